// Row gather: the union's K and V rows (one record = a token's K then V of one KV head, bf16,
// 4*DIM bytes) into a compact HBM buffer, one warp per row, 16-byte lanes. Rows come from an
// HBM cache of recently fetched rows when present there (direct-mapped: slot = token mod C,
// tag = token + 1), else from the (mapped host or HBM) record store.
#include "common.cuh"
#define REC (4 * DIM)
#define PIECES (REC / 16)

// grid = (ceil(umax / 8), heads), block = 256. src: [heads][n] records of this layer.
// tags/data: this layer's cache ([heads][C] and [heads][C][REC]); tags == 0 disables the cache.
extern "C" __global__ void rows_gather(const u8* __restrict__ src, u64 n, const u32* __restrict__ ulist,
                                       const u32* __restrict__ ucount, u64 umax,
                                       const u32* __restrict__ tags, const u8* __restrict__ cache, u64 C,
                                       u8* __restrict__ out, u32* __restrict__ hits,
                                       u32* __restrict__ utotal) {
    __shared__ u32 sh_hits;
    if (threadIdx.x == 0) sh_hits = 0;
    __syncthreads();
    const int h = blockIdx.y, lane = threadIdx.x & 31;
    const u64 pos = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u64 u = min((u64)ucount[h], umax);
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(utotal, (u32)u);
    if (pos < u) {
        const u32 tok = ulist[(u64)h * umax + pos];
        const uint4* s;
        bool hit = false;
        if (tags != 0) {
            const u64 slot = tok % C;
            hit = tags[(u64)h * C + slot] == tok + 1;
            if (hit) s = (const uint4*)(cache + ((u64)h * C + slot) * REC);
        }
        if (!hit) s = (const uint4*)(src + ((u64)h * n + tok) * REC);
        uint4* d = (uint4*)(out + ((u64)h * umax + pos) * REC);
        for (int i = lane; i < PIECES; i += 32) d[i] = s[i];
        if (hit && lane == 0) atomicAdd(&sh_hits, 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0 && sh_hits) atomicAdd(hits, sh_hits);
}

// Misses claim their cache slot: the largest (stamp, token) wins a slot this launch.
// grid = (ceil(umax / 256), heads).
extern "C" __global__ void rows_claim(const u32* __restrict__ ulist, const u32* __restrict__ ucount, u64 umax,
                                      const u32* __restrict__ tags, u64 C, u64* __restrict__ claim, u64 stamp) {
    const int h = blockIdx.y;
    const u64 pos = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (pos >= min((u64)ucount[h], umax)) return;
    const u32 tok = ulist[(u64)h * umax + pos];
    const u64 slot = tok % C;
    if (tags[(u64)h * C + slot] != tok + 1) atomicMax(&claim[(u64)h * C + slot], (stamp << 32) | tok);
}

// Claim winners copy their gathered row into the cache and set the tag. grid as rows_gather.
extern "C" __global__ void rows_fill(const u32* __restrict__ ulist, const u32* __restrict__ ucount, u64 umax,
                                     u32* __restrict__ tags, u8* __restrict__ cache, u64 C,
                                     const u64* __restrict__ claim, u64 stamp, const u8* __restrict__ rows) {
    const int h = blockIdx.y, lane = threadIdx.x & 31;
    const u64 pos = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (pos >= min((u64)ucount[h], umax)) return;
    const u32 tok = ulist[(u64)h * umax + pos];
    const u64 slot = tok % C;
    if (claim[(u64)h * C + slot] != ((stamp << 32) | tok)) return;
    const uint4* s = (const uint4*)(rows + ((u64)h * umax + pos) * REC);
    uint4* d = (uint4*)(cache + ((u64)h * C + slot) * REC);
    for (int i = lane; i < PIECES; i += 32) d[i] = s[i];
    __syncwarp();
    if (lane == 0) tags[(u64)h * C + slot] = tok + 1;
}
