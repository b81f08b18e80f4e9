//! The layers of the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid targets, as transformers 5.23's
//! `modeling_qwen3_5.py` computes them: zero-centred RMSNorm (`x * (1 + w)`), gated attention
//! (the query projection also emits a sigmoid gate per head; per-head q/k norms; rotary on the
//! first `partial_rotary_factor` of each head) and Gated DeltaNet layers
//! ([`super::gated_delta`]), each followed by the SwiGLU MLP.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::config::TargetConfig;
use super::feed_forward::FeedForward;
use super::gated_delta::{gated_delta_rule, gated_delta_rule_steps, GdnState};
use super::hybrid_config::{GdnLayout, GdnShape};
use super::layers::{add_product, Rope};
use super::weights::WeightSource;
use crate::aten_ext::fused::{FusedKernels, GatedHeads};
use crate::aten_ext::gdn::{GdnInputs, GdnKernels, CONV_WIDTH};

/// The fused kernels where they take `x` (on their device, of a type they exist for).
fn serving<'a>(kernels: Option<&'a FusedKernels>, x: &Tensor) -> Option<&'a FusedKernels> {
    kernels.filter(|k| k.serve(x))
}

/// RMSNorm with a zero-centred weight: `norm(x) * (1 + w)`, the norm and the product in
/// float32 and one rounding to the input's dtype (transformers' `Qwen3_5RMSNorm`).
#[derive(Debug)]
pub(crate) struct ZeroCentredNorm {
    /// `1 + w`, float32.
    scale: Tensor,
    eps: f64,
}

impl ZeroCentredNorm {
    pub(crate) fn load(
        weights: &dyn WeightSource,
        name: &str,
        dim: i64,
        eps: f64,
        device: Device,
    ) -> Result<Self> {
        let w = weights.load(name, &[dim], Kind::Float, device)?;
        Ok(ZeroCentredNorm {
            scale: w + 1.0,
            eps,
        })
    }

    pub(crate) fn numel(&self) -> usize {
        self.scale.numel()
    }

    /// The norm of `x` [..., dim]: by the fused kernel where `kernels` take `x`, else by
    /// libtorch's operations (the same values up to the order of the float sum).
    pub(crate) fn forward(&self, x: &Tensor, kernels: Option<&FusedKernels>) -> Tensor {
        if let Some(k) = serving(kernels, x) {
            match k.scaled_rms_norm(x, &self.scale, self.eps) {
                Ok(y) => return y,
                Err(e) => log::warn!("fused norm refused a call, libtorch instead: {e:#}"),
            }
        }
        let dim = self.scale.size()[0];
        x.to_kind(Kind::Float)
            .rms_norm([dim], Some(&self.scale), self.eps)
            .to_kind(x.kind())
    }
}

/// Gated full attention: `q_proj` emits per head a query and a gate of `head_dim` each.
#[derive(Debug)]
pub(crate) struct GatedAttention {
    /// [q_proj; k_proj; v_proj] as one matrix (frozen weights: one product).
    qkv: Tensor,
    o_proj: Tensor,
    q_norm: ZeroCentredNorm,
    k_norm: ZeroCentredNorm,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    rotary_dim: i64,
}

impl GatedAttention {
    /// Rotated queries [B, heads, L, d], keys and values [B, kv_heads, L, d], and the projection
    /// [B, L, row] (which holds each query head's gate, for [`GatedAttention::add_output`]) of
    /// the normed input `x` [B, L, H] at angles `cos`, `sin` [L, rotary] (or one row per
    /// token); the q/k norms and the rotation in one fused kernel where `kernels` take them.
    pub(crate) fn project(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        kernels: Option<&FusedKernels>,
    ) -> [Tensor; 4] {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let y = x.linear::<&Tensor>(&self.qkv, None);
        let v = y
            .narrow(-1, 2 * h * d + kvh * d, kvh * d)
            .view([b, l, kvh, d])
            .transpose(1, 2);
        // angles the kernel reads in place: dense rows of the projection's type, one per
        // position (shared by the batch's rows) or one per token
        let per_token = |t: &Tensor| {
            let m = t.numel() as i64 / self.rotary_dim.max(1);
            t.is_contiguous() && t.kind() == y.kind() && (m == l || m == b * l)
        };
        if let Some(k) = serving(kernels, &y).filter(|_| per_token(cos) && per_token(sin)) {
            let fused = k.gated_attention_prep(
                &y,
                self.gated_heads(),
                &self.q_norm.scale,
                &self.k_norm.scale,
                self.q_norm.eps,
                cos,
                sin,
            );
            match fused {
                Ok((q, kk)) => {
                    let q = q.view([b, l, h, d]).transpose(1, 2);
                    let kk = kk.view([b, l, kvh, d]).transpose(1, 2);
                    return [q, kk, v, y];
                }
                Err(e) => {
                    log::warn!("fused gated attention refused a call, libtorch instead: {e:#}")
                }
            }
        }
        let qg = y.narrow(-1, 0, 2 * h * d).view([b, l, h, 2 * d]);
        let q = self.q_norm.forward(&qg.narrow(-1, 0, d), kernels);
        let k = y.narrow(-1, 2 * h * d, kvh * d).view([b, l, kvh, d]);
        let k = self.k_norm.forward(&k, kernels);
        let rotate = |t: &Tensor| self.rotate(&t.transpose(1, 2), cos, sin);
        [rotate(&q), rotate(&k), v, y]
    }

