// The chunked form of the gated delta rule on tensor cores, for bf16 and f16 storage (included
// by gdn_kernels.cu after the float32 chunked kernels of gdn_chunked.cuh, whose sizes,
// parameters and helpers it shares; launched by src/aten_ext/gdn_chunked.rs).
//
// The same two steps as gdn_chunk_prep / gdn_chunk_scan, with every matrix product a warp-level
// TF32 mma.sync (m16n8k8, float32 accumulation; sm_80 and later). bf16 and f16 values are exact
// in TF32, so the raw q, k and v enter the products as they are, and the l2 norms, 1 / sqrt(K),
// decays and beta scale the products' rows and columns in float32. What the kernels compute
// (W, P, u, the state) is rounded to TF32 (cvt.rna) only where it is an operand; the state
// itself is carried from chunk to chunk in float32 accumulators.
//
// gdn_tc_prep (8 warps per chunk and value head, all chunks at once): with the chunk's raw k, q
// and v staged in shared memory (cp.async), K K^T and Q K^T give A and P; T = (I + A)^-1 by
// forward substitution (one thread per column); W = T diag(beta e^gamma rk) K and
// U' = T diag(beta) V. It writes W ([C, K], TF32), U' ([C, V], float32), P ([C, C], TF32, zero
// above the diagonal) and three rows of per-token scales: e^gamma_i rq_i (the outputs' first
// term; rq includes 1 / sqrt(K)), e^(gamma_C - gamma_i) rk_i (the state's update), e^gamma_C.
//
// gdn_tc_scan (16 warps per 64 value columns of a head, through its chunks; gdn_tc_scan_narrow
// the same over 32 columns, for calls with too few heads to fill the GPU): per chunk
// X = [W; Q] S0 with the state's columns in shared memory as TF32; u = U' - W S0; then
// O = diag(e^gamma rq) Q S0 + P u and S = e^gamma_C S0 + K^T diag(kscale) u, each warp holding
// its tiles of S in registers. The next chunk's W and q are copied into shared memory while this
// one's second half computes, its k, P and scales while the next chunk's first half does.
//
// Fragment layouts are those of mma.m16n8k8 with .tf32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k8"): lane = 4 g + t4; A (16 x 8, row-major) a0 (g, t4), a1 (g + 8, t4), a2 (g, t4 + 4),
// a3 (g + 8, t4 + 4); B (8 x 8) b0 (t4, g), b1 (t4 + 4, g); C / D (16 x 8) c0 (g, 2 t4),
// c1 (g, 2 t4 + 1), c2 (g + 8, 2 t4), c3 (g + 8, 2 t4 + 1). Row strides in shared memory are
// chosen so that a warp's 32 fragment reads fall in distinct banks (or share words): 132 and 68
// floats (4 mod 32) for A operands read by rows, 72 floats (8 mod 32) for B operands, 136 halves
// for raw rows read either way.
//
// Requirements the Rust side checks: key heads of 128, value heads a multiple of 64 up to 128,
// q, k, v rows and token strides 16-byte aligned (cp.async copies 16 bytes).

#define GDN_TC_PREP_THREADS 256
#define GDN_TC_SCAN_THREADS 512
#define GDN_TC_COLUMNS 64                   // value columns per scan block (the wide scan)
#define GDN_TC_NARROW_COLUMNS 32            // value columns per block of the narrow scan
#define GDN_TC_MAX_V 128                    // the largest value head the prep stages
#define GDN_HROW (GDN_CHUNK_K + 8)          // halves: a staged raw row of q, k or v
#define GDN_FROW (GDN_CHUNK + 4)            // floats: a row of A, T or P
#define GDN_WROW (GDN_CHUNK_K + 4)          // floats: a row of W
// floats: a row of the state or of u (B operands) in a scan block of COLS value columns
#define GDN_BROW(COLS) ((COLS) + 8)

