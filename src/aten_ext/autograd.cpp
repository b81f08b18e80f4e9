// Autograd functions whose forward and backward passes are the program's own kernels (tch
// cannot attach a backward pass to an operation from Rust): the C++ side is libtorch's
// `torch::autograd::Function`, which records the node in the graph and saves what the backward
// pass needs; the computation itself is a Rust function (src/aten_ext/fused_autograd.rs) called with
// the tensors, which launches a run-time compiled kernel or runs libtorch's operations.
// Built by build.rs with the other shims. Tensors cross as `at::Tensor *` (tch's); a tensor
// returned through `out` is a `new at::Tensor`, taken over here or by tch.

#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <torch/csrc/autograd/custom_function.h>

#include "guard.h"

#include <string>
#include <vector>

// The rotation of rotary position embeddings (fused_autograd.rs's `rotate_callback`): `*out` =
// x * cos + roll(x, half) * sin, or with `inverse` the transposed rotation (its backward
// pass), x * cos - roll(x, half) * sin. `state` is opaque to this side. Returns 0, or else
// writes a message of at most `msg_len` bytes (terminated) to `msg`.
typedef int (*dflash_rotate_fn)(const void *state, const at::Tensor *x, const at::Tensor *cos,
                                const at::Tensor *sin, int inverse, at::Tensor **out,
                                char *msg, size_t msg_len);

// SwiGLU's product (fused_autograd.rs's `swiglu_callback`): without `grad` (null),
// `*out0` = silu(gate) * up; with it, the backward pass: `*out0` = the gradient of gate,
// `*out1` = that of up. Returns 0, or else writes a message to `msg` as dflash_rotate_fn does.
typedef int (*dflash_swiglu_fn)(const void *state, const at::Tensor *gate, const at::Tensor *up,
                                const at::Tensor *grad, at::Tensor **out0, at::Tensor **out1,
                                char *msg, size_t msg_len);

// RMSNorm (fused_rms_norm.rs's `rms_norm_callback`): without `grad` (null), `*out0` =
// x * rsqrt(mean(x^2) + eps) * weight over the last dimension; with it, the backward pass:
// `*out0` = the gradient of x, `*out1` = that of the weight. Returns 0, or else writes a message
// to `msg` as dflash_rotate_fn does.
typedef int (*dflash_rms_norm_fn)(const void *state, const at::Tensor *x,
                                  const at::Tensor *weight, const at::Tensor *grad, double eps,
                                  at::Tensor **out0, at::Tensor **out1, char *msg,
                                  size_t msg_len);

// A layer's residual sum and its RMSNorm (fused_rms_norm.rs's `add_rms_norm_callback`):
// forward (`grad` null), `*out0` = s = h + a and `*out1` = rms_norm(s) * weight from `x0` = h
// and `x1` = a; backward, from `x0` = s, `x1` = the gradient of s (or null where s has none)
// and `grad` = that of the norm's output: `*out0` = the gradient of s's inputs (the norm's
// backward pass plus s's own gradient), `*out1` = that of the weight. Returns 0, or else writes
// a message to `msg` as dflash_rotate_fn does.
typedef int (*dflash_add_rms_norm_fn)(const void *state, const at::Tensor *x0,
                                      const at::Tensor *x1, const at::Tensor *weight,
                                      const at::Tensor *grad, double eps, at::Tensor **out0,
                                      at::Tensor **out1, char *msg, size_t msg_len);

