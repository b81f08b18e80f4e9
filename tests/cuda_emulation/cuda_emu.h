// Just enough of CUDA to run a kernel's source on the CPU, one block at a time, one host thread
// per CUDA thread: __syncthreads is a barrier of the block's threads, a warp shuffle a barrier
// of its warp's, __shared__ variables are statics (one block runs at a time). For testing a
// kernel's indexing, tiling and reductions where there is no GPU; not for speed. A thread that
// skips a barrier its block meets hangs the run (the caller's time limit reports it).
// Dynamic shared memory is emu::dynamic_shared, which the caller sizes before a launch.
// Inline assembly is dropped: kernels that need it (f16 conversions) compute garbage here; the
// few helpers that are inline assembly on the GPU and that the kernels' sources leave to the
// emulation where DFLASH_EMULATED_ASM is defined (TF32 rounding, mma.sync m16n8k8 TF32 and
// m16n8k16 bf16 / f16, cp.async)
// are defined below with the same meaning.
#pragma once

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __shared__ static
#define asm(...) ((void)0)

struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

namespace emu {
inline uint3 block_idx, block_dim, grid_dim;
inline thread_local uint3 thread_idx;
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<float> warp_values;   // one slot per thread
inline std::vector<long long> warp_values64;   // one slot per thread (64-bit shuffles)
inline std::vector<float4> dynamic_shared;   // a launch's dynamic shared memory (sized by its caller)
struct MmaOperands {
    unsigned a[4], b[2];
    float c[4];
};
inline std::vector<MmaOperands> mma_operands;   // one slot per thread

// Runs `kernel` over the grid, blocks in turn, each with its own threads.
template <class F>
void launch(uint3 grid, unsigned threads, F kernel) {
    grid_dim = grid;
    block_dim = {threads, 1, 1};
    block_barrier = std::make_unique<std::barrier<>>(threads);
    warp_barriers.clear();
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) {
        warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w)));
    }
    warp_values.assign(threads, 0.0f);
    warp_values64.assign(threads, 0);
    mma_operands.assign(threads, MmaOperands{});
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) {
                block_idx = {x, y, z};
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; ++t) {
                    pool.emplace_back([t, &kernel] {
                        thread_idx = {t, 0, 0};
                        kernel();
                    });
                }
                for (auto &th : pool) {
                    th.join();
                }
            }
        }
    }
}

// Ends the process with status 2 if it still runs after `seconds`: a thread that skips a barrier
// its block meets hangs the others, and a test's time limit should not be what reports it.
inline void deadline(int seconds) {
    std::thread([seconds] {
        std::this_thread::sleep_for(std::chrono::seconds(seconds));
        std::fprintf(stderr, "no result after %d s: a barrier that not every thread meets?\n",
                     seconds);
        std::_Exit(2);
    }).detach();
}
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

// Every lane of the warp takes part (the full mask), as the kernels here use it.
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    const unsigned t = threadIdx.x, lane = t % 32, base = t - lane;
    auto &barrier = *emu::warp_barriers[t / 32];
    emu::warp_values[t] = v;
    barrier.arrive_and_wait();
    const float other = emu::warp_values[base + (lane ^ offset)];
    barrier.arrive_and_wait();
    return other;
}

inline long long __shfl_xor_sync(unsigned, long long v, int offset) {
    const unsigned t = threadIdx.x, lane = t % 32, base = t - lane;
    auto &barrier = *emu::warp_barriers[t / 32];
    emu::warp_values64[t] = v;
    barrier.arrive_and_wait();
    const long long other = emu::warp_values64[base + (lane ^ offset)];
    barrier.arrive_and_wait();
    return other;
}

template <class T>
inline T shfl_xor_any(T v, int offset) {
    static_assert(sizeof(T) <= 8);
    long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = __shfl_xor_sync(0xffffffffu, bits, offset);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
inline int __shfl_xor_sync(unsigned, int v, int offset) { return shfl_xor_any(v, offset); }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int offset) {
    return shfl_xor_any(v, offset);
}

// A barrier of the warp's lanes (all of them take part, as the kernels here use it).
inline void __syncwarp(unsigned = 0xffffffffu) {
    emu::warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}

inline unsigned long long atomicOr(unsigned long long *a, unsigned long long v) {
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);
}
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }

// The value of lane - offset (a lane's own below `offset`).
inline float __shfl_up_sync(unsigned, float v, int offset) {
    const unsigned t = threadIdx.x, lane = t % 32;
    auto &barrier = *emu::warp_barriers[t / 32];
    emu::warp_values[t] = v;
    barrier.arrive_and_wait();
    const float other = lane >= (unsigned)offset ? emu::warp_values[t - offset] : v;
    barrier.arrive_and_wait();
    return other;
}

// The value of lane `src` of the `width`-lane segment of the calling lane (all lanes take part).
inline float __shfl_sync(unsigned, float v, int src, int width = 32) {
    const unsigned t = threadIdx.x, lane = t % 32, base = t - lane;
    auto &barrier = *emu::warp_barriers[t / 32];
    emu::warp_values[t] = v;
    barrier.arrive_and_wait();
    const unsigned segment = lane - lane % (unsigned)width;
    const float other = emu::warp_values[base + segment + (unsigned)src % (unsigned)width];
    barrier.arrive_and_wait();
    return other;
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
#include <math.h>  // expf, fmaf
inline long long min(long long a, long long b) { return a < b ? a : b; }
using std::fmaxf;

#define DFLASH_EMULATED_ASM

// cvt.rna.tf32.f32: to nearest, ties away from zero (the low 13 bits of the mantissa cleared).
inline unsigned tf32_bits(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) != 0x7f800000u) {
        u += 0x1000u;
    }
    return u & 0xffffe000u;
}

