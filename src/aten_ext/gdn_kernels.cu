// The gated delta rule of Gated DeltaNet layers (Qwen3.5 / Qwen3-Next linear attention),
// compiled at run time by NVRTC (the Rust side is src/aten_ext/gdn.rs; the rule as a libtorch
// loop is its `reference`). Per value head h (reading key head h / (Hv / Hk)) and time step t,
// with q and k optionally l2-normalised and q scaled by 1 / sqrt(K), the state S [K, V] (fp32):
//
//   S = exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S = S + k_t u^T;   o_t = S^T q_t
//
// The columns of S are independent: column j is a K-vector s_j with
//   u_j = beta (v_j - a s_j.k),   s_j = a s_j + k u_j,   o_j = a s_j.q + (k.q) u_j
// (a = exp(g); o written from the old s_j, which is the same number). So one block runs 16
// columns of one head through all T steps with the state in registers: 8 threads per column,
// each holding K / 8 of its rows, the two dot products summed over the 8 threads with warp
// shuffles. No block waits on another. The decay is applied lazily: the registers hold s / c
// for a running product c of the decays (renormalised before it leaves [1e-9, 1e9]), so that a
// row costs 3 FMAs per step (two dot products, one update) instead of 3 and a multiply; a step
// is then ~95 instructions per warp at K = 128. The q / k rows of a tile of steps are staged
// in shared memory as fp32, normalised once per step (and their product k.q with them), with
// exp(g), beta and the block's values.
//
// Thread layout: thread = column * 8 + slice. Slice p holds the rows 4 (p + 8 m) + x, for
// m < K / 32 and x < 4 (in its registers 4 m + x): four consecutive rows per float4, so that
// the 8 slices of a warp read 32 consecutive floats of a staged row (no bank conflicts) and
// the warp's 4 columns share them.
//
// No system headers: storage types are converted by hand (bf16, f16, storage_types.cuh) so
// that NVRTC needs nothing but itself.

#include "storage_types.cuh"

#define GDN_SLICES 8                              // threads per value column
#define GDN_COLUMNS 16                            // value columns per block
#define GDN_THREADS (GDN_SLICES * GDN_COLUMNS)    // 128
#define GDN_WARPS (GDN_THREADS / 32)
#define GDN_TILE_FLOATS 4096                      // staged floats per q (or k) tile: steps * K

// The launch's arguments (one struct, every field 8 bytes: its layout is the Rust
// `GdnParams`'s). Element strides; the last dimension of q, k, v is dense.
struct GdnParams {
    const void *q;            // [B, T, Hk, K], storage type
    const void *k;            // [B, T, Hk, K], storage type
    const void *v;            // [B, T, Hv, V], storage type
    const void *g;            // [B, T, Hv] dense: float32 or the storage type
    const void *beta;         // [B, T, Hv] dense: float32 or the storage type
    const float *initial;     // [B, Hv, K, V], or null for zeros
    void *out;                // [B, T, Hv, V] dense, storage type
    float *final_state;       // [B, Hv, K, V], or null
    float *states;            // [B, T, Hv, K, V]: the state after every step, or null
    long long q_stride[3];    // batch, time, head
    long long k_stride[3];
    long long v_stride[3];
    long long steps;          // T
    long long key_heads;      // Hk
    long long value_heads;    // Hv (a multiple of Hk)
    long long value_dim;      // V
    long long g_is_f32;       // else g is in the storage type
    long long beta_is_f32;    // else beta is in the storage type
    long long l2norm;         // l2-normalise q and k (x / sqrt(sum x^2 + 1e-6))
};

