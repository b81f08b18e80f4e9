//! The DFlash drafter (dflash spec §1-2): Qwen3-style layers with the target's dimensions,
//! `fc` + `hidden_norm` fusion of the tapped target features, KV injection of that context in
//! every layer, the target's frozen embedding and LM head, its own final norm.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::drafter_config::DrafterConfig;
use super::layers::{
    attention, attention_with_bias, rms_norm, upload, AttentionWeights, Mlp, Rope,
};
use super::slots::{SlotBatch, SlotCache};
use super::target::TargetModel;
use super::weights::WeightFiles;
use crate::fsutil::StagedDir;

/// The target's frozen input embedding and LM head, on the drafter's device.
#[derive(Debug)]
pub struct FrozenHead {
    pub embed_tokens: Tensor,
    pub lm_head: Tensor,
}

impl FrozenHead {
    /// Shares the target's tensors when the devices and dtypes match, copies otherwise.
    pub fn from_target(target: &TargetModel, device: Device, kind: Kind) -> Self {
        let take = |t: &Tensor| t.to_device(device).to_kind(kind).detach();
        FrozenHead {
            embed_tokens: take(target.embed_tokens()),
            lm_head: take(target.lm_head()),
        }
    }
}

struct DrafterLayer {
    input_norm: Tensor,
    attn: AttentionWeights,
    post_norm: Tensor,
    mlp: Mlp,
}

/// A DFlash drafter.
pub struct Drafter {
    pub config: DrafterConfig,
    pub device: Device,
    pub kind: Kind,
    layers: Vec<DrafterLayer>,
    fc: Tensor,
    hidden_norm: Tensor,
    norm: Tensor,
    rope: Rope,
    train_attention: TrainAttention,
}

impl std::fmt::Debug for Drafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drafter")
            .field("layers", &self.layers.len())
            .field("block_size", &self.config.block_size)
            .field("device", &self.device)
            .field("kind", &self.kind)
            .field("train_attention", &self.train_attention)
            .finish()
    }
}

/// Training input: sequences and the anchors of their blocks (spec §2).
#[derive(Debug)]
pub struct AnchorBatch {
    /// [B, S] int64 token ids.
    pub input_ids: Tensor,
    /// [B, N] int64 anchor positions, sorted ascending per row; padded entries may hold any
    /// position in 0..S.
    pub anchors: Tensor,
    /// [B, N] bool: false for padding blocks (zero loss weight).
    pub valid: Tensor,
}

/// How [`Drafter::forward_train`] computes the attention of its N anchor blocks (spec §2.4).
/// Both formulations are exact; they differ in cost only.
///
/// - `Dense`: one fused attention call per layer over all N*B block queries of a sequence
///   against [context (S); all N*B block keys] with one boolean mask. Only B of the N*B block
///   keys are visible to a query, so for large N the block-block part (N*B x N*B) dominates
///   the cost. Kept as the reference.
/// - `Chunked`: the N (sorted) blocks of a sequence are cut into chunks of consecutive blocks;
///   each chunk's queries attend over [context (S); the chunk's own block keys] only, every
///   chunk of the batch in one fused call (chunks along the batch axis). Cost per query:
///   S + C*B keys instead of S + N*B. The context keys and values are copied once per chunk
///   (N/C copies). `blocks_per_chunk` is C; 0 chooses it from S (see
///   [`TrainAttention::blocks_per_chunk`]). The context is padded to a bucketed length and
///   the chunks go through fused calls of a fixed size, so that the calls' shapes repeat.
///
/// Text form (for configs): `dense`, `chunked` (automatic chunk size), `chunked:C`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TrainAttention {
    Dense,
    Chunked { blocks_per_chunk: usize },
}

impl Default for TrainAttention {
    fn default() -> Self {
        TrainAttention::AUTO
    }
}

impl TrainAttention {
    /// The automatic chunk size with the default `Chunked { blocks_per_chunk: 0 }`.
    pub const AUTO: TrainAttention = TrainAttention::Chunked {
        blocks_per_chunk: 0,
    };

