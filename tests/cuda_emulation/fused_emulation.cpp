// Runs the target's norm kernels of src/aten_ext/fused_kernels.cu (scaled_rms_norm,
// gated_rms_norm), the Gated DeltaNet's gdn_gates, SwiGLU's silu_mul, a mixture of experts'
// moe_combine, the training kernels (RMSNorm's backward pass among them), the optimizer's
// adamw_step and the attention's rotate_write on the CPU (cuda_emu.h)
// against double-precision loops
// that round to the storage type where the kernels must (where libtorch's operations round):
// rows of 5120 (a block per row) and of 128 / 256 (a warp per row, a partial last block),
// strided row layouts (a projection's views), rows the kernels read 16 bytes at a time and rows
// they read one element at a time (misaligned by an odd stride), bf16 and f32 storage (f16
// converts by inline assembly, which the emulation drops). The launch configurations are the
// Rust side's (src/aten_ext/fused_norms.rs). Prints one line per case; exit status 1 when any
// is off. Built and run by src/aten_ext/fused_norms.rs's tests:
//   c++ -std=c++20 -O1 -pthread -w -Isrc/aten_ext tests/cuda_emulation/fused_emulation.cpp
#include "cuda_emu.h"

#define FUSED_DYNAMIC_SHARED(name) float4 *name = emu::dynamic_shared.data()

#include "fused_kernels.cu"

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>

// The kernels of storage type P (the test is a template over it).
template <class P>
static void block_attention_fwd_bf16_or(const typename P::T *q, const typename P::T *kb,
                                        const typename P::T *vb, const typename P::T *o1,
                                        const float *lse1, const long long *anchors,
                                        typename P::T *out, float *lse, int heads, int kv, int d,
                                        int bs, int rows, float scale, int lanes) {
    if constexpr (std::is_same_v<P, Bf16>) {
        block_attention_fwd_bf16(q, kb, vb, o1, lse1, anchors, out, lse, heads, kv, d, bs, rows,
                                 scale, lanes);
    } else {
        block_attention_fwd_f32(q, kb, vb, o1, lse1, anchors, out, lse, heads, kv, d, bs, rows,
                                scale, lanes);
    }
}

template <class P>
static void block_attention_bwd_bf16_or(const typename P::T *q, const typename P::T *kb,
                                        const typename P::T *vb, const typename P::T *out,
                                        const typename P::T *dout, const float *lse,
                                        const long long *anchors, typename P::T *dq,
                                        typename P::T *dkb, typename P::T *dvb, int heads, int kv,
                                        int d, int bs, int rows, float scale, int lanes) {
    if constexpr (std::is_same_v<P, Bf16>) {
        block_attention_bwd_bf16(q, kb, vb, out, dout, lse, anchors, dq, dkb, dvb, heads, kv, d,
                                 bs, rows, scale, lanes);
    } else {
        block_attention_bwd_f32(q, kb, vb, out, dout, lse, anchors, dq, dkb, dvb, heads, kv, d,
                                bs, rows, scale, lanes);
    }
}

// The launch of a norm over rows of `width` elements of `bytes` each, as fused_norms.rs picks
// it: a warp per row, 8 rows a block, up to 1024; else a block per row of a warp per four
// 16-byte vectors (64 to 1024 threads).
struct Launch {
    unsigned blocks, threads;
    int row_threads;
};

static Launch launch_for(long long rows, int width, int bytes) {
    if (width <= 1024) {
        return {(unsigned)((rows + 7) / 8), 256, 32};
    }
    const int vec = 16 / bytes;
    int threads = (width + 4 * vec - 1) / (4 * vec);
    threads = std::clamp((threads + 31) / 32 * 32, 64, 1024);
    return {(unsigned)rows, (unsigned)threads, threads};
}

// `rows` rows in the layout `l` ([outer, inner] rows, `inner_stride` and `outer_stride`
// elements apart) in a buffer of `size` elements; the elements between rows hold NaN (a read of
// them shows).
struct Rows {
    RowLayout l;
    long long size;
    // row i's first element, computed here rather than by the kernels' own function
    long long at(long long i) const {
        const long long outer = i / l.inner, inner = i - outer * l.inner;
        return outer * l.outer_stride + inner * l.inner_stride;
    }
};

static Rows rows_of(long long rows, long long inner, long long inner_stride,
                    long long outer_stride) {
    const long long outer = rows / inner;
    return {{outer_stride, inner_stride, inner}, (outer - 1) * outer_stride + inner * inner_stride};
}

template <class P>
static std::vector<typename P::T> random_rows(const Rows &r, long long rows, int width,
                                              std::mt19937 &rng, float spread) {
    std::normal_distribution<float> normal;
    std::vector<typename P::T> x(r.size + 64, P::store(NAN));
    for (long long i = 0; i < rows; ++i) {
        for (int j = 0; j < width; ++j) {
            x[r.at(i) + j] = P::store(spread * normal(rng));
        }
    }
    return x;
}

template <class P>
static double round_to(double v) {
    return P::load(P::store((float)v));
}

// Compares the kernel's dense output `got` (`n` elements, then 64 guards that must stay NaN)
// with `want` (already rounded where the kernel rounds): each element within `rel` of it (and a
// small floor), at least `exact` of them bit for bit.
template <class P>
static bool compare(const char *name, const std::vector<typename P::T> &got,
                    const std::vector<double> &want, double rel, double exact) {
    const size_t n = want.size();
    double worst = 0;
    size_t same = 0;
    for (size_t i = 0; i < n; ++i) {
        const double g = P::load(got[i]);
        const double d = std::fabs(g - want[i]);
        const double off = std::isnan(d) ? INFINITY : d / (std::fabs(want[i]) + 1e-6);
        worst = std::max(worst, off);
        same += g == want[i];
    }
    bool untouched = true;
    for (size_t i = n; i < got.size(); ++i) {
        untouched &= std::isnan(P::load(got[i]));
    }
    const double share = (double)same / (double)n;
    const bool ok = untouched && worst <= rel && share >= exact;
    std::printf("%s %s: worst %.2e relative, %.4f exact%s\n", ok ? "ok" : "FAILED", name, worst,
                share, untouched ? "" : ", wrote past the end");
    return ok;
}

// As `compare`, each element within `rel` of |want| plus the mean |want| (for sums that cancel:
// an error the size of a rounding of their terms, not of their result).
template <class P>
static bool compare_scaled(const char *name, const std::vector<typename P::T> &got,
                           const std::vector<double> &want, double rel) {
    double mean = 0;
    for (double w : want) mean += std::fabs(w);
    mean /= std::max<size_t>(want.size(), 1);
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double d = std::fabs(P::load(got[i]) - want[i]);
        worst = std::max(worst, std::isnan(d) ? INFINITY : d / (std::fabs(want[i]) + mean));
    }
    bool untouched = true;
    for (size_t i = want.size(); i < got.size(); ++i) untouched &= std::isnan(P::load(got[i]));
    const bool ok = untouched && worst <= rel;
    std::printf("%s %s: worst %.2e of |value| + mean |value|%s\n", ok ? "ok" : "FAILED", name,
                worst, untouched ? "" : ", wrote past the end");
    return ok;
}

template <class P>
static double row_rstd_reference(const typename P::T *x, int width, double eps) {
    double s = 0;
    for (int j = 0; j < width; ++j) {
        const double v = P::load(x[j]);
        s += v * v;
    }
    return 1.0 / std::sqrt(s / width + eps);
}

// scaled_rms_norm over `rows` rows of `width` laid out as `r`.
template <class P>
static bool run_scaled(const char *name, void (*kernel)(const typename P::T *, RowLayout,
                                                         const float *, typename P::T *,
                                                         long long, int, float, int),
                       const Rows &r, long long rows, int width, double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(7 + rows + width);
    std::normal_distribution<float> normal;
    const std::vector<T> x = random_rows<P>(r, rows, width, rng, 3.0f);
    std::vector<float> scale(width);
    for (float &s : scale) s = 1.0f + 0.2f * normal(rng);
    const float eps = 1e-6f;
    std::vector<T> y(rows * width + 64, P::store(NAN));
    const Launch l = launch_for(rows, width, sizeof(T));
    emu::launch({l.blocks, 1, 1}, l.threads, [&] {
        kernel(x.data(), r.l, scale.data(), y.data(), rows, width, eps, l.row_threads);
    });
    std::vector<double> want(rows * width);
    for (long long i = 0; i < rows; ++i) {
        const T *xr = x.data() + r.at(i);
        const double rstd = row_rstd_reference<P>(xr, width, eps);
        for (int j = 0; j < width; ++j) {
            want[i * width + j] = round_to<P>(P::load(xr[j]) * rstd * scale[j]);
        }
    }
    return compare<P>(name, y, want, rel, exact);
}

// add_rms_norm over `rows` dense rows of `width` (h, a, s and y dense; `offset` elements into
// their buffers, an odd offset makes the kernel read element by element), launched as
// scaled_rms_norm. The reference in double: s = round(h + a), y = round(s rstd scale) with
// rstd from the rounded s.
template <class P>
static bool run_add_norm(const char *name,
                         void (*kernel)(const typename P::T *, const typename P::T *,
                                        const float *, typename P::T *, typename P::T *,
                                        long long, int, float, int),
                         long long rows, int width, int offset, double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(17 + rows + width);
    std::normal_distribution<float> normal;
    const long long n = rows * width;
    std::vector<T> h(n + offset), a(n + offset);
    for (long long i = 0; i < n + offset; ++i) {
        h[i] = P::store(3.0f * normal(rng));
        a[i] = P::store(normal(rng));
    }
    std::vector<float> scale(width);
    for (float &v : scale) v = 1.0f + 0.2f * normal(rng);
    const float eps = 1e-6f;
    std::vector<T> sum(n + offset + 64, P::store(NAN)), y(n + offset + 64, P::store(NAN));
    const Launch l = launch_for(rows, width, sizeof(T));
    emu::launch({l.blocks, 1, 1}, l.threads, [&] {
        kernel(h.data() + offset, a.data() + offset, scale.data(), sum.data() + offset,
               y.data() + offset, rows, width, eps, l.row_threads);
    });
    std::vector<double> want_s(n), want_y(n);
    for (long long i = 0; i < rows; ++i) {
        double squares = 0;
        for (int j = 0; j < width; ++j) {
            const long long e = offset + i * width + j;
            want_s[i * width + j] = round_to<P>(P::load(h[e]) + P::load(a[e]));
            squares += want_s[i * width + j] * want_s[i * width + j];
        }
        const double rstd = 1.0 / std::sqrt(squares / width + eps);
        for (int j = 0; j < width; ++j) {
            want_y[i * width + j] = round_to<P>(want_s[i * width + j] * rstd * scale[j]);
        }
    }
    const std::vector<T> got_s(sum.begin() + offset, sum.end());
    const std::vector<T> got_y(y.begin() + offset, y.end());
    const bool s_ok = compare<P>((std::string(name) + ", the sum").c_str(), got_s, want_s, 0.0, 1.0);
    return compare<P>((std::string(name) + ", the norm").c_str(), got_y, want_y, rel, exact) && s_ok;
}

