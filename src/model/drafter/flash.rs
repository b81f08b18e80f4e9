//! The flash form of the drafter's training attention ([`TrainAttention::Flash`]): the layout of
//! its chunks ([`FlashPlan`], built once per forward on the host) and one layer's attention
//! through [`block_attention`] (three flash attention calls merged by their log-sum-exp).
//!
//! [`TrainAttention::Flash`]: super::TrainAttention::Flash

use anyhow::Result;
use tch::{Device, Tensor};

use super::chunks::KeptBlocks;
use crate::aten_ext::{block_attention, BlockAttentionKeys};
use crate::model::layers::upload;

/// Where the kept blocks' keys come from, for every layer of one training forward.
///
/// The kept blocks of each row (in row order, as the queries hold them) are cut into chunks of
/// consecutive blocks whose anchors lie at most `span` apart. For a chunk of first anchor a0 and
/// last anchor a1:
/// - its prefix: context positions [0, a0), seen by all its queries;
/// - its staircase: context positions [a0, a1), of which the block anchored at a sees [a0, a);
///   its query positions are t = 0..=a1 - a0 (the block anchored at a0 + t, where there is
///   one), so that a causal mask aligned bottom-right lets position t see keys < t.
pub(super) struct FlashPlan {
    /// The kernel's index lists (int64, on the device): cu_q1, cu_k1, cu_q2, cu_k2, each
    /// block's staircase row.
    index: Tensor,
    /// The context rows (of the batch's B * S) of every chunk's prefix, back to back.
    prefix_rows: Tensor,
    /// The context rows of every chunk's staircase, back to back (chunks with one anchor have
    /// none).
    staircase_rows: Tensor,
    /// The kernel's sizes (see [`block_attention`]).
    sizes: [i64; 8],
}

/// The host side of a [`FlashPlan`].
#[derive(Debug, PartialEq, Eq)]
struct FlashLayout {
    cu_q1: Vec<i64>,
    cu_k1: Vec<i64>,
    cu_q2: Vec<i64>,
    cu_k2: Vec<i64>,
    /// Each kept block's row among the staircase's query positions (the blocks of chunks
    /// without a staircase: one past the last row).
    pos2: Vec<i64>,
    prefix_rows: Vec<i64>,
    staircase_rows: Vec<i64>,
    /// n1, n2, max_q1, max_k1, max_q2, max_k2, staircase rows, block size.
    sizes: [i64; 8],
}

/// The layout of `kept` (per row, its blocks' anchors, ascending) in blocks of `block` rows,
/// the context laid out as rows of `stride` positions each, chunks at most `span` apart.
fn flash_layout(kept: &[Vec<i64>], block: i64, stride: i64, span: i64) -> FlashLayout {
    let mut l = FlashLayout {
        cu_q1: vec![0],
        cu_k1: vec![0],
        cu_q2: vec![0],
        cu_k2: vec![0],
        pos2: Vec::new(),
        prefix_rows: Vec::new(),
        staircase_rows: Vec::new(),
        sizes: [0; 8],
    };
    // chunk by chunk: (row, its anchors)
    let mut chunks: Vec<(i64, &[i64])> = Vec::new();
    for (r, anchors) in kept.iter().enumerate() {
        let mut start = 0;
        for j in 1..=anchors.len() {
            if j == anchors.len() || anchors[j] - anchors[start] > span {
                chunks.push((r as i64, &anchors[start..j]));
                start = j;
            }
        }
    }
    let (mut max_q1, mut max_k1, mut max_q2, mut max_k2) = (0, 0, 0, 0);
    // staircase rows of each block, filled once the total is known
    let mut stairs: Vec<Option<i64>> = Vec::new();
    for &(r, anchors) in &chunks {
        let (a0, a1) = (anchors[0], anchors[anchors.len() - 1]);
        let rows = anchors.len() as i64 * block;
        l.cu_q1.push(l.cu_q1.last().copied().unwrap_or(0) + rows);
        l.cu_k1.push(l.cu_k1.last().copied().unwrap_or(0) + a0);
        l.prefix_rows.extend((0..a0).map(|p| r * stride + p));
        max_q1 = max_q1.max(rows);
        max_k1 = max_k1.max(a0);
        let width = a1 - a0;
        if width > 0 {
            let first = l.cu_q2.last().copied().unwrap_or(0);
            stairs.extend(anchors.iter().map(|&a| Some(first + a - a0)));
            l.cu_q2.push(first + width + 1);
            l.cu_k2.push(l.cu_k2.last().copied().unwrap_or(0) + width);
            l.staircase_rows.extend((a0..a1).map(|p| r * stride + p));
            max_q2 = max_q2.max(width + 1);
            max_k2 = max_k2.max(width);
        } else {
            stairs.extend(anchors.iter().map(|_| None));
        }
    }
    let rows2 = l.cu_q2.last().copied().unwrap_or(0);
    l.pos2 = stairs.into_iter().map(|p| p.unwrap_or(rows2)).collect();
    l.sizes = [
        l.cu_q1.len() as i64 - 1,
        l.cu_q2.len() as i64 - 1,
        max_q1,
        max_k1,
        max_q2,
        max_k2,
        rows2,
        block,
    ];
    l
}

