// Planning kernels: Fathom's water-filling (docs/SPEC.md §3) and SparQ's channel choice, one CTA
// (DIM threads) per (sequence, KV head). Both write the depths and the fixed-size run list.
#include "common.cuh"

// Gains per bit of planes 1..4 per unit importance: fathom_plan::waterfill::GAIN_PER_BIT.
__device__ __forceinline__ double gain(int j) {
    return j == 1 ? 0.75 / 1.25 : j == 2 ? 0.1875 : j == 3 ? 0.046875 : 0.01171875;
}
__device__ __forceinline__ int depth_at(float w, double lambda) {
    double wd = (double)w;
    return (int)(wd * (0.75 / 1.25) >= lambda) + (int)(wd * 0.1875 >= lambda)
         + (int)(wd * 0.046875 >= lambda) + (int)(wd * 0.01171875 >= lambda);
}

#define CPL (DIM / 32)  // channels per lane: lane l owns channels l, l + 32, ...

__device__ __forceinline__ u32 warp_sum(u32 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_max(double v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ double warp_min(double v) {
    for (int o = 16; o > 0; o >>= 1) v = fmin(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Q(lambda): the plan's quarter bits, 4*t_c + [t_c > 0] summed over channels (warp-uniform).
__device__ __forceinline__ u32 quarters_at(const float (&w)[CPL], double lambda) {
    u32 q = 0;
#pragma unroll
    for (int j = 0; j < CPL; j++) { int t = depth_at(w[j], lambda); q += 4 * t + (t > 0); }
    return warp_sum(q);
}

// Writes the two runs of channel c of head h at depth t: its first t planes and its scales.
// Layer layout: planes [H][D][4][nb] u64, then scales [H][D][nb] fp16.
__device__ __forceinline__ void write_runs(Run* runs, int heads, int h, int c, int t, u64 nb) {
    u64 hc = (u64)h * DIM + c;
    Run p; p.off = hc * 4 * nb * 8; p.len = (u64)t * nb * 8;
    Run s; s.off = (u64)heads * DIM * 4 * nb * 8 + hc * nb * 2; s.len = t > 0 ? nb * 2 : 0;
    // Run list layout [H][2][D]: a head group's runs are one contiguous slice.
    runs[(u64)h * 2 * DIM + c] = p;
    runs[(u64)h * 2 * DIM + DIM + c] = s;
}

// Importance w_c = sigma2_c * sum_g q_gc^2 (f64 sum, rounded once to f32, as
// fathom_plan::importance_into) and reverse water-filling (fathom_plan::water_fill, steps 1-7),
// one warp per (sequence, KV head): grid = heads, block = 32. q: [heads][GQ][DIM] f32,
// sigma2: [heads][DIM].
extern "C" __global__ void fathom_plan(const float* __restrict__ q, const float* __restrict__ sigma2,
                                       float budget, int steps, int heads, u64 nb,
                                       u8* __restrict__ depths, float* __restrict__ bits_out,
                                       Run* __restrict__ runs, float* __restrict__ bits_acc) {
    const int h = blockIdx.x, lane = threadIdx.x;
    const float* qh = q + (u64)h * GQ * DIM;
    float w[CPL];
    double lo = INFINITY, max_rho1 = 0.0;
#pragma unroll
    for (int j = 0; j < CPL; j++) {
        const int c = lane + 32 * j;
        double sq = 0.0;
        for (int g = 0; g < GQ; g++) { double x = (double)qh[g * DIM + c]; sq += x * x; }
        w[j] = (float)((double)sigma2[(u64)h * DIM + c] * sq);
        if (w[j] > 0.0f) {
            lo = fmin(lo, (double)w[j] * 0.01171875);
            max_rho1 = fmax(max_rho1, (double)w[j] * (0.75 / 1.25));
        }
    }
    lo = warp_min(lo);
    max_rho1 = warp_max(max_rho1);
    const u32 cap = (u32)floorf(budget * 4.0f);
    double lambda;
    if (lo == INFINITY) {
        lambda = INFINITY;
    } else if (quarters_at(w, lo) <= cap) {
        lambda = lo;
    } else {
        double hi = 2.0 * max_rho1;
        for (int s = 0; s < steps; s++) {
            double mid = sqrt(lo * hi);
            if (quarters_at(w, mid) <= cap) hi = mid; else lo = mid;
        }
        for (;;) {
            double mine = -INFINITY;
#pragma unroll
            for (int j = 0; j < CPL; j++) {
                int t = depth_at(w[j], hi);
                if (w[j] > 0.0f && t < 4) mine = fmax(mine, (double)w[j] * gain(t + 1));
            }
            double next = warp_max(mine);
            if (next == -INFINITY || next <= lo) break;
            if (quarters_at(w, next) > cap) break;
            hi = next;
        }
        lambda = hi;
    }
    u32 quarters = 0;
#pragma unroll
    for (int j = 0; j < CPL; j++) {
        const int c = lane + 32 * j;
        const int t = depth_at(w[j], lambda);
        quarters += 4 * t + (t > 0);
        depths[(u64)h * DIM + c] = (u8)t;
        write_runs(runs, heads, h, c, t, nb);
    }
    quarters = warp_sum(quarters);
    if (lane == 0) { bits_out[h] = (float)quarters * 0.25f; atomicAdd(bits_acc, (float)quarters * 0.25f); }
}

// SparQ: per KV head, the r channels with the largest sum_g |q_gc| (ties: lower index), at 4
// planes. grid = heads, block = DIM.
extern "C" __global__ void sparq_plan(const float* __restrict__ q, int r, int heads, u64 nb,
                                      u8* __restrict__ depths, float* __restrict__ bits_out,
                                      Run* __restrict__ runs, float* __restrict__ bits_acc) {
    __shared__ float s[DIM];
    const int h = blockIdx.x, c = threadIdx.x;
    const float* qh = q + (u64)h * GQ * DIM;
    float a = 0.0f;
    for (int g = 0; g < GQ; g++) a += fabsf(qh[g * DIM + c]);
    s[c] = a;
    __syncthreads();
    int rank = 0;
    for (int o = 0; o < DIM; o++) rank += (s[o] > a) || (s[o] == a && o < c);
    int t = rank < r ? 4 : 0;
    depths[(u64)h * DIM + c] = (u8)t;
    if (c == 0) { float b = (float)(r < DIM ? r : DIM) * 4.25f; bits_out[h] = b; atomicAdd(bits_acc, b); }
    write_runs(runs, heads, h, c, t, nb);
}
