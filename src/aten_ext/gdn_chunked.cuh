// The chunked (WY) form of the gated delta rule in float32 (included by gdn_kernels.cu, whose
// parameters and helpers it shares; launched by src/aten_ext/gdn_chunked.rs).

// The recurrent kernel (gdn_kernels.cu) is a chain of T dependent steps. For a long prefill the rule is
// computed per chunk of C = 64 tokens instead (the WY form of Yang et al., as FLA's
// chunk_gated_delta_rule computes it), in two kernels:
//
// gdn_chunk_prep (one block per chunk and value head, all chunks at once): with the chunk's
// cumulative log decays gamma_i (g clamped at -110, where exp already underflows, so that a
// decay of zero stays finite), A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j (j < i) and
// forward substitution through (I + A), it writes
//   U' = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta exp(gamma)) K,
//   P_ij = exp(gamma_i - gamma_j) q_i.k_j (j <= i, else 0),   gamma.
// Then, for the state S0 at the chunk's start, the chunk's values u = U' - W S0, its outputs
// O = diag(exp(gamma)) Q S0 + P u, and the next state exp(gamma_C) S0 + sum_j
// exp(gamma_C - gamma_j) k_j u_j^T.
//
// gdn_chunk_scan (one block per 32 value columns of a head, walking its chunks): the state's
// columns are independent, so a block keeps [K, 32] of it in shared memory and per chunk
// computes [W; Q] S0 as one product, then the outputs and the next state. Both kernels work in
// float32 with register tiles of 4 x 4 (2 x 4) products over operands staged in shared memory
// (dynamic: more than the static 48 KB; the Rust side sizes it with the same formulas,
// gdn.rs; in the scan the keys and P^T take the place of [W; Q]^T once that is read, so that
// two blocks' shared memory fits a multiprocessor). What a chunk reads from global memory is loaded into registers
// while the chunk before it computes, so the walk does not wait for memory at every chunk. Key heads of 128
// only (Qwen3.5, Qwen3.6, Qwen3-Next); other sizes and short calls take the recurrent kernel.
//
// Tokens past the end (the last chunk's padding) read as g = 0, beta = 0, q = k = v = 0: their
// rows of U' and W are zero, so they change neither the state nor any output.

#define GDN_CHUNK 64                 // tokens per chunk
#define GDN_CHUNK_THREADS 256
#define GDN_CHUNK_WARPS (GDN_CHUNK_THREADS / 32)
#define GDN_WARP_ROWS (GDN_CHUNK / GDN_CHUNK_WARPS)   // key rows a warp stages: 8
#define GDN_SCAN_COLUMNS 32          // value columns per scan block
#define GDN_CHUNK_K 128              // the key head size of the chunked kernels
#define GDN_MIN_LOG_DECAY (-110.0f)  // exp() of it is 0 in float32

// float counts of the two kernels' dynamic shared memory (gdn.rs computes the same)
#define GDN_ROW (GDN_CHUNK_K + 4)                           // a staged key row, padded
#define GDN_AROW (GDN_CHUNK + 4)                            // a row of A / P^T, padded
#define GDN_PREP_FLOATS (2 * GDN_CHUNK * GDN_ROW + GDN_CHUNK * GDN_AROW + 3 * GDN_CHUNK)
#define GDN_XROW (2 * GDN_CHUNK + 4)                        // a row of [W; Q]^T, padded
#define GDN_SROW (GDN_SCAN_COLUMNS + 4)                     // a row of the state tile, padded
#define GDN_SCAN_STAGE_FLOATS (GDN_CHUNK_K * GDN_XROW)      // >= C * GDN_ROW + C * GDN_AROW
#define GDN_SCAN_FLOATS \
    (GDN_SCAN_STAGE_FLOATS + GDN_CHUNK_K * GDN_SROW + 2 * GDN_CHUNK * GDN_SROW + 2 * GDN_CHUNK)