// bytes of the two kernels' dynamic shared memory (gdn_chunked.rs computes the same)
#define GDN_TC_PREP_BYTES (4 * GDN_CHUNK * GDN_FROW * 4 + 4 * GDN_CHUNK * 4)
#define GDN_TC_SCAN_BYTES_FOR(COLS)                                                            \
    (4 * (GDN_CHUNK * GDN_WROW + GDN_CHUNK * GDN_FROW + GDN_CHUNK_K * GDN_BROW(COLS) +         \
          2 * GDN_CHUNK * GDN_BROW(COLS) + 3 * GDN_CHUNK) +                                    \
     2 * 2 * GDN_CHUNK * GDN_HROW)
#define GDN_TC_SCAN_BYTES GDN_TC_SCAN_BYTES_FOR(GDN_TC_COLUMNS)
#define GDN_TC_NARROW_SCAN_BYTES GDN_TC_SCAN_BYTES_FOR(GDN_TC_NARROW_COLUMNS)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

#ifndef DFLASH_EMULATED_ASM   // (tests/cuda_emulation/cuda_emu.h defines these on the CPU)
// x rounded to TF32 (to nearest, ties away), as a float32 bit pattern.
static __device__ __forceinline__ unsigned tf32_bits(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// d += a b for one 16 x 8 x 8 tile (operands as TF32 bit patterns).
static __device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                                unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Starts copying 16 bytes from global to shared memory; zeros where !valid (nothing read).
static __device__ __forceinline__ void copy16_async(void *shared, const void *global, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(shared);
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global),
                 "r"(bytes)
                 : "memory");
}

// Waits for this thread's copies (a barrier then makes everyone's visible).
static __device__ __forceinline__ void wait_async_copies() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}
#endif

// The value x rounded to TF32, as a float.
static __device__ __forceinline__ float tf32_round(float x) {
    return __uint_as_float(tf32_bits(x));
}

// A stored value (exact in TF32) as an operand.
template <class P>
static __device__ __forceinline__ unsigned raw_bits(typename P::T v) {
    return __float_as_uint(P::load(v));
}

// Copies `rows` rows of `width` values (a multiple of 8) of a [B, T, H, D] input from token t0
// into dst[r * GDN_HROW + d]; rows past the end are zero.
template <class P>
static __device__ __forceinline__ void stage_raw_rows(const GdnParams &p, const void *base,
                                                      const long long *stride, long long b,
                                                      long long t0, long long head, int width,
                                                      typename P::T *dst, int tid, int threads) {
    typedef typename P::T T;
    const int pieces = width / 8;
    for (int e = tid; e < GDN_CHUNK * pieces; e += threads) {
        const int r = e / pieces, part = e % pieces;
        const long long t = t0 + r;
        const bool valid = t < p.steps;
        const T *src = (const T *)base + b * stride[0] + (valid ? t : 0) * stride[1] +
                       head * stride[2] + part * 8;
        copy16_async(dst + r * GDN_HROW + part * 8, src, valid);
    }
}

// A TF32 A-operand fragment from float rows (stride `ld`) at row r0, column c0.
static __device__ __forceinline__ void a_fragment(const float *m, int ld, int r0, int c0, int g,
                                                  int t4, unsigned (&a)[4]) {
    a[0] = __float_as_uint(m[(r0 + g) * ld + c0 + t4]);
    a[1] = __float_as_uint(m[(r0 + g + 8) * ld + c0 + t4]);
    a[2] = __float_as_uint(m[(r0 + g) * ld + c0 + t4 + 4]);
    a[3] = __float_as_uint(m[(r0 + g + 8) * ld + c0 + t4 + 4]);
}

// The same from raw rows (stride GDN_HROW).
template <class P>
static __device__ __forceinline__ void a_fragment_raw(const typename P::T *m, int r0, int c0,
                                                      int g, int t4, unsigned (&a)[4]) {
    a[0] = raw_bits<P>(m[(r0 + g) * GDN_HROW + c0 + t4]);
    a[1] = raw_bits<P>(m[(r0 + g + 8) * GDN_HROW + c0 + t4]);
    a[2] = raw_bits<P>(m[(r0 + g) * GDN_HROW + c0 + t4 + 4]);
    a[3] = raw_bits<P>(m[(r0 + g + 8) * GDN_HROW + c0 + t4 + 4]);
}

