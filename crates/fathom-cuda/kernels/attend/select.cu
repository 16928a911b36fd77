// Stage 3, the selection (docs/SPEC.md §5): each query head's top-k (the boundary bucket, one
// streaming pass, the exact boundary; or the filtered select), then the union per KV head.
// NVRTC compiles it after shared.cuh and the stages before it (src/cuda/cache/params.rs,
// ATTEND_SRC), so it uses their types, helpers and #defines.
#define BINS 2048   // bins of a selection pass (2 per thread of TK)
#define ELEMS 4096  // middle tokens per CTA of paged_topk_collect

// Over BINS bin counts `cnt` in descending bin order, the bin holding the k-th largest
// element, the count of the bins above it and the total (in shared memory). All TK threads.
__device__ void select_bin(const u32* cnt, u32 k, int* out_bin, u32* out_above, u32* out_total) {
    __shared__ u32 wsum[32];
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    // Position j of the descending order holds bin BINS - 1 - j; thread t owns 2t and 2t + 1.
    const u32 c0 = cnt[BINS - 1 - 2 * t], c1 = cnt[BINS - 2 - 2 * t];
    const u32 s = c0 + c1;
    u32 x = s;
    for (int o = 1; o < 32; o <<= 1) { const u32 y = __shfl_up_sync(0xffffffffu, x, o); if (lane >= o) x += y; }
    if (lane == 31) wsum[w] = x;
    __syncthreads();
    if (w == 0) {
        const u32 v = wsum[lane];
        u32 z = v;
        for (int o = 1; o < 32; o <<= 1) { const u32 y = __shfl_up_sync(0xffffffffu, z, o); if (lane >= o) z += y; }
        wsum[lane] = z - v;
        if (lane == 31) *out_total = z;
    }
    __syncthreads();
    const u32 excl = wsum[w] + x - s;
    if (excl < k && excl + c0 >= k) { *out_bin = BINS - 1 - 2 * t; *out_above = excl; }
    else if (excl + c0 < k && excl + c0 + c1 >= k) { *out_bin = BINS - 2 - 2 * t; *out_above = excl + c0; }
    __syncthreads();
}

// The boundary of one query head row's top-k (docs/SPEC.md §5): kk = min(k, middle tokens)
// winners; from the scan's level-1 histogram, the bucket holding the kk-th largest score and
// how many of it are still needed (bucket -1: every middle token wins). Resets the row's
// winner and candidate counts. grid = (Hq, batch), block = TK.
struct Sel { int bucket; u32 need; };
extern "C" __global__ void paged_topk_select(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                             const u32* __restrict__ hist, Sel* __restrict__ sel,
                                             u32* __restrict__ counts, u32* __restrict__ ccount,
                                             const u32* __restrict__ mode) {
    __shared__ u32 cnt[BINS];
    __shared__ int bin;
    __shared__ u32 above, total;
    const u32 b = blockIdx.y, hq = a.h0 * GQ + blockIdx.x;
    const u64 r = (u64)b * g.heads * GQ + hq;
    if (mode[r] == 1) return;  // selected by the filtered path
    const AppendDesc d = descs[b];
    u32 lo, hi;
    middle(d.n0 + d.m, a, &lo, &hi);
    const u32 kk = min(a.k, hi - lo);
    for (u32 i = threadIdx.x; i < BINS; i += TK) cnt[i] = i < HBINS ? hist[r * HBINS + i] : 0u;
    if (threadIdx.x == 0) { bin = -1; above = 0; }
    __syncthreads();
    select_bin(cnt, kk, &bin, &above, &total);
    if (threadIdx.x == 0) {
        Sel s;
        if (kk == 0) { s.bucket = BINS; s.need = 0; }          // nothing wins
        else if (total <= kk) { s.bucket = -1; s.need = 0; }    // every middle token wins
        else { s.bucket = bin; s.need = kk - above; }
        sel[r] = s;
        counts[r] = 0;
        ccount[r] = 0;
    }
}


