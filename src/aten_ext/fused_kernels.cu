// Fused kernels for the drafter's decoding steps and its training loss, and the target's norms,
// compiled at run time by NVRTC (src/aten_ext/nvrtc.rs; the Rust side is src/aten_ext/fused.rs
// and fused_norms.rs). A drafter step of a
// small model is ~110 kernels of 1-4 us each: its cost is their number. The fusions:
//
// rotate_write: after the fused q/k/v projection, the per-head q/k RMS norm (normalised, then
//   times the weight), the rotary embedding (x * cos + rotate_half(x) * sin) of queries and
//   keys, and the writes of keys and values to their cache rows: one kernel where libtorch runs
//   seven (norm, weight product, cos product, roll, addcmul, two index_copy).
// silu_mul: SwiGLU's silu(gate) * up over the fused [gate | up] product: one kernel for two.
// rotary, swiglu (training): the rotary embedding's and SwiGLU's forward and backward passes as
//   autograd nodes, one kernel a pass.
// cross_entropy_grad (training): the LM head's cross-entropy, argmax check and gradient of a
//   chunk of logits in one kernel, in place, where libtorch runs about seven over the chunk.
// rms_norm_backward (training): RMSNorm's backward pass as an autograd node's (the forward is
//   scaled_rms_norm): the input's gradient and partial sums of the weight's in one pass over
//   the input and the output's gradient, where libtorch's two kernels read both twice;
//   optionally with the residual stream's gradient added in the same pass.
// add_rms_norm (training): a layer's residual sum and the RMSNorm of it in one pass, s = h + a
//   and y = rms_norm(s) * w, where libtorch runs an addition and the norm (and its backward
//   pass then sums the residual's two gradients in a third).
// adamw_step (training): one parameter's AdamW step from its gradient where the backward pass
//   left it (in the storage type), the float32 master weight and moments updated and the new
//   weight rounded into the parameter in the same pass, where libtorch's path copies every
//   gradient into a float32 buffer first and the master weights into the parameters after.
// block_attention_fwd / _bwd (training): each anchor block's attention over its own keys and
//   the merge with cuDNN's attention over the context by their log-sum-exp, forward and
//   backward (see the section below), where one masked call per chunk of 32 blocks read every
//   block's keys of the chunk.
//
// For the target's forward (the Qwen3.5 hybrids; a prefill or training forward of thousands of
// tokens, where the cost is the passes over memory):
// scaled_rms_norm: the zero-centred RMSNorm, x.float().rms_norm(scale).to(dtype) with a float32
//   scale (1 + w): one kernel for three (two of them float32 copies of the input). Sum of
//   squares, rstd = rsqrt(mean + eps) and y = x * rstd * scale in float32, one rounding.
// gated_attention_prep: a gated attention layer's q/k norms and partial rotary embedding from
//   the fused projection, dense queries and keys out: one kernel for about a dozen.
// sigmoid_gate_mul: its output gate, attn * sigmoid(gate) with the gate read in place.
// gdn_gates: the Gated DeltaNet's decay and write strength per token and value head from the
//   projection's columns a and b: g = softplus(float(a) + dt_bias) * neg_a in float32 and
//   beta = sigmoid(b) in the storage type, one kernel for five (a float32 copy, the sum, the
//   softplus, the product, the sigmoid), each rounded where those round.
// gated_rms_norm: the Gated DeltaNet's output norm gated by z (transformers'
//   Qwen3_5RMSNormGated): one kernel for about ten. Three roundings, where libtorch's operations
//   round: t1 = round(x * rstd) (rstd over the row in float32, no weight), t2 = round(t1 * w)
//   (the product of two storage-type tensors), out = round(t2 * silu(z)) (t2 and z in float32).
//
// For a mixture of experts' block (Qwen3-MoE, Qwen3.5-MoE; src/model/moe.rs):
// moe_combine: the routed products, sorted by expert, back to their tokens: out[t] = sum over
//   the token's k choices j of round(y[pos[t k + j]] * w[t k + j]), summed in float32 and
//   rounded once; where libtorch scales the products (rounding each), scatters them back to
//   token order (index_copy) and sums the k of each token: three kernels and two passes over
//   the [T k, H] products for one; optionally with Qwen3.5-MoE's gated shared expert added and
//   the result added into the residual in the same pass (four kernels and passes fewer).
// moe_topk: the router's top k of its softmax, chosen and ordered as libtorch's topk does
//   (ties included), one warp per token instead of a block's radix selection and a sort;
//   optionally also the routing weights (normalised to sum 1 as libtorch sums, cast to the
//   hidden type), where libtorch runs a sum, a division and a cast.
// moe_group_count / _offsets / _place: the pairs grouped by expert (a stable counting sort over
//   chunks of 64 tokens): the grouped GEMMs' ends, each pair's row and each row's token, where
//   libtorch needs a radix sort of the ids, a binary search and three index kernels.
//
// Each rounds where the libtorch operations it replaces round (every intermediate in the storage
// type), so that a fused step computes what the unfused one does up to the order of the float
// sums inside a norm. No system headers: storage types are converted by hand (bf16, f16,
// storage_types.cuh) so that NVRTC needs nothing but itself.

#include "storage_types.cuh"

// The sum of `v` over the block's threads (at most 1024), returned to every thread.
static __device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    if (blockDim.x <= 32) {
        return v;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// `y` [n, layers, heads + 2 * kv, d]: each token's projected queries, keys and values, per
// layer. Queries (head < heads) go to `q_out` [n, layers, heads, d]; keys to `k_cache` and values
// to `v_cache` at row `rows[token]` of the layer's cache [rows, kv, d] (layer l's starts
// `layer_stride` elements after layer l - 1's). `q_norm`, `k_norm` [layers, d], or null for no
// norm; `cos`, `sin` [n, d] with the sin's first half negated (rotate_half folded into the sign).
//
// Two launch forms (rotate_write_warps says which; src/aten_ext/fused.rs launches the same):
// - where d / 2 is a multiple of 32 up to 256, a warp per (token, layer, head), four a block
//   (blockIdx.y * 4 + warp = layer * groups + head): lane l holds elements l + 32 j and their
//   partners l + 32 j + d / 2 (j < d / 64), so that each load of the warp reads 32 neighbouring
//   elements and the norm's sum is one warp reduction, without shared memory and a barrier (a
//   prefill of thousands of tokens: the 8B target's 3,072 tokens x 48 heads took 104 us a layer
//   in blocks of two warps on an H100, 89 us in this form);
// - else a block per (token, layer, head) of d / 2 threads rounded up to a whole warp; thread
//   i < d / 2 holds elements i and i + d / 2, the others only join the norm's sum.
static __device__ __forceinline__ bool rotate_write_warps(int d) {
    return (d / 2) % 32 == 0 && d / 2 <= 256;
}

// One head's `e` element pairs (a0[j], a1[j]) = (x[i_j], x[i_j + d / 2]) normed, rotated and
// written to `dst`; element index i_j = first + j * step. `sum` is the head's sum of squares.
template <class P, int MAX>
static __device__ __forceinline__ void rotate_pairs(const float *a0, const float *a1, int e,
                                                    int first, int step, int half, float sum,
                                                    float eps, int d, const typename P::T *norm,
                                                    const typename P::T *c,
                                                    const typename P::T *s, typename P::T *dst) {
    const float inv = norm != nullptr ? rsqrtf(sum / (float)d + eps) : 0.0f;
#pragma unroll
    for (int j = 0; j < MAX; ++j) {
        if (j >= e) {
            break;
        }
        const int i = first + j * step;
        float x0 = a0[j], x1 = a1[j];
        if (norm != nullptr) {
            x0 = P::load(P::store(P::load(P::store(x0 * inv)) * P::load(norm[i])));
            x1 = P::load(P::store(P::load(P::store(x1 * inv)) * P::load(norm[i + half])));
        }
        dst[i] = P::store(fmaf(x1, P::load(s[i]), P::load(P::store(x0 * P::load(c[i])))));
        dst[i + half] =
            P::store(fmaf(x0, P::load(s[i + half]), P::load(P::store(x1 * P::load(c[i + half])))));
    }
}

template <class P>
static __device__ void rotate_write(const typename P::T *__restrict__ y, int layers, int heads,
                                    int kv, int d, const typename P::T *__restrict__ q_norm,
                                    const typename P::T *__restrict__ k_norm, float eps,
                                    const typename P::T *__restrict__ cos,
                                    const typename P::T *__restrict__ sin,
                                    const long long *__restrict__ rows,
                                    typename P::T *__restrict__ q_out,
                                    typename P::T *__restrict__ k_cache,
                                    typename P::T *__restrict__ v_cache, long long layer_stride) {
    typedef typename P::T T;
    const int groups = heads + 2 * kv;
    const long long token = blockIdx.x;
    const bool warps = rotate_write_warps(d);
    const int slot = warps ? (int)(blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32)
                           : (int)blockIdx.y;
    if (slot >= layers * groups) {
        return;
    }
    const int layer = slot / groups, head = slot % groups;
    const int half = d / 2;
    // this thread's element pairs: i = first + j * step, j < e
    const int first = warps ? (int)(threadIdx.x % 32) : (int)threadIdx.x;
    const int step = 32;
    const int e = warps ? half / 32 : (first < half ? 1 : 0);
    const T *src = y + ((token * layers + layer) * groups + head) * (long long)d;
    const long long row = rows[token];
    if (head >= heads + kv) {
        // a value: copied as it is
        T *dst = v_cache + layer * layer_stride + (row * kv + (head - heads - kv)) * d;
        for (int j = 0; j < e; ++j) {
            const int i = first + j * step;
            dst[i] = src[i];
            dst[i + half] = src[i + half];
        }
        return;
    }
    // at most 8 pairs a thread (d <= 512 in the warp form, 1 in the block form): indices
    // known when unrolled, so that the pairs stay in registers
    const int MAX = 8;
    float a0[MAX], a1[MAX];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < MAX; ++j) {
        if (j >= e) {
            break;
        }
        const int i = first + j * step;
        a0[j] = P::load(src[i]);
        a1[j] = P::load(src[i + half]);
        sum += a0[j] * a0[j] + a1[j] * a1[j];
    }
    const T *norm = head < heads ? q_norm : k_norm;
    if (norm != nullptr) {
        if (warps) {
            for (int offset = 16; offset > 0; offset >>= 1) {
                sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            }
        } else {
            sum = block_sum(sum);
        }
        norm += (long long)layer * d;
    }
    T *dst;
    if (head < heads) {
        dst = q_out + ((token * layers + layer) * heads + head) * (long long)d;
    } else {
        dst = k_cache + layer * layer_stride + (row * kv + (head - heads)) * d;
    }
    rotate_pairs<P, MAX>(a0, a1, e, first, step, half, sum, eps, d, norm, cos + token * d,
                         sin + token * d, dst);
}

// The gates of `rows` tokens of `heads` value heads: a and b [rows, heads] with rows
// `row_stride` elements apart (columns of the projection), dt_bias [heads] in the storage
// type, neg_a [heads] float32; g [rows, heads] float32 and beta [rows, heads] dense. As
// libtorch computes them: softplus (beta 1, threshold 20) of the float32 sum
// log1p(exp(x)) unless x > 20, times neg_a; sigmoid 1 / (1 + exp(-b)) in float32, rounded once.
template <class P>
static __device__ void gdn_gates(const typename P::T *__restrict__ a,
                                 const typename P::T *__restrict__ b, long long row_stride,
                                 int heads, long long rows,
                                 const typename P::T *__restrict__ dt_bias,
                                 const float *__restrict__ neg_a, float *__restrict__ g,
                                 typename P::T *__restrict__ beta) {
    const long long n = rows * heads;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const long long r = i / heads;
        const int h = (int)(i - r * heads);
        const float x = P::load(a[r * row_stride + h]) + P::load(dt_bias[h]);
        const float soft = x > 20.0f ? x : log1pf(expf(x));
        g[i] = soft * neg_a[h];
        beta[i] = P::store(1.0f / (1.0f + expf(-P::load(b[r * row_stride + h]))));
    }
}

// Whether `p` can be read as 16-byte vectors.
static __device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ULL) == 0;
}

// N elements (1, or a 16-byte vector of them) at `p`, to float32.
template <class P, int N>
static __device__ __forceinline__ void load_n(const typename P::T *p, float *v) {
    typedef typename P::T T;
    if (N == 1) {
        v[0] = P::load(*p);
        return;
    }
    uint4 u = *reinterpret_cast<const uint4 *>(p);
    const T *e = reinterpret_cast<const T *>(&u);
    for (int t = 0; t < N; ++t) {
        v[t] = P::load(e[t]);
    }
}

// N floats rounded to the storage type, stored at `p` (1, or a 16-byte vector of them).
template <class P, int N>
static __device__ __forceinline__ void store_n(typename P::T *p, const float *v) {
    typedef typename P::T T;
    if (N == 1) {
        *p = P::store(v[0]);
        return;
    }
    uint4 u;
    T *e = reinterpret_cast<T *>(&u);
    for (int t = 0; t < N; ++t) {
        e[t] = P::store(v[t]);
    }
    *reinterpret_cast<uint4 *>(p) = u;
}

// `both` [n, 2 * width] ([gate | up] per row) -> `out` [n, width] = silu(gate) * up, silu
// rounded to the storage type first (as libtorch's two kernels). Rows by blockIdx.y (a stride of
// gridDim.y), columns by the threads of blockIdx.x (16-byte vectors where the width and the
// pointers allow, else one element each): no division per element.
template <class P, int N>
static __device__ __forceinline__ void silu_mul_row(const typename P::T *gate,
                                                    const typename P::T *up, typename P::T *out,
                                                    long long width) {
    const long long step = (long long)gridDim.x * blockDim.x * N;
    for (long long j = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * N; j < width;
         j += step) {
        float g[N], u[N];
        load_n<P, N>(gate + j, g);
        load_n<P, N>(up + j, u);
        for (int t = 0; t < N; ++t) {
            g[t] = P::load(P::store(g[t] / (1.0f + expf(-g[t])))) * u[t];
        }
        store_n<P, N>(out + j, g);
    }
}

template <class P>
static __device__ void silu_mul(const typename P::T *__restrict__ both,
                                typename P::T *__restrict__ out, long long n, long long width) {
    const int VEC = 16 / sizeof(typename P::T);
    const bool vectors = width % VEC == 0 && aligned16(both) && aligned16(out);
    for (long long r = blockIdx.y; r < n; r += gridDim.y) {
        const typename P::T *gate = both + r * 2 * width;
        if (vectors) {
            silu_mul_row<P, VEC>(gate, gate + width, out + r * width, width);
        } else {
            silu_mul_row<P, 1>(gate, gate + width, out + r * width, width);
        }
    }
}

// The rows of the norms: a tensor [outer, inner, width] of contiguous rows, row r at
// (r / inner) * outer_stride + (r % inner) * inner_stride (strided views of a projection need
// no copy). A warp per row (row_threads 32: the block's warps take consecutive rows) or the
// whole block per row (row_threads = blockDim.x), each thread `lane` of the row's `row_threads`.
// Rows are read VEC = 16 / sizeof(T) elements at a time where every row pointer is 16-byte
// aligned and the width divisible by VEC, else one element at a time.
struct RowLayout {
    long long outer_stride, inner_stride, inner;
};

static __device__ __forceinline__ long long row_offset(const RowLayout &l, long long r) {
    return (r / l.inner) * l.outer_stride + (r % l.inner) * l.inner_stride;
}