// A stores pairs of adjacent values (c0, c1 or c2, c3 of a fragment) in one 4-byte write.
template <class P>
static __device__ __forceinline__ void store_pair(typename P::T *dst, float x, float y) {
    *(unsigned *)dst = (unsigned)P::store(x) | ((unsigned)P::store(y) << 16);
}

// Zeroes N accumulator fragments.
template <int N>
static __device__ __forceinline__ void zero_tiles(float (&x)[N][4]) {
#pragma unroll
    for (int c = 0; c < N; ++c) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            x[c][r] = 0.0f;
        }
    }
}

// acc[c] = rows 16 m .. 16 m + 15 of the lower-triangular `t` [C][GDN_FROW] (TF32) times
// column tile n0 + c (8 columns) of the raw rows `b` [C][GDN_HROW], for c < tiles (at most 8);
// the k-steps right of the row tile, where t is zero, are skipped.
template <class P>
static __device__ __forceinline__ void lower_times_raw(const float *t, const typename P::T *b,
                                                       int m, int n0, int tiles, int g, int t4,
                                                       float (&acc)[8][4]) {
    zero_tiles(acc);
#pragma unroll
    for (int s = 0; s < GDN_CHUNK / 8; ++s) {
        if (8 * s <= 16 * m + 15) {
            unsigned a[4];
            a_fragment(t, GDN_FROW, 16 * m, 8 * s, g, t4, a);
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                if (c < tiles) {
                    const int col = 8 * (n0 + c) + g;
                    mma_tf32(acc[c], a, raw_bits<P>(b[(8 * s + t4) * GDN_HROW + col]),
                             raw_bits<P>(b[(8 * s + t4 + 4) * GDN_HROW + col]));
                }
            }
        }
    }
}