// The drafter's block attention's own-block part and merge (fused_block_attention.rs's
// `block_attention_callback`). Forward (`dout` null): from the queries `q` [E, rows, heads, d],
// the blocks' own keys and values `kb`, `vb` [E, rows, kv, d], the blocks' anchors and the
// context part's output `o` [E, rows, heads, d] and log-sum-exp `lse` (E * heads * rows
// floats), `*out0` = the merged output [E, rows, heads, d], `*out1` = the merged log-sum-exp
// (lse's shape). Backward: `o` and `lse` are the merged ones, `dout` the output's gradient
// [E, rows, heads, d]; the own part's query gradient is added into `*dq` (the context part's,
// [E, rows, heads, d], dense) in place, `*out0`, `*out1` = the gradients of kb and vb. Returns 0,
// or else writes a message to `msg` as dflash_rotate_fn does.
typedef int (*dflash_block_attention_fn)(const void *state, const at::Tensor *q,
                                         const at::Tensor *kb, const at::Tensor *vb,
                                         const at::Tensor *anchors, const at::Tensor *o,
                                         const at::Tensor *lse, const at::Tensor *dout,
                                         at::Tensor *dq, at::Tensor **out0, at::Tensor **out1,
                                         char *msg, size_t msg_len);

namespace {

// A tensor the Rust side returned through an out-pointer, taken over.
at::Tensor take(at::Tensor *t) {
    at::Tensor result = std::move(*t);
    delete t;
    return result;
}

at::Tensor rotate(dflash_rotate_fn fn, const std::string &state, const at::Tensor &x,
                  const at::Tensor &cos, const at::Tensor &sin, int inverse) {
    char msg[512] = {0};
    at::Tensor *out = nullptr;
    const int status = fn(state.data(), &x, &cos, &sin, inverse, &out, msg, sizeof msg);
    TORCH_CHECK(status == 0 && out != nullptr, "rotary embedding: ", msg);
    return take(out);
}

// out = silu(gate) * up; the backward pass needs gate and up (libtorch's operations also keep
// silu(gate)).
struct SwiGlu : public torch::autograd::Function<SwiGlu> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &gate,
                              const at::Tensor &up, int64_t fn, const std::string &state) {
        ctx->save_for_backward({gate, up});
        ctx->saved_data["fn"] = fn;
        ctx->saved_data["state"] = state;
        char msg[512] = {0};
        at::Tensor *out = nullptr;
        const int status = reinterpret_cast<dflash_swiglu_fn>(fn)(
            state.data(), &gate, &up, nullptr, &out, nullptr, msg, sizeof msg);
        TORCH_CHECK(status == 0 && out != nullptr, "SwiGLU: ", msg);
        return take(out);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        if (!grads[0].defined()) {
            return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
        }
        const auto saved = ctx->get_saved_variables();
        const auto fn = reinterpret_cast<dflash_swiglu_fn>(ctx->saved_data["fn"].toInt());
        const std::string &state = ctx->saved_data["state"].toStringRef();
        char msg[512] = {0};
        at::Tensor *d_gate = nullptr, *d_up = nullptr;
        const int status =
            fn(state.data(), &saved[0], &saved[1], &grads[0], &d_gate, &d_up, msg, sizeof msg);
        TORCH_CHECK(status == 0 && d_gate != nullptr && d_up != nullptr, "SwiGLU backward: ",
                    msg);
        return {take(d_gate), take(d_up), at::Tensor(), at::Tensor()};
    }
};

