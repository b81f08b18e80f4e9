//! The frozen target model: Llama (incl. Llama 3 rope scaling), Qwen2/2.5 (q/k/v biases),
//! Qwen3 (per-head q/k RMSNorm) and the Qwen3.5 / 3.6 / Qwen3-Next hybrids (Gated DeltaNet and
//! gated attention layers, [`super::hybrid`]). Attention runs through libtorch's fused
//! `scaled_dot_product_attention` with grouped-query heads. Weights carry no gradients and every
//! forward runs without autograd; one loaded model is shared (`Arc`) by the workers of a device.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::config::{Family, TargetConfig};
use super::feed_forward::FeedForward;
use super::gated_delta::GdnState;
use super::hybrid::{GatedDeltaNet, HybridLayer, Mixer, ZeroCentredNorm};
use super::hybrid_slots::MixerOrdinals;
pub use super::kv_cache::KvCache;
use super::layers::{
    attention, rms_norm, rows, AttentionShape, AttentionWeights, DecoderLayer, Rope,
};
use super::slots::{SlotBatch, SlotCache};
use super::weights::{RandomWeights, WeightFiles, WeightSource};
use crate::aten_ext::fused::FusedKernels;

mod slot_decoding;
pub use slot_decoding::SlotLogits;

/// One layer of a target: a Llama / Qwen decoder layer, or a hybrid's (gated attention or Gated
/// DeltaNet).
enum TargetLayer {
    Decoder(DecoderLayer<FeedForward>),
    Hybrid(HybridLayer),
}

/// The norm before the LM head: plain RMSNorm, or a hybrid's zero-centred one.
enum FinalNorm {
    Plain(Tensor),
    ZeroCentred(ZeroCentredNorm),
}

impl FinalNorm {
    fn forward(&self, x: &Tensor, eps: f64, kernels: Option<&FusedKernels>) -> Tensor {
        match self {
            FinalNorm::Plain(w) => rms_norm(x, w, eps),
            FinalNorm::ZeroCentred(n) => n.forward(x, kernels),
        }
    }

    fn numel(&self) -> usize {
        match self {
            FinalNorm::Plain(w) => w.numel(),
            FinalNorm::ZeroCentred(n) => n.numel(),
        }
    }
}

/// What a forward pass should return.
#[derive(Debug, Clone, Default)]
pub struct ForwardRequest {
    /// Decoder layer ids whose outputs (residual stream after the layer, before any final
    /// norm; `hidden_states[id + 1]` in Hugging Face terms) are returned, concatenated on the
    /// hidden axis in this order.
    pub tap_layers: Vec<usize>,
    /// Return the final-normed hidden states.
    pub final_hidden: bool,
    /// Return float32 logits.
    pub logits: bool,
}

/// The outputs a [`ForwardRequest`] asked for.
#[derive(Debug, Default)]
pub struct TargetOutput {
    /// [batch, seq, K * hidden]
    pub features: Option<Tensor>,
    /// [batch, seq, hidden]
    pub final_hidden: Option<Tensor>,
    /// [batch, seq, vocab], float32
    pub logits: Option<Tensor>,
}

/// A loaded target model.
pub struct TargetModel {
    pub config: TargetConfig,
    pub family: Family,
    pub device: Device,
    pub kind: Kind,
    embed_tokens: Tensor,
    layers: Vec<TargetLayer>,
    norm: FinalNorm,
    lm_head: Tensor,
    /// The LM head in float32, made on the first logits of a bf16 / f16 model off the GPU
    /// (training only taps features and never needs it; on a GPU one bf16 product with float32
    /// output gives the same values): logits from it have no bf16 rounding, whose exact ties
    /// would make greedy picks depend on the kernel.
    lm_head_f32: std::sync::OnceLock<Tensor>,
    rope: Rope,
    /// The fused kernels for the model's GPU (None: libtorch's operations): a hybrid's norms,
    /// and SwiGLU's product of dense MLPs in [`TargetModel::run`] and a hybrid's slot forwards
    /// (a dense target's slot forwards take the cache's, [`SlotCache::kernels`]).
    fused: Option<FusedKernels>,
}