// Streams ELEMS middle tokens of one row once: a score above the boundary bucket wins, one in
// it is a candidate (its index kept). Appends are aggregated per CTA: every thread's winners
// and candidates are counted, ranked by a block-wide scan, and the CTA reserves its places in
// each list with one atomic (a row's lists used to take one atomic per warp, and its
// candidates, a few per cent of 1M tokens, queued on one address). The lists' order is
// irrelevant: the union sorts the winners and the final select orders the candidates by key
// and token. A count goes on past its list's cap, so a caller sees an overflow.
// grid = (chunks, Hq, batch), block = COLLECT_NT.
#define COLLECT_NT 256
extern "C" __global__ void paged_topk_collect(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                              const float* __restrict__ scores, const Sel* __restrict__ sel,
                                              u32* __restrict__ winners, u32* __restrict__ counts,
                                              u32* __restrict__ cand, u32* __restrict__ ccount,
                                              const u32* __restrict__ mode) {
    __shared__ u32 warp_sum[COLLECT_NT / 32];
    __shared__ u32 base_w, base_c;
    const u32 b = blockIdx.z, hq = a.h0 * GQ + blockIdx.y;
    const u64 r = (u64)b * g.heads * GQ + hq;
    if (mode[r] == 1) return;  // uniform over the CTA
    const AppendDesc d = descs[b];
    u32 lo, hi;
    middle(d.n0 + d.m, a, &lo, &hi);
    const u32 st = lo + blockIdx.x * ELEMS;
    if (st >= hi) return;  // uniform over the CTA
    const u32 e = min(st + ELEMS, hi);
    const Sel s = sel[r];
    const float* row = scores + r * a.max_tokens;
    // Every score of the chunk loaded first (all in flight at once), then this thread's
    // winners and candidates as bit masks over its PER elements.
    constexpr u32 PER = ELEMS / COLLECT_NT;
    static_assert(PER <= 16, "a thread's counts are packed in 16 bits each");
    int bk[PER];
#pragma unroll
    for (u32 j = 0; j < PER; j++) {
        const u32 i = st + j * COLLECT_NT + threadIdx.x;
        const int x = (int)(f32_key(row[min(i, e - 1)]) >> 22);  // unconditional load
        bk[j] = i < e ? x : -2;
    }
    u32 wm = 0, cm = 0;
#pragma unroll
    for (u32 j = 0; j < PER; j++) {
        wm |= (u32)(bk[j] > s.bucket) << j;
        cm |= (u32)(bk[j] == s.bucket) << j;
    }
    // Winners in the high 16 bits, candidates in the low: a CTA holds at most ELEMS = 4096 of
    // either, so neither field carries into the other.
    const u32 mine = ((u32)__popc(wm) << 16) | (u32)__popc(cm);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 incl = mine;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sum[warp] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (u32 w = 0; w < COLLECT_NT / 32; ++w) { const u32 c = warp_sum[w]; warp_sum[w] = acc; acc += c; }
        const u32 tw = acc >> 16, tc = acc & 0xffffu;
        base_w = tw ? atomicAdd(&counts[r], tw) : 0u;
        base_c = tc ? atomicAdd(&ccount[r], tc) : 0u;
    }
    __syncthreads();
    const u32 before = warp_sum[warp] + incl - mine;
    u32 pw = base_w + (before >> 16), pc = base_c + (before & 0xffffu);
    u32* wl = winners + r * a.max_k;
    u32* cl = cand + r * a.max_tokens;
#pragma unroll
    for (u32 j = 0; j < PER; j++) {
        const u32 i = st + j * COLLECT_NT + threadIdx.x;
        if ((wm >> j) & 1u) {
            if (pw < a.max_k) wl[pw] = i;
            ++pw;
        }
        if ((cm >> j) & 1u) {
            if (pc < (u32)a.max_tokens) cl[pc] = i;
            ++pc;
        }
    }
}

