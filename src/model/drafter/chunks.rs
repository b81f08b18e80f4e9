//! The attention of the drafter's anchor blocks in training: the dense mask (the reference),
//! and the chunked layout ([`ChunkPlan`]: chunks of consecutive blocks, each against the context
//! and its own keys, in fused calls of a fixed shape), with the warm-up of its kernels.

use tch::{Device, Kind, Tensor};

use super::attention::context_bucket;
use super::{AnchorBatch, Drafter, FrozenHead, TrainAttention};
use crate::model::layers::attention_with_bias;

/// Chunks per fused attention call of the chunked training attention: a fixed batch size, so
/// that a call's shape depends only on the bucketed context length.
const CHUNKS_PER_CALL: i64 = 8;

/// The attention of one layer's block queries.
#[derive(Clone, Copy)]
pub(super) enum BlockAttention<'a> {
    /// Against [context; all blocks], with an optional boolean mask [B, 1, Q, S + Q].
    Full(Option<&'a Tensor>),
    /// Per chunk of blocks (see [`TrainAttention`]).
    Chunked(&'a ChunkPlan),
}

/// The layout shared by every layer of one chunked training forward.
pub(super) struct ChunkPlan {
    /// Chunks per sequence (K).
    pub(super) chunks: i64,
    /// Query rows per chunk (C * block).
    pub(super) rows: i64,
    /// Additive mask [batch * K, 1, rows, S + rows] of the compute kind: 0 where visible,
    /// -inf elsewhere (what the fused kernels turn a boolean mask into); its rows are
    /// padded in memory to a multiple of 16 elements so that the memory-efficient kernel
    /// takes it without a copy. Built once, shared by every layer (and saved once for the
    /// backward pass instead of once per layer).
    pub(super) bias: Tensor,
    /// Whether grouped-query heads must be expanded for a fused kernel to take the call.
    pub(super) expand_kv: std::cell::Cell<Option<bool>>,
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
            // one sequence, one call's worth of chunks, every block at anchor 0
            let n = cpc * CHUNKS_PER_CALL;
            let features = Tensor::zeros([1, len, self.fc.size()[1]], (self.kind, dev));
            let batch = AnchorBatch {
                input_ids: Tensor::zeros([1, len], (Kind::Int64, Device::Cpu)),
                anchors: Tensor::zeros([1, n], (Kind::Int64, Device::Cpu)),
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

    /// The chunk layout and the additive mask of a chunked training forward: `anchors` [B, N]
    /// on the device, `s` context positions, `per_chunk` blocks per chunk. The chunks per
    /// sequence are rounded up so that the batch's chunks fill whole fused calls of
    /// [`CHUNKS_PER_CALL`].
    pub(super) fn chunk_plan(&self, anchors: &Tensor, s: i64, per_chunk: i64) -> ChunkPlan {
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
        let query_anchor = anchors
            .reshape([b * chunks, cpc, 1])
            .expand([b * chunks, cpc, bs], false)
            .reshape([b * chunks, rows]);
        let sees_ctx = Tensor::arange(s, (Kind::Int64, dev))
            .view([1, 1, s])
            .lt_tensor(&query_anchor.unsqueeze(-1)); // [B*K, rows, S]
        let block_of = Tensor::arange(rows, (Kind::Int64, dev)).divide_scalar_mode(bs, "floor");
        let sees_block = block_of
            .unsqueeze(1)
            .eq_tensor(&block_of.unsqueeze(0))
            .unsqueeze(0)
            .expand([b * chunks, rows, rows], false);
        let hidden = Tensor::cat(&[sees_ctx, sees_block], -1)
            .logical_not()
            .unsqueeze(1); // [B*K, 1, rows, S + rows]
        let keys = s + rows;
        let padded = (keys + 15) / 16 * 16;
        let mut bias =
            Tensor::zeros([b * chunks, 1, rows, padded], (self.kind, dev)).narrow(3, 0, keys);
        let _ = bias.masked_fill_(&hidden, f64::NEG_INFINITY);
        ChunkPlan {
            chunks,
            rows,
            bias,
            expand_kv: std::cell::Cell::new(None),
        }
    }
}

/// The dense training mask [B, 1, N*bs, S + N*bs] (true = visible): block j's queries see
/// context positions p < a_j and their own block.
pub(super) fn dense_block_mask(anchors: &Tensor, s: i64, bs: i64) -> Tensor {
    let dev = anchors.device();
    let (b, n) = anchors.size2().unwrap_or((0, 0));
    let query_anchor = anchors
        .unsqueeze(-1)
        .expand([b, n, bs], false)
        .reshape([b, n * bs]);
    let sees_ctx = Tensor::arange(s, (Kind::Int64, dev))
        .view([1, 1, s])
        .lt_tensor(&query_anchor.unsqueeze(-1)); // [B, N*bs, S]
    let block_of = Tensor::arange(n * bs, (Kind::Int64, dev)).divide_scalar_mode(bs, "floor");
    let sees_block = block_of
        .unsqueeze(1)
        .eq_tensor(&block_of.unsqueeze(0))
        .unsqueeze(0)
        .expand([b, n * bs, n * bs], false);
    Tensor::cat(&[sees_ctx, sees_block], -1).unsqueeze(1)
}

/// Chunked block attention of one layer. `q` [B, heads, N*bs, d] (block queries, rotated),
/// `ctx` keys/values [B, kv_heads, S, d], `block` keys/values [B, kv_heads, N*bs, d]. Each
/// chunk of `plan.rows` consecutive query rows attends over [context; its own rows' keys]
/// with `plan.bias`; all chunks of the batch go through one fused call along the batch axis.
/// Returns the attention output as rows [B, N*bs, heads * d] (before `o_proj`).
pub(super) fn chunked_attention(
    q: &Tensor,
    ctx: (&Tensor, &Tensor),
    block: (&Tensor, &Tensor),
    plan: &ChunkPlan,
) -> Tensor {
    let (b, heads, len, d) = q.size4().unwrap_or((0, 0, 0, 0));
    let (kv_heads, s) = (ctx.0.size()[1], ctx.0.size()[2]);
    let (chunks, rows) = (plan.chunks, plan.rows);
    let pad = chunks * rows - len;
    // [B, h, L, d] -> [B, K, rows, h, d] (token-major, the layout the fused kernels read best)
    let by_chunk = |x: &Tensor, h: i64| {
        let x = x.transpose(1, 2);
        let x = if pad > 0 {
            x.constant_pad_nd([0, 0, 0, 0, 0, pad])
        } else {
            x
        };
        x.reshape([b, chunks, rows, h, d])
    };
    let q = by_chunk(q, heads)
        .view([b * chunks, rows, heads, d])
        .transpose(1, 2);
    // [context; the chunk's own keys]: the context is copied once per chunk (the kernels take
    // one key tensor per batch entry).
    let keys = |c: &Tensor, x: &Tensor| {
        let c = c
            .transpose(1, 2)
            .unsqueeze(1)
            .expand([b, chunks, s, kv_heads, d], false);
        Tensor::cat(&[c, by_chunk(x, kv_heads)], 2)
            .view([b * chunks, s + rows, kv_heads, d])
            .transpose(1, 2)
    };
    let k = keys(ctx.0, block.0);
    let v = keys(ctx.1, block.1);
    let expand = match plan.expand_kv.get() {
        Some(e) => e,
        None => {
            let e = must_expand_kv(&q, &k, &v, &plan.bias);
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
    // [B*K, heads, rows, d], in calls of CHUNKS_PER_CALL chunks (B*K is a multiple of it)
    let calls = (b * chunks / CHUNKS_PER_CALL).max(1);
    let per_call = b * chunks / calls;
    let o = if calls == 1 {
        attention_with_bias(&q, &k, &v, &plan.bias)
    } else {
        let part = |t: &Tensor, i: i64| t.narrow(0, i * per_call, per_call);
        let parts: Vec<Tensor> = (0..calls)
            .map(|i| {
                attention_with_bias(
                    &part(&q, i),
                    &part(&k, i),
                    &part(&v, i),
                    &part(&plan.bias, i),
                )
            })
            .collect();
        Tensor::cat(&parts, 0)
    };
    let o = o.transpose(1, 2).reshape([b, chunks * rows, heads * d]);
    if pad > 0 {
        o.narrow(1, 0, len)
    } else {
        o
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