impl TargetModel {
    /// Whether a hybrid target's long gated delta rule calls (prefills, training forwards) take
    /// the chunked form of the CUDA kernels (`chunked`) or their recurrent kernel; by default
    /// the chunked form where it runs on tensor cores ([`crate::aten_ext::gdn::GdnKernels::takes_chunked`]). With
    /// `tensor_cores` false the chunked
    /// form of bf16 / f16 calls computes in float32 instead of on tensor cores (the default).
    /// Nothing changes without the kernels (off CUDA, or other models).
    pub fn set_gdn_prefill_form(&mut self, chunked: bool, tensor_cores: bool) {
        for layer in &mut self.layers {
            if let TargetLayer::Hybrid(HybridLayer {
                mixer: Mixer::DeltaNet(net),
                ..
            }) = layer
            {
                let kernels = net.kernels().map(|k| {
                    k.with_chunked_prefill(chunked)
                        .with_tensor_cores(tensor_cores)
                });
                net.set_kernels(kernels);
            }
        }
    }

    /// Runs the norms and SwiGLU's products on `kernels` (loaded for the model's device; the
    /// model loads them itself on a GPU), or on libtorch's operations with `None`: the same
    /// values up to the order of the norms' float sums.
    pub fn set_fused_kernels(&mut self, kernels: Option<FusedKernels>) {
        let kernels = kernels.filter(|k| k.device() == self.device);
        self.fused = kernels;
        for layer in &mut self.layers {
            if let TargetLayer::Hybrid(HybridLayer {
                mixer: Mixer::DeltaNet(net),
                ..
            }) = layer
            {
                net.set_fused_kernels(kernels);
            }
        }
    }

    /// The fused kernels the forwards run their norms and SwiGLU's products on, if any.
    pub fn fused_kernels(&self) -> Option<FusedKernels> {
        self.fused
    }
}

impl std::fmt::Debug for TargetModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetModel")
            .field("family", &self.family)
            .field("layers", &self.layers.len())
            .field("device", &self.device)
            .field("kind", &self.kind)
            .finish()
    }
}

