// The gather: copies every run of a fixed-size run list from (mapped, pinned) host memory into
// an HBM staging buffer at the same offset. Work item w = (run w / chunks, chunk w % chunks);
// CTAs stride over the work items (grid-stride), so the caller can cap the grid and leave
// multiprocessors free for compute kernels of earlier head groups (pipelined steps).
// Zero-length and short runs cost one load of their Run. 16-byte loads, UNROLL in flight per
// thread.
#include "common.cuh"
#define UNROLL 4

extern "C" __global__ void gather_runs(const u8* __restrict__ src, u8* __restrict__ dst,
                                       const Run* __restrict__ runs, u64 chunk, u64 nruns,
                                       u64 chunks) {
    const u64 items = nruns * chunks;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const Run run = runs[w / chunks];
        const u64 start = (w % chunks) * chunk;
        if (start >= run.len) continue;
        const u64 end = min(start + chunk, run.len);
        const u8* s = src + run.off;
        u8* d = dst + run.off;
        if (((run.off | start | end) & 15) == 0) {
            const uint4* s4 = (const uint4*)(s);
            uint4* d4 = (uint4*)(d);
            const u64 b = start >> 4, e = end >> 4;
            for (u64 i = b + threadIdx.x; i < e; i += (u64)blockDim.x * UNROLL) {
                uint4 v[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; u++) {
                    u64 k = i + (u64)u * blockDim.x;
                    if (k < e) v[u] = s4[k];
                }
#pragma unroll
                for (int u = 0; u < UNROLL; u++) {
                    u64 k = i + (u64)u * blockDim.x;
                    if (k < e) d4[k] = v[u];
                }
            }
        } else {
            for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) d[i] = s[i];
        }
    }
}