// The sum of `v` over the row's threads, returned to each of them.
static __device__ __forceinline__ float row_sum(float v, int row_threads) {
    if (row_threads > 32) {
        return block_sum(v);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// This thread's part of the sum of squares of a row, N elements at a time.
template <class P, int N>
static __device__ __forceinline__ float row_squares(const typename P::T *x, int width, int lane,
                                                    int row_threads) {
    float s = 0.0f;
    for (int j = lane * N; j < width; j += row_threads * N) {
        float v[N];
        load_n<P, N>(x + j, v);
        for (int t = 0; t < N; ++t) {
            s += v[t] * v[t];
        }
    }
    return s;
}

// rsqrt(mean(x^2) + eps) of the row at `x`, in float32, to each of the row's threads.
template <class P>
static __device__ __forceinline__ float row_rstd(const typename P::T *x, bool vectors, int width,
                                                 float eps, int lane, int row_threads) {
    const int VEC = 16 / sizeof(typename P::T);
    const float s = vectors ? row_squares<P, VEC>(x, width, lane, row_threads)
                            : row_squares<P, 1>(x, width, lane, row_threads);
    return rsqrtf(row_sum(s, row_threads) / (float)width + eps);
}

template <class P, int N>
static __device__ __forceinline__ void scaled_rms_norm_row(const typename P::T *x,
                                                           const float *__restrict__ scale,
                                                           typename P::T *y, int width,
                                                           float rstd, int lane, int row_threads) {
    for (int j = lane * N; j < width; j += row_threads * N) {
        float v[N];
        load_n<P, N>(x + j, v);
        for (int t = 0; t < N; ++t) {
            v[t] = v[t] * rstd * scale[j + t];
        }
        store_n<P, N>(y + j, v);
    }
}

// The row of this thread in a norm launch of `row_threads` threads per row (a warp, or the
// whole block).
static __device__ __forceinline__ long long norm_row(int row_threads) {
    return (long long)blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
}

// The zero-centred RMSNorm: `x` rows (layout `xl`) of `width` -> dense `y` [rows, width],
// y = x * rsqrt(mean(x^2) + eps) * scale in float32, rounded once (`scale` float32 [width]).
template <class P>
static __device__ void scaled_rms_norm(const typename P::T *__restrict__ x, RowLayout xl,
                                       const float *__restrict__ scale,
                                       typename P::T *__restrict__ y, long long rows, int width,
                                       float eps, int row_threads) {
    typedef typename P::T T;
    const int VEC = 16 / sizeof(T);
    const long long row = norm_row(row_threads);
    const int lane = threadIdx.x % row_threads;
    if (row >= rows) {
        return;   // a whole warp (a block per row has no row past the end)
    }
    const T *xr = x + row_offset(xl, row);
    T *yr = y + row * width;
    const bool vectors = width % VEC == 0 && aligned16(xr) && aligned16(yr);
    const float rstd = row_rstd<P>(xr, vectors, width, eps, lane, row_threads);
    if (vectors) {
        scaled_rms_norm_row<P, VEC>(xr, scale, yr, width, rstd, lane, row_threads);
    } else {
        scaled_rms_norm_row<P, 1>(xr, scale, yr, width, rstd, lane, row_threads);
    }
}

// s = round(h + a) over a row, N elements at a time, into `s`; this thread's part of the sum
// of squares of the rounded sums.
template <class P, int N>
static __device__ __forceinline__ float add_row(const typename P::T *h, const typename P::T *a,
                                                typename P::T *s, int width, int lane,
                                                int row_threads) {
    float squares = 0.0f;
    for (int j = lane * N; j < width; j += row_threads * N) {
        float v[N], b[N];
        load_n<P, N>(h + j, v);
        load_n<P, N>(a + j, b);
        for (int t = 0; t < N; ++t) {
            v[t] = P::load(P::store(v[t] + b[t]));
            squares += v[t] * v[t];
        }
        store_n<P, N>(s + j, v);
    }
    return squares;
}

// The residual sum and its RMSNorm: dense `h`, `a` [rows, width] -> dense `s` = round(h + a)
// and `y` = s * rsqrt(mean(s^2) + eps) * scale in float32, rounded once (`scale` float32
// [width]): libtorch's addition, then its rms_norm. Launched as scaled_rms_norm; each thread
// reads back only the elements of `s` it wrote.
template <class P>
static __device__ void add_rms_norm(const typename P::T *__restrict__ h,
                                    const typename P::T *__restrict__ a,
                                    const float *__restrict__ scale, typename P::T *s,
                                    typename P::T *__restrict__ y, long long rows, int width,
                                    float eps, int row_threads) {
    typedef typename P::T T;
    const int VEC = 16 / sizeof(T);
    const long long row = norm_row(row_threads);
    const int lane = threadIdx.x % row_threads;
    if (row >= rows) {
        return;   // a whole warp (a block per row has no row past the end)
    }
    const T *hr = h + row * width;
    const T *ar = a + row * width;
    T *sr = s + row * width;
    T *yr = y + row * width;
    const bool vectors = width % VEC == 0 && aligned16(hr) && aligned16(ar) && aligned16(sr) &&
                         aligned16(yr);
    const float squares = vectors ? add_row<P, VEC>(hr, ar, sr, width, lane, row_threads)
                                  : add_row<P, 1>(hr, ar, sr, width, lane, row_threads);
    const float rstd = rsqrtf(row_sum(squares, row_threads) / (float)width + eps);
    if (vectors) {
        scaled_rms_norm_row<P, VEC>(sr, scale, yr, width, rstd, lane, row_threads);
    } else {
        scaled_rms_norm_row<P, 1>(sr, scale, yr, width, rstd, lane, row_threads);
    }
}

template <class P, int N>
static __device__ __forceinline__ void gated_rms_norm_row(const typename P::T *x,
                                                          const typename P::T *z,
                                                          const typename P::T *__restrict__ w,
                                                          typename P::T *out, int width,
                                                          float rstd, int lane, int row_threads) {
    for (int j = lane * N; j < width; j += row_threads * N) {
        float v[N], g[N];
        load_n<P, N>(x + j, v);
        load_n<P, N>(z + j, g);
        for (int t = 0; t < N; ++t) {
            const float normed = P::load(P::store(v[t] * rstd));
            const float weighted = P::load(P::store(normed * P::load(w[j + t])));
            v[t] = weighted * (g[t] / (1.0f + expf(-g[t])));
        }
        store_n<P, N>(out + j, v);
    }
}

// The Gated DeltaNet's gated output norm: `x` rows (layout `xl`) and `z` rows (layout `zl`,
// the same rows) of `width` -> dense `out` [rows, width] = round(round(round(x * rstd) * w) *
// silu(z)), rstd = rsqrt(mean(x^2) + eps) in float32, `w` [width] in the storage type.
template <class P>
static __device__ void gated_rms_norm(const typename P::T *__restrict__ x, RowLayout xl,
                                      const typename P::T *__restrict__ z, RowLayout zl,
                                      const typename P::T *__restrict__ w,
                                      typename P::T *__restrict__ out, long long rows, int width,
                                      float eps, int row_threads) {
    typedef typename P::T T;
    const int VEC = 16 / sizeof(T);
    const long long row = norm_row(row_threads);
    const int lane = threadIdx.x % row_threads;
    if (row >= rows) {
        return;
    }
    const T *xr = x + row_offset(xl, row);
    const T *zr = z + row_offset(zl, row);
    T *outr = out + row * width;
    const bool vectors = width % VEC == 0 && aligned16(xr) && aligned16(zr) && aligned16(outr);
    const float rstd = row_rstd<P>(xr, vectors, width, eps, lane, row_threads);
    if (vectors) {
        gated_rms_norm_row<P, VEC>(xr, zr, w, outr, width, rstd, lane, row_threads);
    } else {
        gated_rms_norm_row<P, 1>(xr, zr, w, outr, width, rstd, lane, row_threads);
    }
}

// rms_norm_backward (training): the backward pass of y = x * rstd * w (libtorch's rms_norm:
// rstd = rsqrt(mean(x^2) + eps) over each row in float32, one rounding) over dense rows `x`
// [rows, width] with the output's gradient `g` (dense, the same shape) and `w` [width] of the
// storage type: `dx` = rstd * (g w - x rstd^2 mean(g w x)), in float32, rounded once; and the
// weight's gradient sum over rows of g * (x rstd) in float32, per (block, row group) into
// `dw_part` [gridDim.x * groups, width] (the caller sums it). Where `r` (dense, x's shape) is
// not null, dx also adds it before its rounding: the gradient of a residual stream that x
// continues (add_rms_norm's s). One pass over x and g: each
// thread holds its RMS_BWD_VECTORS 16-byte vectors of the row (columns lane * VEC + k *
// row_threads * VEC) from the sums to the writes, and the weight's gradient of its columns over
// every row it takes. `row_threads`: a power of two up to 32 (rows of a warp's lanes), or the
// whole block (a multiple of 32). Rows must be 16-byte aligned and the width a multiple of VEC
// (the caller checks); the blocks loop over the rows, all of them the same number of rounds.
#define RMS_BWD_VECTORS 4

// The sums of `a` and `b` over the row's threads (`row_threads` as rms_norm_backward's),
// returned to each of them; safe to call again at once (the block's partials are read before
// the next call writes them).
static __device__ __forceinline__ void row_sum2(float &a, float &b, int row_threads) {
    __shared__ float partial_a[32], partial_b[32];
    const int lanes = row_threads < 32 ? row_threads : 32;
    for (int offset = lanes >> 1; offset > 0; offset >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, offset);
        b += __shfl_xor_sync(0xffffffffu, b, offset);
    }
    if (row_threads <= 32) {
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        partial_a[warp] = a;
        partial_b[warp] = b;
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    a = lane < warps ? partial_a[lane] : 0.0f;
    b = lane < warps ? partial_b[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, offset);
        b += __shfl_xor_sync(0xffffffffu, b, offset);
    }
    __syncthreads();
}

template <class P>
static __device__ void rms_norm_backward(const typename P::T *__restrict__ x,
                                         const typename P::T *__restrict__ w,
                                         const typename P::T *__restrict__ g,
                                         const typename P::T *__restrict__ r,
                                         typename P::T *__restrict__ dx,
                                         float *__restrict__ dw_part, long long rows, int width,
                                         float eps, int row_threads) {
    typedef typename P::T T;
    const int VEC = 16 / sizeof(T);
    const int groups = blockDim.x / row_threads;
    const int group = threadIdx.x / row_threads, lane = threadIdx.x % row_threads;
    const int step = row_threads * VEC;
    uint4 wv[RMS_BWD_VECTORS];
    float acc[RMS_BWD_VECTORS][16 / sizeof(T)];
    for (int k = 0; k < RMS_BWD_VECTORS; ++k) {
        const int j = lane * VEC + k * step;
        if (j < width) {
            wv[k] = *reinterpret_cast<const uint4 *>(w + j);
        }
        for (int t = 0; t < VEC; ++t) {
            acc[k][t] = 0.0f;
        }
    }
    const long long round_rows = (long long)gridDim.x * groups;
    for (long long first = (long long)blockIdx.x * groups; first < rows; first += round_rows) {
        const long long row = first + group;
        const bool active = row < rows;
        uint4 xv[RMS_BWD_VECTORS], gv[RMS_BWD_VECTORS];
        float squares = 0.0f, gwx = 0.0f;
        for (int k = 0; k < RMS_BWD_VECTORS; ++k) {
            const int j = lane * VEC + k * step;
            if (active && j < width) {
                xv[k] = *reinterpret_cast<const uint4 *>(x + row * width + j);
                gv[k] = *reinterpret_cast<const uint4 *>(g + row * width + j);
                const T *xe = reinterpret_cast<const T *>(&xv[k]);
                const T *ge = reinterpret_cast<const T *>(&gv[k]);
                const T *we = reinterpret_cast<const T *>(&wv[k]);
                for (int t = 0; t < VEC; ++t) {
                    const float xf = P::load(xe[t]);
                    squares += xf * xf;
                    gwx += P::load(ge[t]) * P::load(we[t]) * xf;
                }
            }
        }
        row_sum2(squares, gwx, row_threads);
        const float rstd = rsqrtf(squares / (float)width + eps);
        // mean(g w x_hat) with x_hat = x rstd
        const float mean_gwxh = gwx * rstd / (float)width;
        for (int k = 0; k < RMS_BWD_VECTORS; ++k) {
            const int j = lane * VEC + k * step;
            if (active && j < width) {
                const T *xe = reinterpret_cast<const T *>(&xv[k]);
                const T *ge = reinterpret_cast<const T *>(&gv[k]);
                const T *we = reinterpret_cast<const T *>(&wv[k]);
                float out[16 / sizeof(T)];
                for (int t = 0; t < VEC; ++t) {
                    const float xh = P::load(xe[t]) * rstd;
                    const float gf = P::load(ge[t]);
                    out[t] = rstd * (gf * P::load(we[t]) - xh * mean_gwxh);
                    acc[k][t] += gf * xh;
                }
                if (r != nullptr) {
                    float res[16 / sizeof(T)];
                    load_n<P, 16 / sizeof(T)>(r + row * width + j, res);
                    for (int t = 0; t < VEC; ++t) {
                        out[t] += res[t];
                    }
                }
                store_n<P, 16 / sizeof(T)>(dx + row * width + j, out);
            }
        }
    }
    float *part = dw_part + ((long long)blockIdx.x * groups + group) * width;
    for (int k = 0; k < RMS_BWD_VECTORS; ++k) {
        const int j = lane * VEC + k * step;
        if (j < width) {
            for (int t = 0; t < VEC; ++t) {
                part[j + t] = acc[k][t];
            }
        }
    }
}

// One thread's (then a block's) view of a row of logits: the running maximum `m` and the sum
// `s` of exp(x - m) (the online softmax), and the first index `bi` of the largest value `bv`.
#define NEG_INF __int_as_float(0xff800000)

struct RowStat {
    float m, s, bv;
    long long bi;
};

// Whether (v, i) comes before (bv, bi) as torch.argmax picks: NaN counts as the largest, and
// of equal values the first index wins.
static __device__ __forceinline__ bool argmax_beats(float v, long long i, float bv, long long bi) {
    if ((v != v)) {
        return !(bv != bv) || i < bi;
    }
    if ((bv != bv)) {
        return false;
    }
    return v > bv || (v == bv && i < bi);
}

static __device__ __forceinline__ void row_take(RowStat &a, float v, long long i) {
    if (argmax_beats(v, i, a.bv, a.bi)) {
        a.bv = v;
        a.bi = i;
    }
    if (v > a.m) {
        a.s = a.s * expf(a.m - v) + 1.0f;
        a.m = v;
    } else if (v != NEG_INF) {
        a.s += expf(v - a.m);
    }
}

// Takes N consecutive elements of one thread `v` (indices i0.., above every index it took
// before) into its RowStat: their first largest against the running argmax, then the online
// softmax rescaled once to their maximum (row_take rescales at every new maximum and compares
// every element with the running argmax: the same numbers up to the order of the float sum, at
// about half the instructions per element).
template <int N>
static __device__ __forceinline__ void row_take_n(RowStat &a, const float *v, long long i0) {
    float vm = v[0];
    int vi = 0;
    for (int t = 1; t < N; ++t) {
        // a later index wins only when larger, or a NaN over a number (torch.argmax's first NaN)
        if (v[t] > vm || (v[t] != v[t] && vm == vm)) {
            vm = v[t];
            vi = t;
        }
    }
    if (argmax_beats(vm, i0 + vi, a.bv, a.bi)) {
        a.bv = vm;
        a.bi = i0 + vi;
    }
    if (vm != vm) {
        a.s = __int_as_float(0x7fffffff);   // a NaN logit: the sum is NaN, as row_take's
        return;
    }
    if (vm > a.m) {
        a.s = a.s * expf(a.m - vm);   // a.m = -inf: s was 0 and stays 0
        a.m = vm;
    }
    if (a.m != NEG_INF) {
        for (int t = 0; t < N; ++t) {
            a.s += expf(v[t] - a.m);
        }
    }
}

static __device__ __forceinline__ void row_merge(RowStat &a, const RowStat &b) {
    if (argmax_beats(b.bv, b.bi, a.bv, a.bi)) {
        a.bv = b.bv;
        a.bi = b.bi;
    }
    const float m = fmaxf(a.m, b.m);
    if (m != NEG_INF) {
        a.s = (a.s == 0.0f ? 0.0f : a.s * expf(a.m - m)) + (b.s == 0.0f ? 0.0f : b.s * expf(b.m - m));
        a.m = m;
    }
}

static __device__ __forceinline__ RowStat row_shfl(const RowStat &a, int offset) {
    RowStat b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, offset);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, offset);
    b.bv = __shfl_xor_sync(0xffffffffu, a.bv, offset);
    b.bi = __shfl_xor_sync(0xffffffffu, a.bi, offset);
    return b;
}

