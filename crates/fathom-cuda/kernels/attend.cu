// Attend of the paged cache (docs/SPEC.md §5, §6.1) for a ragged batch, one layer: each
// session's query (its last token) is scanned against the session's paged store read in
// place from mapped host memory (zero-copy: no staging), each query head takes its own top-k
// of the middle tokens, and attends exactly over its own sink + local + top-k set, reading
// the bf16 K|V records of the union once per KV head (from an HBM row cache when there).
// Compiled by NVRTC with -DGQ=<G> -DDIM=<D>. The parameter structs mirror `#[repr(C)]` ones
// in cuda_cache.rs.
#include "common.cuh"

struct AppendDesc { u32 slot; u32 n0; u32 m; u32 row0; };

// One layer's pool geometry (paged_layout.rs): channel runs [S scales][4][B] words.
struct PoolGeom {
    u64 page_bytes; u32 run_bytes; u32 scale_pad;
    u64 recs; u64 rec_page_bytes;  // page 0's K|V records (device address) and their page stride
    u32 page_tokens; u32 max_pages; u32 heads; u32 layers;
};

// Selection and working-memory strides of one attend.
struct AttendGeom {
    u32 sink; u32 local; u32 k;   // docs/SPEC.md §5
    u32 max_k;                    // winners row stride
    u64 max_tokens;               // scores and candidates row stride
    u32 depth_stride;             // bytes between sessions' depth rows (0: one static plan)
    u32 dense;                    // 1: attend over every token (no scan, no top-k)
    float scale;                  // softmax scale
    u32 umax;                     // union row capacity per (session, KV head)
    u32 cache_rows;               // HBM row-cache slots per (session, layer, KV head); 0: none
    u32 layer;                    // this attend's layer (row-cache index)
    u32 nsplit;                   // partial-attention CTAs per (session, KV head)
    u32 fuse_min;                 // middle tokens from which a row may take the filtered select (0: never)
    u32 fcap;                     // filtered candidates per row
    u32 keep_scores;              // 1: the filtered scan also writes scores and the histogram
    u32 h0;                       // first KV head of this launch's head group (grids cover its heads)
    u32 host_gather;              // percent of the fetch's misses the host gather brings (below); 0: off
};

