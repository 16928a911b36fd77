// Top-k per query head by radix select on order-preserving f32 keys, then the union of the
// group's winners (plus sink and local tokens) per KV head. No host synchronisation: every
// count stays on the device. Row r = h * GQ + g covers the middle tokens [lo, hi) with
// lo = min(SINK, n), hi = max(lo, n - LOCAL).
#include "common.cuh"
// SINK and LOCAL come from Rust (-D, crate::cuda::module::STEP_SINK / STEP_LOCAL).
#ifndef SINK
#error "compile with -DSINK=<sink tokens>"
#endif
#ifndef LOCAL
#error "compile with -DLOCAL=<local tokens>"
#endif
#define BINS 2048   // bins of the refinement passes (select_bin)
#define HBINS 1024  // level-1 bins: top 10 key bits
#define ELEMS 4096   // elements per CTA in the streaming passes

struct Sel { int bucket; u32 need; };

__device__ __forceinline__ void middle(u64 n, u64* lo, u64* hi) {
    u64 l = n < SINK ? n : SINK;
    u64 h = n > LOCAL ? n - LOCAL : 0;
    *lo = l;
    *hi = h > l ? h : l;
}

// Histogram of the top 10 key bits of each row's middle tokens (for the table scans; the
// plane scan builds it itself). grid = (chunks, rows).
extern "C" __global__ void topk_hist(const float* __restrict__ scores, u64 n, u32* __restrict__ hist) {
    __shared__ u32 sh[HBINS];
    for (int i = threadIdx.x; i < HBINS; i += blockDim.x) sh[i] = 0;
    __syncthreads();
    u64 lo, hi;
    middle(n, &lo, &hi);
    const int r = blockIdx.y;
    const float* row = scores + (u64)r * n;
    const u64 s = lo + (u64)blockIdx.x * ELEMS, e = min(s + ELEMS, hi);
    for (u64 i = s + threadIdx.x; i < e; i += blockDim.x) atomicAdd(&sh[f32_key(row[i]) >> 22], 1u);
    __syncthreads();
    for (int i = threadIdx.x; i < HBINS; i += blockDim.x)
        if (sh[i]) atomicAdd(&hist[(u64)r * HBINS + i], sh[i]);
}

// Finds, over BINS bins in descending order, the bin holding the k-th largest element.
// Block of 1024 threads, 2 bins each. Returns (in shared) the bin and the count above it.
__device__ void select_bin(const u32* cnt, u32 k, int* out_bin, u32* out_above, u32* out_total) {
    __shared__ u32 wsum[32];
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    // Descending order: position j holds bin BINS-1-j.
    const u32 a = cnt[BINS - 1 - 2 * t], b = cnt[BINS - 2 - 2 * t];
    u32 s = a + b, x = s;
    for (int o = 1; o < 32; o <<= 1) { u32 y = __shfl_up_sync(0xffffffffu, x, o); if (lane >= o) x += y; }
    if (lane == 31) wsum[w] = x;
    __syncthreads();
    if (w == 0) {
        u32 v = wsum[lane], z = v;
        for (int o = 1; o < 32; o <<= 1) { u32 y = __shfl_up_sync(0xffffffffu, z, o); if (lane >= o) z += y; }
        wsum[lane] = z - v;  // exclusive
        if (lane == 31) *out_total = z;
    }
    __syncthreads();
    const u32 excl = wsum[w] + x - s;
    if (excl < k && excl + a >= k) { *out_bin = BINS - 1 - 2 * t; *out_above = excl; }
    else if (excl + a < k && excl + a + b >= k) { *out_bin = BINS - 2 - 2 * t; *out_above = excl + a; }
    __syncthreads();
}

// Per row: the boundary bucket and how many of it are needed; resets the row's counters.
// grid = rows, block = 1024.
extern "C" __global__ void topk_select(const u32* __restrict__ hist, u32 k, Sel* __restrict__ sel,
                                       u32* __restrict__ wcount, u32* __restrict__ ccount,
                                       u32* __restrict__ tcount, u32* __restrict__ ucount) {
    __shared__ int bin;
    __shared__ u32 above, total;
    __shared__ u32 cnt[BINS];
    const int r = blockIdx.x;
    if (threadIdx.x == 0) { bin = -1; above = 0; }
    for (int i = threadIdx.x; i < BINS; i += blockDim.x) cnt[i] = i < HBINS ? hist[(u64)r * HBINS + i] : 0u;
    __syncthreads();
    select_bin(cnt, k, &bin, &above, &total);
    if (threadIdx.x == 0) {
        Sel s;
        if (total <= k) { s.bucket = -1; s.need = 0; }
        else { s.bucket = bin; s.need = k - above; }
        sel[r] = s;
        wcount[r] = 0; ccount[r] = 0; tcount[r] = 0;
        if (r % GQ == 0) ucount[r / GQ] = 0;
    }
}