#ifndef GDN_DYNAMIC_SHARED
#define GDN_DYNAMIC_SHARED(name) extern __shared__ float4 name[]
#endif

// The recurrent kernel's arguments, and the chunked form's work buffers (float32, dense).
struct GdnChunkParams {
    GdnParams rule;           // q .. l2norm; initial, out, final_state used; states unused
    float *u;                 // [B, Hv, N, C, V]: U'
    float *w;                 // [B, Hv, N, K, C]: W, transposed
    float *p;                 // [B, Hv, N, C, C]: P, transposed (row j holds P_ij over i)
    float *gamma;             // [B, Hv, N, C]
    long long chunks;         // N
};

// A warp's rows of q or k in a chunk (rows warp, warp + 8, ...), 4 elements per lane and row.
struct KeyRows {
    float x[GDN_WARP_ROWS][GDN_CHUNK_K / 32];
};

// Loads the warp's rows of the chunk from t0 (head `head` of batch row b); zeros past the end.
// Every load is issued before any is used.
template <class P>
static __device__ __forceinline__ void load_key_rows(const GdnParams &p, const void *base,
                                                     const long long *stride, long long b,
                                                     long long t0, long long head, int warp,
                                                     int lane, KeyRows &rows) {
    typedef typename P::T T;
#pragma unroll
    for (int m = 0; m < GDN_WARP_ROWS; ++m) {
        const long long t = t0 + warp + GDN_CHUNK_WARPS * m;
        const T *row = (const T *)base + b * stride[0] + t * stride[1] + head * stride[2];
#pragma unroll
        for (int x = 0; x < GDN_CHUNK_K / 32; ++x) {
            rows.x[m][x] = t < p.steps ? P::load(row[lane + 32 * x]) : 0.0f;
        }
    }
}

// Writes the rows as the rule reads them (l2-normalised where asked, times `scale`): element d
// of row r at dst[r * row_stride + d * element_stride].
static __device__ __forceinline__ void store_key_rows(const KeyRows &rows, long long l2norm,
                                                      float scale, float *dst, int row_stride,
                                                      int element_stride, int warp, int lane) {
#pragma unroll
    for (int m = 0; m < GDN_WARP_ROWS; ++m) {
        float ss = 0.0f;
#pragma unroll
        for (int x = 0; x < GDN_CHUNK_K / 32; ++x) {
            ss += rows.x[m][x] * rows.x[m][x];
        }
        const float norm = (l2norm ? rsqrtf(warp_sum(ss) + 1e-6f) : 1.0f) * scale;
        float *row = dst + (warp + GDN_CHUNK_WARPS * m) * row_stride;
#pragma unroll
        for (int x = 0; x < GDN_CHUNK_K / 32; ++x) {
            row[(lane + 32 * x) * element_stride] = rows.x[m][x] * norm;
        }
    }
}

// The inclusive prefix sums of x[0 .. 64), in place, by warp 0 (two values per lane).
static __device__ __forceinline__ void chunk_cumsum(float *x, int lane) {
    const float a = x[2 * lane], b = x[2 * lane + 1];
    float sum = a + b;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, sum, offset);
        if (lane >= offset) {
            sum += up;
        }
    }
    const float before = sum - a - b;
    x[2 * lane] = before + a;
    x[2 * lane + 1] = before + a + b;
}

