//! The sparse mixture-of-experts block of Qwen3-MoE (`qwen3_moe`) and Qwen3.5-MoE
//! (`qwen3_5_moe`), computed as transformers 5.23 computes it (`Qwen3MoeSparseMoeBlock`,
//! `Qwen3_5MoeSparseMoeBlock`, and its default experts implementation "grouped_mm" in
//! `transformers/integrations/moe.py`).
//!
//! Per token `x` [H]: router logits `x R^T` [E] in the hidden dtype, their softmax in float32,
//! the `k` largest probabilities and their experts (`torch.topk`), divided by their sum when
//! `norm_topk_prob` (always for Qwen3.5-MoE), cast back to the hidden dtype; each chosen expert
//! `e` is a SwiGLU, `down_e(silu(gate_e x) * up_e x)`, scaled by its weight, and the `k`
//! products are summed. Qwen3.5-MoE adds a shared expert (a SwiGLU of its own width) scaled by
//! `sigmoid(x g^T)` with `g` = `shared_expert_gate.weight` [1, H].
//!
//! Fast path: the (token, choice) pairs are sorted by expert, the boundaries of each expert's
//! rows found by a binary search of the sorted ids, and every expert's rows go through one
//! grouped matrix product for gate+up and one for down ([`ExpertGemm`]); the products go back
//! to their pairs by one scatter and are summed over the `k` choices. No step reads a value
//! back to the host on a GPU with the grouped kernel (bf16 on Hopper or Blackwell). With the
//! fused kernels (a GPU; [`SparseMoe::add_forward_fused`]), with the same choices and roundings:
//! the router's top k is one kernel that selects and orders as libtorch's GPU topk; the pairs
//! are grouped by expert by a counting sort (three small kernels: the grouped products' ends,
//! each pair's row and each row's token); SwiGLU's `silu(gate) * up` is one kernel; and the
//! scaling, scatter and sum of the products, the gated shared expert's addition and the
//! residual's are one pass (`moe_combine_add`), where libtorch runs some fifteen kernels.
//!
//! Ties in the router: `torch.topk` leaves the order of equal values unspecified. On the CPU it
//! selects with the C++ library's nth_element / partial_sort (libtorch 2.11: eight equal
//! probabilities, k = 2, give experts [6, 5]; 256 equal ones give [0, 1]), on CUDA with a
//! radix selection. Routing is the same as transformers' because the same libtorch `topk` runs
//! with the same arguments on a float32 probability tensor computed by the same operations:
//! equal inputs, equal choices (checked on the CPU against transformers' recorded indices,
//! with four tied experts).

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

use super::feed_forward::Mlp;
use crate::aten_ext::fused::{FusedKernels, MOE_MAX_EXPERTS, MOE_MAX_TOP_K};

/// The MoE fields of a text config (`qwen3_moe`, `qwen3_5_moe` text settings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MoeSettings {
    /// `num_experts` (transformers 5 writes Qwen3-MoE's as `num_local_experts`).
    pub num_experts: i64,
    pub num_experts_per_tok: i64,
    pub moe_intermediate_size: i64,
    /// Qwen3-MoE's switch (default false); Qwen3.5-MoE always normalises.
    pub norm_topk_prob: bool,
    /// Layers that keep a dense MLP (Qwen3-MoE).
    pub mlp_only_layers: Vec<i64>,
    /// Every `decoder_sparse_step`-th layer is sparse (Qwen3-MoE, default 1).
    pub decoder_sparse_step: i64,
    /// The shared expert's width (Qwen3.5-MoE); `None` without one.
    pub shared_expert_intermediate_size: Option<i64>,
}

/// The architecture of a block's router, which decides its defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoeFamily {
    /// `qwen3_moe`: routed experts, `norm_topk_prob` as configured, dense layers by
    /// `mlp_only_layers` / `decoder_sparse_step`.
    Qwen3Moe,
    /// `qwen3_5_moe` (text config `qwen3_5_moe_text`): every layer sparse, routing weights
    /// normalised, plus the gated shared expert.
    Qwen3_5Moe,
    /// `qwen3_next`: Qwen3.5-MoE's block (`Qwen3NextSparseMoeBlock` computes the same), with
    /// Qwen3-MoE's switches (`norm_topk_prob`, default true; `mlp_only_layers`,
    /// `decoder_sparse_step`) and transformers' defaults for absent fields (512 experts, 10
    /// chosen, widths 512).
    Qwen3Next,
}

