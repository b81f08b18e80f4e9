//! The Llama-family target model in tch: RMSNorm, RoPE, grouped-query attention through
//! libtorch's fused `scaled_dot_product_attention`, SwiGLU MLP, tied or untied LM head.
//! Frozen: weights carry no gradients and every forward runs without autograd.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::config::TargetConfig;
use super::weights::WeightFiles;

struct DecoderLayer {
    input_norm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    post_norm: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

/// Keys and values of past positions, per layer: [batch, kv_heads, len, head_dim].
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: i64,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of cached positions.
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rolls back to the first `len` positions (used when draft tokens are rejected).
    pub fn truncate(&mut self, len: i64) {
        if len >= self.len {
            return;
        }
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.narrow(2, 0, len);
            *v = v.narrow(2, 0, len);
        }
        self.len = len;
    }

    fn append(&mut self, layer: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        let merged = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[pk, k], 2), Tensor::cat(&[pv, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some((merged.0.shallow_clone(), merged.1.shallow_clone()));
        merged
    }
}

/// A loaded target model.
pub struct LlamaModel {
    pub config: TargetConfig,
    pub device: Device,
    pub kind: Kind,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Tensor,
}

impl std::fmt::Debug for LlamaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModel")
            .field("layers", &self.layers.len())
            .field("device", &self.device)
            .field("kind", &self.kind)
            .finish()
    }
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let x32 = x.to_kind(Kind::Float);
    let var = x32.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    (x32 * (var + eps).rsqrt()).to_kind(x.kind()) * weight
}

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[x2.neg(), x1], -1)
}