__device__ __forceinline__ float load_elem(const void* p, u64 i, u32 dtype) {
    if (dtype == 0) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return dtype == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

// The middle tokens [lo, hi) of a session of n tokens: after the sink, before the local window.
__device__ __forceinline__ void middle(u32 n, const AttendGeom& a, u32* lo, u32* hi) {
    const u32 l = min(a.sink, n);
    const u32 h = n > a.local ? n - a.local : 0u;
    *lo = l;
    *hi = max(h, l);
}

// The order-preserving key's float (the inverse of f32_key).
__device__ __forceinline__ float key_f32(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The filtered select (docs/SPEC.md §5, "Selection without a score array"). A row that has
// an estimate e (the previous attend's filter score over the norm of its query's active
// channels; 0 bits: none) scans with the filter F = e * |q_active| and keeps only the
// (key, token) pairs of middle tokens with key >= key(F). When at least kk and at most fcap
// tokens pass, the row's top-kk lies among them (every token at or above the kk-th score
// passed), and an exact radix select over the pairs gives the same winners as the score
// path, ties included (every token tied with the kk-th score passed too). Otherwise the row
// falls back: it is scanned again with its scores written (or, with keep_scores, the first
// scan wrote them and the histogram too), and the score path selects.
// The estimate aims at FUSE_TARGET * kk passing tokens. CPU reference of the selection:
// fathom_plan::select::select_filtered.
#define FUSE_TARGET 6  // results/filtered-select/README.md: 1.1 % of rows fall back at 6, 2.8 % at 4

__device__ __forceinline__ bool fuse_row(const AttendGeom& a, u32 lo, u32 hi, float est) {
    const u32 mid = hi - lo, kk = min(a.k, mid);
    return a.fuse_min > 0 && mid >= a.fuse_min && mid >= 2u * FUSE_TARGET * kk && __float_as_uint(est) != 0u;
}

// The row's estimate slot: [max_sessions][L][Hq].
__device__ __forceinline__ u64 est_at(const AppendDesc& d, const PoolGeom& g, const AttendGeom& a, u32 hq) {
    return ((u64)d.slot * g.layers + a.layer) * (g.heads * GQ) + hq;
}

// |q| over the channels the row's KV head scans (depth > 0), summed by one warp in a fixed
// order (lane l takes channels l, l + 32, ...; then a butterfly): every kernel that calls it
// gets the same bits.
__device__ float active_norm(const float* qrow, const u8* dep) {
    const u32 lane = threadIdx.x & 31;
    float s = 0.0f;
    for (u32 c = lane; c < DIM; c += 32) if (dep[c] > 0) s = fmaf(qrow[c], qrow[c], s);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return sqrtf(s);
}

// The estimate the next attend of the row uses: the score of key fkey over |q_active|
// (0 bits, none, when that is not a finite number; +0 stored as -0).
__device__ __forceinline__ float next_estimate(u32 fkey, float norm) {
    const float e = key_f32(fkey) / norm;
    if (!(fabsf(e) <= 3.0e38f)) return 0.0f;
    return __float_as_uint(e) == 0u ? -0.0f : e;
}

// The query rows as f32: grid = batch * Hq, block = DIM.
extern "C" __global__ void attend_queries(const void* __restrict__ q, u32 dtype, float* __restrict__ qf) {
    const u64 i = (u64)blockIdx.x * DIM + threadIdx.x;
    qf[i] = load_elem(q, i, dtype);
}

// The query rows in the PCA index's basis (docs/SPEC.md §6.1), for a scan of that index:
// qr[row][j] = the f32 of sum_i u_h[i][j] qf[row][i] accumulated in f64 in order of i, h the
// row's KV head (fathom_store::StoreView::rotate_query, bit for bit: each product of two f32
// is exact in f64). rot: [Hkv][D][D] f32; hq: query heads per session.
// grid = batch * Hq, block = DIM.
extern "C" __global__ void attend_rotate_queries(const float* __restrict__ qf, const float* __restrict__ rot,
                                                 u32 hq, float* __restrict__ qr) {
    __shared__ float x[DIM];
    const u32 row = blockIdx.x, j = threadIdx.x;
    const u32 h = (row % hq) / GQ;
    x[j] = qf[(u64)row * DIM + j];
    __syncthreads();
    const float* __restrict__ u = rot + (u64)h * DIM * DIM;
    double acc = 0.0;
    for (u32 i = 0; i < DIM; ++i) acc += (double)u[(u64)i * DIM + j] * (double)x[i];
    qr[(u64)row * DIM + j] = (float)acc;
}

// Warp-aggregated append of the lanes with `flag` set to `list` (one atomic per warp; the
// count goes on past cap, so a caller sees an overflow). Every lane must call it.
template <class T>
__device__ __forceinline__ void warp_append(bool flag, T value, u32* count, T* list, u32 cap) {
    const unsigned m = __ballot_sync(0xffffffffu, flag);
    if (!m) return;
    const int lane = threadIdx.x & 31, leader = __ffs(m) - 1;
    u32 p0 = 0;
    if (lane == leader) p0 = atomicAdd(count, (u32)__popc(m));
    p0 = __shfl_sync(0xffffffffu, p0, leader);
    if (flag) {
        const u32 p = p0 + (u32)__popc(m & ((1u << lane) - 1u));
        if (p < cap) list[p] = value;
    }
}

#define BPC 32     // 64-token blocks per scan CTA (at most one page's): 8 threads per block
#define CHS 8      // active channels staged in shared memory per round
#define HBINS 1024 // level-1 top-k bins: the top 10 bits of the order-preserving key

// One active channel of depth T for one thread's 8 tokens (paged_scan_body): spreads the T plane
// bytes into 8 codes (bit i of a plane's byte is token i; one magic multiply per nibble puts
// bits 0..3 in the low bits of the bytes of c0 and bits 4..7 in the high nibbles of c1, its
// shifted copies never overlapping, and Horner's rule stacks the planes, plane 0 the most
// significant bit), then khat = (q_t - 2^(T-1) + 1/2) * step with
// step = m * 2^(1-T), and one FMA per query head and token. The code enters as the float
// 128 + q_t (one byte permute into the mantissa of 128.0 = 0x43000000, passed in `k128` so the
// selector stays an immediate), and khat = fma(128 + q_t, step, off - 128 step) with
// off = (1/2 - 2^(T-1)) step: the product is exact in the FMA, off - 128 step is exact (a
// multiplier of <= 9 significant bits times an fp16 value), and the exact sum khat has <= 16
// significant bits, so khat has the same bits as fma(q_t, step, off) (fathom_plan::scan's).
// One plane byte's 8 token bits (bit i: token i) spread one per byte: tokens 0..3 at bit 0 of
// the bytes of `lo`, tokens 4..7 at bit 4 of the bytes of `hi`. One magic multiply per nibble,
// whose four shifted copies never overlap (so no carry crosses a byte).
__device__ __forceinline__ void spread_plane_byte(u32 by, u32* lo, u32* hi) {
    *lo = ((by & 0x0Fu) * 0x00204081u) & 0x01010101u;
    *hi = ((by & 0xF0u) * 0x00204081u) & 0x10101010u;
}

template <int T>
__device__ __forceinline__ void scan_channel(const u8* __restrict__ pb, float m, const float* __restrict__ qv,
                                             u32 k128, float (&acc)[GQ][8]) {
    u32 c0 = 0, c1 = 0;
#pragma unroll
    for (int p = 0; p < T; p++) {
        u32 lo, hi;
        spread_plane_byte(pb[p * (BPC * 8)], &lo, &hi);
        c0 = (c0 << 1) | lo;
        c1 = (c1 << 1) | hi;
    }
    c1 >>= 4;
    // m * 2^(1-T) and (1/2 - 2^(T-1) - 128) * step: both exact.
    const float step = m * (T == 1 ? 1.0f : T == 2 ? 0.5f : T == 3 ? 0.25f : 0.125f);
    const float off = (0.5f - (float)(1 << (T - 1)) - 128.0f) * step;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 bits = __byte_perm(j < 4 ? c0 : c1, k128, 0x7044u | ((u32)(j & 3) << 8));
        const float kv = fmaf(__int_as_float(bits), step, off);
#pragma unroll
        for (int q = 0; q < GQ; q++) acc[q][j] = fmaf(qv[q], kv, acc[q][j]);
    }
}

// Scores of the tokens of BPC blocks of one (session, KV head) under its plan, read in place
// from the session's page (docs/SPEC.md §2, §3; fathom_plan::scan): s_g = sum over active
// channels c of q_gc * khat_t(c), khat_t = (q_t - 2^(t-1) + 1/2) * m * 2^(1-t), t the depth of
// c. Each round stages CHS active channels' scales and first t plane words of the CTA's
// blocks in shared memory (one coalesced load per word: the channel run is contiguous), then
// each thread (8 per block, 8 tokens each) runs scan_channel<t> on each: spreading its tokens'
// t plane bits into 8 codes, then one FMA per token and query head with the exact product
// khat. Also counts the top 10 key bits of every middle token per query head (the top-k's
// level-1 histogram; hist zeroed by the caller). grid = (CTAs, Hkv, batch), block = 8 * BPC.
// scores: [b][Hq][max_tokens].
template <int VEC>
__device__ __forceinline__ void paged_scan_body(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                      const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                      const float* __restrict__ qf, const u8* __restrict__ depths,
                                      float* __restrict__ scores, u32* __restrict__ hist, u32 pass,
                                      const float* __restrict__ est, const u32* __restrict__ mode,
                                      uint2* __restrict__ fcand, u32* __restrict__ fcount) {
    __shared__ int act_t[DIM];
    // Byte offset of each active channel's run from the head's first run (run0 below).
    __shared__ u32 act_off[DIM];
    // The query heads' values at each active channel, adjacent (one vector load per channel).
    __shared__ __align__(16) float qa[DIM][GQ];
    __shared__ int wcnt[8];
    __shared__ int nact;
    // Double-buffered: round r + 1's words are loaded (into registers) while round r computes.
    __shared__ u64 sw[2][CHS][4][BPC];
    __shared__ float sm[2][CHS][BPC];
    // Two 16-bit bin counts per word (a CTA counts at most 8 * BPC * 8 = 2048 tokens).
    __shared__ u32 sh[GQ][HBINS / 2];
    // Per query head: 0 scores + histogram, 1 filtered pairs (key >= rkey), 2 nothing.
    __shared__ int rmode[GQ];
    __shared__ u32 rkey[GQ];
    const u32 b = blockIdx.z, h = a.h0 + blockIdx.y, tid = threadIdx.x;
    const AppendDesc d = descs[b];
    const u32 n = d.n0 + d.m;
    const u32 bp = g.page_tokens / 64;
    const u32 cb = min((u32)BPC, bp);
    const u32 blk0 = blockIdx.x * cb;
    const u32 nblk = (n + 63) / 64;
    if (blk0 >= nblk) return;  // uniform over the CTA
    u32 lo, hi;
    middle(n, a, &lo, &hi);
    const u32 heads_q = g.heads * GQ;
    const u8* dep = depths + (u64)b * a.depth_stride + (u64)h * DIM;
    // Each row's mode: pass 0 filters the rows with an estimate; pass 1 (the fallback) scans
    // only the rows whose filter failed, with scores. One warp per query head (GQ <= 8 warps).
    if ((tid >> 5) < GQ) {
        const u32 q = tid >> 5, hq = h * GQ + q;
        const u64 r = (u64)b * heads_q + hq;
        int md = 0;
        u32 fk = 0;
        if (pass == 0) {
            const float e = est[est_at(d, g, a, hq)];
            if (fuse_row(a, lo, hi, e)) {
                const float norm = active_norm(qf + r * DIM, dep);
                md = 1;
                fk = f32_key(e * norm);
            }
        } else {
            md = mode[r] == 2 ? 0 : 2;
        }
        if ((tid & 31) == 0) { rmode[q] = md; rkey[q] = fk; }
    }
    for (u32 i = tid; i < GQ * HBINS / 2; i += blockDim.x) sh[i / (HBINS / 2)][i % (HBINS / 2)] = 0;
    __syncthreads();
    if (pass == 1) {
        bool any = false;
        for (int q = 0; q < GQ; q++) any |= rmode[q] == 0;
        if (!any) return;  // uniform over the CTA
    }
    // Order-preserving compaction of the active channels (DIM <= blockDim).
    int t0 = 0;
    bool on = false;
    if (tid < DIM) { t0 = dep[tid]; on = t0 > 0; }
    const unsigned bal = __ballot_sync(0xffffffffu, on);
    if ((tid & 31) == 0) wcnt[tid >> 5] = __popc(bal);
    __syncthreads();
    if (tid < DIM) {
        int off = 0;
        for (u32 w = 0; w < (tid >> 5); w++) off += wcnt[w];
        off += __popc(bal & ((1u << (tid & 31)) - 1u));
        if (on) {
            act_t[off] = t0;
            act_off[off] = tid * g.run_bytes;
            for (int q = 0; q < GQ; q++) qa[off][q] = qf[((u64)b * heads_q + h * GQ + q) * DIM + tid];
        }
        if (tid == DIM - 1) nact = off + (on ? 1 : 0);
    }
    __syncthreads();
    const u32 page = tables[(u64)d.slot * g.max_pages + blk0 / bp];
    const u32 bb0 = blk0 % bp;
    const u8* run0 = pool + (u64)page * g.page_bytes + (u64)h * DIM * g.run_bytes;
    // This CTA's first plane word of a run and its first scale, from the run's start.
    const u8* word0 = run0 + g.scale_pad + (u64)bb0 * 8;
    const u8* scale0 = run0 + (u64)bb0 * 2;
    const u32 plane_bytes = bp * 8;
    const u32 lb = tid >> 3, sub = tid & 7;
    const bool live = lb < cb && blk0 + lb < nblk;
    float acc[GQ][8];
#pragma unroll
    for (int q = 0; q < GQ; q++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[q][j] = 0.0f;
    const int na = nact;
    // 128.0f's bits in a register the compiler cannot fold (na < 2^30), so that
    // scan_channel's byte permutes take their selectors as immediates.
    const u32 k128 = 0x43000000u | ((u32)na >> 30);
    // Each thread stages SCAN_WORDS plane words and one scale of every round (blockDim = 8 * BPC).
    constexpr u32 NT_SCAN = 8 * BPC, SCAN_WORDS = CHS * 4 * BPC / NT_SCAN;
    u64 wreg[SCAN_WORDS];
    float sreg = 0.0f;
    // With VEC 2 and an even number of blocks per page, each thread loads two adjacent
    // words of a plane run at once (16-byte aligned: runs and pages are 16-byte multiples and
    // bb0 + j is even), half the load instructions for the same bytes.
    const bool pairs = VEC == 2 && (bp % 2 == 0);
    // Issues round a0's global loads into registers (zero-copy reads of the page).
    auto load = [&](int a0) {
        if (pairs) {
#pragma unroll
            for (u32 k = 0; k < SCAN_WORDS / 2; k++) {
                const u32 i = tid + k * NT_SCAN;  // a pair of words
                const u32 s = i / (2 * BPC), p = (i / (BPC / 2)) % 4, j = (i % (BPC / 2)) * 2;
                const int ac = a0 + (int)s;
                ulonglong2 v = make_ulonglong2(0ull, 0ull);
                if (ac < na && (int)p < act_t[ac] && j < cb && blk0 + j < nblk) {
                    const u64* w = (const u64*)(word0 + act_off[ac] + p * plane_bytes + j * 8);
                    if (blk0 + j + 1 < nblk) v = *(const ulonglong2*)w;
                    else v.x = w[0];
                }
                wreg[2 * k] = v.x;
                wreg[2 * k + 1] = v.y;
            }
        } else {
#pragma unroll
        for (u32 k = 0; k < SCAN_WORDS; k++) {
            const u32 i = tid + k * NT_SCAN;
            const u32 s = i / (4 * BPC), p = (i / BPC) % 4, j = i % BPC;
            const int ac = a0 + (int)s;
            wreg[k] = 0ull;
            if (ac < na && (int)p < act_t[ac] && j < cb && blk0 + j < nblk)
                wreg[k] = *(const u64*)(word0 + act_off[ac] + p * plane_bytes + j * 8);
        }
        }
        const u32 s = tid / BPC, j = tid % BPC;
        const int ac = a0 + (int)s;
        sreg = 0.0f;
        if (ac < na && j < cb && blk0 + j < nblk)
            sreg = f16_to_f32(*(const u16*)(scale0 + act_off[ac] + j * 2));
    };
    auto store = [&](int buf) {
        if (pairs) {
#pragma unroll
            for (u32 k = 0; k < SCAN_WORDS / 2; k++) {
                const u32 i = tid + k * NT_SCAN;
                const u32 s = i / (2 * BPC), p = (i / (BPC / 2)) % 4, j = (i % (BPC / 2)) * 2;
                sw[buf][s][p][j] = wreg[2 * k];
                sw[buf][s][p][j + 1] = wreg[2 * k + 1];
            }
        } else {
#pragma unroll
        for (u32 k = 0; k < SCAN_WORDS; k++) {
            const u32 i = tid + k * NT_SCAN;
            sw[buf][i / (4 * BPC)][(i / BPC) % 4][i % BPC] = wreg[k];
        }
        }
        sm[buf][tid / BPC][tid % BPC] = sreg;
    };
    if (na > 0) {
        load(0);
        store(0);
    }
    __syncthreads();
    for (int a0 = 0, buf = 0; a0 < na; a0 += CHS, buf ^= 1) {
        const bool next = a0 + CHS < na;
        if (next) load(a0 + CHS);
        const int ns = min(CHS, na - a0);
        if (live) {
            for (int s = 0; s < ns; s++) {
                const int ac = a0 + s;
                // This thread's byte of plane 0 (byte `sub` of the block's word: its 8 tokens).
                const u8* pb = (const u8*)&sw[buf][s][0][lb] + sub;
                const float m = sm[buf][s][lb];
                float qv[GQ];
#pragma unroll
                for (int q = 0; q < GQ; q++) qv[q] = qa[ac][q];
                switch (act_t[ac]) {  // uniform over the CTA
                case 1: scan_channel<1>(pb, m, qv, k128, acc); break;
                case 2: scan_channel<2>(pb, m, qv, k128, acc); break;
                case 3: scan_channel<3>(pb, m, qv, k128, acc); break;
                default: scan_channel<4>(pb, m, qv, k128, acc); break;
                }
            }
        }
        // The other buffer was last read before the previous round's barrier.
        if (next) store(buf ^ 1);
        __syncthreads();
    }
    const u32 tok0 = (blk0 + lb) * 64 + sub * 8;
    // Every one of this thread's 8 tokens is a scored token (stored with two 16-byte stores
    // where the row stride keeps them aligned), and every one is a middle token.
    const bool whole = live && tok0 + 8 <= n && (a.max_tokens & 3) == 0;
    const bool mid = live && tok0 >= lo && tok0 + 8 <= hi;
#pragma unroll
    for (int q = 0; q < GQ; q++) {
        const u64 r = (u64)b * heads_q + h * GQ + q;
        const int md = rmode[q];  // uniform over the CTA: every lane reaches the ballots
        if (md == 0 || (md == 1 && a.keep_scores)) {
            float* out = scores + r * a.max_tokens;
            if (whole) {
                *(float4*)(out + tok0) = make_float4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
                *(float4*)(out + tok0 + 4) = make_float4(acc[q][4], acc[q][5], acc[q][6], acc[q][7]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (live && tok0 + j < n) out[tok0 + j] = acc[q][j];
            }
            if (mid) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 bin = f32_key(acc[q][j]) >> 22;
                    atomicAdd(&sh[q][bin >> 1], 1u << ((bin & 1u) * 16));
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 tok = tok0 + j, bin = f32_key(acc[q][j]) >> 22;
                    if (live && tok >= lo && tok < hi) atomicAdd(&sh[q][bin >> 1], 1u << ((bin & 1u) * 16));
                }
            }
        }
        if (md == 1) {
            const u32 fk = rkey[q];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const u32 tok = tok0 + j;
                const u32 key = f32_key(acc[q][j]);
                const bool pass_f = live && tok >= lo && tok < hi && key >= fk;
                warp_append(pass_f, make_uint2(key, tok), &fcount[r], fcand + r * a.fcap, a.fcap);
            }
        }
    }
    __syncthreads();
    for (u32 i = tid; i < GQ * HBINS / 2; i += blockDim.x) {
        const u32 v = sh[i / (HBINS / 2)][i % (HBINS / 2)];
        u32* row = hist + ((u64)b * heads_q + h * GQ + i / (HBINS / 2)) * HBINS + 2 * (i % (HBINS / 2));
        if (v & 0xffffu) atomicAdd(row, v & 0xffffu);
        if (v >> 16) atomicAdd(row + 1, v >> 16);
    }
}

