// The drafter's training attention over anchor blocks as three mask-free (or causal) flash
// attention calls whose results are merged by their log-sum-exp (src/model/drafter/flash.rs
// builds the layout). A block anchored at a sees the context positions p < a and its own block.
// The blocks of a sequence are cut into chunks of consecutive blocks; for a chunk whose first
// anchor is a0 the visible keys of its block at a split into:
//   1. the prefix [0, a0), seen by every query of the chunk: one varlen sequence per chunk
//      (queries: the chunk's rows; keys: a copy of the prefix), no mask;
//   2. the staircase [a0, a): one sequence per chunk whose query positions t = 0..span (span =
//      the chunk's last anchor - a0) hold the block anchored at a0 + t, all of its rows and
//      heads as heads (the positions without a block are zero queries nobody reads), keys the
//      copy of [a0, a0 + span): causal, bottom-right aligned, so position t sees keys < t;
//   3. the own block: per block and key/value head, the block's rows of the heads that share
//      that key/value head (as rows of one head) against the block's keys, no mask.
// The output is sum_i exp(lse_i - lse) o_i with lse the log-sum-exp of the three. Its backward
// pass runs each part's flash backward with the merged output and log-sum-exp, which gives each
// part's share of the exact gradient. Off CUDA, or in float32, each part runs on plain products
// (the same formulas), which the CPU tests check against the dense mask.
// Built by build.rs with the other shims.

#include <ATen/ATen.h>
#include <ATen/ops/_flash_attention_backward_ops.h>
#include <ATen/ops/_flash_attention_forward_ops.h>
#include <torch/csrc/autograd/custom_function.h>

#include "guard.h"

#include <cmath>
#include <limits>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool flash_kind(const Tensor &q) {
    return q.is_cuda() &&
           (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
}

