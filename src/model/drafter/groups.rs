//! The drafter's training attention in groups of consecutive blocks of one sequence, in two
//! parts merged by their log-sum-exp (one autograd node a layer,
//! [`grouped_block_attention_autograd`]):
//! - the context: per group, cuDNN's fused attention of its queries over a view of its
//!   sequence's context keys up to its last anchor (bucketed), under the staircase mask (a block
//!   anchored at a sees the positions p < a). Nothing is copied: the groups' queries are
//!   consecutive rows of the layer's, the context is read in place;
//! - each block over its own 16 keys, on the `block_attention_fwd` / `_bwd` kernels, which also
//!   merge the two parts.
//!
//! The chunked form ([`super::chunks`]) reads the own keys of every block of its chunk (512 at
//! the 8B shape where a query needs 16) and copies the context once per chunk, to put chunks of
//! several sequences in one call of a fixed shape. Here a query reads its context up to its
//! group's last anchor and its block's own keys only.
//!
//! The groups' shapes repeat (cuDNN builds a plan per shape, tens of milliseconds of host time
//! each): groups of the configured size (`grouped:G`, a power of two; 128 blocks by default), and
//! a sequence's remaining blocks in groups of the powers of two of their count; contexts
//! bucketed by [`context_bucket`].

use std::cell::OnceCell;

use anyhow::Result;
use tch::{Kind, Tensor};

use super::attention::context_bucket;
use super::chunks::{ChunkPlan, KeptBlocks};
use super::Drafter;
use crate::aten_ext::fused::{
    block_attention_takes, grouped_block_attention_autograd, BlockGroup, FusedKernels,
};

/// Each group's (sequence, first kept block, blocks), from each sequence's kept anchors: groups
/// of `most` blocks (a power of two), the rest of a sequence in groups of the powers of two of
/// its count, largest first.
pub(super) fn group_spans(kept: &[Vec<i64>], most: i64) -> Vec<(i64, i64, i64)> {
    let mut spans = Vec::new();
    let mut first = 0;
    for (seq, anchors) in kept.iter().enumerate() {
        let (mut left, mut at, mut size) = (anchors.len() as i64, first, most.max(1));
        while left > 0 {
            while size > left {
                size /= 2;
            }
            spans.push((seq as i64, at, size));
            at += size;
            left -= size;
        }
        first += anchors.len() as i64;
    }
    spans
}

/// One group: its sequence, first query row, rows, and its mask [1, 1, rows, context].
struct Group {
    seq: i64,
    first_row: i64,
    rows: i64,
    mask: Tensor,
}

/// The layout shared by every layer of one grouped training forward.
pub(super) struct GroupPlan<'a> {
    groups: Vec<Group>,
    /// Each kept block's anchor [M] (int64, on the device).
    anchors: Tensor,
    kernels: FusedKernels,
    /// What a chunked forward would use, should the node fail (built then).
    kept: &'a KeptBlocks,
    context: i64,
    per_chunk: i64,
    fallback: OnceCell<ChunkPlan>,
}

