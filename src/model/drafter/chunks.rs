//! The attention of the drafter's anchor blocks in training: the dense mask (the reference),
//! and the chunked layout ([`ChunkPlan`]: chunks of consecutive blocks, each against the context
//! and its own keys, in fused calls of a fixed shape), with the warm-up of its kernels.

use tch::{Device, Kind, Tensor};

use super::attention::context_bucket;
use super::groups::GroupPlan;
use super::{AnchorBatch, Drafter, FrozenHead, TrainAttention};
use crate::model::layers::{attention_with_bias, upload};

/// Chunks per fused attention call of the chunked training attention: a fixed batch size, so
/// that a call's shape depends only on the bucketed context length.
const CHUNKS_PER_CALL: i64 = 8;

/// The attention of one layer's block queries.
#[derive(Clone, Copy)]
pub(super) enum BlockAttention<'a> {
    /// Against [context; all blocks], with an optional boolean mask [B, 1, Q, S + Q].
    Full(Option<&'a Tensor>),
    /// Per chunk of blocks (see [`TrainAttention`]), with the plan's sliding-window masks
    /// where `sliding`.
    Chunked { plan: &'a ChunkPlan, sliding: bool },
    /// In groups of blocks, the context and the own keys apart ([`super::groups`]).
    Grouped(&'a GroupPlan<'a>),
}

/// The blocks a chunked training forward computes: the valid ones, in row order (all of them
/// where none is valid, so that the forward still builds its graph). Padding blocks have no
/// loss weight; leaving them out saves their share of every layer's products.
pub(super) struct KeptBlocks {
    /// Per row, its kept blocks' anchors (ascending, as the batch holds them).
    pub(super) anchors: Vec<Vec<i64>>,
    /// Each kept block's index among the batch's B * N blocks, in order.
    pub(super) index: Vec<i64>,
    /// Whether every block of the batch is kept (the forward's output is then a view).
    pub(super) all: bool,
}

impl KeptBlocks {
    /// From the batch's host anchors and validity, [B * N] each, row-major.
    pub(super) fn of(anchors: &[i64], valid: &[bool], b: i64, n: i64) -> KeptBlocks {
        let total = (b * n).max(0) as usize;
        let known = anchors.len() == total && valid.len() == total;
        let any_valid = known && valid.iter().any(|&v| v);
        let keep = |i: usize| !any_valid || valid[i];
        let mut rows = vec![Vec::new(); b.max(0) as usize];
        let mut index = Vec::with_capacity(total);
        for (r, row) in rows.iter_mut().enumerate() {
            for j in 0..n.max(0) as usize {
                let i = r * n as usize + j;
                if keep(i) {
                    row.push(anchors.get(i).copied().unwrap_or(0));
                    index.push(i as i64);
                }
            }
        }
        KeptBlocks {
            all: index.len() == total,
            anchors: rows,
            index,
        }
    }

    /// Number of kept blocks (M).
    pub(super) fn len(&self) -> i64 {
        self.index.len() as i64
    }

    /// The row of each kept block, and its anchor, in order.
    pub(super) fn rows_and_anchors(&self) -> (Vec<i64>, Vec<i64>) {
        self.anchors
            .iter()
            .enumerate()
            .flat_map(|(r, a)| a.iter().map(move |&a| (r as i64, a)))
            .unzip()
    }
}

/// The layout shared by every layer of one chunked training forward.
///
/// Each row's kept blocks are cut into chunks of C consecutive blocks; the chunks of the batch
/// are ordered chunk-major (chunk 0 of every row that has one, then chunk 1, ...) and go
/// through fused calls of [`CHUNKS_PER_CALL`] entries each, so that a call holds the same
/// chunk of several sequences: its queries see the context only up to their chunk's last
/// anchor, and its keys stop there (bucketed), instead of running over the whole context. With
/// anchors spread evenly over a sequence, the k-th of K chunks needs (k + 1) / K of it. The
/// kept blocks' rows are scattered into the entries' rows once per layer (the slots of a last,
/// partial chunk and the entries filling the last call stay zero) and gathered back after.
pub(super) struct ChunkPlan {
    /// Fused-call entries (E, a multiple of [`CHUNKS_PER_CALL`]).
    pub(super) entries: i64,
    /// Query rows per chunk (C * block).
    pub(super) rows: i64,
    /// The row among the entries' E * rows of each kept query row [M * block] (int64, on the
    /// device).
    pub(super) entry_rows: Tensor,
    /// A permutation of the entries' E * rows rows that sends the kept query rows to their
    /// places 0..M * block and the others after them ([`entry_order`]; int64, on the device).
    pub(super) entry_order: Tensor,
    /// The fused calls, in entry order.
    pub(super) calls: Vec<ChunkCall>,
    /// Whether grouped-query heads must be expanded for a fused kernel to take the call.
    pub(super) expand_kv: std::cell::Cell<Option<bool>>,
}

/// Where the kept blocks of a chunked forward go (host values, see [`ChunkPlan`]).
#[derive(Debug, PartialEq, Eq)]
struct EntryLayout {
    /// The row of each entry [E] (0 for the entries filling the last call).
    seqs: Vec<i64>,
    /// The anchor of each entry's block slots [E * C] (0 for empty slots: they see no
    /// context, only their own all-zero block, so their rows stay finite).
    slot_anchor: Vec<i64>,
    /// Each kept block's slot among the E * C, in kept order.
    block_slot: Vec<i64>,
    /// The context positions each call reads: up to the last anchor of its chunks (a query at
    /// anchor a sees positions p < a), bucketed by [`context_bucket`], at most `s`.
    contexts: Vec<i64>,
}

/// The entry layout of `kept` (per row, its blocks' anchors) in chunks of `cpc` blocks, against
/// `s` context positions.
fn entry_layout(kept: &[Vec<i64>], cpc: i64, s: i64) -> EntryLayout {
    let cpc = cpc.max(1) as usize;
    let per_call = CHUNKS_PER_CALL as usize;
    let chunks: Vec<usize> = kept.iter().map(|a| a.len().div_ceil(cpc)).collect();
    let offsets: Vec<usize> = kept
        .iter()
        .scan(0, |o, a| {
            let start = *o;
            *o += a.len();
            Some(start)
        })
        .collect();
    let most = chunks.iter().copied().max().unwrap_or(0);
    let real: Vec<(usize, usize)> = (0..most)
        .flat_map(|k| (0..kept.len()).map(move |r| (r, k)))
        .filter(|&(r, k)| k < chunks[r])
        .collect();
    let entries = real.len().div_ceil(per_call).max(1) * per_call;
    let mut seqs = vec![0i64; entries];
    let mut slot_anchor = vec![0i64; entries * cpc];
    let mut block_slot = vec![0i64; offsets.last().map_or(0, |o| o + kept[kept.len() - 1].len())];
    let mut last = vec![0i64; entries / per_call];
    for (e, &(r, k)) in real.iter().enumerate() {
        seqs[e] = r as i64;
        for (jj, &a) in kept[r].iter().skip(k * cpc).take(cpc).enumerate() {
            let slot = e * cpc + jj;
            slot_anchor[slot] = a;
            block_slot[offsets[r] + k * cpc + jj] = slot as i64;
            last[e / per_call] = last[e / per_call].max(a);
        }
    }
    let contexts = last
        .into_iter()
        .map(|a| context_bucket(a.max(1)).min(s))
        .collect();
    EntryLayout {
        seqs,
        slot_anchor,
        block_slot,
        contexts,
    }
}

/// One fused call of the chunked training attention: [`CHUNKS_PER_CALL`] entries.
pub(super) struct ChunkCall {
    /// Context positions its keys cover (bucketed, so that the calls' shapes repeat).
    pub(super) context: i64,
    /// The sequence of each entry [CHUNKS_PER_CALL] (int64, on the device).
    pub(super) seqs: Tensor,
    /// Additive mask [CHUNKS_PER_CALL, 1, rows, context + rows] of the compute kind: 0 where
    /// visible, -inf elsewhere (what the fused kernels turn a boolean mask into); its rows are
    /// padded in memory to a multiple of 16 elements so that the memory-efficient kernel takes
    /// it without a copy. Built once, shared by every layer.
    pub(super) bias: Tensor,
    /// The same for the sliding-window layers, where the drafter has any.
    pub(super) sliding_bias: Option<Tensor>,
}

impl Drafter {
    /// Runs one chunked training forward and backward (on zeros; the gradients are reset) per
    /// bucketed context length up to `max_len`, so that the fused attention kernels build their
    /// per-shape plans now instead of during the first steps of training (cuDNN's take tens of
    /// milliseconds each, per thread). Only on CUDA with the chunked attention; returns the
    /// number of context lengths warmed.
    pub(crate) fn warm_up_attention(&self, head: &FrozenHead, max_len: usize) -> usize {
        let c = &self.config;
        let bs = c.block_size;
        let chunked = !matches!(self.train_attention, TrainAttention::Dense);
        if !self.device.is_cuda() || !chunked {
            return 0;
        }
        let dev = self.device;
        let max_len = (max_len as i64).max(bs);
        let mut warmed = 0;
        let mut s = bs;
        loop {
            let len = context_bucket(s);
            let cpc = self
                .train_attention
                .blocks_per_chunk(bs, len, c.num_attention_heads, c.num_key_value_heads)
                .unwrap_or(1);
            // one sequence, one call's worth of chunks, every block at the last position (so
            // that the call reads the whole context: the shape of the calls that read `len`);
            // in the grouped form a group of each size
            let n = match self.train_attention.blocks_per_group() {
                Some(g) => 2 * g - 1,
                None => cpc * CHUNKS_PER_CALL,
            };
            let features = Tensor::zeros([1, len, self.fc.size()[1]], (self.kind, dev));
            let batch = AnchorBatch {
                input_ids: Tensor::zeros([1, len], (Kind::Int64, Device::Cpu)),
                anchors: Tensor::full([1, n], len - 1, (Kind::Int64, Device::Cpu)),
                valid: Tensor::ones([1, n], (Kind::Bool, Device::Cpu)),
            };
            self.forward_train(head, &features, &batch)
                .sum(Kind::Float)
                .backward();
            warmed += 1;
            if len >= max_len {
                break;
            }
            s = len + 1;
        }
        for (_, p) in self.named_parameters() {
            crate::aten_ext::clear_grad(p);
        }
        warmed
    }

    /// The chunk layout and the additive masks of a chunked training forward over the `kept`
    /// blocks: `s` context positions, `per_chunk` blocks per chunk, `window` the sliding
    /// layers' window where the drafter has any. The entries are filled up to whole fused
    /// calls of [`CHUNKS_PER_CALL`].
    pub(super) fn chunk_plan(
        &self,
        kept: &KeptBlocks,
        s: i64,
        per_chunk: i64,
        window: Option<i64>,
    ) -> ChunkPlan {
        let bs = self.config.block_size;
        let dev = self.device;
        let cpc = per_chunk.max(1);
        let rows = cpc * bs;
        let layout = entry_layout(&kept.anchors, cpc, s);
        let entries = layout.seqs.len() as i64;
        // each kept query row's row among the entries' rows
        let entry_rows: Vec<i64> = layout
            .block_slot
            .iter()
            .flat_map(|&slot| (0..bs).map(move |t| slot * bs + t))
            .collect();
        let order = entry_order(&entry_rows, entries * rows);
        // one upload (the step's only host-to-device copy here), the parts views of it
        let host: Vec<i64> = [&layout.seqs, &layout.slot_anchor, &entry_rows, &order]
            .into_iter()
            .flatten()
            .copied()
            .collect();
        let all = upload(&Tensor::from_slice(&host), dev);
        let all_seqs = all.narrow(0, 0, entries);
        let slot_anchor = all.narrow(0, entries, entries * cpc);
        let kept_rows = entry_rows.len() as i64;
        let entry_rows = all.narrow(0, entries * (1 + cpc), kept_rows);
        let entry_order = all.narrow(0, entries * (1 + cpc) + kept_rows, order.len() as i64);
        // [E, rows]: each entry row's anchor
        let entry_anchor = slot_anchor
            .view([entries, cpc, 1])
            .expand([entries, cpc, bs], false)
            .reshape([entries, rows]);
        let block_of = Tensor::arange(rows, (Kind::Int64, dev)).divide_scalar_mode(bs, "floor");
        let sees_block = block_of
            .unsqueeze(1)
            .eq_tensor(&block_of.unsqueeze(0))
            .unsqueeze(0)
            .expand([CHUNKS_PER_CALL, rows, rows], false);
        // a query row's slot in its block, [1, rows, 1]
        let slot = Tensor::arange(rows, (Kind::Int64, dev))
            .remainder(bs)
            .view([1, rows, 1]);
        let calls = layout
            .contexts
            .iter()
            .enumerate()
            .map(|(call, &context)| {
                let first = call as i64 * CHUNKS_PER_CALL;
                let query_anchor = entry_anchor.narrow(0, first, CHUNKS_PER_CALL);
                let ctx_pos = Tensor::arange(context, (Kind::Int64, dev)).view([1, 1, context]);
                let query_anchor = query_anchor.unsqueeze(-1); // [calls, rows, 1]
                let sees_ctx = ctx_pos.lt_tensor(&query_anchor); // [calls, rows, context]
                let bias = self.additive_mask(&Tensor::cat(&[&sees_ctx, &sees_block], -1));
                let sliding_bias = window.map(|w| {
                    let (ctx, own) = window_visibility(&ctx_pos, &query_anchor, &slot, bs, w);
                    let own = sees_block.logical_and(&own.repeat([cpc, cpc]));
                    self.additive_mask(&Tensor::cat(&[sees_ctx.logical_and(&ctx), own], -1))
                });
                ChunkCall {
                    context,
                    seqs: all_seqs.narrow(0, first, CHUNKS_PER_CALL),
                    bias,
                    sliding_bias,
                }
            })
            .collect();
        ChunkPlan {
            entries,
            rows,
            entry_rows,
            entry_order,
            calls,
            expand_kv: std::cell::Cell::new(None),
        }
    }

    /// The additive mask of a call [CHUNKS_PER_CALL, 1, rows, keys] from where its queries see
    /// `sees` [CHUNKS_PER_CALL, rows, keys] (0 where visible, -inf elsewhere), its rows padded
    /// in memory to a multiple of 16 elements so that the memory-efficient kernel takes it
    /// without a copy.
    pub(super) fn additive_mask(&self, sees: &Tensor) -> Tensor {
        let (calls, rows, keys) = sees.size3().unwrap_or((0, 0, 0));
        let padded = (keys + 15) / 16 * 16;
        let mut bias =
            Tensor::zeros([calls, 1, rows, padded], (self.kind, sees.device())).narrow(3, 0, keys);
        let _ = bias.masked_fill_(&sees.logical_not().unsqueeze(1), f64::NEG_INFINITY);
        bias
    }
}

/// The sliding-window part of the visibility (see [`crate::model::drafter_layout`]): a query in
/// slot k of the block anchored at a (position a + k) sees context positions p > a + k - w, and
/// the slots k' of its block with k - w < k' <= k. `ctx_pos` [1, 1, C] context positions,
/// `anchor` [.., Q, 1] each query's anchor, `slot` [1, Q, 1] each query's slot. Returns the
/// context part [.., Q, C] and the slot part [bs, bs] (query slot, key slot) of one block.
fn window_visibility(
    ctx_pos: &Tensor,
    anchor: &Tensor,
    slot: &Tensor,
    bs: i64,
    window: i64,
) -> (Tensor, Tensor) {
    let ctx = ctx_pos.gt_tensor(&(anchor + slot - window));
    let k = Tensor::arange(bs, (Kind::Int64, slot.device()));
    let behind = k.view([bs, 1]) - k.view([1, bs]); // query slot - key slot
    (ctx, behind.ge(0).logical_and(&behind.lt(window)))
}

/// The dense training mask [B, 1, N*bs, S + N*bs] (true = visible): block j's queries see
/// context positions p < a_j and their own block; with a sliding `window`, only the keys of
/// [`window_visibility`] among them.
pub(super) fn dense_block_mask(anchors: &Tensor, s: i64, bs: i64, window: Option<i64>) -> Tensor {
    let dev = anchors.device();
    let (b, n) = anchors.size2().unwrap_or((0, 0));
    let query_anchor = anchors
        .unsqueeze(-1)
        .expand([b, n, bs], false)
        .reshape([b, n * bs, 1]);
    let ctx_pos = Tensor::arange(s, (Kind::Int64, dev)).view([1, 1, s]);
    let sees_ctx = ctx_pos.lt_tensor(&query_anchor); // [B, N*bs, S]
    let block_of = Tensor::arange(n * bs, (Kind::Int64, dev)).divide_scalar_mode(bs, "floor");
    let sees_block = block_of
        .unsqueeze(1)
        .eq_tensor(&block_of.unsqueeze(0))
        .unsqueeze(0)
        .expand([b, n * bs, n * bs], false);
    let (sees_ctx, sees_block) = match window {
        None => (sees_ctx, sees_block),
        Some(w) => {
            let slot = Tensor::arange(n * bs, (Kind::Int64, dev))
                .remainder(bs)
                .view([1, n * bs, 1]);
            let (ctx, own) = window_visibility(&ctx_pos, &query_anchor, &slot, bs, w);
            let own = sees_block.logical_and(&own.repeat([n, n]));
            (sees_ctx.logical_and(&ctx), own)
        }
    };
    Tensor::cat(&[sees_ctx, sees_block], -1).unsqueeze(1)
}

/// Chunked block attention of one layer over the kept blocks. `q` [1, heads, M*bs, d] (their
/// queries, rotated), `ctx` keys/values [B, kv_heads, S, d], `block` keys/values [1, kv_heads,
/// M*bs, d]. Each chunk of `plan.rows` query rows attends over [the context its call covers;
/// its own rows' keys] with the call's mask; the chunks go through the plan's fused calls along
/// the batch axis. Returns the attention output as rows [1, M*bs, heads * d] (before `o_proj`).
pub(super) fn chunked_attention(
    q: &Tensor,
    ctx: (&Tensor, &Tensor),
    block: (&Tensor, &Tensor),
    plan: &ChunkPlan,
    sliding: bool,
) -> Tensor {
    let (_, heads, _, d) = q.size4().unwrap_or((0, 0, 0, 0));
    let kv_heads = ctx.0.size()[1];
    let (entries, rows) = (plan.entries, plan.rows);
    // [1, h, M*bs, d] -> the entries' rows [E, rows, h, d], token-major (the layout the fused
    // kernels read best), the rows of no block zero; cut into the calls' entries (one split:
    // its backward pass is one concatenation)
    let by_entry = |x: &Tensor, h: i64| {
        let tokens = x.squeeze_dim(0).transpose(0, 1);
        // in place: the out-of-place form would copy the zeros once more
        let mut rows_of = Tensor::zeros([entries * rows, h, d], (x.kind(), x.device()));
        let _ = rows_of.index_copy_(0, &plan.entry_rows, &tokens);
        rows_of
            .view([entries, rows, h, d])
            .split(CHUNKS_PER_CALL, 0)
    };
    let (qs, kb, vb) = (
        by_entry(q, heads),
        by_entry(block.0, kv_heads),
        by_entry(block.1, kv_heads),
    );
    // token-major context [B, S, kv_heads, d]
    let (ck, cv) = (ctx.0.transpose(1, 2), ctx.1.transpose(1, 2));
    let width = heads * d;
    let parts: Vec<Tensor> = plan
        .calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let q = qs[i].transpose(1, 2);
            let bias = match (sliding, &call.sliding_bias) {
                (true, Some(sliding)) => sliding,
                _ => &call.bias,
            };
            // [the call's context; its chunks' own keys], [calls, kv_heads, context + rows, d]
            let keys = |c: &Tensor, own: &Tensor| {
                let c = c.narrow(1, 0, call.context).index_select(0, &call.seqs);
                Tensor::cat(&[c, own.shallow_clone()], 1).transpose(1, 2)
            };
            let (k, v) = (keys(&ck, &kb[i]), keys(&cv, &vb[i]));
            let expand = match plan.expand_kv.get() {
                Some(e) => e,
                None => {
                    let e = must_expand_kv(&q, &k, &v, bias);
                    plan.expand_kv.set(Some(e));
                    e
                }
            };
            let (k, v) = if expand {
                let g = heads / kv_heads;
                (
                    k.repeat_interleave_self_int(g, 1, None),
                    v.repeat_interleave_self_int(g, 1, None),
                )
            } else {
                (k, v)
            };
            // token-major rows [entries, rows, heads * d]: a view where the kernel wrote its
            // output token-major, as the fused kernels do
            attention_with_bias(&q, &k, &v, bias)
                .transpose(1, 2)
                .reshape([CHUNKS_PER_CALL * rows, width])
        })
        .collect();
    // The kept rows gathered back, as a scatter by the permutation `entry_order` followed by
    // a narrow: its backward pass is a gather of the gradient, where `index_select`'s would
    // add into zeros with atomics (bf16 ones are slow); every row is written, so `empty`.
    let all = Tensor::cat(&parts, 0);
    let kept_rows = plan.entry_rows.size()[0];
    let mut ordered = all.empty_like();
    let _ = ordered.index_copy_(0, &plan.entry_order, &all);
    ordered.narrow(0, 0, kept_rows).unsqueeze(0)
}