// One block per (chunk, batch row x value head): W, U', P and the scales of the chunk.
template <class P>
static __device__ void gdn_tc_prep(const GdnChunkParams &cp) {
    typedef typename P::T T;
    const int C = GDN_CHUNK, K = GDN_CHUNK_K;
    const GdnParams &p = cp.rule;
    GDN_DYNAMIC_SHARED(shared);
    T *kh = (T *)shared;                         // [C][GDN_HROW]: raw keys
    T *qh = kh + C * GDN_HROW;                   // [C][GDN_HROW]: raw queries
    T *vh = qh + C * GDN_HROW;                   // [C][GDN_HROW]: raw values
    float *am = (float *)(vh + C * GDN_HROW);    // [C][GDN_FROW]: A, then T diag(beta e^gamma rk)
    float *tu = (float *)qh;                     // [C][GDN_FROW]: T diag(beta), once q is read
    float *gam = am + C * GDN_FROW;              // [C]
    float *bet = gam + C;                        // [C]
    float *rk = bet + C;                         // [C]: the keys' inverse norms
    float *rq = rk + C;                          // [C]: the queries' inverse norms / sqrt(K)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const long long hv = p.value_heads, vd = p.value_dim, n = blockIdx.x;
    const long long h = blockIdx.y % hv, b = blockIdx.y / hv;
    const long long hk = h / (hv / p.key_heads);
    const long long t0 = n * C;
    const long long chunk = (b * hv + h) * cp.chunks + n;   // this chunk's index in the buffers

    stage_raw_rows<P>(p, p.k, p.k_stride, b, t0, hk, K, kh, tid, GDN_TC_PREP_THREADS);
    stage_raw_rows<P>(p, p.q, p.q_stride, b, t0, hk, K, qh, tid, GDN_TC_PREP_THREADS);
    stage_raw_rows<P>(p, p.v, p.v_stride, b, t0, h, (int)vd, vh, tid, GDN_TC_PREP_THREADS);
    if (tid < C) {
        const long long t = t0 + tid;
        const long long idx = (b * p.steps + t) * hv + h;
        const bool valid = t < p.steps;
        const float gt = valid ? load_scalar<P>(p.g, p.g_is_f32, idx) : 0.0f;
        gam[tid] = fmaxf(gt, GDN_MIN_LOG_DECAY);
        bet[tid] = valid ? load_scalar<P>(p.beta, p.beta_is_f32, idx) : 0.0f;
    }
    wait_async_copies();
    __syncthreads();

    // the rows' norms (warp w: rows w, w + 8, ...; 4 values per lane), gamma's prefix sums
    const float inv_sqrt_k = rsqrtf((float)K);
    for (int r = warp; r < C; r += GDN_TC_PREP_THREADS / 32) {
        float sk = 0.0f, sq = 0.0f;
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const float kv = P::load(kh[r * GDN_HROW + 4 * lane + x]);
            const float qv = P::load(qh[r * GDN_HROW + 4 * lane + x]);
            sk += kv * kv;
            sq += qv * qv;
        }
        sk = warp_sum(sk);
        sq = warp_sum(sq);
        if (lane == 0) {
            rk[r] = p.l2norm ? rsqrtf(sk + 1e-6f) : 1.0f;
            rq[r] = (p.l2norm ? rsqrtf(sq + 1e-6f) : 1.0f) * inv_sqrt_k;
        }
    }
    if (warp == 0) {
        chunk_cumsum(gam, lane);
    }
    __syncthreads();
    if (tid < C) {
        float *scales = cp.gamma + chunk * 3 * C;
        scales[tid] = expf(gam[tid]) * rq[tid];
        scales[C + tid] = expf(gam[C - 1] - gam[tid]) * rk[tid];
        scales[2 * C + tid] = expf(gam[C - 1]);
    }

    // K K^T and Q K^T: warp (m, quarter) takes row tile m (16 rows) and column tiles
    // 4 quarter .. 4 quarter + 3 (8 columns each); tiles wholly above the diagonal stay zero
    {
        const int m = warp & 3, nb = 4 * (warp >> 2);
        float kk[4][4], qk[4][4];
        zero_tiles(kk);
        zero_tiles(qk);
#pragma unroll 4
        for (int s = 0; s < K / 8; ++s) {
            unsigned ak[4], aq[4];
            a_fragment_raw<P>(kh, 16 * m, 8 * s, g, t4, ak);
            a_fragment_raw<P>(qh, 16 * m, 8 * s, g, t4, aq);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int nt = nb + c;
                if (8 * nt <= 16 * m + 15) {
                    const unsigned b0 = raw_bits<P>(kh[(8 * nt + g) * GDN_HROW + 8 * s + t4]);
                    const unsigned b1 = raw_bits<P>(kh[(8 * nt + g) * GDN_HROW + 8 * s + t4 + 4]);
                    mma_tf32(kk[c], ak, b0, b1);
                    mma_tf32(qk[c], aq, b0, b1);
                }
            }
        }
        float *pg = cp.p + chunk * C * C;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float pv[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 16 * m + g + 8 * (r >> 1), j = 8 * (nb + c) + 2 * t4 + (r & 1);
                const float decay = j <= i ? expf(gam[i] - gam[j]) : 0.0f;
                am[i * GDN_FROW + j] = j < i ? bet[i] * decay * rk[i] * rk[j] * kk[c][r] : 0.0f;
                pv[r] = tf32_round(decay * rq[i] * rk[j] * qk[c][r]);
            }
            const int i = 16 * m + g, j = 8 * (nb + c) + 2 * t4;
            *(float2 *)(pg + i * C + j) = float2{pv[0], pv[1]};
            *(float2 *)(pg + (i + 8) * C + j) = float2{pv[2], pv[3]};
        }
    }
    __syncthreads();

    // T = (I + A)^-1, column `tid` per thread: x_i = [i = c] - sum_{j < i} A_ij x_j, the sum
    // in four independent partial sums (a chain of i / 4 dependent FMAs per row, not i)
    float x[C];
    if (tid < C) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
            float r[4] = {i == tid ? 1.0f : 0.0f, 0.0f, 0.0f, 0.0f};
            const float *arow = am + i * GDN_FROW;
