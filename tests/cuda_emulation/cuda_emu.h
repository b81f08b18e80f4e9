// Just enough of CUDA to run a kernel's source on the CPU, one block at a time, one host thread
// per CUDA thread: __syncthreads is a barrier of the block's threads, a warp shuffle a barrier
// of its warp's, __shared__ variables are statics (one block runs at a time). For testing a
// kernel's indexing, tiling and reductions where there is no GPU; not for speed. A thread that
// skips a barrier its block meets hangs the run (the caller's time limit reports it).
// Dynamic shared memory is emu::dynamic_shared, which the caller sizes before a launch.
// Inline assembly is dropped: kernels that need it (f16 conversions) compute garbage here.
#pragma once

#include <algorithm>
#include <barrier>
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

namespace emu {
inline uint3 block_idx, block_dim, grid_dim;
inline thread_local uint3 thread_idx;
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<float> warp_values;   // one slot per thread
inline std::vector<float4> dynamic_shared;   // a launch's dynamic shared memory (sized by its caller)

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

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
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