impl LlamaModel {
    /// Loads config.json and the safetensors weights of a Hugging Face model folder.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config = TargetConfig::from_model_dir(dir)?;
        let weights = WeightFiles::open(dir)?;
        Self::from_weights(config, &weights, device, kind)
            .with_context(|| format!("{}: cannot load the model", dir.display()))
    }

    pub fn from_weights(
        config: TargetConfig,
        weights: &WeightFiles,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let h = config.hidden_size;
        let i = config.intermediate_size;
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
        let mut layers = Vec::with_capacity(config.num_hidden_layers as usize);
        for l in 0..config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let bias = |name: &str, len: i64| -> Result<Option<Tensor>> {
                let full = format!("{p}.self_attn.{name}.bias");
                if config.attention_bias || weights.contains(&full) {
                    Ok(Some(load(&full, &[len])?))
                } else {
                    Ok(None)
                }
            };
            layers.push(DecoderLayer {
                input_norm: load(&format!("{p}.input_layernorm.weight"), &[h])?,
                q_proj: load(&format!("{p}.self_attn.q_proj.weight"), &[q_dim, h])?,
                k_proj: load(&format!("{p}.self_attn.k_proj.weight"), &[kv_dim, h])?,
                v_proj: load(&format!("{p}.self_attn.v_proj.weight"), &[kv_dim, h])?,
                o_proj: load(&format!("{p}.self_attn.o_proj.weight"), &[h, q_dim])?,
                q_bias: bias("q_proj", q_dim)?,
                k_bias: bias("k_proj", kv_dim)?,
                v_bias: bias("v_proj", kv_dim)?,
                post_norm: load(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                gate_proj: load(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                up_proj: load(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                down_proj: load(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
            });
        }
        let norm = load("model.norm.weight", &[h])?;
        let inv_freq = {
            let exponents = Tensor::arange_start_step(0, d, 2, (Kind::Float, device)) / d as f64;
            (Tensor::from(config.rope_theta as f32).to_device(device))
                .pow(&exponents)
                .reciprocal()
        };
        Ok(LlamaModel {
            config,
            device,
            kind,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn parameter_count(&self) -> i64 {
        let mut n = self.embed_tokens.numel() as i64 + self.norm.numel() as i64;
        if !self.config.tie_word_embeddings {
            n += self.lm_head.numel() as i64;
        }
        for l in &self.layers {
            for t in [
                &l.input_norm,
                &l.q_proj,
                &l.k_proj,
                &l.v_proj,
                &l.o_proj,
                &l.post_norm,
                &l.gate_proj,
                &l.up_proj,
                &l.down_proj,
            ] {
                n += t.numel() as i64;
            }
            for b in [&l.q_bias, &l.k_bias, &l.v_bias].into_iter().flatten() {
                n += b.numel() as i64;
            }
        }
        n
    }

    /// cos and sin for positions `start..start+len`: [len, head_dim].
    fn rope(&self, start: i64, len: i64) -> (Tensor, Tensor) {
        let pos = Tensor::arange_start(start, start + len, (Kind::Float, self.device));
        let freqs = pos.unsqueeze(1) * self.inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos().to_kind(self.kind), emb.sin().to_kind(self.kind))
    }

    /// Final-normed hidden states [batch, seq, hidden] for `input_ids` [batch, seq] that
    /// continue the positions held in `cache` (or start at 0 without one).
    pub fn forward_hidden(&self, input_ids: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        tch::no_grad(|| self.forward_hidden_inner(input_ids, cache))
    }

    /// Next-token logits [batch, seq, vocab] in float32.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        tch::no_grad(|| {
            let hidden = self.forward_hidden_inner(input_ids, cache);
            self.logits(&hidden)
        })
    }

    /// LM head over final-normed hidden states, in float32.
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        tch::no_grad(|| {
            hidden
                .linear::<&Tensor>(&self.lm_head, None)
                .to_kind(Kind::Float)
        })
    }

    fn forward_hidden_inner(&self, input_ids: &Tensor, mut cache: Option<&mut KvCache>) -> Tensor {
        let (batch, seq) = input_ids.size2().expect("input_ids must be [batch, seq]");
        let past = cache.as_ref().map_or(0, |c| c.len);
        let cfg = &self.config;
        let (heads, kv_heads, d) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let (cos, sin) = self.rope(past, seq);
        // Queries of this call sit at positions past..past+seq; key j is visible to query i when
        // j <= past + i. Without past keys that is the plain causal mask.
        let mask = if past > 0 && seq > 1 {
            let q_pos = Tensor::arange_start(past, past + seq, (Kind::Int64, self.device));
            let k_pos = Tensor::arange(past + seq, (Kind::Int64, self.device));
            Some(k_pos.unsqueeze(0).le_tensor(&q_pos.unsqueeze(1)))
        } else {
            None
        };
        let is_causal = past == 0 && seq > 1;

        let mut x = Tensor::embedding(
            &self.embed_tokens,
            &input_ids.to_device(self.device),
            -1,
            false,
            false,
        );
        for (idx, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps);
            let project = |w: &Tensor, b: &Option<Tensor>, n: i64| {
                h.linear(w, b.as_ref())
                    .view([batch, seq, n, d])
                    .transpose(1, 2)
            };
            let q = project(&layer.q_proj, &layer.q_bias, heads);
            let k = project(&layer.k_proj, &layer.k_bias, kv_heads);
            let v = project(&layer.v_proj, &layer.v_bias, kv_heads);
            let q = &q * &cos + rotate_half(&q) * &sin;
            let k = &k * &cos + rotate_half(&k) * &sin;
            let (k, v) = match cache.as_deref_mut() {
                Some(c) => c.append(idx, k, v),
                None => (k, v),
            };
            let attn = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                mask.as_ref(),
                0.0,
                is_causal,
                None,
                kv_heads != heads,
            );
            let attn = attn
                .transpose(1, 2)
                .contiguous()
                .view([batch, seq, heads * d]);
            x += attn.linear::<&Tensor>(&layer.o_proj, None);
            let h = rms_norm(&x, &layer.post_norm, cfg.rms_norm_eps);
            let gated = h.linear::<&Tensor>(&layer.gate_proj, None).silu()
                * h.linear::<&Tensor>(&layer.up_proj, None);
            x += gated.linear::<&Tensor>(&layer.down_proj, None);
        }
        if let Some(c) = cache {
            c.len = past + seq;
        }
        rms_norm(&x, &self.norm, cfg.rms_norm_eps)
    }
}
