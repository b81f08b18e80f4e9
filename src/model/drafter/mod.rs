//! The DFlash drafter (dflash spec §1-2): Qwen3-style layers with the target's dimensions,
//! `fc` + `hidden_norm` fusion of the tapped target features, KV injection of that context in
//! every layer, the target's frozen embedding and LM head, its own final norm.

mod attention;
mod block_inputs;
mod chunks;
mod decode;
mod groups;
mod init;

pub use attention::{context_bucket, TrainAttention, DEFAULT_GROUP_BLOCKS};

use block_inputs::BlockInputs;
use chunks::{chunked_attention, dense_block_mask, BlockAttention, KeptBlocks};
use groups::grouped_attention;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::drafter_config::DrafterConfig;
use super::feed_forward::Mlp;
use super::layers::{
    add_rms_norm_with, attention, rms_norm_with, upload, AttentionWeights, DecoderLayer, Rope,
};
use super::target::TargetModel;
use super::weights::WeightFiles;
use crate::aten_ext::fused::{rotary_autograd, FusedKernels};
use crate::fsutil::StagedDir;

/// The target's frozen input embedding and LM head, on the drafter's device.
#[derive(Debug)]
pub struct FrozenHead {
    pub embed_tokens: Tensor,
    pub lm_head: Tensor,
    /// The fused kernels of that device, for the training loss through the LM head and the
    /// rotary embedding and SwiGLU of the training forward (`None`: libtorch's operations).
    pub loss_kernels: Option<FusedKernels>,
}

impl FrozenHead {
    /// Shares the target's tensors when the devices and dtypes match, copies otherwise.
    pub fn from_target(target: &TargetModel, device: Device, kind: Kind) -> Self {
        let take = |t: &Tensor| t.to_device(device).to_kind(kind).detach();
        FrozenHead {
            embed_tokens: take(target.embed_tokens()),
            lm_head: take(target.lm_head()),
            loss_kernels: None,
        }
    }

    /// The same head, its training loss computed with `kernels` (the loss uses them where they
    /// are on the hidden states' device).
    pub fn with_loss_kernels(mut self, kernels: Option<FusedKernels>) -> Self {
        self.loss_kernels = kernels;
        self
    }
}

/// The rotary embedding of a training forward's queries or keys `x` [B, heads, L, d]: one
/// autograd node on the fused kernels where they are on x's device ([`rotary_autograd`]: one
/// kernel a pass), else libtorch's operations ([`Rope::apply`]).
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, kernels: Option<&FusedKernels>) -> Tensor {
    match kernels.filter(|k| k.device() == x.device() && x.dim() == 4) {
        Some(k) => rotary_autograd(x, cos, sin, Some(k)).unwrap_or_else(|e| {
            log::warn!("the fused rotary embedding failed ({e:#}); libtorch's operations");
            Rope::apply(x, cos, sin)
        }),
        None => Rope::apply(x, cos, sin),
    }
}