impl MoeFamily {
    /// transformers' value of an absent integer field, where it has one.
    fn default_of(self, field: &str) -> Option<i64> {
        match (self, field) {
            (MoeFamily::Qwen3Next, "num_experts") => Some(512),
            (MoeFamily::Qwen3Next, "num_experts_per_tok") => Some(10),
            (MoeFamily::Qwen3Next, "moe_intermediate_size" | "shared_expert_intermediate_size") => {
                Some(512)
            }
            _ => None,
        }
    }

    /// The number of routed experts a config asks for (0: a dense model).
    pub(crate) fn num_experts(self, c: &Map<String, Value>) -> Result<i64> {
        Ok(int_field(c, &["num_experts", "num_local_experts"])?
            .or(self.default_of("num_experts"))
            .unwrap_or(0))
    }

    /// The family of a `model_type`, if it is a mixture of experts this module serves.
    pub(crate) fn of_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "qwen3_moe" => Some(MoeFamily::Qwen3Moe),
            "qwen3_5_moe" | "qwen3_5_moe_text" => Some(MoeFamily::Qwen3_5Moe),
            "qwen3_next" => Some(MoeFamily::Qwen3Next),
            _ => None,
        }
    }
}

fn int_field(c: &Map<String, Value>, names: &[&str]) -> Result<Option<i64>> {
    for name in names {
        match c.get(*name) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return v
                    .as_i64()
                    .map(Some)
                    .with_context(|| format!("field {name} = {v} is not an integer"))
            }
        }
    }
    Ok(None)
}

fn required(family: MoeFamily, c: &Map<String, Value>, names: &[&str]) -> Result<i64> {
    let value = int_field(c, names)?.or(family.default_of(names[0]));
    value.with_context(|| {
        format!(
            "field {} is missing (a mixture of experts needs it)",
            names[0]
        )
    })
}

impl MoeSettings {
    /// Reads the MoE fields of a text config (`text_config` already taken out of a multimodal
    /// one), with transformers' defaults; refuses values no block can be built from
    /// ([`MoeSettings::check`]).
    pub(crate) fn from_text_config(
        family: MoeFamily,
        c: &Map<String, Value>,
        num_layers: i64,
    ) -> Result<Self> {
        // Qwen3-MoE's and Qwen3-Next's routing switches; Qwen3.5-MoE has none
        let switches = family != MoeFamily::Qwen3_5Moe;
        let norm_topk_prob = match c.get("norm_topk_prob") {
            _ if !switches => true,
            None | Some(Value::Null) => family == MoeFamily::Qwen3Next,
            Some(Value::Bool(b)) => *b,
            Some(v) => bail!("field norm_topk_prob = {v} is not true or false"),
        };
        let mlp_only_layers = match c.get("mlp_only_layers") {
            _ if !switches => Vec::new(),
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_i64()
                        .context("field mlp_only_layers holds a non-integer")
                })
                .collect::<Result<_>>()?,
            Some(v) => bail!("field mlp_only_layers = {v} is not a list of layer indices"),
        };
        let settings = MoeSettings {
            num_experts: required(family, c, &["num_experts", "num_local_experts"])?,
            num_experts_per_tok: required(family, c, &["num_experts_per_tok"])?,
            moe_intermediate_size: required(family, c, &["moe_intermediate_size"])?,
            norm_topk_prob,
            mlp_only_layers,
            decoder_sparse_step: if switches {
                int_field(c, &["decoder_sparse_step"])?.unwrap_or(1)
            } else {
                1
            },
            shared_expert_intermediate_size: if family == MoeFamily::Qwen3Moe {
                None
            } else {
                Some(required(family, c, &["shared_expert_intermediate_size"])?)
            },
        };
        settings.check(num_layers, c.get("hidden_act").and_then(Value::as_str))?;
        Ok(settings)
    }

    /// Refuses configs that cannot be served, naming the field: experts, choices and widths
    /// that are not positive, more choices than experts, a sparse step of 0 (transformers
    /// would divide by it), dense layers that do not exist, and activations other than SiLU.
    pub(crate) fn check(&self, num_layers: i64, hidden_act: Option<&str>) -> Result<()> {
        let positive = [
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ];
        for (name, value) in positive {
            if value <= 0 {
                bail!("field {name} = {value} must be positive for a mixture of experts");
            }
        }
        if let Some(width) = self.shared_expert_intermediate_size.filter(|w| *w <= 0) {
            bail!("field shared_expert_intermediate_size = {width} must be positive");
        }
        if self.num_experts_per_tok > self.num_experts {
            bail!(
                "field num_experts_per_tok = {} exceeds num_experts = {}: a token cannot \
                 choose more experts than there are",
                self.num_experts_per_tok,
                self.num_experts
            );
        }
        if let Some(bad) = self
            .mlp_only_layers
            .iter()
            .find(|&&l| l < 0 || l >= num_layers)
        {
            bail!("field mlp_only_layers names layer {bad}, but the model has {num_layers} layers");
        }
        match hidden_act {
            None | Some("silu") | Some("swish") => Ok(()),
            Some(other) => {
                bail!("field hidden_act = {other:?} is not supported by the experts (SiLU only)")
            }
        }
    }

    /// Whether layer `idx` has a sparse block, by transformers' rule: not listed in
    /// `mlp_only_layers`, and `idx + 1` a multiple of `decoder_sparse_step`.
    pub(crate) fn is_sparse(&self, idx: i64) -> bool {
        !self.mlp_only_layers.contains(&idx)
            && self.num_experts > 0
            && (idx + 1) % self.decoder_sparse_step.max(1) == 0
    }

    /// The width of the SwiGLU products one token runs through in a sparse block: its chosen
    /// experts and the shared expert (for counts of active parameters).
    pub(crate) fn active_width(&self) -> i64 {
        self.num_experts_per_tok * self.moe_intermediate_size
            + self.shared_expert_intermediate_size.unwrap_or(0)
    }

    /// The shape of a sparse block of a model with hidden size `hidden`.
    pub(crate) fn shape(&self, hidden: i64) -> MoeShape {
        MoeShape {
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            hidden,
            intermediate: self.moe_intermediate_size,
            norm_topk_prob: self.norm_topk_prob,
            shared_intermediate: self.shared_expert_intermediate_size,
        }
    }
}