// One radix-select pass over the candidates: `cand(i, &key, &tok)` gives candidate i's
// order-preserving key and token. Among those whose value v matches *prefix under *pmask,
// the bin of bits [shift, shift + width] of v holding the *need-th largest; v is the key, or,
// with `ties`, ~token among the candidates whose key is T (so the largest v are the lowest
// tokens). Narrows prefix and mask, lowers need by the count above the bin, and returns the
// bin's own count. All TK threads, with the same arguments.
template <class C>
__device__ u32 select_pass(C cand, u32 cc, bool ties, u32 T, u32* prefix, u32* pmask, int shift, u32 width,
                           u32* need, u32* hist) {
    __shared__ int bin;
    __shared__ u32 above, total;
    for (u32 i = threadIdx.x; i < BINS; i += TK) hist[i] = 0;
    if (threadIdx.x == 0) { bin = -1; above = 0; }
    __syncthreads();
    for (u32 i = threadIdx.x; i < cc; i += TK) {
        u32 key, tok;
        cand(i, &key, &tok);
        const u32 v = ties ? ~tok : key;
        if ((!ties || key == T) && (v & *pmask) == *prefix) atomicAdd(&hist[(v >> shift) & width], 1u);
    }
    __syncthreads();
    select_bin(hist, *need, &bin, &above, &total);
    const u32 own = bin >= 0 ? hist[bin] : 0u;
    const u32 ab = above;
    const int bn = bin;
    __syncthreads();
    *need -= ab;
    *prefix |= (u32)bn << shift;
    *pmask |= width << shift;
    return own;
}

// The key of the need-th largest candidate, from the bits known under kmask (0: none; or the
// level-1 bucket's top 10): passes of 11 bits. Lowers *need to the count still wanted among
// the candidates equal to it, and returns (in *eq) how many are. All TK threads.
template <class C>
__device__ u32 kth_key(C cand, u32 cc, u32 T, u32 kmask, u32* need, u32* eq, u32* hist) {
    if (kmask == 0u) {
        select_pass(cand, cc, false, 0, &T, &kmask, 21, 0x7ffu, need, hist);
        select_pass(cand, cc, false, 0, &T, &kmask, 10, 0x7ffu, need, hist);
        *eq = select_pass(cand, cc, false, 0, &T, &kmask, 0, 0x3ffu, need, hist);
    } else {
        select_pass(cand, cc, false, 0, &T, &kmask, 11, 0x7ffu, need, hist);
        *eq = select_pass(cand, cc, false, 0, &T, &kmask, 0, 0x7ffu, need, hist);
    }
    return T;
}

// The winners of one row among its candidates (as fathom_plan::select_per_head): the kk-th
// score's key T from the known bits (kmask over T), every candidate above T, and of those
// equal to T the lowest tokens (three passes over ~token). Appends to out (counts[r] from 0).
template <class C>
__device__ void take_winners(C cand, u32 cc, u32 need, u32 T, u32 kmask, u32* count, u32* out, u32 max_k,
                             u32* hist) {
    u32 eq = 0;
    T = kth_key(cand, cc, T, kmask, &need, &eq, hist);
    // `need` of the `eq` candidates equal to T still win.
    u32 ilim = 0xffffffffu;  // ties win when their token is <= ilim
    if (need < eq) {
        u32 ip = 0, imask = 0;
        select_pass(cand, cc, true, T, &ip, &imask, 21, 0x7ffu, &need, hist);
        select_pass(cand, cc, true, T, &ip, &imask, 10, 0x7ffu, &need, hist);
        select_pass(cand, cc, true, T, &ip, &imask, 0, 0x3ffu, &need, hist);
        ilim = ~ip;  // ip is ~(the need-th lowest tied token)
    }
    for (u32 i = threadIdx.x; i < cc; i += TK) {
        u32 key, tok;
        cand(i, &key, &tok);
        if (key > T || (key == T && tok <= ilim)) {
            const u32 p = atomicAdd(count, 1u);
            if (p < max_k) out[p] = tok;
        }
    }
}

