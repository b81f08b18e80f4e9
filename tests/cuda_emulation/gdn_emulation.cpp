// Runs src/aten_ext/gdn_kernels.cu on the CPU (cuda_emu.h) against the gated delta rule
// computed naively in double precision, over cases that reach every part of the kernel: each
// key head size, grouped heads, partial tiles and partial column blocks, q / k / v as strided
// views of one projection, g and beta in either type, bf16 storage, an initial state, the state
// after every step, decays strong enough to renormalise the lazy decay (and one of zero).
// Prints one line per case; exit status 1 when any is off. Built and run by
// src/aten_ext/gdn_tests.rs:
//   c++ -std=c++20 -O1 -pthread -w -Isrc/aten_ext tests/cuda_emulation/gdn_emulation.cpp
#include "cuda_emu.h"

#define GDN_DYNAMIC_SHARED(name) float4 *name = emu::dynamic_shared.data()
#include "gdn_kernels.cu"

#include <chrono>
#include <cstdio>
#include <random>

struct Case {
    const char *name;
    int batch, steps, key_heads, value_heads, key_dim, value_dim;
    bool initial, l2norm, strided, g_f32, beta_f32, strong_decays;
};

// A [B, T, H, D] view: element (b, t, h, d) at base + b s0 + t s1 + h s2 + d.
struct View {
    long long offset, s0, s1, s2;
    long long at(long long b, long long t, long long h, long long d) const {
        return offset + b * s0 + t * s1 + h * s2 + d;
    }
};

static double max_abs(const std::vector<double> &x) {
    double m = 0;
    for (double v : x) m = std::max(m, std::fabs(v));
    return m;
}

// max |got - want| / max |want|; NaN in `got` (never written) counts as infinitely off.
static double relative_error(const std::vector<float> &got, const std::vector<double> &want) {
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double d = std::fabs((double)got[i] - want[i]);
        worst = std::max(worst, std::isnan(d) ? INFINITY : d);
    }
    return worst / std::max(max_abs(want), 1e-30);
}

// The chunked form's two kernels (prep, then scan), in place of the recurrent one, with their
// launch: threads, dynamic shared memory, value columns per scan block, floats per token of the
// `gamma` buffer (1; the tensor-core form's three rows of scales) and its state tolerance.
struct Chunked {
    void (*prep)(const GdnChunkParams);
    void (*scan)(const GdnChunkParams);
    unsigned prep_threads, scan_threads;
    size_t prep_bytes, scan_bytes;
    long long scan_columns, scale_rows;
    double state_tolerance;
};