    /// The number of blocks per chunk actually used for `n` blocks of `block` tokens per
    /// sequence, against `context` positions, with `heads` query heads and `kv_heads` key/value
    /// heads; `None` for `Dense`.
    ///
    /// Automatic choice: per query, the fused kernel's work grows with the keys it reads,
    /// S + C*B, while copying the context keys and values once per chunk costs about
    /// S * kv_heads * head_dim / (C*B) per query (memory traffic, forward and backward). The
    /// sum is smallest at C*B = sqrt(r * S) with r = 640 * kv_heads / heads (measured on an
    /// H200 with cuDNN's fused attention, head_dim 128: the step time falls from C = 4 to
    /// C = 32 at S = 1522, for 16/8 and 32/8 heads); the optimum is flat, so C is rounded to a
    /// power of two. Examples (GQA 32/8 heads, B = 16): S = 256 -> 16, S = 1024 -> 32,
    /// S = 3072 -> 32, S = 8192 -> 64.
    ///
    /// C does not depend on the number of blocks: with the bucketed context length
    /// ([`context_bucket`]) it fixes the shape of every fused attention call, and a fused
    /// kernel builds its plan once per shape.
    pub fn blocks_per_chunk(
        &self,
        block: i64,
        context: i64,
        heads: i64,
        kv_heads: i64,
    ) -> Option<i64> {
        let TrainAttention::Chunked { blocks_per_chunk } = *self else {
            return None;
        };
        let c = if blocks_per_chunk > 0 {
            blocks_per_chunk as i64
        } else {
            let r = 640.0 * kv_heads.max(1) as f64 / heads.max(1) as f64;
            let rows = (r * context.max(1) as f64).sqrt();
            let c = (rows / block.max(1) as f64).max(1.0);
            1i64 << (c.log2().round() as i64).clamp(0, 20)
        };
        Some(c.max(1))
    }
}

/// The context length the chunked training attention pads `s` to: a multiple of 1/16 of the
/// largest power of two not above `s`, and of at least 128 (128 up to 4096, 256 up to 8192,
/// ...): fewer than max(128, s/16) padding keys, 24 distinct lengths up to 3072. Fused
/// attention kernels (cuDNN's) build a plan per shape, tens of milliseconds of host time
/// each: with raw sequence lengths nearly every batch would build new ones.
pub fn context_bucket(s: i64) -> i64 {
    let s = s.max(1);
    let floor_pow2 = 1i64 << (63 - s.leading_zeros() as i64);
    let step = (floor_pow2 / 16).max(128);
    (s + step - 1) / step * step
}

/// Chunks per fused attention call of the chunked training attention: a fixed batch size, so
/// that a call's shape depends only on the bucketed context length.
const CHUNKS_PER_CALL: i64 = 8;

impl fmt::Display for TrainAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainAttention::Dense => write!(f, "dense"),
            TrainAttention::Chunked {
                blocks_per_chunk: 0,
            } => write!(f, "chunked"),
            TrainAttention::Chunked { blocks_per_chunk } => write!(f, "chunked:{blocks_per_chunk}"),
        }
    }
}

impl FromStr for TrainAttention {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "dense" => Ok(TrainAttention::Dense),
            "chunked" | "chunked:auto" | "chunked:0" => Ok(TrainAttention::AUTO),
            _ => {
                let c = t
                    .strip_prefix("chunked:")
                    .and_then(|c| c.trim().parse::<usize>().ok())
                    .filter(|&c| (1..=1 << 20).contains(&c));
                match c {
                    Some(blocks_per_chunk) => Ok(TrainAttention::Chunked { blocks_per_chunk }),
                    None => bail!(
                        "attention {s:?}: expected \"dense\", \"chunked\" (automatic chunk size) or \"chunked:C\" with C blocks per chunk, 1 <= C <= 1048576"
                    ),
                }
            }
        }
    }
}