impl TargetModel {
    /// Loads config.json and the safetensors weights of a Hugging Face model folder.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config = TargetConfig::from_model_dir(dir)?;
        let weights = WeightFiles::open(dir)?;
        Self::from_weights(config, &weights, device, kind)
            .with_context(|| format!("{}: cannot load the model", dir.display()))
    }

    /// A model of the shape in `dir`'s config.json with seeded random weights (see
    /// [`RandomWeights`]), drawn on `device`; no weight files are read. Each device's
    /// generator gives other weights: [`TargetModel::random_drawn_on_cpu`] gives the same
    /// model on every device.
    pub fn random(dir: &Path, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        Self::random_drawn_on(dir, device, kind, seed, None)
    }

    /// [`TargetModel::random`] with the weights drawn by the CPU and moved to `device`: the
    /// same model as `random(dir, Device::Cpu, kind, seed)`, for comparing devices (slower
    /// to make at large shapes).
    pub fn random_drawn_on_cpu(dir: &Path, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        Self::random_drawn_on(dir, device, kind, seed, Some(Device::Cpu))
    }

    fn random_drawn_on(
        dir: &Path,
        device: Device,
        kind: Kind,
        seed: u64,
        draw_on: Option<Device>,
    ) -> Result<Self> {
        let config = TargetConfig::from_model_dir(dir)?;
        let untied = !config.tie_word_embeddings;
        let weights = RandomWeights {
            seed,
            std: 0.02,
            // experts in the fused layout: one tensor per layer and projection, not 3 E
            present: Box::new(move |name| {
                (untied && name == "lm_head.weight") || name.ends_with(".experts.gate_up_proj")
            }),
            zero_centred_norms: config.hybrid.is_some(),
            draw_on,
        };
        Self::from_weights(config, &weights, device, kind)
            .with_context(|| format!("{}: cannot build a random model", dir.display()))
    }

    pub(crate) fn from_weights(
        config: TargetConfig,
        weights: &dyn WeightSource,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let family = config.family()?;
        let h = config.hidden_size;
        let d = config.head_dim();
        let q_dim = config.num_attention_heads * d;
        let kv_dim = config.kv_heads() * d;
        let v = config.vocab_size;
        let load = |name: &str, shape: &[i64]| weights.load(name, shape, kind, device);
        let embed_tokens = load("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else if weights.contains("lm_head.weight") {
            load("lm_head.weight", &[v, h])?
        } else {
            bail!("tie_word_embeddings is false but the weights have no lm_head.weight");
        };
        let with_bias = family.qkv_bias(config.attention_bias);
        let mut layers = Vec::with_capacity(config.num_hidden_layers as usize);
        if let Some(h) = &config.hybrid {
            // the gated delta rule's CUDA kernels, loaded once for the model's device
            let kernels = crate::runtime::gdn_kernels_or_warn(device, h.gdn.key_dim);
            for l in 0..config.num_hidden_layers as usize {
                let mut layer = HybridLayer::load(&config, l, weights, device, kind)?;
                if let Mixer::DeltaNet(net) = &mut layer.mixer {
                    net.set_kernels(kernels);
                }
                layers.push(TargetLayer::Hybrid(layer));
            }
        }
        for l in (0..config.num_hidden_layers).filter(|_| config.hybrid.is_none()) {
            let p = format!("model.layers.{l}");
            let bias = |name: &str, len: i64| -> Result<Option<Tensor>> {
                let full = format!("{p}.self_attn.{name}.bias");
                if with_bias || weights.contains(&full) {
                    Ok(Some(load(&full, &[len])?))
                } else {
                    Ok(None)
                }
            };
            let norm = |name: &str| -> Result<Option<Tensor>> {
                if family.qk_norm() {
                    Ok(Some(load(&format!("{p}.self_attn.{name}.weight"), &[d])?))
                } else {
                    Ok(None)
                }
            };
            let mut layer = DecoderLayer {
                input_norm: load(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn: AttentionWeights {
                    q_proj: load(&format!("{p}.self_attn.q_proj.weight"), &[q_dim, h])?,
                    k_proj: load(&format!("{p}.self_attn.k_proj.weight"), &[kv_dim, h])?,
                    v_proj: load(&format!("{p}.self_attn.v_proj.weight"), &[kv_dim, h])?,
                    o_proj: load(&format!("{p}.self_attn.o_proj.weight"), &[h, q_dim])?,
                    q_bias: bias("q_proj", q_dim)?,
                    k_bias: bias("k_proj", kv_dim)?,
                    v_bias: bias("v_proj", kv_dim)?,
                    q_norm: norm("q_norm")?,
                    k_norm: norm("k_norm")?,
                    fused: None,
                    fused_qk_norm: None,
                },
                post_norm: load(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp: FeedForward::load(&config, l as usize, &p, weights, device, kind)?,
            };
            // frozen weights: one matrix product for q, k, v (and for gate, up: at load)
            layer.attn.fuse();
            layers.push(TargetLayer::Decoder(layer));
        }
        let norm = match config.hybrid {
            Some(_) => FinalNorm::ZeroCentred(ZeroCentredNorm::load(
                weights,
                "model.norm.weight",
                h,
                config.rms_norm_eps,
                device,
            )?),
            None => FinalNorm::Plain(load("model.norm.weight", &[h])?),
        };
        let rope = Rope::new(&config, device)?;
        let mut model = TargetModel {
            config,
            family,
            device,
            kind,
            embed_tokens,
            layers,
            norm,
            lm_head_f32: std::sync::OnceLock::new(),
            lm_head,
            rope,
            fused: None,
        };
        model.set_fused_kernels(crate::runtime::fused_kernels_or_warn(device));
        Ok(model)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn parameter_count(&self) -> i64 {
        let mut n = self.embed_tokens.numel() + self.norm.numel();
        if !self.config.tie_word_embeddings {
            n += self.lm_head.numel();
        }
        for layer in &self.layers {
            let tensors = match layer {
                TargetLayer::Decoder(l) => {
                    let mut tensors = vec![&l.input_norm, &l.post_norm];
                    tensors.extend(l.attn.tensors());
                    tensors.extend(l.mlp.tensors());
                    tensors
                }
                TargetLayer::Hybrid(l) => l.tensors(),
            };
            n += tensors.iter().map(|t| t.numel()).sum::<usize>();
        }
        n as i64
    }

    /// The parameters one token runs through: [`TargetModel::parameter_count`] less the
    /// experts it is not routed to (for model FLOPs of a mixture of experts).
    pub fn active_parameter_count(&self) -> i64 {
        let mlp = |layer: &TargetLayer| match layer {
            TargetLayer::Decoder(l) => l.mlp.inactive_numel(),
            TargetLayer::Hybrid(l) => l.mlp.inactive_numel(),
        };
        self.parameter_count() - self.layers.iter().map(mlp).sum::<usize>() as i64
    }

    /// The frozen input embedding [vocab, hidden] (shared storage).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The frozen LM head [vocab, hidden] (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Next-token logits [batch, seq, vocab] in float32.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        let req = ForwardRequest {
            logits: true,
            ..Default::default()
        };
        self.run(input_ids, cache, &req)
            .logits
            .unwrap_or_else(|| Tensor::zeros([0], (Kind::Float, self.device)))
    }

    /// LM head over final-normed hidden states, in float32.
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        tch::no_grad(|| {
            if self.kind == Kind::Float {
                return hidden.linear::<&Tensor>(&self.lm_head, None);
            }
            if self.device.is_cuda() {
                // bf16 / f16 operands, float32 products and sums and result: the same values as
                // the float32 product of the widened operands (widening is exact), at the
                // cost of reading the half-width head (a decoding step's largest matrix).
                let size = hidden.size();
                let width = size.last().copied().unwrap_or(0);
                let flat = hidden.reshape([-1, width]);
                if let Ok(logits) = flat.f_mm_dtype(&self.lm_head.tr(), Kind::Float) {
                    let mut out = size.clone();
                    if let Some(last) = out.last_mut() {
                        *last = self.lm_head.size()[0];
                    }
                    return logits.view(out.as_slice());
                }
            }
            let head = self
                .lm_head_f32
                .get_or_init(|| self.lm_head.to_kind(Kind::Float));
            hidden.to_kind(Kind::Float).linear::<&Tensor>(head, None)
        })
    }

    /// [`TargetModel::logits`] of `hidden` [n, width], `rows` rows at a time, each with the row
    /// it starts at: a long sequence's full-vocabulary logits are never materialised at once.
    pub fn logits_by_rows<'a>(
        &'a self,
        hidden: &'a Tensor,
        rows: i64,
    ) -> impl Iterator<Item = (i64, Tensor)> + 'a {
        let n = hidden.size().first().copied().unwrap_or(0);
        let rows = rows.max(1);
        (0..n).step_by(rows as usize).map(move |start| {
            (
                start,
                self.logits(&hidden.narrow(0, start, rows.min(n - start))),
            )
        })
    }

    /// One forward over `input_ids` [batch, seq] continuing the positions held in `cache` (or
    /// starting at 0 without one). Layers after the last one needed are skipped when neither
    /// final states nor logits are requested and no cache must be filled.
    pub fn run(
        &self,
        input_ids: &Tensor,
        cache: Option<&mut KvCache>,
        req: &ForwardRequest,
    ) -> TargetOutput {
        self.run_padded(input_ids, cache, req, None)
    }

    /// [`TargetModel::run`] over a padded batch. `key_mask` [batch, past + seq] (bool, or 0/1)
    /// marks the real tokens of every cached and new position (false = padding); padding keys
    /// are hidden from every query, on top of the causal / cache visibility. With left padding
    /// all rows share positions, and since the rotary embedding is relative the real tokens'
    /// outputs equal those of the unpadded rows (up to float rounding). Outputs at padding
    /// positions are meaningless (each sees only itself, so they stay finite). A hybrid's Gated
    /// DeltaNet layers see padding as zeros that neither decay nor write their state (as
    /// transformers zeroes them): exact for left padding, before a row's first real token.
    pub fn run_padded(
        &self,
        input_ids: &Tensor,
        cache: Option<&mut KvCache>,
        req: &ForwardRequest,
        key_mask: Option<&Tensor>,
    ) -> TargetOutput {
        tch::no_grad(|| {
            let size = input_ids.size();
            let (batch, seq) = (size[0], size[size.len() - 1]);
            let past = cache.as_ref().map_or(0, |c| c.len);
            let eps = self.config.rms_norm_eps;
            let positions = Tensor::arange_start(past, past + seq, (Kind::Int64, self.device));
            let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
            // Queries sit at positions past..past+seq; key j is visible to query i when
            // j <= past + i. Without past keys that is the plain causal mask.
            let visible = || {
                let k_pos = Tensor::arange(past + seq, (Kind::Int64, self.device));
                k_pos.unsqueeze(0).le_tensor(&positions.unsqueeze(1))
            };
            let (mask, causal) = match key_mask {
                Some(km) => {
                    assert_eq!(
                        km.size(),
                        [batch, past + seq],
                        "key_mask must be [batch, past + seq]"
                    );
                    let k_pos = Tensor::arange(past + seq, (Kind::Int64, self.device));
                    let own = k_pos.unsqueeze(0).eq_tensor(&positions.unsqueeze(1));
                    let real =
                        km.to_device(self.device)
                            .to_kind(Kind::Bool)
                            .view([batch, 1, past + seq]);
                    // [batch, 1 (heads), seq, keys]
                    let m = visible()
                        .unsqueeze(0)
                        .logical_and(&real.logical_or(&own.unsqueeze(0)));
                    (Some(m.unsqueeze(1)), false)
                }
                None if past > 0 && seq > 1 => (Some(visible()), false),
                None => (None, past == 0 && seq > 1),
            };
            let needs_all = req.final_hidden || req.logits || cache.is_some();
            let last_layer = if needs_all {
                self.layers.len()
            } else {
                req.tap_layers.iter().map(|&l| l + 1).max().unwrap_or(0)
            };
            let real_new = key_mask.map(|km| {
                km.to_device(self.device)
                    .to_kind(Kind::Bool)
                    .narrow(1, past, seq)
            });
            let before = cache
                .as_ref()
                .filter(|c| c.keeps_step_states())
                .map(|c| c.states_now());
            let mut mixing = Mixing {
                cache,
                mask,
                causal,
                padded_step: key_mask.is_some() && seq == 1,
                real_new,
                steps: Vec::new(),
            };

            let ids = input_ids.to_device(self.device).view([batch, seq]);
            let x = Tensor::embedding(&self.embed_tokens, &ids, -1, false, false);
            let (x, taps) =
                self.decoder_layers(x, (&cos, &sin), last_layer, &req.tap_layers, &mut mixing);
            if let Some(c) = mixing.cache {
                c.len = past + seq;
                if let Some(before) = before {
                    c.record_steps(past, before, mixing.steps, seq);
                }
            }
            let features = concat_taps(taps, &x);
            let (final_hidden, logits) = if req.final_hidden || req.logits {
                let hidden = self.norm.forward(&x, eps, self.fused.as_ref());
                let logits = req.logits.then(|| self.logits(&hidden));
                (req.final_hidden.then_some(hidden), logits)
            } else {
                (None, None)
            };
            TargetOutput {
                features,
                final_hidden,
                logits,
            }
        })
    }
}