// y = rotate(x) with cos and sin constants: the backward pass is the inverse rotation of the
// output's gradient, so nothing of x is saved.
struct Rotary : public torch::autograd::Function<Rotary> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x,
                              const at::Tensor &cos, const at::Tensor &sin, int64_t fn,
                              const std::string &state) {
        ctx->save_for_backward({cos, sin});
        ctx->saved_data["fn"] = fn;
        ctx->saved_data["state"] = state;
        return rotate(reinterpret_cast<dflash_rotate_fn>(fn), state, x, cos, sin, 0);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        at::Tensor grad_x;
        if (grads[0].defined()) {
            const auto fn = reinterpret_cast<dflash_rotate_fn>(ctx->saved_data["fn"].toInt());
            grad_x = rotate(fn, ctx->saved_data["state"].toStringRef(), grads[0], saved[0],
                            saved[1], 1);
        }
        return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

// y = rms_norm(x, weight): the backward pass needs x and the weight (libtorch's operations
// also keep each row's rstd; the kernel computes it again from x, which it reads anyway).
struct RmsNorm : public torch::autograd::Function<RmsNorm> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x,
                              const at::Tensor &weight, double eps, int64_t fn,
                              const std::string &state) {
        ctx->save_for_backward({x, weight});
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["fn"] = fn;
        ctx->saved_data["state"] = state;
        char msg[512] = {0};
        at::Tensor *out = nullptr;
        const int status = reinterpret_cast<dflash_rms_norm_fn>(fn)(
            state.data(), &x, &weight, nullptr, eps, &out, nullptr, msg, sizeof msg);
        TORCH_CHECK(status == 0 && out != nullptr, "RMSNorm: ", msg);
        return take(out);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        if (!grads[0].defined()) {
            return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
        }
        const auto saved = ctx->get_saved_variables();
        const auto fn = reinterpret_cast<dflash_rms_norm_fn>(ctx->saved_data["fn"].toInt());
        const std::string &state = ctx->saved_data["state"].toStringRef();
        const double eps = ctx->saved_data["eps"].toDouble();
        char msg[512] = {0};
        at::Tensor *dx = nullptr, *dw = nullptr;
        const int status = fn(state.data(), &saved[0], &saved[1], &grads[0], eps, &dx, &dw, msg,
                              sizeof msg);
        TORCH_CHECK(status == 0 && dx != nullptr && dw != nullptr, "RMSNorm backward: ", msg);
        return {take(dx), take(dw), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

// (s, y) = (h + a, rms_norm(h + a, weight)): the backward pass needs s (an output, saved as
// such) and the weight; both inputs take the same gradient, the norm's input gradient plus s's
// own, summed in the norm's backward kernel where autograd would add them in a pass of its own.
struct AddRmsNorm : public torch::autograd::Function<AddRmsNorm> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx,
                                                  const at::Tensor &h, const at::Tensor &a,
                                                  const at::Tensor &weight, double eps,
                                                  int64_t fn, const std::string &state) {
        char msg[512] = {0};
        at::Tensor *sum = nullptr, *y = nullptr;
        const int status = reinterpret_cast<dflash_add_rms_norm_fn>(fn)(
            state.data(), &h, &a, &weight, nullptr, eps, &sum, &y, msg, sizeof msg);
        TORCH_CHECK(status == 0 && sum != nullptr && y != nullptr, "residual RMSNorm: ", msg);
        at::Tensor s = take(sum);
        ctx->save_for_backward({s, weight});
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["fn"] = fn;
        ctx->saved_data["state"] = state;
        ctx->set_materialize_grads(false);
        return {s, take(y)};
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const at::Tensor &ds = grads[0];
        const at::Tensor &dy = grads[1];
        if (!dy.defined()) {
            return {ds, ds, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
        }
        const auto saved = ctx->get_saved_variables();
        const auto fn = reinterpret_cast<dflash_add_rms_norm_fn>(ctx->saved_data["fn"].toInt());
        const std::string &state = ctx->saved_data["state"].toStringRef();
        const double eps = ctx->saved_data["eps"].toDouble();
        char msg[512] = {0};
        at::Tensor *dx = nullptr, *dw = nullptr;
        const int status = fn(state.data(), &saved[0], ds.defined() ? &ds : nullptr, &saved[1],
                              &dy, eps, &dx, &dw, msg, sizeof msg);
        TORCH_CHECK(status == 0 && dx != nullptr && dw != nullptr,
                    "residual RMSNorm backward: ", msg);
        at::Tensor d = take(dx);
        return {d, d, take(dw), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

// x W_i^T for several weights W_i [out_i, in] of one input x [..., in] (no biases): the
// products of a layer's projections that read the same activations (queries, keys and values;
// SwiGLU's gate and up). The backward pass sums the input's gradient inside the matrix
// products (`addmm_` with beta 1 adds each product into the first's result), where autograd
// would write every product's gradient and add them in separate passes over the activations.
struct SharedInputLinear : public torch::autograd::Function<SharedInputLinear> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx,
                                                  const at::Tensor &x, at::TensorList weights) {
        torch::autograd::variable_list to_save{x};
        torch::autograd::variable_list out;
        // which inputs take a gradient (bit i: input i, x first)
        int64_t wanted = x.requires_grad() ? 1 : 0;
        for (size_t i = 0; i < weights.size(); ++i) {
            to_save.push_back(weights[i]);
            out.push_back(at::linear(x, weights[i]));
            if (weights[i].requires_grad()) {
                wanted |= int64_t{1} << (i + 1);
            }
        }
        ctx->save_for_backward(to_save);
        ctx->saved_data["wanted"] = wanted;
        // an output without gradient costs no product in the backward pass
        ctx->set_materialize_grads(false);
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0];
        const int64_t in = x.size(-1);
        const at::Tensor x2 = x.reshape({-1, in});
        const int64_t wanted = ctx->saved_data["wanted"].toInt();
        torch::autograd::variable_list result(saved.size());
        at::Tensor dx;
        for (size_t i = 0; i < grads.size(); ++i) {
            if (!grads[i].defined()) {
                continue;
            }
            const at::Tensor &w = saved[i + 1];
            const at::Tensor g = grads[i].reshape({-1, w.size(0)});
            if (wanted & 1) {
                if (dx.defined()) {
                    dx.addmm_(g, w);
                } else {
                    dx = at::mm(g, w);
                }
            }
            if (wanted & (int64_t{1} << (i + 1))) {
                result[i + 1] = at::mm(g.t(), x2);
            }
        }
        if (dx.defined()) {
            result[0] = dx.view(x.sizes());
        }
        return result;
    }
};

// The sequence `seq`'s first `len` positions of a context tensor `c` [B, S, kv, d] (token-major,
// each position dense) as [1, kv, len, d]. The batch stride of a batch of one is free: it is set
// to that of a dense [1, len, kv, d], so that the view's strides depend on `len` only (cuDNN
// builds a plan per shape and strides).
at::Tensor context_view(const at::Tensor &c, int64_t seq, int64_t len) {
    const int64_t kv = c.size(2), d = c.size(3);
    return c.as_strided({1, kv, len, d}, {len * kv * d, d, kv * d, 1},
                        c.storage_offset() + seq * c.stride(0));
}

// The drafter's block attention of one layer, in groups of consecutive blocks of one sequence:
// queries q [T, heads, d] (token-major; each group's rows consecutive) see their sequence's
// context keys and values ck, cv [B, S, kv, d] up to the group's context length under its
// additive mask [1, 1, rows, context] (cuDNN's fused attention over a view: no copies), and
// their block's own keys kb, vb [T, kv, d] (the callback's kernel, one launch over every row,
// which merges the two parts by their log-sum-exp). The backward pass gives each part the
// merged output and log-sum-exp, as flash attention's backward pass takes them: each part's
// gradients are then its share of the exact ones; the groups' context gradients are summed.
// Output [T, heads, d].
struct GroupedBlockAttention : public torch::autograd::Function<GroupedBlockAttention> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &q,
                              const at::Tensor &ck, const at::Tensor &cv, const at::Tensor &kb,
                              const at::Tensor &vb, const at::Tensor &anchors, int64_t masks,
                              const std::vector<int64_t> &groups, int64_t fn,
                              const std::string &state) {
        // the masks: a vector of the caller's, passed by address (no gradient, one per group;
        // a vector of tensors among the arguments would count as inputs)
        const auto &biases = *reinterpret_cast<const std::vector<at::Tensor> *>(masks);
        const auto pass = reinterpret_cast<dflash_block_attention_fn>(fn);
        const int64_t n = static_cast<int64_t>(biases.size());
        std::vector<at::Tensor> outs, lses, saved{q, ck, cv, kb, vb, anchors};
        int64_t lse_dims = 0;
        for (int64_t g = 0; g < n; ++g) {
            const int64_t seq = groups[3 * g], row0 = groups[3 * g + 1], rows = groups[3 * g + 2];
            const int64_t len = biases[g].size(3);
            const auto parts = at::_scaled_dot_product_cudnn_attention(
                q.narrow(0, row0, rows).unsqueeze(0).transpose(1, 2), context_view(ck, seq, len),
                context_view(cv, seq, len), biases[g], /*compute_log_sumexp=*/true);
            // [1, heads, rows, d] as cuDNN wrote it (token-major like q: then no copy)
            outs.push_back(std::get<0>(parts).transpose(1, 2).squeeze(0));
            lse_dims = std::get<1>(parts).dim();
            lses.push_back(std::get<1>(parts).reshape({q.size(1), rows}));
            saved.insert(saved.end(), {biases[g], std::get<6>(parts), std::get<7>(parts)});
        }
        // every row's context part [1, T, heads, d] and log-sum-exp [1, heads, T]
        const at::Tensor o1 = at::cat(outs, 0).unsqueeze(0);
        const at::Tensor lse1 = at::cat(lses, 1).unsqueeze(0);
        const at::Tensor q1 = q.unsqueeze(0), kb1 = kb.unsqueeze(0), vb1 = vb.unsqueeze(0);
        char msg[512] = {0};
        at::Tensor *out = nullptr, *lse = nullptr;
        const int status = pass(state.data(), &q1, &kb1, &vb1, &anchors, &o1, &lse1, nullptr,
                                nullptr, &out, &lse, msg, sizeof msg);
        TORCH_CHECK(status == 0 && out != nullptr && lse != nullptr, "block attention: ", msg);
        at::Tensor merged = take(out).squeeze(0);
        saved.push_back(merged);
        saved.push_back(take(lse));
        ctx->save_for_backward(saved);
        ctx->saved_data["groups"] = groups;
        ctx->saved_data["lse_dims"] = lse_dims;
        ctx->saved_data["fn"] = fn;
        ctx->saved_data["state"] = state;
        return merged;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        torch::autograd::variable_list none(10);
        if (!grads[0].defined()) {
            return none;
        }
        const auto saved = ctx->get_saved_variables();
        const size_t count = saved.size();
        const at::Tensor &q = saved[0], &ck = saved[1], &cv = saved[2], &kb = saved[3],
                         &vb = saved[4], &anchors = saved[5], &out = saved[count - 2],
                         &lse = saved[count - 1];
        const at::Tensor dout = grads[0].contiguous();
        const auto groups = ctx->saved_data["groups"].toIntVector();
        const int64_t lse_dims = ctx->saved_data["lse_dims"].toInt();
        const auto pass = reinterpret_cast<dflash_block_attention_fn>(ctx->saved_data["fn"].toInt());
        const std::string &state = ctx->saved_data["state"].toStringRef();
        const int64_t n = static_cast<int64_t>(groups.size() / 3), heads = q.size(1);
        at::Tensor dck = at::zeros_like(ck), dcv = at::zeros_like(cv);
        std::vector<at::Tensor> dqs;
        for (int64_t g = 0; g < n; ++g) {
            const int64_t seq = groups[3 * g], row0 = groups[3 * g + 1], rows = groups[3 * g + 2];
            const at::Tensor &bias = saved[6 + 3 * g];
            const int64_t len = bias.size(3);
            // the merged log-sum-exp of the group's rows, in the shape cuDNN gave its own
            at::Tensor lse_g = lse.narrow(2, row0, rows).contiguous().view({1, heads, rows});
            if (lse_dims == 4) {
                lse_g = lse_g.unsqueeze(-1);
            }
            const auto rows_of = [&](const at::Tensor &t) {
                return t.narrow(0, row0, rows).unsqueeze(0).transpose(1, 2);
            };
            auto context = at::_scaled_dot_product_cudnn_attention_backward(
                rows_of(dout), rows_of(q), context_view(ck, seq, len), context_view(cv, seq, len),
                rows_of(out), lse_g, saved[7 + 3 * g], saved[8 + 3 * g], bias, at::Tensor(),
                at::Tensor(), rows, len, /*dropout_p=*/0.0, /*is_causal=*/false);
            dqs.push_back(std::get<0>(context).transpose(1, 2).squeeze(0));
            context_view(dck, seq, len).add_(std::get<1>(context));
            context_view(dcv, seq, len).add_(std::get<2>(context));
        }
        // the own part's query gradient added into the context part's, in place
        at::Tensor dq = at::cat(dqs, 0).unsqueeze(0);
        const at::Tensor q1 = q.unsqueeze(0), kb1 = kb.unsqueeze(0), vb1 = vb.unsqueeze(0);
        const at::Tensor out1 = out.unsqueeze(0), dout1 = dout.unsqueeze(0);
        char msg[512] = {0};
        at::Tensor *dkb = nullptr, *dvb = nullptr;
        const int status = pass(state.data(), &q1, &kb1, &vb1, &anchors, &out1, &lse, &dout1, &dq,
                                &dkb, &dvb, msg, sizeof msg);
        TORCH_CHECK(status == 0 && dkb != nullptr && dvb != nullptr,
                    "block attention backward: ", msg);
        none[0] = dq.squeeze(0);
        none[1] = dck;
        none[2] = dcv;
        none[3] = take(dkb).squeeze(0);
        none[4] = take(dvb).squeeze(0);
        return none;
    }
};


}  // namespace