// Per row of the score path: the `need` largest candidates of the boundary bucket give the
// exact kk-th score and the winners (take_winners). A row long enough for the filtered select
// then leaves its next estimate: the score of the FUSE_TARGET * kk-th largest token when it
// lies in the bucket, else the bucket's lowest score (fewer pass, but at least kk).
// grid = (Hq, batch), block = TK.
extern "C" __global__ void paged_topk_finish(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                             const float* __restrict__ scores, const Sel* __restrict__ sel,
                                             u32* __restrict__ winners, u32* __restrict__ counts,
                                             const u32* __restrict__ cand, const u32* __restrict__ ccount,
                                             const u32* __restrict__ mode, const float* __restrict__ qf,
                                             const u8* __restrict__ depths, float* __restrict__ est) {
    __shared__ u32 hist[BINS];
    const u32 b = blockIdx.y, hq = a.h0 * GQ + blockIdx.x;
    const u64 r = (u64)b * g.heads * GQ + hq;
    if (mode[r] == 1) return;  // selected by the filtered path
    const Sel s = sel[r];
    if (s.need == 0) return;
    const float* row = scores + r * a.max_tokens;
    const u32 cc = min(ccount[r], (u32)a.max_tokens);
    const u32* idx = cand + r * a.max_tokens;
    auto c = [&](u32 i, u32* key, u32* tok) { *tok = idx[i]; *key = f32_key(row[*tok]); };
    const u32 T0 = (u32)s.bucket << 22;
    take_winners(c, cc, s.need, T0, 0xffc00000u, &counts[r], winners + r * a.max_k, a.max_k, hist);
    if (a.fuse_min == 0) return;
    const AppendDesc d = descs[b];
    u32 lo, hi;
    middle(d.n0 + d.m, a, &lo, &hi);
    const u32 kk = min(a.k, hi - lo);
    if (hi - lo < a.fuse_min || hi - lo < 2u * FUSE_TARGET * kk) return;
    const u32 above = kk - s.need, m = FUSE_TARGET * kk;
    u32 fkey = T0;
    if (above + cc >= m) {
        u32 need = m - above, eq = 0;
        fkey = kth_key(c, cc, T0, 0xffc00000u, &need, &eq, hist);
    }
    if (threadIdx.x < 32) {
        const float norm = active_norm(qf + r * DIM, depths + (u64)b * a.depth_stride + (u64)(hq / GQ) * DIM);
        if (threadIdx.x == 0) est[est_at(d, g, a, hq)] = next_estimate(fkey, norm);
    }
}

// Per row with an estimate (fuse_row): checks the filtered scan's pairs. With kk to fcap of
// them, selects the winners among them exactly (take_winners over full keys), sets mode 1,
// and, when more than 2 * FUSE_TARGET * kk passed, tightens the estimate to the score of the
// FUSE_TARGET * kk-th largest; otherwise mode 2 (the fallback scan and the score path run).
// Rows without an estimate take mode 0. counters[2] counts filtered rows, counters[3]
// fallbacks. grid = (Hq, batch), block = TK.
extern "C" __global__ void paged_topk_fused(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                            const float* __restrict__ qf, const u8* __restrict__ depths,
                                            float* __restrict__ est, u32* __restrict__ mode,
                                            const uint2* __restrict__ fcand, const u32* __restrict__ fcount,
                                            u32* __restrict__ winners, u32* __restrict__ counts,
                                            unsigned long long* __restrict__ counters) {
    __shared__ u32 hist[BINS];
    const u32 b = blockIdx.y, hq = a.h0 * GQ + blockIdx.x;
    const u64 r = (u64)b * g.heads * GQ + hq;
    const AppendDesc d = descs[b];
    u32 lo, hi;
    middle(d.n0 + d.m, a, &lo, &hi);
    const u32 kk = min(a.k, hi - lo);
    const u64 ei = est_at(d, g, a, hq);
    if (!fuse_row(a, lo, hi, est[ei])) {
        if (threadIdx.x == 0) mode[r] = 0;
        return;
    }
    const u32 cnt = fcount[r];
    if (cnt < kk || cnt > a.fcap) {
        if (threadIdx.x == 0) { mode[r] = 2; atomicAdd(&counters[3], 1ull); }
        return;
    }
    if (threadIdx.x == 0) { mode[r] = 1; counts[r] = 0; atomicAdd(&counters[2], 1ull); }
    __syncthreads();
    const uint2* pairs = fcand + r * a.fcap;
    auto c = [&](u32 i, u32* key, u32* tok) { const uint2 p = pairs[i]; *key = p.x; *tok = p.y; };
    take_winners(c, cnt, kk, 0u, 0u, &counts[r], winners + r * a.max_k, a.max_k, hist);
    const u32 m = FUSE_TARGET * kk;
    if (cnt <= 2u * m) return;  // the estimate stands
    u32 need = m, eq = 0;
    const u32 fkey = kth_key(c, cnt, 0u, 0u, &need, &eq, hist);
    if (threadIdx.x < 32) {
        const float norm = active_norm(qf + r * DIM, depths + (u64)b * a.depth_stride + (u64)(hq / GQ) * DIM);
        if (threadIdx.x == 0) est[ei] = next_estimate(fkey, norm);
    }
}