/// What the token-mixing layers of one [`TargetModel::run_padded`] share: the cache, the
/// attention mask, the padding of the new tokens, and the Gated DeltaNet states kept per token.
struct Mixing<'a> {
    cache: Option<&'a mut KvCache>,
    mask: Option<Tensor>,
    causal: bool,
    /// A padded batch's one-token step: attention by plain products ([`masked_attention`]).
    padded_step: bool,
    /// [batch, seq] bool: the new tokens that are real (None: all).
    real_new: Option<Tensor>,
    /// Per Gated DeltaNet layer, its states after each new token (when the cache keeps them).
    steps: Vec<(usize, Vec<GdnState>)>,
}

impl Mixing<'_> {
    /// Attention of layer `idx`'s rotated queries [B, heads, L, d] over the cached and new keys
    /// and values [B, kv_heads, L, d] (appended to the cache): [B, heads, L, d].
    fn attend(&mut self, idx: usize, q: &Tensor, k: Tensor, v: Tensor) -> Tensor {
        let (k, v) = match self.cache.as_deref_mut() {
            Some(c) => c.append(idx, k, v),
            None => (k, v),
        };
        match (&self.mask, self.padded_step) {
            (Some(m), true) => masked_attention(q, &k, &v, m),
            _ => attention(q, &k, &v, self.mask.as_ref(), self.causal),
        }
    }

    /// Gated DeltaNet layer `idx` over its normed input `x` [B, L, H], continuing and updating
    /// the cache's states.
    fn delta_net(&mut self, idx: usize, layer: &GatedDeltaNet, x: &Tensor) -> Tensor {
        let real = self.real_new.as_ref();
        let Some(cache) = self.cache.as_deref_mut() else {
            return layer.step(x, None, real).0;
        };
        let state = cache.gdn_state(idx).map(GdnState::shallow_clone);
        if cache.keeps_step_states() {
            let (out, states) = layer.step_each(x, state.as_ref(), real);
            if let Some(last) = states.last() {
                cache.set_gdn_state(idx, last.shallow_clone());
            }
            self.steps.push((idx, states));
            return out;
        }
        let (out, new_state) = layer.step(x, state.as_ref(), real);
        cache.set_gdn_state(idx, new_state);
        out
    }
}

