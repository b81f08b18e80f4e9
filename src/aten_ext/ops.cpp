// libtorch operations tch 0.24 does not bind: the fused (multi-tensor) AdamW step,
// `at::_fused_adamw_`, which reads the parameter, gradient and both moments once and writes
// them back in one kernel (CPU and CUDA); and the flash attention kernel called directly,
// `at::_scaled_dot_product_flash_attention` (CUDA), which plans nothing per shape, and its
// variable-length form `at::_flash_attention_forward` over a key/value cache.
// Built by build.rs with the cc crate against the libtorch headers; the symbols resolve from
// libtorch_cpu, which torch-sys links. The tensors are tch's (`Tensor::as_ptr`), which are
// `at::Tensor *`; a returned tensor is a `new at::Tensor`, which tch frees with `delete`.

// Only the operators' declarations (`at::_ops::NAME::call`, what the inline `at::NAME`
// functions forward to, with every argument spelt out): the full headers pull in
// ATen/Context.h and more and double the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_forward_ops.h>
#include <ATen/ops/_fused_adamw_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_ops.h>

#include "guard.h"

#include <optional>

using dflash_guard::copy_message;
using dflash_guard::guarded;

extern "C" {

// One AdamW step (decoupled weight decay, no amsgrad, no maximize) on one parameter tensor.
// `state_step` holds the step count after this step (float32, one element, on the
// parameters' device); `grad_scale` (float32, one element, same device, or null) divides the
// gradient (which is written back divided). Returns null on success, else a malloc'd message
// that the caller frees with `dflash_free_error`.
char *dflash_fused_adamw(const at::Tensor *param, const at::Tensor *grad,
                         const at::Tensor *exp_avg, const at::Tensor *exp_avg_sq,
                         const at::Tensor *state_step, const at::Tensor *grad_scale,
                         double lr, double beta1, double beta2, double weight_decay,
                         double eps) {
    return guarded([&]() -> char * {
        if (param == nullptr || grad == nullptr || exp_avg == nullptr ||
            exp_avg_sq == nullptr || state_step == nullptr) {
            return copy_message("a null tensor was passed");
        }
        std::optional<at::Tensor> scale;
        if (grad_scale != nullptr) {
            scale = *grad_scale;
        }
        // aten::_fused_adamw_(Tensor(a!)[] self, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs,
        //   Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *,
        //   float lr, float beta1, float beta2, float weight_decay, float eps, bool amsgrad,
        //   bool maximize, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()
        // (the `float lr` overload; `.tensor_lr` takes the rate as a tensor)
        const std::optional<at::Tensor> found_inf;
        at::_ops::_fused_adamw_::call(*param, *grad, *exp_avg, *exp_avg_sq,
                                      /*max_exp_avg_sqs=*/{}, *state_step, lr, beta1, beta2,
                                      weight_decay, eps, /*amsgrad=*/false,
                                      /*maximize=*/false, scale, found_inf);
        return nullptr;
    });
}

// Flash attention of `query` [B, heads, L, D] over `key`, `value` [B, kv_heads, S, D] (kv_heads
// dividing heads), bf16 or f16 on a GPU, no mask, causal or not, scale 1/sqrt(D); the output
// [B, heads, L, D] goes to `*out`. Returns null on success, else a malloc'd message.
char *dflash_flash_attention(const at::Tensor *query, const at::Tensor *key,
                             const at::Tensor *value, bool is_causal, at::Tensor **out) {
    return guarded([&]() -> char * {
        if (query == nullptr || key == nullptr || value == nullptr || out == nullptr) {
            return copy_message("a null tensor was passed");
        }
        auto result = at::_ops::_scaled_dot_product_flash_attention::call(
            *query, *key, *value, /*dropout_p=*/0.0, is_causal, /*return_debug_mask=*/false,
            /*scale=*/std::nullopt);
        *out = new at::Tensor(std::move(std::get<0>(result)));
        return nullptr;
    });
}

// Flash attention in its variable-length form, over a key/value cache: `query` [total_q, heads,
// D] holds the queries of every sequence back to back (sequence b's at rows cu_q[b] ..
// cu_q[b+1]); sequence b's keys and values are the rows cu_k[b] .. cu_k[b] + seqused_k[b] of
// `key`, `value` [rows, kv_heads, D] (cu_k[b] need not be increasing: each sequence reads its
// own slot of a cache). Causal masks align bottom-right: query i of a sequence with q queries
// and s keys sees keys up to s - q + i. cu_q, cu_k and seqused_k are int32 on the device, so
// a CUDA graph can be replayed with new lengths; max_q and max_k bound the lengths. The
// output [total_q, heads, D] goes to `*out`. Returns null on success, else a malloc'd message.
char *dflash_flash_varlen(const at::Tensor *query, const at::Tensor *key,
                          const at::Tensor *value, const at::Tensor *cu_q,
                          const at::Tensor *cu_k, const at::Tensor *seqused_k, int64_t max_q,
                          int64_t max_k, bool is_causal, int64_t window_left,
                          at::Tensor **out) {
    return guarded([&]() -> char * {
        if (query == nullptr || key == nullptr || value == nullptr || cu_q == nullptr ||
            cu_k == nullptr || seqused_k == nullptr || out == nullptr) {
            return copy_message("a null tensor was passed");
        }
        // aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value,
        //   Tensor? cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p,
        //   bool is_causal, bool return_debug_mask, *, float? scale=None,
        //   SymInt? window_size_left=None, SymInt? window_size_right=None,
        //   Tensor? seqused_k=None, Tensor? alibi_slopes=None)
        const std::optional<at::Tensor> cq(*cu_q), ck(*cu_k), used(*seqused_k), no_alibi;
        // window_left < 0: no window; else a query sees the keys up to window_left before it
        std::optional<c10::SymInt> left, right;
        if (window_left >= 0) {
            left = c10::SymInt(window_left);
            right = c10::SymInt(0);
        }
        auto result = at::_ops::_flash_attention_forward::call(
            *query, *key, *value, cq, ck, c10::SymInt(max_q), c10::SymInt(max_k),
            /*dropout_p=*/0.0, is_causal, /*return_debug_mask=*/false, /*scale=*/std::nullopt,
            left, right, used, no_alibi);
        *out = new at::Tensor(std::move(std::get<0>(result)));
        return nullptr;
    });
}

// Drops the gradient of `t` (its `grad()` becomes undefined, as PyTorch's
// `zero_grad(set_to_none=True)`): the next backward pass then stores its gradient instead of
// adding it to zeros, and nothing has to write the zeros. Returns null or a message.
char *dflash_clear_grad(const at::Tensor *t) {
    return guarded([&]() -> char * {
        if (t == nullptr) {
            return copy_message("a null tensor was passed");
        }
        const_cast<at::Tensor *>(t)->mutable_grad().reset();
        return nullptr;
    });
}

void dflash_free_error(char *err) { dflash_guard::free_message(err); }

}  // extern "C"