    fn gated_heads(&self) -> GatedHeads {
        GatedHeads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
        }
    }

    /// The rotary embedding on the first `rotary_dim` of each head, the rest passed through.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let r = self.rotary_dim;
        let turned = Rope::apply(&x.narrow(-1, 0, r), cos, sin);
        if r == self.head_dim {
            return turned;
        }
        Tensor::cat(&[turned, x.narrow(-1, r, self.head_dim - r)], -1)
    }

    /// `residual += o_proj(attn * sigmoid(gate))` for the attention output [B, heads, L, d] and
    /// the projection `y` [B, L, row] [`GatedAttention::project`] returned (the gates are in
    /// it); the gate in one fused kernel where `kernels` take it.
    pub(crate) fn add_output(
        &self,
        residual: &mut Tensor,
        attn: &Tensor,
        y: &Tensor,
        kernels: Option<&FusedKernels>,
    ) {
        let (b, h, l, d) = attn.size4().unwrap_or((0, 0, 0, 0));
        let tokens = attn.transpose(1, 2);
        if let Some(k) = serving(kernels, y) {
            match k.sigmoid_gate_mul(&tokens.contiguous(), y, self.gated_heads()) {
                Ok(merged) => return add_product(residual, &merged, &self.o_proj),
                Err(e) => log::warn!("fused output gate refused a call, libtorch instead: {e:#}"),
            }
        }
        let gate = y
            .narrow(-1, 0, 2 * h * d)
            .view([b, l, h, 2 * d])
            .narrow(-1, d, d)
            .reshape([b, l, h * d]);
        let merged = tokens.reshape([b, l, h * d]) * gate.sigmoid();
        add_product(residual, &merged.view([-1, h * d]), &self.o_proj);
    }

    fn tensors(&self) -> Vec<&Tensor> {
        vec![
            &self.qkv,
            &self.o_proj,
            &self.q_norm.scale,
            &self.k_norm.scale,
        ]
    }
}

/// A Gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`).
#[derive(Debug)]
pub(crate) struct GatedDeltaNet {
    /// [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a] as one matrix, Qwen3.5's row order.
    in_proj: Tensor,
    /// The depthwise convolution [conv_dim, 1, kernel].
    conv: Tensor,
    /// `-exp(A_log)` per value head, float32.
    neg_a: Tensor,
    dt_bias: Tensor,
    /// The gated output norm's weight (not zero-centred) [value_dim].
    norm: Tensor,
    out_proj: Tensor,
    shape: GdnShape,
    eps: f64,
    /// The rule's CUDA kernels for the weights' device (None: libtorch's operations).
    kernels: Option<GdnKernels>,
    /// The fused kernels for the output norm (None: libtorch's operations).
    fused: Option<FusedKernels>,
}

/// The projections of one Gated DeltaNet input, [B, T, ...] each.
struct Projected {
    /// q, k, v before the convolution, [B, conv_dim, T].
    qkv: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
}

