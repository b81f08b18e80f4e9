//! The drafter's side of decoding over a [`SlotCache`]: context keys and values written to
//! slots, blocks attending to their slots, the cache itself and a copy with fused projections.

use anyhow::{Context, Result};
use tch::Tensor;

use super::{Drafter, FrozenHead};
use crate::model::layers::{rms_norm, rows, AttentionShape, Rope};
use crate::model::slots::{SlotBatch, SlotCache};

/// The key and value projections of every layer of a decoding copy stacked, for the context:
/// every layer reads the same fused features, so one matrix product, one norm and one rotation
/// serve all layers and one write fills their cache rows (a decoding step costs its kernel
/// launches, not its arithmetic).
pub(super) struct ContextKv {
    /// [layers * 2 * kv_heads * d, H]: per layer its keys' rows, then its values'.
    weight: Tensor,
    /// [layers, 1, d]: each layer's key norm.
    k_norm: Tensor,
}

impl ContextKv {
    /// Stacks the fused layers' projections; `None` where a layer has biases or no key norm
    /// (not a drafter's layout).
    fn stack(drafter: &Drafter) -> Option<Self> {
        let c = &drafter.config;
        let (nq, kv) = (
            c.num_attention_heads * c.head_dim,
            2 * c.num_key_value_heads * c.head_dim,
        );
        let mut weights = Vec::with_capacity(drafter.layers.len());
        let mut norms = Vec::with_capacity(drafter.layers.len());
        for layer in &drafter.layers {
            let (Some((w, None)), Some(k_norm)) = (&layer.attn.fused, &layer.attn.k_norm) else {
                return None;
            };
            weights.push(w.narrow(0, nq, kv));
            norms.push(k_norm.view([1, 1, -1]));
        }
        Some(ContextKv {
            weight: Tensor::cat(&weights, 0),
            k_norm: Tensor::cat(&norms, 0),
        })
    }
}

impl Drafter {
    /// Decoding over a [`SlotCache`] (see [`crate::model::decode`]): writes the context keys and
    /// values of the target features `features` [c, K*H] of newly accepted tokens to the rows
    /// and positions of `batch` (c tokens). The context only ever serves as keys, so nothing
    /// attends here.
    pub fn append_context_slots(
        &self,
        features: &Tensor,
        batch: &SlotBatch,
        cache: &mut SlotCache,
    ) -> Result<()> {
        tch::no_grad(|| {
            let ctx = self.fuse_context(&features.unsqueeze(0), None);
            let (cos, sin) = self.rotary(cache, &batch.positions);
            if let Some(stacked) = &self.context_kv {
                let c = &self.config;
                let (n, d) = (batch.tokens(), c.head_dim);
                let shape = [n, self.layers.len() as i64, 2, c.num_key_value_heads, d];
                let kv = ctx
                    .squeeze_dim(0)
                    .linear::<&Tensor>(&stacked.weight, None)
                    .view(shape);
                if cache.kernels().is_some() {
                    return cache.write_all_layers_projected(
                        &kv,
                        &stacked.k_norm,
                        c.rms_norm_eps,
                        (&cos, &sin),
                        &batch.rows,
                    );
                }
                // normalised, then times the weight (rounded twice, as Hugging Face's norm)
                let k = kv
                    .select(2, 0)
                    .rms_norm([d], None::<&Tensor>, c.rms_norm_eps)
                    * &stacked.k_norm;
                let angles = |t: &Tensor| t.view([n, 1, 1, d]);
                let k = Rope::apply(&k, &angles(&cos), &angles(&sin));
                cache.write_all_layers(&k, &kv.select(2, 1), &batch.rows);
                return Ok(());
            }
            for (idx, layer) in self.layers.iter().enumerate() {
                let (k, v) = self.context_kv(layer, &ctx, &cos, &sin, None);
                cache.write(idx, &k, &v, &batch.rows);
            }
            Ok(())
        })
    }

    /// Decoding over a [`SlotCache`]: the blocks `block_ids` [n] (int64 on the device; each
    /// sequence's block at the positions of `batch`, a uniform batch of one block per
    /// sequence) attend to their sequence's context rows and to their own block, not causally.
    /// Their keys and values are written after the context rows, where the next context
    /// overwrites them. Returns the final-normed hidden states [n, H].
    pub fn block_slots(
        &self,
        head: &FrozenHead,
        block_ids: &Tensor,
        batch: &SlotBatch,
        cache: &mut SlotCache,
    ) -> Result<Tensor> {
        tch::no_grad(|| {
            let c = &self.config;
            let (heads, kv_heads, d, eps) = (
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.rms_norm_eps,
            );
            let n = batch.tokens();
            let (cos, sin) = self.rotary(cache, &batch.positions);
            let mut h = rows(&head.embed_tokens, &block_ids.view([n]))
                .unsqueeze(0)
                .to_kind(self.kind);
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim: d,
                eps,
            };
            for (idx, layer) in self.layers.iter().enumerate() {
                layer.forward_slots(&mut h, idx, shape, (&cos, &sin), batch, cache, false)?;
            }
            Ok(rms_norm(&h, &self.norm, eps).squeeze_dim(0))
        })
    }

    /// The rotary cos and sin of `positions`: from the cache's table when it has one.
    fn rotary(&self, cache: &SlotCache, positions: &Tensor) -> (Tensor, Tensor) {
        match &cache.rope {
            Some(table) => table.at(positions),
            None => self.rope.cos_sin(positions, self.kind),
        }
    }

    /// A decoding cache of one sequence of up to `capacity` positions for this drafter: the
    /// flash attention where the kernel takes its shapes, its rotary table, the windows of its
    /// sliding layers (the context rows of a slot are its positions, so the cache's window over
    /// rows is the window over positions).
    pub fn slot_cache(&self, capacity: i64) -> Result<SlotCache> {
        let c = &self.config;
        let attention = crate::model::slots::SlotAttention::for_model(
            self.device,
            self.kind,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        Ok(SlotCache::new(
            self.layers.len(),
            1,
            capacity,
            c.num_key_value_heads,
            c.head_dim,
            self.kind,
            self.device,
            attention,
        )?
        .with_rope(self.rope.table(capacity, self.kind))
        .with_windows(c.layer_windows()))
    }

    /// A copy for decoding: the same weights, detached from training, with the q, k, v and the
    /// gate, up projections each stored as one matrix (one matrix product instead of several;
    /// see [`crate::model::layers::AttentionWeights::fuse`]).
    pub fn decode_copy(&self) -> Result<Drafter> {
        let params: std::collections::HashMap<String, Tensor> = self
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.detach().copy()))
            .collect();
        let mut copy = Self::build(self.config.clone(), self.device, self.kind, |name, _| {
            params
                .get(name)
                .map(Tensor::shallow_clone)
                .with_context(|| format!("the drafter has no tensor {name}"))
        })?;
        for layer in &mut copy.layers {
            layer.attn.fuse();
            layer.mlp.fuse();
        }
        copy.context_kv = ContextKv::stack(&copy);
        Ok(copy)
    }
}
