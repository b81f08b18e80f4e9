//! The gated delta rule of Gated DeltaNet layers (Yang, Kautz, Hatamizadeh, "Gated Delta
//! Networks", 2024; transformers 5.23's `torch_chunk_gated_delta_rule` and
//! `torch_recurrent_gated_delta_rule` in `models/qwen3_5/modeling_qwen3_5.py` compute the same).
//!
//! Per value head, with a state `S` [key_dim, value_dim] and at each token
//! `S <- exp(g) S + k (beta (v - exp(g) S^T k))^T`, output `S^T q / sqrt(key_dim)`.
//! [`gated_delta_rule`] runs it chunk by chunk (64 tokens: the WY form with one triangular solve
//! per chunk and a sequential scan over chunks); [`gated_delta_rule_steps`] token by token,
//! keeping the state after each (what rolling a speculative step back needs). Both take CUDA
//! tensors to the NVRTC kernels of [`crate::aten_ext::gdn`] when the caller holds them for the
//! tensors' device, and run libtorch's operations otherwise.

use tch::{Kind, Tensor};

use crate::aten_ext::gdn::{GdnInputs, GdnKernels};

/// Tokens per chunk of [`gated_delta_rule`] (transformers' and FLA's).
pub(crate) const CHUNK: i64 = 64;

/// The l2 norm transformers applies to queries and keys before the rule (FLA's:
/// `x / sqrt(sum(x^2) + 1e-6)`), in float32.
pub(crate) fn l2norm(x: &Tensor) -> Tensor {
    let x = x.to_kind(Kind::Float);
    let inv = (&x * &x)
        .sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)
        .g_add_scalar(1e-6)
        .rsqrt();
    x * inv
}

/// The conv and recurrent states of one Gated DeltaNet layer after some tokens of a batch.
#[derive(Debug)]
pub struct GdnState {
    /// The last `conv_kernel - 1` inputs of the causal convolution (q, k, v before it):
    /// [batch, conv_dim, conv_kernel - 1], in the model's dtype.
    pub conv: Tensor,
    /// The delta rule's state: [batch, value_heads, key_dim, value_dim], float32.
    pub recurrent: Tensor,
}

impl GdnState {
    /// Another handle on the same tensors (states are replaced, never written in place).
    pub fn shallow_clone(&self) -> Self {
        GdnState {
            conv: self.conv.shallow_clone(),
            recurrent: self.recurrent.shallow_clone(),
        }
    }

    /// Keeps the batch rows `rows` (int64 indices).
    pub fn select_rows(&self, rows: &Tensor) -> Self {
        let pick = |t: &Tensor| t.index_select(0, &rows.to_device(t.device()));
        GdnState {
            conv: pick(&self.conv),
            recurrent: pick(&self.recurrent),
        }
    }
}

/// The gated delta rule over a sequence ([`GdnInputs`]: q and k are l2-normalised here, in
/// float32, see [`l2norm`]: transformers' `use_qk_l2norm_in_kernel`); each key head serves
/// `value_heads / key_heads` consecutive value heads. Returns the output [B, T, value_heads,
/// value_dim] in `v`'s dtype and the final state (float32). Computed in float32 whatever the
/// inputs' dtype.
///
/// The one dispatch point of the rule: CUDA tensors go to `kernels` (loaded for their device,
/// q, k and v of one dtype; the kernel normalises q and k itself, with the same formula);
/// everything else, and a call the kernels refuse, to libtorch's operations. Every caller (full
/// forwards, prefill, multi-token steps) comes through here or [`gated_delta_rule_steps`].
pub fn gated_delta_rule(x: &GdnInputs<'_>, kernels: Option<&GdnKernels>) -> (Tensor, Tensor) {
    if let Some(done) = on_kernels(kernels, x, |kernels| kernels.forward(x, true)) {
        return done;
    }
    let heads = Heads::new(x);
    if x.q.size()[1] == 1 {
        // one token: the recurrence is one step (a chunk would pad it to 64)
        let (out, states) = recurrence(heads, x.initial_state, x.v.kind());
        return (out, states.select(1, 0));
    }
    chunked_rule(heads, x.initial_state, x.v.kind())
}