impl GatedDeltaNet {
    /// The layer's output [B, T, H] for its normed input `x` [B, T, H] continuing `state`
    /// (zeros when None), and the state after the last token. `real` [B, T] (bool) marks the
    /// real tokens of a left-padded batch: padding is zeroed before the projections (as
    /// transformers does) and neither decays nor writes the recurrent state.
    pub(crate) fn step(
        &self,
        x: &Tensor,
        state: Option<&GdnState>,
        real: Option<&Tensor>,
    ) -> (Tensor, GdnState) {
        let (out, conv, recurrent) = self.mix(x, state, real, false);
        (out, GdnState { conv, recurrent })
    }

    /// [`GatedDeltaNet::step`] keeping the state after each of the `T` tokens (the last is the
    /// state `step` returns): a multi-token step (speculative verification) can then resume
    /// from any of its prefixes.
    pub(crate) fn step_each(
        &self,
        x: &Tensor,
        state: Option<&GdnState>,
        real: Option<&Tensor>,
    ) -> (Tensor, Vec<GdnState>) {
        let (out, each) = self.step_kept(x, state, real);
        let t = x.size()[1];
        let states = (0..t)
            .map(|i| GdnState {
                conv: each.conv.select(1, i),
                recurrent: each.recurrent.select(1, i),
            })
            .collect();
        (out, states)
    }

    /// [`GatedDeltaNet::step_each`] with the states stacked: conv [B, T, conv_dim, kernel - 1]
    /// and recurrent [B, T, value_heads, key_dim, value_dim] (token i's at index i).
    pub(crate) fn step_kept(
        &self,
        x: &Tensor,
        state: Option<&GdnState>,
        real: Option<&Tensor>,
    ) -> (Tensor, GdnState) {
        let (out, history, recurrent) = self.mix(x, state, real, true);
        let window = self.shape.conv_kernel - 1;
        let t = x.size()[1];
        // windows of the history ending after each new token: [B, conv_dim, T, window]
        let conv = history
            .unfold(2, window, 1)
            .narrow(2, 1, t)
            .permute([0, 2, 1, 3]);
        (out, GdnState { conv, recurrent })
    }