impl TargetModel {
    /// The decoder layers `0..last_layer` over the embedded inputs `x` [B, L, H] at the
    /// rotary angles `rope` (cos, signed sin, [L, d]), mixing tokens through `mixing` (which
    /// owns the cache). Returns the last residual stream and the outputs of the `taps` layers,
    /// in order (`None` where a tap lies past `last_layer`).
    fn decoder_layers(
        &self,
        mut x: Tensor,
        rope: (&Tensor, &Tensor),
        last_layer: usize,
        taps: &[usize],
        mixing: &mut Mixing,
    ) -> (Tensor, Vec<Option<Tensor>>) {
        let cfg = &self.config;
        let eps = cfg.rms_norm_eps;
        let shape = AttentionShape {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            eps,
        };
        let (cos, sin) = rope;
        let kernels = self.fused.as_ref();
        let mut tapped: Vec<Option<Tensor>> = taps.iter().map(|_| None).collect();
        for (idx, layer) in self.layers.iter().enumerate().take(last_layer) {
            match layer {
                TargetLayer::Decoder(layer) => {
                    let h = rms_norm(&x, &layer.input_norm, eps);
                    let (q, k, v) = layer
                        .attn
                        .project_qkv_rotated_with(&h, shape, rope, kernels);
                    let a = mixing.attend(idx, &q, k, v);
                    layer.attn.add_output(&mut x, &a);
                    let normed = rms_norm(&x, &layer.post_norm, eps);
                    layer.mlp.add_forward_with(&mut x, &normed, kernels);
                }
                TargetLayer::Hybrid(layer) => {
                    let h = layer.input_norm.forward(&x, kernels);
                    match &layer.mixer {
                        Mixer::Attention(attn) => {
                            let [q, k, v, projected] = attn.project(&h, cos, sin, kernels);
                            let a = mixing.attend(idx, &q, k, v);
                            attn.add_output(&mut x, &a, &projected, kernels);
                        }
                        Mixer::DeltaNet(net) => {
                            x += mixing.delta_net(idx, net, &h);
                        }
                    }
                    layer.add_mlp(&mut x, kernels);
                }
            }
            record_taps(&mut tapped, taps, idx, &x);
        }
        (x, tapped)
    }
}