// Block-wide exclusive prefix sum of a count in thread order; returns this thread's part,
// writes the block total to *total. All TK threads.
__device__ __forceinline__ u32 block_excl_sum(u32 v, u32* warp_counts, u32* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 incl = v;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_counts[warp] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (u32 w = 0; w < TK / 32; ++w) { const u32 c = warp_counts[w]; warp_counts[w] = acc; acc += c; }
        *total = acc;
    }
    __syncthreads();
    const u32 r = warp_counts[warp] + incl - v;
    __syncthreads();
    return r;
}

// The union of one (session, KV head)'s selections: sink and local (every query head), then
// the winners of all G query heads in token order without repeats, each with the mask of the
// heads that chose it. The middle tokens are taken in windows of UBITS: each winner sets its
// token's bit in a shared bitmap, a block-wide scan of the bitmap's popcounts (each thread
// owns UWPT consecutive words) gives every set bit its rank, the ranks' tokens are written in
// order, and each winner ORs its head's bit into its rank's mask. Sorting-free, and the same
// rows and masks as sorting the keys token*8 + g and merging runs (G <= 8, G·max_k <= UKEYS:
// CacheConfig checks both). grid = (batch, Hkv), block = TK.
#define UKEYS 8192
#define UWPT 8                      // bitmap words per thread
#define UWORDS (UWPT * TK)          // words of the window's bitmap
#define UBITS (UWORDS * 32u)        // middle tokens per window
#define UPT (UKEYS / TK)            // winners per thread
extern "C" __global__ void paged_union(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                       const u32* __restrict__ winners, const u32* __restrict__ counts,
                                       u32* __restrict__ urows, u8* __restrict__ umask, u32* __restrict__ ucount) {
    __shared__ u32 bits[UWORDS];
    __shared__ u32 masks[UKEYS / 4];  // one byte per middle row of the union
    __shared__ u32 trank[TK];
    __shared__ u32 warp_counts[TK / 32];
    __shared__ u32 sh_total;
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, h = a.h0 + blockIdx.y, tid = threadIdx.x;
    const u32 n = d.n0 + d.m;
    const u32 sink_end = min(a.sink, n);
    const u32 local_start = max(n > a.local ? n - a.local : 0u, sink_end);
    const u64 ub = ((u64)b * g.heads + h) * a.umax;
    const u8 all = (u8)((1u << GQ) - 1u);
    // Sink and local rows first, chosen by every head.
    const u32 fixed = sink_end + (n - local_start);
    for (u32 i = tid; i < fixed; i += TK) {
        const u32 t = i < sink_end ? i : local_start + (i - sink_end);
        urows[ub + i] = t;
        umask[ub + i] = all;
    }
    // This thread's winners as keys token*8 + g (~0: none); head q's list starts at off[q].
    u32 off[GQ + 1];
    off[0] = 0;
#pragma unroll
    for (u32 q = 0; q < GQ; ++q) off[q + 1] = off[q] + min(counts[(u64)b * g.heads * GQ + h * GQ + q], a.max_k);
    const u32 total = off[GQ];
    u32 key[UPT];
#pragma unroll
    for (u32 j = 0; j < UPT; ++j) {
        const u32 i = tid + j * TK;
        key[j] = 0xffffffffu;
        if (i < total) {
            u32 q = 0, base = 0;
#pragma unroll
            for (u32 jq = 1; jq < GQ; ++jq)
                if (i >= off[jq]) { q = jq; base = off[jq]; }
            const u64 r = (u64)b * g.heads * GQ + h * GQ + q;
            key[j] = winners[r * a.max_k + (i - base)] * 8u + q;
        }
    }
#pragma unroll
    for (u32 k = 0; k < UWPT; ++k) bits[tid * UWPT + k] = 0;
    for (u32 i = tid; i < UKEYS / 4; i += TK) masks[i] = 0;
    __syncthreads();
    u32 lo, hi;
    middle(n, a, &lo, &hi);
    u32 out = 0;  // middle rows written so far (uniform)
    for (u32 w0 = lo; w0 < hi; w0 += UBITS) {
        bool any = false;
#pragma unroll
        for (u32 j = 0; j < UPT; ++j) {
            const u32 t = key[j] >> 3;
            if (key[j] != 0xffffffffu && t >= w0 && t - w0 < UBITS) {
                atomicOr(&bits[(t - w0) >> 5], 1u << ((t - w0) & 31u));
                any = true;
            }
        }
        if (!__syncthreads_or(any)) continue;  // no winner here: the bitmap stays clear
        u32 c = 0;
#pragma unroll
        for (u32 k = 0; k < UWPT; ++k) c += (u32)__popc(bits[tid * UWPT + k]);
        const u32 r0 = block_excl_sum(c, warp_counts, &sh_total);
        trank[tid] = r0;
        const u32 wtotal = sh_total;
        __syncthreads();
        // The tokens of this thread's words, in order.
        u32 p = out + r0;
#pragma unroll
        for (u32 k = 0; k < UWPT; ++k) {
            u32 wd = bits[tid * UWPT + k];
            const u32 t0 = w0 + (tid * UWPT + k) * 32u;
            while (wd) {
                urows[ub + fixed + p++] = t0 + (u32)(__ffs(wd) - 1);
                wd &= wd - 1u;
            }
        }
        // Each winner's head bit into its token's rank.
#pragma unroll
        for (u32 j = 0; j < UPT; ++j) {
            const u32 t = key[j] >> 3;
            if (key[j] != 0xffffffffu && t >= w0 && t - w0 < UBITS) {
                const u32 x = t - w0, wi = x >> 5, owner = wi / UWPT;
                u32 rank = out + trank[owner];
                for (u32 k = owner * UWPT; k < wi; ++k) rank += (u32)__popc(bits[k]);
                rank += (u32)__popc(bits[wi] & ((1u << (x & 31u)) - 1u));
                atomicOr(&masks[rank >> 2], (1u << (key[j] & 7u)) << (8u * (rank & 3u)));
            }
        }
        __syncthreads();
#pragma unroll
        for (u32 k = 0; k < UWPT; ++k) bits[tid * UWPT + k] = 0;
        out += wtotal;
        __syncthreads();
    }
    for (u32 i = tid; i < out; i += TK) umask[ub + fixed + i] = (u8)(masks[i >> 2] >> (8u * (i & 3u)));
    if (tid == 0) ucount[(u64)b * g.heads + h] = fixed + out;
}