// One block per (chunk, batch row x value head): U', W, P and gamma of the chunk.
template <class P>
static __device__ void gdn_chunk_prep(const GdnChunkParams &cp) {
    const int C = GDN_CHUNK, K = GDN_CHUNK_K;
    const GdnParams &p = cp.rule;
    GDN_DYNAMIC_SHARED(shared);
    float *ks = (float *)shared;             // [C][GDN_ROW]: unit keys
    float *qs = ks + C * GDN_ROW;            // [C][GDN_ROW]: unit queries / sqrt(K)
    float *as = qs + C * GDN_ROW;            // [C][GDN_AROW]: A (zero on and above the diagonal)
    float *gam = as + C * GDN_AROW;          // [C]
    float *bet = gam + C;                    // [C]
    float *egam = bet + C;                   // [C]: exp(gamma)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long hv = p.value_heads, vd = p.value_dim, n = blockIdx.x;
    const long long h = blockIdx.y % hv, b = blockIdx.y / hv;
    const long long hk = h / (hv / p.key_heads);
    const long long t0 = n * C;
    const long long chunk = (b * hv + h) * cp.chunks + n;   // this chunk's index in the buffers

    KeyRows k_rows, q_rows;
    load_key_rows<P>(p, p.k, p.k_stride, b, t0, hk, warp, lane, k_rows);
    load_key_rows<P>(p, p.q, p.q_stride, b, t0, hk, warp, lane, q_rows);
    if (tid < C) {
        const long long t = t0 + tid;
        const long long idx = (b * p.steps + t) * hv + h;
        const bool valid = t < p.steps;
        const float g = valid ? load_scalar<P>(p.g, p.g_is_f32, idx) : 0.0f;
        gam[tid] = fmaxf(g, GDN_MIN_LOG_DECAY);
        bet[tid] = valid ? load_scalar<P>(p.beta, p.beta_is_f32, idx) : 0.0f;
    }
    store_key_rows(k_rows, p.l2norm, 1.0f, ks, GDN_ROW, 1, warp, lane);
    store_key_rows(q_rows, p.l2norm, rsqrtf((float)K), qs, GDN_ROW, 1, warp, lane);
    // this thread's right-hand column of V (loaded now, used after the products below)
    const long long col = tid;
    const bool is_u = col < vd;
    float x[C];
    {
        const typename P::T *vcol = (const typename P::T *)p.v + b * p.v_stride[0] +
                                    h * p.v_stride[2] + (is_u ? col : 0);
#pragma unroll
        for (int i = 0; i < C; ++i) {
            x[i] = (is_u && t0 + i < p.steps) ? P::load(vcol[(t0 + i) * p.v_stride[1]]) : 0.0f;
        }
    }
    __syncthreads();
    if (warp == 0) {
        chunk_cumsum(gam, lane);
    }
    __syncthreads();
    if (tid < C) {
        cp.gamma[chunk * C + tid] = gam[tid];
        egam[tid] = expf(gam[tid]);
    }

    // k_i.k_j and q_i.k_j: thread (ti, tj) takes rows i = ti + 16 a and j = tj + 16 c (rows
    // 16 apart: the lanes of a quarter warp read 8 consecutive padded rows, no bank conflicts;
    // the lanes of a half warp write 16 consecutive floats of a row of P^T)
    {
        const int ti = tid % 16, tj = tid / 16;
        float kk[4][4], qk[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                kk[a][c] = 0.0f;
                qk[a][c] = 0.0f;
            }
        }
#pragma unroll 2
        for (int d = 0; d < K; d += 4) {
            float4 ki[4], qi[4], kj[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                ki[a] = *(const float4 *)(ks + (ti + 16 * a) * GDN_ROW + d);
                qi[a] = *(const float4 *)(qs + (ti + 16 * a) * GDN_ROW + d);
                kj[a] = *(const float4 *)(ks + (tj + 16 * a) * GDN_ROW + d);
            }
#pragma unroll
            for (int a = 0; a < 4; ++a) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    kk[a][c] += ki[a].x * kj[c].x + ki[a].y * kj[c].y + ki[a].z * kj[c].z +
                                ki[a].w * kj[c].w;
                    qk[a][c] += qi[a].x * kj[c].x + qi[a].y * kj[c].y + qi[a].z * kj[c].z +
                                qi[a].w * kj[c].w;
                }
            }
        }
        float *pt = cp.p + chunk * C * C;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int i = ti + 16 * a, j = tj + 16 * c;
                const float decay = j <= i ? expf(gam[i] - gam[j]) : 0.0f;
                as[i * GDN_AROW + j] = j < i ? bet[i] * decay * kk[a][c] : 0.0f;
                pt[j * C + i] = decay * qk[a][c];
            }
        }
    }
    __syncthreads();

    // forward substitution, one right-hand column per thread, in place: x_i = r_i - sum_{j<i}
    // A_ij x_j over the columns of beta V (U') and of beta exp(gamma) K (W)
    for (long long c = col; c < vd + K; c += GDN_CHUNK_THREADS) {
        const bool u_column = c < vd;
        if (c != col) {   // a further column of V (value heads wider than 128)
            const typename P::T *vcol = (const typename P::T *)p.v + b * p.v_stride[0] +
                                        h * p.v_stride[2] + (u_column ? c : 0);
#pragma unroll
            for (int i = 0; i < C; ++i) {
                x[i] = (u_column && t0 + i < p.steps) ? P::load(vcol[(t0 + i) * p.v_stride[1]])
                                                      : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < C; ++i) {
            float r = u_column ? bet[i] * x[i] : bet[i] * egam[i] * ks[i * GDN_ROW + (c - vd)];
            const float *arow = as + i * GDN_AROW;
#pragma unroll
            for (int j = 0; j < (i & ~3); j += 4) {
                const float4 a4 = *(const float4 *)(arow + j);
                r -= a4.x * x[j] + a4.y * x[j + 1] + a4.z * x[j + 2] + a4.w * x[j + 3];
            }
#pragma unroll
            for (int j = i & ~3; j < i; ++j) {
                r -= arow[j] * x[j];
            }
            x[i] = r;
        }
        if (u_column) {
            float *u = cp.u + chunk * C * vd + c;
#pragma unroll
            for (int i = 0; i < C; ++i) {
                u[i * vd] = x[i];
            }
        } else {
            float4 *w = (float4 *)(cp.w + (chunk * K + (c - vd)) * C);
#pragma unroll
            for (int i = 0; i < C; i += 4) {
                float4 v;
                v.x = x[i];
                v.y = x[i + 1];
                v.z = x[i + 2];
                v.w = x[i + 3];
                w[i / 4] = v;
            }
        }
    }
}