#pragma unroll
            for (int j = 0; j < (i & ~3); j += 4) {
                const float4 a4 = *(const float4 *)(arow + j);
                r[0] = fmaf(-a4.x, x[j], r[0]);
                r[1] = fmaf(-a4.y, x[j + 1], r[1]);
                r[2] = fmaf(-a4.z, x[j + 2], r[2]);
                r[3] = fmaf(-a4.w, x[j + 3], r[3]);
            }
#pragma unroll
            for (int j = i & ~3; j < i; ++j) {
                r[j & 3] = fmaf(-arow[j], x[j], r[j & 3]);
            }
            x[i] = (r[0] + r[1]) + (r[2] + r[3]);
        }
    }
    __syncthreads();   // A and q are read: T's two scaled copies take their places
    if (tid < C) {
        const float sw = bet[tid] * expf(gam[tid]) * rk[tid], su = bet[tid];
#pragma unroll
        for (int i = 0; i < C; ++i) {
            am[i * GDN_FROW + tid] = tf32_round(x[i] * sw);
            tu[i * GDN_FROW + tid] = tf32_round(x[i] * su);
        }
    }
    __syncthreads();

    // W = T diag(beta e^gamma rk) K and U' = T diag(beta) V: warp (m, half) takes row tile m
    // and half of the column tiles
    {
        const int m = warp & 3, half = warp >> 2;
        float acc[8][4];
        lower_times_raw<P>(am, kh, m, 8 * half, 8, g, t4, acc);
        float *wg = cp.w + chunk * C * K;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const int i = 16 * m + g, j = 8 * (8 * half + c) + 2 * t4;
            *(float2 *)(wg + i * K + j) = float2{tf32_round(acc[c][0]), tf32_round(acc[c][1])};
            *(float2 *)(wg + (i + 8) * K + j) =
                float2{tf32_round(acc[c][2]), tf32_round(acc[c][3])};
        }
        const int tiles = (int)vd / 16;   // column tiles per half: 8 (V = 128) or 4 (V = 64)
        lower_times_raw<P>(tu, vh, m, tiles * half, tiles, g, t4, acc);
        float *ug = cp.u + chunk * C * vd;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            if (c < tiles) {
                const int i = 16 * m + g, j = 8 * (tiles * half + c) + 2 * t4;
                *(float2 *)(ug + i * vd + j) = float2{acc[c][0], acc[c][1]};
                *(float2 *)(ug + (i + 8) * vd + j) = float2{acc[c][2], acc[c][3]};
            }
        }
    }
}

// Starts copying chunk n's W and raw q into the scan's shared memory.
template <class P>
static __device__ __forceinline__ void stage_scan_wq(const GdnChunkParams &cp, long long head,
                                                     long long b, long long hk, long long n,
                                                     float *ws, typename P::T *qh, int tid) {
    const int C = GDN_CHUNK, K = GDN_CHUNK_K;
    const float *w = cp.w + (head * cp.chunks + n) * C * K;
    for (int e = tid; e < C * K / 4; e += GDN_TC_SCAN_THREADS) {
        const int r = e / (K / 4), part = e % (K / 4);
        copy16_async(ws + r * GDN_WROW + 4 * part, w + 4 * e, true);
    }
    stage_raw_rows<P>(cp.rule, cp.rule.q, cp.rule.q_stride, b, n * C, hk, K, qh, tid,
                      GDN_TC_SCAN_THREADS);
}