impl TryFrom<String> for TrainAttention {
    type Error = anyhow::Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<TrainAttention> for String {
    fn from(a: TrainAttention) -> String {
        a.to_string()
    }
}

/// The attention of one layer's block queries.
#[derive(Clone, Copy)]
enum BlockAttention<'a> {
    /// Against [context; all blocks], with an optional boolean mask [B, 1, Q, S + Q].
    Full(Option<&'a Tensor>),
    /// Per chunk of blocks (see [`TrainAttention`]).
    Chunked(&'a ChunkPlan),
}

/// The layout shared by every layer of one chunked training forward.
struct ChunkPlan {
    /// Chunks per sequence (K).
    chunks: i64,
    /// Query rows per chunk (C * block).
    rows: i64,
    /// Additive mask [batch * K, 1, rows, S + rows] of the compute kind: 0 where visible,
    /// -inf elsewhere (what the fused kernels turn a boolean mask into); its rows are
    /// padded in memory to a multiple of 16 elements so that the memory-efficient kernel
    /// takes it without a copy. Built once, shared by every layer (and saved once for the
    /// backward pass instead of once per layer).
    bias: Tensor,
    /// Whether grouped-query heads must be expanded for a fused kernel to take the call.
    expand_kv: std::cell::Cell<Option<bool>>,
}

/// The public tensor names of a drafter with `layers` layers (spec §6), in a fixed order.
pub fn tensor_names(layers: i64) -> Vec<String> {
    let mut names = Vec::new();
    for i in 0..layers {
        for part in [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ] {
            names.push(format!("layers.{i}.{part}"));
        }
    }
    names.extend(["fc.weight", "hidden_norm.weight", "norm.weight"].map(String::from));
    names
}

impl Drafter {
    /// The shape of every tensor, by public name.
    pub fn tensor_shape(config: &DrafterConfig, name: &str) -> Option<Vec<i64>> {
        let h = config.hidden_size;
        let d = config.head_dim;
        let q = config.num_attention_heads * d;
        let kv = config.num_key_value_heads * d;
        let i = config.intermediate_size;
        let k = config.num_taps() as i64;
        let part = match name.strip_prefix("layers.") {
            Some(rest) => rest.split_once('.')?.1,
            None => name,
        };
        Some(match part {
            "self_attn.q_proj.weight" => vec![q, h],
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, h],
            "self_attn.o_proj.weight" => vec![h, q],
            "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![d],
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![i, h],
            "mlp.down_proj.weight" => vec![h, i],
            "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![h],
            "fc.weight" => vec![h, k * h],
            "hidden_norm.weight" | "norm.weight" => vec![h],
            _ => return None,
        })
    }

    /// Builds the drafter from a source of tensors by name.
    fn build(
        config: DrafterConfig,
        device: Device,
        kind: Kind,
        mut get: impl FnMut(&str, &[i64]) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut take = |name: String| -> Result<Tensor> {
            let shape = Self::tensor_shape(&config, &name)
                .with_context(|| format!("no shape for {name}"))?;
            get(&name, &shape)
        };
        let mut layers = Vec::new();
        for l in 0..config.num_hidden_layers {
            let p = |s: &str| format!("layers.{l}.{s}");
            layers.push(DrafterLayer {
                attn: AttentionWeights {
                    q_proj: take(p("self_attn.q_proj.weight"))?,
                    k_proj: take(p("self_attn.k_proj.weight"))?,
                    v_proj: take(p("self_attn.v_proj.weight"))?,
                    o_proj: take(p("self_attn.o_proj.weight"))?,
                    q_bias: None,
                    k_bias: None,
                    v_bias: None,
                    q_norm: Some(take(p("self_attn.q_norm.weight"))?),
                    k_norm: Some(take(p("self_attn.k_norm.weight"))?),
                    fused: None,
                },
                mlp: Mlp {
                    gate_proj: take(p("mlp.gate_proj.weight"))?,
                    up_proj: take(p("mlp.up_proj.weight"))?,
                    down_proj: take(p("mlp.down_proj.weight"))?,
                    fused: None,
                },
                input_norm: take(p("input_layernorm.weight"))?,
                post_norm: take(p("post_attention_layernorm.weight"))?,
            });
        }
        let fc = take("fc.weight".into())?;
        let hidden_norm = take("hidden_norm.weight".into())?;
        let norm = take("norm.weight".into())?;
        let rope = Rope::new(&config.as_rope_config(), device)?;
        Ok(Drafter {
            config,
            device,
            kind,
            layers,
            fc,
            hidden_norm,
            norm,
            rope,
            train_attention: TrainAttention::default(),
        })
    }

    /// A freshly initialised drafter: weights N(0, 0.02), norms at 1 (spec §4), drawn from
    /// generators of its own seeded with `seed` (libtorch's global generator is shared by every
    /// thread of the process, so the same seed would not give the same drafter). Each tensor is
    /// drawn in chunks of its own generator, in parallel: a drafter of an 8B target has about
    /// a billion weights.
    pub fn init(config: DrafterConfig, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        Self::build(config, device, kind, |name, shape| {
            let t = if shape.len() == 1 {
                Tensor::ones(shape, (Kind::Float, Device::Cpu))
            } else {
                let n: i64 = shape.iter().product();
                Tensor::from_slice(&normal_values(n as usize, 0.02, seed, name)).view(shape)
            };
            Ok(t.to_device(device).to_kind(kind).set_requires_grad(true))
        })
    }

    /// Loads a drafter folder (config.json + model.safetensors), checking that the file holds
    /// exactly the public tensors with the right shapes.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        Self::load_checked(dir, None, device, kind)
    }