// The block's RowStat, returned to every thread (blockDim.x a multiple of 32, at most 1024).
static __device__ RowStat block_row_stat(RowStat a) {
    __shared__ RowStat partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        row_merge(a, row_shfl(a, offset));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        partial[warp] = a;
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    if (lane < warps) {
        a = partial[lane];
    } else {
        a.m = NEG_INF;
        a.s = 0.0f;
        a.bv = NEG_INF;
        a.bi = 0x7fffffffffffffffLL;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        row_merge(a, row_shfl(a, offset));
    }
    return a;
}

#define CE_UNROLL 4   // 16-byte vectors each thread of cross_entropy_grad loads at once

// This thread's vectors k, k + stride, ... (CE_UNROLL of them, those below `nvec`) of a row
// `xv`, loaded at once.
static __device__ __forceinline__ void load_unrolled(const uint4 *xv, long long k, long long stride,
                                                     long long nvec, uint4 *u) {
    for (int q = 0; q < CE_UNROLL; ++q) {
        if (k + q * stride < nvec) {
            u[q] = xv[k + q * stride];
        }
    }
}

// The training loss of the LM head, one block per row of `logits` [rows, vocab] (dense):
// cross-entropy against `labels` [rows] (int64; outside 0..vocab: ignored, loss and gradient 0),
// computed in float32 as libtorch's log_softmax(dtype=float32) and nll_loss compute it, into
// `loss` [rows]; whether the first argmax is the label into `correct` [rows] (1 or 0); and the
// logits overwritten with the gradient of `scale[row] * loss[row]`: scale * (softmax - onehot),
// rounded once to the storage type, as log_softmax's backward pass computes it. Two passes over
// the row (the second from L2) where libtorch's kernels make about seven over the whole chunk.
template <class P>
static __device__ void cross_entropy_grad(typename P::T *__restrict__ logits, long long vocab,
                                          const long long *__restrict__ labels,
                                          const float *__restrict__ scale,
                                          float *__restrict__ loss, float *__restrict__ correct) {
    typedef typename P::T T;
    const int VEC = 16 / sizeof(T);
    __shared__ float shared_x_label;
    const long long row = blockIdx.x;
    T *x = logits + row * vocab;
    const bool vectors =
        vocab % VEC == 0 && (reinterpret_cast<unsigned long long>(x) & 15ULL) == 0;
    RowStat st;
    st.m = NEG_INF;
    st.s = 0.0f;
    st.bv = NEG_INF;
    st.bi = 0x7fffffffffffffffLL;
    // 16-byte vectors, CE_UNROLL of them loaded at once per thread (the loads in flight)
    const long long nvec = vocab / VEC, stride = blockDim.x;
    if (vectors) {
        const uint4 *xv = reinterpret_cast<const uint4 *>(x);
        for (long long k = threadIdx.x; k < nvec; k += CE_UNROLL * stride) {
            uint4 u[CE_UNROLL];
            load_unrolled(xv, k, stride, nvec, u);
            for (int q = 0; q < CE_UNROLL; ++q) {
                if (k + q * stride < nvec) {
                    const T *e = reinterpret_cast<const T *>(&u[q]);
                    float v[16 / sizeof(T)];
                    for (int t = 0; t < VEC; ++t) {
                        v[t] = P::load(e[t]);
                    }
                    row_take_n<16 / sizeof(T)>(st, v, (k + q * stride) * VEC);
                }
            }
        }
    } else {
        for (long long j = threadIdx.x; j < vocab; j += blockDim.x) {
            row_take(st, P::load(x[j]), j);
        }
    }
    const long long label = labels[row];
    const bool counted = label >= 0 && label < vocab;
    if (threadIdx.x == 0) {
        shared_x_label = counted ? P::load(x[label]) : 0.0f;
    }
    st = block_row_stat(st);
    // log_softmax = (x - max) - log(sum exp(x - max)), in float32
    const float logsum = logf(st.s);
    if (threadIdx.x == 0) {
        loss[row] = counted ? -((shared_x_label - st.m) - logsum) : 0.0f;
        correct[row] = counted && st.bi == label ? 1.0f : 0.0f;
    }
    // d loss / d x = grad_out - exp(log_softmax) * sum(grad_out), grad_out = -scale at the label
    const float g_label = counted ? -scale[row] : 0.0f;
    const float g_sum = g_label;
    if (vectors) {
        uint4 *xv = reinterpret_cast<uint4 *>(x);
        for (long long k = threadIdx.x; k < nvec; k += CE_UNROLL * stride) {
            uint4 u[CE_UNROLL];
            load_unrolled(xv, k, stride, nvec, u);
            for (int q = 0; q < CE_UNROLL; ++q) {
                if (k + q * stride < nvec) {
                    T *e = reinterpret_cast<T *>(&u[q]);
                    const long long first = (k + q * stride) * VEC;
                    for (int t = 0; t < VEC; ++t) {
                        const float lsm = (P::load(e[t]) - st.m) - logsum;
                        const float go = first + t == label ? g_label : 0.0f;
                        e[t] = P::store(go - expf(lsm) * g_sum);
                    }
                    xv[k + q * stride] = u[q];
                }
            }
        }
    } else {
        for (long long j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float lsm = (P::load(x[j]) - st.m) - logsum;
            const float go = j == label ? g_label : 0.0f;
            x[j] = P::store(go - expf(lsm) * g_sum);
        }
    }
}

#define MOE_MAX_TOP_K 32   // choices per token moe_combine takes (Qwen3 / Qwen3.5 MoE: 8 or 10)

// One block per token: the k product rows it reads, then `hidden` columns, 16 bytes per thread
// and step where `vectors` (hidden a multiple of the vector, rows 16-byte aligned), else one.
// With `shared` (a shared expert's output [tokens, hidden]) and `gate` (its gate's logit per
// token [tokens]): the sum, rounded, plus round(round(sigmoid(gate)) * shared), rounded, as
// Qwen3.5-MoE adds its shared expert. With `accumulate`, `out` (the residual stream) gets
// round(out + that) instead of it.
template <class P>
static __device__ void moe_combine(const typename P::T *y, const long long *pos,
                                   const typename P::T *w, const typename P::T *shared,
                                   const typename P::T *gate, typename P::T *out,
                                   long long hidden, int k, int vectors, int accumulate) {
    typedef typename P::T T;
    __shared__ long long rows[MOE_MAX_TOP_K];
    __shared__ float weights[MOE_MAX_TOP_K];
    __shared__ float shared_scale;
    const long long t = blockIdx.x;
    if (threadIdx.x < k) {
        rows[threadIdx.x] = pos[t * k + threadIdx.x];
        weights[threadIdx.x] = P::load(w[t * k + threadIdx.x]);
    }
    if (threadIdx.x == 0 && shared) {
        // libtorch's sigmoid, 1 / (1 + exp(-x)) in float32, rounded to the type
        shared_scale = P::load(P::store(1.0f / (1.0f + expf(-P::load(gate[t])))));
    }
    __syncthreads();
    T *dst = out + t * hidden;
    const T *sh = shared ? shared + t * hidden : nullptr;
    // the block's result for one element from the rounded sum of the routed products
    const auto finish = [&](float sum, long long h) -> T {
        float v = P::load(P::store(sum));
        if (sh) {
            v = P::load(P::store(v + P::load(P::store(shared_scale * P::load(sh[h])))));
        }
        if (accumulate) {
            v = P::load(dst[h]) + v;
        }
        return P::store(v);
    };
    if (vectors) {
        const int VEC = 16 / sizeof(T);
        for (long long c = threadIdx.x; c < hidden / VEC; c += blockDim.x) {
            float acc[16 / sizeof(T)];
            for (int e = 0; e < VEC; ++e) {
                acc[e] = 0.0f;
            }
            for (int j = 0; j < k; ++j) {
                uint4 u = reinterpret_cast<const uint4 *>(y + rows[j] * hidden)[c];
                const T *v = reinterpret_cast<const T *>(&u);
                for (int e = 0; e < VEC; ++e) {
                    acc[e] += P::load(P::store(P::load(v[e]) * weights[j]));
                }
            }
            uint4 r;
            T *o = reinterpret_cast<T *>(&r);
            for (int e = 0; e < VEC; ++e) {
                o[e] = finish(acc[e], c * VEC + e);
            }
            reinterpret_cast<uint4 *>(dst)[c] = r;
        }
    } else {
        for (long long h = threadIdx.x; h < hidden; h += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < k; ++j) {
                acc += P::load(P::store(P::load(y[rows[j] * hidden + h]) * weights[j]));
            }
            dst[h] = finish(acc, h);
        }
    }
}

// The router's choices (moe_topk) and the grouping of the (token, choice) pairs by expert
// (moe_group_count, moe_group_offsets, moe_group_place): what libtorch's topk (a radix selection
// and a bitonic sort, one block per token) and a stable radix sort of the pairs' expert ids, a
// binary search and three index kernels compute, in four small kernels.

#define MOE_MAX_EXPERTS 1024    // experts the routing kernels take
#define MOE_TOPK_MAX_ITEMS 32   // router probabilities per lane (32 x 32 = MOE_MAX_EXPERTS)
#define MOE_TOPK_WARPS 8        // tokens per block of moe_topk (a warp each)
#define MOE_SORT_SLOTS 32       // the bitonic network's width (libtorch's small sort)
#define MOE_GROUP_TOKENS 64     // tokens per block of the grouping kernels (a 64-bit mask)