/// The shape of one sparse block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MoeShape {
    pub num_experts: i64,
    pub top_k: i64,
    pub hidden: i64,
    pub intermediate: i64,
    pub norm_topk_prob: bool,
    pub shared_intermediate: Option<i64>,
}

/// How a checkpoint stores a block's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertLayout {
    /// `experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]: the
    /// published checkpoints, and what transformers 5's `save_pretrained` writes.
    PerExpert,
    /// `experts.gate_up_proj` [E, 2 I, H] (each expert's gate rows, then its up rows) and
    /// `experts.down_proj` [E, H, I]: transformers 5's parameters as they are in memory.
    Fused,
}

/// Reads a model's tensors: `load(name, shape)` (shape checked, in the model's dtype and
/// device) and `contains(name)`. Closures, so that the block does not depend on a loader.
pub(crate) struct TensorSource<'a> {
    pub load: &'a dyn Fn(&str, &[i64]) -> Result<Tensor>,
    pub contains: &'a dyn Fn(&str) -> bool,
}

impl ExpertLayout {
    /// The layout of the block under `prefix` (e.g. `model.layers.3.mlp`).
    pub(crate) fn detect(prefix: &str, source: &TensorSource) -> Result<Self> {
        let fused = format!("{prefix}.experts.gate_up_proj");
        let first = format!("{prefix}.experts.0.gate_proj.weight");
        if (source.contains)(&fused) {
            Ok(ExpertLayout::Fused)
        } else if (source.contains)(&first) {
            Ok(ExpertLayout::PerExpert)
        } else {
            bail!("the weights have neither {fused:?} nor {first:?}: no experts for {prefix}")
        }
    }
}

/// Which matrix products run the experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertGemm {
    /// libtorch's `_grouped_mm` over all experts at once: on CUDA with bf16 on sm90 / sm100 its
    /// CUTLASS kernel (no host synchronisation); on the CPU (float32, bf16, f16) a loop of one
    /// product per expert inside libtorch, exactly the per-expert products; on other GPUs or
    /// dtypes libtorch's fallback, which reads the offsets to the host first. Needs rows whose
    /// byte strides are multiples of 16 (hidden and expert widths multiples of 8 in bf16, of 4
    /// in float32).
    Grouped,
    /// One product per expert that has rows, the boundaries read to the host once per call:
    /// exact, for what `_grouped_mm` refuses (float64, widths off the 16-byte alignment).
    PerExpert,
}