    /// Like [`Drafter::load`], and first checks that the drafter fits `target` (hidden size,
    /// vocabulary, layer count).
    pub fn load_for_target(
        dir: &Path,
        target: &super::config::TargetConfig,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        Self::load_checked(dir, Some(target), device, kind)
    }

    /// The configuration of the drafter in `dir`, checked against the target (no weights read).
    pub fn config_for_target(
        dir: &Path,
        target: &super::config::TargetConfig,
    ) -> Result<DrafterConfig> {
        let config = DrafterConfig::from_dir(dir)?;
        config.check_against(target).with_context(|| {
            format!(
                "{}: the drafter does not fit the target",
                dir.join("config.json").display()
            )
        })?;
        Ok(config)
    }

    fn load_checked(
        dir: &Path,
        target: Option<&super::config::TargetConfig>,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let config = match target {
            Some(target) => Self::config_for_target(dir, target)?,
            None => DrafterConfig::from_dir(dir)?,
        };
        let weights = WeightFiles::open(dir)?;
        let file = dir.join("model.safetensors");
        let expected: BTreeSet<String> =
            tensor_names(config.num_hidden_layers).into_iter().collect();
        let found: BTreeSet<String> = weights.names().map(str::to_string).collect();
        if let Some(extra) = found.difference(&expected).next() {
            bail!(
                "{}: unexpected tensor {extra:?}: not part of a {}-layer DFlash drafter",
                file.display(),
                config.num_hidden_layers
            );
        }
        if let Some(missing) = expected.difference(&found).next() {
            bail!("{}: tensor {missing:?} is missing", file.display());
        }
        let drafter = Self::build(config, device, kind, |name, shape| {
            Ok(weights
                .load(name, shape, kind, device)?
                .set_requires_grad(true))
        })?;
        log::info!("{}: {}", dir.display(), drafter.describe());
        Ok(drafter)
    }

