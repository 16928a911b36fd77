// Scans in HBM: approximate scores of all n keys for the GQ query heads of each KV head.
#include "common.cuh"
#define BPC 32   // 64-token blocks per CTA; 8 threads per block, 8 tokens per thread

// Bit-plane scan (SPEC §2, §3): score_g(i) = sum over active channels c (ascending) of
// q_gc * k̂_t(i, c), k̂_t = (q_t - 2^(t-1) + 1/2) * m * 2^(1-t), t = depth of c.
// `base` holds one layer in the store layout: planes [H][D][4][nb] u64, scales [H][D][nb] fp16.
// grid = (ceil(nb / BPC), heads), block = 8 * BPC (>= DIM). scores: [heads][GQ][n] f32.
extern "C" __global__ void scan_planes(const u8* __restrict__ base, int heads, u64 nb, u64 n,
                                       const u8* __restrict__ depths, const float* __restrict__ q,
                                       float* __restrict__ scores) {
    __shared__ int act_c[DIM];
    __shared__ int act_t[DIM];
    __shared__ float qa[GQ][DIM];
    __shared__ int wcnt[32];
    __shared__ int nact;
    const int h = blockIdx.y;
    const int tid = threadIdx.x;
    // Order-preserving compaction of the active channels.
    int t0 = 0;
    bool on = false;
    if (tid < DIM) { t0 = depths[(u64)h * DIM + tid]; on = t0 > 0; }
    unsigned bal = __ballot_sync(0xffffffffu, on);
    if ((tid & 31) == 0) wcnt[tid >> 5] = __popc(bal);
    __syncthreads();
    if (tid < DIM) {
        int off = 0;
        for (int w = 0; w < (tid >> 5); w++) off += wcnt[w];
        off += __popc(bal & ((1u << (tid & 31)) - 1u));
        if (on) {
            act_c[off] = tid;
            act_t[off] = t0;
            for (int g = 0; g < GQ; g++) qa[g][off] = q[((u64)h * GQ + g) * DIM + tid];
        }
        if (tid == DIM - 1) nact = off + (on ? 1 : 0);
    }
    __syncthreads();
    const u64 b = (u64)blockIdx.x * BPC + (tid >> 3);
    const int sub = tid & 7;
    if (b >= nb) return;
    const u64* planes = (const u64*)base;
    const u16* scales = (const u16*)(base + (u64)heads * DIM * 4 * nb * 8);
    float acc[GQ][8];
#pragma unroll
    for (int g = 0; g < GQ; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
    const int na = nact;
    for (int a = 0; a < na; a++) {
        const int c = act_c[a], t = act_t[a];
        const u64 hc = (u64)h * DIM + c;
        const float m = f16_to_f32(scales[hc * nb + b]);
        const float step = t == 1 ? m * 2.0f : t == 2 ? m : t == 3 ? m * 0.5f : m * 0.25f;
        const float half_range = (float)(1 << (t - 1));
        u32 by[4];
#pragma unroll
        for (int p = 0; p < 4; p++)
            by[p] = p < t ? (u32)(planes[(hc * 4 + p) * nb + b] >> (sub * 8)) & 0xffu : 0u;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 qt = 0;
#pragma unroll
            for (int p = 0; p < 4; p++)
                if (p < t) qt = (qt << 1) | ((by[p] >> j) & 1u);
            const float kv = __fmul_rn(__fadd_rn(__fsub_rn((float)qt, half_range), 0.5f), step);
#pragma unroll
            for (int g = 0; g < GQ; g++) acc[g][j] = __fadd_rn(acc[g][j], __fmul_rn(qa[g][a], kv));
        }
    }
    const u64 tok0 = b * 64 + (u64)sub * 8;
#pragma unroll
    for (int g = 0; g < GQ; g++) {
        float* out = scores + ((u64)h * GQ + g) * n;
        if (tok0 + 8 <= n && (n & 3) == 0) {
            *(float4*)(out + tok0) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            *(float4*)(out + tok0 + 4) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) if (tok0 + j < n) out[tok0 + j] = acc[g][j];
        }
    }
}

// Block-landmark scan (ShadowKV-style): the fp16 mean key of each 8-token group; every token
// gets its group's score. table: [heads][ceil(n/8)][DIM] fp16. grid = (groups/256, heads).
extern "C" __global__ void scan_landmark(const u16* __restrict__ table, u64 n, const float* __restrict__ q,
                                         float* __restrict__ scores) {
    __shared__ float qs[GQ][DIM];
    const int h = blockIdx.y;
    for (int i = threadIdx.x; i < GQ * DIM; i += blockDim.x) qs[i / DIM][i % DIM] = q[(u64)h * GQ * DIM + i];
    __syncthreads();
    const u64 ng = (n + 7) / 8;
    const u64 grp = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (grp >= ng) return;
    const uint4* row = (const uint4*)(table + ((u64)h * ng + grp) * DIM);
    float acc[GQ];
    for (int g = 0; g < GQ; g++) acc[g] = 0.0f;
    for (int v = 0; v < DIM / 8; v++) {
        uint4 x = row[v];
        u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float k = f16_to_f32((u16)(w[e >> 1] >> ((e & 1) * 16)));
            for (int g = 0; g < GQ; g++) acc[g] += qs[g][v * 8 + e] * k;
        }
    }
    for (int g = 0; g < GQ; g++) {
        float* out = scores + ((u64)h * GQ + g) * n;
        for (int j = 0; j < 8; j++) if (grp * 8 + j < n) out[grp * 8 + j] = acc[g];
    }
}

// Quest: per 16-token page, channel-wise min and max (fp16); page score
// sum_c max(q_c * min_c, q_c * max_c). table: [heads][ceil(n/16)][2][DIM] fp16.
extern "C" __global__ void scan_quest(const u16* __restrict__ table, u64 n, const float* __restrict__ q,
                                      float* __restrict__ scores) {
    __shared__ float qs[GQ][DIM];
    const int h = blockIdx.y;
    for (int i = threadIdx.x; i < GQ * DIM; i += blockDim.x) qs[i / DIM][i % DIM] = q[(u64)h * GQ * DIM + i];
    __syncthreads();
    const u64 np = (n + 15) / 16;
    const u64 pg = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (pg >= np) return;
    const uint4* mn = (const uint4*)(table + (((u64)h * np + pg) * 2) * DIM);
    const uint4* mx = mn + DIM / 8;
    float acc[GQ];
    for (int g = 0; g < GQ; g++) acc[g] = 0.0f;
    for (int v = 0; v < DIM / 8; v++) {
        uint4 a = mn[v], b = mx[v];
        u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float lo = f16_to_f32((u16)(wa[e >> 1] >> ((e & 1) * 16)));
            float hi = f16_to_f32((u16)(wb[e >> 1] >> ((e & 1) * 16)));
            for (int g = 0; g < GQ; g++) { float qq = qs[g][v * 8 + e]; acc[g] += fmaxf(qq * lo, qq * hi); }
        }
    }
    for (int g = 0; g < GQ; g++) {
        float* out = scores + ((u64)h * GQ + g) * n;
        for (int j = 0; j < 16; j++) if (pg * 16 + j < n) out[pg * 16 + j] = acc[g];
    }
}
