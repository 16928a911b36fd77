// Shared helpers for Fathom's kernels. Compiled by NVRTC with -DGQ=<G> -DDIM=<D>.
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// One contiguous byte run of the fixed-size run list (offsets relative to a layer's base).
struct Run { u64 off; u64 len; };

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Order-preserving map of f32 to u32 (larger float -> larger key), with -0 = +0 as the CPU
// selection compares them (fathom_plan::select's order key): a tie at zero goes to the lower
// token on both sides.
__device__ __forceinline__ u32 f32_key(float x) {
    u32 u = x == 0.0f ? 0u : __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