// The scan with 8-byte plane loads (paged_scan) and with 16-byte ones where the page allows
// (paged_scan_v2); PagedCache::set_scan_vector_words picks one by measurement.
extern "C" __global__ void __launch_bounds__(8 * BPC, GQ <= 4 ? 3 : 2) paged_scan(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                      const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                      const float* __restrict__ qf, const u8* __restrict__ depths,
                                      float* __restrict__ scores, u32* __restrict__ hist, u32 pass,
                                      const float* __restrict__ est, const u32* __restrict__ mode,
                                      uint2* __restrict__ fcand, u32* __restrict__ fcount) {
    paged_scan_body<1>(descs, tables, pool, g, a, qf, depths, scores, hist, pass, est, mode, fcand, fcount);
}
extern "C" __global__ void __launch_bounds__(8 * BPC, GQ <= 4 ? 3 : 2) paged_scan_v2(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                      const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                      const float* __restrict__ qf, const u8* __restrict__ depths,
                                      float* __restrict__ scores, u32* __restrict__ hist, u32 pass,
                                      const float* __restrict__ est, const u32* __restrict__ mode,
                                      uint2* __restrict__ fcand, u32* __restrict__ fcount) {
    paged_scan_body<2>(descs, tables, pool, g, a, qf, depths, scores, hist, pass, est, mode, fcand, fcount);
}