impl Drafter {
    /// The grouped layout of a training forward over the `kept` blocks (their anchors on the
    /// device, `anchors` [M]) against `s` context positions, where it applies: the fused kernels
    /// on the drafter's device, bf16 or f16, no sliding-window layer, heads and blocks the
    /// kernels take. `group_blocks`: blocks a group (a power of two); `per_chunk`: the chunked
    /// form's chunk size, should the node fail.
    pub(super) fn group_plan<'a>(
        &self,
        kept: &'a KeptBlocks,
        group_blocks: i64,
        anchors: &Tensor,
        s: i64,
        per_chunk: i64,
        kernels: Option<&FusedKernels>,
    ) -> Option<GroupPlan<'a>> {
        let c = &self.config;
        let bs = c.block_size;
        let kernels = kernels.filter(|k| k.device() == self.device)?;
        let applies = matches!(self.kind, Kind::BFloat16 | Kind::Half)
            && c.layer_windows().iter().all(Option::is_none)
            && kept.len() > 0
            && block_attention_takes(c.num_attention_heads, c.num_key_value_heads, c.head_dim, bs);
        if !applies {
            return None;
        }
        let dev = self.device;
        let anchors = anchors.reshape([-1]);
        // every kept block's anchor, in kept order
        let (_, host_anchors) = kept.rows_and_anchors();
        let groups = group_spans(&kept.anchors, group_blocks)
            .into_iter()
            .map(|(seq, first, blocks)| {
                let last = host_anchors[(first + blocks - 1) as usize];
                let context = context_bucket(last.max(1)).min(s);
                let rows = blocks * bs;
                // a query row's anchor: it sees the positions before it
                let query_anchor = anchors
                    .narrow(0, first, blocks)
                    .repeat_interleave_self_int(bs, None, None)
                    .view([rows, 1]);
                let sees = Tensor::arange(context, (Kind::Int64, dev))
                    .view([1, context])
                    .lt_tensor(&query_anchor);
                Group {
                    seq,
                    first_row: first * bs,
                    rows,
                    mask: self.additive_mask(&sees.unsqueeze(0)),
                }
            })
            .collect();
        Some(GroupPlan {
            groups,
            anchors,
            kernels: *kernels,
            kept,
            context: s,
            per_chunk,
            fallback: OnceCell::new(),
        })
    }

    /// The chunked form's plan for the blocks of `plan`, built once (where the grouped node
    /// failed).
    pub(super) fn group_fallback<'p>(&self, plan: &'p GroupPlan) -> &'p ChunkPlan {
        plan.fallback
            .get_or_init(|| self.chunk_plan(plan.kept, plan.context, plan.per_chunk, None))
    }
}

/// Grouped block attention of one layer over the kept blocks: `q` [1, heads, M*bs, d] (their
/// queries, rotated), `ctx` keys/values [B, kv_heads, S, d], `block` keys/values [1, kv_heads,
/// M*bs, d]. Returns the attention output as rows [1, M*bs, heads * d] (before `o_proj`).
pub(super) fn grouped_attention(
    q: &Tensor,
    ctx: (&Tensor, &Tensor),
    block: (&Tensor, &Tensor),
    plan: &GroupPlan,
    bs: i64,
) -> Result<Tensor> {
    let (_, heads, rows, d) = q.size4()?;
    // token-major: [T, heads, d] and [B, S, kv, d] (views where the tensors are stored so)
    let tokens = |x: &Tensor| x.squeeze_dim(0).transpose(0, 1).contiguous();
    let positions = |x: &Tensor| {
        let t = x.transpose(1, 2);
        let (_, _, kv, d) = t.size4().unwrap_or((0, 0, 0, 0));
        match t.stride()[1..] == [kv * d, d, 1] {
            true => t,
            false => t.contiguous(),
        }
    };
    let groups: Vec<BlockGroup> = plan
        .groups
        .iter()
        .map(|g| BlockGroup {
            seq: g.seq,
            first_row: g.first_row,
            rows: g.rows,
            mask: &g.mask,
        })
        .collect();
    let out = grouped_block_attention_autograd(
        &tokens(q),
        (&positions(ctx.0), &positions(ctx.1)),
        (&tokens(block.0), &tokens(block.1)),
        &plan.anchors,
        &groups,
        bs,
        &plan.kernels,
    )?;
    Ok(out.view([1, rows, heads * d]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_cover_each_sequence_in_repeating_sizes() {
        let kept = vec![(0..150).collect::<Vec<i64>>(), vec![], (0..5).collect()];
        let spans = group_spans(&kept, 64);
        assert_eq!(
            spans,
            vec![
                (0, 0, 64),
                (0, 64, 64),
                (0, 128, 16),
                (0, 144, 4),
                (0, 148, 2),
                (2, 150, 4),
                (2, 154, 1),
            ]
        );
        // every block once, in order, each group within one sequence
        let mut next = 0;
        for &(seq, first, blocks) in &spans {
            assert_eq!(first, next);
            assert!(blocks.count_ones() == 1 && blocks <= 64);
            let start: i64 = kept[..seq as usize].iter().map(|a| a.len() as i64).sum();
            assert!(first >= start && first + blocks <= start + kept[seq as usize].len() as i64);
            next += blocks;
        }
        assert_eq!(next, 155);
    }
}
