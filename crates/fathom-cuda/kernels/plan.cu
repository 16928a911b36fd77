// Planning kernels: Fathom's water-filling (SPEC §3) and SparQ's channel choice, one CTA
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

__device__ u64 block_sum_u64(u64 v, u64* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    u64 s = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) s += sh[i];
    return s;
}
__device__ double block_max_f64(double v, double* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    double s = sh[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); i++) s = fmax(s, sh[i]);
    return s;
}
__device__ double block_min_f64(double v, double* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmin(v, __shfl_xor_sync(0xffffffffu, v, o));
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    double s = sh[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); i++) s = fmin(s, sh[i]);
    return s;
}

// Q(lambda): the plan's quarter bits (block-uniform call).
__device__ u64 quarters_at(float w, double lambda, u64* sh) {
    int t = depth_at(w, lambda);
    return block_sum_u64((u64)(4 * t + (t > 0)), sh);
}

// Writes the two runs of channel c of head h at depth t: its first t planes and its scales.
// Layer layout: planes [H][D][4][nb] u64, then scales [H][D][nb] fp16.
__device__ __forceinline__ void write_runs(Run* runs, int heads, int h, int c, int t, u64 nb) {
    u64 hc = (u64)h * DIM + c;
    Run p; p.off = hc * 4 * nb * 8; p.len = (u64)t * nb * 8;
    Run s; s.off = (u64)heads * DIM * 4 * nb * 8 + hc * nb * 2; s.len = t > 0 ? nb * 2 : 0;
    runs[hc] = p;
    runs[(u64)heads * DIM + hc] = s;
}

// Importance w_c = sigma2_c * sum_g q_gc^2 (f64 sum, rounded once to f32, as
// fathom_plan::importance_into) and reverse water-filling (fathom_plan::water_fill, steps 1-7).
// grid = heads, block = DIM threads. q: [heads][GQ][DIM] f32, sigma2: [heads][DIM].
extern "C" __global__ void fathom_plan(const float* __restrict__ q, const float* __restrict__ sigma2,
                                       float budget, int steps, int heads, u64 nb,
                                       u8* __restrict__ depths, float* __restrict__ bits_out,
                                       Run* __restrict__ runs, float* __restrict__ bits_acc) {
    __shared__ u64 shu[32];
    __shared__ double shd[32];
    const int h = blockIdx.x, c = threadIdx.x;
    const float* qh = q + (u64)h * GQ * DIM;
    double sq = 0.0;
    for (int g = 0; g < GQ; g++) { double x = (double)qh[g * DIM + c]; sq += x * x; }
    float w = (float)((double)sigma2[(u64)h * DIM + c] * sq);
    u64 cap = (u64)floorf(budget * 4.0f);

    double lo = block_min_f64(w > 0.0f ? (double)w * 0.01171875 : INFINITY, shd);
    double max_rho1 = block_max_f64(w > 0.0f ? (double)w * (0.75 / 1.25) : 0.0, shd);
    double lambda;
    if (lo == INFINITY) {
        lambda = INFINITY;
    } else if (quarters_at(w, lo, shu) <= cap) {
        lambda = lo;
    } else {
        double hi = 2.0 * max_rho1;
        for (int s = 0; s < steps; s++) {
            double mid = sqrt(lo * hi);
            if (quarters_at(w, mid, shu) <= cap) hi = mid; else lo = mid;
        }
        for (;;) {
            int t = depth_at(w, hi);
            double mine = (w > 0.0f && t < 4) ? (double)w * gain(t + 1) : -INFINITY;
            double next = block_max_f64(mine, shd);
            if (next == -INFINITY || next <= lo) break;
            if (quarters_at(w, next, shu) > cap) break;
            hi = next;
        }
        lambda = hi;
    }
    int t = depth_at(w, lambda);
    u64 quarters = block_sum_u64((u64)(4 * t + (t > 0)), shu);
    depths[(u64)h * DIM + c] = (u8)t;
    if (c == 0) { bits_out[h] = (float)quarters * 0.25f; atomicAdd(bits_acc, (float)quarters * 0.25f); }
    write_runs(runs, heads, h, c, t, nb);
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