// Runs the recurrent kernel (`kernel`), or the chunked form (`chunked`: no states after every
// token, which it does not write) on case `c`.
template <class P>
static bool run_case(const Case &c, void (*kernel)(const GdnParams), double out_tolerance,
                     const Chunked *chunked = nullptr) {
    typedef typename P::T T;
    const long long B = c.batch, L = c.steps, Hk = c.key_heads, Hv = c.value_heads, K = c.key_dim,
                    V = c.value_dim;
    std::mt19937 rng(1234 + B * 7 + L * 13 + K);
    std::normal_distribution<float> normal;
    // q, k, v: one buffer; as one projection's views (token rows of q | k | v | 8 spare) or
    // three dense tensors back to back
    View q, k, v;
    long long total;
    if (c.strided) {
        const long long w = 2 * Hk * K + Hv * V + 8;
        q = {0, L * w, w, K};
        k = {Hk * K, L * w, w, K};
        v = {2 * Hk * K, L * w, w, V};
        total = B * L * w;
    } else {
        q = {0, L * Hk * K, Hk * K, K};
        k = {B * L * Hk * K, L * Hk * K, Hk * K, K};
        v = {2 * B * L * Hk * K, L * Hv * V, Hv * V, V};
        total = 2 * B * L * Hk * K + B * L * Hv * V;
    }
    std::vector<T> qkv(total, P::store(NAN));
    const float qk_scale = c.l2norm ? 1.0f : 1.0f / std::sqrt((float)K);
    for (long long b = 0; b < B; ++b)
        for (long long t = 0; t < L; ++t) {
            for (long long h = 0; h < Hk; ++h)
                for (long long d = 0; d < K; ++d) {
                    qkv[q.at(b, t, h, d)] = P::store(normal(rng) * qk_scale);
                    qkv[k.at(b, t, h, d)] = P::store(normal(rng) * qk_scale);
                }
            for (long long h = 0; h < Hv; ++h)
                for (long long d = 0; d < V; ++d) qkv[v.at(b, t, h, d)] = P::store(normal(rng));
        }
    const long long n = B * L * Hv;
    std::vector<float> g(n), beta(n), initial(B * Hv * K * V);
    for (long long i = 0; i < n; ++i) {
        g[i] = -std::log1p(std::exp(normal(rng)));
        beta[i] = 1.0f / (1.0f + std::exp(-normal(rng)));
        const long long t = (i / Hv) % L;
        if (c.strong_decays && t % 5 == 4) g[i] = -12.0f;
        if (c.strong_decays && t == 7) g[i] = -INFINITY;
    }
    for (float &x : initial) x = 0.5f * normal(rng);
    std::vector<T> g_st(n), beta_st(n);
    for (long long i = 0; i < n; ++i) {
        g_st[i] = P::store(g[i]);
        beta_st[i] = P::store(beta[i]);
        if (!c.g_f32) g[i] = P::load(g_st[i]);   // what the kernel reads
        if (!c.beta_f32) beta[i] = P::load(beta_st[i]);
    }

    // the rule in double precision
    std::vector<double> want_out(B * L * Hv * V), want_states(B * L * Hv * K * V),
        want_final(B * Hv * K * V);
    for (long long b = 0; b < B; ++b)
        for (long long h = 0; h < Hv; ++h) {
            const long long hk = h / (Hv / Hk);
            std::vector<double> S(K * V, 0.0), qd(K), kd(K);
            if (c.initial)
                for (long long i = 0; i < K * V; ++i) S[i] = initial[(b * Hv + h) * K * V + i];
            for (long long t = 0; t < L; ++t) {
                double qq = 0, kk = 0;
                for (long long d = 0; d < K; ++d) {
                    qd[d] = P::load(qkv[q.at(b, t, hk, d)]);
                    kd[d] = P::load(qkv[k.at(b, t, hk, d)]);
                    qq += qd[d] * qd[d];
                    kk += kd[d] * kd[d];
                }
                const double qn = c.l2norm ? 1.0 / std::sqrt(qq + 1e-6) : 1.0;
                const double kn = c.l2norm ? 1.0 / std::sqrt(kk + 1e-6) : 1.0;
                for (long long d = 0; d < K; ++d) {
                    qd[d] *= qn / std::sqrt((double)K);
                    kd[d] *= kn;
                }
                const long long gi = (b * L + t) * Hv + h;
                const double a = std::exp((double)g[gi]);
                for (double &x : S) x *= a;
                for (long long j = 0; j < V; ++j) {
                    double kv = 0;
                    for (long long i = 0; i < K; ++i) kv += S[i * V + j] * kd[i];
                    const double u = beta[gi] * ((double)P::load(qkv[v.at(b, t, h, j)]) - kv);
                    double o = 0;
                    for (long long i = 0; i < K; ++i) {
                        S[i * V + j] += kd[i] * u;
                        o += S[i * V + j] * qd[i];
                    }
                    want_out[gi * V + j] = o;
                }
                for (long long i = 0; i < K * V; ++i) want_states[gi * K * V + i] = S[i];
            }
            for (long long i = 0; i < K * V; ++i) want_final[(b * Hv + h) * K * V + i] = S[i];
        }

    // the kernel, every output filled with NaN first (anything left unwritten shows)
    std::vector<T> out(B * L * Hv * V + 64, P::store(NAN));
    std::vector<float> states(B * L * Hv * K * V + 64, NAN), final_state(B * Hv * K * V + 64, NAN);
    GdnParams p = {};
    p.q = qkv.data();
    p.k = qkv.data();
    p.v = qkv.data();
    // the views' offsets folded into the pointers, as the Rust side's data pointers are
    p.q = qkv.data() + q.offset;
    p.k = qkv.data() + k.offset;
    p.v = qkv.data() + v.offset;
    p.g = c.g_f32 ? (const void *)g.data() : (const void *)g_st.data();
    p.beta = c.beta_f32 ? (const void *)beta.data() : (const void *)beta_st.data();
    p.initial = c.initial ? initial.data() : nullptr;
    p.out = out.data();
    p.final_state = final_state.data();
    p.states = chunked ? nullptr : states.data();
    const View *views[3] = {&q, &k, &v};
    long long *strides[3] = {p.q_stride, p.k_stride, p.v_stride};
    for (int x = 0; x < 3; ++x) {
        strides[x][0] = views[x]->s0;
        strides[x][1] = views[x]->s1;
        strides[x][2] = views[x]->s2;
    }
    p.steps = L;
    p.key_heads = Hk;
    p.value_heads = Hv;
    p.value_dim = V;
    p.g_is_f32 = c.g_f32;
    p.beta_is_f32 = c.beta_f32;
    p.l2norm = c.l2norm;
    if (chunked) {
        const long long N = (L + GDN_CHUNK - 1) / GDN_CHUNK, C = GDN_CHUNK;
        std::vector<float> u(B * Hv * N * C * V + 64, NAN), w(B * Hv * N * K * C + 64, NAN),
            pm(B * Hv * N * C * C + 64, NAN), gamma(B * Hv * N * chunked->scale_rows * C + 64, NAN);
        GdnChunkParams cp = {p, u.data(), w.data(), pm.data(), gamma.data(), N};
        emu::dynamic_shared.assign((chunked->prep_bytes + 15) / 16, float4{NAN, NAN, NAN, NAN});
        emu::launch({(unsigned)N, (unsigned)(B * Hv), 1}, chunked->prep_threads,
                    [&] { chunked->prep(cp); });
        emu::dynamic_shared.assign((chunked->scan_bytes + 15) / 16, float4{NAN, NAN, NAN, NAN});
        const long long column_blocks = (V + chunked->scan_columns - 1) / chunked->scan_columns;
        emu::launch({(unsigned)column_blocks, (unsigned)(B * Hv), 1}, chunked->scan_threads,
                    [&] { chunked->scan(cp); });
        for (auto *buffer : {&u, &w, &pm, &gamma}) {   // nothing written past the buffers
            for (int i = 0; i < 64; ++i) {
                if (!std::isnan((*buffer)[buffer->size() - 1 - i])) {
                    std::printf("FAILED %s: a work buffer written past its end\n", c.name);
                    return false;
                }
            }
        }
        std::fill(states.begin(), states.end() - 64, 0.0f);   // not written: not compared
        std::fill(want_states.begin(), want_states.end(), 0.0);
    } else {
        emu::launch({(unsigned)((V + GDN_COLUMNS - 1) / GDN_COLUMNS), (unsigned)(B * Hv), 1},
                    GDN_THREADS, [&] { kernel(p); });
    }

    std::vector<float> got_out(B * L * Hv * V);
    for (size_t i = 0; i < got_out.size(); ++i) got_out[i] = P::load(out[i]);
    bool untouched = true;   // nothing written past the ends
    for (int i = 0; i < 64; ++i) {
        untouched &= std::isnan(P::load(out[B * L * Hv * V + i]));
        untouched &= std::isnan(states[B * L * Hv * K * V + i]);
        untouched &= std::isnan(final_state[B * Hv * K * V + i]);
    }
    const double e_out = relative_error(got_out, want_out);
    const double e_states = relative_error(states, want_states);
    const double e_final = relative_error(final_state, want_final);
    const double state_tolerance = chunked ? chunked->state_tolerance : 2e-5;
    const bool ok = untouched && e_out <= out_tolerance && e_states <= state_tolerance &&
                    e_final <= state_tolerance;
    std::printf("%s %s: output %.2e, states %.2e, final state %.2e%s\n", ok ? "ok" : "FAILED",
                c.name, e_out, e_states, e_final, untouched ? "" : ", wrote past the end");
    return ok;
}

