//! The attention of the drafter's anchor blocks in training: the dense mask (the reference),
//! and the chunked layout ([`ChunkPlan`]: chunks of consecutive blocks, each against the context
//! and its own keys, in fused calls of a fixed shape), with the warm-up of its kernels.

use tch::{Device, Kind, Tensor};

use super::attention::context_bucket;
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
}

/// The layout shared by every layer of one chunked training forward.
///
/// The chunks of the batch are ordered chunk-major (entry `k * B + r` is chunk k of sequence r)
/// and go through fused calls of [`CHUNKS_PER_CALL`] entries each, so that a call holds the
/// same chunk of several sequences: its queries see the context only up to their chunk's
/// last anchor, and its keys stop there (bucketed), instead of running over the whole context.
/// With anchors spread evenly over a sequence, the k-th of K chunks needs (k + 1) / K of it.
pub(super) struct ChunkPlan {
    /// Chunks per sequence (K).
    pub(super) chunks: i64,
    /// Query rows per chunk (C * block).
    pub(super) rows: i64,
    /// The fused calls, in entry order.
    pub(super) calls: Vec<ChunkCall>,
    /// Whether grouped-query heads must be expanded for a fused kernel to take the call.
    pub(super) expand_kv: std::cell::Cell<Option<bool>>,
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
        let chunked = matches!(self.train_attention, TrainAttention::Chunked { .. });
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
            // that the call reads the whole context: the shape of the calls that read `len`)
            let n = cpc * CHUNKS_PER_CALL;
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