// The sum of `v` over the warp, returned to every lane.
static __device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The sum of `v` over the 8 lanes of one column (lanes 8 c .. 8 c + 7), returned to each.
static __device__ __forceinline__ float column_sum(float v) {
    for (int offset = GDN_SLICES / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// A float32 or storage-type scalar of g / beta.
template <class P>
static __device__ __forceinline__ float load_scalar(const void *base, long long is_f32,
                                                    long long idx) {
    return is_f32 ? ((const float *)base)[idx] : P::load(((const typename P::T *)base)[idx]);
}

// The state row of register e of slice `slice`: rows 4 (slice + 8 m) + x hold registers
// 4 m + x.
static __device__ __forceinline__ long long row_of(int slice, int e) {
    return 4 * (slice + GDN_SLICES * (e / 4)) + e % 4;
}

// One block: columns blockIdx.x * 16 .. + 15 of value head blockIdx.y % Hv of batch row
// blockIdx.y / Hv, through all steps. 128 threads.
template <class P, int K>
static __device__ void gdn_recurrent(const GdnParams &p) {
    typedef typename P::T T;
    static_assert(K % 32 == 0 && K <= 256, "K: a multiple of 32, at most 256");
    const int ROWS = K / GDN_SLICES;    // state rows per thread
    const int CHUNKS = K / 32;          // float4s of them (also: a staging lane's elements)
    const int TILE = GDN_TILE_FLOATS / K;
    __shared__ float4 k_tile[GDN_TILE_FLOATS / 4];   // [TILE][K] as float4
    __shared__ float4 q_tile[GDN_TILE_FLOATS / 4];
    __shared__ float decay_tile[TILE], beta_tile[TILE], kq_tile[TILE];
    __shared__ float v_tile[TILE][GDN_COLUMNS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int column = tid / GDN_SLICES, slice = tid % GDN_SLICES;
    const long long hv = p.value_heads, vd = p.value_dim, steps = p.steps;
    const long long h = blockIdx.y % hv, b = blockIdx.y / hv;
    const long long hk = h / (hv / p.key_heads);
    const long long j0 = (long long)blockIdx.x * GDN_COLUMNS;
    const long long j = j0 + column;
    const bool active = j < vd;
    const long long head_state = (b * hv + h) * K * vd;   // this head's [K, V] state

    float s[ROWS];
#pragma unroll
    for (int e = 0; e < ROWS; ++e) {
        s[e] = (p.initial != nullptr && active) ? p.initial[head_state + row_of(slice, e) * vd + j]
                                                : 0.0f;
    }
    float lazy_decay = 1.0f;

    const T *q = (const T *)p.q, *k = (const T *)p.k, *v = (const T *)p.v;
    const float scale = rsqrtf((float)K);
    for (long long t0 = 0; t0 < steps; t0 += TILE) {
        const int n = (int)min((long long)TILE, steps - t0);
        __syncthreads();   // the previous tile is read
        // q and k of each step, one warp per step: normalised, q scaled, and their product
        for (int r = warp; r < n; r += GDN_WARPS) {
            const long long t = t0 + r;
            const T *kr = k + b * p.k_stride[0] + t * p.k_stride[1] + hk * p.k_stride[2];
            const T *qr = q + b * p.q_stride[0] + t * p.q_stride[1] + hk * p.q_stride[2];
            float kx[CHUNKS], qx[CHUNKS];
            float kk = 0.0f, qq = 0.0f;
#pragma unroll
            for (int x = 0; x < CHUNKS; ++x) {
                kx[x] = P::load(kr[lane + 32 * x]);
                qx[x] = P::load(qr[lane + 32 * x]);
                kk += kx[x] * kx[x];
                qq += qx[x] * qx[x];
            }
            float k_norm = 1.0f, q_norm = 1.0f;
            if (p.l2norm) {
                k_norm = rsqrtf(warp_sum(kk) + 1e-6f);
                q_norm = rsqrtf(warp_sum(qq) + 1e-6f);
            }
            float *ks = (float *)k_tile + r * K, *qs = (float *)q_tile + r * K;
            float kq = 0.0f;
#pragma unroll
            for (int x = 0; x < CHUNKS; ++x) {
                const float kn = kx[x] * k_norm, qn = (qx[x] * q_norm) * scale;
                ks[lane + 32 * x] = kn;
                qs[lane + 32 * x] = qn;
                kq += kn * qn;
            }
            kq = warp_sum(kq);
            if (lane == 0) {
                kq_tile[r] = kq;
            }
        }
        for (int r = tid; r < n; r += GDN_THREADS) {
            const long long idx = (b * steps + t0 + r) * hv + h;
            decay_tile[r] = expf(load_scalar<P>(p.g, p.g_is_f32, idx));
            beta_tile[r] = load_scalar<P>(p.beta, p.beta_is_f32, idx);
        }
        for (int x = tid; x < n * GDN_COLUMNS; x += GDN_THREADS) {
            const int r = x / GDN_COLUMNS, c = x % GDN_COLUMNS;
            const long long jj = j0 + c;
            const long long at = b * p.v_stride[0] + (t0 + r) * p.v_stride[1] + h * p.v_stride[2];
            v_tile[r][c] = jj < vd ? P::load(v[at + jj]) : 0.0f;
        }
        __syncthreads();

        // where step t0's output and state of this column go (then one step further each step)
        long long out_at = ((b * steps + t0) * hv + h) * vd + j;
        long long state_at = ((b * steps + t0) * hv + h) * K * vd + j;
        for (int r = 0; r < n; ++r, out_at += hv * vd, state_at += hv * K * vd) {
            // decay lazily: s = c * (the registers); renormalised before c leaves [1e-9, 1e9]
            // (uniform over the block: every thread sees the same decays)
            float c = lazy_decay * decay_tile[r];
            if (!(c >= 1e-9f && c <= 1e9f)) {
#pragma unroll
                for (int e = 0; e < ROWS; ++e) {
                    s[e] *= c;
                }
                c = 1.0f;
            }
            const float4 *kr = k_tile + r * (K / 4), *qr = q_tile + r * (K / 4);
            float kv[ROWS];
            float dk0 = 0.0f, dk1 = 0.0f, dq0 = 0.0f, dq1 = 0.0f;
#pragma unroll
            for (int m = 0; m < CHUNKS; ++m) {
                const float4 kc = kr[slice + GDN_SLICES * m];
                const float4 qc = qr[slice + GDN_SLICES * m];
                kv[4 * m] = kc.x;
                kv[4 * m + 1] = kc.y;
                kv[4 * m + 2] = kc.z;
                kv[4 * m + 3] = kc.w;
                dk0 = fmaf(s[4 * m], kc.x, dk0);
                dk1 = fmaf(s[4 * m + 1], kc.y, dk1);
                dk0 = fmaf(s[4 * m + 2], kc.z, dk0);
                dk1 = fmaf(s[4 * m + 3], kc.w, dk1);
                dq0 = fmaf(s[4 * m], qc.x, dq0);
                dq1 = fmaf(s[4 * m + 1], qc.y, dq1);
                dq0 = fmaf(s[4 * m + 2], qc.z, dq0);
                dq1 = fmaf(s[4 * m + 3], qc.w, dq1);
            }
            // with the decayed state a s = c (registers): s.k and s.q
            const float dk = c * column_sum(dk0 + dk1), dq = c * column_sum(dq0 + dq1);
            const float u = beta_tile[r] * (v_tile[r][column] - dk);
            if (active && slice == 0) {
                ((T *)p.out)[out_at] = P::store(dq + kq_tile[r] * u);
            }
            // s = a s + k u, i.e. registers += k (u / c)
            const float w = u * __frcp_rn(c);
#pragma unroll
            for (int e = 0; e < ROWS; ++e) {
                s[e] = fmaf(kv[e], w, s[e]);
            }
            lazy_decay = c;
            if (p.states != nullptr && active) {
#pragma unroll
                for (int e = 0; e < ROWS; ++e) {
                    p.states[state_at + row_of(slice, e) * vd] = s[e] * c;
                }
            }
        }
    }
    if (p.final_state != nullptr && active) {
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            p.final_state[head_state + row_of(slice, e) * vd + j] = s[e] * lazy_decay;
        }
    }
}

#define DFLASH_GDN_KERNEL(SUFFIX, P, K)                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                            \
        gdn_recurrent_##SUFFIX##_k##K(const GdnParams p) {                               \
        gdn_recurrent<P, K>(p);                                                          \
    }

#define DFLASH_GDN_KERNELS(SUFFIX, P)  \
    DFLASH_GDN_KERNEL(SUFFIX, P, 32)   \
    DFLASH_GDN_KERNEL(SUFFIX, P, 64)   \
    DFLASH_GDN_KERNEL(SUFFIX, P, 128)  \
    DFLASH_GDN_KERNEL(SUFFIX, P, 256)

DFLASH_GDN_KERNELS(bf16, Bf16)
DFLASH_GDN_KERNELS(f16, F16)
DFLASH_GDN_KERNELS(f32, F32)

// The chunked form for long prefills: in float32, then on tensor cores for bf16 and f16
// storage; and the causal convolution and SiLU before the rule. Files of their own for their
// size, handed to NVRTC as headers by src/aten_ext/nvrtc.rs.
#include "gdn_chunked.cuh"
#include "gdn_chunked_tc.cuh"
#include "gdn_conv.cuh"