/// A permutation of `total` entry rows that sends `entry_rows[i]` to `i` and the rows not
/// listed to `entry_rows.len()..`, in their order: `out.index_copy_(0, order, all)` puts the
/// kept rows first. `entry_rows` are distinct and below `total`.
fn entry_order(entry_rows: &[i64], total: i64) -> Vec<i64> {
    let mut order = vec![-1; total.max(0) as usize];
    for (i, &row) in entry_rows.iter().enumerate() {
        if let Some(o) = order.get_mut(row as usize) {
            *o = i as i64;
        }
    }
    let rest = order.iter_mut().filter(|o| **o < 0);
    for (next, o) in (entry_rows.len() as i64..).zip(rest) {
        *o = next;
    }
    order
}

/// Whether grouped-query heads have to be expanded for a fused kernel: libtorch picks its
/// kernel per call (cuDNN, flash, memory-efficient, math); flash takes no mask, and where no
/// fused kernel takes grouped-query heads with a mask it falls back to the math kernel, which
/// materialises every score. Expanding the key/value heads costs memory but keeps a fused
/// kernel; done only when the grouped call would get the math kernel and the expanded one a
/// fused kernel.
fn must_expand_kv(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> bool {
    const MATH: i64 = 0;
    if q.size()[1] == k.size()[1] {
        return false;
    }
    let grouped = Tensor::f_internal_fused_sdp_choice(q, k, v, Some(bias), 0.0, false, None, true)
        .unwrap_or(MATH);
    if grouped != MATH {
        return false;
    }
    // The choice depends on shapes, dtypes, devices and alignment, not on values: ask for a
    // broadcast stand-in instead of copying the keys.
    let (n, _, l, d) = k.size4().unwrap_or((0, 0, 0, 0));
    let ke =
        Tensor::zeros([1, 1, 1, d], (k.kind(), k.device())).expand([n, q.size()[1], l, d], false);
    let expanded =
        Tensor::f_internal_fused_sdp_choice(q, &ke, &ke, Some(bias), 0.0, false, None, false)
            .unwrap_or(MATH);
    expanded != MATH
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_blocks_are_the_valid_ones_or_all_where_none_is() {
        let anchors = [3, 9, 0, 5, 0, 0];
        let valid = [true, true, false, true, false, false];
        let kept = KeptBlocks::of(&anchors, &valid, 2, 3);
        assert_eq!(kept.anchors, vec![vec![3, 9], vec![5]]);
        assert_eq!(kept.index, vec![0, 1, 3]);
        assert!(!kept.all);
        assert_eq!(kept.rows_and_anchors(), (vec![0, 0, 1], vec![3, 9, 5]));
        let none = KeptBlocks::of(&anchors, &[false; 6], 2, 3);
        assert!(none.all);
        assert_eq!(none.len(), 6);
        assert!(KeptBlocks::of(&anchors, &[true; 6], 2, 3).all);
    }

    #[test]
    fn the_entry_order_puts_the_kept_rows_first_in_their_order() {
        let order = entry_order(&[5, 1, 6], 8);
        assert_eq!(order, vec![3, 1, 4, 5, 6, 0, 2, 7]);
        // what the attention's gather does with it: kept rows 5, 1, 6 come out first
        let all = Tensor::arange(8, (Kind::Int64, Device::Cpu)) * 10;
        let mut out = all.empty_like();
        let _ = out.index_copy_(0, &Tensor::from_slice(&order), &all);
        assert_eq!(
            Vec::<i64>::try_from(out.narrow(0, 0, 3)).ok(),
            Some(vec![50, 10, 60])
        );
        assert_eq!(entry_order(&[], 3), vec![0, 1, 2]);
    }

    #[test]
    fn a_call_reads_the_context_up_to_its_last_anchor() {
        // two sequences of 40 anchors 15 apart (0..=585), 4 blocks per chunk: 10 chunks each,
        // 20 entries chunk-major (chunks 0-3 of both sequences, then 4-7, then 8-9), filled to 24
        let rows: Vec<Vec<i64>> = (0..2).map(|_| (0..40).map(|j| j * 15).collect()).collect();
        let layout = entry_layout(&rows, 4, 640);
        // last anchors 225, 465, 585 -> buckets 256, 512, 640
        assert_eq!(layout.contexts, vec![256, 512, 640]);
        let mut seqs = [0, 1].repeat(10);
        seqs.extend([0; 4]);
        assert_eq!(layout.seqs, seqs);
        // block 5 of sequence 1 is the second block of chunk 1 of sequence 1: entry 3
        assert_eq!(layout.block_slot[40 + 5], 3 * 4 + 1);
        assert_eq!(layout.slot_anchor[3 * 4 + 1], 75);
        // one sequence whose anchors all lie early: every call reads little
        let early: Vec<i64> = (0..16).collect();
        assert_eq!(entry_layout(&[early], 2, 2048).contexts, vec![128]);
    }

    #[test]
    fn rows_of_unequal_block_counts_fill_only_their_own_chunks() {
        // 5 and 2 blocks, 2 per chunk: chunks (0,0) (1,0) (0,1) (0,2), filled to 8 entries
        let kept = vec![vec![10, 20, 30, 40, 50], vec![7, 8]];
        let layout = entry_layout(&kept, 2, 4096);
        assert_eq!(layout.seqs, vec![0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(layout.block_slot, vec![0, 1, 4, 5, 6, 2, 3]);
        let mut anchors = vec![10, 20, 7, 8, 30, 40, 50, 0];
        anchors.extend([0; 8]);
        assert_eq!(layout.slot_anchor, anchors);
        assert_eq!(layout.contexts, vec![context_bucket(50)]);
        // every kept block has a slot of its own
        let mut slots = layout.block_slot.clone();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), 7);
    }
}
