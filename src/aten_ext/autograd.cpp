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

// The drafter's block attention of one fused call: queries q [E, rows, heads, d] (rows
// token-major) see the context keys and values k, v [E, kv, ctx, d] under the additive mask
// `bias` [E, 1, rows, ctx] (cuDNN's fused attention, with its log-sum-exp), and their block's
// own keys kb, vb [E, rows, kv, d] (the callback's kernel), the two parts merged by their
// log-sum-exp. The backward pass gives each part the merged output and log-sum-exp, as flash
// attention's backward pass takes them: each part's gradients are then its share of the exact
// ones. Output [E, rows, heads, d].
struct BlockAttention : public torch::autograd::Function<BlockAttention> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &q,
                              const at::Tensor &k, const at::Tensor &v, const at::Tensor &kb,
                              const at::Tensor &vb, const at::Tensor &bias,
                              const at::Tensor &anchors, int64_t fn, const std::string &state) {
        const auto parts = at::_scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k, v, bias, /*compute_log_sumexp=*/true);
        // [E, heads, rows, d] as cuDNN wrote it (token-major like q: then no copy)
        const at::Tensor o1 = std::get<0>(parts).transpose(1, 2).contiguous();
        const at::Tensor lse1 = std::get<1>(parts).contiguous();
        char msg[512] = {0};
        at::Tensor *out = nullptr, *lse = nullptr;
        const int status = reinterpret_cast<dflash_block_attention_fn>(fn)(
            state.data(), &q, &kb, &vb, &anchors, &o1, &lse1, nullptr, nullptr, &out, &lse, msg,
            sizeof msg);
        TORCH_CHECK(status == 0 && out != nullptr && lse != nullptr, "block attention: ", msg);
        at::Tensor merged = take(out);
        ctx->save_for_backward({q, k, v, kb, vb, bias, anchors, merged, take(lse),
                                std::get<6>(parts), std::get<7>(parts)});
        ctx->saved_data["fn"] = fn;
        ctx->saved_data["state"] = state;
        return merged;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        torch::autograd::variable_list none(9);
        if (!grads[0].defined()) {
            return none;
        }
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &kb = saved[3],
                         &vb = saved[4], &bias = saved[5], &anchors = saved[6], &out = saved[7],
                         &lse = saved[8];
        const at::Tensor dout = grads[0].contiguous();
        const auto fn = reinterpret_cast<dflash_block_attention_fn>(ctx->saved_data["fn"].toInt());
        const std::string &state = ctx->saved_data["state"].toStringRef();
        const int64_t rows = q.size(1), keys = k.size(2);
        auto context = at::_scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k, v, out.transpose(1, 2), lse, saved[9],
            saved[10], bias, at::Tensor(), at::Tensor(), rows, keys, /*dropout_p=*/0.0,
            /*is_causal=*/false);
        at::Tensor dq = std::get<0>(context).transpose(1, 2).contiguous();
        char msg[512] = {0};
        at::Tensor *dkb = nullptr, *dvb = nullptr;
        const int status = fn(state.data(), &q, &kb, &vb, &anchors, &out, &lse, &dout, &dq, &dkb,
                              &dvb, msg, sizeof msg);
        TORCH_CHECK(status == 0 && dkb != nullptr && dvb != nullptr,
                    "block attention backward: ", msg);
        none[0] = dq;
        none[1] = std::get<1>(context);
        none[2] = std::get<2>(context);
        none[3] = take(dkb);
        none[4] = take(dvb);
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

// One fused call of the drafter's block attention (BlockAttention) as a node of the autograd
// graph, its own-block part and merge computed by `fn` with `state` as dflash_rotary_autograd's.
// The result goes to `*out`.
char *dflash_block_attention_autograd(const at::Tensor *q, const at::Tensor *k,
                                      const at::Tensor *v, const at::Tensor *kb,
                                      const at::Tensor *vb, const at::Tensor *bias,
                                      const at::Tensor *anchors, dflash_block_attention_fn fn,
                                      const void *state, size_t state_len, at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (q == nullptr || k == nullptr || v == nullptr || kb == nullptr || vb == nullptr ||
            bias == nullptr || anchors == nullptr || fn == nullptr || out == nullptr) {
            return dflash_guard::copy_message("a null argument was passed");
        }
        const std::string bytes(static_cast<const char *>(state), state_len);
        at::Tensor y = BlockAttention::apply(*q, *k, *v, *kb, *vb, *bias, *anchors,
                                             reinterpret_cast<int64_t>(fn), bytes);
        *out = new at::Tensor(std::move(y));
        return nullptr;
    });
}

}  // extern "C"