// gated_rms_norm over `rows` rows of `width`, x laid out as `xr`, z as `zr`.
template <class P>
static bool run_gated(const char *name,
                      void (*kernel)(const typename P::T *, RowLayout, const typename P::T *,
                                     RowLayout, const typename P::T *, typename P::T *, long long,
                                     int, float, int),
                      const Rows &xr, const Rows &zr, long long rows, int width, double rel,
                      double exact) {
    typedef typename P::T T;
    std::mt19937 rng(11 + rows + width);
    std::normal_distribution<float> normal;
    const std::vector<T> x = random_rows<P>(xr, rows, width, rng, 0.5f);
    const std::vector<T> z = random_rows<P>(zr, rows, width, rng, 2.0f);
    std::vector<T> w(width);
    for (T &e : w) e = P::store(1.0f + 0.3f * normal(rng));
    const float eps = 1e-6f;
    std::vector<T> out(rows * width + 64, P::store(NAN));
    const Launch l = launch_for(rows, width, sizeof(T));
    emu::launch({l.blocks, 1, 1}, l.threads, [&] {
        kernel(x.data(), xr.l, z.data(), zr.l, w.data(), out.data(), rows, width, eps,
               l.row_threads);
    });
    std::vector<double> want(rows * width);
    for (long long i = 0; i < rows; ++i) {
        const T *xi = x.data() + xr.at(i);
        const T *zi = z.data() + zr.at(i);
        const double rstd = row_rstd_reference<P>(xi, width, eps);
        for (int j = 0; j < width; ++j) {
            const double t1 = round_to<P>(P::load(xi[j]) * rstd);
            const double t2 = round_to<P>(t1 * P::load(w[j]));
            const double g = P::load(zi[j]);
            want[i * width + j] = round_to<P>(t2 * (g / (1.0 + std::exp(-g))));
        }
    }
    return compare<P>(name, out, want, rel, exact);
}

// silu_mul over `rows` rows of [gate | up] of `width` each, launched as fused.rs does.
template <class P>
static bool run_silu_mul(const char *name,
                         void (*kernel)(const typename P::T *, typename P::T *, long long,
                                        long long),
                         long long rows, long long width, double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(5 + rows + width);
    std::normal_distribution<float> normal;
    std::vector<T> both(rows * 2 * width);
    for (T &e : both) e = P::store(2.0f * normal(rng));
    std::vector<T> out(rows * width + 64, P::store(NAN));
    const long long vec = width % (16 / sizeof(T)) == 0 ? 16 / sizeof(T) : 1;
    const unsigned blocks = (unsigned)std::min((width / vec + 255) / 256, 65535LL);
    emu::launch({blocks, (unsigned)std::min(rows, 65535LL), 1}, 256,
                [&] { kernel(both.data(), out.data(), rows, width); });
    std::vector<double> want(rows * width);
    for (long long i = 0; i < rows; ++i) {
        for (long long j = 0; j < width; ++j) {
            const double g = P::load(both[i * 2 * width + j]);
            const double u = P::load(both[i * 2 * width + width + j]);
            want[i * width + j] = round_to<P>(round_to<P>(g / (1.0 + std::exp(-g))) * u);
        }
    }
    return compare<P>(name, out, want, rel, exact);
}

// rotary over `positions` x `heads` rows of `d`, launched as fused_autograd.rs does (`vec`
// elements a thread, 256 threads where d / vec divides 256, else one row), forward or inverse, with
// tables of sin's first half negated as Rope::cos_sin makes them. The reference in double:
// x[j] cos[j] +- x[j +- d/2] sin[j], rounded once; allowed off by the storage type's rounding
// of the two products' magnitudes (the sum may cancel).
template <class P>
static bool run_rotary(const char *name,
                       void (*kernel)(const typename P::T *, const typename P::T *,
                                      const typename P::T *, typename P::T *, long long, int,
                                      int, int, int),
                       long long positions, int heads, int d, int inverse, int vec, double ulp) {
    typedef typename P::T T;
    std::mt19937 rng(11 + positions + heads + d + inverse);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> angle(0.0f, 100.0f);
    const long long rows = positions * heads;
    std::vector<T> x(rows * d), cos(positions * d), sin(positions * d);
    for (T &e : x) e = P::store(normal(rng));
    for (long long p = 0; p < positions; ++p) {
        for (int i = 0; i < d / 2; ++i) {
            const float a = angle(rng) / (1.0f + i);
            cos[p * d + i] = cos[p * d + i + d / 2] = P::store(std::cos(a));
            sin[p * d + i] = P::store(-std::sin(a));
            sin[p * d + i + d / 2] = P::store(std::sin(a));
        }
    }
    std::vector<T> out(rows * d + 64, P::store(NAN));
    const int per_row = d / vec;
    const int threads = 256 % per_row == 0 ? 256 : per_row;
    const long long per_block = threads / per_row;
    emu::launch({(unsigned)((rows + per_block - 1) / per_block), 1, 1}, threads, [&] {
        kernel(x.data(), cos.data(), sin.data(), out.data(), rows, heads, d, inverse, vec);
    });
    long long off = 0;
    bool untouched = true;
    for (size_t i = rows * d; i < out.size(); ++i) untouched &= std::isnan(P::load(out[i]));
    for (long long r = 0; r < rows; ++r) {
        const long long p = r / heads;
        for (int j = 0; j < d; ++j) {
            const int partner = j < d / 2 ? j + d / 2 : j - d / 2;
            const double a = (double)P::load(x[r * d + j]) * P::load(cos[p * d + j]);
            const double b = (double)P::load(x[r * d + partner]) * P::load(sin[p * d + j]) *
                             (inverse ? -1.0 : 1.0);
            const double got = P::load(out[r * d + j]);
            off += std::fabs(got - (a + b)) > ulp * (std::fabs(a) + std::fabs(b)) + 1e-30;
        }
    }
    const bool ok = off == 0 && untouched;
    std::printf("%s %s: %lld off%s\n", ok ? "ok" : "FAILED", name, off,
                untouched ? "" : ", wrote past the end");
    return ok;
}

// rotate_write over `n` tokens of `layers` layers of `heads` query and `kv` key/value heads of
// `d`, launched as fused.rs's rotate_write_launch does (a warp per head where d / 2 is a
// multiple of 32 up to 256, else a block per head), with or without the q/k norms; tokens go to
// cache rows in reverse order. The reference in double, rounded where the kernel must (the
// normalised value, its product with the weight, x * cos); the rotation's sum once.
template <class P>
static bool run_rotate_write(const char *name,
                             void (*kernel)(const typename P::T *, int, int, int, int,
                                            const typename P::T *, const typename P::T *, float,
                                            const typename P::T *, const typename P::T *,
                                            const long long *, typename P::T *, typename P::T *,
                                            typename P::T *, long long),
                             long long n, int layers, int heads, int kv, int d, bool norms,
                             double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(5 + n + layers + heads + d);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> angle(0.0f, 10.0f);
    const int groups = heads + 2 * kv, half = d / 2;
    const float eps = 1e-6f;
    std::vector<T> y(n * layers * groups * d), qn(layers * d), kn(layers * d), cos(n * d),
        sin(n * d);
    for (T &e : y) e = P::store(2.0f * normal(rng));
    for (T &e : qn) e = P::store(1.0f + 0.3f * normal(rng));
    for (T &e : kn) e = P::store(1.0f + 0.3f * normal(rng));
    for (long long t = 0; t < n; ++t) {
        for (int i = 0; i < half; ++i) {
            const float a = angle(rng) / (1.0f + i);
            cos[t * d + i] = cos[t * d + i + half] = P::store(std::cos(a));
            sin[t * d + i] = P::store(-std::sin(a));
            sin[t * d + i + half] = P::store(std::sin(a));
        }
    }
    // cache rows: n + 2 rows a layer, token t at row n - t
    const long long cache_rows = n + 2, layer_stride = cache_rows * kv * d;
    std::vector<long long> rows(n);
    for (long long t = 0; t < n; ++t) rows[t] = n - t;
    std::vector<T> q_out(n * layers * heads * d + 64, P::store(NAN)),
        k_cache(layers * layer_stride + 64, P::store(NAN)),
        v_cache(layers * layer_stride + 64, P::store(NAN));
    const long long slots = (long long)layers * groups;
    const bool warps = half % 32 == 0 && half <= 256;
    const unsigned threads = warps ? 128 : (unsigned)((half + 31) / 32 * 32);
    const unsigned gy = (unsigned)(warps ? (slots + 3) / 4 : slots);
    emu::launch({(unsigned)n, gy, 1}, threads, [&] {
        kernel(y.data(), layers, heads, kv, d, norms ? qn.data() : nullptr,
               norms ? kn.data() : nullptr, eps, cos.data(), sin.data(), rows.data(),
               q_out.data(), k_cache.data(), v_cache.data(), layer_stride);
    });
    std::vector<double> want_q(n * layers * heads * d), want_k, want_v;
    std::vector<T> got_k, got_v;
    for (long long t = 0; t < n; ++t) {
        for (int l = 0; l < layers; ++l) {
            for (int h = 0; h < groups; ++h) {
                const T *src = &y[((t * layers + l) * groups + h) * d];
                if (h >= heads + kv) {
                    const T *cached = &v_cache[l * layer_stride + (rows[t] * kv + h - heads - kv) * d];
                    for (int i = 0; i < d; ++i) {
                        want_v.push_back(P::load(src[i]));
                        got_v.push_back(cached[i]);
                    }
                    continue;
                }
                double sum = 0;
                for (int i = 0; i < d; ++i) sum += (double)P::load(src[i]) * P::load(src[i]);
                const double inv = 1.0 / std::sqrt(sum / d + eps);
                const T *w = (h < heads ? qn.data() : kn.data()) + l * d;
                std::vector<double> x(d);
                for (int i = 0; i < d; ++i) {
                    x[i] = P::load(src[i]);
                    if (norms) x[i] = round_to<P>(round_to<P>(x[i] * inv) * P::load(w[i]));
                }
                for (int i = 0; i < d; ++i) {
                    const int partner = i < half ? i + half : i - half;
                    const double r = round_to<P>(
                        round_to<P>(x[i] * P::load(cos[t * d + i])) +
                        x[partner] * P::load(sin[t * d + i]));
                    if (h < heads) {
                        want_q[((t * layers + l) * heads + h) * d + i] = r;
                    } else {
                        want_k.push_back(r);
                        got_k.push_back(k_cache[l * layer_stride + (rows[t] * kv + h - heads) * d + i]);
                    }
                }
            }
        }
    }
    // rows 0 and n + 1 of every layer's caches are no token's: untouched
    bool untouched = true;
    for (int l = 0; l < layers; ++l) {
        for (long long r : {0LL, cache_rows - 1}) {
            for (long long i = 0; i < kv * d; ++i) {
                untouched &= std::isnan(P::load(k_cache[l * layer_stride + r * kv * d + i]));
                untouched &= std::isnan(P::load(v_cache[l * layer_stride + r * kv * d + i]));
            }
        }
    }
    for (int i = 0; i < 64; ++i) {
        got_k.push_back(P::store(NAN));
        got_v.push_back(P::store(NAN));
    }
    std::string base(name);
    bool ok = compare<P>((base + ", queries").c_str(), q_out, want_q, rel, exact);
    ok &= compare<P>((base + ", keys").c_str(), got_k, want_k, rel, exact);
    ok &= compare<P>((base + ", values").c_str(), got_v, want_v, 0.0, 1.0);
    if (!untouched) std::printf("FAILED %s: wrote a cache row of no token\n", name);
    return ok && untouched;
}