/// What `run` gives on `kernels` where they serve `x` (on their device, q, k and v of one
/// dtype); `None` sends the call to libtorch's operations, with a warning where the kernels
/// refused it.
fn on_kernels<T>(
    kernels: Option<&GdnKernels>,
    x: &GdnInputs<'_>,
    run: impl FnOnce(&GdnKernels) -> anyhow::Result<T>,
) -> Option<T> {
    let (q, k, v) = (x.q, x.k, x.v);
    let kernels = kernels
        .filter(|g| q.device() == g.device() && q.kind() == v.kind() && k.kind() == v.kind())?;
    run(kernels)
        .map_err(|e| log::warn!("gated delta rule kernel refused a call, libtorch instead: {e:#}"))
        .ok()
}

/// Inputs in the rule's working form: [B, value_heads, T, dim] float32 (queries and keys
/// l2-normalised, queries scaled by `1 / sqrt(key_dim)`, keys and queries repeated per value
/// head), `g` and `beta` [B, H, T].
struct Heads {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

impl Heads {
    fn new(x: &GdnInputs<'_>) -> Self {
        let (q, k, v) = (&l2norm(x.q), &l2norm(x.k), x.v);
        let group = v.size()[2] / k.size()[2].max(1);
        let per_value_head = |t: &Tensor| match group {
            1 => t.shallow_clone(),
            _ => t.repeat_interleave_self_int(group, 2, None),
        };
        let f32_heads = |t: &Tensor| t.transpose(1, 2).to_kind(Kind::Float).contiguous();
        let key_dim = k.size()[3];
        Heads {
            q: f32_heads(&per_value_head(q)) * (key_dim as f64).powf(-0.5),
            k: f32_heads(&per_value_head(k)),
            v: f32_heads(v),
            g: f32_heads(x.g),
            beta: f32_heads(x.beta),
        }
    }

    fn zero_state(&self) -> Tensor {
        let (b, h, _, dk) = self.k.size4().unwrap_or((0, 0, 0, 0));
        let dv = self.v.size()[3];
        Tensor::zeros([b, h, dk, dv], (Kind::Float, self.v.device()))
    }

    fn state(&self, initial: Option<&Tensor>) -> Tensor {
        match initial {
            Some(s) => s.to_kind(Kind::Float),
            None => self.zero_state(),
        }
    }
}

/// The chunked form (see the module doc): per chunk, the decays between its positions, the
/// UT transform solved once for the new values and the decayed keys, then one scan over chunks.
fn chunked_rule(x: Heads, initial_state: Option<&Tensor>, kind: Kind) -> (Tensor, Tensor) {
    let mut state = x.state(initial_state);
    let (b, h, t, dk) = x.k.size4().unwrap_or((0, 0, 0, 0));
    let dv = x.v.size()[3];
    let pad = (CHUNK - t % CHUNK) % CHUNK;
    let n = (t + pad) / CHUNK;
    let chunks = |t: &Tensor, width: i64| {
        t.constant_pad_nd([0, 0, 0, pad])
            .reshape([b, h, n, CHUNK, width])
    };
    let beta = x.beta.unsqueeze(-1);
    let (qc, kc) = (chunks(&x.q, dk), chunks(&x.k, dk));
    let v_beta = chunks(&(&x.v * &beta), dv);
    let k_beta = chunks(&(&x.k * &beta), dk);
    let cum =
        x.g.constant_pad_nd([0, pad])
            .reshape([b, h, n, CHUNK])
            .cumsum(-1, Kind::Float);
    let device = x.v.device();
    let above = Tensor::ones([CHUNK, CHUNK], (Kind::Bool, device)).triu(1);
    // exp(cum_i - cum_j) for j <= i, else 0
    let decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2))
        .masked_fill(&above, f64::NEG_INFINITY)
        .exp();
    let ut = kc_product(&k_beta, &kc) * &decay;
    let intra = kc_product(&qc, &kc) * &decay;
    let cum_exp = cum.exp().unsqueeze(-1);
    let new_values = ut.linalg_solve_triangular(&v_beta, false, true, true);
    let k_cumdecay = ut.linalg_solve_triangular(&(&k_beta * &cum_exp), false, true, true);
    let last = cum.narrow(-1, CHUNK - 1, 1);
    let q_decayed = &qc * &cum_exp;
    let k_to_end = &kc * (&last - &cum).exp().unsqueeze(-1);
    let chunk_decay = last.exp().unsqueeze(-1); // [B, H, N, 1, 1]
    let mut outs = Vec::with_capacity(n as usize);
    for i in 0..n {
        let at = |t: &Tensor| t.select(2, i);
        let v_new = at(&new_values) - at(&k_cumdecay).matmul(&state);
        outs.push(at(&q_decayed).matmul(&state) + at(&intra).matmul(&v_new));
        state = &state * at(&chunk_decay) + at(&k_to_end).transpose(-1, -2).matmul(&v_new);
    }
    let out = Tensor::cat(&outs, 2).narrow(2, 0, t);
    (out.transpose(1, 2).to_kind(kind).contiguous(), state)
}