// The order libtorch's radix selection compares floats in: the bits as an unsigned integer,
// flipped so that the integer order is the float order (NaNs above infinity, -0 below +0).
static __device__ __forceinline__ unsigned radix_key(float v) {
    const unsigned x = __float_as_uint(v);
    return x ^ ((x & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}

// The small sort's "greater" for a descending sort: a NaN before any number, then `>`.
static __device__ __forceinline__ bool greater_nan_first(float a, float b) {
    return (a != a && b == b) || a > b;
}

// `probs` [tokens, experts] float32 (the router's softmax): per token the `k` largest, as
// torch.topk(probs, k, largest=True, sorted=True) on a GPU chooses and orders them, with its
// ties. Its selection keeps every value above the k-th largest and, of those equal to it, the
// first ones by index, written out as [those above, by index; those equal, by index]; its sort
// (k <= 32) is a bitonic network over 32 slots (the k valid ones first), which can swap equal
// values. Both are reproduced: k rounds of a warp's argmax (the largest key, the lowest index
// among equal ones) give the same set, which is laid out in that order and put through the
// same network. One warp per token; `values` [tokens, k] and `indices` [tokens, k] (int64), and
// where `weights` is not null the routing weights [tokens, k] (see the end).
template <int ITEMS>
static __device__ void moe_topk(const float *__restrict__ probs, long long tokens, int experts,
                                int k, float *__restrict__ values,
                                long long *__restrict__ indices, int normalize,
                                int weight_kind, void *__restrict__ weights) {
    __shared__ float slot_value[MOE_TOPK_WARPS][MOE_SORT_SLOTS];
    __shared__ int slot_index[MOE_TOPK_WARPS][MOE_SORT_SLOTS];
    __shared__ int slot_valid[MOE_TOPK_WARPS][MOE_SORT_SLOTS];
    __shared__ unsigned pick_key[MOE_TOPK_WARPS][MOE_SORT_SLOTS];
    __shared__ int pick_index[MOE_TOPK_WARPS][MOE_SORT_SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long t = (long long)blockIdx.x * MOE_TOPK_WARPS + warp;
    if (t >= tokens) {
        return;   // the whole warp: no block-wide barrier below
    }
    const float *row = probs + t * experts;
    unsigned key[ITEMS];
    unsigned taken = 0;   // bit i: this lane's item i (expert lane + 32 i) is chosen
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < experts ? radix_key(row[e]) : 0u;
    }
    // this lane's best remaining item: the largest key, the lowest index among equal ones
    // (0x7fffffff: none left)
    unsigned mine = 0u;
    int mine_index = 0x7fffffff;
    const auto rescan = [&]() {
        mine = 0u;
        mine_index = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int e = lane + 32 * i;
            if (e < experts && !((taken >> i) & 1u) &&
                (key[i] > mine || (key[i] == mine && e < mine_index))) {
                mine = key[i];
                mine_index = e;
            }
        }
    };
    rescan();
    for (int r = 0; r < k; ++r) {
        // the warp's best of the lanes' bests; only its lane has to look again
        unsigned best = mine;
        int best_index = mine_index;
        for (int offset = 16; offset > 0; offset >>= 1) {
            const unsigned other = __shfl_xor_sync(0xffffffffu, best, offset);
            const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
            if (other > best || (other == best && other_index < best_index)) {
                best = other;
                best_index = other_index;
            }
        }
        if (best_index == mine_index) {
            taken |= 1u << (best_index >> 5);
            rescan();
        }
        if (lane == 0) {
            pick_key[warp][r] = best;
            pick_index[warp][r] = best_index;
        }
    }
    __syncwarp();
    // the selection's output order: those above the k-th key by index, then those equal by index
    if (lane < k) {
        const unsigned kth = pick_key[warp][k - 1];
        const int mine = pick_index[warp][lane];
        const int group = pick_key[warp][lane] > kth ? 0 : 1;
        int at = 0;
        for (int j = 0; j < k; ++j) {
            const int other = pick_index[warp][j];
            const int other_group = pick_key[warp][j] > kth ? 0 : 1;
            at += other_group < group || (other_group == group && other < mine);
        }
        slot_value[warp][at] = row[mine];
        slot_index[warp][at] = mine;
        slot_valid[warp][at] = 1;
    } else {
        slot_value[warp][lane] = 0.0f;
        slot_index[warp][lane] = 0;
        slot_valid[warp][lane] = 0;
    }
    // the bitonic network over 32 slots, 16 lanes a step (each a pair of slots); a swap where
    // `(a > b && a valid) || !b valid` equals the step's direction: invalid slots sink to the
    // end, equal values may change places
    float *sv = slot_value[warp];
    int *si = slot_index[warp];
    int *sok = slot_valid[warp];
    const auto step = [&](int stride, bool dir) {
        __syncwarp();
        if (lane < MOE_SORT_SLOTS / 2) {
            const int a = 2 * lane - (lane & (stride - 1)), b = a + stride;
            const bool swap = (greater_nan_first(sv[a], sv[b]) && sok[a]) || !sok[b];
            if (swap == dir) {
                const float v = sv[a];
                sv[a] = sv[b];
                sv[b] = v;
                const int i = si[a];
                si[a] = si[b];
                si[b] = i;
                const int ok = sok[a];
                sok[a] = sok[b];
                sok[b] = ok;
            }
        }
    };
    for (int size = 2; size < MOE_SORT_SLOTS; size *= 2) {
        const bool flag = (lane & (size / 2)) != 0;
        for (int stride = size / 2; stride > 0; stride /= 2) {
            step(stride, flag);
        }
    }
    for (int stride = MOE_SORT_SLOTS / 2; stride > 0; stride /= 2) {
        step(stride, false);
    }
    __syncwarp();
    if (lane < k) {
        values[t * k + lane] = sv[lane];
        indices[t * k + lane] = si[lane];
    }
    if (weights == nullptr) {
        return;
    }
    // the routing weights: the values over their sum where `normalize`, in float32, stored
    // as `weight_kind` (0 bf16, 1 f16, 2 f32). libtorch's sum over the k values (a block row of
    // w = the largest power of two up to k lanes) adds value i + w to value i, then halves the
    // lanes, adding lane i + offset to lane i for offset = w / 2, ..., 1: the same order here.
    __shared__ float weight_total[MOE_TOPK_WARPS];
    if (normalize && lane == 0) {
        int width = 1;
        while (2 * width <= k) {
            width *= 2;
        }
        float part[MOE_SORT_SLOTS];
        for (int i = 0; i < width; ++i) {
            part[i] = i + width < k ? sv[i] + sv[i + width] : sv[i];
        }
        for (int offset = width / 2; offset > 0; offset /= 2) {
            for (int i = 0; i < offset; ++i) {
                part[i] = part[i] + part[i + offset];
            }
        }
        weight_total[warp] = part[0];
    }
    __syncwarp();
    if (lane < k) {
        const float w = normalize ? sv[lane] / weight_total[warp] : sv[lane];
        const long long at = t * k + lane;
        if (weight_kind == 0) {
            static_cast<Bf16::T *>(weights)[at] = Bf16::store(w);
        } else if (weight_kind == 1) {
            static_cast<F16::T *>(weights)[at] = F16::store(w);
        } else {
            static_cast<float *>(weights)[at] = w;
        }
    }
}

// Up to 256 experts (8 a lane), and up to MOE_MAX_EXPERTS.
extern "C" __global__ void __launch_bounds__(32 * MOE_TOPK_WARPS)
    moe_topk_256(const float *__restrict__ probs, long long tokens, int experts, int k,
                 float *__restrict__ values, long long *__restrict__ indices, int normalize,
                 int weight_kind, void *__restrict__ weights) {
    moe_topk<8>(probs, tokens, experts, k, values, indices, normalize, weight_kind, weights);
}
extern "C" __global__ void __launch_bounds__(32 * MOE_TOPK_WARPS)
    moe_topk_1024(const float *__restrict__ probs, long long tokens, int experts, int k,
                  float *__restrict__ values, long long *__restrict__ indices, int normalize,
                  int weight_kind, void *__restrict__ weights) {
    moe_topk<MOE_TOPK_MAX_ITEMS>(probs, tokens, experts, k, values, indices, normalize,
                                 weight_kind, weights);
}

// The experts chosen by the tokens of this block's chunk (MOE_GROUP_TOKENS tokens), as one
// 64-bit mask per expert in `mask` [experts] (bit i: the chunk's token i chose it); ids outside
// [0, experts) are left out.
static __device__ void moe_chunk_masks(const long long *experts_of, long long tokens, int k,
                                       int experts, unsigned long long *mask) {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        mask[e] = 0ull;
    }
    __syncthreads();
    const long long first = (long long)blockIdx.x * MOE_GROUP_TOKENS;
    const int n = (int)min((long long)MOE_GROUP_TOKENS, tokens - first);
    for (int p = threadIdx.x; p < n * k; p += blockDim.x) {
        const long long e = experts_of[first * k + p];
        if (e >= 0 && e < experts) {
            atomicOr(&mask[e], 1ull << (p / k));
        }
    }
    __syncthreads();
}

// `experts_of` [tokens, k] int64 (the router's choices): per chunk of MOE_GROUP_TOKENS tokens
// the number of its pairs that chose each expert, `counts` [chunks, experts] int32.
extern "C" __global__ void __launch_bounds__(256)
    moe_group_count(const long long *__restrict__ experts_of, long long tokens, int k,
                    int experts, int *__restrict__ counts) {
    __shared__ unsigned long long group_mask[MOE_MAX_EXPERTS];
    moe_chunk_masks(experts_of, tokens, k, experts, group_mask);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        counts[(long long)blockIdx.x * experts + e] = __popcll(group_mask[e]);
    }
}

// One block of 1024 threads: `counts` [chunks, experts] becomes, in place, where each chunk's
// rows of each expert start among the pairs sorted by expert (expert by expert, chunk by chunk
// within one), and `ends` [experts] int32 the end of each expert's rows.
extern "C" __global__ void __launch_bounds__(1024)
    moe_group_offsets(int *__restrict__ counts, long long chunks, int experts,
                      int *__restrict__ ends) {
    __shared__ int scan[1024];
    const int e = threadIdx.x;
    int total = 0;
    if (e < experts) {
        for (long long c = 0; c < chunks; ++c) {
            const int n = counts[c * experts + e];
            counts[c * experts + e] = total;
            total += n;
        }
    }
    // inclusive scan of the experts' totals (Hillis-Steele over the block)
    scan[e] = total;
    __syncthreads();
    for (int offset = 1; offset < 1024; offset <<= 1) {
        const int add = e >= offset ? scan[e - offset] : 0;
        __syncthreads();
        scan[e] += add;
        __syncthreads();
    }
    if (e < experts) {
        const int start = scan[e] - total;
        ends[e] = scan[e];
        for (long long c = 0; c < chunks; ++c) {
            counts[c * experts + e] += start;
        }
    }
}

// Each pair's place among the pairs sorted by expert (stable: token order within an expert):
// its chunk's start for the expert (`offsets`, from moe_group_offsets) plus the number of the
// chunk's earlier tokens that chose it. Writes `positions` [tokens * k] (where pair t k + j's
// row lies) and `row_tokens` [tokens * k] (the token of each sorted row), both int64.
extern "C" __global__ void __launch_bounds__(256)
    moe_group_place(const long long *__restrict__ experts_of, long long tokens, int k,
                    int experts, const int *__restrict__ offsets,
                    long long *__restrict__ positions, long long *__restrict__ row_tokens) {
    __shared__ unsigned long long group_mask[MOE_MAX_EXPERTS];
    moe_chunk_masks(experts_of, tokens, k, experts, group_mask);
    const long long first = (long long)blockIdx.x * MOE_GROUP_TOKENS;
    const int n = (int)min((long long)MOE_GROUP_TOKENS, tokens - first);
    for (int p = threadIdx.x; p < n * k; p += blockDim.x) {
        const long long e = experts_of[first * k + p];
        if (e < 0 || e >= experts) {
            continue;
        }
        const int i = p / k;
        const int rank = __popcll(group_mask[e] & ((1ull << i) - 1ull));
        const long long dest = offsets[(long long)blockIdx.x * experts + e] + rank;
        positions[first * k + p] = dest;
        row_tokens[dest] = first + i;
    }
}

// rotary (training): the rotary embedding as an autograd node's two passes
// (src/aten_ext/fused_autograd.rs). `x` and `out` are rows of `d` elements, `heads` consecutive
// rows a position; `cos` and `sin` [positions, d] (the sin's first half negated, as
// Rope::cos_sin gives it). out = x * cos + roll(x, d / 2) * sin (the forward pass), or with
// `inverse` x * cos - roll(x, d / 2) * sin, the transposed rotation (the backward pass of the
// first, for sin's halves of opposite signs). One rounding. A thread takes `vec` consecutive
// elements (a 16-byte vector, where the launch found half a row a whole number of them and the
// pointers aligned, else 1); a block holds blockDim / (d / vec) rows. Where libtorch runs three
// kernels forward (a product, the roll, addcmul) and four backward.

// N consecutive elements j.. of a row (1, or a 16-byte vector of them, inside one half).
template <class P, int N>
static __device__ __forceinline__ void rotary_at(const typename P::T *x,
                                                 const typename P::T *cos,
                                                 const typename P::T *sin, typename P::T *out,
                                                 int j, int half, bool inverse) {
    float a[N], b[N], c[N], s[N];
    load_n<P, N>(x + j, a);
    load_n<P, N>(x + (j < half ? j + half : j - half), b);
    load_n<P, N>(cos + j, c);
    load_n<P, N>(sin + j, s);
    for (int t = 0; t < N; ++t) {
        a[t] = a[t] * c[t] + b[t] * (inverse ? -s[t] : s[t]);
    }
    store_n<P, N>(out + j, a);
}

template <class P>
static __device__ void rotary(const typename P::T *__restrict__ x,
                              const typename P::T *__restrict__ cos,
                              const typename P::T *__restrict__ sin,
                              typename P::T *__restrict__ out, long long rows, int heads, int d,
                              int inverse, int vec) {
    const bool vectors = vec > 1;
    const int n = vectors ? 16 / sizeof(typename P::T) : 1;
    const int per_row = d / n;
    const int per_block = blockDim.x / per_row;
    const long long row = (long long)blockIdx.x * per_block + threadIdx.x / per_row;
    const int j = (threadIdx.x % per_row) * n;
    if (threadIdx.x >= per_block * per_row || row >= rows) {
        return;
    }
    const long long pos = (row / heads) * d;
    if (vectors) {
        rotary_at<P, 16 / sizeof(typename P::T)>(x + row * d, cos + pos, sin + pos,
                                                 out + row * d, j, d / 2, inverse);
    } else {
        rotary_at<P, 1>(x + row * d, cos + pos, sin + pos, out + row * d, j, d / 2, inverse);
    }
}

// swiglu (training): SwiGLU's product of separate gate and up tensors as an autograd node's
// two passes (src/aten_ext/fused_autograd.rs), over `n` elements. Forward (`grad` null):
// out = silu(gate) * up. Backward: d_up = grad * silu(gate) into `d_up`, and into `out`
// d_gate = silu'(gate) applied to grad * up. Rounded where libtorch's silu, mul and
// silu_backward round (silu(gate) and grad * up in the storage type), in one kernel a pass
// where libtorch runs two forward and three backward.
// N consecutive elements at e (1, or a 16-byte vector of them).
template <class P, int N>
static __device__ __forceinline__ void swiglu_at(const typename P::T *gate,
                                                 const typename P::T *up,
                                                 const typename P::T *grad, typename P::T *out,
                                                 typename P::T *d_up, long long e) {
    float g[N], u[N], r[N];
    load_n<P, N>(gate + e, g);
    load_n<P, N>(up + e, u);
    if (grad == nullptr) {
        for (int t = 0; t < N; ++t) {
            r[t] = P::load(P::store(g[t] / (1.0f + expf(-g[t])))) * u[t];
        }
        store_n<P, N>(out + e, r);
        return;
    }
    float dy[N], du[N];
    load_n<P, N>(grad + e, dy);
    for (int t = 0; t < N; ++t) {
        const float x = g[t], ex = 1.0f + expf(-x);
        du[t] = dy[t] * P::load(P::store(x / ex));
        const float ds = P::load(P::store(dy[t] * u[t]));
        const float sig = 1.0f / ex;
        r[t] = ds * sig * (1.0f + x * (1.0f - sig));
    }
    store_n<P, N>(out + e, r);
    store_n<P, N>(d_up + e, du);
}

template <class P>
static __device__ void swiglu(const typename P::T *__restrict__ gate,
                              const typename P::T *__restrict__ up,
                              const typename P::T *__restrict__ grad,
                              typename P::T *__restrict__ out, typename P::T *__restrict__ d_up,
                              long long n) {
    const int VEC = 16 / sizeof(typename P::T);
    const bool vectors = n % VEC == 0 && aligned16(gate) && aligned16(up) && aligned16(out) &&
                         (grad == nullptr || (aligned16(grad) && aligned16(d_up)));
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (vectors) {
        for (long long e = first * VEC; e < n; e += stride * VEC) {
            swiglu_at<P, 16 / sizeof(typename P::T)>(gate, up, grad, out, d_up, e);
        }
    } else {
        for (long long e = first; e < n; e += stride) {
            swiglu_at<P, 1>(gate, up, grad, out, d_up, e);
        }
    }
}

// gated_attention_prep: after a Qwen3.5 gated attention layer's fused q/k/v projection `y`
// (per token, `row_stride` elements apart: per query head its query and its gate of d each,
// then kv keys and kv values of d each), the zero-centred q/k norms (scaled_rms_norm's
// arithmetic: rstd over the head in float32, x * rstd * scale rounded once) and the rotary
// embedding of the first `rot` of each head (x * cos + rotate_half(x) * sin with the sin's
// first half negated, rounded where libtorch's product and addcmul round; the rest passed
// through), written to dense `q_out` [n, heads, d] and `k_out` [n, kv, d]: one kernel for the
// norms, the gate's copy, the rotation's products, rolls and concatenations (about a dozen).
// A warp per (token, head), the heads of 8 tokens' rows a block (blockIdx.x * 8 + warp over
// n * (heads + kv)); `cos`, `sin` [m, rot] with token t at row t % m. The normed head is staged
// in shared memory (the rotation pairs element i with i + rot / 2, another lane's).
#define GATED_PREP_WARPS 8
#define GATED_PREP_MAX_D 512