// Starts copying chunk n's raw k, P and scales into the scan's shared memory.
template <class P>
static __device__ __forceinline__ void stage_scan_kp(const GdnChunkParams &cp, long long head,
                                                     long long b, long long hk, long long n,
                                                     float *ps, float *scales,
                                                     typename P::T *kh, int tid) {
    const int C = GDN_CHUNK, K = GDN_CHUNK_K;
    const long long chunk = head * cp.chunks + n;
    const float *pg = cp.p + chunk * C * C;
    for (int e = tid; e < C * C / 4; e += GDN_TC_SCAN_THREADS) {
        const int r = e / (C / 4), part = e % (C / 4);
        copy16_async(ps + r * GDN_FROW + 4 * part, pg + 4 * e, true);
    }
    if (tid < 3 * C / 4) {
        copy16_async(scales + 4 * tid, cp.gamma + chunk * 3 * C + 4 * tid, true);
    }
    stage_raw_rows<P>(cp.rule, cp.rule.k, cp.rule.k_stride, b, n * C, hk, K, kh, tid,
                      GDN_TC_SCAN_THREADS);
}

// U' of chunk n at this warp's tiles of u (rows 16 a + g (+ 8), columns 8 nt + 2 t4 (+ 1) for
// the TPW column tiles nt = nb, nb + 1, ... of the block's).
template <int TPW>
static __device__ __forceinline__ void load_u_prime(const GdnChunkParams &cp, long long head,
                                                    long long n, long long j0, int a, int nb,
                                                    int g, int t4, float (&up)[TPW][4]) {
    const long long vd = cp.rule.value_dim;
    const float *u = cp.u + (head * cp.chunks + n) * GDN_CHUNK * vd + j0;
#pragma unroll
    for (int c = 0; c < TPW; ++c) {
        const int i = 16 * a + g, j = 8 * (nb + c) + 2 * t4;
        const float2 lo = *(const float2 *)(u + i * vd + j);
        const float2 hi = *(const float2 *)(u + (i + 8) * vd + j);
        up[c][0] = lo.x;
        up[c][1] = lo.y;
        up[c][2] = hi.x;
        up[c][3] = hi.y;
    }
}

// Calls f(element, k, col) for each of a scan warp's state elements st[mi][c][r] (`element` =
// &st[mi][c][r]): key row k = 16 (a + 4 mi) + g (+ 8), column col = 8 (nb + c) + 2 t4 (+ 1) of
// the block's.
template <int TPW, class F>
static __device__ __forceinline__ void for_state_elements(float (&st)[2][TPW][4], int a, int nb,
                                                          int g, int t4, F f) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int c = 0; c < TPW; ++c) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                f(st[mi][c][r], 16 * (a + 4 * mi) + g + 8 * (r >> 1),
                  8 * (nb + c) + 2 * t4 + (r & 1));
            }
        }
    }
}