    /// Every parameter with its public name, in [`tensor_names`] order.
    pub fn named_parameters(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let a = &l.attn;
            let norms = (a.q_norm.as_ref(), a.k_norm.as_ref());
            let (Some(q_norm), Some(k_norm)) = norms else {
                continue;
            };
            for (part, t) in [
                ("self_attn.q_proj.weight", &a.q_proj),
                ("self_attn.k_proj.weight", &a.k_proj),
                ("self_attn.v_proj.weight", &a.v_proj),
                ("self_attn.o_proj.weight", &a.o_proj),
                ("self_attn.q_norm.weight", q_norm),
                ("self_attn.k_norm.weight", k_norm),
                ("mlp.gate_proj.weight", &l.mlp.gate_proj),
                ("mlp.up_proj.weight", &l.mlp.up_proj),
                ("mlp.down_proj.weight", &l.mlp.down_proj),
                ("input_layernorm.weight", &l.input_norm),
                ("post_attention_layernorm.weight", &l.post_norm),
            ] {
                out.push((format!("layers.{i}.{part}"), t));
            }
        }
        out.push(("fc.weight".into(), &self.fc));
        out.push(("hidden_norm.weight".into(), &self.hidden_norm));
        out.push(("norm.weight".into(), &self.norm));
        out
    }

    pub fn parameter_count(&self) -> i64 {
        self.named_parameters()
            .iter()
            .map(|(_, t)| t.numel() as i64)
            .sum()
    }

    /// One line for logs: size and memory estimate.
    pub fn describe(&self) -> String {
        let n = self.parameter_count() as f64;
        let bytes = match self.kind {
            Kind::Float => 4.0,
            Kind::Double => 8.0,
            _ => 2.0,
        };
        format!(
            "DFlash drafter: {} layers, block size {}, taps {:?}, mask token {}, {:.2} M parameters; weights {:.1} MiB as {:?}, training state about {:.1} MiB (fp32 master weights, AdamW moments, gradients)",
            self.config.num_hidden_layers,
            self.config.block_size,
            self.config.target_layer_ids(),
            self.config.mask_token_id(),
            n / 1e6,
            n * bytes / (1u64 << 20) as f64,
            self.kind,
            n * 16.0 / (1u64 << 20) as f64,
        )
    }

    /// Writes a servable checkpoint: config.json + model.safetensors (bf16, public names). The
    /// folder appears only when complete.
    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        let staged = StagedDir::create(dir)?;
        self.config.write(&staged.path().join("config.json"))?;
        let tensors: Vec<(String, Tensor)> = self
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.detach().to_kind(Kind::BFloat16)))
            .collect();
        super::weights::save_safetensors(&staged.path().join("model.safetensors"), &tensors)?;
        staged.commit()
    }

    /// `ctx = hidden_norm(fc(features))`: [B, S, K*H] -> [B, S, H].
    fn fuse_context(&self, features: &Tensor) -> Tensor {
        let f = features.to_device(self.device).to_kind(self.kind);
        rms_norm(
            &f.linear::<&Tensor>(&self.fc, None),
            &self.hidden_norm,
            self.config.rms_norm_eps,
        )
    }

    fn layer_forward(
        &self,
        layer: &DrafterLayer,
        h: &Tensor,
        ctx_kv: (&Tensor, &Tensor),
        block_rope: (&Tensor, &Tensor),
        attn: BlockAttention<'_>,
    ) -> Tensor {
        let c = &self.config;
        let (heads, kv_heads, d, eps) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
        );
        let x = rms_norm(h, &layer.input_norm, eps);
        // Queries and the block's keys share the block positions.
        let (cos, sin) = block_rope;
        let q = Rope::apply(&layer.attn.queries(&x, heads, d, eps), cos, sin);
        let k_block = Rope::apply(&layer.attn.keys(&x, kv_heads, d, eps), cos, sin);
        let v_block = layer.attn.values(&x, kv_heads, d);
        let a = match attn {
            BlockAttention::Full(mask) => {
                let k = Tensor::cat(&[ctx_kv.0, &k_block], 2);
                let v = Tensor::cat(&[ctx_kv.1, &v_block], 2);
                layer.attn.output(&attention(&q, &k, &v, mask, false))
            }
            BlockAttention::Chunked(plan) => {
                let rows = chunked_attention(&q, ctx_kv, (&k_block, &v_block), plan);
                rows.linear::<&Tensor>(&layer.attn.o_proj, None)
            }
        };
        let h = h + a;
        let m = layer.mlp.forward(&rms_norm(&h, &layer.post_norm, eps));
        h + m
    }

    /// Keys (normed, rotated) and values of the context for one layer: [B, kv_heads, S, d].
    fn context_kv(
        &self,
        layer: &DrafterLayer,
        ctx: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> (Tensor, Tensor) {
        let c = &self.config;
        let (k, v) = layer
            .attn
            .project_kv(ctx, c.num_key_value_heads, c.head_dim, c.rms_norm_eps);
        (Rope::apply(&k, cos, sin), v)
    }

    /// The formulation [`Drafter::forward_train`] uses (default: chunked, automatic size).
    pub fn train_attention(&self) -> TrainAttention {
        self.train_attention
    }

    /// Chooses the formulation of the training attention; both are exact.
    pub fn set_train_attention(&mut self, attention: TrainAttention) {
        self.train_attention = attention;
    }

    /// [`Drafter::set_train_attention`], by value.
    pub fn with_train_attention(mut self, attention: TrainAttention) -> Self {
        self.train_attention = attention;
        self
    }

    /// Training forward over N anchor blocks per sequence (spec §2). `features` [B, S, K*H] are
    /// the tapped target features. Returns the final-normed hidden states [B, N, block, H].
    ///
    /// Visibility: a query in block j sees context positions p < a_j and all positions of its
    /// own block, nothing of any other block. A padding block still sees its own block, so no
    /// row of the attention is empty (no NaN).
    ///
    /// The attention runs as [`Drafter::train_attention`] says. The host never waits for the
    /// device here: host tensors of `batch` go up through pinned memory without blocking.
    pub fn forward_train(
        &self,
        head: &FrozenHead,
        features: &Tensor,
        batch: &AnchorBatch,
    ) -> Tensor {
        self.forward_train_with(head, features, batch, self.train_attention)
    }

    /// [`Drafter::forward_train`] with an explicit formulation of the attention.
    pub fn forward_train_with(
        &self,
        head: &FrozenHead,
        features: &Tensor,
        batch: &AnchorBatch,
        attention: TrainAttention,
    ) -> Tensor {
        let c = &self.config;
        let bs = c.block_size;
        let dev = self.device;
        let (b, s) = batch.input_ids.size2().unwrap_or((0, 0));
        let n = batch.anchors.size()[1];
        let ids = upload(&batch.input_ids, dev).to_kind(Kind::Int64);
        let anchors = upload(&batch.anchors, dev).to_kind(Kind::Int64);

        // Block inputs: [x[a_j], MASK, ..., MASK]
        let first = ids.gather(1, &anchors, false).unsqueeze(-1); // [B, N, 1]
        let masks = Tensor::full([b, n, bs - 1], c.mask_token_id(), (Kind::Int64, dev));
        let block_ids = Tensor::cat(&[first, masks], -1).view([b, n * bs]);
        let mut h =
            Tensor::embedding(&head.embed_tokens, &block_ids, -1, false, false).to_kind(self.kind);

        // Positions: slot k of block j at a_j + k; context position p at p.
        let offsets = Tensor::arange(bs, (Kind::Int64, dev));
        let block_pos = (anchors.unsqueeze(-1) + &offsets).view([b, n * bs]);
        // The chunked attention reads a context padded to a bucketed length (the padding
        // positions lie after every anchor, so no query sees them).
        let chunked = matches!(attention, TrainAttention::Chunked { .. }) && n > 0;
        let s_ctx = if chunked { context_bucket(s) } else { s };
        let ctx_pos = Tensor::arange(s_ctx, (Kind::Int64, dev))
            .unsqueeze(0)
            .expand([b, s_ctx], false);
        let (q_cos, q_sin) = self.rope.cos_sin(&block_pos, self.kind);
        let (q_cos, q_sin) = (q_cos.unsqueeze(1), q_sin.unsqueeze(1));
        let (c_cos, c_sin) = self.rope.cos_sin(&ctx_pos, self.kind);
        let (c_cos, c_sin) = (c_cos.unsqueeze(1), c_sin.unsqueeze(1));

        let per_chunk =
            attention.blocks_per_chunk(bs, s_ctx, c.num_attention_heads, c.num_key_value_heads);
        let dense_mask;
        let plan;
        let attn = match per_chunk {
            Some(cpc) if chunked => {
                plan = self.chunk_plan(&anchors, s_ctx, cpc);
                BlockAttention::Chunked(&plan)
            }
            _ => {
                dense_mask = dense_block_mask(&anchors, s, bs);
                BlockAttention::Full(Some(&dense_mask))
            }
        };

        let ctx = self.fuse_context(features);
        let ctx = if s_ctx > s {
            ctx.constant_pad_nd([0, 0, 0, s_ctx - s])
        } else {
            ctx
        };
        for layer in &self.layers {
            let (ck, cv) = self.context_kv(layer, &ctx, &c_cos, &c_sin);
            h = self.layer_forward(layer, &h, (&ck, &cv), (&q_cos, &q_sin), attn);
        }
        rms_norm(&h, &self.norm, self.config.rms_norm_eps).view([b, n, bs, -1])
    }

    /// Runs one chunked training forward and backward (on zeros; the gradients are reset) per
    /// bucketed context length up to `max_len`, so that the fused attention kernels build their
    /// per-shape plans now instead of during the first steps of training (cuDNN's take tens of
    /// milliseconds each, per thread). Only on CUDA with the chunked attention; returns the
    /// number of context lengths warmed.
    pub fn warm_up_attention(&self, head: &FrozenHead, max_len: usize) -> usize {
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
    fn chunk_plan(&self, anchors: &Tensor, s: i64, per_chunk: i64) -> ChunkPlan {
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

    /// Decoding over a [`SlotCache`] (see [`crate::model::decode`]): writes the context keys and
    /// values of the target features `features` [c, K*H] of newly accepted tokens to the rows
    /// and positions of `batch` (c tokens). The context only ever serves as keys, so nothing
    /// attends here.
    pub fn append_context_slots(
        &self,
        features: &Tensor,
        batch: &SlotBatch,
        cache: &mut SlotCache,
    ) {
        tch::no_grad(|| {
            let ctx = self.fuse_context(&features.unsqueeze(0));
            let (cos, sin) = self.rotary(cache, &batch.positions);
            for (idx, layer) in self.layers.iter().enumerate() {
                let (k, v) = self.context_kv(layer, &ctx, &cos, &sin);
                cache.write(idx, &k, &v, &batch.rows);
            }
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
            let (cos, sin) = self.rope.cos_sin(&batch.positions, self.kind);
            let mut h = Tensor::embedding(
                &head.embed_tokens,
                &block_ids.view([1, n]),
                -1,
                false,
                false,
            )
            .to_kind(self.kind);
            for (idx, layer) in self.layers.iter().enumerate() {
                let x = rms_norm(&h, &layer.input_norm, eps);
                let q = Rope::apply(&layer.attn.queries(&x, heads, d, eps), &cos, &sin);
                let k = Rope::apply(&layer.attn.keys(&x, kv_heads, d, eps), &cos, &sin);
                let v = layer.attn.values(&x, kv_heads, d);
                let a = cache.attend(idx, &q, &k, &v, batch, false)?;
                h = &h + layer.attn.output(&a);
                h = &h + layer.mlp.forward(&rms_norm(&h, &layer.post_norm, eps));
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
    /// flash attention where the kernel takes its shapes, its rotary table.
    pub fn slot_cache(&self, capacity: i64) -> Result<SlotCache> {
        let c = &self.config;
        let attention = super::slots::SlotAttention::for_model(
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
        .with_rope(self.rope.table(capacity, self.kind)))
    }

    /// A copy for decoding: the same weights, detached from training, with the q, k, v and the
    /// gate, up projections each stored as one matrix (one matrix product instead of several;
    /// see [`AttentionWeights::fuse`]).
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
        Ok(copy)
    }

    /// Logits through the target's frozen LM head, in float32.
    pub fn logits(&self, head: &FrozenHead, hidden: &Tensor) -> Tensor {
        hidden
            .linear::<&Tensor>(&head.lm_head, None)
            .to_kind(Kind::Float)
    }
}

/// The dense training mask [B, 1, N*bs, S + N*bs] (true = visible): block j's queries see
/// context positions p < a_j and their own block.
fn dense_block_mask(anchors: &Tensor, s: i64, bs: i64) -> Tensor {
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
fn chunked_attention(
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

/// `n` values drawn from N(0, std): chunks of 2^20 values, each from a ChaCha8 generator
/// seeded by (`seed`, `name`, chunk index), drawn in parallel (Box-Muller: two uniform draws
/// give two standard normal values). The same arguments always give the same values.
fn normal_values(n: usize, std: f64, seed: u64, name: &str) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    let h = super::weights::name_seed(seed, name);
    let mut values = vec![0f32; n];
    values
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            for pair in chunk.chunks_mut(2) {
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random::<f64>();
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let theta = 2.0 * std::f64::consts::PI * u2;
                pair[0] = (r * theta.cos()) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (r * theta.sin()) as f32;
                }
            }
        });
    values
}