// What a scan block reads of one chunk: W (8 float4 per thread), its columns of U', P^T
// (4 float4), gamma (threads < C), the warp's rows of q and k.
struct ScanLoads {
    float4 w[8];
    float u[8];
    float4 p[4];
    float gamma;
    KeyRows q, k;
};

template <class P>
static __device__ __forceinline__ void load_scan_chunk(const GdnChunkParams &cp, long long head,
                                                       long long b, long long hk, long long j0,
                                                       long long n, int tid, ScanLoads &in) {
    const int C = GDN_CHUNK, K = GDN_CHUNK_K, VS = GDN_SCAN_COLUMNS;
    const GdnParams &p = cp.rule;
    const long long chunk = head * cp.chunks + n, vd = p.value_dim;
    const float4 *w = (const float4 *)(cp.w + chunk * K * C);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        in.w[m] = w[tid + GDN_CHUNK_THREADS * m];
    }
    const float *u = cp.u + chunk * C * vd;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int e = tid + GDN_CHUNK_THREADS * m, i = e / VS, c = e % VS;
        in.u[m] = j0 + c < vd ? u[i * vd + j0 + c] : 0.0f;
    }
    const float4 *pg = (const float4 *)(cp.p + chunk * C * C);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        in.p[m] = pg[tid + GDN_CHUNK_THREADS * m];
    }
    in.gamma = tid < C ? cp.gamma[chunk * C + tid] : 0.0f;
    const int warp = tid >> 5, lane = tid & 31;
    load_key_rows<P>(p, p.q, p.q_stride, b, n * C, hk, warp, lane, in.q);
    load_key_rows<P>(p, p.k, p.k_stride, b, n * C, hk, warp, lane, in.k);
}