// The causal convolution + SiLU kernel against the same in double precision (the sum rounded
// to the storage type before SiLU, as the kernel and libtorch do): B batch rows of T tokens
// and C channels read from a strided projection, with or without a conv state.
template <class P>
static bool run_conv_case(const char *name, int B, int T, int C, bool with_prev,
                          void (*kernel)(const GdnConvParams), double tolerance) {
    typedef typename P::T Tst;
    const int W = GDN_CONV_WIDTH;
    std::mt19937 rng(99 + T + C);
    std::normal_distribution<float> normal;
    const long long row = C + 5, batch = (long long)T * row + 3;   // strided rows and batches
    std::vector<Tst> x(B * batch), weight(C * W), prev(B * C * (W - 1));
    for (auto &e : x) e = P::store(normal(rng));
    for (auto &e : weight) e = P::store(0.5f * normal(rng));
    for (auto &e : prev) e = P::store(normal(rng));
    std::vector<Tst> out(B * T * C + 16, P::store(NAN)), next(B * C * (W - 1) + 16, P::store(NAN));
    GdnConvParams p = {x.data(), weight.data(), with_prev ? prev.data() : nullptr, out.data(),
                       next.data(), {batch, row}, T, C};
    emu::launch({(unsigned)((C + GDN_CONV_THREADS - 1) / GDN_CONV_THREADS),
                 (unsigned)((T + GDN_CONV_TOKENS - 1) / GDN_CONV_TOKENS), (unsigned)B},
                GDN_CONV_THREADS, [&] { kernel(p); });
    auto input = [&](int b, long long tau, int c) -> double {
        if (tau >= 0) return P::load(x[b * batch + tau * row + c]);
        return with_prev ? P::load(prev[(b * C + c) * (W - 1) + W - 1 + tau]) : 0.0;
    };
    double worst = 0, scale = 0, worst_state = 0;
    for (int b = 0; b < B; ++b)
        for (int c = 0; c < C; ++c) {
            for (int t = 0; t < T; ++t) {
                double acc = 0;
                for (int i = 0; i < W; ++i) acc += P::load(weight[c * W + i]) * input(b, t - (W - 1) + i, c);
                acc = P::load(P::store((float)acc));
                const double want = acc / (1.0 + std::exp(-acc));
                const double got = P::load(out[(b * T + t) * C + c]);
                worst = std::max(worst, std::isnan(got) ? INFINITY : std::fabs(got - want));
                scale = std::max(scale, std::fabs(want));
            }
            for (int j = 0; j < W - 1; ++j) {
                const double got = P::load(next[(b * C + c) * (W - 1) + j]);
                const double want = input(b, T - (W - 1) + j, c);
                worst_state = std::max(worst_state, std::isnan(got) ? INFINITY : std::fabs(got - want));
            }
        }
    bool untouched = true;
    for (int i = 0; i < 16; ++i) {
        untouched &= std::isnan(P::load(out[B * T * C + i])) && std::isnan(P::load(next[B * C * (W - 1) + i]));
    }
    const double e = worst / std::max(scale, 1e-30);
    const bool ok = untouched && e <= tolerance && worst_state == 0.0;
    std::printf("%s %s: output %.2e, next conv state %.2e%s\n", ok ? "ok" : "FAILED", name, e,
                worst_state, untouched ? "" : ", wrote past the end");
    return ok;
}