// One block per COLS = 32 TPW value columns of (batch row, value head), through its chunks in
// order: the wide scan (TPW = 2, 64 columns) or the narrow one (TPW = 1, 32 columns: twice the
// blocks, for calls whose wide blocks would leave half the multiprocessors idle).
template <class P, int TPW>
static __device__ void gdn_tc_scan(const GdnChunkParams &cp) {
    typedef typename P::T T;
    const int C = GDN_CHUNK, K = GDN_CHUNK_K;
    const int COLS = 32 * TPW, BROW = GDN_BROW(COLS);
    const GdnParams &p = cp.rule;
    GDN_DYNAMIC_SHARED(shared);
    float *ws = (float *)shared;             // [C][GDN_WROW]: W
    float *ps = ws + C * GDN_WROW;           // [C][GDN_FROW]: P
    float *ss = ps + C * GDN_FROW;           // [K][BROW]: the state's columns, TF32
    float *uo = ss + K * BROW;               // [C][BROW]: u, TF32
    float *uk = uo + C * BROW;               // [C][BROW]: diag(kscale) u, TF32
    float *scales = uk + C * BROW;           // [3][C]: output scales, update scales, e^gamma_C
    T *qh = (T *)(scales + 3 * C);           // [C][GDN_HROW]: raw queries
    T *kh = qh + C * GDN_HROW;               // [C][GDN_HROW]: raw keys

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    // warp (a, nb): u's and the outputs' row tile a (16 tokens) and the state's row tiles a and
    // a + 4 (16 key rows each), the TPW column tiles from nb (8 value columns each)
    const int a = warp & 3, nb = TPW * (warp >> 2);
    const long long hv = p.value_heads, vd = p.value_dim;
    const long long h = blockIdx.y % hv, b = blockIdx.y / hv;
    const long long hk = h / (hv / p.key_heads);
    const long long j0 = (long long)blockIdx.x * COLS;
    const long long head = b * hv + h;

    float st[2][TPW][4];   // the state: [row tile a, a + 4][column tile nb + c][fragment]
    for_state_elements(st, a, nb, g, t4, [&](float &e, int k, int col) {
        e = p.initial != nullptr ? p.initial[(head * K + k) * vd + j0 + col] : 0.0f;
        ss[k * BROW + col] = tf32_round(e);
    });
    stage_scan_wq<P>(cp, head, b, hk, 0, ws, qh, tid);
    stage_scan_kp<P>(cp, head, b, hk, 0, ps, scales, kh, tid);
    float up[TPW][4];
    load_u_prime(cp, head, 0, j0, a, nb, g, t4, up);

    for (long long n = 0; n < cp.chunks; ++n) {
        wait_async_copies();
        __syncthreads();   // the chunk's operands and the state's columns are in place

        // X = [W; Q] S0 for this warp's tiles
        float xw[TPW][4], xq[TPW][4];
        zero_tiles(xw);
        zero_tiles(xq);
#pragma unroll 4
        for (int s = 0; s < K / 8; ++s) {
            unsigned aw[4], aq[4];
            a_fragment(ws, GDN_WROW, 16 * a, 8 * s, g, t4, aw);
            a_fragment_raw<P>(qh, 16 * a, 8 * s, g, t4, aq);
#pragma unroll
            for (int c = 0; c < TPW; ++c) {
                const int col = 8 * (nb + c) + g;
                const unsigned b0 = __float_as_uint(ss[(8 * s + t4) * BROW + col]);
                const unsigned b1 = __float_as_uint(ss[(8 * s + t4 + 4) * BROW + col]);
                mma_tf32(xw[c], aw, b0, b1);
                mma_tf32(xq[c], aq, b0, b1);
            }
        }
        // u = U' - W S0, as the two products below take it; the outputs' first term
        float o[TPW][4];
#pragma unroll
        for (int c = 0; c < TPW; ++c) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 16 * a + g + 8 * (r >> 1), col = 8 * (nb + c) + 2 * t4 + (r & 1);
                const float u = up[c][r] - xw[c][r];
                uo[i * BROW + col] = tf32_round(u);
                uk[i * BROW + col] = tf32_round(u * scales[C + i]);
                o[c][r] = xq[c][r] * scales[i];
            }
        }
        __syncthreads();   // u is complete; W and q are read
        if (n + 1 < cp.chunks) {
            stage_scan_wq<P>(cp, head, b, hk, n + 1, ws, qh, tid);
            load_u_prime(cp, head, n + 1, j0, a, nb, g, t4, up);
        }

        // O += P u (P is zero right of the diagonal: those k-steps are skipped)
#pragma unroll
        for (int s = 0; s < C / 8; ++s) {
            if (8 * s <= 16 * a + 15) {
                unsigned ap[4];
                a_fragment(ps, GDN_FROW, 16 * a, 8 * s, g, t4, ap);
#pragma unroll
                for (int c = 0; c < TPW; ++c) {
                    const int col = 8 * (nb + c) + g;
                    mma_tf32(o[c], ap, __float_as_uint(uo[(8 * s + t4) * BROW + col]),
                             __float_as_uint(uo[(8 * s + t4 + 4) * BROW + col]));
                }
            }
        }
        const long long t0 = n * C;