// One block per 32 value columns of (batch row, value head), through its chunks in order.
template <class P>
static __device__ void gdn_chunk_scan(const GdnChunkParams &cp) {
    typedef typename P::T T;
    const int C = GDN_CHUNK, K = GDN_CHUNK_K, VS = GDN_SCAN_COLUMNS;
    const GdnParams &p = cp.rule;
    GDN_DYNAMIC_SHARED(shared);
    float *xt = (float *)shared;                    // [K][GDN_XROW]: [W; Q / sqrt(K)]^T
    float *kt = xt;                                 // then [C][GDN_ROW]: unit keys
    float *pt = xt + C * GDN_ROW;                   //  and [C][GDN_AROW]: P^T
    float *ss = xt + GDN_SCAN_STAGE_FLOATS;         // [K][GDN_SROW]: the state's columns
    float *us = ss + K * GDN_SROW;                  // [C][GDN_SROW]: U' then u
    float *os = us + C * GDN_SROW;                  // [C][GDN_SROW]: exp(gamma) Q S0
    float *gam = os + C * GDN_SROW;                 // [C]
    float *kdecay = gam + C;                        // [C]: exp(gamma_C - gamma_j)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rt = tid / 8, ct = tid % 8;           // a thread's row tile and column tile
    const long long hv = p.value_heads, vd = p.value_dim;
    const long long h = blockIdx.y % hv, b = blockIdx.y / hv;
    const long long hk = h / (hv / p.key_heads);
    const long long j0 = (long long)blockIdx.x * VS;
    const long long head = b * hv + h;

    // the state: thread (rt, ct) owns rows 4 rt .. 4 rt + 3, columns 4 ct .. 4 ct + 3
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const long long k = 4 * rt + a, j = j0 + 4 * ct + c;
            ss[k * GDN_SROW + 4 * ct + c] =
                (p.initial != nullptr && j < vd) ? p.initial[(head * K + k) * vd + j] : 0.0f;
        }
    }
    ScanLoads in;
    load_scan_chunk<P>(cp, head, b, hk, j0, 0, tid, in);
    for (long long n = 0; n < cp.chunks; ++n) {
        const long long t0 = n * C;
        __syncthreads();   // the previous chunk's readers are done
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int e = 4 * (tid + GDN_CHUNK_THREADS * m);   // W^T is [K][C]
            *(float4 *)(xt + (e / C) * GDN_XROW + e % C) = in.w[m];
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int e = tid + GDN_CHUNK_THREADS * m;
            us[(e / VS) * GDN_SROW + e % VS] = in.u[m];
        }
        if (tid < C) {
            gam[tid] = in.gamma;
        }
        store_key_rows(in.q, p.l2norm, rsqrtf((float)K), xt + C, 1, GDN_XROW, warp, lane);
        __syncthreads();
        if (tid < C) {
            kdecay[tid] = expf(gam[C - 1] - gam[tid]);
        }

        // [W; Q] S0: rows 4 rt .. (of 2C), columns 4 ct ..
        {
            float acc[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    acc[a][c] = 0.0f;
                }
            }
