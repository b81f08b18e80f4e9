// The causal convolution and SiLU of Gated DeltaNet layers (included by gdn_kernels.cu, whose
// storage types and conventions it shares; launched by src/aten_ext/gdn_conv.rs).

// Gated DeltaNet layers run q, k and v (one projection's first conv_dim columns) through a
// depthwise causal convolution of width 4 and SiLU. libtorch's depthwise conv1d wants the
// channels first ([B, C, T]: a transposed copy of the projection, and the conv state
// concatenated before it), then SiLU and another transpose. This kernel reads the projection
// where it lies ([B, T, C], any batch and token strides, channels dense) and the conv state
// [B, C, 3], and writes SiLU(conv) [B, T, C] dense and the next conv state (the last 3
// inputs) in one pass. The sum is in float32 and rounded to the storage type before SiLU, as
// libtorch's conv then silu round. Thread: one channel, 16 consecutive tokens.

#define GDN_CONV_WIDTH 4
#define GDN_CONV_TOKENS 16
#define GDN_CONV_THREADS 128

struct GdnConvParams {
    const void *x;            // [B, T, C], storage type, channels dense
    const void *weight;       // [C, 1, W], storage type, dense
    const void *prev;         // [B, C, W - 1], storage type, dense; or null for zeros
    void *out;                // [B, T, C] dense
    void *next_state;         // [B, C, W - 1] dense
    long long x_stride[2];    // batch, token
    long long steps;          // T
    long long channels;       // C
};

template <class P>
static __device__ void gdn_causal_conv(const GdnConvParams &p) {
    typedef typename P::T T;
    const int W = GDN_CONV_WIDTH, R = GDN_CONV_TOKENS;
    const long long c = (long long)blockIdx.x * GDN_CONV_THREADS + threadIdx.x;
    const long long t0 = (long long)blockIdx.y * R, b = blockIdx.z;
    if (c >= p.channels) {
        return;
    }
    const T *x = (const T *)p.x + b * p.x_stride[0] + c;
    const T *prev = p.prev != nullptr ? (const T *)p.prev + (b * p.channels + c) * (W - 1)
                                      : nullptr;
    // input tau of this channel: the projection's, the conv state's before token 0
    float window[W - 1 + R];
#pragma unroll
    for (int j = 0; j < W - 1 + R; ++j) {
        const long long tau = t0 - (W - 1) + j;
        window[j] = tau >= 0 ? (tau < p.steps ? P::load(x[tau * p.x_stride[1]]) : 0.0f)
                             : (prev != nullptr ? P::load(prev[W - 1 + tau]) : 0.0f);
    }
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) {
        w[i] = P::load(((const T *)p.weight)[c * W + i]);
    }
    T *out = (T *)p.out + (b * p.steps + t0) * p.channels + c;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (t0 + r < p.steps) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < W; ++i) {
                acc = fmaf(w[i], window[r + i], acc);
            }
            acc = P::load(P::store(acc));
            out[r * p.channels] = P::store(acc / (1.0f + expf(-acc)));
        }
    }
    if (blockIdx.y == gridDim.y - 1) {   // the last tile: the next conv state
        T *next = (T *)p.next_state + (b * p.channels + c) * (W - 1);
#pragma unroll
        for (int j = 0; j < W - 1; ++j) {
            const long long tau = p.steps - (W - 1) + j;
            next[j] = tau >= 0 ? x[tau * p.x_stride[1]]
                               : (prev != nullptr ? prev[W - 1 + tau] : P::store(0.0f));
        }
    }
}

#define DFLASH_GDN_CONV_KERNEL(SUFFIX, P)                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_CONV_THREADS)                         \
        gdn_causal_conv_##SUFFIX(const GdnConvParams p) {                                  \
        gdn_causal_conv<P>(p);                                                             \
    }

DFLASH_GDN_CONV_KERNEL(bf16, Bf16)
DFLASH_GDN_CONV_KERNEL(f16, F16)
DFLASH_GDN_CONV_KERNEL(f32, F32)