// The selection written out (the `select` entry, docs/SPEC.md §5): for each (session b, query
// head h), its sink tokens, its top-k winners in the order the top-k wrote them, then its local
// window, as logical token positions, -1 past the row's length up to `cap`; and the length.
// CPU twin: `fathom_cuda::cache::select_out_row`.
struct SelectOutParams { u32 sink; u32 local; u32 max_k; u32 cap; u32 hq; };
extern "C" __global__ void paged_select_out(const AppendDesc* __restrict__ descs, SelectOutParams p,
                                            const u32* __restrict__ winners, const u32* __restrict__ counts,
                                            int* __restrict__ indices, int* __restrict__ lengths) {
    const AppendDesc d = descs[blockIdx.y];
    const u64 row = (u64)blockIdx.y * p.hq + blockIdx.x;
    const u32 n = d.n0 + d.m;
    const u32 sink_end = min(p.sink, n);
    const u32 local_start = max(n > p.local ? n - p.local : 0u, sink_end);
    const u32 cnt = min(counts[row], p.max_k);
    const u32 len = sink_end + cnt + (n - local_start);
    for (u32 i = threadIdx.x; i < p.cap; i += blockDim.x) {
        int v = -1;
        if (i < sink_end) v = (int)i;
        else if (i < sink_end + cnt) v = (int)winners[row * p.max_k + (i - sink_end)];
        else if (i < len) v = (int)(local_start + (i - sink_end - cnt));
        indices[row * p.cap + i] = v;
    }
    if (threadIdx.x == 0) lengths[row] = (int)len;
}