#pragma unroll
        for (int c = 0; c < TPW; ++c) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const long long t = t0 + 16 * a + g + 8 * half;
                if (t < p.steps) {
                    T *out = (T *)p.out + ((b * p.steps + t) * hv + h) * vd + j0 + 8 * (nb + c) +
                             2 * t4;
                    store_pair<P>(out, o[c][2 * half], o[c][2 * half + 1]);
                }
            }
        }

        // S = e^gamma_C S0 + K^T diag(kscale) u
        const float decay = scales[2 * C];
        for_state_elements(st, a, nb, g, t4, [&](float &e, int, int) { e *= decay; });
#pragma unroll 2
        for (int s = 0; s < C / 8; ++s) {
            unsigned bu[TPW][2];
#pragma unroll
            for (int c = 0; c < TPW; ++c) {
                const int col = 8 * (nb + c) + g;
                bu[c][0] = __float_as_uint(uk[(8 * s + t4) * BROW + col]);
                bu[c][1] = __float_as_uint(uk[(8 * s + t4 + 4) * BROW + col]);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int k0 = 16 * (a + 4 * mi) + g;
                const T *lo = kh + (8 * s + t4) * GDN_HROW, *hi = lo + 4 * GDN_HROW;
                const unsigned ak[4] = {raw_bits<P>(lo[k0]), raw_bits<P>(lo[k0 + 8]),
                                        raw_bits<P>(hi[k0]), raw_bits<P>(hi[k0 + 8])};
#pragma unroll
                for (int c = 0; c < TPW; ++c) {
                    mma_tf32(st[mi][c], ak, bu[c][0], bu[c][1]);
                }
            }
        }
        __syncthreads();   // P, k, u, the scales and the state's columns are read
        for_state_elements(st, a, nb, g, t4, [&](float &e, int k, int col) {
            ss[k * BROW + col] = tf32_round(e);
        });
        if (n + 1 < cp.chunks) {
            stage_scan_kp<P>(cp, head, b, hk, n + 1, ps, scales, kh, tid);
        }
    }
    if (p.final_state != nullptr) {
        for_state_elements(st, a, nb, g, t4, [&](float &e, int k, int col) {
            p.final_state[(head * K + k) * vd + j0 + col] = e;
        });
    }
}

#define DFLASH_GDN_TC_KERNELS(SUFFIX, P)                                                   \
    extern "C" __global__ void __launch_bounds__(GDN_TC_PREP_THREADS)                      \
        gdn_tc_prep_##SUFFIX(const GdnChunkParams p) {                                     \
        gdn_tc_prep<P>(p);                                                                 \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(GDN_TC_SCAN_THREADS)                      \
        gdn_tc_scan_##SUFFIX(const GdnChunkParams p) {                                     \
        gdn_tc_scan<P, GDN_TC_COLUMNS / 32>(p);                                            \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(GDN_TC_SCAN_THREADS)                      \
        gdn_tc_scan_narrow_##SUFFIX(const GdnChunkParams p) {                              \
        gdn_tc_scan<P, GDN_TC_NARROW_COLUMNS / 32>(p);                                     \
    }

#else   // older GPUs: the entries exist (the module looks them up) but are never launched

#define DFLASH_GDN_TC_KERNELS(SUFFIX, P)                                                   \
    extern "C" __global__ void gdn_tc_prep_##SUFFIX(const GdnChunkParams p) {}             \
    extern "C" __global__ void gdn_tc_scan_##SUFFIX(const GdnChunkParams p) {}             \
    extern "C" __global__ void gdn_tc_scan_narrow_##SUFFIX(const GdnChunkParams p) {}

#endif

DFLASH_GDN_TC_KERNELS(bf16, Bf16)
DFLASH_GDN_TC_KERNELS(f16, F16)