// block_attention_fwd and _bwd over `entries` chunk entries of `blocks` blocks of `bs` rows,
// `heads` query heads over `kv` key/value heads of `d`, launched as fused_block_attention.rs
// does (a block per (block, kv head) of g * bs threads; shared memory sized as it sizes it).
// Each entry has `context` context keys; block b of an entry sees the first anchor(b) of them
// (the first block of each entry none: its context part's output, log-sum-exp and query
// gradient hold NaN, which the kernels must not read) and its own rows' keys. The reference:
// the whole attention in double ([visible context; own block], softmax, its gradients for a
// random output gradient); the context part's output, log-sum-exp and query gradient given to
// the kernels as the fused kernel would compute them (rounded to the storage type). The merge
// rounds the context part once more than one pass over all keys would: errors are measured
// against the values' mean magnitude (compare_scaled).
template <class P>
static bool run_block_attention(const char *name, int entries, int blocks, int bs, int heads,
                                int kv, int d, int context, double rel, bool mma = false) {
    typedef typename P::T T;
    std::mt19937 rng(17 + entries + blocks + bs + heads + d);
    std::normal_distribution<float> normal;
    const int g = heads / kv, rows = blocks * bs;
    const long long R = (long long)entries * rows;
    const double scale = 1.0 / std::sqrt((double)d);
    auto fill = [&](long long n, float spread) {
        std::vector<T> v(n);
        for (T &e : v) e = P::store(spread * normal(rng));
        return v;
    };
    std::vector<T> q = fill(R * heads * d, 1.0f), kb = fill(R * kv * d, 1.0f),
                   vb = fill(R * kv * d, 1.0f), kc = fill((long long)entries * context * kv * d, 1.0f),
                   vc = fill((long long)entries * context * kv * d, 1.0f),
                   dout = fill(R * heads * d, 1.0f);
    std::vector<long long> anchors(R / bs);
    for (long long b = 0; b < R / bs; ++b) {
        anchors[b] = b % blocks == 0 ? 0 : 1 + (b * 7) % context;
    }
    // per row and head: the reference in double over its visible keys
    std::vector<T> o1(R * heads * d), out_ref(R * heads * d), dq(R * heads * d);
    std::vector<float> lse1(R * heads), lse(R * heads);
    std::vector<double> want_out(R * heads * d), want_dq(R * heads * d), want_dk(R * kv * d, 0.0),
        want_dv(R * kv * d, 0.0);
    for (long long row = 0; row < R; ++row) {
        const long long e = row / rows, r = row % rows, blk = row / bs, a = anchors[blk];
        for (int h = 0; h < heads; ++h) {
            const int kh = h / g;
            const long long li = (e * heads + h) * rows + r;
            const T *qr = &q[(row * heads + h) * d];
            // keys: context 0..a, then the block's bs rows
            const int n = (int)a + bs;
            std::vector<const T *> ks(n), vs(n);
            for (int j = 0; j < n; ++j) {
                if (j < a) {
                    ks[j] = &kc[((e * context + j) * kv + kh) * d];
                    vs[j] = &vc[((e * context + j) * kv + kh) * d];
                } else {
                    const long long kr = blk * bs + (j - a);
                    ks[j] = &kb[(kr * kv + kh) * d];
                    vs[j] = &vb[(kr * kv + kh) * d];
                }
            }
            std::vector<double> sc(n);
            double m = -INFINITY;
            for (int j = 0; j < n; ++j) {
                double acc = 0;
                for (int c = 0; c < d; ++c) acc += (double)P::load(qr[c]) * P::load(ks[j][c]);
                sc[j] = acc * scale;
                m = std::max(m, sc[j]);
            }
            double l = 0, lc = 0;
            for (int j = 0; j < n; ++j) {
                l += std::exp(sc[j] - m);
                if (j < a) lc += std::exp(sc[j] - m);
            }
            const double total = m + std::log(l);
            lse[li] = (float)total;
            lse1[li] = a > 0 ? (float)(m + std::log(lc)) : NAN;
            const T *gr = &dout[(row * heads + h) * d];
            std::vector<double> o(d, 0.0), oc(d, 0.0);
            for (int j = 0; j < n; ++j) {
                const double p = std::exp(sc[j] - total);
                for (int c = 0; c < d; ++c) {
                    o[c] += p * P::load(vs[j][c]);
                    if (j < a) oc[c] += std::exp(sc[j] - m) / lc * P::load(vs[j][c]);
                }
            }
            double dot = 0;
            for (int c = 0; c < d; ++c) {
                want_out[(row * heads + h) * d + c] = round_to<P>(o[c]);
                out_ref[(row * heads + h) * d + c] = P::store((float)o[c]);
                o1[(row * heads + h) * d + c] = a > 0 ? P::store((float)oc[c]) : P::store(NAN);
                dot += (double)P::load(gr[c]) * P::load(out_ref[(row * heads + h) * d + c]);
            }
            std::vector<double> dqc(d, 0.0), dqa(d, 0.0);
            for (int j = 0; j < n; ++j) {
                const double p = std::exp(sc[j] - total);
                double dp = 0;
                for (int c = 0; c < d; ++c) dp += (double)P::load(gr[c]) * P::load(vs[j][c]);
                const double ds = p * (dp - dot);
                for (int c = 0; c < d; ++c) {
                    dqa[c] += scale * ds * P::load(ks[j][c]);
                    if (j < a) dqc[c] += scale * ds * P::load(ks[j][c]);
                }
                if (j >= a) {
                    const long long kr = blk * bs + (j - a);
                    for (int c = 0; c < d; ++c) {
                        want_dk[(kr * kv + kh) * d + c] += scale * ds * P::load(qr[c]);
                        want_dv[(kr * kv + kh) * d + c] += p * P::load(gr[c]);
                    }
                }
            }
            for (int c = 0; c < d; ++c) {
                want_dq[(row * heads + h) * d + c] = dqa[c];
                dq[(row * heads + h) * d + c] = a > 0 ? P::store((float)dqc[c]) : P::store(NAN);
            }
        }
    }
    for (double &v : want_dk) v = round_to<P>(v);
    for (double &v : want_dv) v = round_to<P>(v);
    for (double &v : want_dq) v = round_to<P>(v);
    std::vector<T> out(R * heads * d + 64, P::store(NAN));
    std::vector<float> lse_got(R * heads, NAN);
    // the warp-cooperative form where a head is 8 or 16 vectors of 16 bytes, as the Rust side
    // launches it
    // (or the tensor-core form: a warp per head of the block's kv head, shared memory as
    // fused_block_attention.rs sizes it)
    const int vec = 16 / (int)sizeof(T);
    const int lanes = mma ? BLOCK_ATTN_MMA : d == 8 * vec ? 8 : d == 16 * vec ? 16 : 0;
    const unsigned threads = mma ? 32u * g : lanes > 0 ? 128u : (unsigned)(g * bs);
    const int width = g * 16 + BLOCK_ATTN_RPAD, keys = 16 * (d + BLOCK_ATTN_KPAD);
    const long long mma_bytes =
        2 * (2 * 16 * width + std::max(2 * keys + 16 * d, 2 * d * width));
    emu::dynamic_shared.assign(
        std::max<long long>((2 * bs * d + 2 * g * bs * 16) / 4, mma_bytes / 16) + 1, float4{});
    emu::launch({(unsigned)(R / bs), (unsigned)kv, 1}, threads, [&] {
        block_attention_fwd_bf16_or<P>(q.data(), kb.data(), vb.data(), o1.data(), lse1.data(),
                                       anchors.data(), out.data(), lse_got.data(), heads, kv, d,
                                       bs, rows, (float)scale, lanes);
    });
    std::string base(name);
    bool ok = compare_scaled<P>((base + ", forward").c_str(), out, want_out, rel);
    double worst_lse = 0;
    for (long long i = 0; i < R * heads; ++i) {
        worst_lse = std::max(worst_lse, std::fabs((double)lse_got[i] - lse[i]));
    }
    const bool lse_ok = worst_lse < 1e-4;
    std::printf("%s %s, log-sum-exp: worst %.2e\n", lse_ok ? "ok" : "FAILED", name, worst_lse);
    ok &= lse_ok;
    std::vector<T> dkb(R * kv * d + 64, P::store(NAN)), dvb(R * kv * d + 64, P::store(NAN));
    dq.resize(R * heads * d + 64, P::store(NAN));
    emu::launch({(unsigned)(R / bs), (unsigned)kv, 1}, threads, [&] {
        block_attention_bwd_bf16_or<P>(q.data(), kb.data(), vb.data(), out_ref.data(), dout.data(),
                                       lse.data(), anchors.data(), dq.data(), dkb.data(),
                                       dvb.data(), heads, kv, d, bs, rows, (float)scale, lanes);
    });
    ok &= compare_scaled<P>((base + ", dq").c_str(), dq, want_dq, rel);
    ok &= compare_scaled<P>((base + ", dk").c_str(), dkb, want_dk, rel);
    ok &= compare_scaled<P>((base + ", dv").c_str(), dvb, want_dv, rel);
    return ok;
}