#define TK 1024

// Block tables (append.cu's TableGeom): page stride and page 0's landmark / Quest tables.
struct TableGeom {
    u64 page_bytes;
    u64 landmark;
    u64 quest;
};

#define TS_NT 128  // threads per CTA of paged_table_scan
#ifndef TS_G
#error "paged_table_scan needs -DTS_G (groups per CTA, chosen by the host: cache.rs table_scan_groups)"
#endif
#define TS_W4 (2 * DIM / 8)  // 16-byte words of a staged row (Quest's min | max; landmark: half)
#define TS_ROW4 (TS_W4 + 1)  // staged row stride: one word of pad, so rows at one offset spread over the banks

// Scores of landmark (quest = 0: a token's score is q . mean of its 8-token group) or Quest
// (quest = 1: q's upper bound over its 16-token page, sum_c max(q_c min_c, q_c max_c)) from the
// block tables read in place from the session's pages, per query head; each product of an f32
// and an fp16 is exact in f64 and the sum runs over c in order, so the score is
// fathom_baselines' PageHead score bit for bit. Writes every token's score and the level-1
// histogram of the middle tokens, as paged_scan does. grid = (ceil(groups / TS_G), Hkv,
// batch), block = TS_NT. The CTA's TS_G table rows are first staged in shared memory by
// coalesced 16-byte loads (consecutive threads, consecutive words of a row; a page's rows are
// contiguous), then thread p sums (group p / GQ, query head p % GQ) from there.
extern "C" __global__ void paged_table_scan(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                            PoolGeom g, AttendGeom a, TableGeom tg, u32 quest,
                                            const float* __restrict__ qf, float* __restrict__ scores,
                                            u32* __restrict__ hist) {
    __shared__ float qa[GQ][DIM + 1];  // + 1: the GQ heads' values at one channel in distinct banks
    __shared__ u32 sh[GQ][HBINS];
    __shared__ uint4 srow[TS_G * TS_ROW4];
    const u32 b = blockIdx.z, h = a.h0 + blockIdx.y, tid = threadIdx.x;
    const AppendDesc d = descs[b];
    const u32 n = d.n0 + d.m;
    const u32 gs = quest ? 16u : 8u;
    const u32 ngroups = (n + gs - 1) / gs;
    const u32 g0 = blockIdx.x * TS_G;
    if (g0 >= ngroups) return;  // uniform over the CTA
    const u32 heads_q = g.heads * GQ;
    for (u32 i = tid; i < GQ * DIM; i += TS_NT)
        qa[i / DIM][i % DIM] = qf[((u64)b * heads_q + h * GQ) * DIM + i];
    for (u32 i = tid; i < GQ * HBINS; i += TS_NT) sh[i / HBINS][i % HBINS] = 0;
    const u32 w4 = quest ? TS_W4 : TS_W4 / 2;  // words per row
    const u32 per_page = g.page_tokens / gs;
    for (u32 i = tid; i < TS_G * w4; i += TS_NT) {
        const u32 gl = i / w4, j = i % w4;
        const u32 grp = min(g0 + gl, ngroups - 1);  // clamped: an unconditional load
        const u32 tok0 = grp * gs;
        const u32 page = tables[(u64)d.slot * g.max_pages + tok0 / g.page_tokens];
        const u32 gi = (tok0 % g.page_tokens) / gs;
        const u64 base = (quest ? tg.quest : tg.landmark) + (u64)page * tg.page_bytes;
        // Rows are 16-byte aligned: D * 2 (or 4) bytes apart from a page start.
        const uint4* row = (const uint4*)((const u16*)base + ((u64)h * per_page + gi) * (quest ? 2 : 1) * DIM);
        srow[gl * TS_ROW4 + j] = row[j];
    }
    __syncthreads();
    u32 lo, hi;
    middle(n, a, &lo, &hi);
    for (u32 p = tid; p < TS_G * GQ; p += TS_NT) {
        const u32 gl = p / GQ, q = p % GQ;
        const u32 grp = g0 + gl;
        if (grp >= ngroups) continue;
        const uint4* r4 = srow + gl * TS_ROW4;
        double acc = 0.0;
        for (u32 c8 = 0; c8 < DIM / 8; ++c8) {
            const uint4 l4 = r4[c8];                         // landmark mean, or Quest's min
            const uint4 h4 = quest ? r4[DIM / 8 + c8] : l4;  // Quest's max
            const u32 lw[4] = {l4.x, l4.y, l4.z, l4.w};
            const u32 hw[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
            for (u32 j = 0; j < 8; ++j) {
                const double qc = (double)qa[q][c8 * 8 + j];
                const double lv = (double)f16_to_f32((u16)(lw[j / 2] >> ((j & 1u) * 16)));
                const double hv = (double)f16_to_f32((u16)(hw[j / 2] >> ((j & 1u) * 16)));
                acc += quest ? fmax(qc * lv, qc * hv) : qc * lv;
            }
        }
        const float sc = (float)acc;
        const u32 tok0 = grp * gs;
        float* out = scores + ((u64)b * heads_q + h * GQ + q) * a.max_tokens;
        const u32 bin = f32_key(sc) >> 22;
        u32 mid = 0;
        for (u32 t = tok0; t < min(tok0 + gs, n); ++t) {
            out[t] = sc;
            if (t >= lo && t < hi) ++mid;
        }
        if (mid) atomicAdd(&sh[q][bin], mid);
    }
    __syncthreads();
    for (u32 i = tid; i < GQ * HBINS; i += TS_NT) {
        const u32 v = sh[i / HBINS][i % HBINS];
        if (v) atomicAdd(hist + ((u64)b * heads_q + h * GQ + i / HBINS) * HBINS + i % HBINS, v);
    }
}

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

// The row cache of one (session, layer, KV head): C direct-mapped slots (slot = token mod
// C), tags[slot] = token + 1 when slot holds that token's record (0: empty), data [C][4D].
__device__ __forceinline__ u64 cache_base(const AppendDesc& d, const PoolGeom& g, const AttendGeom& a, u32 h) {
    return (((u64)d.slot * g.layers + a.layer) * g.heads + h) * a.cache_rows;
}

// The fetch: every union row's bf16 K|V record into HBM rows [b][h][umax][2D], from the row
// cache when it holds the token, else from the host page. A miss bids for its cache slot (the
// largest token of this attend wins it). Each CTA takes FR rows: FR threads resolve one row's
// source each (the dependent loads of all rows at once), then the CTA copies them in 16-byte
// pieces with every load of a thread in flight before its stores; a miss of the host
// gather's share (gather_on_host) is left to paged_gather_copy. Counts union rows and hits
// into counters[0], counters[1]. grid = (ceil(umax / FR), Hkv, batch), block = FETCH_NT.
// The host gather's state words and sizes (see paged_gather_publish).
#define GS_COUNT 0
#define GS_EPOCH 1
#define GS_FAULTS 2
#define GS_TIMEOUTS 3
#define GATHER_CHUNK 32
#define GATHER_NT 256
#define GATHER_TIMEOUT_NS 2000000000ull  // a host that does not answer in 2 s is a fault
#define FR 64
#define FETCH_NT 256

// Whether union row `row` (its index into rows), when it misses the row cache, is the host
// gather's (a.host_gather percent of rows by a multiplicative hash of the index) or the
// fetch's own read. paged_gather_list and paged_fetch both decide by this rule alone.
__device__ __forceinline__ bool gather_on_host(const AttendGeom& a, u64 row) {
    return a.host_gather && (((u32)row * 2654435761u) >> 16) % 100u < a.host_gather;
}

// The byte offset of token t's K|V record of KV head h from g.recs.
__device__ __forceinline__ u64 record_offset(const u32* tables, const PoolGeom& g, const AppendDesc& d,
                                             u32 h, u32 t) {
    const u32 page = tables[(u64)d.slot * g.max_pages + t / g.page_tokens];
    return (u64)page * g.rec_page_bytes + ((u64)h * g.page_tokens + t % g.page_tokens) * 4 * DIM;
}
#define PIECES (4 * DIM / 16)                   // 16-byte pieces of one record
#define FETCH_PER (FR * PIECES / FETCH_NT)      // pieces per thread
extern "C" __global__ void paged_fetch(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                       const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                       const u32* __restrict__ urows, const u32* __restrict__ ucount,
                                       const u32* __restrict__ tags, const u16* __restrict__ cdata,
                                       u32* __restrict__ claim, u16* __restrict__ rows,
                                       unsigned long long* __restrict__ counters) {
    __shared__ const uint4* src[FR];
    __shared__ u32 sh_hits;
    const u32 b = blockIdx.z, h = a.h0 + blockIdx.y, tid = threadIdx.x;
    const u64 ub = ((u64)b * g.heads + h) * a.umax;
    const u32 cnt = min(ucount[(u64)b * g.heads + h], a.umax);
    if (blockIdx.x == 0 && tid == 0) atomicAdd(&counters[0], (unsigned long long)cnt);
    const u32 r0 = blockIdx.x * FR;
    if (r0 >= cnt) return;  // uniform over the CTA
    const u32 nr = min((u32)FR, cnt - r0);
    if (tid == 0) sh_hits = 0;
    __syncthreads();
    if (tid < nr) {
        const AppendDesc d = descs[b];
        const u32 t = urows[ub + r0 + tid];
        bool hit = false;
        const uint4* p = nullptr;
        if (a.cache_rows) {
            const u64 slot = cache_base(d, g, a, h) + t % a.cache_rows;
            hit = tags[slot] == t + 1;
            if (hit) p = (const uint4*)(cdata + slot * 2 * DIM);
            else atomicMax(&claim[slot], t + 1);
        }
        // A miss of the host gather's share was listed by paged_gather_list: the host
        // brings it (paged_gather_copy), while this CTA reads the others itself.
        if (!hit && !gather_on_host(a, ub + r0 + tid))
            p = (const uint4*)(g.recs + record_offset(tables, g, d, h, t));
        src[tid] = p;
        const unsigned m = __ballot_sync(__activemask(), hit);
        if ((tid & 31) == 0 && m) atomicAdd(&sh_hits, (u32)__popc(m));
    }
    __syncthreads();
    uint4 v[FETCH_PER];
#pragma unroll
    for (u32 k = 0; k < FETCH_PER; k++) {
        const u32 i = tid + k * FETCH_NT;
        const u32 r = min(i / PIECES, nr - 1);  // clamped: an unconditional load
        const uint4* p = src[r];                 // null: the host gather brings the row
        if (p) v[k] = p[i % PIECES];
    }
    uint4* dst = (uint4*)(rows + (ub + r0) * 2 * DIM);
#pragma unroll
    for (u32 k = 0; k < FETCH_PER; k++) {
        const u32 i = tid + k * FETCH_NT;
        if (i / PIECES < nr && src[i / PIECES]) dst[i] = v[k];
    }
    if (tid == 0 && sh_hits) atomicAdd(&counters[1], (unsigned long long)sh_hits);
}

// The host gather (docs/SPEC.md §6.1, "Host gather"; host side: host_gather.rs). Random
// 512-byte reads of mapped host memory from the GPU run at a fraction of the link rate where
// the IOMMU translates (each record one translation), while CPU cores gather them at DRAM
// speed. With a.host_gather, before the fetch, paged_gather_list lists each miss of the
// host's share (gather_on_host: its record's byte offset from g.recs in glist[j], pinned;
// its row in gdst[j], HBM); paged_gather_publish hands the list to the host threads through
// the mailbox; they copy record j into staging slot j in chunks of GATHER_CHUNK and mark each
// chunk done with the attend's epoch while paged_fetch reads the other misses itself; and
// paged_gather_copy, on a second stream at once with the fetch (the two write disjoint rows),
// moves each chunk into its rows once its mark is there. The two reads are bound by different
// resources (IOMMU translations, host cores), so a split adds their rates, and the staging
// reads take the link bandwidth the fetch's translation-bound reads leave idle.
// gstate (HBM): [count, epoch, faults, timeouts]; count is zeroed before each list.
// The mailbox (pinned, mapped): [epoch, count, layer, pending epoch]; done [chunks] u32 (pinned).

// One thread per union row: a miss of the host's share (the row cache's tags as paged_fetch
// reads them: nothing changes them in between) gets the next list slot j. A list past its
// capacity is counted and left (a fault). grid = (ceil(umax / GATHER_NT), Hkv, batch).
extern "C" __global__ void paged_gather_list(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                             PoolGeom g, AttendGeom a, const u32* __restrict__ urows,
                                             const u32* __restrict__ ucount, const u32* __restrict__ tags,
                                             u32* __restrict__ gstate, u64* __restrict__ glist,
                                             u32* __restrict__ gdst, u32 gcap) {
    const u32 b = blockIdx.z, h = a.h0 + blockIdx.y;
    const u64 ub = ((u64)b * g.heads + h) * a.umax;
    const u32 cnt = min(ucount[(u64)b * g.heads + h], a.umax);
    const u32 r = blockIdx.x * GATHER_NT + threadIdx.x;
    if (r >= cnt || !gather_on_host(a, ub + r)) return;
    const AppendDesc d = descs[b];
    const u32 t = urows[ub + r];
    if (a.cache_rows && tags[cache_base(d, g, a, h) + t % a.cache_rows] == t + 1) return;  // a hit
    const u32 j = atomicAdd(&gstate[GS_COUNT], 1u);
    if (j < gcap) {
        glist[j] = record_offset(tables, g, d, h, t);
        gdst[j] = (u32)(ub + r);
    } else {
        atomicAdd(&gstate[GS_FAULTS], 1u);
    }
    __threadfence_system();
}

__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread: the next epoch, and the request the host threads wait for, at system scope in
// this order: the epoch to the pending word, count and layer, then the epoch (a seqlock: a
// host thread that read the epoch, the fields and then a pending word equal to the epoch read
// one request, never a newer count under an older epoch; host_gather.rs `Shared::request`).
extern "C" __global__ void paged_gather_publish(AttendGeom a, u32* __restrict__ gstate, u32 gcap,
                                                volatile u32* __restrict__ mailbox) {
    const u32 e = gstate[GS_EPOCH] + 1u;
    gstate[GS_EPOCH] = e;
    mailbox[3] = e;
    __threadfence_system();
    mailbox[1] = min(gstate[GS_COUNT], gcap);
    mailbox[2] = a.layer;
    __threadfence_system();
    mailbox[0] = e;
    __threadfence_system();
}

// Each of GATHER_COPY_CTAS CTAs moves staging chunks c = blockIdx.x, + gridDim.x, ... (of
// GATHER_CHUNK records) to their rows, each once the host has marked it with this attend's
// epoch (or past the timeout, counted in gstate[GS_TIMEOUTS]). One poller per CTA, backing
// off between polls, keeps the polls' reads off the link the data needs. Staging is read with
// ld.global.cv: the host rewrote it since any earlier read. grid = GATHER_COPY_CTAS.
#define GATHER_PER (GATHER_CHUNK * PIECES / GATHER_NT)
extern "C" __global__ void paged_gather_copy(u32* __restrict__ gstate, u32 gcap,
                                             const u32* __restrict__ done, const u16* __restrict__ staging,
                                             const u32* __restrict__ gdst, u16* __restrict__ rows) {
    const u32 cnt = min(gstate[GS_COUNT], gcap), e = gstate[GS_EPOCH];
    for (u32 c = blockIdx.x; c * GATHER_CHUNK < cnt; c += gridDim.x) {
        const u32 j0 = c * GATHER_CHUNK;
        const u32 nr = min((u32)GATHER_CHUNK, cnt - j0);
        if (threadIdx.x == 0) {
            const u64 t0 = global_ns();
            while (load_acquire_sys(&done[c]) != e) {
                if (global_ns() - t0 > GATHER_TIMEOUT_NS) {
                    atomicAdd(&gstate[GS_TIMEOUTS], 1u);
                    break;
                }
                __nanosleep(200);
            }
        }
        __syncthreads();
        const uint4* s = (const uint4*)(staging + (u64)j0 * 2 * DIM);
        uint4 v[GATHER_PER];
#pragma unroll
        for (u32 k = 0; k < GATHER_PER; k++) {
            const u32 i = threadIdx.x + k * GATHER_NT;
            if (i / PIECES < nr) v[k] = __ldcv(s + i);
        }
#pragma unroll
        for (u32 k = 0; k < GATHER_PER; k++) {
            const u32 i = threadIdx.x + k * GATHER_NT;
            if (i / PIECES < nr) ((uint4*)(rows + (u64)gdst[j0 + i / PIECES] * 2 * DIM))[i % PIECES] = v[k];
        }
        __syncthreads();  // thread 0 polls the next chunk only after every thread's loads
    }
}

// Block-wide exclusive rank of a 0/1 flag in thread order for blocks of NT threads; returns
// this thread's rank, writes the total to *total.
#define NT 128  // threads of the partial attention (4 warps)
__device__ __forceinline__ u32 block_rank_nt(bool flag, u32* warp_counts, u32* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    u32 before = 0, all = 0;
    for (u32 w = 0; w < NT / 32; ++w) {
        const u32 c = warp_counts[w];
        before += w < warp ? c : 0u;
        all += c;
    }
    if (threadIdx.x == 0) *total = all;
    return before + __popc(ballot & ((1u << lane) - 1u));
}

#define CH 64   // rows per tile of the partial attention
#define GRAN 16 // split spans are multiples of GRAN rows
#define KE (DIM / 32)  // key elements per lane in the logits (2, 4 or 8 bf16)
#if KE != 2 && KE != 4 && KE != 8
#error "paged attention needs DIM in {64, 128, 256}"
#endif

// KE bf16 of a key row at element e0 (a multiple of KE) as f32, in one vector load.
__device__ __forceinline__ void load_key(const u16* k, u32 e0, float* out) {
#if KE == 8
    const uint4 w = *(const uint4*)(k + e0);
    const u32 x[4] = {w.x, w.y, w.z, w.w};
#elif KE == 4
    const uint2 w = *(const uint2*)(k + e0);
    const u32 x[2] = {w.x, w.y};
#else
    const u32 x[1] = {*(const u32*)(k + e0)};
#endif
#pragma unroll
    for (int i = 0; i < KE / 2; i++) {
        out[2 * i] = __uint_as_float(x[i] << 16);
        out[2 * i + 1] = __uint_as_float(x[i] & 0xffff0000u);
    }
}

// Exact attention of the G query heads of one (session, KV head) over one split of its rows
// (docs/SPEC.md §5): the union rows from HBM, each head counting only the rows whose mask has
// its bit (its own set), or every token read from the pages when dense. Each K row is read
// once for all G heads (one warp per row, KE channels per lane in one vector load, the
// queries in registers); an online softmax over tiles of CH rows, each head's max and sum
// reduced by one warp; the split's partial max, sum and weighted V go to pm, pl
// [b][Hq][nsplit] and pacc [b][Hq][nsplit][D]. Splits span a multiple of GRAN rows. Each
// split also fills the row cache from its rows first: the winners of the fetch's bids copy
// their record into the slot, set its tag and clear the bid (so every bid is zero again after
// this launch; the fetch has finished, so every bid is in).
// grid = (nsplit, Hkv, batch), block = NT.
extern "C" __global__ void paged_attn_partial(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                              const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                              const float* __restrict__ qf, const u16* __restrict__ rows,
                                              const u32* __restrict__ urows, const u8* __restrict__ umask,
                                              const u32* __restrict__ ucount, u32* __restrict__ tags,
                                              u16* __restrict__ cdata, u32* __restrict__ claim,
                                              float* __restrict__ pm, float* __restrict__ pl,
                                              float* __restrict__ pacc) {
    __shared__ float p[GQ][CH];
    __shared__ const u16* recs[CH];
    __shared__ float corr[GQ], msum[GQ], lsum[GQ];
    __shared__ u64 wslot[NT];
    __shared__ u32 wrow[NT], wcnt[NT / 32], nwon;
    const u32 b = blockIdx.z, h = a.h0 + blockIdx.y, split = blockIdx.x;
    const AppendDesc d = descs[b];
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 n = d.n0 + d.m;
    const u64 ub = ((u64)b * g.heads + h) * a.umax;
    const u32 total = a.dense ? n : min(ucount[(u64)b * g.heads + h], a.umax);
    const u32 per = (total + a.nsplit - 1) / a.nsplit;
    const u32 span = (per + GRAN - 1) / GRAN * GRAN;
    const u32 r0 = min(split * span, total), r1 = min(r0 + span, total);
    const u32 heads_q = g.heads * GQ;
    if (!a.dense && a.cache_rows) {
        // The fill: each thread checks one row's bid (span <= NT rows per pass), then the
        // warps copy the won rows.
        const u64 cb = cache_base(d, g, a, h);
        for (u32 base = r0; base < r1; base += NT) {
            const u32 r = base + tid;
            bool won = false;
            u64 slot = 0;
            if (r < r1) {
                const u32 t = urows[ub + r];
                slot = cb + t % a.cache_rows;
                won = claim[slot] == t + 1;
            }
            const u32 rank = block_rank_nt(won, wcnt, &nwon);
            if (won) { wslot[rank] = slot; wrow[rank] = r; }
            __syncthreads();
            for (u32 w = warp; w < nwon; w += NT / 32) {
                const u64 sl = wslot[w];
                const uint4* src = (const uint4*)(rows + (ub + wrow[w]) * 2 * DIM);
                uint4* dst = (uint4*)(cdata + sl * 2 * DIM);
                for (u32 i = lane; i < 2 * DIM * 2 / 16; i += 32) dst[i] = src[i];
                __syncwarp();
                if (lane == 0) { tags[sl] = urows[ub + wrow[w]] + 1; claim[sl] = 0; }
            }
            __syncthreads();
        }
    }
    // This lane's KE channels of every head's query (pre-scaled by the softmax scale).
    float qr[GQ][KE];
#pragma unroll
    for (int q = 0; q < GQ; q++)
#pragma unroll
        for (int j = 0; j < KE; j++)
            qr[q][j] = qf[((u64)b * heads_q + h * GQ + q) * DIM + lane * KE + j] * a.scale;
    if (tid < GQ) { msum[tid] = -INFINITY; lsum[tid] = 0.0f; }
    constexpr int CPT = (DIM + NT - 1) / NT;  // channels per thread
    float acc[GQ][CPT];
#pragma unroll
    for (int q = 0; q < GQ; q++)
#pragma unroll
        for (int j = 0; j < CPT; j++) acc[q][j] = 0.0f;
    __syncthreads();
    for (u32 t0 = r0; t0 < r1; t0 += CH) {
        const u32 nr = min((u32)CH, r1 - t0);
        if (tid < nr) {
            const u32 j = t0 + tid;
            if (a.dense) {
                const u32 page = tables[(u64)d.slot * g.max_pages + j / g.page_tokens];
                recs[tid] = (const u16*)(g.recs + (u64)page * g.rec_page_bytes) +
                            ((u64)h * g.page_tokens + j % g.page_tokens) * 2 * DIM;
            } else {
                recs[tid] = rows + (ub + j) * 2 * DIM;
            }
        }
        __syncthreads();
        // Logits: one warp per row, all G heads at once.
        for (u32 r = warp; r < nr; r += NT / 32) {
            const u32 m = a.dense ? 0xffu : umask[ub + t0 + r];
            float kv[KE];
            load_key(recs[r], lane * KE, kv);
            float dt[GQ];
#pragma unroll
            for (int q = 0; q < GQ; q++) {
                float x = 0.0f;
#pragma unroll
                for (int j = 0; j < KE; j++) x = fmaf(qr[q][j], kv[j], x);
                dt[q] = x;
            }
#pragma unroll
            for (int q = 0; q < GQ; q++) {
                float x = dt[q];
                for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
                if (lane == 0) p[q][r] = ((m >> q) & 1u) ? x : -INFINITY;
            }
        }
        __syncthreads();
        // Per head (warp w takes heads w, w + 4): the tile's max, the weights, their sum and
        // the rescale of the running sums.
        for (u32 q = warp; q < GQ; q += NT / 32) {
            const float x0 = lane < nr ? p[q][lane] : -INFINITY;
            const float x1 = lane + 32 < nr ? p[q][lane + 32] : -INFINITY;
            float tm = fmaxf(x0, x1);
            for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
            const float old = msum[q];
            tm = fmaxf(tm, old);
            const float e0 = x0 == -INFINITY ? 0.0f : expf(x0 - tm);
            const float e1 = x1 == -INFINITY ? 0.0f : expf(x1 - tm);
            if (lane < nr) p[q][lane] = e0;
            if (lane + 32 < nr) p[q][lane + 32] = e1;
            float sum = e0 + e1;
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            __syncwarp();  // every lane has read msum[q] before lane 0 rewrites it
            if (lane == 0) {
                const float c = (old == -INFINITY || tm == -INFINITY) ? (tm == -INFINITY ? 1.0f : 0.0f) : expf(old - tm);
                corr[q] = c;
                lsum[q] = lsum[q] * c + sum;
                msum[q] = tm;
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < CPT; j++) {
            const u32 c = tid + j * NT;
            if (c < DIM) {
#pragma unroll
                for (int q = 0; q < GQ; q++) acc[q][j] *= corr[q];
#pragma unroll 4
                for (u32 r = 0; r < nr; r++) {
                    const float v = bf16_to_f32(recs[r][DIM + c]);
#pragma unroll
                    for (int q = 0; q < GQ; q++) acc[q][j] = fmaf(p[q][r], v, acc[q][j]);
                }
            }
        }
        __syncthreads();
    }
    const u64 pb = ((u64)b * heads_q + h * GQ) * a.nsplit;  // + q * nsplit + split
#pragma unroll
    for (int q = 0; q < GQ; q++) {
        const u64 i = pb + (u64)q * a.nsplit + split;
        if (tid == 0) { pm[i] = msum[q]; pl[i] = lsum[q]; }
#pragma unroll
        for (int j = 0; j < CPT; j++) {
            const u32 c = tid + j * NT;
            if (c < DIM) pacc[i * DIM + c] = acc[q][j];
        }
    }
}

// The splits of one query head combined: o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// Every split's m_s and l_s are first staged in shared memory by all threads at once (the
// sums then read them from there, in split order as before, so the bits are unchanged).
// grid = (Hq, batch), block = DIM. out: [b][Hq][D] f32.
#define COMBINE_MAX 256  // DENSE_SPLITS in cuda_cache.rs: the most splits of an attend
extern "C" __global__ void paged_attn_combine(PoolGeom g, AttendGeom a, const float* __restrict__ pm,
                                              const float* __restrict__ pl, const float* __restrict__ pacc,
                                              float* __restrict__ out) {
    __shared__ float sm[COMBINE_MAX], sl[COMBINE_MAX];
    __shared__ float sh_max;
    const u32 b = blockIdx.y, hq = a.h0 * GQ + blockIdx.x, c = threadIdx.x;
    const u64 row = (u64)b * g.heads * GQ + hq;
    const u64 base = row * a.nsplit;
    const u32 ns = min(a.nsplit, (u32)COMBINE_MAX);
    for (u32 s = c; s < ns; s += DIM) {
        sm[s] = pm[base + s];
        sl[s] = pl[base + s];
    }
    __syncthreads();
    if (c < 32) {
        float m = -INFINITY;
        for (u32 s = c; s < ns; s += 32) m = fmaxf(m, sm[s]);
#pragma unroll
        for (u32 o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (c == 0) sh_max = m;
    }
    __syncthreads();
    const float M = sh_max;
    float L = 0.0f, o = 0.0f;
    if (M != -INFINITY) {
#pragma unroll 8
        for (u32 s = 0; s < ns; s++) {
            const float m = sm[s];
            const float w = m == -INFINITY ? 0.0f : expf(m - M);
            L += sl[s] * w;
            o += pacc[(base + s) * DIM + c] * w;
        }
    }
    out[row * DIM + c] = L > 0.0f ? o / L : 0.0f;
}