at::ScalarType accumulate_kind(const Tensor &q) {
    return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// One part's attention: q [Tq, Hq, D], k, v [Tk, Hk, D], sequences by cu_q, cu_k (int32).
// Returns the output [Tq, Hq, D], the log-sum-exp [Hq, Tq] (float32, float64 for float64 inputs;
// +inf where a row sees no key, as flash attention writes it) and flash attention's two
// random-state tensors.
struct PartOut {
    Tensor out, lse, rng, unused;
};

PartOut math_forward(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q,
                     const Tensor &cu_k, bool causal) {
    const auto cq = cu_q.to(at::kCPU).to(at::kLong);
    const auto ck = cu_k.to(at::kCPU).to(at::kLong);
    const auto *pq = cq.data_ptr<int64_t>();
    const auto *pk = ck.data_ptr<int64_t>();
    const int64_t n = cq.size(0) - 1, hq = q.size(1), hk = k.size(1), d = q.size(2);
    const auto acc = accumulate_kind(q);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    auto out = at::zeros_like(q);
    auto lse = at::full({hq, q.size(0)}, std::numeric_limits<double>::infinity(),
                        q.options().dtype(acc));
    for (int64_t b = 0; b < n; ++b) {
        const int64_t q0 = pq[b], nq = pq[b + 1] - pq[b], k0 = pk[b], nk = pk[b + 1] - pk[b];
        if (nq <= 0 || nk <= 0) {
            continue;
        }
        auto qb = q.narrow(0, q0, nq).to(acc).permute({1, 0, 2});
        auto kb = k.narrow(0, k0, nk).to(acc).repeat_interleave(hq / hk, 1).permute({1, 0, 2});
        auto vb = v.narrow(0, k0, nk).to(acc).repeat_interleave(hq / hk, 1).permute({1, 0, 2});
        auto s = at::matmul(qb, kb.transpose(1, 2)) * scale;
        if (causal) {
            auto i = at::arange(nq, q.options().dtype(at::kLong)).unsqueeze(1);
            auto j = at::arange(nk, q.options().dtype(at::kLong)).unsqueeze(0);
            s = s.masked_fill(j.gt(i + (nk - nq)).unsqueeze(0),
                              -std::numeric_limits<double>::infinity());
        }
        auto l = at::logsumexp(s, -1);
        auto seen = l.isfinite();
        auto p = at::where(seen.unsqueeze(-1), at::exp(s - l.unsqueeze(-1)), at::zeros_like(s));
        out.narrow(0, q0, nq).copy_(at::matmul(p, vb).permute({1, 0, 2}));
        lse.narrow(1, q0, nq).copy_(at::where(seen, l, at::full_like(l, INFINITY)));
    }
    return {out, lse, Tensor(), Tensor()};
}

// The gradients of one part's q, k, v given the merged output `out` and log-sum-exp `lse`.
std::tuple<Tensor, Tensor, Tensor> math_backward(const Tensor &dout, const Tensor &q,
                                                 const Tensor &k, const Tensor &v,
                                                 const Tensor &out, const Tensor &lse,
                                                 const Tensor &cu_q, const Tensor &cu_k,
                                                 bool causal) {
    const auto cq = cu_q.to(at::kCPU).to(at::kLong);
    const auto ck = cu_k.to(at::kCPU).to(at::kLong);
    const auto *pq = cq.data_ptr<int64_t>();
    const auto *pk = ck.data_ptr<int64_t>();
    const int64_t n = cq.size(0) - 1, hq = q.size(1), hk = k.size(1), d = q.size(2);
    const int64_t g = hq / hk;
    const auto acc = accumulate_kind(q);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    auto dq = at::zeros(q.sizes(), q.options().dtype(acc));
    auto dk = at::zeros(k.sizes(), k.options().dtype(acc));
    auto dv = at::zeros(v.sizes(), v.options().dtype(acc));
    for (int64_t b = 0; b < n; ++b) {
        const int64_t q0 = pq[b], nq = pq[b + 1] - pq[b], k0 = pk[b], nk = pk[b + 1] - pk[b];
        if (nq <= 0 || nk <= 0) {
            continue;
        }
        auto qb = q.narrow(0, q0, nq).to(acc).permute({1, 0, 2});
        auto kb = k.narrow(0, k0, nk).to(acc).repeat_interleave(g, 1).permute({1, 0, 2});
        auto vb = v.narrow(0, k0, nk).to(acc).repeat_interleave(g, 1).permute({1, 0, 2});
        auto ob = out.narrow(0, q0, nq).to(acc).permute({1, 0, 2});
        auto dob = dout.narrow(0, q0, nq).to(acc).permute({1, 0, 2});
        auto l = lse.narrow(1, q0, nq).to(acc).unsqueeze(-1);
        auto s = at::matmul(qb, kb.transpose(1, 2)) * scale;
        if (causal) {
            auto i = at::arange(nq, q.options().dtype(at::kLong)).unsqueeze(1);
            auto j = at::arange(nk, q.options().dtype(at::kLong)).unsqueeze(0);
            s = s.masked_fill(j.gt(i + (nk - nq)).unsqueeze(0),
                              -std::numeric_limits<double>::infinity());
        }
        auto p = at::exp(s - l);
        auto row = (dob * ob).sum(-1, true);
        auto ds = p * (at::matmul(dob, vb.transpose(1, 2)) - row);
        dq.narrow(0, q0, nq).add_(at::matmul(ds, kb).permute({1, 0, 2}) * scale);
        auto dkb = (at::matmul(ds.transpose(1, 2), qb) * scale).view({hk, g, nk, d}).sum(1);
        auto dvb = at::matmul(p.transpose(1, 2), dob).view({hk, g, nk, d}).sum(1);
        dk.narrow(0, k0, nk).add_(dkb.permute({1, 0, 2}));
        dv.narrow(0, k0, nk).add_(dvb.permute({1, 0, 2}));
    }
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

PartOut part_forward(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q,
                     const Tensor &cu_k, int64_t max_q, int64_t max_k, bool causal) {
    if (!flash_kind(q)) {
        return math_forward(q, k, v, cu_q, cu_k, causal);
    }
    const std::optional<Tensor> cq(cu_q), ck(cu_k), none;
    auto r = at::_ops::_flash_attention_forward::call(
        q, k, v, cq, ck, c10::SymInt(max_q), c10::SymInt(max_k), /*dropout_p=*/0.0, causal,
        /*return_debug_mask=*/false, /*scale=*/std::nullopt, std::nullopt, std::nullopt, none,
        none);
    TORCH_CHECK(std::get<1>(r).dim() == 2 && std::get<1>(r).size(1) == q.size(0),
                "flash attention's log-sum-exp has an unexpected layout ",
                std::get<1>(r).sizes());
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

std::tuple<Tensor, Tensor, Tensor> part_backward(const Tensor &dout, const Tensor &q,
                                                 const Tensor &k, const Tensor &v,
                                                 const Tensor &out, const Tensor &lse,
                                                 const Tensor &cu_q, const Tensor &cu_k,
                                                 int64_t max_q, int64_t max_k, bool causal,
                                                 const Tensor &rng, const Tensor &unused) {
    if (!flash_kind(q)) {
        return math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal);
    }
    return at::_ops::_flash_attention_backward::call(
        dout, q, k, v, out, lse, cu_q, cu_k, c10::SymInt(max_q), c10::SymInt(max_k),
        /*dropout_p=*/0.0, causal, rng, unused, /*scale=*/std::nullopt, std::nullopt,
        std::nullopt);
}

// A log-sum-exp with the rows that saw no key (+inf from flash attention) as -inf.
Tensor seen_or_empty(const Tensor &lse) {
    return at::where(lse.isfinite(), lse, at::full_like(lse, -INFINITY));
}

// The shape of one call: T query rows of H heads of size D, M blocks of `block` rows, KV
// key/value heads (G = H / KV query heads each).
struct Dims {
    int64_t t, h, d, kv, g, m, block;
    static Dims of(const Tensor &q, const Tensor &kb, int64_t block) {
        Dims s{q.size(0), q.size(1), q.size(2), kb.size(1), 0, 0, block};
        s.g = s.h / s.kv;
        s.m = s.t / block;
        return s;
    }
    // [T, H, D] -> [M, KV, G, block, D] (contiguous): the heads sharing a key/value head
    // together, rows of a block innermost.
    Tensor fold(const Tensor &x) const {
        return x.reshape({m, block, kv, g, d}).permute({0, 2, 3, 1, 4}).contiguous();
    }
    Tensor unfold(const Tensor &x) const {
        return x.reshape({m, kv, g, block, d}).permute({0, 3, 1, 2, 4}).reshape({t, h, d});
    }
    // keys [T, KV, D] -> [M * KV * block, 1, D]
    Tensor fold_kv(const Tensor &x) const {
        return x.reshape({m, block, kv, d}).permute({0, 2, 1, 3}).reshape({m * kv * block, 1, d});
    }
    Tensor unfold_kv(const Tensor &x) const {
        return x.reshape({m, kv, block, d}).permute({0, 2, 1, 3}).reshape({t, kv, d});
    }
};

// The staircase part's query rows: `per_block` [M, KV * G * block, D] placed at the rows
// `pos` [M] of `rows` + 1 rows filled with `fill` (blocks of no staircase all go to the last row,
// which is then dropped).
Tensor place_rows(const Tensor &per_block, const Tensor &pos, int64_t rows, double fill) {
    auto sizes = per_block.sizes().vec();
    sizes[0] = rows + 1;
    auto all = at::full(sizes, fill, per_block.options());
    all.index_copy_(0, pos, per_block);
    return all.narrow(0, 0, rows);
}

struct BlockAttention : public torch::autograd::Function<BlockAttention> {
    // q [T, H, D]; k1, v1 [K1, KV, D] the chunks' prefixes; k2, v2 [K2, KV, D] their
    // staircases; kb, vb [T, KV, D] the blocks' own keys and values. `index` (int64, on q's
    // device): cu_q1, cu_k1 [n1 + 1], cu_q2, cu_k2 [n2 + 1], pos2 [M] back to back. `sizes`:
    // n1, n2, max_q1, max_k1, max_q2, max_k2, rows2 (staircase query rows), block.
    static Tensor forward(AutogradContext *ctx, const Tensor &q, const Tensor &k1,
                          const Tensor &v1, const Tensor &k2, const Tensor &v2, const Tensor &kb,
                          const Tensor &vb, const Tensor &index, std::vector<int64_t> sizes) {
        const auto s = Dims::of(q, kb, sizes[7]);
        const auto lists = split_index(index, sizes, s);
        const auto &[cu_q1, cu_k1, cu_q2, cu_k2, pos2, cu_qb, cu_kb] = lists;
        auto p1 = part_forward(q, k1, v1, cu_q1, cu_k1, sizes[2], sizes[3], false);
        const auto qf = s.fold(q);
        auto pb = part_forward(qf.view({-1, 1, s.d}), s.fold_kv(kb), s.fold_kv(vb), cu_qb, cu_kb,
                               s.g * s.block, s.block, false);
        // [H, T] log-sum-exps and [T, H, D] outputs of every part
        auto lb = pb.lse.view({s.m, s.kv, s.g, s.block}).permute({1, 2, 0, 3}).reshape({s.h, s.t});
        auto ob = s.unfold(pb.out);
        auto l1 = seen_or_empty(p1.lse);
        auto big = at::maximum(l1, lb);
        PartOut p2;
        Tensor l2, o2;
        const bool staircase = sizes[1] > 0;
        if (staircase) {
            const auto heads2 = s.kv * s.g * s.block;
            auto q2 = place_rows(qf.view({s.m, heads2, s.d}), pos2, sizes[6], 0.0);
            p2 = part_forward(q2, k2, v2, cu_q2, cu_k2, sizes[4], sizes[5], true);
            // each block's row (the blocks without one read the appended empty row)
            auto lse2 = at::cat({p2.lse, at::full({heads2, 1}, INFINITY, p2.lse.options())}, 1)
                            .index_select(1, pos2);
            l2 = seen_or_empty(lse2)
                     .view({s.kv, s.g, s.block, s.m})
                     .permute({0, 1, 3, 2})
                     .reshape({s.h, s.t});
            o2 = s.unfold(at::cat({p2.out, at::zeros({1, heads2, s.d}, p2.out.options())}, 0)
                              .index_select(0, pos2));
            big = at::maximum(big, l2);
        }
        auto weight = [&](const Tensor &l) { return at::exp(l - big); };
        auto total = weight(l1) + weight(lb);
        if (staircase) {
            total = total + weight(l2);
        }
        auto lse = big + at::log(total);  // [H, T]
        auto share = [&](const Tensor &o, const Tensor &l) {
            return o.to(lse.scalar_type()) * at::exp(l - lse).t().unsqueeze(-1);
        };
        auto out = share(p1.out, l1) + share(ob, lb);
        if (staircase) {
            out = out + share(o2, l2);
        }
        out = out.to(q.scalar_type());
        ctx->save_for_backward({q, k1, v1, k2, v2, kb, vb, index, out, lse, p1.rng, p1.unused,
                                p2.rng, p2.unused, pb.rng, pb.unused});
        ctx->saved_data["sizes"] = sizes;
        return out;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const auto sizes = ctx->saved_data["sizes"].toIntVector();
        const Tensor &q = saved[0], &k1 = saved[1], &v1 = saved[2], &k2 = saved[3],
                     &v2 = saved[4], &kb = saved[5], &vb = saved[6], &index = saved[7],
                     &out = saved[8], &lse = saved[9];
        variable_list none(9);
        if (!grads[0].defined()) {
            return none;
        }
        const auto s = Dims::of(q, kb, sizes[7]);
        const auto lists = split_index(index, sizes, s);
        const auto &[cu_q1, cu_k1, cu_q2, cu_k2, pos2, cu_qb, cu_kb] = lists;
        const auto dout = grads[0].contiguous();
        const auto lse_t = lse.contiguous();
        auto [dq1, dk1, dv1] = part_backward(dout, q, k1, v1, out, lse_t, cu_q1, cu_k1, sizes[2],
                                             sizes[3], false, saved[10], saved[11]);
        const auto qf = s.fold(q), of = s.fold(out), dof = s.fold(dout);
        // [H, T] -> per block [M, KV, G, block]
        const auto lse_blocks = lse.view({s.kv, s.g, s.m, s.block}).permute({2, 0, 1, 3});
        auto [dqb, dkb, dvb] = part_backward(
            dof.view({-1, 1, s.d}), qf.view({-1, 1, s.d}), s.fold_kv(kb), s.fold_kv(vb),
            of.view({-1, 1, s.d}), lse_blocks.reshape({1, -1}), cu_qb, cu_kb, s.g * s.block,
            s.block, false, saved[14], saved[15]);
        auto dq_folded = dqb.view({s.m, s.kv, s.g, s.block, s.d}).to(at::kFloat);
        Tensor dk2, dv2;
        if (sizes[1] > 0) {
            const auto heads2 = s.kv * s.g * s.block;
            const auto rows = sizes[6];
            auto q2 = place_rows(qf.view({s.m, heads2, s.d}), pos2, rows, 0.0);
            auto o2 = place_rows(of.view({s.m, heads2, s.d}), pos2, rows, 0.0);
            auto do2 = place_rows(dof.view({s.m, heads2, s.d}), pos2, rows, 0.0);
            // the rows of no block get +inf: their probabilities are all zero
            auto l2 = place_rows(lse_blocks.permute({1, 2, 3, 0}).reshape({heads2, s.m}).t(), pos2,
                                 rows, INFINITY)
                          .t()
                          .contiguous();
            auto [dq2, dk2_, dv2_] = part_backward(do2, q2, k2, v2, o2, l2, cu_q2, cu_k2,
                                                   sizes[4], sizes[5], true, saved[12], saved[13]);
            dk2 = dk2_;
            dv2 = dv2_;
            auto dq2_blocks =
                at::cat({dq2, at::zeros({1, heads2, s.d}, dq2.options())}, 0).index_select(0, pos2);
            dq_folded = dq_folded + dq2_blocks.view({s.m, s.kv, s.g, s.block, s.d}).to(at::kFloat);
        } else {
            dk2 = at::zeros_like(k2);
            dv2 = at::zeros_like(v2);
        }
        auto dq = (dq1.to(at::kFloat) + s.unfold(dq_folded)).to(q.scalar_type());
        return {dq, dk1, dv1, dk2, dv2, s.unfold_kv(dkb), s.unfold_kv(dvb), Tensor(), Tensor()};
    }

    // The index lists of `index` (see forward), int32 where flash attention reads them, and the
    // own-block part's (every sequence G * block queries and block keys).
    static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> split_index(
        const Tensor &index, const std::vector<int64_t> &sizes, const Dims &s) {
        const int64_t n1 = sizes[0], n2 = sizes[1];
        int64_t at_ = 0;
        auto take = [&](int64_t len, bool int32) {
            auto t = index.narrow(0, at_, len);
            at_ += len;
            return int32 ? t.to(at::kInt) : t;
        };
        auto cu_q1 = take(n1 + 1, true);
        auto cu_k1 = take(n1 + 1, true);
        auto cu_q2 = take(n2 + 1, true);
        auto cu_k2 = take(n2 + 1, true);
        auto pos2 = take(s.m, false);
        const auto seqs = at::arange(s.m * s.kv + 1, index.options().dtype(at::kInt));
        return {cu_q1, cu_k1, cu_q2, cu_k2, pos2, seqs * (s.g * s.block), seqs * s.block};
    }
};

}  // namespace

extern "C" {

// The block attention above as a node of the autograd graph. Tensors as BlockAttention's
// forward takes them; `sizes` points to its 8 sizes. The output [T, H, D] goes to `*out`.
// Returns null on success, else a malloc'd message freed with `dflash_free_error`.
char *dflash_block_attention(const at::Tensor *q, const at::Tensor *k1, const at::Tensor *v1,
                             const at::Tensor *k2, const at::Tensor *v2, const at::Tensor *kb,
                             const at::Tensor *vb, const at::Tensor *index, const int64_t *sizes,
                             at::Tensor **out) {
    return dflash_guard::guarded([&]() -> char * {
        if (q == nullptr || k1 == nullptr || v1 == nullptr || k2 == nullptr || v2 == nullptr ||
            kb == nullptr || vb == nullptr || index == nullptr || sizes == nullptr ||
            out == nullptr) {
            return dflash_guard::copy_message("a null argument was passed");
        }
        std::vector<int64_t> s(sizes, sizes + 8);
        TORCH_CHECK(s[7] > 0 && q->dim() == 3 && q->size(0) % s[7] == 0 && kb->dim() == 3 &&
                        kb->size(0) == q->size(0) && kb->size(1) > 0 &&
                        q->size(1) % kb->size(1) == 0,
                    "block attention: query rows ", q->sizes(), " and block keys ", kb->sizes(),
                    " do not fit blocks of ", s[7]);
        at::Tensor y = BlockAttention::apply(*q, *k1, *v1, *k2, *v2, *kb, *vb, *index, s);
        *out = new at::Tensor(std::move(y));
        return nullptr;
    });
}

}  // extern "C"
