// Scans in HBM: approximate scores of all n keys for the GQ query heads of each KV head.
#include "common.cuh"
#define BPC 32   // 64-token blocks per CTA; 8 threads per block, 8 tokens per thread

// Level-1 top-k histogram fused into the scan when it fits in shared memory (topk.cu).
#define HBINS 1024
#if GQ <= 8
#define FUSED_HIST 1
#else
#define FUSED_HIST 0
#endif

// Bit-plane scan (docs/SPEC.md §2, §3): score_g(i) = sum over active channels c (ascending) of
// q_gc * k̂_t(i, c), k̂_t = (q_t - 2^(t-1) + 1/2) * m * 2^(1-t), t = depth of c.
// A CTA covers BPC blocks; for every CHS active channels it first stages their plane words
// and scales in shared memory with one cooperative load (all loads independent, coalesced),
// then each thread (8 per block, 8 tokens each) spreads the t plane bytes of its tokens into
// 8 bytes (the t-bit codes q_t), turns each into (q_t - 2^(t-1) + 1/2) exactly with one byte
// permute and the 2^22 magic-number trick, and does one FMA per query head with
// q_gc * m * 2^(1-t).
// planes: [H][D][4][nb] u64 and scales: [H][D][nb] fp16 of this head group (head = blockIdx.y).
// grid = (ceil(nb / BPC), heads), block = 8 * BPC (>= DIM). scores: [heads][GQ][n] f32.
// hist ([heads*GQ][HBINS], zeroed by the caller): histogram of the top 10 key bits of the
// middle tokens (when FUSED_HIST).
#define CHS 8
extern "C" __global__ void scan_planes(const u64* __restrict__ planes, const u16* __restrict__ scales,
                                       u64 nb, u64 n, const u8* __restrict__ depths,
                                       const float* __restrict__ q, float* __restrict__ scores,
                                       u32* __restrict__ hist) {
    __shared__ int act_c[DIM];
    __shared__ int act_t[DIM];
    __shared__ float qa[GQ][DIM];
    __shared__ int wcnt[32];
    __shared__ int nact;
    __shared__ u64 sw[CHS][4][BPC];
    __shared__ float sm[CHS][BPC];
#if FUSED_HIST
    __shared__ u32 sh[GQ][HBINS];
    for (int i = threadIdx.x; i < GQ * HBINS; i += blockDim.x) sh[i / HBINS][i % HBINS] = 0;
#endif
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
    const u64 b0 = (u64)blockIdx.x * BPC;
    const int lb = tid >> 3, sub = tid & 7;
    const u64 b = b0 + lb;
    const bool live = b < nb;
    float acc[GQ][8];
#pragma unroll
    for (int g = 0; g < GQ; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
    const int na = nact;
    for (int a0 = 0; a0 < na; a0 += CHS) {
        for (int i = tid; i < CHS * 4 * BPC; i += blockDim.x) {
            const int s = i / (4 * BPC), p = (i / BPC) % 4, j = i % BPC;
            const int a = a0 + s;
            if (a < na && p < act_t[a] && b0 + j < nb)
                sw[s][p][j] = planes[(((u64)h * DIM + act_c[a]) * 4 + p) * nb + b0 + j];
        }
        for (int i = tid; i < CHS * BPC; i += blockDim.x) {
            const int s = i / BPC, j = i % BPC;
            const int a = a0 + s;
            if (a < na && b0 + j < nb) sm[s][j] = f16_to_f32(scales[((u64)h * DIM + act_c[a]) * nb + b0 + j]);
        }
        __syncthreads();
        const int ns = min(CHS, na - a0);
        if (live) {
            for (int s = 0; s < ns; s++) {
                const int a = a0 + s, t = act_t[a];
                const float m = sm[s][lb];
                // Codes of tokens 0..3 in the bytes of c0, 4..7 in c1 (bit i of a nibble goes
                // to byte i by one magic multiply: the shifted copies never overlap).
                u32 c0 = 0, c1 = 0;
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    if (p < t) {
                        const u32 by = (u32)(sw[s][p][lb] >> (sub * 8)) & 0xffu;
                        c0 |= (((by & 0xFu) * 0x00204081u) & 0x01010101u) << (t - 1 - p);
                        c1 |= (((by >> 4) * 0x00204081u) & 0x01010101u) << (t - 1 - p);
                    }
                }
                // Bytes now hold 2 q_t + 1 (<= 31).
                c0 = (c0 << 1) | 0x01010101u;
                c1 = (c1 << 1) | 0x01010101u;
                const float step = t == 1 ? m : t == 2 ? m * 0.5f : t == 3 ? m * 0.25f : m * 0.125f;  // m * 2^(1-t)
                // Floats in [2^22, 2^23) step by 1/2: the bits 0x4A8000xx with xx = 2 q_t + 1 are
                // 2^22 + q_t + 1/2 (one byte permute per token), and subtracting 2^22 + 2^(t-1)
                // leaves q_t - 2^(t-1) + 1/2 exactly.
                const float off = 4194304.0f + (float)(1 << (t - 1));
                float A[GQ];
#pragma unroll
                for (int g = 0; g < GQ; g++) A[g] = qa[g][a] * step;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float kv = __int_as_float(__byte_perm(j < 4 ? c0 : c1, 0x4A800000u, 0x7650u | (j & 3))) - off;
#pragma unroll
                    for (int g = 0; g < GQ; g++) acc[g][j] = fmaf(A[g], kv, acc[g][j]);
                }
            }
        }
        __syncthreads();
    }
    const u64 tok0 = b * 64 + (u64)sub * 8;
    if (live) {
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
#if FUSED_HIST
    // Middle tokens [lo, hi) as in topk.cu; shared-memory atomics.
    const u64 lo = n < SINK ? n : SINK;
    const u64 hi0 = n > LOCAL ? n - LOCAL : 0;
    const u64 hi = hi0 > lo ? hi0 : lo;
#pragma unroll
    for (int g = 0; g < GQ; g++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const u64 tok = tok0 + j;
            const bool in = live && tok >= lo && tok < hi;
            const u32 bin = in ? (f32_key(acc[g][j]) >> 22) : 0xffffffffu;
            if (in) atomicAdd(&sh[g][bin], 1u);
        }
    }
    __syncthreads();
    for (int i = tid; i < GQ * HBINS; i += blockDim.x) {
        const u32 v = sh[i / HBINS][i % HBINS];
        if (v) atomicAdd(&hist[((u64)h * GQ + i / HBINS) * HBINS + i % HBINS], v);
    }
#endif
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