template <class P>
static __device__ void gated_attention_prep(const typename P::T *__restrict__ y,
                                            long long row_stride, long long n, int heads, int kv,
                                            int d, int rot, const float *__restrict__ q_scale,
                                            const float *__restrict__ k_scale, float eps,
                                            const typename P::T *__restrict__ cos,
                                            const typename P::T *__restrict__ sin, long long m,
                                            typename P::T *__restrict__ q_out,
                                            typename P::T *__restrict__ k_out) {
    typedef typename P::T T;
    __shared__ float staged[GATED_PREP_WARPS][GATED_PREP_MAX_D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long item = (long long)blockIdx.x * GATED_PREP_WARPS + warp;
    const int groups = heads + kv;
    if (item >= n * groups) {
        return;   // a whole warp
    }
    const long long token = item / groups;
    const int head = (int)(item % groups);
    const bool query = head < heads;
    const T *src = y + token * row_stride +
                   (query ? (long long)head * 2 * d : (long long)heads * 2 * d +
                                                          (long long)(head - heads) * d);
    const float *scale = query ? q_scale : k_scale;
    const int VEC = 16 / sizeof(T);
    const bool vectors = d % VEC == 0 && aligned16(src);
    const float rstd = row_rstd<P>(src, vectors, d, eps, lane, 32);
    float *row = staged[warp];
    for (int j = lane; j < d; j += 32) {
        row[j] = P::load(P::store(P::load(src[j]) * rstd * scale[j]));
    }
    __syncwarp();
    const T *c = cos + (token % m) * rot, *s = sin + (token % m) * rot;
    const int half = rot / 2;
    T *dst = query ? q_out + (token * heads + head) * (long long)d
                   : k_out + (token * kv + (head - heads)) * (long long)d;
    for (int j = lane; j < d; j += 32) {
        const float a = row[j];
        if (j < rot) {
            const float partner = row[j < half ? j + half : j - half];
            dst[j] = P::store(fmaf(partner, P::load(s[j]), P::load(P::store(a * P::load(c[j])))));
        } else {
            dst[j] = P::store(a);
        }
    }
}

// sigmoid_gate_mul: the gated attention's output gate, out[t, h * d + e] = round(attn[t, h, e] *
// round(sigmoid(gate[t, h, e]))) (libtorch's sigmoid and product, each rounded), with `attn`
// dense [n, heads, d] and the gate read in place from the projection `y` (head h's gate at
// t * row_stride + (2 h + 1) * d): one kernel for the gate's copy, the sigmoid and the product.
// A thread per N elements (16-byte vectors where d and the pointers allow), grid-stride.
template <class P, int N>
static __device__ __forceinline__ void sigmoid_gate_mul_at(const typename P::T *attn,
                                                           const typename P::T *gate,
                                                           typename P::T *out, long long e) {
    float a[N], g[N];
    load_n<P, N>(attn + e, a);
    load_n<P, N>(gate, g);
    for (int t = 0; t < N; ++t) {
        a[t] = a[t] * P::load(P::store(1.0f / (1.0f + expf(-g[t]))));
    }
    store_n<P, N>(out + e, a);
}

template <class P>
static __device__ void sigmoid_gate_mul(const typename P::T *__restrict__ attn,
                                        const typename P::T *__restrict__ y,
                                        long long row_stride, long long n, int heads, int d,
                                        typename P::T *__restrict__ out) {
    const int VEC = 16 / sizeof(typename P::T);
    const bool vectors = d % VEC == 0 && row_stride % VEC == 0 && aligned16(attn) &&
                         aligned16(y) && aligned16(out);
    const int step = vectors ? VEC : 1;
    const long long total = n * heads * d;
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * step;
    const long long stride = (long long)gridDim.x * blockDim.x * step;
    for (long long e = first; e < total; e += stride) {
        const long long token = e / ((long long)heads * d);
        const long long within = e - token * heads * d;
        const long long h = within / d, col = within - h * d;
        const typename P::T *gate = y + token * row_stride + (2 * h + 1) * d + col;
        if (vectors) {
            sigmoid_gate_mul_at<P, 16 / sizeof(typename P::T)>(attn, gate, out, e);
        } else {
            sigmoid_gate_mul_at<P, 1>(attn, gate, out, e);
        }
    }
}

// N consecutive floats at `p` (1, or 16-byte vectors of 4).
template <int N>
static __device__ __forceinline__ void load_f32(const float *p, float *v) {
    if (N == 1) {
        v[0] = *p;
        return;
    }
    for (int t = 0; t < N; t += 4) {
        const float4 q = *reinterpret_cast<const float4 *>(p + t);
        v[t] = q.x;
        v[t + 1] = q.y;
        v[t + 2] = q.z;
        v[t + 3] = q.w;
    }
}

template <int N>
static __device__ __forceinline__ void store_f32(float *p, const float *v) {
    if (N == 1) {
        *p = v[0];
        return;
    }
    for (int t = 0; t < N; t += 4) {
        float4 q;
        q.x = v[t];
        q.y = v[t + 1];
        q.z = v[t + 2];
        q.w = v[t + 3];
        *reinterpret_cast<float4 *>(p + t) = q;
    }
}

// One step's rates, computed on the host: decay = lr * weight_decay (as float32 numbers,
// multiplied in float32), step_size = lr / (1 - beta1^t), bias2_sqrt = sqrt(1 - beta2^t).
struct AdamWRates {
    float decay, beta1, beta2, step_size, bias2_sqrt, eps;
};

// adamw_step at N consecutive elements from e, as libtorch's fused AdamW computes each in
// float32: g = grad / grad_scale, master -= decay * master, m = beta1 m + (1 - beta1) g,
// v = beta2 v + (1 - beta2) g g, master -= step_size * m / (sqrt(v) / bias2_sqrt + eps); then
// the parameter = master rounded to the storage type. A null gradient counts as zeros.
template <class P, int N>
static __device__ __forceinline__ void adamw_at(const typename P::T *grad,
                                                typename P::T *param, float *master,
                                                float *exp_avg, float *exp_avg_sq, long long e,
                                                float scale, const AdamWRates &r) {
    float g[N], w[N], m[N], v[N];
    if (grad != nullptr) {
        load_n<P, N>(grad + e, g);
    } else {
        for (int t = 0; t < N; ++t) {
            g[t] = 0.0f;
        }
    }
    load_f32<N>(master + e, w);
    load_f32<N>(exp_avg + e, m);
    load_f32<N>(exp_avg_sq + e, v);
    for (int t = 0; t < N; ++t) {
        const float gt = g[t] / scale;
        w[t] -= r.decay * w[t];
        m[t] = r.beta1 * m[t] + (1.0f - r.beta1) * gt;
        v[t] = r.beta2 * v[t] + (1.0f - r.beta2) * gt * gt;
        w[t] -= r.step_size * m[t] / (sqrtf(v[t]) / r.bias2_sqrt + r.eps);
    }
    store_f32<N>(master + e, w);
    store_f32<N>(exp_avg + e, m);
    store_f32<N>(exp_avg_sq + e, v);
    store_n<P, N>(param + e, w);
}

// adamw_step over `n` elements, a grid-stride loop over 16-byte vectors of the storage type
// where every pointer and the count allow (the float32 buffers then by 16-byte vectors too),
// else element by element. `grad_scale` (one float32 on the device, or null): the gradients'
// divisor (the clip's).
template <class P>
static __device__ void adamw_step(const typename P::T *__restrict__ grad,
                                  typename P::T *__restrict__ param, float *__restrict__ master,
                                  float *__restrict__ exp_avg, float *__restrict__ exp_avg_sq,
                                  long long n, const float *__restrict__ grad_scale,
                                  AdamWRates rates) {
    const int VEC = 16 / sizeof(typename P::T);
    const float scale = grad_scale != nullptr ? grad_scale[0] : 1.0f;
    const bool vectors = n % VEC == 0 && (grad == nullptr || aligned16(grad)) &&
                         aligned16(param) && aligned16(master) && aligned16(exp_avg) &&
                         aligned16(exp_avg_sq);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (vectors) {
        for (long long e = first * VEC; e < n; e += stride * VEC) {
            adamw_at<P, 16 / sizeof(typename P::T)>(grad, param, master, exp_avg, exp_avg_sq,
                                                    e, scale, rates);
        }
    } else {
        for (long long e = first; e < n; e += stride) {
            adamw_at<P, 1>(grad, param, master, exp_avg, exp_avg_sq, e, scale, rates);
        }
    }
}

// block_attention_fwd / block_attention_bwd (training): the drafter's block attention split in
// two parts merged by their log-sum-exp (src/model/drafter/groups.rs): cuDNN's fused attention
// over the context with the staircase mask, per group of blocks, and each block's attention over
// its own keys here. Layout: R = E * rows query rows (the grouped node passes E = 1 and every row
// of the layer), a block of `bs` consecutive rows attending to its own rows' keys; q, o1, out,
// dout, dq [R, heads, d]; kb, vb, dkb, dvb [R, kv, d]; lse1, lse [E, heads, rows] float32
// (natural log of the sum of exp(scale * q.k) over the keys); `anchors` [R / bs]: each block's
// anchor (0: it sees no context, and the context part's output and log-sum-exp for its rows
// are not read).
//
// One CUDA block per (block, kv head) (g = heads / kv query heads on it): in the general form
// g * bs threads, thread t the query row of head kv_head * g + t / bs, slot t % bs, the block's
// keys and values waiting in shared memory as float32 (2 * bs * d); the warp-cooperative form
// (below: heads of 8 or 16 16-byte vectors) takes a row per 8 or 16 lanes. Forward: the row's scores against its block's bs keys, their
// softmax, the output over the values, then the merge with the context part: lse = log(exp(lse1)
// + exp(lse2)), out = exp(lse1 - lse) o1 + exp(lse2 - lse) o2, rounded once. Backward (given the
// merged out and lse, as flash attention's backward pass takes them, so that each part's
// gradient is its share of the exact one): p = exp(s - lse), ds = p (dout.v - dout.out); dq +=
// scale ds k (added to the context part's dq, in place); dk = scale ds^T q and dv = p^T dout
// summed over the block's g * bs rows, through shared memory (2 * g * bs * bs more floats).
#define BLOCK_ATTN_MAX 16   // most rows a block (the drafter's block size)
#ifndef FUSED_DYNAMIC_SHARED
#define FUSED_DYNAMIC_SHARED(name) extern __shared__ float4 name[]
#endif

// The row's scores against the block's keys `ks` [bs, d] (shared), times `scale`.
template <class P, int N>
static __device__ __forceinline__ void block_scores(const typename P::T *qr, const float *ks,
                                                    int d, int bs, float scale, float *s) {
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        s[j] = 0.0f;
    }
    for (int c = 0; c < d; c += N) {
        float x[N];
        load_n<P, N>(qr + c, x);
#pragma unroll
        for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
            if (j < bs) {
                const float *kr = ks + j * d + c;
                float acc = s[j];
                for (int u = 0; u < N; ++u) {
                    acc = fmaf(x[u], kr[u], acc);
                }
                s[j] = acc;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        s[j] *= scale;
    }
}

// The block's keys and values of kv head `kvh` into shared memory (float32, [bs, d] each).
template <class P>
static __device__ __forceinline__ void block_kv_to_shared(const typename P::T *kb,
                                                          const typename P::T *vb, long long blk,
                                                          int kvh, int kv, int d, int bs,
                                                          float *ks, float *vs) {
    for (int i = threadIdx.x; i < bs * d; i += blockDim.x) {
        const int j = i / d, c = i - j * d;
        const long long at = ((blk * bs + j) * kv + kvh) * (long long)d + c;
        ks[i] = P::load(kb[at]);
        vs[i] = P::load(vb[at]);
    }
    __syncthreads();
}

// Whether a log-sum-exp is a number (a row that saw keys).
static __device__ __forceinline__ bool finite_lse(float v) {
    return v == v && v > -3.0e38f && v < 3.0e38f;
}

// sum over the block's keys j of w[j] * rows[j][c .. c + N) (rows: [bs, d], shared, float32).
template <int N>
static __device__ __forceinline__ void weighted_rows(const float *w, const float *rows, int c,
                                                     int d, int bs, float *acc) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
        acc[u] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        if (j < bs) {
            const float *r = rows + j * d + c;
            for (int u = 0; u < N; ++u) {
                acc[u] = fmaf(w[j], r[u], acc[u]);
            }
        }
    }
}

template <class P, int N>
static __device__ __forceinline__ void block_attention_fwd_row(
    const typename P::T *q, const typename P::T *o1, const float *lse1,
    const long long *anchors, typename P::T *out, float *lse, const float *ks, const float *vs,
    long long blk, int head, int slot, int heads, int d, int bs, int rows, float scale) {
    const long long row = blk * bs + slot;
    const long long at = (row * heads + head) * (long long)d;
    float s[BLOCK_ATTN_MAX];
    block_scores<P, N>(q + at, ks, d, bs, scale, s);
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        if (j < bs) {
            m = fmaxf(m, s[j]);
        }
    }
    float l = 0.0f;
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        s[j] = j < bs ? expf(s[j] - m) : 0.0f;
        l += s[j];
    }
    const float own = m + logf(l);
    const long long e = row / rows, r = row - e * rows;
    const long long li = (e * heads + head) * rows + r;
    const float ctx = lse1[li];
    float merged = own, w1 = 0.0f;
    if (anchors[blk] > 0 && finite_lse(ctx)) {
        const float top = fmaxf(ctx, own);
        merged = top + logf(expf(ctx - top) + expf(own - top));
        w1 = expf(ctx - merged);
    }
    // the own part's weights, normalised and scaled by its share: exp(own - merged) / l
    const float w2 = expf(own - merged) / l;
    for (int c = 0; c < d; c += N) {
        float o[N], prev[N];
        weighted_rows<N>(s, vs, c, d, bs, o);
        if (w1 > 0.0f) {
            load_n<P, N>(o1 + at + c, prev);
            for (int u = 0; u < N; ++u) {
                o[u] = fmaf(w1, prev[u], w2 * o[u]);
            }
        } else {
            for (int u = 0; u < N; ++u) {
                o[u] *= w2;
            }
        }
        store_n<P, N>(out + at + c, o);
    }
    lse[li] = merged;
}

// The warp-cooperative form: where a head is 8 or 16 vectors of 16 bytes (d = 64 or 128 in bf16
// or f16: block_attention_lanes), a row is handled by LANES lanes, a vector each, so that every
// load and store is of whole rows; BLOCK_ATTN_THREADS threads a block loop over its g * bs rows.
// A row's partial dot products with the bs keys are summed across its lanes by halving
// exchanges (transpose_sum: 15 shuffles for 16 sums), each lane ending with COUNT = 16 / LANES
// of them, keys COUNT * lane ...; a key's probability reaches every lane by one shuffle.
#define BLOCK_ATTN_THREADS 128

// Sums the partial sums s[0..16) over the row's LANES lanes: lane l ends with s[0..16 / LANES)
// complete, those of keys (16 / LANES) * l onwards.
template <int LANES>
static __device__ __forceinline__ void transpose_sum(float *s, int lane) {
    int count = BLOCK_ATTN_MAX;
#pragma unroll
    for (int w = LANES / 2; w >= 1; w >>= 1) {
        count /= 2;
        const bool upper = (lane & w) != 0;
#pragma unroll
        for (int i = 0; i < BLOCK_ATTN_MAX / 2; ++i) {
            if (i < count) {
                const float send = upper ? s[i] : s[i + count];
                const float keep = upper ? s[i + count] : s[i];
                s[i] = keep + __shfl_xor_sync(0xffffffffu, send, w);
            }
        }
    }
}

template <int LANES>
static __device__ __forceinline__ float lanes_max(float v) {
#pragma unroll
    for (int w = LANES / 2; w >= 1; w >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, w));
    }
    return v;
}

template <int LANES>
static __device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int w = LANES / 2; w >= 1; w >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, w);
    }
    return v;
}

// A row's partial dot products of its vector `x` (elements c0 .. c0 + VEC) with the block's
// keys or values `kv` [bs, d] (shared), summed over its lanes (transpose_sum).
template <class P, int LANES>
static __device__ __forceinline__ void lanes_dots(const float *x, const typename P::T *kv, int c0,
                                                  int d, int bs, int lane, float *s) {
    const int VEC = 16 / sizeof(typename P::T);
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        float acc = 0.0f;
        if (j < bs) {
            float kr[VEC];
            load_n<P, VEC>(kv + j * d + c0, kr);
#pragma unroll
            for (int u = 0; u < VEC; ++u) {
                acc = fmaf(x[u], kr[u], acc);
            }
        }
        s[j] = acc;
    }
    transpose_sum<LANES>(s, lane);
}

