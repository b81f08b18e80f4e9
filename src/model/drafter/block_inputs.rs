//! The first layer's inputs of a training forward: a block is `[x[a_j], MASK, ..., MASK]`, so
//! of its `block` rows only the anchor's differs from block to block and the other `block - 1`
//! are the mask token's embedding. The first layer's input norm and its query, key and value
//! projections (with their q/k norms) are row-wise, so they are computed on the `M + 1`
//! distinct rows (M anchors, one mask row) and spread over the `M * block` slots before the
//! rotary embedding, the first thing that depends on a slot's position. The same values as
//! projecting every slot; in the backward pass the mask slots' gradients are summed before
//! the projections' (the expansion's gradient), which is the same sum in another order.
//! At the 8B shape this is about 1.5 TFLOP a step of two sequences fewer (a sixteenth of
//! the first layer's q/k/v products, forward and the weights' gradients).

use tch::{Kind, Tensor};

/// The distinct input rows of a training forward's first layer.
pub(super) struct BlockInputs {
    /// [1, M + 1, H]: the M blocks' anchor embeddings in block order, then the mask token's.
    pub(super) rows: Tensor,
    /// Sequence groups and blocks per group: M = groups * blocks.
    groups: i64,
    blocks: i64,
    block: i64,
}

impl BlockInputs {
    /// The inputs of `blocks` blocks of `block` slots in each of `groups` groups whose anchor
    /// tokens are `first` [groups * blocks], embedded by `embed` [V, H] in `kind`.
    pub(super) fn embed(
        embed: &Tensor,
        first: &Tensor,
        mask_token: i64,
        (groups, blocks, block): (i64, i64, i64),
        kind: Kind,
    ) -> Self {
        let mask = Tensor::full([1], mask_token, (Kind::Int64, first.device()));
        let ids = Tensor::cat(&[first.reshape([-1]), mask], 0).unsqueeze(0);
        BlockInputs {
            rows: Tensor::embedding(embed, &ids, -1, false, false).to_kind(kind),
            groups,
            blocks,
            block,
        }
    }

    /// Row-wise values of the distinct rows `t` [1, M + 1, X] spread over the slots:
    /// [groups, blocks * block, X], block-major, the anchor's row first in each block.
    pub(super) fn spread(&self, t: &Tensor) -> Tensor {
        let (g, n, bs) = (self.groups, self.blocks, self.block);
        let width = t.size()[2];
        let anchors = t.narrow(1, 0, g * n).reshape([g, n, 1, width]);
        let masks = t
            .narrow(1, g * n, 1)
            .reshape([1, 1, 1, width])
            .expand([g, n, bs - 1, width], false);
        Tensor::cat(&[anchors, masks], 2).view([g, n * bs, width])
    }

    /// [`BlockInputs::spread`] of per-head values `t` [1, heads, M + 1, d] (as the attention's
    /// projections give them): [groups, heads, blocks * block, d], laid out as a projection of
    /// every slot would be ([groups, slots, heads, d] in memory).
    pub(super) fn spread_heads(&self, t: &Tensor) -> Tensor {
        let size = t.size();
        let (heads, d) = (size[1], size[3]);
        let rows = t.transpose(1, 2).reshape([1, -1, heads * d]);
        self.spread(&rows)
            .view([self.groups, -1, heads, d])
            .transpose(1, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn spread_rows_are_the_embedding_of_every_slot() {
        let embed = Tensor::randn([10, 6], (Kind::Double, Device::Cpu));
        let first = Tensor::from_slice(&[3i64, 1, 4, 1, 5, 9]);
        let inputs = BlockInputs::embed(&embed, &first, 7, (2, 3, 4), Kind::Double);
        assert_eq!(inputs.rows.size(), [1, 7, 6]);
        let mut ids = Vec::new();
        for a in [3i64, 1, 4, 1, 5, 9] {
            ids.extend([a, 7, 7, 7]);
        }
        let want = embed
            .index_select(0, &Tensor::from_slice(&ids))
            .view([2, 12, 6]);
        assert!(inputs.spread(&inputs.rows).equal(&want));

        // per head: [1, heads, M + 1, d] with heads 2, d 3, against the same spread of rows
        let heads = inputs.rows.view([1, 7, 2, 3]).transpose(1, 2);
        let spread = inputs.spread_heads(&heads);
        assert_eq!(spread.size(), [2, 2, 12, 3]);
        assert!(spread.equal(&want.view([2, 12, 2, 3]).transpose(1, 2)));
        assert_eq!(
            spread.stride(),
            [72, 3, 6, 1],
            "slots-major as a projection lays it out"
        );
    }

    #[test]
    fn the_mask_rows_gradient_is_the_sum_over_its_slots() {
        let rows = Tensor::randn([1, 3, 2], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let inputs = BlockInputs {
            rows: rows.shallow_clone(),
            groups: 1,
            blocks: 2,
            block: 3,
        };
        let probe = Tensor::randn([1, 6, 2], (Kind::Double, Device::Cpu));
        (inputs.spread(&rows) * &probe).sum(Kind::Double).backward();
        let g = rows.grad();
        assert!(g.select(1, 0).equal(&probe.select(1, 0)));
        assert!(g.select(1, 1).equal(&probe.select(1, 3)));
        let mask =
            probe.select(1, 1) + probe.select(1, 2) + probe.select(1, 4) + probe.select(1, 5);
        assert!((g.select(1, 2) - mask).abs().max().double_value(&[]) < 1e-12);
    }
}