    /// The chunk layout and the additive masks of a chunked training forward: `anchors` [B, N]
    /// on the device and `host_anchors` the same on the host (they set how much context each
    /// call reads; empty: all of it), `s` context positions, `per_chunk` blocks per chunk,
    /// `window` the sliding layers' window where the drafter has any. The chunks per sequence
    /// are rounded up so that the batch's chunks fill whole fused calls of [`CHUNKS_PER_CALL`].
    pub(super) fn chunk_plan(
        &self,
        anchors: &Tensor,
        host_anchors: &[i64],
        s: i64,
        per_chunk: i64,
        window: Option<i64>,
    ) -> ChunkPlan {
        let bs = self.config.block_size;
        let dev = self.device;
        let (b, n) = anchors.size2().unwrap_or((0, 0));
        let cpc = per_chunk.max(1);
        let multiple = CHUNKS_PER_CALL / gcd(b.max(1), CHUNKS_PER_CALL);
        let chunks = ((n + cpc - 1) / cpc + multiple - 1) / multiple * multiple;
        let pad = chunks * cpc - n;
        let rows = cpc * bs;
        // Slots added to fill the last chunk get anchor 0: they see no context, only their own
        // (all-zero) block, so their rows stay finite; their outputs are dropped.
        let anchors = if pad > 0 {
            anchors.constant_pad_nd([0, pad])
        } else {
            anchors.shallow_clone()
        };
        // [K * B, rows]: each entry's query anchors, chunk-major
        let entry_anchor = anchors
            .reshape([b, chunks, cpc])
            .transpose(0, 1)
            .reshape([chunks * b, cpc, 1])
            .expand([chunks * b, cpc, bs], false)
            .reshape([chunks * b, rows]);
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
        let layout = call_layout(host_anchors, b, n, cpc, chunks, s);
        // every call's entry sequences in one upload (the step's only host-to-device copy
        // here), each call's a view of it
        let all_seqs: Vec<i64> = layout.iter().flat_map(|(_, seqs)| seqs).copied().collect();
        let all_seqs = upload(&Tensor::from_slice(&all_seqs), dev);
        let calls = layout
            .into_iter()
            .enumerate()
            .map(|(call, (context, _))| {
                let query_anchor =
                    entry_anchor.narrow(0, call as i64 * CHUNKS_PER_CALL, CHUNKS_PER_CALL);
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
                    seqs: all_seqs.narrow(0, call as i64 * CHUNKS_PER_CALL, CHUNKS_PER_CALL),
                    bias,
                    sliding_bias,
                }
            })
            .collect();
        ChunkPlan {
            chunks,
            rows,
            calls,
            expand_kv: std::cell::Cell::new(None),
        }
    }

    /// The additive mask of a call [CHUNKS_PER_CALL, 1, rows, keys] from where its queries see
    /// `sees` [CHUNKS_PER_CALL, rows, keys] (0 where visible, -inf elsewhere), its rows padded
    /// in memory to a multiple of 16 elements so that the memory-efficient kernel takes it
    /// without a copy.
    fn additive_mask(&self, sees: &Tensor) -> Tensor {
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

/// Per fused call of a chunked forward (`b` sequences of `n` anchors, `cpc` blocks per chunk,
/// `chunks` chunks per sequence, entries chunk-major): the context positions it reads and the
/// sequence of each of its entries. A call reads the context up to the last anchor of its
/// chunks (a query at anchor a sees positions p < a), bucketed by [`context_bucket`] and at
/// most `s`; all of it when `host_anchors` does not hold the b * n anchors.
fn call_layout(
    host_anchors: &[i64],
    b: i64,
    n: i64,
    cpc: i64,
    chunks: i64,
    s: i64,
) -> Vec<(i64, Vec<i64>)> {
    let known = host_anchors.len() as i64 == b * n;
    (0..chunks * b / CHUNKS_PER_CALL)
        .map(|call| {
            let entries: Vec<(i64, i64)> = (call * CHUNKS_PER_CALL..(call + 1) * CHUNKS_PER_CALL)
                .map(|e| (e / b, e % b))
                .collect();
            let last = entries
                .iter()
                .flat_map(|&(k, r)| {
                    (k * cpc..((k + 1) * cpc).min(n))
                        .filter_map(move |j| host_anchors.get((r * n + j) as usize))
                })
                .copied()
                .max()
                .unwrap_or(0);
            let context = if known {
                context_bucket(last.max(1)).min(s)
            } else {
                s
            };
            (context, entries.iter().map(|&(_, r)| r).collect())
        })
        .collect()
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

/// Chunked block attention of one layer. `q` [B, heads, N*bs, d] (block queries, rotated),
/// `ctx` keys/values [B, kv_heads, S, d], `block` keys/values [B, kv_heads, N*bs, d]. Each
/// chunk of `plan.rows` consecutive query rows attends over [the context its call covers; its
/// own rows' keys] with the call's mask; the chunks go through the plan's fused calls along the
/// batch axis. Returns the attention output as rows [B, N*bs, heads * d] (before `o_proj`).
pub(super) fn chunked_attention(
    q: &Tensor,
    ctx: (&Tensor, &Tensor),
    block: (&Tensor, &Tensor),
    plan: &ChunkPlan,
    sliding: bool,
) -> Tensor {
    let (b, heads, len, d) = q.size4().unwrap_or((0, 0, 0, 0));
    let kv_heads = ctx.0.size()[1];
    let (chunks, rows) = (plan.chunks, plan.rows);
    let pad = chunks * rows - len;
    // [B, h, L, d] -> [K * B, rows, h, d]: chunk-major entries, token-major (the layout the
    // fused kernels read best), cut into the calls' entries (one split: its backward pass is
    // one concatenation, where a narrow per call would fill and add a whole-batch gradient)
    let by_entry = |x: &Tensor, h: i64| {
        let x = x.transpose(1, 2);
        let x = if pad > 0 {
            x.constant_pad_nd([0, 0, 0, 0, 0, pad])
        } else {
            x
        };
        x.reshape([b, chunks, rows, h, d])
            .transpose(0, 1)
            .reshape([chunks * b, rows, h, d])
            .split(CHUNKS_PER_CALL, 0)
    };
    let (qs, kb, vb) = (
        by_entry(q, heads),
        by_entry(block.0, kv_heads),
        by_entry(block.1, kv_heads),
    );
    // token-major context [B, S, kv_heads, d]
    let (ck, cv) = (ctx.0.transpose(1, 2), ctx.1.transpose(1, 2));
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
            attention_with_bias(&q, &k, &v, bias)
        })
        .collect();
    let o = sequence_major(&parts, b, chunks, rows, heads * d);
    if pad > 0 {
        o.narrow(1, 0, len)
    } else {
        o
    }
}