// sum over keys j of w_j * rows[j][c0 ..] where w_j is held as s[j % COUNT] by lane j / COUNT.
template <class P, int LANES>
static __device__ __forceinline__ void lanes_combine(const float *s, const typename P::T *rows,
                                                     int c0, int d, int bs, float *o) {
    const int VEC = 16 / sizeof(typename P::T), COUNT = BLOCK_ATTN_MAX / LANES;
#pragma unroll
    for (int u = 0; u < VEC; ++u) {
        o[u] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        if (j < bs) {
            const float w = __shfl_sync(0xffffffffu, s[j % COUNT], j / COUNT, LANES);
            float r[VEC];
            load_n<P, VEC>(rows + j * d + c0, r);
#pragma unroll
            for (int u = 0; u < VEC; ++u) {
                o[u] = fmaf(w, r[u], o[u]);
            }
        }
    }
}

// The block's keys and values of kv head `kvh` into shared memory as they are stored ([bs, d]
// each, 16-byte vectors): a row's lanes then read 16 consecutive bytes each, 8 lanes one
// 128-byte line, without bank conflicts.
template <class P>
static __device__ __forceinline__ void block_kv_raw(const typename P::T *kb,
                                                    const typename P::T *vb, long long blk,
                                                    int kvh, int kv, int d, int bs,
                                                    typename P::T *ks, typename P::T *vs) {
    const int VEC = 16 / sizeof(typename P::T), per = d / VEC;
    for (int i = threadIdx.x; i < bs * per; i += blockDim.x) {
        const int j = i / per, c = (i - j * per) * VEC;
        const long long at = ((blk * bs + j) * kv + kvh) * (long long)d + c;
        *reinterpret_cast<uint4 *>(ks + j * d + c) = *reinterpret_cast<const uint4 *>(kb + at);
        *reinterpret_cast<uint4 *>(vs + j * d + c) = *reinterpret_cast<const uint4 *>(vb + at);
    }
    __syncthreads();
}

// A round's row of the calling thread's lanes in the warp-cooperative form: its index among the
// CUDA block's g * bs rows as wanted (`want`, maybe past the end) and as computed (`ri`, the last
// row there), its query head, its row and the offset of the lane's vector in q-shaped tensors.
struct LaneRow {
    int want, ri, head;
    long long row, at;
};
template <int LANES>
static __device__ __forceinline__ LaneRow lane_row(int first, long long blk, int kvh, int g,
                                                   int bs, int heads, int d, int c0) {
    const int want = first + (int)threadIdx.x / LANES;
    const int ri = want < g * bs ? want : g * bs - 1;
    const int head = kvh * g + ri / bs;
    const long long row = blk * bs + ri % bs;
    return {want, ri, head, row, (row * heads + head) * (long long)d + c0};
}

template <class P, int LANES>
static __device__ void block_attention_fwd_lanes(
    const typename P::T *q, const typename P::T *o1, const float *lse1, const long long *anchors,
    typename P::T *out, float *lse, const typename P::T *ks, const typename P::T *vs,
    long long blk, int kvh, int heads, int kv, int d, int bs, int rows, float scale) {
    const int VEC = 16 / sizeof(typename P::T), COUNT = BLOCK_ATTN_MAX / LANES;
    const int g = heads / kv, lane = threadIdx.x % LANES, c0 = lane * VEC;
    const int groups = blockDim.x / LANES;
    const bool sees_context = anchors[blk] > 0;
    // every lane of a warp runs the same rounds (the shuffles): rows past the end are computed
    // on the last row and not written
    for (int first = 0; first < g * bs; first += groups) {
        const auto [want, ri, head, row, at] =
            lane_row<LANES>(first, blk, kvh, g, bs, heads, d, c0);
        // the row's loads first, so that they are in flight together
        float x[VEC], s[BLOCK_ATTN_MAX], prev[VEC];
        load_n<P, VEC>(q + at, x);
        if (sees_context) {
            load_n<P, VEC>(o1 + at, prev);
        }
        lanes_dots<P, LANES>(x, ks, c0, d, bs, lane, s);
        float m = NEG_INF;
#pragma unroll
        for (int i = 0; i < COUNT; ++i) {
            s[i] = COUNT * lane + i < bs ? s[i] * scale : NEG_INF;
            m = fmaxf(m, s[i]);
        }
        m = lanes_max<LANES>(m);
        float l = 0.0f;
#pragma unroll
        for (int i = 0; i < COUNT; ++i) {
            s[i] = expf(s[i] - m);
            l += s[i];
        }
        l = lanes_sum<LANES>(l);
        const float own = m + logf(l);
        const long long e = row / rows, r = row - e * rows;
        const long long li = (e * heads + head) * rows + r;
        const float ctx = lse1[li];
        float merged = own, w1 = 0.0f;
        if (sees_context && finite_lse(ctx)) {
            const float top = fmaxf(ctx, own);
            merged = top + logf(expf(ctx - top) + expf(own - top));
            w1 = expf(ctx - merged);
        }
        const float w2 = expf(own - merged) / l;
        float o[VEC];
        lanes_combine<P, LANES>(s, vs, c0, d, bs, o);
        if (w1 > 0.0f) {
            for (int u = 0; u < VEC; ++u) {
                o[u] = fmaf(w1, prev[u], w2 * o[u]);
            }
        } else {
            for (int u = 0; u < VEC; ++u) {
                o[u] *= w2;
            }
        }
        if (want < g * bs) {
            store_n<P, VEC>(out + at, o);
            if (lane == 0) {
                lse[li] = merged;
            }
        }
    }
}

// The rows' part of the backward pass in the warp-cooperative form: probabilities and score
// gradients into `ps`, `dss` ([g * bs, BLOCK_ATTN_MAX], shared), the query gradients added.
template <class P, int LANES>
static __device__ void block_attention_bwd_lanes(
    const typename P::T *q, const typename P::T *out, const typename P::T *dout,
    const float *lse, const long long *anchors, typename P::T *dq, const typename P::T *ks,
    const typename P::T *vs, float *ps, float *dss, long long blk, int kvh, int heads, int kv,
    int d, int bs, int rows, float scale) {
    const int VEC = 16 / sizeof(typename P::T), COUNT = BLOCK_ATTN_MAX / LANES;
    const int g = heads / kv, lane = threadIdx.x % LANES, c0 = lane * VEC;
    const int groups = blockDim.x / LANES;
    const bool add = anchors[blk] > 0;
    for (int first = 0; first < g * bs; first += groups) {
        const auto [want, ri, head, row, at] =
            lane_row<LANES>(first, blk, kvh, g, bs, heads, d, c0);
        // the row's loads first, so that they are in flight together
        float x[VEC], s[BLOCK_ATTN_MAX], dp[BLOCK_ATTN_MAX], gr[VEC], o[VEC], prev[VEC];
        load_n<P, VEC>(q + at, x);
        load_n<P, VEC>(dout + at, gr);
        load_n<P, VEC>(out + at, o);
        if (add) {
            load_n<P, VEC>(dq + at, prev);
        }
        const long long e = row / rows, r = row - e * rows;
        const float total = lse[(e * heads + head) * rows + r];
        lanes_dots<P, LANES>(x, ks, c0, d, bs, lane, s);
        float dot = 0.0f;
        for (int u = 0; u < VEC; ++u) {
            dot = fmaf(gr[u], o[u], dot);
        }
        dot = lanes_sum<LANES>(dot);
        lanes_dots<P, LANES>(gr, vs, c0, d, bs, lane, dp);
#pragma unroll
        for (int i = 0; i < COUNT; ++i) {
            const int key = COUNT * lane + i;
            s[i] = key < bs ? expf(s[i] * scale - total) : 0.0f;
            dp[i] = s[i] * (dp[i] - dot);
            if (want < g * bs) {
                // (zeros for keys past the block: block_attention_bwd_kv4 reads four at a time)
                ps[ri * BLOCK_ATTN_MAX + key] = s[i];
                dss[ri * BLOCK_ATTN_MAX + key] = dp[i];
            }
        }
        float acc[VEC];
        lanes_combine<P, LANES>(dp, ks, c0, d, bs, acc);
        if (want < g * bs) {
            for (int u = 0; u < VEC; ++u) {
                acc[u] = fmaf(scale, acc[u], add ? prev[u] : 0.0f);
            }
            store_n<P, VEC>(dq + at, acc);
        }
    }
}

// dk = scale ds^T q and dv = p^T dout of the block's keys in the warp-cooperative form: a task
// per (dk or dv, four keys, one 16-byte vector of columns) sums over the block's g * bs rows,
// so that each row's vector is read once for four keys.
template <class P>
static __device__ __forceinline__ void block_attention_bwd_kv4(
    const typename P::T *q, const typename P::T *dout, const float *ps, const float *dss,
    typename P::T *dkb, typename P::T *dvb, long long blk, int kvh, int heads, int kv, int d,
    int bs, float scale) {
    const int VEC = 16 / sizeof(typename P::T), chunks = d / VEC, quads = (bs + 3) / 4;
    const int g = heads / kv, per = quads * chunks;
    for (int task = threadIdx.x; task < 2 * per; task += blockDim.x) {
        const bool values = task >= per;
        const int rest = values ? task - per : task;
        const int quad = rest / chunks, c = (rest - quad * chunks) * VEC;
        const typename P::T *src = values ? dout : q;
        const float *coef = (values ? ps : dss) + quad * 4;
        float acc[4][VEC];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int u = 0; u < VEC; ++u) {
                acc[k][u] = 0.0f;
            }
        }
#pragma unroll 4
        for (int i = 0; i < g * bs; ++i) {
            const int head = kvh * g + i / bs;
            const long long row = blk * bs + i % bs;
            float x[VEC];
            load_n<P, VEC>(src + (row * heads + head) * (long long)d + c, x);
            const float4 w = *reinterpret_cast<const float4 *>(coef + i * BLOCK_ATTN_MAX);
            const float ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
#pragma unroll
                for (int u = 0; u < VEC; ++u) {
                    acc[k][u] = fmaf(ws[k], x[u], acc[k][u]);
                }
            }
        }
        const float f = values ? 1.0f : scale;
        typename P::T *dst = values ? dvb : dkb;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int j = quad * 4 + k;
            if (j < bs) {
                for (int u = 0; u < VEC; ++u) {
                    acc[k][u] *= f;
                }
                store_n<P, VEC>(dst + ((blk * bs + j) * kv + kvh) * (long long)d + c, acc[k]);
            }
        }
    }
}

// The tensor-core form (lanes == BLOCK_ATTN_MMA: bf16 or f16, blocks of 16 rows, heads a
// multiple of 32 wide, compute capability 8.0 or later). The forms above spend their time on
// instructions (a row's 16 scores and the weighted sum of 16 values, element by element, with
// shuffles; the backward pass's key and value gradients one row at a time), three to four times
// what their memory traffic takes. Here each product is an mma.sync m16n8k16 of the warp,
// float32 sums (P in the storage type, as flash attention's): a warp per (block, query head),
// g warps a CUDA block (its key/value head's query heads), the block's 16 keys and values in
// shared memory. Fragment layouts are the PTX ISA's (lane = 4 * group + quad): A (16 x 16, row)
// a[0] = (row group, k 2 quad .. +1), a[1] = (row group + 8, same k), a[2] = (row group,
// k 8 + 2 quad .. +1), a[3] = (row group + 8, k 8 + 2 quad ..); B (16 x 8, col) b0 = (k 2 quad ..
// +1, n group), b1 = (k 8 + 2 quad .., n group); C (16 x 8) c[0], c[1] = (row group, n 2 quad,
// 2 quad + 1), c[2], c[3] = (row group + 8, same n).
//
// The k order of a product is free as long as A and B share it: over a head's columns, lane
// quad holds the 8 consecutive columns 32 c + 8 quad .. of its rows (one 16-byte load each), the
// first four as k step 2c's (k 2 quad, 2 quad + 1 | 8 + 2 quad, 8 + 2 quad + 1), the last four
// as step 2c + 1's; the keys' B fragments are then one 16-byte load too. The n order of the
// products over the values is chosen likewise: of four n tiles 32 c + s (s < 4), n = 2 i + u of
// tile s is column 32 c + 8 i + 2 s + u, so that a lane's results are its 8 consecutive columns
// 32 c + 8 quad .. of both rows: 16-byte loads and stores again. A probability's k (a key) is
// where the scores' C layout put it: keys 2 quad, 2 quad + 1 (tile 0), 8 + 2 quad, 8 + 2 quad + 1
// (tile 1): the transposed values in shared memory hold them in that order, slot 4 quad + (0, 1,
// 2, 3), so that both B registers are one 8-byte load.
#define BLOCK_ATTN_MMA 32     // the `lanes` value that selects this form
#define BLOCK_ATTN_KPAD 32    // padding of a key row in shared memory (no bank conflicts)
#define BLOCK_ATTN_RPAD 8     // padding of a transposed row (rows of a key, columns of a row)

#ifndef DFLASH_EMULATED_ASM   // (tests/cuda_emulation/cuda_emu.h defines these on the CPU)
// d += a b, m16n8k16, float32 sums of bf16 / f16 operands (compute capability 8.0 on).
static __device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4],
                                                      unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
static __device__ __forceinline__ void mma_f16_16816(float (&d)[4], const unsigned (&a)[4],
                                                     unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
#endif

static __device__ __forceinline__ void mma_16816(Bf16, float (&d)[4], const unsigned (&a)[4],
                                                  unsigned b0, unsigned b1) {
    mma_bf16_16816(d, a, b0, b1);
}
static __device__ __forceinline__ void mma_16816(F16, float (&d)[4], const unsigned (&a)[4],
                                                 unsigned b0, unsigned b1) {
    mma_f16_16816(d, a, b0, b1);
}

// Two floats rounded to the storage type, packed as an operand register (the first low).
template <class P>
static __device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
    return (unsigned)P::store(lo) | ((unsigned)P::store(hi) << 16);
}

// Eight elements of a 16-byte vector as floats.
template <class P>
static __device__ __forceinline__ void unpack8(const uint4 &u, float *v) {
    const typename P::T *e = reinterpret_cast<const typename P::T *>(&u);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        v[t] = P::load(e[t]);
    }
}

// The transposed slot of key j (see above): keys 2 quad + u at 4 quad + u, keys 8 + 2 quad + u
// at 4 quad + 2 + u.
static __device__ __forceinline__ int mma_key_slot(int j) {
    return ((j & 7) >> 1) * 4 + (j >= 8 ? 2 : 0) + (j & 1);
}

// The block's 16 keys of kv head `kvh` as stored into `ks` [16, d + KPAD], and (where `kt` is
// not null) transposed into `kt` [d, 16] by mma_key_slot; the values likewise into `vs`, `vt`.
template <class P>
static __device__ __forceinline__ void block_kv_mma(const typename P::T *kb,
                                                    const typename P::T *vb, long long blk,
                                                    int kvh, int kv, int d, typename P::T *ks,
                                                    typename P::T *kt, typename P::T *vs,
                                                    typename P::T *vt) {
    typedef typename P::T T;
    // consecutive threads take consecutive keys: the transposed stores of a warp then fall in
    // distinct banks (a key's 16-byte vectors to consecutive threads would all hit one)
    const int per = d / 8, stride = d + BLOCK_ATTN_KPAD;
    for (int i = threadIdx.x; i < 16 * per; i += blockDim.x) {
        const int j = i % 16, c = (i / 16) * 8, slot = mma_key_slot(j);
        const long long at = ((blk * 16 + j) * kv + kvh) * (long long)d + c;
        const uint4 k = *reinterpret_cast<const uint4 *>(kb + at);
        const uint4 v = *reinterpret_cast<const uint4 *>(vb + at);
        if (ks != nullptr) {
            *reinterpret_cast<uint4 *>(ks + j * stride + c) = k;
        }
        if (vs != nullptr) {
            *reinterpret_cast<uint4 *>(vs + j * stride + c) = v;
        }
        const T *ke = reinterpret_cast<const T *>(&k), *ve = reinterpret_cast<const T *>(&v);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (kt != nullptr) {
                kt[(c + u) * 16 + slot] = ke[u];
            }
            if (vt != nullptr) {
                vt[(c + u) * 16 + slot] = ve[u];
            }
        }
    }
}