impl ExpertGemm {
    /// The path for experts of `kind` with hidden size `hidden` and expert width `width`.
    pub(crate) fn for_shape(kind: Kind, hidden: i64, width: i64) -> Self {
        let bytes = match kind {
            Kind::Float => 4,
            Kind::BFloat16 | Kind::Half => 2,
            _ => return ExpertGemm::PerExpert,
        };
        if (hidden * bytes) % 16 == 0 && (width * bytes) % 16 == 0 {
            ExpertGemm::Grouped
        } else {
            ExpertGemm::PerExpert
        }
    }
}

/// The router's decision for `T` tokens.
#[derive(Debug)]
pub(crate) struct Routing {
    /// [T, E], the hidden dtype (compared with transformers' router logits in the tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub logits: Tensor,
    /// [T, k], the hidden dtype, in topk's order.
    pub weights: Tensor,
    /// [T, k] int64.
    pub experts: Tensor,
}

/// The always-on expert of Qwen3.5-MoE and its scalar gate.
#[derive(Debug)]
pub(crate) struct SharedExpert {
    pub mlp: Mlp,
    /// `shared_expert_gate.weight` [1, H].
    pub gate: Tensor,
}

/// One sparse block: router, experts stored once as stacked tensors, optional shared expert.
#[derive(Debug)]
pub(crate) struct SparseMoe {
    /// `gate.weight` [E, H].
    pub router: Tensor,
    /// [E, 2 I, H]: each expert's gate rows, then its up rows.
    pub gate_up: Tensor,
    /// [E, H, I].
    pub down: Tensor,
    pub top_k: i64,
    pub norm_topk_prob: bool,
    pub shared: Option<SharedExpert>,
}

impl SparseMoe {
    /// Loads the block under `prefix` (e.g. `model.layers.3.mlp`) in either expert layout.
    pub(crate) fn load(prefix: &str, shape: MoeShape, source: &TensorSource) -> Result<Self> {
        let MoeShape {
            num_experts: e,
            hidden: h,
            intermediate: i,
            ..
        } = shape;
        let load = |name: &str, dims: &[i64]| (source.load)(&format!("{prefix}.{name}"), dims);
        let (gate_up, down) = match ExpertLayout::detect(prefix, source)? {
            ExpertLayout::Fused => (
                load("experts.gate_up_proj", &[e, 2 * i, h])?,
                load("experts.down_proj", &[e, h, i])?,
            ),
            ExpertLayout::PerExpert => stack_experts(&load, e, h, i)?,
        };
        let shared = match shape.shared_intermediate {
            Some(s) => Some(SharedExpert {
                mlp: Mlp {
                    gate_proj: load("shared_expert.gate_proj.weight", &[s, h])?,
                    up_proj: load("shared_expert.up_proj.weight", &[s, h])?,
                    down_proj: load("shared_expert.down_proj.weight", &[h, s])?,
                    fused: None,
                },
                gate: load("shared_expert_gate.weight", &[1, h])?,
            }),
            None => None,
        };
        Ok(SparseMoe {
            router: load("gate.weight", &[e, h])?,
            gate_up,
            down,
            top_k: shape.top_k,
            norm_topk_prob: shape.norm_topk_prob,
            shared,
        })
    }

