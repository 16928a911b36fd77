// Exact softmax attention over the gathered rows (docs/SPEC.md §5): scale 1/sqrt(D), no softcap.
// Split over chunks of CH rows (partial max, sum and weighted V), then combined.
#include "common.cuh"
#define CH 64
#define NT 128

// grid = (nsplit, heads), block = NT. rows: [heads][umax][K DIM | V DIM] bf16.
// q: [heads][GQ][DIM] f32. pm, pl: [heads][nsplit][GQ]; pacc: [heads][nsplit][GQ][DIM].
extern "C" __global__ void attn_partial(const u16* __restrict__ rows, const u32* __restrict__ ucount, u64 umax,
                                        const float* __restrict__ q, float scale,
                                        float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc) {
    __shared__ float qs[GQ][DIM];
    __shared__ float p[GQ][CH];
    __shared__ float mx[GQ];
    const int h = blockIdx.y, split = blockIdx.x, nsplit = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 u = min((u64)ucount[h], umax);
    const u64 start = (u64)split * CH;
    const u64 pbase = ((u64)h * nsplit + split) * GQ;
    if (start >= u) {
        for (int i = tid; i < GQ * DIM; i += NT) pacc[pbase * DIM + i] = 0.0f;
        if (tid < GQ) { pm[pbase + tid] = -INFINITY; pl[pbase + tid] = 0.0f; }
        return;
    }
    const int nr = (int)min((u64)CH, u - start);
    for (int i = tid; i < GQ * DIM; i += NT) qs[i / DIM][i % DIM] = q[(u64)h * GQ * DIM + i];
    __syncthreads();
    const u16* base = rows + ((u64)h * umax + start) * 2 * DIM;
    for (int r = warp; r < nr; r += NT / 32) {
        const u16* k = base + (u64)r * 2 * DIM;
        float d[GQ];
#pragma unroll
        for (int g = 0; g < GQ; g++) d[g] = 0.0f;
        for (int c = lane; c < DIM; c += 32) {
            float kv = bf16_to_f32(k[c]);
#pragma unroll
            for (int g = 0; g < GQ; g++) d[g] += qs[g][c] * kv;
        }
#pragma unroll
        for (int g = 0; g < GQ; g++) {
            float x = d[g];
            for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            if (lane == 0) p[g][r] = x * scale;
        }
    }
    __syncthreads();
    if (tid < GQ) {
        float m = -INFINITY;
        for (int r = 0; r < nr; r++) m = fmaxf(m, p[tid][r]);
        mx[tid] = m;
    }
    __syncthreads();
    for (int i = tid; i < GQ * nr; i += NT) { int g = i / nr, r = i % nr; p[g][r] = expf(p[g][r] - mx[g]); }
    __syncthreads();
    if (tid < GQ) {
        float l = 0.0f;
        for (int r = 0; r < nr; r++) l += p[tid][r];
        pm[pbase + tid] = mx[tid];
        pl[pbase + tid] = l;
    }
    for (int c = tid; c < DIM; c += NT) {
        float acc[GQ];
#pragma unroll
        for (int g = 0; g < GQ; g++) acc[g] = 0.0f;
        for (int r = 0; r < nr; r++) {
            float v = bf16_to_f32(base[(u64)r * 2 * DIM + DIM + c]);
#pragma unroll
            for (int g = 0; g < GQ; g++) acc[g] += p[g][r] * v;
        }
#pragma unroll
        for (int g = 0; g < GQ; g++) pacc[(pbase + g) * DIM + c] = acc[g];
    }
}

// grid = heads * GQ, block = DIM (<= 1024). out: [heads][GQ][DIM] f32.
extern "C" __global__ void attn_combine(const float* __restrict__ pm, const float* __restrict__ pl,
                                        const float* __restrict__ pacc, int nsplit, float* __restrict__ out) {
    const int hg = blockIdx.x, h = hg / GQ, g = hg % GQ, c = threadIdx.x;
    float M = -INFINITY;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, pm[((u64)h * nsplit + s) * GQ + g]);
    float L = 0.0f, o = 0.0f;
    for (int s = 0; s < nsplit; s++) {
        const u64 i = ((u64)h * nsplit + s) * GQ + g;
        const float w = pm[i] == -INFINITY ? 0.0f : expf(pm[i] - M);
        L += pl[i] * w;
        o += pacc[i * DIM + c] * w;
    }
    out[(u64)hg * DIM + c] = L > 0.0f ? o / L : 0.0f;
}