extern "C" {

// The rotation of `x` as a node of the autograd graph (where grad mode is on and x needs a
// gradient): `fn` computes it forward and backward with `state` (copied, `state_len` bytes,
// kept with the node). The result goes to `*out`. Returns null on success, else a malloc'd
// message that the caller frees with `dflash_free_error`.
char *dflash_rotary_autograd(const at::Tensor *x, const at::Tensor *cos, const at::Tensor *sin,
                             dflash_rotate_fn fn, const void *state, size_t state_len,
                             at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (x == nullptr || cos == nullptr || sin == nullptr || fn == nullptr || out == nullptr) {
            return dflash_guard::copy_message("a null argument was passed");
        }
        const std::string bytes(static_cast<const char *>(state), state_len);
        at::Tensor y = Rotary::apply(*x, *cos, *sin, reinterpret_cast<int64_t>(fn), bytes);
        *out = new at::Tensor(std::move(y));
        return nullptr;
    });
}

// SwiGLU's product of `gate` and `up` as a node of the autograd graph, computed by `fn` with
// `state` as dflash_rotary_autograd's. The result goes to `*out`.
char *dflash_swiglu_autograd(const at::Tensor *gate, const at::Tensor *up, dflash_swiglu_fn fn,
                             const void *state, size_t state_len, at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (gate == nullptr || up == nullptr || fn == nullptr || out == nullptr) {
            return dflash_guard::copy_message("a null argument was passed");
        }
        const std::string bytes(static_cast<const char *>(state), state_len);
        at::Tensor y = SwiGlu::apply(*gate, *up, reinterpret_cast<int64_t>(fn), bytes);
        *out = new at::Tensor(std::move(y));
        return nullptr;
    });
}