    pub(crate) fn num_experts(&self) -> i64 {
        self.router.size()[0]
    }

    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.router, &self.gate_up, &self.down];
        if let Some(shared) = &self.shared {
            out.extend(shared.mlp.tensors());
            out.push(&shared.gate);
        }
        out
    }

    fn intermediate(&self) -> i64 {
        self.down.size()[2]
    }

    /// The router's choices for `x` [T, H].
    pub(crate) fn route(&self, x: &Tensor) -> Routing {
        let logits = x.linear::<&Tensor>(&self.router, None);
        let probs = logits.softmax(-1, Kind::Float);
        // torch.topk(probs, k, dim=-1) as transformers calls it (largest, sorted): the same
        // selection on the same float32 probabilities breaks ties as it does on one device,
        // where a sort or an argmax loop could pick other experts among equal probabilities
        let (top, experts) = probs.topk(self.top_k, -1, true, true);
        self.routing(logits, top, experts)
    }

    /// [`SparseMoe::route`] with the top k and the weights on the fused kernel (which chooses
    /// and orders as libtorch's GPU topk does, ties included, and normalises and rounds as
    /// [`SparseMoe::routing`] does on a GPU).
    fn route_fused(&self, x: &Tensor, kernels: &FusedKernels) -> Result<Routing> {
        let logits = x.linear::<&Tensor>(&self.router, None);
        let probs = logits.softmax(-1, Kind::Float);
        let (weights, experts) =
            kernels.moe_route(&probs, self.top_k, self.norm_topk_prob, logits.kind())?;
        Ok(Routing {
            weights,
            logits,
            experts,
        })
    }

    /// The routing from the router's logits and the top k of their softmax: the weights
    /// normalised to sum 1 where `norm_topk_prob`, cast to the logits' type.
    fn routing(&self, logits: Tensor, mut top: Tensor, experts: Tensor) -> Routing {
        if self.norm_topk_prob {
            top = &top / top.sum_dim_intlist(-1, true, Kind::Float);
        }
        Routing {
            weights: top.to_kind(logits.kind()),
            logits,
            experts,
        }
    }

    /// The block's output for `x` [..., H] (same shape), on the path [`ExpertGemm::for_shape`]
    /// picks.
    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let gemm = ExpertGemm::for_shape(
            self.gate_up.kind(),
            self.router.size()[1],
            self.intermediate(),
        );
        self.forward_with(x, gemm)
    }

    /// `residual += forward(x)` (the block's output is summed first, then added, as
    /// transformers rounds it).
    pub(crate) fn add_forward(&self, residual: &mut Tensor, x: &Tensor) {
        *residual += self.forward(x);
    }

    /// [`SparseMoe::add_forward`] with the SwiGLU products (the experts' and the shared
    /// expert's) and the experts' combination on the fused kernels; an error (a call a kernel
    /// refuses) leaves `residual` as it was.
    pub(crate) fn add_forward_fused(
        &self,
        residual: &mut Tensor,
        x: &Tensor,
        kernels: &FusedKernels,
    ) -> Result<()> {
        let gemm = ExpertGemm::for_shape(
            self.gate_up.kind(),
            self.router.size()[1],
            self.intermediate(),
        );
        if self.num_experts() > MOE_MAX_EXPERTS || self.top_k > MOE_MAX_TOP_K {
            // wider than the routing kernels take: libtorch's routing, the same result
            self.add_forward(residual, x);
            return Ok(());
        }
        let h = x.size().last().copied().unwrap_or(0);
        let flat = x.reshape([-1, h]);
        if flat.size()[0] == 0 {
            return Ok(());
        }
        let routing = self.route_fused(&flat, kernels)?;
        let groups = kernels.moe_groups(&routing.experts, self.num_experts())?;
        let rows = flat.index_select(0, &groups.row_tokens);
        let both = grouped_linear(&rows, &self.gate_up, &groups.ends, gemm);
        let y = grouped_linear(&kernels.silu_mul(&both)?, &self.down, &groups.ends, gemm);
        let shared = match &self.shared {
            Some(shared) => Some((
                shared.mlp.forward_fused(&flat, kernels)?,
                flat.linear::<&Tensor>(&shared.gate, None),
            )),
            None => None,
        };
        let weights = routing.weights.reshape([-1]).contiguous();
        // the residual's rows, in place (a dense residual: the kernel refuses any other)
        let mut rows_of_residual = residual.f_view([-1, h])?;
        kernels.moe_combine_add(
            &y,
            &groups.positions,
            &weights,
            self.top_k,
            shared.as_ref().map(|(out, gate)| (out, gate)),
            &mut rows_of_residual,
        )
    }

    /// [`SparseMoe::forward`] on a chosen path.
    pub(crate) fn forward_with(&self, x: &Tensor, gemm: ExpertGemm) -> Tensor {
        let size = x.size();
        let h = size.last().copied().unwrap_or(0);
        let flat = x.reshape([-1, h]);
        let routing = self.route(&flat);
        let mut out = self.experts(&flat, &routing, gemm);
        if let Some(shared) = &self.shared {
            let gate = flat.linear::<&Tensor>(&shared.gate, None).sigmoid();
            out += gate * shared.mlp.forward(&flat);
        }
        out.view(size.as_slice())
    }

    /// The routed experts' weighted sum [T, H] for `x` [T, H]: pairs sorted by expert
    /// (stable, so each expert's rows keep token order), one grouped product for gate+up and
    /// one for down, each product scaled by its weight (in the hidden dtype, as transformers),
    /// scattered back to its pair and summed over the `k` choices (one rounding in bf16, and
    /// no atomics, where an index_add over tokens would race on a GPU).
    pub(crate) fn experts(&self, x: &Tensor, routing: &Routing, gemm: ExpertGemm) -> Tensor {
        let (t, h) = (x.size()[0], x.size()[1]);
        let k = self.top_k;
        if t == 0 {
            return x.zeros_like();
        }
        let (order, ends, rows) = self.sorted_pairs(x, routing);
        let both = grouped_linear(&rows, &self.gate_up, &ends, gemm);
        let i = self.intermediate();
        let gated = both.narrow(1, 0, i).silu() * both.narrow(1, i, i);
        let y = grouped_linear(&gated, &self.down, &ends, gemm);
        let weights = routing.weights.reshape([-1]).index_select(0, &order);
        let y = y * weights.unsqueeze(-1);
        // `order` is a permutation: every row is written, no zero fill needed
        let mut pairs = y.empty_like();
        let _ = pairs.index_copy_(0, &order, &y);
        pairs
            .view([t, k, h])
            .sum_dim_intlist(1, false, None::<Kind>)
    }

    /// The (token, choice) pairs sorted by expert (stable: each expert's rows in token order):
    /// the sorting permutation of the pairs, each expert's end among them ([`group_ends`]) and
    /// the pairs' rows of `x`.
    fn sorted_pairs(&self, x: &Tensor, routing: &Routing) -> (Tensor, Tensor, Tensor) {
        // 32-bit ids: a GPU's radix sort then makes half the passes of 64-bit ones
        let ids = routing.experts.reshape([-1]).to_kind(Kind::Int);
        let (sorted, order) = ids.sort_stable(true, 0, false);
        let ends = group_ends(&sorted, self.num_experts());
        let rows = x.index_select(0, &order.floor_divide_scalar(self.top_k));
        (order, ends, rows)
    }
}

