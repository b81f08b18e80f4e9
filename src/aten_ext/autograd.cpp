// Autograd functions whose forward and backward passes are the program's own kernels (tch
// cannot attach a backward pass to an operation from Rust): the C++ side is libtorch's
// `torch::autograd::Function`, which records the node in the graph and saves what the backward
// pass needs; the computation itself is a Rust function (src/aten_ext/fused_autograd.rs) called with
// the tensors, which launches a run-time compiled kernel or runs libtorch's operations.
// Built by build.rs with the other shims. Tensors cross as `at::Tensor *` (tch's); a tensor
// returned through `out` is a `new at::Tensor`, taken over here or by tch.

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

}  // extern "C"