// swiglu over `n` elements, forward and backward, launched as fused_autograd.rs does (256
// threads, a grid-stride loop over fewer blocks than elements here): the reference in double,
// rounded where libtorch's silu, mul and silu_backward round.
template <class P>
static bool run_swiglu(const char *name,
                       void (*kernel)(const typename P::T *, const typename P::T *,
                                      const typename P::T *, typename P::T *, typename P::T *,
                                      long long),
                       long long n, double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(17 + n);
    std::normal_distribution<float> normal;
    std::vector<T> gate(n), up(n), grad(n);
    for (long long i = 0; i < n; ++i) {
        gate[i] = P::store(3.0f * normal(rng));
        up[i] = P::store(normal(rng));
        grad[i] = P::store(normal(rng));
    }
    std::vector<T> out(n + 64, P::store(NAN)), d_gate(n + 64, P::store(NAN)),
        d_up(n + 64, P::store(NAN));
    emu::launch({3, 1, 1}, 256, [&] { kernel(gate.data(), up.data(), nullptr, out.data(), nullptr, n); });
    emu::launch({3, 1, 1}, 256,
                [&] { kernel(gate.data(), up.data(), grad.data(), d_gate.data(), d_up.data(), n); });
    std::vector<double> want(n), want_dg(n), want_du(n);
    for (long long i = 0; i < n; ++i) {
        const double g = P::load(gate[i]), u = P::load(up[i]), dy = P::load(grad[i]);
        const double sig = 1.0 / (1.0 + std::exp(-g));
        const double silu = round_to<P>(g * sig);
        want[i] = round_to<P>(silu * u);
        want_du[i] = round_to<P>(dy * silu);
        want_dg[i] = round_to<P>(round_to<P>(dy * u) * sig * (1.0 + g * (1.0 - sig)));
    }
    char label[200];
    bool ok = compare<P>(name, out, want, rel, exact);
    std::snprintf(label, sizeof label, "%s, gate's gradient", name);
    ok &= compare<P>(label, d_gate, want_dg, rel, exact);
    std::snprintf(label, sizeof label, "%s, up's gradient", name);
    ok &= compare<P>(label, d_up, want_du, rel, exact);
    return ok;
}

// gdn_gates over `rows` tokens of `heads` value heads, a and b columns of a projection whose
// rows are `row_stride` apart (a at column 0, b after it), launched as fused_norms.rs does (a
// thread per value, 256 a block). The reference: the float32 sum a + dt_bias (as libtorch adds
// two float32 tensors), softplus in double (the sum itself above 20), times neg_a; sigmoid(b)
// in double, rounded to the storage type. Values of a span the threshold.
template <class P>
static bool run_gdn_gates(const char *name,
                          void (*kernel)(const typename P::T *, const typename P::T *, long long,
                                         int, long long, const typename P::T *, const float *,
                                         float *, typename P::T *),
                          long long rows, int heads, long long row_stride, double rel,
                          double exact) {
    typedef typename P::T T;
    std::mt19937 rng(11 + rows + heads);
    std::normal_distribution<float> normal;
    std::vector<T> proj(rows * row_stride, P::store(NAN));
    for (long long r = 0; r < rows; ++r) {
        for (int h = 0; h < 2 * heads; ++h) {
            proj[r * row_stride + h] = P::store(h < heads ? 12.0f * normal(rng) : 3.0f * normal(rng));
        }
    }
    std::vector<T> dt(heads);
    std::vector<float> neg_a(heads);
    for (int h = 0; h < heads; ++h) {
        dt[h] = P::store(normal(rng));
        neg_a[h] = -std::exp(normal(rng));
    }
    std::vector<float> g(rows * heads + 64, NAN);
    std::vector<T> beta(rows * heads + 64, P::store(NAN));
    const long long n = rows * heads;
    emu::launch({(unsigned)std::min((n + 255) / 256, 65535LL), 1, 1}, 256, [&] {
        kernel(proj.data(), proj.data() + heads, row_stride, heads, rows, dt.data(),
               neg_a.data(), g.data(), beta.data());
    });
    std::vector<double> want_g(n), want_beta(n);
    for (long long r = 0; r < rows; ++r) {
        for (int h = 0; h < heads; ++h) {
            const float x = P::load(proj[r * row_stride + h]) + P::load(dt[h]);
            const double soft = x > 20.0f ? (double)x : std::log1p(std::exp((double)x));
            want_g[r * heads + h] = soft * neg_a[h];
            const double b = P::load(proj[r * row_stride + heads + h]);
            want_beta[r * heads + h] = round_to<P>(1.0 / (1.0 + std::exp(-b)));
        }
    }
    std::string gname = std::string(name) + ", g", bname = std::string(name) + ", beta";
    return compare<F32>(gname.c_str(), g, want_g, 1e-6, 0.0) &
           compare<P>(bname.c_str(), beta, want_beta, rel, exact);
}

// moe_combine over `tokens` tokens of `k` choices and rows of `hidden`, launched as fused.rs
// does: the products y in a shuffled order (as sorted by expert), pos their inverse; with
// `shared` a shared expert's output and its gate's logit per token, with `accumulate` the
// result added into a residual stream. The reference rounds where transformers' operations
// round: each round(y * w), their sum in double precision rounded once, sigmoid(gate), its
// product with the shared output, their sum, the residual's sum.
template <class P>
static bool run_moe_combine(const char *name,
                            void (*kernel)(const typename P::T *, const long long *,
                                           const typename P::T *, const typename P::T *,
                                           const typename P::T *, typename P::T *, long long,
                                           int, int, int),
                            long long tokens, int k, long long hidden, bool shared,
                            bool accumulate, double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(9 + tokens + k + hidden + shared + 2 * accumulate);
    std::normal_distribution<float> normal;
    const long long pairs = tokens * k;
    std::vector<long long> order(pairs);
    for (long long p = 0; p < pairs; ++p) order[p] = p;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<long long> pos(pairs);
    for (long long p = 0; p < pairs; ++p) pos[order[p]] = p;
    std::vector<T> y(pairs * hidden), w(pairs), sh(tokens * hidden), gate(tokens);
    for (T &e : y) e = P::store(normal(rng));
    for (T &e : w) e = P::store(std::fabs(normal(rng)) / k);
    for (T &e : sh) e = P::store(normal(rng));
    for (T &e : gate) e = P::store(2.0f * normal(rng));
    std::vector<T> out(tokens * hidden + 64, P::store(NAN));
    if (accumulate) {
        for (long long i = 0; i < tokens * hidden; ++i) out[i] = P::store(4.0f * normal(rng));
    }
    const std::vector<T> before = out;
    const int vectors = hidden % (16 / sizeof(T)) == 0;
    emu::launch({(unsigned)tokens, 1, 1}, 256, [&] {
        kernel(y.data(), pos.data(), w.data(), shared ? sh.data() : nullptr,
               shared ? gate.data() : nullptr, out.data(), hidden, k, vectors, accumulate);
    });
    std::vector<double> want(tokens * hidden);
    for (long long t = 0; t < tokens; ++t) {
        const double g = P::load(gate[t]);
        const double scale = round_to<P>(1.0 / (1.0 + std::exp(-g)));
        for (long long h = 0; h < hidden; ++h) {
            double acc = 0;
            for (int j = 0; j < k; ++j) {
                const long long p = t * k + j;
                acc += round_to<P>((double)P::load(y[pos[p] * hidden + h]) * P::load(w[p]));
            }
            double v = round_to<P>(acc);
            if (shared) {
                v = round_to<P>(v + round_to<P>(scale * P::load(sh[t * hidden + h])));
            }
            if (accumulate) {
                v = round_to<P>(P::load(before[t * hidden + h]) + v);
            }
            want[t * hidden + h] = v;
        }
    }
    return compare<P>(name, out, want, rel, exact);
}

// The host's reading of libtorch's topk on a GPU (largest, sorted, k <= 32): the k largest by
// the radix order, the lowest indices among those equal to the k-th; laid out as [above the
// k-th, by index; equal to it, by index]; then its bitonic network over 32 slots, step by step.
static unsigned host_radix_key(float v) {
    unsigned x;
    std::memcpy(&x, &v, 4);
    return x ^ ((x & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}

static void host_topk(const float *row, int experts, int k, float *values, long long *indices) {
    std::vector<int> idx(experts);
    for (int e = 0; e < experts; ++e) idx[e] = e;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
        return host_radix_key(row[a]) > host_radix_key(row[b]);
    });
    const unsigned kth = host_radix_key(row[idx[k - 1]]);
    std::vector<int> chosen(idx.begin(), idx.begin() + k);
    std::sort(chosen.begin(), chosen.end(), [&](int a, int b) {
        const int ga = host_radix_key(row[a]) > kth ? 0 : 1;
        const int gb = host_radix_key(row[b]) > kth ? 0 : 1;
        return ga != gb ? ga < gb : a < b;
    });
    float v[32];
    int ix[32];
    bool ok[32];
    for (int i = 0; i < 32; ++i) {
        ok[i] = i < k;
        v[i] = ok[i] ? row[chosen[i]] : 0.0f;
        ix[i] = ok[i] ? chosen[i] : 0;
    }
    const auto swap_step = [&](int stride, bool dir, int lane) {
        const int a = 2 * lane - (lane & (stride - 1)), b = a + stride;
        const bool greater = (std::isnan(v[a]) && !std::isnan(v[b])) || v[a] > v[b];
        const bool swap = (greater && ok[a]) || !ok[b];
        if (swap == dir) {
            std::swap(v[a], v[b]);
            std::swap(ix[a], ix[b]);
            std::swap(ok[a], ok[b]);
        }
    };
    for (int size = 2; size < 32; size *= 2) {
        for (int stride = size / 2; stride > 0; stride /= 2) {
            for (int lane = 0; lane < 16; ++lane) swap_step(stride, (lane & (size / 2)) != 0, lane);
        }
    }
    for (int stride = 16; stride > 0; stride /= 2) {
        for (int lane = 0; lane < 16; ++lane) swap_step(stride, false, lane);
    }
    for (int i = 0; i < k; ++i) {
        values[i] = v[i];
        indices[i] = ix[i];
    }
}

// libtorch's float32 sum of the k values of a row on a GPU (Reduce.cuh, a reduction over the
// fastest dimension of k elements): w = the largest power of two up to k lanes, lane i holding
// v[i] + v[i + w]; then lane i adds lane i + offset for offset = w / 2, ..., 1 (shfl_down).
static float libtorch_row_sum(const float *v, int k) {
    int w = 1;
    while (2 * w <= k) w *= 2;
    std::vector<float> lane(w);
    for (int i = 0; i < w; ++i) lane[i] = i + w < k ? v[i] + v[i + w] : v[i];
    for (int offset = w / 2; offset > 0; offset /= 2) {
        std::vector<float> next = lane;
        for (int i = 0; i + offset < w; ++i) next[i] = lane[i] + lane[i + offset];
        lane = next;
    }
    return lane[0];
}