impl FlashPlan {
    /// The plan of the `kept` blocks (`block` rows each) over a context of `stride` positions
    /// per row, chunks at most `span` apart, its index lists uploaded to `device` at once.
    pub(super) fn new(
        kept: &KeptBlocks,
        block: i64,
        stride: i64,
        span: i64,
        device: Device,
    ) -> Self {
        let l = flash_layout(&kept.anchors, block, stride, span);
        let parts = [
            &l.cu_q1,
            &l.cu_k1,
            &l.cu_q2,
            &l.cu_k2,
            &l.pos2,
            &l.prefix_rows,
            &l.staircase_rows,
        ];
        let lens: Vec<i64> = parts.iter().map(|p| p.len() as i64).collect();
        let host: Vec<i64> = parts.into_iter().flatten().copied().collect();
        let all = upload(&Tensor::from_slice(&host), device);
        let index_len: i64 = lens[..5].iter().sum();
        let staircase_at = index_len + lens[5];
        FlashPlan {
            index: all.narrow(0, 0, index_len),
            prefix_rows: all.narrow(0, index_len, lens[5]),
            staircase_rows: all.narrow(0, staircase_at, lens[6]),
            sizes: l.sizes,
        }
    }
}

/// The flash form's attention of one layer over the kept blocks: `q` [1, heads, M*bs, d] (their
/// queries, rotated), `ctx` keys/values [B, kv_heads, S, d] (S the plan's stride), `block`
/// keys/values [1, kv_heads, M*bs, d]. Returns the attention output as rows [1, M*bs, heads *
/// d] (before `o_proj`).
pub(super) fn flash_attention(
    q: &Tensor,
    ctx: (&Tensor, &Tensor),
    block: (&Tensor, &Tensor),
    plan: &FlashPlan,
) -> Result<Tensor> {
    let (_, heads, rows, d) = q.size4()?;
    let (b, kv_heads, s, _) = ctx.0.size4()?;
    // token-major rows: [M*bs, heads, d] and the context's [B*S, kv_heads, d]
    let tokens = |x: &Tensor, h: i64| {
        x.squeeze_dim(0)
            .transpose(0, 1)
            .contiguous()
            .view([rows, h, d])
    };
    let context = |x: &Tensor| x.transpose(1, 2).reshape([b * s, kv_heads, d]);
    let (ck, cv) = (context(ctx.0), context(ctx.1));
    let (kb, vb) = (tokens(block.0, kv_heads), tokens(block.1, kv_heads));
    let prefix = (
        ck.index_select(0, &plan.prefix_rows),
        cv.index_select(0, &plan.prefix_rows),
    );
    let staircase = (
        ck.index_select(0, &plan.staircase_rows),
        cv.index_select(0, &plan.staircase_rows),
    );
    let keys = BlockAttentionKeys {
        prefix: (&prefix.0, &prefix.1),
        staircase: (&staircase.0, &staircase.1),
        own: (&kb, &vb),
    };
    let out = block_attention(&tokens(q, heads), &keys, &plan.index, plan.sizes)?;
    Ok(out.view([1, rows, heads * d]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_where_anchors_lie_more_than_the_span_apart() {
        // row 0: anchors 0, 2, 5 | 20 (span 5); row 1: 3, 4
        let kept = vec![vec![0, 2, 5, 20], vec![3, 4]];
        let l = flash_layout(&kept, 2, 100, 5);
        // chunks: (0: 0,2,5) (0: 20) (1: 3,4); queries 2 rows a block
        assert_eq!(l.cu_q1, vec![0, 6, 8, 12]);
        // prefixes: [0, 0), [0, 20), [0, 3) of row 1
        assert_eq!(l.cu_k1, vec![0, 0, 20, 23]);
        let mut prefix: Vec<i64> = (0..20).collect();
        prefix.extend([100, 101, 102]);
        assert_eq!(l.prefix_rows, prefix);
        // staircases: chunk 0 over [0, 5) with positions 0..=5, chunk 2 over [3, 4)
        assert_eq!(l.cu_q2, vec![0, 6, 8]);
        assert_eq!(l.cu_k2, vec![0, 5, 6]);
        assert_eq!(l.staircase_rows, vec![0, 1, 2, 3, 4, 103]);
        // blocks' staircase rows: 0, 2, 5 | none (8) | 6, 7
        assert_eq!(l.pos2, vec![0, 2, 5, 8, 6, 7]);
        assert_eq!(l.sizes, [3, 2, 6, 20, 6, 5, 8, 2]);
    }

    #[test]
    fn a_span_of_zero_makes_every_block_a_chunk_without_staircase() {
        let l = flash_layout(&[vec![1, 2, 4]], 4, 10, 0);
        assert_eq!(l.cu_q1, vec![0, 4, 8, 12]);
        assert_eq!(l.cu_k1, vec![0, 1, 3, 7]);
        assert_eq!(l.cu_q2, vec![0]);
        assert!(l.staircase_rows.is_empty());
        assert_eq!(l.pos2, vec![0, 0, 0]);
        assert_eq!(l.sizes[1], 0);
    }
}