    /// The layer's output for `x` continuing `state`, and after the last token the next conv
    /// state [B, conv_dim, kernel - 1] and the recurrent state; with `each_token` the conv
    /// history instead (the state's inputs then the new ones, [B, conv_dim, kernel - 1 + T])
    /// and the recurrent state after every token ([B, T, ...]).
    fn mix(
        &self,
        x: &Tensor,
        state: Option<&GdnState>,
        real: Option<&Tensor>,
        each_token: bool,
    ) -> (Tensor, Tensor, Tensor) {
        let (p, history) = self.convolved(x, state, real, each_token);
        let (q, k, v, g, beta) = self.rule_inputs(&p, real);
        let kernels = self.kernels.as_ref();
        let rule = GdnInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            initial_state: state.map(|s| &s.recurrent),
        };
        let (core, recurrent) = if each_token {
            gated_delta_rule_steps(&rule, kernels)
        } else {
            gated_delta_rule(&rule, kernels)
        };
        (self.output(&core, &p.z), history, recurrent)
    }

    /// Runs the rule on `kernels` (CUDA tensors on their device; None: libtorch's operations).
    pub(crate) fn set_kernels(&mut self, kernels: Option<GdnKernels>) {
        self.kernels = kernels;
    }

    /// Runs the gated output norm on `kernels` (tensors on their device; None: libtorch's
    /// operations).
    pub(crate) fn set_fused_kernels(&mut self, kernels: Option<FusedKernels>) {
        self.fused = kernels;
    }

    /// The gated delta rule kernels the layer runs on, if any.
    pub(crate) fn kernels(&self) -> Option<GdnKernels> {
        self.kernels
    }

    /// The four projections of `x`, padding zeroed first.
    fn project(&self, x: &Tensor, real: Option<&Tensor>) -> Projected {
        let x = match real {
            Some(m) => x * m.unsqueeze(-1).to_kind(x.kind()),
            None => x.shallow_clone(),
        };
        let s = &self.shape;
        let (conv_dim, z_dim) = (s.conv_dim(), s.value_heads * s.value_dim);
        let (b, t) = (x.size()[0], x.size()[1]);
        let y = x.linear::<&Tensor>(&self.in_proj, None);
        let hv = s.value_heads;
        Projected {
            qkv: y.narrow(-1, 0, conv_dim).transpose(1, 2),
            z: y.narrow(-1, conv_dim, z_dim).view([b, t, hv, s.value_dim]),
            b: y.narrow(-1, conv_dim + z_dim, hv),
            a: y.narrow(-1, conv_dim + z_dim + hv, hv),
        }
    }

    /// The conv state followed by the new inputs: [B, conv_dim, kernel - 1 + T].
    fn history(&self, qkv: &Tensor, state: Option<&GdnState>) -> Tensor {
        let window = self.shape.conv_kernel - 1;
        let prev = match state {
            Some(s) => s.conv.to_kind(qkv.kind()),
            None => Tensor::zeros(
                [qkv.size()[0], qkv.size()[1], window],
                (qkv.kind(), qkv.device()),
            ),
        };
        Tensor::cat(&[prev, qkv.shallow_clone()], 2)
    }

    /// The projections with q, k, v through the causal convolution and SiLU (`p.qkv` [B, T,
    /// conv_dim] after it), and the next conv state [B, conv_dim, kernel - 1]; with
    /// `keep_history` the convolution's whole input instead: the conv state then the new q, k,
    /// v ([B, conv_dim, kernel - 1 + T]; its last `kernel - 1` columns are the next conv state).
    fn convolved(
        &self,
        x: &Tensor,
        state: Option<&GdnState>,
        real: Option<&Tensor>,
        keep_history: bool,
    ) -> (Projected, Tensor) {
        let mut p = self.project(x, real);
        if !keep_history {
            if let Some((out, next)) = self.conv_on_kernels(&p.qkv, state) {
                p.qkv = out;
                return (p, next);
            }
        }
        let history = self.history(&p.qkv, state);
        let groups = self.shape.conv_dim();
        p.qkv = history
            .conv1d::<&Tensor>(&self.conv, None, [1], [0], [1], groups)
            .silu()
            .transpose(1, 2);
        if keep_history {
            return (p, history);
        }
        let (window, len) = (self.shape.conv_kernel - 1, history.size()[2]);
        (p, history.narrow(2, len - window, window).contiguous())
    }

    /// The causal convolution and SiLU of `qkv` [B, conv_dim, T] (a view of the projection)
    /// and the next conv state, by the CUDA kernel where the layer holds the kernels for its
    /// device and the convolution is theirs (width 4, one dtype); `None` sends it to libtorch.
    fn conv_on_kernels(&self, qkv: &Tensor, state: Option<&GdnState>) -> Option<(Tensor, Tensor)> {
        let kernels = self
            .kernels
            .as_ref()
            .filter(|k| k.device() == qkv.device() && self.shape.conv_kernel == CONV_WIDTH)?;
        let prev = state.map(|s| s.conv.to_kind(qkv.kind()));
        kernels
            .causal_conv_silu(&qkv.transpose(1, 2), &self.conv, prev.as_ref())
            .map_err(|e| log::warn!("causal conv kernel refused a call, libtorch instead: {e:#}"))
            .ok()
    }

    /// q, k (not yet l2-normalised: the rule does it), v, g and beta of the rule from the
    /// convolved projections; padding neither decays (g = 0) nor writes (beta = 0) the state.
    fn rule_inputs(
        &self,
        p: &Projected,
        real: Option<&Tensor>,
    ) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
        let s = &self.shape;
        let (b, t) = (p.z.size()[0], p.z.size()[1]);
        let key_width = s.key_heads * s.key_dim;
        let heads = |from: i64, n: i64, d: i64| p.qkv.narrow(-1, from, n * d).reshape([b, t, n, d]);
        let q = heads(0, s.key_heads, s.key_dim);
        let k = heads(key_width, s.key_heads, s.key_dim);
        let v = heads(2 * key_width, s.value_heads, s.value_dim);
        let (mut g, mut beta) = self.gates(&p.a, &p.b);
        if let Some(m) = real {
            let m = m.unsqueeze(-1);
            g *= m.to_kind(Kind::Float);
            let kind = beta.kind();
            beta *= m.to_kind(kind);
        }
        (q, k, v, g, beta)
    }

    /// The rule's decay `g` = softplus(a + dt_bias) * -exp(A) (float32) and write strength
    /// `beta` = sigmoid(b) of the projection's columns `a`, `b` [B, T, Hv]: one fused kernel
    /// where the layer holds them for the device, else libtorch's operations.
    fn gates(&self, a: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
        if let Some(k) = serving(self.fused.as_ref(), a) {
            match k.gdn_gates(a, b, &self.dt_bias, &self.neg_a) {
                Ok(gates) => return gates,
                Err(e) => log::warn!("fused gates refused a call, libtorch instead: {e:#}"),
            }
        }
        let g = (a.to_kind(Kind::Float) + &self.dt_bias).softplus() * &self.neg_a;
        (g, b.sigmoid())
    }

    /// The gated norm of the rule's output [B, T, Hv, dv] with `z`, then `out_proj`: [B, T, H].
    fn output(&self, core: &Tensor, z: &Tensor) -> Tensor {
        let (b, t) = (core.size()[0], core.size()[1]);
        self.gated_norm(core, z)
            .reshape([b, t, -1])
            .linear::<&Tensor>(&self.out_proj, None)
    }

    /// `norm(core) * w * silu(z)`, rounded to the storage type where transformers'
    /// `Qwen3_5RMSNormGated` rounds: after the norm, after the weight's product, at the end. One
    /// fused kernel where the layer holds them for `core`'s device.
    fn gated_norm(&self, core: &Tensor, z: &Tensor) -> Tensor {
        if let Some(k) = serving(self.fused.as_ref(), core) {
            match k.gated_rms_norm(core, z, &self.norm, self.eps) {
                Ok(out) => return out,
                Err(e) => log::warn!("fused gated norm refused a call, libtorch instead: {e:#}"),
            }
        }
        let kind = core.kind();
        let dv = self.shape.value_dim;
        let normed = core
            .to_kind(Kind::Float)
            .rms_norm([dv], None::<&Tensor>, self.eps)
            .to_kind(kind)
            * &self.norm;
        (normed.to_kind(Kind::Float) * z.to_kind(Kind::Float).silu()).to_kind(kind)
    }

    fn tensors(&self) -> Vec<&Tensor> {
        vec![
            &self.in_proj,
            &self.conv,
            &self.neg_a,
            &self.dt_bias,
            &self.norm,
            &self.out_proj,
        ]
    }
}