#pragma unroll 4
            for (int k = 0; k < K; ++k) {
                const float4 x4 = *(const float4 *)(xt + k * GDN_XROW + 4 * rt);
                const float4 s4 = *(const float4 *)(ss + k * GDN_SROW + 4 * ct);
                const float xv[4] = {x4.x, x4.y, x4.z, x4.w}, sv[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
                for (int a = 0; a < 4; ++a) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        acc[a][c] = fmaf(xv[a], sv[c], acc[a][c]);
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const int row = 4 * rt + a;
                const float scale = row < C ? 1.0f : expf(gam[row - C]);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (row < C) {
                        us[row * GDN_SROW + 4 * ct + c] -= acc[a][c];   // u = U' - W S0
                    } else {
                        os[(row - C) * GDN_SROW + 4 * ct + c] = acc[a][c] * scale;
                    }
                }
            }
        }
        __syncthreads();   // xt is read: the keys and P^T in its place
        store_key_rows(in.k, p.l2norm, 1.0f, kt, GDN_ROW, 1, warp, lane);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int e = 4 * (tid + GDN_CHUNK_THREADS * m);
            *(float4 *)(pt + (e / C) * GDN_AROW + e % C) = in.p[m];
        }
        if (n + 1 < cp.chunks) {   // the next chunk's loads, in flight while this one computes
            load_scan_chunk<P>(cp, head, b, hk, j0, n + 1, tid, in);
        }
        __syncthreads();

        // outputs: rows 2 rt, 2 rt + 1 of the chunk, columns 4 ct ..
        {
            float o[2][4];
#pragma unroll
            for (int a = 0; a < 2; ++a) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    o[a][c] = os[(2 * rt + a) * GDN_SROW + 4 * ct + c];
                }
            }
#pragma unroll 4
            for (int j = 0; j < C; ++j) {
                const float2 p2 = *(const float2 *)(pt + j * GDN_AROW + 2 * rt);
                const float4 u4 = *(const float4 *)(us + j * GDN_SROW + 4 * ct);
                const float pv[2] = {p2.x, p2.y}, uv[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
                for (int a = 0; a < 2; ++a) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        o[a][c] = fmaf(pv[a], uv[c], o[a][c]);
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                const long long t = t0 + 2 * rt + a;
                if (t < p.steps) {
                    T *out = (T *)p.out + ((b * p.steps + t) * hv + h) * vd + j0 + 4 * ct;
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        if (j0 + 4 * ct + c < vd) {
                            out[c] = P::store(o[a][c]);
                        }
                    }
                }
            }
        }
        // the next state: exp(gamma_C) S0 + sum_j k_j (exp(gamma_C - gamma_j) u_j)^T,
        // rows 4 rt .., columns 4 ct ..
        {
            const float decay = expf(gam[C - 1]);
            float s[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    s[a][c] = ss[(4 * rt + a) * GDN_SROW + 4 * ct + c] * decay;
                }
            }
#pragma unroll 4
            for (int j = 0; j < C; ++j) {
                const float4 k4 = *(const float4 *)(kt + j * GDN_ROW + 4 * rt);
                const float4 u4 = *(const float4 *)(us + j * GDN_SROW + 4 * ct);
                const float f = kdecay[j];
                const float kv[4] = {k4.x, k4.y, k4.z, k4.w};
                const float uv[4] = {u4.x * f, u4.y * f, u4.z * f, u4.w * f};
#pragma unroll
                for (int a = 0; a < 4; ++a) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        s[a][c] = fmaf(kv[a], uv[c], s[a][c]);
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    ss[(4 * rt + a) * GDN_SROW + 4 * ct + c] = s[a][c];
                }
            }
        }
    }
    if (p.final_state != nullptr) {
        // each thread wrote its own tile of ss: no barrier needed before reading it back
#pragma unroll
        for (int a = 0; a < 4; ++a) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const long long k = 4 * rt + a, j = j0 + 4 * ct + c;
                if (j < vd) {
                    p.final_state[(head * K + k) * vd + j] = ss[k * GDN_SROW + 4 * ct + c];
                }
            }
        }
    }
}

#define DFLASH_GDN_CHUNK_KERNELS(SUFFIX, P)                                               \
    extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)                       \
        gdn_chunk_prep_##SUFFIX(const GdnChunkParams p) {                                 \
        gdn_chunk_prep<P>(p);                                                             \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)                       \
        gdn_chunk_scan_##SUFFIX(const GdnChunkParams p) {                                 \
        gdn_chunk_scan<P>(p);                                                             \
    }

DFLASH_GDN_CHUNK_KERNELS(bf16, Bf16)
DFLASH_GDN_CHUNK_KERNELS(f16, F16)
DFLASH_GDN_CHUNK_KERNELS(f32, F32)
