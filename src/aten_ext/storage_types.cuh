// The storage types the run-time compiled kernels read and write (gdn_kernels.cu,
// fused_kernels.cu): load to float32, store with the rounding libtorch uses. Handed to NVRTC as
// a header by src/aten_ext/nvrtc.rs (the kernels include it by name); no system headers, so
// that NVRTC needs nothing but itself.
#pragma once

typedef unsigned short u16;

// bf16 storage: the top half of a float32; rounding to nearest even as c10::BFloat16 does.
struct Bf16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) {
        return __uint_as_float(((unsigned int)v) << 16);
    }
    static __device__ __forceinline__ T store(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            return (T)0x7fc0;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        return (T)(u >> 16);
    }
};

// IEEE half storage, through the hardware conversions.
struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ T store(float f) {
        T v;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
        return v;
    }
};

// float32 storage: nothing to round.
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float f) { return f; }
};