/// What mixes the tokens of a hybrid layer.
#[derive(Debug)]
pub(crate) enum Mixer {
    Attention(GatedAttention),
    // boxed: the kernels it carries make it several times the size of an attention mixer
    DeltaNet(Box<GatedDeltaNet>),
}

/// One hybrid decoder layer: zero-centred pre-norms, the mixer, the MLP (a SwiGLU, or
/// Qwen3.5-MoE's / Qwen3-Next's experts).
#[derive(Debug)]
pub(crate) struct HybridLayer {
    pub input_norm: ZeroCentredNorm,
    pub mixer: Mixer,
    pub post_norm: ZeroCentredNorm,
    pub mlp: FeedForward,
}

impl HybridLayer {
    /// `x += mlp(post_norm(x))` in place, the norm and SwiGLU's product by the fused kernels
    /// where `kernels` take `x`.
    pub(crate) fn add_mlp(&self, x: &mut Tensor, kernels: Option<&FusedKernels>) {
        let kernels = serving(kernels, x);
        let normed = self.post_norm.forward(x, kernels);
        self.mlp.add_forward_with(x, &normed, kernels);
    }

    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.input_norm.scale, &self.post_norm.scale];
        out.extend(match &self.mixer {
            Mixer::Attention(a) => a.tensors(),
            Mixer::DeltaNet(d) => d.tensors(),
        });
        out.extend(self.mlp.tensors());
        out
    }

    /// Layer `l` of a hybrid checkpoint (`model.layers.{l}.*`).
    pub(crate) fn load(
        config: &TargetConfig,
        l: usize,
        weights: &dyn WeightSource,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let hybrid = config
            .hybrid
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("not a hybrid config"))?;
        let (h, eps) = (config.hidden_size, config.rms_norm_eps);
        let p = format!("model.layers.{l}");
        let load =
            |name: &str, shape: &[i64]| weights.load(&format!("{p}.{name}"), shape, kind, device);
        let norm = |name: &str, dim: i64| {
            ZeroCentredNorm::load(weights, &format!("{p}.{name}"), dim, eps, device)
        };
        let mixer = match hybrid.layers.get(l) {
            Some(super::hybrid_config::LayerKind::LinearAttention) => {
                Mixer::DeltaNet(Box::new(load_delta_net(config, &p, weights, device, kind)?))
            }
            _ => {
                let (heads, kvh, d) = (
                    config.num_attention_heads,
                    config.kv_heads(),
                    config.head_dim(),
                );
                let q = load("self_attn.q_proj.weight", &[2 * heads * d, h])?;
                let k = load("self_attn.k_proj.weight", &[kvh * d, h])?;
                let v = load("self_attn.v_proj.weight", &[kvh * d, h])?;
                Mixer::Attention(GatedAttention {
                    qkv: Tensor::cat(&[q, k, v], 0),
                    o_proj: load("self_attn.o_proj.weight", &[h, heads * d])?,
                    q_norm: norm("self_attn.q_norm.weight", d)?,
                    k_norm: norm("self_attn.k_norm.weight", d)?,
                    heads,
                    kv_heads: kvh,
                    head_dim: d,
                    rotary_dim: config.rotary_dim(),
                })
            }
        };
        let mlp = FeedForward::load(config, l, &p, weights, device, kind)?;
        Ok(HybridLayer {
            input_norm: norm("input_layernorm.weight", h)?,
            mixer,
            post_norm: norm("post_attention_layernorm.weight", h)?,
            mlp,
        })
    }
}