// moe_topk over `tokens` rows of softmax probabilities of logits drawn from `levels` values (so
// that many are tied), launched as fused.rs does (a warp per token, 8 a block); the kernel's
// values and indices must equal the host's bit for bit, and be a top k: non-increasing, with
// nothing left out larger than the last. With `weight_kind` 0 (bf16) or 2 (f32) the routing
// weights too: the values over libtorch's sum of them where `normalize`, rounded, bit for bit.
static bool run_moe_topk(const char *name, long long tokens, int experts, int k, int levels,
                         int normalize = 0, int weight_kind = -1) {
    std::mt19937 rng(23 + tokens + experts + k);
    std::uniform_int_distribution<int> level(0, levels - 1);
    std::vector<float> probs(tokens * experts);
    for (long long t = 0; t < tokens; ++t) {
        float *row = probs.data() + t * experts;
        float m = -INFINITY, sum = 0;
        for (int e = 0; e < experts; ++e) {
            row[e] = 0.25f * level(rng);
            m = std::max(m, row[e]);
        }
        for (int e = 0; e < experts; ++e) sum += row[e] = std::exp(row[e] - m);
        for (int e = 0; e < experts; ++e) row[e] /= sum;
    }
    std::vector<float> values(tokens * k, NAN);
    std::vector<long long> indices(tokens * k, -1);
    std::vector<float> weights32(tokens * k, NAN);
    std::vector<u16> weights16(tokens * k, 0xffff);
    void *weights = weight_kind < 0    ? nullptr
                    : weight_kind == 2 ? (void *)weights32.data()
                                       : (void *)weights16.data();
    emu::launch({(unsigned)((tokens + 7) / 8), 1, 1}, 256, [&] {
        if (experts <= 256) {
            moe_topk_256(probs.data(), tokens, experts, k, values.data(), indices.data(),
                         normalize, weight_kind, weights);
        } else {
            moe_topk_1024(probs.data(), tokens, experts, k, values.data(), indices.data(),
                          normalize, weight_kind, weights);
        }
    });
    long long wrong = 0, reordered_ties = 0;
    for (long long t = 0; t < tokens; ++t) {
        float v[32];
        long long ix[32];
        host_topk(probs.data() + t * experts, experts, k, v, ix);
        if (weight_kind >= 0) {
            const float total = libtorch_row_sum(v, k);
            for (int j = 0; j < k; ++j) {
                const float w = normalize ? v[j] / total : v[j];
                wrong += weight_kind == 2 ? weights32[t * k + j] != w
                                          : weights16[t * k + j] != Bf16::store(w);
            }
        }
        bool by_index = true;
        for (int j = 0; j < k; ++j) {
            wrong += values[t * k + j] != v[j] || indices[t * k + j] != ix[j];
            if (j > 0) {
                wrong += values[t * k + j] > values[t * k + j - 1];
                by_index &= !(v[j] == v[j - 1] && ix[j] < ix[j - 1]);
            }
        }
        for (int e = 0; e < experts; ++e) {
            bool chosen = false;
            for (int j = 0; j < k; ++j) chosen |= indices[t * k + j] == e;
            wrong += !chosen && probs[t * experts + e] > values[t * k + k - 1];
        }
        reordered_ties += !by_index;
    }
    // the ties must show: some tokens whose equal values the network left out of index order
    const bool ok = wrong == 0 && (k < 4 || reordered_ties > 0);
    std::printf("%s %s: %lld off, %lld tokens with equal values out of index order\n",
                ok ? "ok" : "FAILED", name, wrong, reordered_ties);
    return ok;
}

// The grouping kernels as fused.rs launches them (count and place a block of 256 per 64
// tokens, offsets one block of 1024) against a stable sort of the pairs by expert: each pair's
// row, each row's token and the experts' ends.
static bool run_moe_group(const char *name, long long tokens, int experts, int k) {
    std::mt19937 rng(29 + tokens + experts + k);
    std::vector<long long> ids(tokens * k);
    std::vector<int> all(experts);
    for (int e = 0; e < experts; ++e) all[e] = e;
    for (long long t = 0; t < tokens; ++t) {
        // distinct experts per token, skewed towards the low ids (some experts get no rows)
        std::shuffle(all.begin(), all.begin() + std::min(experts, 3 * k), rng);
        for (int j = 0; j < k; ++j) ids[t * k + j] = all[j];
    }
    const long long chunks = (tokens + 63) / 64, pairs = tokens * k;
    std::vector<int> counts(chunks * experts, -1), ends(experts, -1);
    std::vector<long long> positions(pairs, -1), row_tokens(pairs, -1);
    emu::launch({(unsigned)chunks, 1, 1}, 256,
                [&] { moe_group_count(ids.data(), tokens, k, experts, counts.data()); });
    emu::launch({1, 1, 1}, 1024,
                [&] { moe_group_offsets(counts.data(), chunks, experts, ends.data()); });
    emu::launch({(unsigned)chunks, 1, 1}, 256, [&] {
        moe_group_place(ids.data(), tokens, k, experts, counts.data(), positions.data(),
                        row_tokens.data());
    });
    std::vector<long long> order(pairs);
    for (long long p = 0; p < pairs; ++p) order[p] = p;
    std::stable_sort(order.begin(), order.end(),
                     [&](long long a, long long b) { return ids[a] < ids[b]; });
    long long wrong = 0;
    for (long long r = 0; r < pairs; ++r) {
        wrong += positions[order[r]] != r;
        wrong += row_tokens[r] != order[r] / k;
    }
    for (int e = 0; e < experts; ++e) {
        long long n = 0;
        for (long long p = 0; p < pairs; ++p) n += ids[p] <= e;
        wrong += ends[e] != n;
    }
    std::printf("%s %s: %lld off\n", wrong == 0 ? "ok" : "FAILED", name, wrong);
    return wrong == 0;
}

// gated_attention_prep over `tokens` tokens of a projection of `heads` query heads (a query and
// a gate each) and `kv` key/value heads of `d`, the first `rot` of each head rotated with `m`
// rows of angles (token t at row t % m), launched as fused_attention.rs does (8 warps a block,
// a warp per head). The reference in double, rounded where the kernel must: the normed head
// (once), the product with cos, the addcmul.
template <class P>
static bool run_gated_prep(const char *name,
                           void (*kernel)(const typename P::T *, long long, long long, int, int,
                                          int, int, const float *, const float *, float,
                                          const typename P::T *, const typename P::T *,
                                          long long, typename P::T *, typename P::T *),
                           long long tokens, int heads, int kv, int d, int rot, long long m,
                           double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(13 + tokens + heads + d + rot);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> angle(0.0f, 100.0f);
    const long long row = (2LL * heads + 2LL * kv) * d;
    std::vector<T> y(tokens * row);
    for (T &e : y) e = P::store(3.0f * normal(rng));
    std::vector<float> q_scale(d), k_scale(d);
    for (float &s : q_scale) s = 1.0f + 0.2f * normal(rng);
    for (float &s : k_scale) s = 1.0f + 0.2f * normal(rng);
    std::vector<T> cos(m * rot), sin(m * rot);
    for (long long p = 0; p < m; ++p) {
        for (int i = 0; i < rot / 2; ++i) {
            const float a = angle(rng) / (1.0f + i);
            cos[p * rot + i] = cos[p * rot + i + rot / 2] = P::store(std::cos(a));
            sin[p * rot + i] = P::store(-std::sin(a));
            sin[p * rot + i + rot / 2] = P::store(std::sin(a));
        }
    }
    const float eps = 1e-6f;
    std::vector<T> q(tokens * heads * d + 64, P::store(NAN)), k(tokens * kv * d + 64, P::store(NAN));
    const long long items = tokens * (heads + kv);
    emu::launch({(unsigned)((items + GATED_PREP_WARPS - 1) / GATED_PREP_WARPS), 1, 1},
                32 * GATED_PREP_WARPS, [&] {
                    kernel(y.data(), row, tokens, heads, kv, d, rot, q_scale.data(),
                           k_scale.data(), eps, cos.data(), sin.data(), m, q.data(), k.data());
                });
    std::vector<double> want_q(tokens * heads * d), want_k(tokens * kv * d);
    std::vector<double> normed(d);
    for (long long t = 0; t < tokens; ++t) {
        for (int h = 0; h < heads + kv; ++h) {
            const bool query = h < heads;
            const T *src = y.data() + t * row + (query ? 2LL * h * d : 2LL * heads * d + (long long)(h - heads) * d);
            const float *scale = query ? q_scale.data() : k_scale.data();
            const double rstd = row_rstd_reference<P>(src, d, eps);
            for (int j = 0; j < d; ++j) normed[j] = round_to<P>(P::load(src[j]) * rstd * scale[j]);
            double *dst = query ? &want_q[(t * heads + h) * d] : &want_k[(t * kv + h - heads) * d];
            const T *c = cos.data() + (t % m) * rot, *sn = sin.data() + (t % m) * rot;
            for (int j = 0; j < d; ++j) {
                if (j < rot) {
                    const int partner = j < rot / 2 ? j + rot / 2 : j - rot / 2;
                    dst[j] = round_to<P>(round_to<P>(normed[j] * P::load(c[j])) +
                                         normed[partner] * P::load(sn[j]));
                } else {
                    dst[j] = normed[j];
                }
            }
        }
    }
    std::string qn = std::string(name) + ", queries", kn = std::string(name) + ", keys";
    const bool ok_q = compare<P>(qn.c_str(), q, want_q, rel, exact);
    const bool ok_k = compare<P>(kn.c_str(), k, want_k, rel, exact);
    return ok_q && ok_k;
}

// sigmoid_gate_mul over `tokens` tokens of `heads` heads of `d` (gates in a projection with `kv`
// key/value heads), `blocks` blocks of 256 threads looping over the elements.
template <class P>
static bool run_gate_mul(const char *name,
                         void (*kernel)(const typename P::T *, const typename P::T *, long long,
                                        long long, int, int, typename P::T *),
                         long long tokens, int heads, int kv, int d, unsigned blocks, double rel,
                         double exact) {
    typedef typename P::T T;
    std::mt19937 rng(17 + tokens + heads + d);
    std::normal_distribution<float> normal;
    const long long row = (2LL * heads + 2LL * kv) * d;
    std::vector<T> y(tokens * row), attn(tokens * heads * d);
    for (T &e : y) e = P::store(3.0f * normal(rng));
    for (T &e : attn) e = P::store(normal(rng));
    std::vector<T> out(tokens * heads * d + 64, P::store(NAN));
    emu::launch({blocks, 1, 1}, 256, [&] {
        kernel(attn.data(), y.data(), row, tokens, heads, d, out.data());
    });
    std::vector<double> want(tokens * heads * d);
    for (long long t = 0; t < tokens; ++t) {
        for (int h = 0; h < heads; ++h) {
            for (int e = 0; e < d; ++e) {
                const double g = P::load(y[t * row + (2LL * h + 1) * d + e]);
                const double sig = round_to<P>(1.0 / (1.0 + std::exp(-g)));
                want[(t * heads + h) * d + e] = round_to<P>(P::load(attn[(t * heads + h) * d + e]) * sig);
            }
        }
    }
    return compare<P>(name, out, want, rel, exact);
}