/// The calls' outputs `parts` (each [CHUNKS_PER_CALL, heads, rows, d], entries chunk-major) as
/// rows of the sequences [B, K * rows, width]. Where B divides a call's entries (each call then
/// holds whole chunks of every sequence) one copy does it: each call's entries regrouped by
/// sequence (views), concatenated along the chunks. Otherwise the chunk-major concatenation is
/// reordered by a second copy. (Concatenating first and reordering after took three copies of
/// the whole attention output, forward and backward.)
fn sequence_major(parts: &[Tensor], b: i64, chunks: i64, rows: i64, width: i64) -> Tensor {
    // token-major rows [entries, rows, heads * d]: a view where the kernel wrote its output
    // token-major, as the fused kernels do
    let token_major = |p: &Tensor| {
        let entries = p.size()[0];
        p.transpose(1, 2).reshape([entries, rows, width])
    };
    if b > 0 && CHUNKS_PER_CALL % b == 0 {
        let per_call = CHUNKS_PER_CALL / b;
        let by_sequence: Vec<Tensor> = parts
            .iter()
            .map(|p| {
                token_major(p)
                    .view([per_call, b, rows, width])
                    .transpose(0, 1)
            })
            .collect();
        Tensor::cat(&by_sequence, 1).view([b, chunks * rows, width])
    } else {
        let all: Vec<Tensor> = parts.iter().map(token_major).collect();
        Tensor::cat(&all, 0)
            .view([chunks, b, rows, width])
            .transpose(0, 1)
            .reshape([b, chunks * rows, width])
    }
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

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reordering of the calls' outputs gives what concatenating them and reordering the
    /// whole did (the earlier formulation), in values and gradients, with B dividing a call's
    /// entries or not, from outputs laid out head-major (the math kernel's) or token-major
    /// (the fused kernels').
    #[test]
    fn the_calls_outputs_reorder_as_before_in_values_and_gradients() {
        let (heads, rows, d) = (3, 4, 2);
        for (b, chunks) in [(1, 8), (2, 4), (2, 8), (3, 8), (8, 2), (5, 8)] {
            for token_major in [false, true] {
                let calls = chunks * b / CHUNKS_PER_CALL;
                let shape = [calls * CHUNKS_PER_CALL, heads, rows, d];
                let x = Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let x_in = if token_major {
                    x.transpose(1, 2).contiguous().transpose(1, 2)
                } else {
                    x.shallow_clone()
                };
                let parts = x_in.split(CHUNKS_PER_CALL, 0);
                let before = Tensor::cat(&parts, 0)
                    .transpose(1, 2)
                    .reshape([chunks, b, rows, heads * d])
                    .transpose(0, 1)
                    .reshape([b, chunks * rows, heads * d]);
                let now = sequence_major(&parts, b, chunks, rows, heads * d);
                assert!(before.equal(&now), "b {b}, chunks {chunks}");
                let probe = Tensor::randn(now.size(), (Kind::Float, Device::Cpu));
                let grad = |y: &Tensor| {
                    let g =
                        Tensor::run_backward(&[(y * &probe).sum(Kind::Float)], &[&x], true, false);
                    g[0].shallow_clone()
                };
                assert!(grad(&before).equal(&grad(&now)), "b {b}, chunks {chunks}");
            }
        }
    }

    #[test]
    fn a_call_reads_the_context_up_to_its_last_anchor() {
        // two sequences of 40 anchors 15 apart (0..=585), 4 blocks per chunk: 10 chunks, 12
        // with the padding to whole calls of 8 entries (chunk-major: chunks 0-3 of both
        // sequences, then 4-7, then 8-11)
        let anchors: Vec<i64> = (0..2).flat_map(|_| (0..40).map(|j| j * 15)).collect();
        let layout = call_layout(&anchors, 2, 40, 4, 12, 640);
        let contexts: Vec<i64> = layout.iter().map(|(c, _)| *c).collect();
        // last anchors 225, 465, 585 -> buckets 256, 512, 640
        assert_eq!(contexts, vec![256, 512, 640]);
        assert!(layout
            .iter()
            .all(|(_, seqs)| seqs == &[0, 1, 0, 1, 0, 1, 0, 1]));
        // one sequence whose anchors all lie early: every call reads little
        let early: Vec<i64> = (0..16).collect();
        assert_eq!(
            call_layout(&early, 1, 16, 2, 8, 2048),
            vec![(128, vec![0; 8])]
        );
        // anchors not known on the host: the whole context
        assert_eq!(
            call_layout(&[], 1, 16, 2, 8, 2048),
            vec![(2048, vec![0; 8])]
        );
    }
}