int main() {
    emu::deadline(120);
    bool ok = true;
    // name, B, T, Hk, Hv, K, V, initial, l2norm, strided, g f32, beta f32, strong decays
    ok &= run_case<F32>({"f32 K32 grouped, one partial tile, 20 columns", 2, 37, 1, 2, 32, 20,
                         true, true, false, true, true, false},
                        gdn_recurrent_f32_k32, 2e-5);
    ok &= run_case<F32>({"f32 K64 two tiles, no norm, no initial state", 1, 70, 2, 2, 64, 16,
                         false, false, false, true, true, false},
                        gdn_recurrent_f32_k64, 2e-5);
    ok &= run_case<Bf16>({"bf16 K128 strided views, g and beta bf16, two tiles", 1, 40, 1, 3,
                          128, 16, true, true, true, false, false, false},
                         gdn_recurrent_bf16_k128, 1e-2);
    ok &= run_case<F32>({"f32 K128 strided, grouped, 2 column blocks", 1, 33, 2, 4, 128, 20,
                         true, true, true, true, false, false},
                        gdn_recurrent_f32_k128, 2e-5);
    ok &= run_case<F32>({"f32 K256 strong and zero decays, two tiles", 1, 20, 1, 1, 256, 8, true,
                         true, false, true, true, true},
                        gdn_recurrent_f32_k256, 2e-5);
    ok &= run_case<F32>({"f32 K32 one token (decoding)", 3, 1, 1, 2, 32, 16, true, true, true,
                         true, true, false},
                        gdn_recurrent_f32_k32, 2e-5);
    // the chunked form: partial last chunks and column blocks, grouped heads, strided views,
    // decays strong enough to underflow (and one of zero), bf16
    const size_t prep_bytes = 4 * GDN_PREP_FLOATS, scan_bytes = 4 * GDN_SCAN_FLOATS;
    const Chunked chunked_f32 = {gdn_chunk_prep_f32, gdn_chunk_scan_f32, GDN_CHUNK_THREADS,
                                 GDN_CHUNK_THREADS, prep_bytes, scan_bytes, GDN_SCAN_COLUMNS,
                                 1, 1e-4};
    const Chunked chunked_bf16 = {gdn_chunk_prep_bf16, gdn_chunk_scan_bf16, GDN_CHUNK_THREADS,
                                  GDN_CHUNK_THREADS, prep_bytes, scan_bytes, GDN_SCAN_COLUMNS,
                                  1, 1e-4};
    // the tensor-core form (TF32 products: a looser state tolerance)
    const Chunked tensor_cores_bf16 = {gdn_tc_prep_bf16, gdn_tc_scan_bf16, GDN_TC_PREP_THREADS,
                                       GDN_TC_SCAN_THREADS, GDN_TC_PREP_BYTES, GDN_TC_SCAN_BYTES,
                                       GDN_TC_COLUMNS, 3, 2e-3};
    const Chunked tensor_cores_narrow_bf16 = {
        gdn_tc_prep_bf16,      gdn_tc_scan_narrow_bf16,  GDN_TC_PREP_THREADS, GDN_TC_SCAN_THREADS,
        GDN_TC_PREP_BYTES,     GDN_TC_NARROW_SCAN_BYTES, GDN_TC_NARROW_COLUMNS, 3, 2e-3};
    ok &= run_case<F32>({"chunked f32: 3 chunks (the last partial), 2 column blocks, strided, "
                         "strong and zero decays",
                         1, 150, 1, 2, 128, 40, true, true, true, true, true, true},
                        nullptr, 1e-4, &chunked_f32);
    ok &= run_case<F32>({"chunked f32: grouped heads, 2 batch rows, no norm, no initial state",
                         2, 70, 2, 4, 128, 16, false, false, false, true, false, false},
                        nullptr, 1e-4, &chunked_f32);
    ok &= run_case<Bf16>({"chunked bf16: one whole chunk, g and beta bf16", 1, 64, 1, 2, 128, 32,
                          true, true, false, false, false, false},
                         nullptr, 1e-2, &chunked_bf16);
    ok &= run_case<Bf16>({"tensor cores bf16: 3 chunks (the last partial), 2 column blocks, "
                          "grouped, strided, strong and zero decays",
                          1, 150, 1, 2, 128, 128, true, true, true, true, true, true},
                         nullptr, 1e-2, &tensor_cores_bf16);
    ok &= run_case<Bf16>({"tensor cores bf16: V 64, 2 batch rows, grouped, no norm, no initial "
                          "state, g and beta bf16",
                          2, 70, 2, 4, 128, 64, false, false, false, false, false, false},
                         nullptr, 1e-2, &tensor_cores_bf16);
    ok &= run_case<Bf16>({"tensor cores bf16, narrow scan: 3 chunks (the last partial), 4 column "
                          "blocks, grouped, strided, strong and zero decays",
                          1, 150, 1, 2, 128, 128, true, true, true, true, true, true},
                         nullptr, 1e-2, &tensor_cores_narrow_bf16);
    ok &= run_case<Bf16>({"tensor cores bf16, narrow scan: V 64, 2 batch rows, grouped, no norm, "
                          "no initial state",
                          2, 70, 2, 4, 128, 64, false, false, false, false, false, false},
                         nullptr, 1e-2, &tensor_cores_narrow_bf16);
    // the causal convolution: several token tiles and channel blocks, a conv state, fewer tokens
    // than the state holds (decoding), bf16
    ok &= run_conv_case<F32>("conv f32: 3 token tiles, 2 channel blocks, conv state", 2, 40, 150,
                             true, gdn_causal_conv_f32, 1e-6);
    ok &= run_conv_case<F32>("conv f32: one token from the state, no state", 1, 1, 20, false,
                             gdn_causal_conv_f32, 1e-6);
    ok &= run_conv_case<F32>("conv f32: two tokens from the state", 2, 2, 33, true,
                             gdn_causal_conv_f32, 1e-6);
    ok &= run_conv_case<Bf16>("conv bf16: 17 tokens", 1, 17, 64, true, gdn_causal_conv_bf16, 1e-2);
    return ok ? 0 : 1;
}