/// A DFlash drafter.
pub struct Drafter {
    pub config: DrafterConfig,
    pub device: Device,
    pub kind: Kind,
    layers: Vec<DecoderLayer>,
    fc: Tensor,
    hidden_norm: Tensor,
    norm: Tensor,
    rope: Rope,
    train_attention: TrainAttention,
    /// A decoding copy's context projections of all layers at once (see
    /// [`Drafter::decode_copy`]).
    context_kv: Option<decode::ContextKv>,
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
    /// [B, N] bool: false for padding blocks (zero loss weight; the chunked training forward
    /// leaves them out).
    pub valid: Tensor,
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
    pub(crate) fn tensor_shape(config: &DrafterConfig, name: &str) -> Option<Vec<i64>> {
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
            layers.push(DecoderLayer {
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
                    fused_qk_norm: None,
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
            context_kv: None,
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
    pub(crate) fn config_for_target(
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

    /// One line for logs: size as saved ([`Drafter::save`] writes bf16), in memory, and the
    /// training state's estimate.
    pub(crate) fn describe(&self) -> String {
        let n = self.parameter_count() as f64;
        let mib = |bytes_per_weight: f64| n * bytes_per_weight / (1u64 << 20) as f64;
        let (name, bytes) = match self.kind {
            Kind::Float => ("f32", 4.0),
            Kind::Double => ("f64", 8.0),
            Kind::Half => ("f16", 2.0),
            _ => ("bf16", 2.0),
        };
        format!(
            "DFlash drafter: {} layers{}, block size {}, taps {:?}, mask token {}, {:.2} M parameters; weights {:.1} MiB as bf16 on disk ({:.1} MiB as {name} in memory), training state about {:.1} MiB (fp32 master weights, AdamW moments, gradients)",
            self.config.num_hidden_layers,
            self.config
                .describe_layers()
                .map(|mix| format!(" ({mix})"))
                .unwrap_or_default(),
            self.config.block_size,
            self.config.target_layer_ids(),
            self.config.mask_token_id(),
            n / 1e6,
            mib(2.0),
            mib(bytes),
            mib(16.0),
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

    /// `ctx = hidden_norm(fc(features))`: [B, S, K*H] -> [B, S, H] (the norm on `kernels`
    /// where given).
    fn fuse_context(&self, features: &Tensor, kernels: Option<&FusedKernels>) -> Tensor {
        let f = features.to_device(self.device).to_kind(self.kind);
        rms_norm_with(
            &f.linear::<&Tensor>(&self.fc, None),
            &self.hidden_norm,
            self.config.rms_norm_eps,
            kernels,
        )
    }

    /// One layer of the training forward up to its MLP's output: returns `(h1, m)`, the
    /// residual stream after the attention and the MLP's output, whose sum (the layer's output)
    /// the caller takes with the next norm ([`add_rms_norm_with`]). `x`: the layer's normed
    /// input; `None` for the first layer, whose input rows `h` come as their distinct rows
    /// (`inputs`, [`BlockInputs`]), which its input norm and projections read instead of `h`.
    #[allow(
        clippy::too_many_arguments,
        reason = "one layer's inputs, each distinct"
    )]
    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        h: &Tensor,
        x: Option<Tensor>,
        inputs: Option<&BlockInputs>,
        ctx_kv: (&Tensor, &Tensor),
        block_rope: (&Tensor, &Tensor),
        attn: BlockAttention<'_>,
        kernels: Option<&FusedKernels>,
    ) -> (Tensor, Tensor) {
        let c = &self.config;
        let (heads, kv_heads, d, eps) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
        );
        let x = x.unwrap_or_else(|| {
            rms_norm_with(
                inputs.map_or(h, |i| &i.rows),
                &layer.input_norm,
                eps,
                kernels,
            )
        });
        let spread = |t: Tensor| match inputs {
            Some(i) => i.spread_heads(&t),
            None => t,
        };
        // Queries and the block's keys share the block positions.
        let (cos, sin) = block_rope;
        let [q, k_block, v_block] = layer.attn.qkv_train(&x, (heads, kv_heads, d, eps), kernels);
        let q = rotate(&spread(q), cos, sin, kernels);
        let k_block = rotate(&spread(k_block), cos, sin, kernels);
        let v_block = spread(v_block);
        let a = match attn {
            BlockAttention::Full(mask) => {
                let k = Tensor::cat(&[ctx_kv.0, &k_block], 2);
                let v = Tensor::cat(&[ctx_kv.1, &v_block], 2);
                layer.attn.output(&attention(&q, &k, &v, mask, false))
            }
            BlockAttention::Chunked { plan, sliding } => {
                let rows = chunked_attention(&q, ctx_kv, (&k_block, &v_block), plan, sliding);
                rows.linear::<&Tensor>(&layer.attn.o_proj, None)
            }
            BlockAttention::Grouped(plan) => {
                let block = (&k_block, &v_block);
                let rows =
                    grouped_attention(&q, ctx_kv, block, plan, c.block_size).unwrap_or_else(|e| {
                        log::warn!("the grouped block attention failed ({e:#}); the chunked one");
                        chunked_attention(&q, ctx_kv, block, self.group_fallback(plan), false)
                    });
                rows.linear::<&Tensor>(&layer.attn.o_proj, None)
            }
        };
        let (h, y) = add_rms_norm_with(h, &a, &layer.post_norm, eps, kernels);
        let m = layer.mlp.forward_train(&y, kernels);
        (h, m)
    }

    /// Keys (normed, rotated) and values of the context for one layer: [B, kv_heads, S, d].
    fn context_kv(
        &self,
        layer: &DecoderLayer,
        ctx: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        kernels: Option<&FusedKernels>,
    ) -> (Tensor, Tensor) {
        let c = &self.config;
        let shape = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
        );
        let [k, v] = layer.attn.kv_train(ctx, shape, kernels);
        (rotate(&k, cos, sin, kernels), v)
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
    /// own block, nothing of any other block; in a sliding-window layer, of those only the keys
    /// of the last `sliding_window` positions up to the query's own (see
    /// [`crate::model::drafter_layout`]). A padding block still sees its own block (a query at
    /// least its own slot), so no row of the attention is empty (no NaN).
    ///
    /// The attention runs as [`Drafter::train_attention`] says. The chunked formulation computes
    /// the valid blocks only (padding blocks have no loss weight): their states are zeros
    /// there; the dense one computes every block. The host never waits for the
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
        let chunked = !matches!(attention, TrainAttention::Dense) && n > 0;
        // The chunked attention computes the valid blocks only, all rows' in one [1, M * bs]
        // row; the dense one every block, [B, N * bs].
        let kept = chunked.then(|| {
            let host = |t: &Tensor, kind| t.to_device(Device::Cpu).to_kind(kind).reshape([-1]);
            let anchors = Vec::<i64>::try_from(host(&batch.anchors, Kind::Int64));
            let valid = Vec::<bool>::try_from(host(&batch.valid, Kind::Bool));
            KeptBlocks::of(
                &anchors.unwrap_or_default(),
                &valid.unwrap_or_default(),
                b,
                n,
            )
        });
        // each block's anchor [G, blocks], its first token's index into ids [B * S], and
        // with the chunked attention the kept blocks' indices among the B * N (one upload)
        let (anchors, first_at, kept_index) = match &kept {
            Some(kept) => {
                let (rows, anchors) = kept.rows_and_anchors();
                let at: Vec<i64> = rows.iter().zip(&anchors).map(|(r, a)| r * s + a).collect();
                let host = [anchors, at, kept.index.clone()].concat();
                let all = upload(&Tensor::from_slice(&host), dev);
                let m = kept.len();
                let part = |i: i64| all.narrow(0, i * m, m);
                (part(0).view([1, m]), part(1), Some(part(2)))
            }
            None => {
                let anchors = upload(&batch.anchors, dev).to_kind(Kind::Int64);
                let rows = Tensor::arange(b, (Kind::Int64, dev)).view([b, 1]) * s;
                let at = (&anchors + rows).reshape([-1]);
                (anchors, at, None)
            }
        };
        let (g, blocks) = anchors.size2().unwrap_or((0, 0));

        // Block inputs: [x[a_j], MASK, ..., MASK]
        let first = ids.reshape([-1]).index_select(0, &first_at);
        let inputs = BlockInputs::embed(
            &head.embed_tokens,
            &first,
            c.mask_token_id(),
            (g, blocks, bs),
            self.kind,
        );
        let mut h = inputs.spread(&inputs.rows);

        // Positions: slot k of block j at a_j + k; context position p at p.
        let offsets = Tensor::arange(bs, (Kind::Int64, dev));
        let block_pos = (anchors.unsqueeze(-1) + &offsets).view([g, blocks * bs]);
        // The chunked attention reads a context padded to a bucketed length (the padding
        // positions lie after every anchor, so no query sees them).
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
        // the sliding layers' window (one for all of them), where the drafter has any
        let windows = c.layer_windows();
        let window = windows.iter().flatten().copied().next();
        let (dense_mask, sliding_mask);
        let (plan, grouped);
        let (full_attn, sliding_attn) = match (per_chunk, &kept) {
            (Some(cpc), Some(kept)) => {
                let kernels = head.loss_kernels.as_ref();
                grouped = attention
                    .blocks_per_group()
                    .and_then(|g| self.group_plan(kept, g, &anchors, s_ctx, cpc, kernels));
                match &grouped {
                    Some(g) => (BlockAttention::Grouped(g), BlockAttention::Grouped(g)),
                    None => {
                        plan = self.chunk_plan(kept, s_ctx, cpc, window);
                        let attn = |sliding| BlockAttention::Chunked {
                            plan: &plan,
                            sliding,
                        };
                        (attn(false), attn(true))
                    }
                }
            }
            _ => {
                dense_mask = dense_block_mask(&anchors, s, bs, None);
                sliding_mask = window.map(|w| dense_block_mask(&anchors, s, bs, Some(w)));
                let sliding = sliding_mask.as_ref().unwrap_or(&dense_mask);
                (
                    BlockAttention::Full(Some(&dense_mask)),
                    BlockAttention::Full(Some(sliding)),
                )
            }
        };

        let kernels = head.loss_kernels.as_ref();
        let ctx = self.fuse_context(features, kernels);
        let ctx = if s_ctx > s {
            ctx.constant_pad_nd([0, 0, 0, s_ctx - s])
        } else {
            ctx
        };
        let eps = self.config.rms_norm_eps;
        // the next layer's normed input (the final norm's output after the last layer): each
        // layer's output is its residual sum, taken with the norm that reads it
        let mut x: Option<Tensor> = None;
        for (i, (layer, window)) in self.layers.iter().zip(&windows).enumerate() {
            let (ck, cv) = self.context_kv(layer, &ctx, &c_cos, &c_sin, kernels);
            let attn = match window {
                Some(_) => sliding_attn,
                None => full_attn,
            };
            let first_inputs = (i == 0).then_some(&inputs);
            let (h1, m) = self.layer_forward(
                layer,
                &h,
                x.take(),
                first_inputs,
                (&ck, &cv),
                (&q_cos, &q_sin),
                attn,
                kernels,
            );
            let next_norm = self
                .layers
                .get(i + 1)
                .map_or(&self.norm, |next| &next.input_norm);
            let (sum, normed) = add_rms_norm_with(&h1, &m, next_norm, eps, kernels);
            h = sum;
            x = Some(normed);
        }
        let out = match x {
            Some(out) => out,
            None => rms_norm_with(&h, &self.norm, eps, kernels),
        };
        match kept_index.filter(|_| kept.as_ref().is_some_and(|k| !k.all)) {
            // the padding blocks' states are zeros
            Some(index) => {
                let width = out.size()[2];
                let rows = (index.unsqueeze(1) * bs + &offsets).reshape([-1]);
                let mut all = Tensor::zeros([b * n * bs, width], (out.kind(), dev));
                let _ = all.index_copy_(0, &rows, &out.view([-1, width]));
                all.view([b, n, bs, width])
            }
            None => out.view([b, n, bs, -1]),
        }
    }

    /// Logits through the target's frozen LM head, in float32.
    pub fn logits(&self, head: &FrozenHead, hidden: &Tensor) -> Tensor {
        hidden
            .linear::<&Tensor>(&head.lm_head, None)
            .to_kind(Kind::Float)
    }
}