// s[t][i] += the warp's 16 rows (`r0`: row group's elements, `r1`: row group + 8's; 16-byte
// aligned) times the 16 keys in `ks` ([16, d + KPAD]): the C fragments of key tiles t = 0, 1.
template <class P>
static __device__ __forceinline__ void mma_rows_by_keys(const typename P::T *r0,
                                                        const typename P::T *r1,
                                                        const typename P::T *ks, int d,
                                                        int group, int quad, float (&s)[2][4]) {
    const int stride = d + BLOCK_ATTN_KPAD;
    for (int c = 0; c < d; c += 32) {
        const uint4 a0 = *reinterpret_cast<const uint4 *>(r0 + c + 8 * quad);
        const uint4 a1 = *reinterpret_cast<const uint4 *>(r1 + c + 8 * quad);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const uint4 b =
                *reinterpret_cast<const uint4 *>(ks + (8 * t + group) * stride + c + 8 * quad);
            const unsigned lo[4] = {a0.x, a1.x, a0.y, a1.y}, hi[4] = {a0.z, a1.z, a0.w, a1.w};
            mma_16816(P{}, s[t], lo, b.x, b.y);
            mma_16816(P{}, s[t], hi, b.z, b.w);
        }
    }
}

// o[s][i] = the A fragments `a` (16 rows x the 16 keys) times the transposed rows `xt` ([d, 16]
// by mma_key_slot) for columns 32 c .. 32 c + 31: row group's columns 32 c + 8 quad + 2 s + u in
// o[s][u], row group + 8's in o[s][2 + u].
template <class P>
static __device__ __forceinline__ void mma_weights_by_rows(const unsigned (&a)[4],
                                                           const typename P::T *xt, int c,
                                                           int group, int quad,
                                                           float (&o)[4][4]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        o[s][0] = o[s][1] = o[s][2] = o[s][3] = 0.0f;
        const int col = c + 8 * (group >> 1) + 2 * s + (group & 1);
        const uint2 b = *reinterpret_cast<const uint2 *>(xt + col * 16 + 4 * quad);
        mma_16816(P{}, o[s], a, b.x, b.y);
    }
}

// The largest of a row's values over its quad (the row's four lanes).
static __device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
static __device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <class P>
static __device__ void block_attention_fwd_mma(
    const typename P::T *q, const typename P::T *kb, const typename P::T *vb,
    const typename P::T *o1, const float *lse1, const long long *anchors, typename P::T *out,
    float *lse, int heads, int kv, int d, int rows, float scale) {
    typedef typename P::T T;
    FUSED_DYNAMIC_SHARED(block_attn_shared);
    T *ks = reinterpret_cast<T *>(block_attn_shared), *vt = ks + 16 * (d + BLOCK_ATTN_KPAD);
    const long long blk = blockIdx.x;
    const int kvh = blockIdx.y, g = heads / kv;
    block_kv_mma<P>(kb, vb, blk, kvh, kv, d, ks, nullptr, nullptr, vt);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane >> 2, quad = lane & 3;
    const int head = kvh * g + warp;
    const bool sees_context = anchors[blk] > 0;
    long long row[2], at[2], li[2];
    for (int h = 0; h < 2; ++h) {
        row[h] = blk * 16 + group + 8 * h;
        at[h] = (row[h] * heads + head) * (long long)d;
        const long long e = row[h] / rows, r = row[h] - e * rows;
        li[h] = (e * heads + head) * rows + r;
    }
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    mma_rows_by_keys<P>(q + at[0], q + at[1], ks, d, group, quad, s);
    // each row's softmax over its 16 keys (four a lane, the row's quad together), the own
    // part's log-sum-exp and its merge with the context part's
    float w1[2], w2[2];
    for (int h = 0; h < 2; ++h) {
        float m = NEG_INF;
        for (int t = 0; t < 2; ++t) {
            for (int u = 0; u < 2; ++u) {
                s[t][2 * h + u] *= scale;
                m = fmaxf(m, s[t][2 * h + u]);
            }
        }
        m = quad_max(m);
        float l = 0.0f;
        for (int t = 0; t < 2; ++t) {
            for (int u = 0; u < 2; ++u) {
                s[t][2 * h + u] = expf(s[t][2 * h + u] - m);
                l += s[t][2 * h + u];
            }
        }
        l = quad_sum(l);
        const float own = m + logf(l);
        float merged = own;
        w1[h] = 0.0f;
        if (sees_context) {
            const float ctx = lse1[li[h]];
            if (finite_lse(ctx)) {
                const float top = fmaxf(ctx, own);
                merged = top + logf(expf(ctx - top) + expf(own - top));
                w1[h] = expf(ctx - merged);
            }
        }
        w2[h] = expf(own - merged) / l;
        if (quad == 0) {
            lse[li[h]] = merged;
        }
    }
    const unsigned a[4] = {pack_pair<P>(s[0][0], s[0][1]), pack_pair<P>(s[0][2], s[0][3]),
                           pack_pair<P>(s[1][0], s[1][1]), pack_pair<P>(s[1][2], s[1][3])};
    for (int c = 0; c < d; c += 32) {
        float o[4][4];
        mma_weights_by_rows<P>(a, vt, c, group, quad, o);
        for (int h = 0; h < 2; ++h) {
            const long long el = at[h] + c + 8 * quad;
            float v[8], prev[8];
            for (int s2 = 0; s2 < 4; ++s2) {
                v[2 * s2] = o[s2][2 * h] * w2[h];
                v[2 * s2 + 1] = o[s2][2 * h + 1] * w2[h];
            }
            if (w1[h] > 0.0f) {
                unpack8<P>(*reinterpret_cast<const uint4 *>(o1 + el), prev);
                for (int u = 0; u < 8; ++u) {
                    v[u] = fmaf(w1[h], prev[u], v[u]);
                }
            }
            store_n<P, 8>(out + el, v);
        }
    }
}

// The backward pass in the tensor-core form. Shared memory: the probabilities and score
// gradients of the g * 16 rows, transposed ([16 keys, g * 16 + RPAD] each, storage type), then
// for the rows' part the keys and values as stored and the keys transposed, for the keys' part
// (after a barrier, in the same space) the queries and output gradients transposed ([d,
// g * 16 + RPAD] each). Row i of the CUDA block is slot i % 16 of head kvh * g + i / 16.
template <class P>
static __device__ void block_attention_bwd_mma(
    const typename P::T *q, const typename P::T *kb, const typename P::T *vb,
    const typename P::T *out, const typename P::T *dout, const float *lse,
    const long long *anchors, typename P::T *dq, typename P::T *dkb, typename P::T *dvb,
    int heads, int kv, int d, int rows, float scale) {
    typedef typename P::T T;
    FUSED_DYNAMIC_SHARED(block_attn_shared);
    const int g = heads / kv, width = g * 16 + BLOCK_ATTN_RPAD;
    T *pt = reinterpret_cast<T *>(block_attn_shared), *dst = pt + 16 * width;
    T *ks = dst + 16 * width, *vs = ks + 16 * (d + BLOCK_ATTN_KPAD),
      *kt = vs + 16 * (d + BLOCK_ATTN_KPAD);
    T *qt = ks, *gt = qt + d * width;   // the keys' part
    const long long blk = blockIdx.x;
    const int kvh = blockIdx.y;
    block_kv_mma<P>(kb, vb, blk, kvh, kv, d, ks, kt, vs, nullptr);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane >> 2, quad = lane & 3;
    const int head = kvh * g + warp;
    const bool add = anchors[blk] > 0;
    long long at[2];
    float total[2];
    for (int h = 0; h < 2; ++h) {
        const long long row = blk * 16 + group + 8 * h;
        at[h] = (row * heads + head) * (long long)d;
        const long long e = row / rows, r = row - e * rows;
        total[h] = lse[(e * heads + head) * rows + r];
    }
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    float dp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    mma_rows_by_keys<P>(q + at[0], q + at[1], ks, d, group, quad, s);
    mma_rows_by_keys<P>(dout + at[0], dout + at[1], vs, d, group, quad, dp);
    // each row's dout . out over its quad's columns
    float dot[2] = {0.0f, 0.0f};
    for (int h = 0; h < 2; ++h) {
        for (int c = 0; c < d; c += 32) {
            float gr[8], o[8];
            unpack8<P>(*reinterpret_cast<const uint4 *>(dout + at[h] + c + 8 * quad), gr);
            unpack8<P>(*reinterpret_cast<const uint4 *>(out + at[h] + c + 8 * quad), o);
            for (int u = 0; u < 8; ++u) {
                dot[h] = fmaf(gr[u], o[u], dot[h]);
            }
        }
        dot[h] = quad_sum(dot[h]);
    }
    // p = exp(scale s - lse), ds = p (dp - dot); both transposed into shared memory
    for (int t = 0; t < 2; ++t) {
        for (int i = 0; i < 4; ++i) {
            const int h = i >> 1;
            s[t][i] = expf(s[t][i] * scale - total[h]);
            dp[t][i] = s[t][i] * (dp[t][i] - dot[h]);
            const int key = 8 * t + 2 * quad + (i & 1), r = warp * 16 + group + 8 * h;
            pt[key * width + r] = P::store(s[t][i]);
            dst[key * width + r] = P::store(dp[t][i]);
        }
    }
    // dq (+)= scale ds k
    const unsigned a[4] = {pack_pair<P>(dp[0][0], dp[0][1]), pack_pair<P>(dp[0][2], dp[0][3]),
                           pack_pair<P>(dp[1][0], dp[1][1]), pack_pair<P>(dp[1][2], dp[1][3])};
    for (int c = 0; c < d; c += 32) {
        float o[4][4];
        mma_weights_by_rows<P>(a, kt, c, group, quad, o);
        for (int h = 0; h < 2; ++h) {
            const long long el = at[h] + c + 8 * quad;
            float v[8], prev[8];
            if (add) {
                unpack8<P>(*reinterpret_cast<const uint4 *>(dq + el), prev);
            }
            for (int s2 = 0; s2 < 4; ++s2) {
                for (int u = 0; u < 2; ++u) {
                    const float x = scale * o[s2][2 * h + u];
                    v[2 * s2 + u] = add ? x + prev[2 * s2 + u] : x;
                }
            }
            store_n<P, 8>(dq + el, v);
        }
    }
    __syncthreads();
    // the keys' part: the rows' queries and output gradients transposed into shared memory
    // (consecutive threads take consecutive rows, as block_kv_mma the keys)
    const int per = d / 8;
    for (int i = threadIdx.x; i < g * 16 * per; i += blockDim.x) {
        const int r = i % (g * 16), c = (i / (g * 16)) * 8;
        const long long el =
            ((blk * 16 + r % 16) * heads + kvh * g + r / 16) * (long long)d + c;
        const uint4 x = *reinterpret_cast<const uint4 *>(q + el);
        const uint4 y = *reinterpret_cast<const uint4 *>(dout + el);
        const T *xe = reinterpret_cast<const T *>(&x), *ye = reinterpret_cast<const T *>(&y);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            qt[(c + u) * width + r] = xe[u];
            gt[(c + u) * width + r] = ye[u];
        }
    }
    __syncthreads();
    // dv = p^T dout and dk = scale ds^T q: 16 keys x 8 columns a tile, k over the g * 16 rows;
    // the warps take the column tiles in turn
    for (int tile = warp; tile < d / 8; tile += g) {
        float dv[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int col = tile * 8 + group;
        for (int k0 = 0; k0 < g * 16; k0 += 16) {
            const int kk = k0 + 2 * quad;
            const unsigned ap[4] = {
                *reinterpret_cast<const unsigned *>(pt + group * width + kk),
                *reinterpret_cast<const unsigned *>(pt + (group + 8) * width + kk),
                *reinterpret_cast<const unsigned *>(pt + group * width + kk + 8),
                *reinterpret_cast<const unsigned *>(pt + (group + 8) * width + kk + 8)};
            const unsigned ad[4] = {
                *reinterpret_cast<const unsigned *>(dst + group * width + kk),
                *reinterpret_cast<const unsigned *>(dst + (group + 8) * width + kk),
                *reinterpret_cast<const unsigned *>(dst + group * width + kk + 8),
                *reinterpret_cast<const unsigned *>(dst + (group + 8) * width + kk + 8)};
            mma_16816(P{}, dv, ap, *reinterpret_cast<const unsigned *>(gt + col * width + kk),
                      *reinterpret_cast<const unsigned *>(gt + col * width + kk + 8));
            mma_16816(P{}, dk, ad, *reinterpret_cast<const unsigned *>(qt + col * width + kk),
                      *reinterpret_cast<const unsigned *>(qt + col * width + kk + 8));
        }
        for (int h = 0; h < 2; ++h) {
            const long long el =
                ((blk * 16 + group + 8 * h) * kv + kvh) * (long long)d + tile * 8 + 2 * quad;
            *reinterpret_cast<unsigned *>(dvb + el) = pack_pair<P>(dv[2 * h], dv[2 * h + 1]);
            *reinterpret_cast<unsigned *>(dkb + el) =
                pack_pair<P>(scale * dk[2 * h], scale * dk[2 * h + 1]);
        }
    }
}

template <class P>
static __device__ void block_attention_fwd(
    const typename P::T *__restrict__ q, const typename P::T *__restrict__ kb,
    const typename P::T *__restrict__ vb, const typename P::T *__restrict__ o1,
    const float *__restrict__ lse1, const long long *__restrict__ anchors,
    typename P::T *__restrict__ out, float *__restrict__ lse, int heads, int kv, int d, int bs,
    int rows, float scale, int lanes) {
    if constexpr (sizeof(typename P::T) == 2) {
        if (lanes == BLOCK_ATTN_MMA) {
            block_attention_fwd_mma<P>(q, kb, vb, o1, lse1, anchors, out, lse, heads, kv, d, rows,
                                       scale);
            return;
        }
    }
    FUSED_DYNAMIC_SHARED(block_attn_shared);
    float *ks = reinterpret_cast<float *>(block_attn_shared), *vs = ks + bs * d;
    const long long blk = blockIdx.x;
    const int kvh = blockIdx.y, g = heads / kv;
    if (lanes == 8 || lanes == 16) {
        typedef typename P::T T;
        T *kr = reinterpret_cast<T *>(block_attn_shared), *vr = kr + bs * d;
        block_kv_raw<P>(kb, vb, blk, kvh, kv, d, bs, kr, vr);
        if (lanes == 16) {
            block_attention_fwd_lanes<P, 16>(q, o1, lse1, anchors, out, lse, kr, vr, blk, kvh,
                                             heads, kv, d, bs, rows, scale);
        } else {
            block_attention_fwd_lanes<P, 8>(q, o1, lse1, anchors, out, lse, kr, vr, blk, kvh,
                                            heads, kv, d, bs, rows, scale);
        }
        return;
    }
    block_kv_to_shared<P>(kb, vb, blk, kvh, kv, d, bs, ks, vs);
    const int t = threadIdx.x;
    if (t >= g * bs) {
        return;
    }
    const int head = kvh * g + t / bs, slot = t % bs;
    const int VEC = 16 / sizeof(typename P::T);
    if (d % VEC == 0 && aligned16(q) && aligned16(o1) && aligned16(out)) {
        block_attention_fwd_row<P, 16 / sizeof(typename P::T)>(
            q, o1, lse1, anchors, out, lse, ks, vs, blk, head, slot, heads, d, bs, rows, scale);
    } else {
        block_attention_fwd_row<P, 1>(q, o1, lse1, anchors, out, lse, ks, vs, blk, head, slot,
                                      heads, d, bs, rows, scale);
    }
}