/// Loads per-expert tensors into the stacked [E, 2 I, H] and [E, H, I] (allocated once, each
/// expert copied in: no second copy of a layer's experts at load).
fn stack_experts(
    load: &dyn Fn(&str, &[i64]) -> Result<Tensor>,
    e: i64,
    h: i64,
    i: i64,
) -> Result<(Tensor, Tensor)> {
    let first = load("experts.0.gate_proj.weight", &[i, h])?;
    let opts = (first.kind(), first.device());
    let gate_up = Tensor::empty([e, 2 * i, h], opts);
    let down = Tensor::empty([e, h, i], opts);
    tch::no_grad(|| -> Result<()> {
        for x in 0..e {
            let slot = gate_up.get(x);
            slot.narrow(0, 0, i)
                .copy_(&load(&format!("experts.{x}.gate_proj.weight"), &[i, h])?);
            slot.narrow(0, i, i)
                .copy_(&load(&format!("experts.{x}.up_proj.weight"), &[i, h])?);
            down.get(x)
                .copy_(&load(&format!("experts.{x}.down_proj.weight"), &[h, i])?);
        }
        Ok(())
    })?;
    Ok((gate_up, down))
}

/// The end (exclusive) of each expert's rows among the sorted expert ids, [E] int32: the
/// number of ids <= e, by binary search. Gives `_grouped_mm`'s offsets in one kernel and
/// without a host read (CUDA's bincount reads the largest id back to size its output).
fn group_ends(sorted: &Tensor, num_experts: i64) -> Tensor {
    let experts = Tensor::arange(num_experts, (sorted.kind(), sorted.device()));
    experts.searchsorted(sorted, true, true, "right", None::<Tensor>)
}

/// `x` [S, in] times the transpose of `w[e]` [E, out, in] for the rows of each expert `e`
/// (`ends` as [`group_ends`]): [S, out].
fn grouped_linear(x: &Tensor, w: &Tensor, ends: &Tensor, gemm: ExpertGemm) -> Tensor {
    match gemm {
        ExpertGemm::Grouped => {
            x.internal_grouped_mm(&w.transpose(1, 2), Some(ends), None, None::<Kind>)
        }
        ExpertGemm::PerExpert => per_expert_linear(x, w, ends),
    }
}

/// [`grouped_linear`] as one product per expert that has rows (reads `ends` to the host).
fn per_expert_linear(x: &Tensor, w: &Tensor, ends: &Tensor) -> Tensor {
    let out = Tensor::zeros([x.size()[0], w.size()[1]], (x.kind(), x.device()));
    let ends = ends.to_device(Device::Cpu).to_kind(Kind::Int64);
    let mut start = 0;
    for (e, end) in (0..ends.size()[0]).map(|e| (e, ends.int64_value(&[e]))) {
        if end > start {
            let rows = x.narrow(0, start, end - start);
            out.narrow(0, start, end - start)
                .copy_(&rows.linear::<&Tensor>(&w.get(e), None));
        }
        start = end;
    }
    out
}

#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