// RMSNorm of `x` over its last dimension with `weight` as a node of the autograd graph,
// computed by `fn` with `state` as dflash_rotary_autograd's. The result goes to `*out`.
char *dflash_rms_norm_autograd(const at::Tensor *x, const at::Tensor *weight, double eps,
                               dflash_rms_norm_fn fn, const void *state, size_t state_len,
                               at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (x == nullptr || weight == nullptr || fn == nullptr || out == nullptr) {
            return dflash_guard::copy_message("a null argument was passed");
        }
        const std::string bytes(static_cast<const char *>(state), state_len);
        at::Tensor y = RmsNorm::apply(*x, *weight, eps, reinterpret_cast<int64_t>(fn), bytes);
        *out = new at::Tensor(std::move(y));
        return nullptr;
    });
}

// (h + a, rms_norm(h + a) * weight) over the last dimension as one node of the autograd graph,
// computed by `fn` with `state` as dflash_rotary_autograd's. The sum goes to `out[0]`, the
// norm's output to `out[1]`.
char *dflash_add_rms_norm_autograd(const at::Tensor *h, const at::Tensor *a,
                                   const at::Tensor *weight, double eps,
                                   dflash_add_rms_norm_fn fn, const void *state,
                                   size_t state_len, at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (h == nullptr || a == nullptr || weight == nullptr || fn == nullptr ||
            out == nullptr) {
            return dflash_guard::copy_message("a null argument was passed");
        }
        const std::string bytes(static_cast<const char *>(state), state_len);
        auto ys = AddRmsNorm::apply(*h, *a, *weight, eps, reinterpret_cast<int64_t>(fn), bytes);
        out[0] = new at::Tensor(std::move(ys[0]));
        out[1] = new at::Tensor(std::move(ys[1]));
        return nullptr;
    });
}