// Streams each row once: keys above the boundary bucket are winners; keys in it are
// candidates. grid = (chunks, rows).
extern "C" __global__ void topk_collect(const float* __restrict__ scores, u64 n, u32 k,
                                        const Sel* __restrict__ sel, u32* __restrict__ win,
                                        u32* __restrict__ wcount, u32* __restrict__ cand_key,
                                        u32* __restrict__ cand_idx, u64 ccap, u32* __restrict__ ccount) {
    u64 lo, hi;
    middle(n, &lo, &hi);
    const int r = blockIdx.y;
    const Sel s = sel[r];
    const float* row = scores + (u64)r * n;
    const u64 st = lo + (u64)blockIdx.x * ELEMS, e = min(st + ELEMS, hi);
    // Warp-aggregated appends: one atomic per warp and list per iteration instead of one per
    // element (the threshold bucket can hold tens of thousands of a row's tokens, all
    // appending to the same counter). The loop bound is uniform across the CTA, so every lane
    // reaches the ballots.
    const int lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u;
    for (u64 b0 = st; b0 < e; b0 += blockDim.x) {
        const u64 i = b0 + threadIdx.x;
        const bool in = i < e;
        const u32 key = in ? f32_key(row[i]) : 0u;
        const int bk = (int)(key >> 22);
        const bool w = in && bk > s.bucket;
        const bool c = in && bk == s.bucket;
        const unsigned mw = __ballot_sync(0xffffffffu, w);
        const unsigned mc = __ballot_sync(0xffffffffu, c);
        if (mw) {
            const int leader = __ffs(mw) - 1;
            u32 p0 = 0;
            if (lane == leader) p0 = atomicAdd(&wcount[r], (u32)__popc(mw));
            p0 = __shfl_sync(0xffffffffu, p0, leader);
            if (w) {
                const u32 p = p0 + (u32)__popc(mw & below);
                if (p < k) win[(u64)r * k + p] = (u32)i;
            }
        }
        if (mc) {
            const int leader = __ffs(mc) - 1;
            u32 p0 = 0;
            if (lane == leader) p0 = atomicAdd(&ccount[r], (u32)__popc(mc));
            p0 = __shfl_sync(0xffffffffu, p0, leader);
            if (c) {
                const u32 p = p0 + (u32)__popc(mc & below);
                if (p < ccap) { cand_key[(u64)r * ccap + p] = key; cand_idx[(u64)r * ccap + p] = (u32)i; }
            }
        }
    }
}

// Per row: selects the `need` largest candidates by the remaining 22 key bits (two passes of
// 11 bits); ties at the final key are taken in arrival order. grid = rows, block = 1024.
extern "C" __global__ void topk_finish(const Sel* __restrict__ sel, u32 k, const u32* __restrict__ cand_key,
                                       const u32* __restrict__ cand_idx, u64 ccap,
                                       const u32* __restrict__ ccount, u32* __restrict__ win,
                                       u32* __restrict__ wcount, u32* __restrict__ tcount) {
    __shared__ u32 hist[BINS];
    __shared__ int bin;
    __shared__ u32 above, total;
    const int r = blockIdx.x;
    const Sel s = sel[r];
    if (s.need == 0) return;
    const u32 cc = min((u64)ccount[r], ccap);
    const u32* keys = cand_key + (u64)r * ccap;
    const u32* idx = cand_idx + (u64)r * ccap;
    u32 need = s.need;
    u32 prefix = (u32)s.bucket << 22, pmask = 0xffc00000u;
    const int shifts[2] = {11, 0};
    const u32 widths[2] = {0x7ffu, 0x7ffu};
    for (int pass = 0; pass < 2; pass++) {
        for (int i = threadIdx.x; i < BINS; i += blockDim.x) hist[i] = 0;
        if (threadIdx.x == 0) { bin = -1; above = 0; }
        __syncthreads();
        for (u32 i = threadIdx.x; i < cc; i += blockDim.x) {
            u32 key = keys[i];
            if ((key & pmask) == prefix) atomicAdd(&hist[(key >> shifts[pass]) & widths[pass]], 1u);
        }
        __syncthreads();
        select_bin(hist, need, &bin, &above, &total);
        need -= above;
        prefix |= (u32)bin << shifts[pass];
        pmask |= widths[pass] << shifts[pass];
        __syncthreads();
    }
    // prefix is now the exact threshold key T; take all keys > T and `need` keys == T.
    for (u32 i = threadIdx.x; i < cc; i += blockDim.x) {
        u32 key = keys[i];
        bool take = key > prefix;
        if (!take && key == prefix) take = atomicAdd(&tcount[r], 1u) < need;
        if (take) {
            u32 p = atomicAdd(&wcount[r], 1u);
            if (p < k) win[(u64)r * k + p] = idx[i];
        }
    }
}

// Union per KV head of its GQ rows' winners and the sink and local tokens, deduplicated with
// a stamp array (stamp[h][i] == tag marks token i as already listed for this launch).
// grid = (ceil((GQ*k + SINK + LOCAL) / 256), heads).
extern "C" __global__ void topk_union(const u32* __restrict__ win, const u32* __restrict__ wcount, u32 k,
                                      u64 n, u32 tag, u32* __restrict__ stamp, u32* __restrict__ ulist,
                                      u64 umax, u32* __restrict__ ucount) {
    const int h = blockIdx.y;
    const u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 tok;
    if (e < SINK + LOCAL) {
        u64 lo, hi;
        middle(n, &lo, &hi);
        if (e < SINK) { if (e >= lo) return; tok = e; }
        else { tok = hi + (e - SINK); if (tok >= n) return; }
    } else {
        u64 x = e - SINK - LOCAL;
        u64 g = x / k, j = x % k;
        if (g >= GQ) return;
        const int r = h * GQ + (int)g;
        if (j >= min(wcount[r], k)) return;
        tok = win[(u64)r * k + j];
    }
    u32 old = atomicExch(&stamp[(u64)h * n + tok], tag);
    if (old != tag) {
        u32 p = atomicAdd(&ucount[h], 1u);
        if (p < umax) ulist[(u64)h * umax + p] = (u32)tok;
    }
}