// The row's part of the backward pass: its probabilities and score gradients into `ps`, `dss`
// (shared, [threads, BLOCK_ATTN_MAX]) and its query gradient added into dq.
template <class P, int N>
static __device__ __forceinline__ void block_attention_bwd_row(
    const typename P::T *q, const typename P::T *out, const typename P::T *dout,
    const float *lse, const long long *anchors, typename P::T *dq, const float *ks,
    const float *vs, float *ps, float *dss, long long blk, int head, int slot, int heads, int d,
    int bs, int rows, float scale) {
    const long long row = blk * bs + slot;
    const long long at = (row * heads + head) * (long long)d;
    float s[BLOCK_ATTN_MAX], dp[BLOCK_ATTN_MAX];
    block_scores<P, N>(q + at, ks, d, bs, scale, s);
    const long long e = row / rows, r = row - e * rows;
    const float total = lse[(e * heads + head) * rows + r];
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        s[j] = j < bs ? expf(s[j] - total) : 0.0f;
        dp[j] = 0.0f;
    }
    float dot = 0.0f;
    for (int c = 0; c < d; c += N) {
        float g[N], o[N];
        load_n<P, N>(dout + at + c, g);
        load_n<P, N>(out + at + c, o);
        for (int u = 0; u < N; ++u) {
            dot = fmaf(g[u], o[u], dot);
        }
#pragma unroll
        for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
            if (j < bs) {
                const float *vr = vs + j * d + c;
                float acc = dp[j];
                for (int u = 0; u < N; ++u) {
                    acc = fmaf(g[u], vr[u], acc);
                }
                dp[j] = acc;
            }
        }
    }
    const int t = threadIdx.x;
#pragma unroll
    for (int j = 0; j < BLOCK_ATTN_MAX; ++j) {
        dp[j] = s[j] * (dp[j] - dot);   // ds
        if (j < bs) {
            ps[t * BLOCK_ATTN_MAX + j] = s[j];
            dss[t * BLOCK_ATTN_MAX + j] = dp[j];
        }
    }
    // a block that sees no context: the context part wrote nothing meaningful to its dq
    const bool add = anchors[blk] > 0;
    for (int c = 0; c < d; c += N) {
        float acc[N], prev[N];
        weighted_rows<N>(dp, ks, c, d, bs, acc);
        if (add) {
            load_n<P, N>(dq + at + c, prev);
        }
        for (int u = 0; u < N; ++u) {
            acc[u] = fmaf(scale, acc[u], add ? prev[u] : 0.0f);
        }
        store_n<P, N>(dq + at + c, acc);
    }
}

// dk (of `src` = q, `coef` = the score gradients, times scale) or dv (of `src` = dout, `coef` =
// the probabilities) of the block's keys: task (j, c) sums over the block's g * bs rows.
template <class P, int N>
static __device__ __forceinline__ void block_attention_bwd_kv(
    const typename P::T *src, const float *coef, typename P::T *dst, long long blk, int kvh,
    int heads, int kv, int d, int bs, int g, float scale) {
    const int chunks = d / N, tasks = bs * chunks;
    for (int task = threadIdx.x; task < tasks; task += blockDim.x) {
        const int j = task / chunks, c = (task - j * chunks) * N;
        float acc[N];
        for (int u = 0; u < N; ++u) {
            acc[u] = 0.0f;
        }
#pragma unroll 4
        for (int i = 0; i < g * bs; ++i) {
            const int head = kvh * g + i / bs;
            const long long row = blk * bs + i % bs;
            float x[N];
            load_n<P, N>(src + (row * heads + head) * (long long)d + c, x);
            const float w = coef[i * BLOCK_ATTN_MAX + j];
            for (int u = 0; u < N; ++u) {
                acc[u] = fmaf(w, x[u], acc[u]);
            }
        }
        for (int u = 0; u < N; ++u) {
            acc[u] *= scale;
        }
        store_n<P, N>(dst + ((blk * bs + j) * kv + kvh) * (long long)d + c, acc);
    }
}

template <class P>
static __device__ void block_attention_bwd(
    const typename P::T *__restrict__ q, const typename P::T *__restrict__ kb,
    const typename P::T *__restrict__ vb, const typename P::T *__restrict__ out,
    const typename P::T *__restrict__ dout, const float *__restrict__ lse,
    const long long *__restrict__ anchors, typename P::T *__restrict__ dq,
    typename P::T *__restrict__ dkb, typename P::T *__restrict__ dvb, int heads, int kv, int d,
    int bs, int rows, float scale, int lanes) {
    if constexpr (sizeof(typename P::T) == 2) {
        if (lanes == BLOCK_ATTN_MMA) {
            block_attention_bwd_mma<P>(q, kb, vb, out, dout, lse, anchors, dq, dkb, dvb, heads, kv,
                                       d, rows, scale);
            return;
        }
    }
    FUSED_DYNAMIC_SHARED(block_attn_shared);
    const int g = heads / kv;
    float *ks = reinterpret_cast<float *>(block_attn_shared), *vs = ks + bs * d;
    float *ps = vs + bs * d, *dss = ps + g * bs * BLOCK_ATTN_MAX;
    const long long blk = blockIdx.x;
    const int kvh = blockIdx.y;
    typedef typename P::T T;
    // the warp-cooperative form's keys and values as stored, in the same space
    T *kr = reinterpret_cast<T *>(block_attn_shared), *vr = kr + bs * d;
    if (lanes == 8 || lanes == 16) {
        block_kv_raw<P>(kb, vb, blk, kvh, kv, d, bs, kr, vr);
    } else {
        block_kv_to_shared<P>(kb, vb, blk, kvh, kv, d, bs, ks, vs);
    }
    const int t = threadIdx.x;
    const int head = kvh * g + t / bs, slot = t % bs;
    const int VEC = 16 / sizeof(typename P::T);
    const bool vectors = d % VEC == 0 && aligned16(q) && aligned16(out) && aligned16(dout) &&
                         aligned16(dq) && aligned16(dkb) && aligned16(dvb);
    if (lanes == 16) {
        block_attention_bwd_lanes<P, 16>(q, out, dout, lse, anchors, dq, kr, vr, ps, dss, blk,
                                         kvh, heads, kv, d, bs, rows, scale);
    } else if (lanes == 8) {
        block_attention_bwd_lanes<P, 8>(q, out, dout, lse, anchors, dq, kr, vr, ps, dss, blk, kvh,
                                        heads, kv, d, bs, rows, scale);
    } else if (vectors) {
        // blockDim.x == g * bs: every thread is a row (the launch makes it so)
        block_attention_bwd_row<P, 16 / sizeof(typename P::T)>(q, out, dout, lse, anchors, dq,
                                                               ks, vs, ps, dss, blk, head, slot,
                                                               heads, d, bs, rows, scale);
    } else {
        block_attention_bwd_row<P, 1>(q, out, dout, lse, anchors, dq, ks, vs, ps, dss, blk, head,
                                      slot, heads, d, bs, rows, scale);
    }
    __syncthreads();
    if (lanes == 8 || lanes == 16) {
        block_attention_bwd_kv4<P>(q, dout, ps, dss, dkb, dvb, blk, kvh, heads, kv, d, bs, scale);
    } else if (vectors) {
        block_attention_bwd_kv<P, 16 / sizeof(typename P::T)>(q, dss, dkb, blk, kvh, heads, kv,
                                                              d, bs, g, scale);
        block_attention_bwd_kv<P, 16 / sizeof(typename P::T)>(dout, ps, dvb, blk, kvh, heads, kv,
                                                              d, bs, g, 1.0f);
    } else {
        block_attention_bwd_kv<P, 1>(q, dss, dkb, blk, kvh, heads, kv, d, bs, g, scale);
        block_attention_bwd_kv<P, 1>(dout, ps, dvb, blk, kvh, heads, kv, d, bs, g, 1.0f);
    }
}

#define DFLASH_FUSED_KERNELS(SUFFIX, P)                                                      \
    extern "C" __global__ void rotate_write_##SUFFIX(                                        \
        const P::T *y, int layers, int heads, int kv, int d, const P::T *q_norm,             \
        const P::T *k_norm, float eps, const P::T *cos, const P::T *sin,                     \
        const long long *rows, P::T *q_out, P::T *k_cache, P::T *v_cache,                    \
        long long layer_stride) {                                                            \
        rotate_write<P>(y, layers, heads, kv, d, q_norm, k_norm, eps, cos, sin, rows, q_out, \
                        k_cache, v_cache, layer_stride);                                     \
    }                                                                                        \
    extern "C" __global__ void block_attention_fwd_##SUFFIX(                                 \
        const P::T *q, const P::T *kb, const P::T *vb, const P::T *o1, const float *lse1,   \
        const long long *anchors, P::T *out, float *lse, int heads, int kv, int d, int bs,   \
        int rows, float scale, int lanes) {                                                  \
        block_attention_fwd<P>(q, kb, vb, o1, lse1, anchors, out, lse, heads, kv, d, bs,     \
                               rows, scale, lanes);                                          \
    }                                                                                        \
    extern "C" __global__ void block_attention_bwd_##SUFFIX(                                 \
        const P::T *q, const P::T *kb, const P::T *vb, const P::T *out, const P::T *dout,    \
        const float *lse, const long long *anchors, P::T *dq, P::T *dkb, P::T *dvb,          \
        int heads, int kv, int d, int bs, int rows, float scale, int lanes) {                \
        block_attention_bwd<P>(q, kb, vb, out, dout, lse, anchors, dq, dkb, dvb, heads, kv,  \
                               d, bs, rows, scale, lanes);                                   \
    }                                                                                        \
    extern "C" __global__ void silu_mul_##SUFFIX(const P::T *both, P::T *out, long long n,  \
                                                 long long width) {                          \
        silu_mul<P>(both, out, n, width);                                                    \
    }                                                                                        \
    extern "C" __global__ void scaled_rms_norm_##SUFFIX(                                     \
        const P::T *x, RowLayout xl, const float *scale, P::T *y, long long rows, int width,  \
        float eps, int row_threads) {                                                        \
        scaled_rms_norm<P>(x, xl, scale, y, rows, width, eps, row_threads);                  \
    }                                                                                        \
    extern "C" __global__ void gated_rms_norm_##SUFFIX(                                      \
        const P::T *x, RowLayout xl, const P::T *z, RowLayout zl, const P::T *w, P::T *out,  \
        long long rows, int width, float eps, int row_threads) {                             \
        gated_rms_norm<P>(x, xl, z, zl, w, out, rows, width, eps, row_threads);              \
    }                                                                                        \
    extern "C" __global__ void rms_norm_backward_##SUFFIX(                                   \
        const P::T *x, const P::T *w, const P::T *g, const P::T *r, P::T *dx, float *dw_part, \
        long long rows, int width, float eps, int row_threads) {                             \
        rms_norm_backward<P>(x, w, g, r, dx, dw_part, rows, width, eps, row_threads);        \
    }                                                                                        \
    extern "C" __global__ void add_rms_norm_##SUFFIX(                                        \
        const P::T *h, const P::T *a, const float *scale, P::T *s, P::T *y, long long rows,  \
        int width, float eps, int row_threads) {                                             \
        add_rms_norm<P>(h, a, scale, s, y, rows, width, eps, row_threads);                   \
    }                                                                                        \
    extern "C" __global__ void gdn_gates_##SUFFIX(                                           \
        const P::T *a, const P::T *b, long long row_stride, int heads, long long rows,       \
        const P::T *dt_bias, const float *neg_a, float *g, P::T *beta) {                     \
        gdn_gates<P>(a, b, row_stride, heads, rows, dt_bias, neg_a, g, beta);                \
    }                                                                                        \
    extern "C" __global__ void moe_combine_##SUFFIX(                                         \
        const P::T *y, const long long *pos, const P::T *w, const P::T *shared,             \
        const P::T *gate, P::T *out, long long hidden, int k, int vectors, int accumulate) { \
        moe_combine<P>(y, pos, w, shared, gate, out, hidden, k, vectors, accumulate);        \
    }                                                                                        \
    extern "C" __global__ void cross_entropy_grad_##SUFFIX(                                  \
        P::T *logits, long long vocab, const long long *labels, const float *scale,          \
        float *loss, float *correct) {                                                       \
        cross_entropy_grad<P>(logits, vocab, labels, scale, loss, correct);                  \
    }                                                                                        \
    extern "C" __global__ void rotary_##SUFFIX(const P::T *x, const P::T *cos,              \
                                               const P::T *sin, P::T *out, long long rows,   \
                                               int heads, int d, int inverse, int vec) {     \
        rotary<P>(x, cos, sin, out, rows, heads, d, inverse, vec);                           \
    }                                                                                        \
    extern "C" __global__ void swiglu_##SUFFIX(const P::T *gate, const P::T *up,            \
                                               const P::T *grad, P::T *out, P::T *d_up,      \
                                               long long n) {                                \
        swiglu<P>(gate, up, grad, out, d_up, n);                                             \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * GATED_PREP_WARPS)                      \
        gated_attention_prep_##SUFFIX(const P::T *y, long long row_stride, long long n,      \
                                      int heads, int kv, int d, int rot,                     \
                                      const float *q_scale, const float *k_scale, float eps, \
                                      const P::T *cos, const P::T *sin, long long m,         \
                                      P::T *q_out, P::T *k_out) {                            \
        gated_attention_prep<P>(y, row_stride, n, heads, kv, d, rot, q_scale, k_scale, eps,  \
                                cos, sin, m, q_out, k_out);                                  \
    }                                                                                        \
    extern "C" __global__ void sigmoid_gate_mul_##SUFFIX(const P::T *attn, const P::T *y,   \
                                                         long long row_stride, long long n,  \
                                                         int heads, int d, P::T *out) {      \
        sigmoid_gate_mul<P>(attn, y, row_stride, n, heads, d, out);                          \
    }                                                                                        \
    extern "C" __global__ void adamw_step_##SUFFIX(                                          \
        const P::T *grad, P::T *param, float *master, float *exp_avg, float *exp_avg_sq,     \
        long long n, const float *grad_scale, AdamWRates rates) {                            \
        adamw_step<P>(grad, param, master, exp_avg, exp_avg_sq, n, grad_scale, rates);       \
    }

DFLASH_FUSED_KERNELS(bf16, Bf16)
DFLASH_FUSED_KERNELS(f16, F16)
DFLASH_FUSED_KERNELS(f32, F32)