/// After layer `idx`: a copy of its output `x` into the slot of each tap on that layer.
fn record_taps(tapped: &mut [Option<Tensor>], taps: &[usize], idx: usize, x: &Tensor) {
    for (slot, &tap) in tapped.iter_mut().zip(taps) {
        if tap == idx {
            *slot = Some(x.copy());
        }
    }
}

/// The tapped layers' outputs concatenated on the hidden axis (zeros for a tap never reached).
fn concat_taps(taps: Vec<Option<Tensor>>, x: &Tensor) -> Option<Tensor> {
    if taps.is_empty() {
        return None;
    }
    let taps: Vec<Tensor> = taps
        .into_iter()
        .map(|t| t.unwrap_or_else(|| x.zeros_like()))
        .collect();
    Some(Tensor::cat(&taps, -1))
}

/// Attention of the queries `q` [B, heads, S, D] over `k`, `v` [B, kv_heads, L, D] under a
/// boolean `mask` [B, 1, S, L] (true = visible), as plain batched matrix products; the heads of a
/// group read their shared keys without copies. Used for padded decoding steps (S = 1): the
/// fused kernels would pick and plan a kernel anew for every key length.
fn masked_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Tensor {
    let (b, h, s, d) = q.size4().unwrap_or((0, 0, 0, 0));
    let (kv_heads, len) = (k.size()[1], k.size()[2]);
    let g = h / kv_heads.max(1);
    let q = q.reshape([b, kv_heads, g * s, d]);
    let scores = q.matmul(&k.transpose(-2, -1)).to_kind(Kind::Float) * (1.0 / (d as f64).sqrt());
    let hidden = mask
        .unsqueeze(2)
        .expand([b, 1, g, s, len], false)
        .reshape([b, 1, g * s, len])
        .logical_not();
    let p = scores
        .masked_fill(&hidden, f64::NEG_INFINITY)
        .softmax(-1, Kind::Float)
        .to_kind(v.kind());
    p.matmul(v).reshape([b, h, s, d])
}

/// A target model shared by the workers of one device.
///
/// libtorch tensors are not `Sync` in tch because in general they can be mutated in place.
/// A target's weights never are: they are loaded once, carry no gradient, and every forward
/// runs under `no_grad` and only reads them, which libtorch supports from several threads at
/// once (as PyTorch's own multi-threaded inference does).
pub struct SharedTarget(TargetModel);

// SAFETY: see the type's documentation: only read-only forwards reach the tensors, and
// `TargetModel` exposes no method that mutates its weights; the one lazily made tensor (the
// float32 LM head) is set once through a `OnceLock`.
unsafe impl Sync for SharedTarget {}

impl SharedTarget {
    pub fn new(model: TargetModel) -> Self {
        SharedTarget(model)
    }
}

impl std::ops::Deref for SharedTarget {
    type Target = TargetModel;
    fn deref(&self) -> &TargetModel {
        &self.0
    }
}
