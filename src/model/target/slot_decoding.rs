//! The target over a [`SlotCache`]: the decoding engines' batched steps (several sequences
//! in slots, packed tokens), for every family; a hybrid's Gated DeltaNet states per slot.

use super::*;

impl TargetModel {
    /// A decoding cache of `slots` sequences of up to `capacity` positions for this model:
    /// the flash attention where the kernel takes the model's shapes, its rotary table; for a
    /// hybrid target keys and values of its attention layers only, and the conv and recurrent
    /// states of its Gated DeltaNet layers per slot ([`crate::model::SlotStates`]).
    pub fn slot_cache(&self, slots: i64, capacity: i64) -> Result<SlotCache> {
        let c = &self.config;
        let attention = crate::model::slots::SlotAttention::for_model(
            self.device,
            self.kind,
            c.num_attention_heads,
            c.kv_heads(),
            c.head_dim(),
        );
        let delta_nets = self.delta_net_layers();
        let cache = SlotCache::new(
            self.num_layers() - delta_nets,
            slots,
            capacity,
            c.kv_heads(),
            c.head_dim(),
            self.kind,
            self.device,
            attention,
        )?
        .with_rope(self.rope.table(capacity, self.kind));
        let Some(h) = &c.hybrid else {
            return Ok(cache);
        };
        let states =
            crate::model::SlotStates::new(delta_nets as i64, slots, h.gdn, self.kind, self.device)
                .with_context(|| {
                    let bytes = crate::model::SlotStates::bytes(
                        delta_nets as i64,
                        slots,
                        h.gdn,
                        self.kind,
                        0,
                    );
                    format!(
                    "the Gated DeltaNet states of {slots} slots ({:.2} GiB) cannot be allocated",
                    bytes as f64 / (1u64 << 30) as f64
                )
                })?;
        Ok(cache.with_states(states))
    }

    /// Bytes of a [`TargetModel::slot_cache`] of this shape: keys and values, and a hybrid's
    /// Gated DeltaNet states.
    pub fn slot_cache_bytes(&self, slots: i64, capacity: i64) -> i64 {
        let c = &self.config;
        let delta_nets = self.delta_net_layers();
        let kv = SlotCache::bytes(
            self.num_layers() - delta_nets,
            slots,
            capacity,
            c.kv_heads(),
            c.head_dim(),
            self.kind,
        );
        let states = c.hybrid.as_ref().map_or(0, |h| {
            crate::model::SlotStates::bytes(delta_nets as i64, slots, h.gdn, self.kind, 0)
        });
        kv + states
    }

    /// Number of Gated DeltaNet layers (a hybrid's; 0 for the others).
    fn delta_net_layers(&self) -> usize {
        let linear = crate::model::hybrid_config::LayerKind::LinearAttention;
        let hybrid = self.config.hybrid.as_ref();
        hybrid.map_or(0, |h| h.layers.iter().filter(|l| **l == linear).count())
    }

    /// One forward of new tokens `ids` [n] (int64, on the model's device) over a
    /// [`SlotCache`]: `batch` says which slot and position each token takes; their keys and
    /// values are written to the cache and each token attends causally to its sequence. Returns
    /// the float32 logits asked for by `logits` and the tapped features [n, K * H]. Built of
    /// tensor operations on device tensors only, so that a CUDA graph can capture it (a packed
    /// batch, known on the host, excepted). A hybrid target's Gated DeltaNet layers continue
    /// their slots' states ([`crate::model::hybrid_slots`]).
    pub(crate) fn forward_slots(
        &self,
        ids: &Tensor,
        batch: &SlotBatch,
        cache: &mut SlotCache,
        tap_layers: &[usize],
        logits: SlotLogits,
    ) -> Result<TargetOutput> {
        tch::no_grad(|| {
            let n = batch.tokens();
            let (cos, sin) = match &cache.rope {
                Some(table) => table.at(&batch.positions),
                None => self.rope.cos_sin(&batch.positions, self.kind),
            };
            let mut x = rows(&self.embed_tokens, &ids.view([n])).unsqueeze(0);
            let cfg = &self.config;
            let shape = AttentionShape {
                heads: cfg.num_attention_heads,
                kv_heads: cfg.kv_heads(),
                head_dim: cfg.head_dim(),
                eps: cfg.rms_norm_eps,
            };
            let mut taps: Vec<Option<Tensor>> = tap_layers.iter().map(|_| None).collect();
            let mut ordinals = MixerOrdinals::default();
            // every layer: the cache must be filled
            for (idx, layer) in self.layers.iter().enumerate() {
                match layer {
                    TargetLayer::Decoder(layer) => {
                        layer.forward_slots(&mut x, idx, shape, (&cos, &sin), batch, cache, true)?
                    }
                    TargetLayer::Hybrid(layer) => {
                        let kernels = self.fused.as_ref();
                        layer.forward_slots(
                            &mut x,
                            &mut ordinals,
                            (&cos, &sin),
                            batch,
                            cache,
                            kernels,
                        )?
                    }
                }
                record_taps(&mut taps, tap_layers, idx, &x);
            }
            let features = concat_taps(taps, &x).map(|f| f.squeeze_dim(0));
            let x = x.squeeze_dim(0);
            let eps = self.config.rms_norm_eps;
            let kernels = self.fused.as_ref();
            let logits = match logits {
                SlotLogits::None => None,
                SlotLogits::All => Some(self.logits(&self.norm.forward(&x, eps, kernels))),
                SlotLogits::Last => {
                    let last = x.index_select(0, &batch.last);
                    Some(self.logits(&self.norm.forward(&last, eps, kernels)))
                }
            };
            Ok(TargetOutput {
                features,
                final_hidden: None,
                logits,
            })
        })
    }
}

/// Which logits [`TargetModel::forward_slots`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotLogits {
    /// None (every layer still runs: the cache must be filled).
    None,
    /// For every new token: [n, vocab].
    All,
    /// For each sequence's last new token: [sequences, vocab].
    Last,
}