// An emulated mma.sync of the warp, in two steps: every lane puts its fragments down (a, b and
// its accumulators), then (mma_result) each computes its four results from the whole tiles,
// rebuilt by the caller from every lane's operands, and all move on together.
inline void mma_operands_down(const float (&d)[4], const unsigned (&a)[4], unsigned b0,
                              unsigned b1) {
    const unsigned t = threadIdx.x;
    emu::MmaOperands &mine = emu::mma_operands[t];
    for (int i = 0; i < 4; ++i) {
        mine.a[i] = a[i];
        mine.c[i] = d[i];
    }
    mine.b[0] = b0;
    mine.b[1] = b1;
    emu::warp_barriers[t / 32]->arrive_and_wait();
}

// d = c + A B for the lane's C elements (row g or g + 8, column 2 t4 or 2 t4 + 1), in double.
template <int K>
inline void mma_result(float (&d)[4], const double (&A)[16][K], const double (&B)[K][8]) {
    const unsigned t = threadIdx.x, lane = t % 32;
    const unsigned g = lane >> 2, t4 = lane & 3;
    float result[4];
    for (int r = 0; r < 4; ++r) {
        const unsigned row = g + 8 * (r >> 1), col = 2 * t4 + (r & 1);
        double acc = emu::mma_operands[t].c[r];
        for (int k = 0; k < K; ++k) {
            acc += A[row][k] * B[k][col];
        }
        result[r] = (float)acc;
    }
    emu::warp_barriers[t / 32]->arrive_and_wait();   // every lane has read the others' fragments
    for (int r = 0; r < 4; ++r) {
        d[r] = result[r];
    }
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, d += a b, over the warp (fragment layouts
// of the PTX ISA; the tensor cores read only the TF32 bits of an operand).
inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma_operands_down(d, a, b0, b1);
    const unsigned base = threadIdx.x - threadIdx.x % 32;
    const auto operand = [](unsigned x) { return (double)__uint_as_float(x & 0xffffe000u); };
    double A[16][8], B[8][8];
    for (unsigned l = 0; l < 32; ++l) {
        const emu::MmaOperands &o = emu::mma_operands[base + l];
        const unsigned g = l >> 2, t4 = l & 3;
        A[g][t4] = operand(o.a[0]);
        A[g + 8][t4] = operand(o.a[1]);
        A[g][t4 + 4] = operand(o.a[2]);
        A[g + 8][t4 + 4] = operand(o.a[3]);
        B[t4][g] = operand(o.b[0]);
        B[t4 + 4][g] = operand(o.b[1]);
    }
    mma_result<8>(d, A, B);
}

// IEEE half bits as a float (normals, subnormals, infinities, NaN).
inline float half_bits_to_float(unsigned h) {
    const unsigned sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    float v;
    if (exp == 0) {
        v = std::ldexp((float)man, -24);
    } else if (exp == 31) {
        v = man != 0 ? NAN : INFINITY;
    } else {
        v = std::ldexp((float)(man | 0x400u), (int)exp - 25);
    }
    return sign != 0 ? -v : v;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.f32, d += a b, over the warp, as mma_tf32:
// A 16 x 16 (a[0] = row g, k 2 t4 .. +1; a[1] = row g + 8; a[2] = row g, k 8 + 2 t4 ..; a[3] =
// row g + 8, k 8 + 2 t4 ..), B 16 x 8 (b0 = k 2 t4 .. +1, n g; b1 = k 8 + 2 t4 ..), each
// register two elements, the first in its low half; products exact, sums in double.
inline void mma_16816_emulated(bool bf16, float (&d)[4], const unsigned (&a)[4], unsigned b0,
                               unsigned b1) {
    mma_operands_down(d, a, b0, b1);
    const unsigned base = threadIdx.x - threadIdx.x % 32;
    const auto half = [bf16](unsigned x, int which) {
        const unsigned h = which == 0 ? x & 0xffffu : x >> 16;
        return bf16 ? (double)__uint_as_float(h << 16) : (double)half_bits_to_float(h);
    };
    double A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        const emu::MmaOperands &o = emu::mma_operands[base + l];
        const unsigned g = l >> 2, t4 = l & 3;
        for (int u = 0; u < 2; ++u) {
            A[g][2 * t4 + u] = half(o.a[0], u);
            A[g + 8][2 * t4 + u] = half(o.a[1], u);
            A[g][8 + 2 * t4 + u] = half(o.a[2], u);
            A[g + 8][8 + 2 * t4 + u] = half(o.a[3], u);
            B[2 * t4 + u][g] = half(o.b[0], u);
            B[8 + 2 * t4 + u][g] = half(o.b[1], u);
        }
    }
    mma_result<16>(d, A, B);
}
inline void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma_16816_emulated(true, d, a, b0, b1);
}
inline void mma_f16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma_16816_emulated(false, d, a, b0, b1);
}

// cp.async of 16 bytes (zeros where !valid), done at once; waiting for it is then nothing.
inline void copy16_async(void *shared, const void *global, bool valid) {
    if (valid) {
        std::memcpy(shared, global, 16);
    } else {
        std::memset(shared, 0, 16);
    }
}
inline void wait_async_copies() {}