// adamw_step over `n` elements (`blocks` blocks of 256 threads looping over them), the float32
// state `offset` floats into its buffers (offset 1: not 16-byte aligned, element by element),
// with a gradient or none (zeros), divided by `scale` or not: the master weights and moments
// against AdamW in double precision, the parameter exactly the new master weight rounded, and
// nothing written past the n elements.
template <class P>
static bool run_adamw(const char *name,
                      void (*kernel)(const typename P::T *, typename P::T *, float *, float *,
                                     float *, long long, const float *, AdamWRates),
                      long long n, long long offset, bool with_grad, float scale,
                      unsigned blocks) {
    typedef typename P::T T;
    std::mt19937 rng(23 + n + offset);
    std::normal_distribution<float> normal;
    std::vector<T> grad(n), param(n + 64, P::store(NAN));
    for (T &g : grad) g = P::store(normal(rng));
    const long long len = offset + n + 64;
    std::vector<float> master(len, NAN), m(len, NAN), v(len, NAN);
    for (long long i = 0; i < n; ++i) {
        master[offset + i] = normal(rng);
        m[offset + i] = 0.1f * normal(rng);
        v[offset + i] = 0.01f * std::fabs(normal(rng));
    }
    const std::vector<float> master0 = master, m0 = m, v0 = v;
    const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
    const int t = 3;
    const AdamWRates r{(float)lr * (float)wd,
                       (float)b1,
                       (float)b2,
                       (float)(lr / (1.0 - std::pow(b1, t))),
                       (float)std::sqrt(1.0 - std::pow(b2, t)),
                       (float)eps};
    const float s = scale;
    emu::launch({blocks, 1, 1}, 256, [&] {
        kernel(with_grad ? grad.data() : nullptr, param.data(), master.data() + offset,
               m.data() + offset, v.data() + offset, n, scale == 1.0f ? nullptr : &s, r);
    });
    double worst = 0;
    bool rounded = true, untouched = true;
    for (long long i = 0; i < n; ++i) {
        const long long k = offset + i;
        const double g = with_grad ? P::load(grad[i]) / (double)scale : 0.0;
        double w = master0[k];
        w -= lr * wd * w;
        const double mt = b1 * m0[k] + (1.0 - b1) * g;
        const double vt = b2 * v0[k] + (1.0 - b2) * g * g;
        w -= lr / (1.0 - std::pow(b1, t)) * mt / (std::sqrt(vt) / std::sqrt(1.0 - std::pow(b2, t)) + eps);
        const double got[3] = {master[k], m[k], v[k]}, want[3] = {w, mt, vt};
        for (int j = 0; j < 3; ++j) {
            const double d = std::fabs(got[j] - want[j]);
            worst = std::max(worst, std::isnan(d) ? INFINITY : d / (std::fabs(want[j]) + 1e-2));
        }
        rounded &= P::load(param[i]) == P::load(P::store(master[k]));
    }
    for (long long k = offset + n; k < len; ++k) {
        untouched &= std::isnan(master[k]) && std::isnan(m[k]) && std::isnan(v[k]);
    }
    for (long long i = n; i < n + 64; ++i) {
        untouched &= std::isnan(P::load(param[i]));
    }
    const bool ok = worst <= 1e-5 && rounded && untouched;
    std::printf("%s %s: worst %.2e relative%s%s\n", ok ? "ok" : "FAILED", name, worst,
                rounded ? "" : ", a parameter is not its master weight rounded",
                untouched ? "" : ", wrote past the end");
    return ok;
}

// rms_norm_backward over `rows` dense rows of `width`, launched as fused_rms_norm.rs's
// rms_backward_launch does on a device of `sms` multiprocessors (so that small cases loop over
// their rows in several rounds). The reference in double: rstd = 1 / sqrt(mean(x^2) + eps),
// dx = rstd (g w - x_hat mean(g w x_hat)) (plus the residual stream's gradient r, with
// `residual`) rounded to the storage type, and the weight's gradient sum(g x_hat) over the rows
// (the kernel's float32 partial sums, added here), within `rel` of the sum of |g x_hat|.
template <class P>
static bool run_rms_backward(const char *name,
                             void (*kernel)(const typename P::T *, const typename P::T *,
                                            const typename P::T *, const typename P::T *,
                                            typename P::T *, float *, long long, int, float, int),
                             long long rows, int width, int sms, double rel, double exact,
                             bool residual = false) {
    typedef typename P::T T;
    const int vec = 16 / sizeof(T), vectors = width / vec;
    int threads, row_threads;
    if (vectors <= 32) {
        threads = 256;
        row_threads = 1;
        while (row_threads < vectors) {
            row_threads *= 2;
        }
    } else {
        threads = row_threads = ((vectors + 3) / 4 + 31) / 32 * 32;
    }
    const int groups = threads / row_threads;
    const long long blocks =
        std::max(1LL, std::min((rows + groups - 1) / groups, (long long)sms * std::max(1, 1024 / threads)));
    std::mt19937 rng(29 + rows + width);
    std::normal_distribution<float> normal;
    const long long n = rows * width;
    std::vector<T> x(n), g(n), w(width), r(n);
    for (long long i = 0; i < n; ++i) {
        x[i] = P::store(2.0f * normal(rng));
        g[i] = P::store(normal(rng));
        r[i] = P::store(0.5f * normal(rng));
    }
    for (int j = 0; j < width; ++j) {
        w[j] = P::store(1.0f + 0.3f * normal(rng));
    }
    const float eps = 1e-6f;
    std::vector<T> dx(n + 64, P::store(NAN));
    std::vector<float> part(blocks * groups * width, NAN);
    emu::launch({(unsigned)blocks, 1, 1}, threads, [&] {
        kernel(x.data(), w.data(), g.data(), residual ? r.data() : nullptr, dx.data(), part.data(),
               rows, width, eps, row_threads);
    });
    std::vector<double> want(n), dw(width, 0.0), dw_abs(width, 0.0);
    for (long long row = 0; row < rows; ++row) {
        const T *xr = x.data() + row * width, *gr = g.data() + row * width;
        const double rstd = row_rstd_reference<P>(xr, width, eps);
        double mean = 0;
        for (int j = 0; j < width; ++j) {
            mean += P::load(gr[j]) * P::load(w[j]) * P::load(xr[j]) * rstd;
        }
        mean /= width;
        for (int j = 0; j < width; ++j) {
            const double xh = P::load(xr[j]) * rstd, gj = P::load(gr[j]);
            const double res = residual ? P::load(r[row * width + j]) : 0.0;
            want[row * width + j] = round_to<P>(rstd * (gj * P::load(w[j]) - xh * mean) + res);
            dw[j] += gj * xh;
            dw_abs[j] += std::fabs(gj * xh);
        }
    }
    bool ok = compare<P>(name, dx, want, rel, exact);
    double worst = 0;
    for (int j = 0; j < width; ++j) {
        double got = 0;
        for (long long p = 0; p < blocks * groups; ++p) {
            got += part[p * width + j];
        }
        worst = std::max(worst, std::fabs(got - dw[j]) / (dw_abs[j] + 1e-12));
    }
    const bool dw_ok = worst <= 1e-5;
    std::printf("%s %s, weight's gradient: worst %.2e of the sum of |terms|\n",
                dw_ok ? "ok" : "FAILED", name, worst);
    return ok && dw_ok;
}

// cross_entropy_grad over `rows` rows of `vocab` logits, a block of 512 threads per row as
// fused.rs launches it (in place: the logits become their gradient); at least 4 rows. Rows 0
// and 1 hold their largest value twice in one vector (at 100 and 101): row 0's label is the
// second (not the first argmax: 0 correct), row 1's the first (1 correct); row 3 holds it at 100
// and at vocab - 7 (other threads), its label the second (0 correct); row 2's label is ignored
// (-100: loss and gradient 0); the others' labels are random. The reference in double: loss = lse - x[label],
// the gradient scale * (softmax - onehot) rounded to the storage type.
template <class P>
static bool run_cross_entropy(const char *name,
                              void (*kernel)(typename P::T *, long long, const long long *,
                                             const float *, float *, float *),
                              long long rows, long long vocab, double rel, double exact) {
    typedef typename P::T T;
    std::mt19937 rng(31 + vocab);
    std::normal_distribution<float> normal;
    std::vector<T> x(rows * vocab + 64, P::store(NAN));
    std::vector<long long> labels(rows);
    std::vector<float> scale(rows);
    for (long long r = 0; r < rows; ++r) {
        for (long long j = 0; j < vocab; ++j) {
            x[r * vocab + j] = P::store(3.0f * normal(rng));
        }
        labels[r] = (long long)(rng() % vocab);
        scale[r] = 0.5f + (float)r;
    }
    for (long long r = 0; r < 2; ++r) {
        x[r * vocab + 100] = x[r * vocab + 101] = P::store(20.0f);
    }
    x[3 * vocab + 100] = x[3 * vocab + vocab - 7] = P::store(20.0f);
    labels[0] = 101;
    labels[1] = 100;
    labels[2] = -100;
    labels[3] = vocab - 7;
    const std::vector<T> logits(x.begin(), x.begin() + rows * vocab);
    std::vector<float> loss(rows, NAN), correct(rows, NAN);
    emu::launch({(unsigned)rows, 1, 1}, 512, [&] {
        kernel(x.data(), vocab, labels.data(), scale.data(), loss.data(), correct.data());
    });
    std::vector<double> want(rows * vocab);
    bool metrics_ok = true;
    double worst_loss = 0;
    for (long long r = 0; r < rows; ++r) {
        const T *row = logits.data() + r * vocab;
        double m = -INFINITY;
        long long first = 0;
        for (long long j = 0; j < vocab; ++j) {
            if (P::load(row[j]) > m) {
                m = P::load(row[j]);
                first = j;
            }
        }
        double sum = 0;
        for (long long j = 0; j < vocab; ++j) {
            sum += std::exp(P::load(row[j]) - m);
        }
        const double lse = m + std::log(sum);
        const long long label = labels[r];
        const bool counted = label >= 0 && label < vocab;
        const double want_loss = counted ? lse - P::load(row[label]) : 0.0;
        worst_loss = std::max(worst_loss, std::fabs(loss[r] - want_loss) / (std::fabs(want_loss) + 1e-6));
        metrics_ok &= correct[r] == (counted && first == label ? 1.0f : 0.0f);
        for (long long j = 0; j < vocab; ++j) {
            const double p = std::exp(P::load(row[j]) - lse);
            want[r * vocab + j] =
                counted ? round_to<P>(scale[r] * (p - (j == label ? 1.0 : 0.0))) : 0.0;
        }
    }
    metrics_ok &= correct[0] == 0.0f && correct[1] == 1.0f && loss[2] == 0.0f && correct[3] == 0.0f;
    const bool loss_ok = worst_loss <= 1e-5;
    std::printf("%s %s: loss worst %.2e relative, argmax checks %s\n",
                loss_ok && metrics_ok ? "ok" : "FAILED", name, worst_loss,
                metrics_ok ? "right" : "WRONG");
    char label[200];
    std::snprintf(label, sizeof label, "%s, gradient", name);
    return compare<P>(label, x, want, rel, exact) && loss_ok && metrics_ok;
}