/// A Gated DeltaNet layer's weights under `{p}.linear_attn.*`, Qwen3-Next's fused
/// per-key-head projections rearranged into Qwen3.5's order.
fn load_delta_net(
    config: &TargetConfig,
    p: &str,
    weights: &dyn WeightSource,
    device: Device,
    kind: Kind,
) -> Result<GatedDeltaNet> {
    let hybrid = config
        .hybrid
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("not a hybrid config"))?;
    let s = hybrid.gdn;
    let h = config.hidden_size;
    let load = |name: &str, shape: &[i64]| {
        weights.load(&format!("{p}.linear_attn.{name}"), shape, kind, device)
    };
    let (conv_dim, value_width, hv) = (s.conv_dim(), s.value_heads * s.value_dim, s.value_heads);
    let in_proj = match hybrid.layout {
        GdnLayout::Split => Tensor::cat(
            &[
                load("in_proj_qkv.weight", &[conv_dim, h])?,
                load("in_proj_z.weight", &[value_width, h])?,
                load("in_proj_b.weight", &[hv, h])?,
                load("in_proj_a.weight", &[hv, h])?,
            ],
            0,
        ),
        GdnLayout::PerKeyHead => {
            let qkvz = load("in_proj_qkvz.weight", &[conv_dim + value_width, h])?;
            let ba = load("in_proj_ba.weight", &[2 * hv, h])?;
            split_per_key_head(&qkvz, &ba, s)
        }
    };
    // transformers: `-A_log.float().exp()` of the parameter in the model's dtype
    let a_log = load("A_log", &[hv])?.to_kind(Kind::Float);
    Ok(GatedDeltaNet {
        in_proj,
        conv: load("conv1d.weight", &[conv_dim, 1, s.conv_kernel])?,
        neg_a: -a_log.exp(),
        dt_bias: load("dt_bias", &[hv])?,
        norm: load("norm.weight", &[s.value_dim])?,
        out_proj: load("out_proj.weight", &[h, value_width])?,
        shape: s,
        eps: config.rms_norm_eps,
        kernels: None,
        fused: None,
    })
}

/// Qwen3-Next's `in_proj_qkvz` rows, per key head [q, k, v of its value heads, z of them],
/// and `in_proj_ba` rows, per key head [b of its value heads, a of them], as one matrix of
/// Qwen3.5's order [all q; all k; all v; all z; all b; all a].
fn split_per_key_head(qkvz: &Tensor, ba: &Tensor, s: GdnShape) -> Tensor {
    let (hk, dk, dv) = (s.key_heads, s.key_dim, s.value_dim);
    let r = s.value_heads / hk;
    let h = qkvz.size()[1];
    let groups = qkvz.view([hk, 2 * dk + 2 * r * dv, h]);
    let part = |from: i64, len: i64| groups.narrow(1, from, len).reshape([-1, h]);
    let ba = ba.view([hk, 2 * r, h]);
    let ba_part = |from: i64| ba.narrow(1, from, r).reshape([-1, h]);
    Tensor::cat(
        &[
            part(0, dk),
            part(dk, dk),
            part(2 * dk, r * dv),
            part(2 * dk + r * dv, r * dv),
            ba_part(0),
            ba_part(r),
        ],
        0,
    )
}