/// `a @ b^T` over the last two dimensions.
fn kc_product(a: &Tensor, b: &Tensor) -> Tensor {
    a.matmul(&b.transpose(-1, -2))
}

/// The gated delta rule token by token (arguments as [`gated_delta_rule`]): the output and the
/// state after each token, [B, T, value_heads, key_dim, value_dim] float32 (the last is the
/// final state). For short steps whose every prefix may have to be resumed from.
pub fn gated_delta_rule_steps(x: &GdnInputs<'_>, kernels: Option<&GdnKernels>) -> (Tensor, Tensor) {
    let on_gpu = on_kernels(kernels, x, |kernels| {
        let (b, t, hv, dv) = x.v.size4().unwrap_or((0, 0, 0, 0));
        let dk = x.k.size().last().copied().unwrap_or(0);
        let states = Tensor::empty([b, t, hv, dk, dv], (Kind::Float, x.v.device()));
        kernels
            .forward_with_states(x, true, &states)
            .map(|out| (out, states))
    });
    on_gpu.unwrap_or_else(|| recurrence(Heads::new(x), x.initial_state, x.v.kind()))
}

/// The recurrence over `x`'s tokens: the output [B, T, H, dv] in `kind` and the state after
/// each token [B, T, H, dk, dv].
fn recurrence(x: Heads, initial_state: Option<&Tensor>, kind: Kind) -> (Tensor, Tensor) {
    let mut state = x.state(initial_state);
    let t = x.k.size()[2];
    let mut outs = Vec::with_capacity(t as usize);
    let mut states = Vec::with_capacity(t as usize);
    for i in 0..t {
        let at = |t: &Tensor| t.select(2, i);
        let (q_t, k_t, v_t) = (at(&x.q), at(&x.k), at(&x.v));
        state = &state * at(&x.g).exp().unsqueeze(-1).unsqueeze(-1);
        // what the state predicts for k_t, then the correction toward v_t
        let predicted = k_t.unsqueeze(-2).matmul(&state).squeeze_dim(-2);
        let delta = (v_t - predicted) * at(&x.beta).unsqueeze(-1);
        state = &state + k_t.unsqueeze(-1).matmul(&delta.unsqueeze(-2));
        outs.push(q_t.unsqueeze(-2).matmul(&state).squeeze_dim(-2));
        states.push(state.shallow_clone());
    }
    let out = Tensor::stack(&outs, 2); // [B, H, T, dv]
    (
        out.transpose(1, 2).to_kind(kind).contiguous(),
        Tensor::stack(&states, 1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Random inputs of [`gated_delta_rule`] for `t` tokens, 2 key heads and 4 value heads.
    fn inputs(t: i64, seed: i64) -> [Tensor; 5] {
        tch::manual_seed(seed);
        let o = (Kind::Double, Device::Cpu);
        let (b, hk, hv, dk, dv) = (2, 2, 4, 8, 6);
        // not normalised: the rule normalises q and k itself
        let q = Tensor::randn([b, t, hk, dk], o);
        let k = Tensor::randn([b, t, hk, dk], o);
        let v = Tensor::randn([b, t, hv, dv], o);
        let g = -(Tensor::rand([b, t, hv], o) * 0.5);
        let beta = Tensor::rand([b, t, hv], o);
        [q, k, v, g, beta]
    }

    /// The recurrence written out per batch row, head and token with explicit outer products
    /// (float64), q and k l2-normalised first: the definition the two forms must meet.
    fn naive(x: &[Tensor; 5], initial: Option<&Tensor>) -> (Tensor, Tensor) {
        let [q, k, v, g, beta] = x;
        let unit = |t: &Tensor| {
            t / (t * t)
                .sum_dim_intlist(-1, true, Kind::Double)
                .g_add_scalar(1e-6)
                .sqrt()
        };
        let (q, k) = (&unit(q), &unit(k));
        let (b, t, hk, dk) = k.size4().unwrap();
        let (hv, dv) = (v.size()[2], v.size()[3]);
        let o = (Kind::Double, Device::Cpu);
        let out = Tensor::zeros([b, t, hv, dv], o);
        let finals = Tensor::zeros([b, hv, dk, dv], o);
        for bi in 0..b {
            for h in 0..hv {
                let kh = h / (hv / hk);
                let mut s = match initial {
                    Some(s) => s.get(bi).get(h).to_kind(Kind::Double).copy(),
                    None => Tensor::zeros([dk, dv], o),
                };
                for i in 0..t {
                    let qi = q.get(bi).get(i).get(kh) / (dk as f64).sqrt();
                    let ki = k.get(bi).get(i).get(kh);
                    let vi = v.get(bi).get(i).get(h);
                    s *= g.get(bi).get(i).get(h).exp();
                    let kv = ki.unsqueeze(0).mm(&s).squeeze_dim(0);
                    let delta = (vi - kv) * beta.get(bi).get(i).get(h);
                    s = &s + ki.unsqueeze(1).mm(&delta.unsqueeze(0));
                    out.get(bi)
                        .get(i)
                        .get(h)
                        .copy_(&qi.unsqueeze(0).mm(&s).squeeze_dim(0));
                }
                finals.get(bi).get(h).copy_(&s);
            }
        }
        (out, finals)
    }

    /// `x` as the rule's inputs, from `initial`.
    fn rule<'a>(x: &'a [Tensor; 5], initial: Option<&'a Tensor>) -> GdnInputs<'a> {
        let [q, k, v, g, beta] = x;
        GdnInputs {
            q,
            k,
            v,
            g,
            beta,
            initial_state: initial,
        }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
            .abs()
            .max()
            .double_value(&[])
    }

    /// Both forms against the written-out recurrence, over more than one chunk and a partial
    /// one, with and without an initial state. (A chunked rule that does not carry the state
    /// from one chunk to the next was off by 0.22 here; one without the decay inside a chunk by
    /// 0.61.)
    #[test]
    fn chunked_and_stepwise_forms_equal_the_recurrence() {
        let t = CHUNK + 13;
        let x = inputs(t, 7);
        let start = Tensor::randn([2, 4, 8, 6], (Kind::Double, Device::Cpu)) * 0.5;
        for initial in [None, Some(&start)] {
            let (want, want_state) = naive(&x, initial);
            let (out, state) = gated_delta_rule(&rule(&x, initial), None);
            assert!(max_diff(&out, &want) < 1e-5, "{}", max_diff(&out, &want));
            assert!(max_diff(&state, &want_state) < 1e-5);
            let (out, states) = gated_delta_rule_steps(&rule(&x, initial), None);
            assert!(max_diff(&out, &want) < 1e-5);
            assert!(max_diff(&states.select(1, t - 1), &want_state) < 1e-5);
            // the state after token 20 resumes the rest
            let rest = x.each_ref().map(|x| x.narrow(1, 21, t - 21));
            let (tail, _) = gated_delta_rule(&rule(&rest, Some(&states.select(1, 20))), None);
            assert!(max_diff(&tail, &want.narrow(1, 21, t - 21)) < 1e-5);
        }
        // a single token takes the stepwise path
        let one = inputs(1, 8);
        let (want, _) = naive(&one, Some(&start));
        let (out, _) = gated_delta_rule(&rule(&one, Some(&start)), None);
        assert!(max_diff(&out, &want) < 1e-6);
    }
}