int main() {
    emu::deadline(120);
    bool ok = true;
    const double bf16_rel = 1e-2, bf16_exact = 0.995, f32_rel = 1e-5;
    // the residual stream [2, 3, 5120], dense: a block per row, 16-byte vectors
    ok &= run_scaled<Bf16>("scaled bf16: 6 dense rows of 5120", scaled_rms_norm_bf16,
                           rows_of(6, 3, 5120, 3 * 5120), 6, 5120, bf16_rel, bf16_exact);
    ok &= run_scaled<F32>("scaled f32: 6 dense rows of 5120", scaled_rms_norm_f32,
                          rows_of(6, 3, 5120, 3 * 5120), 6, 5120, f32_rel, 0.0);
    // rows 5123 apart: every other row misaligned, read element by element
    ok &= run_scaled<Bf16>("scaled bf16: 4 rows of 5120, 5123 apart", scaled_rms_norm_bf16,
                           rows_of(4, 4, 5123, 4 * 5123), 4, 5120, bf16_rel, bf16_exact);
    // q_norm of gated attention: per token [q | gate] of 4 heads of 256, q read in place
    // (heads 512 apart, tokens 4 * 512 + 2 * 256 apart): 3 tokens, a warp per row
    ok &= run_scaled<Bf16>("scaled bf16: q heads of 256 in a projection", scaled_rms_norm_bf16,
                           rows_of(12, 4, 512, 4 * 512 + 512), 12, 256, bf16_rel, bf16_exact);
    ok &= run_scaled<F32>("scaled f32: 11 rows of 128, a partial block", scaled_rms_norm_f32,
                          rows_of(11, 11, 128, 11 * 128), 11, 128, f32_rel, 0.0);
    ok &= run_scaled<F32>("scaled f32: 9 rows of 100, some misaligned", scaled_rms_norm_f32,
                          rows_of(9, 3, 100, 301), 9, 100, f32_rel, 0.0);
    // the Gated DeltaNet's output [B 2, T 3, Hv 3, dv 128] dense; z a view of the projection
    // (heads dv apart, tokens a projection's width apart: 1000 aligns its rows, 1001 only every
    // other one's)
    ok &= run_gated<Bf16>("gated bf16: 18 rows of 128, z in a projection of 1000",
                          gated_rms_norm_bf16, rows_of(18, 3, 128, 3 * 128),
                          rows_of(18, 3, 128, 1000), 18, 128, bf16_rel, bf16_exact);
    ok &= run_gated<Bf16>("gated bf16: 18 rows of 128, z in a projection of 1001",
                          gated_rms_norm_bf16, rows_of(18, 3, 128, 3 * 128),
                          rows_of(18, 3, 128, 1001), 18, 128, bf16_rel, bf16_exact);
    ok &= run_gated<F32>("gated f32: 10 rows of 256, x and z strided", gated_rms_norm_f32,
                         rows_of(10, 2, 260, 600), rows_of(10, 2, 256, 1500), 10, 256, f32_rel,
                         0.0);
    ok &= run_gated<Bf16>("gated bf16: 3 rows of 5120 (a block per row)", gated_rms_norm_bf16,
                          rows_of(3, 3, 5120, 3 * 5120), rows_of(3, 3, 5128, 3 * 5128), 3, 5120,
                          bf16_rel, bf16_exact);
    // SwiGLU's product: rows of 300 (one element at a time), of 2,056 (vectors, two blocks a
    // row, the second partial), of 64
    ok &= run_silu_mul<Bf16>("silu_mul bf16: 5 rows of 300", silu_mul_bf16, 5, 300, bf16_rel,
                             bf16_exact);
    ok &= run_silu_mul<Bf16>("silu_mul bf16: 3 rows of 2056", silu_mul_bf16, 3, 2056, bf16_rel,
                             bf16_exact);
    ok &= run_silu_mul<F32>("silu_mul f32: 3 rows of 64", silu_mul_f32, 3, 64, f32_rel, 0.0);
    // the Gated DeltaNet's gates: 32 value heads of 300 tokens in a projection of 12,352
    // columns (the 35B-A3B shape's a and b), 48 heads of 7 tokens dense (rows of a and b
    // back to back), f32
    ok &= run_gdn_gates<Bf16>("gdn_gates bf16: 300 tokens x 32 heads", gdn_gates_bf16, 300, 32,
                              12352, bf16_rel, bf16_exact);
    ok &= run_gdn_gates<F32>("gdn_gates f32: 7 tokens x 48 heads", gdn_gates_f32, 7, 48, 96,
                             f32_rel, 0.0);
    // a mixture of experts' combination: 8 choices of 2,048 (16-byte vectors), 3 of 100 (one
    // element at a time), 8 of 1,028 (vectors of 4 floats). The float32 sums of terms of either
    // sign cancel in places (1e-3 off relative to a small sum; a wrong row or weight is O(1))
    const double sum_rel = 1e-3;
    ok &= run_moe_combine<Bf16>("moe_combine bf16: 5 tokens x 8 choices of 2048", moe_combine_bf16,
                                5, 8, 2048, false, false, bf16_rel, bf16_exact);
    ok &= run_moe_combine<F32>("moe_combine f32: 4 tokens x 3 choices of 100", moe_combine_f32, 4,
                               3, 100, false, false, sum_rel, 0.0);
    ok &= run_moe_combine<F32>("moe_combine f32: 3 tokens x 8 choices of 1028", moe_combine_f32,
                               3, 8, 1028, false, false, sum_rel, 0.0);
    // ... with a shared expert and into a residual; into a residual only
    ok &= run_moe_combine<Bf16>("moe_combine bf16: 5 x 8 of 2048, shared expert, residual",
                                moe_combine_bf16, 5, 8, 2048, true, true, bf16_rel, bf16_exact);
    ok &= run_moe_combine<Bf16>("moe_combine bf16: 3 x 3 of 100, residual", moe_combine_bf16, 3,
                                3, 100, false, true, bf16_rel, bf16_exact);
    ok &= run_moe_combine<F32>("moe_combine f32: 4 x 8 of 1028, shared expert, residual",
                               moe_combine_f32, 4, 8, 1028, true, true, sum_rel, 0.0);
    // the router: 256 and 128 experts of 8 choices, 6 experts of 2 (a partial warp), 1000 of
    // 10, 300 of 32 (every slot of the sort), 40 of 31; tokens not a multiple of a block's 8
    ok &= run_moe_topk("moe_topk: 19 tokens, 256 experts, top 8, 6 levels", 19, 256, 8, 6);
    ok &= run_moe_topk("moe_topk: 13 tokens, 128 experts, top 8, 40 levels", 13, 128, 8, 40);
    ok &= run_moe_topk("moe_topk: 9 tokens, 6 experts, top 2, 2 levels", 9, 6, 2, 2);
    ok &= run_moe_topk("moe_topk: 5 tokens, 1000 experts, top 10, 12 levels", 5, 1000, 10, 12);
    ok &= run_moe_topk("moe_topk: 6 tokens, 300 experts, top 32, 3 levels", 6, 300, 32, 3);
    ok &= run_moe_topk("moe_topk: 4 tokens, 40 experts, top 31", 4, 40, 31, 2);
    // ... with the routing weights: normalised bf16 (8 of 256), normalised f32 (10 of 1000:
    // two values a lane in the sum), as they are in bf16 (2 of 6)
    ok &= run_moe_topk("moe_topk weights: 19 tokens, 256 experts, top 8, normalised, bf16", 19,
                       256, 8, 6, 1, 0);
    ok &= run_moe_topk("moe_topk weights: 5 tokens, 1000 experts, top 10, normalised, f32", 5,
                       1000, 10, 12, 1, 2);
    ok &= run_moe_topk("moe_topk weights: 9 tokens, 6 experts, top 2, bf16", 9, 6, 2, 2, 0, 0);
    // the rotary embedding: head_dim 128 (two rows a block) forward and inverse, bf16 and f32;
    // 96 (a block of one row: 256 % 96 != 0)
    ok &= run_rotary<Bf16>("rotary bf16: 7 positions x 3 heads of 128, vectors", rotary_bf16, 7,
                           3, 128, 0, 8, 1.0 / 256);
    ok &= run_rotary<Bf16>("rotary bf16 inverse: 5 x 4 of 128, vectors", rotary_bf16, 5, 4,
                           128, 1, 8, 1.0 / 256);
    ok &= run_rotary<Bf16>("rotary bf16: 5 x 4 of 128, elements", rotary_bf16, 5, 4, 128, 0, 1,
                           1.0 / 256);
    ok &= run_rotary<F32>("rotary f32 inverse: 3 x 2 of 96, elements", rotary_f32, 3, 2, 96, 1,
                          1, 1e-6);
    ok &= run_rotary<F32>("rotary f32 inverse: 3 x 2 of 96, vectors", rotary_f32, 3, 2, 96, 1,
                          4, 1e-6);
    // the q/k norms, rotation and cache writes after a fused projection: heads of 128 (a warp
    // a head, two pairs a lane; 3 layers x 7 heads, the last block partial), of 256 with no
    // norms (four pairs a lane), f32 heads of 64 (one pair a lane), bf16 heads of 96 (a block a
    // head: 48 pairs). (The rotation's float32 sum cancels in places: 1e-3 relative to a small
    // result; a wrong partner, angle or norm is O(1) off.)
    ok &= run_rotate_write<Bf16>("rotate_write bf16: 5 tokens, 3 layers, 4 + 2 x 1 heads of 128",
                                 rotate_write_bf16, 5, 3, 4, 1, 128, true, bf16_rel, 0.99);
    ok &= run_rotate_write<Bf16>("rotate_write bf16: 3 tokens, 1 layer, 2 + 2 x 2 heads of 256, no norms",
                                 rotate_write_bf16, 3, 1, 2, 2, 256, false, bf16_rel, 0.99);
    ok &= run_rotate_write<F32>("rotate_write f32: 4 tokens, 2 layers, 3 + 2 x 1 heads of 64",
                                rotate_write_f32, 4, 2, 3, 1, 64, true, 1e-3, 0.0);
    ok &= run_rotate_write<Bf16>("rotate_write bf16: 3 tokens, 2 layers, 2 + 2 x 1 heads of 96",
                                 rotate_write_bf16, 3, 2, 2, 1, 96, true, bf16_rel, 0.99);
    // the block attention's own-block part and merge, forward and backward: bf16 heads of 16
    // (16-byte vectors), 3 entries of 3 blocks of 4 rows, 4 query heads over 2; f32 heads of 6
    // (element by element), blocks of 5 rows, 3 heads over 1. Errors relative to |value| plus
    // the values' mean magnitude (sums that cancel); a wrong row, head or share is O(1) off.
    ok &= run_block_attention<Bf16>("block_attention bf16: 3 x 3 blocks of 4, 4/2 heads of 16",
                                    3, 3, 4, 4, 2, 16, 9, 1e-2);
    // the warp-cooperative form: bf16 heads of 128 (16 lanes a row), 2 x 2 blocks of 16 rows,
    // 4 heads over 2 (32 rows a block: rounds of 8 rows); heads of 64 (8 lanes a row, two keys
    // a lane), blocks of 5 rows (keys past the block masked), 3 heads over 1 (15 rows: the last
    // round partial)
    ok &= run_block_attention<Bf16>("block_attention bf16: 2 x 2 blocks of 16, 4/2 heads of 128",
                                    2, 2, 16, 4, 2, 128, 20, 1e-2);
    ok &= run_block_attention<Bf16>("block_attention bf16: 2 x 3 blocks of 5, 3/1 heads of 64", 2,
                                    3, 5, 3, 1, 64, 12, 1e-2);
    ok &= run_block_attention<F32>("block_attention f32: 2 x 2 blocks of 5, 3/1 heads of 6", 2,
                                   2, 5, 3, 1, 6, 7, 1e-5);
    // the tensor-core form (blocks of 16, bf16): 4 heads over 2 of 128 (four warps a block, the
    // column tiles of the keys' gradients two a warp); 3 heads over 1 of 64 (8 tiles over 3
    // warps); 2 heads over 2 of 32 (one warp, one column chunk). Its products read the
    // probabilities and score gradients rounded to bf16, as flash attention's do (the context
    // part's cuDNN kernels too): up to about 1.2e-2 here where the forms above are within 7e-3;
    // a wrong row, head, key or column is O(1) off.
    ok &= run_block_attention<Bf16>("block_attention mma bf16: 2 x 2 blocks of 16, 4/2 heads of 128",
                                    2, 2, 16, 4, 2, 128, 20, 2e-2, true);
    ok &= run_block_attention<Bf16>("block_attention mma bf16: 2 x 3 blocks of 16, 3/1 heads of 64",
                                    2, 3, 16, 3, 1, 64, 40, 2e-2, true);
    ok &= run_block_attention<Bf16>("block_attention mma bf16: 3 x 1 blocks of 16, 2/2 heads of 32",
                                    3, 1, 16, 2, 2, 32, 9, 2e-2, true);
    // SwiGLU's node: forward and backward, 3 blocks of 256 threads looping over 2000 elements
    ok &= run_swiglu<Bf16>("swiglu bf16: 2000 (vectors)", swiglu_bf16, 2000, bf16_rel, bf16_exact);
    ok &= run_swiglu<Bf16>("swiglu bf16: 1999 (elements)", swiglu_bf16, 1999, bf16_rel,
                           bf16_exact);
    // (silu's derivative 1 + g (1 - sigmoid(g)) cancels near g = -1.28: float32 keeps 1e-4)
    ok &= run_swiglu<F32>("swiglu f32: 2000", swiglu_f32, 2000, 1e-4, 0.0);
    // grouping: three chunks (the last partial), 256 experts of 8; one chunk of 64, 128 of 8
    ok &= run_moe_group("moe_group: 150 tokens, 256 experts, 8 choices", 150, 256, 8);
    ok &= run_moe_group("moe_group: 64 tokens, 128 experts, 8 choices", 64, 128, 8);
    ok &= run_moe_group("moe_group: 70 tokens, 1000 experts, 3 choices", 70, 1000, 3);
    // a gated attention layer's queries and keys: the 35B-A3B shape's heads of 256 (a quarter
    // rotated; 16-byte vectors for the norm), angles per position shared by 2 rows; f32 heads
    // of 98 (read element by element) fully rotated, angles per token
    ok &= run_gated_prep<Bf16>("gated_attention_prep bf16: 6 tokens, 4 + 2 heads of 256, rot 64",
                               gated_attention_prep_bf16, 6, 4, 2, 256, 64, 3, bf16_rel, 0.98);
    // (the rotation's sum cancels in places: 1e-3 relative to a small result; a wrong partner,
    // sign or angle row is O(1) off)
    ok &= run_gated_prep<F32>("gated_attention_prep f32: 5 tokens, 3 + 1 heads of 98, rot 98",
                              gated_attention_prep_f32, 5, 3, 1, 98, 98, 5, 1e-3, 0.0);
    // its output gate: vectors (bf16 heads of 256), elements (f32 heads of 98), 3 blocks
    ok &= run_gate_mul<Bf16>("sigmoid_gate_mul bf16: 6 tokens x 4 heads of 256", sigmoid_gate_mul_bf16,
                             6, 4, 2, 256, 3, bf16_rel, bf16_exact);
    ok &= run_gate_mul<F32>("sigmoid_gate_mul f32: 5 tokens x 3 heads of 98", sigmoid_gate_mul_f32,
                            5, 3, 1, 98, 3, 1e-5, 0.0);
    // the optimizer step: bf16 parameters by vectors of 8 (3 blocks looping over 10,000), with
    // the clip's scale; without a gradient; float32 state misaligned (element by element); f32
    // parameters by vectors of 4; a count that is no multiple of a vector
    ok &= run_adamw<Bf16>("adamw_step bf16: 10000, scaled", adamw_step_bf16, 10000, 0, true,
                          2.5f, 3);
    ok &= run_adamw<Bf16>("adamw_step bf16: 4096, no gradient", adamw_step_bf16, 4096, 0, false,
                          1.0f, 2);
    ok &= run_adamw<Bf16>("adamw_step bf16: 1000, state misaligned", adamw_step_bf16, 1000, 1,
                          true, 1.0f, 2);
    ok &= run_adamw<F32>("adamw_step f32: 4000", adamw_step_f32, 4000, 0, true, 1.0f, 2);
    ok &= run_adamw<F32>("adamw_step f32: 1001", adamw_step_f32, 1001, 0, true, 3.0f, 1);
    // RMSNorm's backward pass: heads of 128 (16 lanes a row, 16 rows a block; two rounds, the
    // second partial), rows of 4096 (a block of 128 threads, four vectors each; two rounds),
    // of 5120 (160 threads), f32 rows of 256 (a warp), bf16 rows of 8 (a lane a row)
    ok &= run_rms_backward<Bf16>("rms_norm_backward bf16: 100 rows of 128", rms_norm_backward_bf16,
                                 100, 128, 1, bf16_rel, bf16_exact);
    ok &= run_rms_backward<Bf16>("rms_norm_backward bf16: 10 rows of 4096", rms_norm_backward_bf16,
                                 10, 4096, 1, bf16_rel, bf16_exact);
    ok &= run_rms_backward<Bf16>("rms_norm_backward bf16: 3 rows of 5120", rms_norm_backward_bf16,
                                 3, 5120, 2, bf16_rel, bf16_exact);
    // (dx is a difference that cancels in places: 1e-4 relative to a small result; a wrong
    // row, column or sum is O(1) off)
    ok &= run_rms_backward<F32>("rms_norm_backward f32: 7 rows of 256", rms_norm_backward_f32, 7,
                                256, 1, 1e-4, 0.0);
    ok &= run_rms_backward<Bf16>("rms_norm_backward bf16: 300 rows of 8", rms_norm_backward_bf16,
                                 300, 8, 1, bf16_rel, bf16_exact);
    // with the residual stream's gradient added (add_rms_norm's backward pass)
    ok &= run_rms_backward<Bf16>("rms_norm_backward bf16 + residual: 10 rows of 4096",
                                 rms_norm_backward_bf16, 10, 4096, 1, bf16_rel, bf16_exact, true);
    ok &= run_rms_backward<F32>("rms_norm_backward f32 + residual: 7 rows of 256",
                                rms_norm_backward_f32, 7, 256, 1, 1e-4, 0.0, true);
    // the residual sum and its norm: rows of 4096 (a block a row, 16-byte vectors), bf16 rows
    // of 128 (a warp a row, a partial block) and misaligned ones (element by element), f32
    ok &= run_add_norm<Bf16>("add_rms_norm bf16: 5 rows of 4096", add_rms_norm_bf16, 5, 4096, 0,
                             bf16_rel, bf16_exact);
    ok &= run_add_norm<Bf16>("add_rms_norm bf16: 11 rows of 128", add_rms_norm_bf16, 11, 128, 0,
                             bf16_rel, bf16_exact);
    ok &= run_add_norm<Bf16>("add_rms_norm bf16: 11 rows of 128, misaligned", add_rms_norm_bf16,
                             11, 128, 1, bf16_rel, bf16_exact);
    ok &= run_add_norm<F32>("add_rms_norm f32: 3 rows of 5120", add_rms_norm_f32, 3, 5120, 0,
                            1e-5, 0.0);
    // the LM head's cross-entropy: bf16 rows of 40,000 (16-byte vectors, several rounds of
    // four per thread, the last partial), f32 rows of 4,100, bf16 rows of 1,001 (element by
    // element)
    ok &= run_cross_entropy<Bf16>("cross_entropy_grad bf16: 5 rows of 40000",
                                  cross_entropy_grad_bf16, 5, 40000, bf16_rel, 0.99);
    ok &= run_cross_entropy<F32>("cross_entropy_grad f32: 4 rows of 4100", cross_entropy_grad_f32,
                                 4, 4100, 1e-4, 0.0);
    ok &= run_cross_entropy<Bf16>("cross_entropy_grad bf16: 4 rows of 1001",
                                  cross_entropy_grad_bf16, 4, 1001, bf16_rel, 0.99);
    return ok ? 0 : 1;
}