// x W_i^T for the `n` weights `weights[i]` of one input `x`, as one node of the autograd graph
// (SharedInputLinear). The products go to `out[0..n]`.
char *dflash_shared_input_linear(const at::Tensor *x, const at::Tensor *const *weights, size_t n,
                                 at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (x == nullptr || weights == nullptr || out == nullptr || n == 0 || n > 62) {
            return dflash_guard::copy_message("a null argument, or not 1 to 62 weights, was passed");
        }
        std::vector<at::Tensor> ws;
        for (size_t i = 0; i < n; ++i) {
            if (weights[i] == nullptr) {
                return dflash_guard::copy_message("a null weight was passed");
            }
            if (weights[i]->dim() != 2 || weights[i]->size(1) != x->size(-1)) {
                return dflash_guard::copy_message("a weight's shape does not fit the input's width");
            }
            ws.push_back(*weights[i]);
        }
        auto ys = SharedInputLinear::apply(*x, at::TensorList(ws));
        for (size_t i = 0; i < n; ++i) {
            out[i] = new at::Tensor(std::move(ys[i]));
        }
        return nullptr;
    });
}

// One layer of the drafter's block attention in groups (GroupedBlockAttention) as a node of
// the autograd graph: `n` groups, `groups` their (sequence, first row, rows) triples, `biases`
// their masks; the own-block part and merge computed by `fn` with `state` as
// dflash_rotary_autograd's. The result goes to `*out`.
char *dflash_grouped_block_attention_autograd(
    const at::Tensor *q, const at::Tensor *ck, const at::Tensor *cv, const at::Tensor *kb,
    const at::Tensor *vb, const at::Tensor *anchors, const at::Tensor *const *biases,
    const int64_t *groups, size_t n, int64_t bs, dflash_block_attention_fn fn, const void *state,
    size_t state_len, at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (q == nullptr || ck == nullptr || cv == nullptr || kb == nullptr || vb == nullptr ||
            anchors == nullptr || biases == nullptr || groups == nullptr || fn == nullptr ||
            out == nullptr || n == 0 || bs <= 0) {
            return dflash_guard::copy_message("a null argument or no group was passed");
        }
        std::vector<at::Tensor> masks;
        for (size_t g = 0; g < n; ++g) {
            if (biases[g] == nullptr) {
                return dflash_guard::copy_message("a null mask was passed");
            }
            masks.push_back(*biases[g]);
        }
        const std::vector<int64_t> triples(groups, groups + 3 * n);
        const std::string bytes(static_cast<const char *>(state), state_len);
        at::Tensor y = GroupedBlockAttention::apply(*q, *ck, *cv, *kb, *vb, *anchors,
                                                    reinterpret_cast<int64_t>(&masks), triples,
                                                    reinterpret_cast<int64_t>(fn), bytes);
        *out = new at::Tensor(std::move(y));
        return nullptr;
    });
}

}  // extern "C"
