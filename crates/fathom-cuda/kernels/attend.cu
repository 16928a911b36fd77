// Attend of the paged cache (docs/SPEC.md §5, §6.1) for a ragged batch, one layer: each
// session's query (its last token) is scanned against the session's paged store read in
// place from mapped host memory, each query head takes its own top-k of the middle tokens,
// and attends exactly over its own sink + local + top-k set, reading the bf16 K|V records
// from the pages. Compiled by NVRTC with -DGQ=<G> -DDIM=<D>. The parameter structs mirror
// `#[repr(C)]` ones in cuda_cache.rs.
#include "common.cuh"

struct AppendDesc { u32 slot; u32 n0; u32 m; u32 row0; };

struct PoolGeom {
    u64 page_bytes; u64 scales_at; u64 records_at;
    u32 page_tokens; u32 max_pages; u32 heads; u32 layers;
};

// Selection and working-memory strides of one attend.
struct AttendGeom {
    u32 sink; u32 local; u32 k;   // docs/SPEC.md §5
    u32 max_k;                    // winners row stride
    u64 max_tokens;               // scores row stride
    u32 depth_stride;             // bytes between sessions' depth rows (0: one static plan)
    u32 dense;                    // 1: attend over every token (no scan, no top-k)
    float scale;                  // softmax scale
    u32 umax;                     // union row capacity per (session, KV head)
    u64 slot_bytes;               // staging bytes per (session, KV head, page)
};

__device__ __forceinline__ float load_elem(const void* p, u64 i, u32 dtype) {
    if (dtype == 0) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return dtype == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

// The query rows as f32: grid = batch * Hq, block = DIM.
extern "C" __global__ void attend_queries(const void* __restrict__ q, u32 dtype, float* __restrict__ qf) {
    const u64 i = (u64)blockIdx.x * DIM + threadIdx.x;
    qf[i] = load_elem(q, i, dtype);
}

// The gather: the planned runs of every page of one (session, KV head), host -> HBM staging.
// Staging slot (b, h, j) holds that head's part of page j in the page's own layout: planes
// [D][4][B] u64 (the first t planes of each channel filled), then scales [D][B] fp16. One warp
// per channel run (t*B words, >= 256 B at P = 2048: link rate, results/device/engine).
// grid = (batch, Hkv, most pages), block = 1024 (any multiple of 32).
extern "C" __global__ void paged_gather(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                        const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                        const u8* __restrict__ depths, u8* __restrict__ staging) {
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, h = blockIdx.y, j = blockIdx.z;
    const u32 n = d.n0 + d.m;
    if ((u64)j * g.page_tokens >= n) return;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 bp = g.page_tokens / 64;
    const u32 page = tables[(u64)d.slot * g.max_pages + j];
    const u8* src = pool + (u64)page * g.page_bytes;
    u8* dst = staging + (((u64)b * g.heads + h) * g.max_pages + j) * a.slot_bytes;
    const u8* dep = depths + (u64)b * a.depth_stride + (u64)h * DIM;
    const u64 plane_bytes = (u64)DIM * 4 * bp * 8;
    for (u32 c = warp; c < DIM; c += nw) {
        const u32 t = dep[c];
        if (t == 0) continue;
        // Planes: t*B words from ((h*D + c)*4)*B in the page, to (c*4)*B in the slot.
        const uint4* s4 = (const uint4*)(src + ((u64)(h * DIM + c) * 4) * bp * 8);
        uint4* d4 = (uint4*)(dst + ((u64)c * 4) * bp * 8);
        const u32 n16 = t * bp * 8 / 16;
        for (u32 i = lane; i < n16; i += 32) d4[i] = s4[i];
        // Scales: B halves from the page's scale section.
        const u16* ss = (const u16*)(src + g.scales_at) + (u64)(h * DIM + c) * bp;
        u16* ds = (u16*)(dst + plane_bytes) + (u64)c * bp;
        for (u32 i = lane; i < bp; i += 32) ds[i] = ss[i];
    }
}

// Scores of every token of one 64-token block of one (session, KV head) under its plan, read
// from the staging: s_g = sum_c q_gc * khat_t(c) (fathom_plan::scan). grid = (batch, Hkv, most
// blocks), block = 64.
extern "C" __global__ void paged_scan(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                      const float* __restrict__ qf, const u8* __restrict__ depths,
                                      const u8* __restrict__ staging, float* __restrict__ scores) {
    __shared__ float qs[GQ][DIM];
    __shared__ u64 ws[DIM][4];
    __shared__ float ms[DIM];
    __shared__ u8 ts[DIM];
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, h = blockIdx.y, z = blockIdx.z, tid = threadIdx.x;
    const u32 n = d.n0 + d.m;
    if ((u64)z * 64 >= n) return;
    const u32 hq0 = h * GQ;
    const u32 heads_q = g.heads * GQ;
    for (u32 i = tid; i < GQ * DIM; i += 64)
        qs[i / DIM][i % DIM] = qf[((u64)b * heads_q + hq0) * DIM + i];
    const u8* dep = depths + (u64)b * a.depth_stride + (u64)h * DIM;
    const u32 bp = g.page_tokens / 64;
    const u32 j = (z * 64) / g.page_tokens;
    const u32 bb = (z * 64 % g.page_tokens) / 64;
    const u8* base = staging + (((u64)b * g.heads + h) * g.max_pages + j) * a.slot_bytes;
    const u64* words = (const u64*)base;
    const u16* sc = (const u16*)(base + (u64)DIM * 4 * bp * 8);
    for (u32 c = tid; c < DIM; c += 64) {
        const u32 t = dep[c];
        ts[c] = (u8)t;
        const u64 w0 = ((u64)c * 4) * bp + bb;
        for (u32 p = 0; p < 4; ++p) ws[c][p] = p < t ? words[w0 + (u64)p * bp] : 0ull;
        ms[c] = t > 0 ? f16_to_f32(sc[(u64)c * bp + bb]) : 0.0f;
    }
    __syncthreads();
    const u32 tok = z * 64 + tid;
    if (tok >= n) return;
    float acc[GQ];
#pragma unroll
    for (int q = 0; q < GQ; ++q) acc[q] = 0.0f;
    for (u32 c = 0; c < DIM; ++c) {
        const u32 t = ts[c];
        if (t == 0) continue;
        u32 qt = 0;
        for (u32 p = 0; p < t; ++p) qt = (qt << 1) | (u32)((ws[c][p] >> tid) & 1ull);
        const float half_range = (float)(1u << (t - 1));
        const float step = ms[c] * exp2f(1.0f - (float)t);
        const float v = ((float)qt - half_range + 0.5f) * step;
#pragma unroll
        for (int q = 0; q < GQ; ++q) acc[q] += qs[q][c] * v;
    }
    for (int q = 0; q < GQ; ++q)
        scores[(((u64)b * g.heads + h) * GQ + q) * a.max_tokens + tok] = acc[q];
}

#define TK 1024

// Block-wide exclusive prefix sum of a 0/1 flag in index order; returns this thread's rank,
// writes the block total to *total.
__device__ __forceinline__ u32 block_rank(bool flag, u32* warp_counts, u32* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    const u32 before = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 s = 0;
        for (u32 w = 0; w < TK / 32; ++w) { u32 c = warp_counts[w]; warp_counts[w] = s; s += c; }
        *total = s;
    }
    __syncthreads();
    const u32 r = warp_counts[warp] + before;
    __syncthreads();
    return r;
}

// Top-k of the middle tokens of one query head row (docs/SPEC.md §5; ties to the lower
// index, as fathom_plan::select_per_head): a 4-pass radix select of the k-th largest score,
// then every larger one and the lowest-index ties. grid = (batch, Hq), block = TK.
extern "C" __global__ void paged_topk(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                      const float* __restrict__ scores, u32* __restrict__ winners,
                                      u32* __restrict__ counts) {
    __shared__ u32 hist[256];
    __shared__ u32 warp_counts[TK / 32];
    __shared__ u32 sh_prefix, sh_remaining, sh_total, sh_out;
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, hq = blockIdx.y, tid = threadIdx.x;
    const u32 n = d.n0 + d.m;
    const u32 sink_end = min(a.sink, n);
    const u32 local_start = max(n > a.local ? n - a.local : 0u, sink_end);
    const u32 mid = local_start - sink_end;
    const u32 kk = min(a.k, mid);
    const float* row = scores + ((u64)b * g.heads * GQ + hq) * a.max_tokens;
    u32* out = winners + ((u64)b * g.heads * GQ + hq) * a.max_k;
    if (kk == 0) { if (tid == 0) counts[b * g.heads * GQ + hq] = 0; return; }
    if (tid == 0) { sh_prefix = 0; sh_remaining = kk; sh_out = 0; }
    __syncthreads();
    u32 mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = tid; i < 256; i += TK) hist[i] = 0;
        __syncthreads();
        const u32 prefix = sh_prefix;
        for (u32 i = sink_end + tid; i < local_start; i += TK) {
            const u32 key = f32_key(row[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 rem = sh_remaining, bin = 255;
            for (;; --bin) {
                const u32 c = hist[bin];
                if (c >= rem || bin == 0) break;
                rem -= c;
            }
            sh_prefix = prefix | (bin << shift);
            sh_remaining = rem;
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    const u32 thr = sh_prefix, take_eq = sh_remaining;
    u32 eq_taken = 0;
    for (u32 base = sink_end; base < local_start; base += TK) {
        const u32 i = base + tid;
        const bool in = i < local_start;
        const u32 key = in ? f32_key(row[i]) : 0u;
        const bool gt = in && key > thr;
        const bool eq = in && key == thr;
        if (gt) out[atomicAdd(&sh_out, 1u)] = i;
        const u32 r = block_rank(eq, warp_counts, &sh_total);
        if (eq && eq_taken + r < take_eq) out[atomicAdd(&sh_out, 1u)] = i;
        eq_taken += sh_total;
        __syncthreads();
    }
    if (tid == 0) counts[b * g.heads * GQ + hq] = sh_out;
}

// The union of one (session, KV head)'s selections: sink and local (every query head), then
// the winners of all G query heads sorted and merged, each with the mask of the heads that
// chose it. grid = (batch, Hkv), block = TK; shared keys token*8 + g (G <= 8).
#define UKEYS 8192
extern "C" __global__ void paged_union(const AppendDesc* __restrict__ descs, PoolGeom g, AttendGeom a,
                                       const u32* __restrict__ winners, const u32* __restrict__ counts,
                                       u32* __restrict__ urows, u8* __restrict__ umask, u32* __restrict__ ucount) {
    __shared__ u32 keys[UKEYS];
    __shared__ u32 warp_counts[TK / 32];
    __shared__ u32 sh_total, sh_out;
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
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
    // Every head's winners as keys token*8 + g, padded to a power of two with ~0.
    u32 total = 0;
    for (u32 q = 0; q < GQ; ++q) total += counts[(u64)b * g.heads * GQ + h * GQ + q];
    u32 len = 1;
    while (len < total) len <<= 1;
    for (u32 i = tid; i < len; i += TK) keys[i] = 0xffffffffu;
    __syncthreads();
    if (tid < 32) {
        // One warp writes the lists (counts are small; G <= 8).
        u32 off = 0;
        for (u32 q = 0; q < GQ; ++q) {
            const u64 r = (u64)b * g.heads * GQ + h * GQ + q;
            const u32 c = counts[r];
            for (u32 i = tid; i < c; i += 32) keys[off + i] = winners[r * a.max_k + i] * 8u + q;
            off += c;
        }
    }
    __syncthreads();
    // Bitonic sort of keys[0..len).
    for (u32 k = 2; k <= len; k <<= 1) {
        for (u32 jj = k >> 1; jj > 0; jj >>= 1) {
            for (u32 i = tid; i < len; i += TK) {
                const u32 ixj = i ^ jj;
                if (ixj > i) {
                    const u32 x = keys[i], y = keys[ixj];
                    const bool up = (i & k) == 0;
                    if ((x > y) == up) { keys[i] = y; keys[ixj] = x; }
                }
            }
            __syncthreads();
        }
    }
    // Unique tokens in order; each one's mask is the OR over its run of equal tokens.
    if (tid == 0) sh_out = 0;
    __syncthreads();
    for (u32 base = 0; base < total; base += TK) {
        const u32 i = base + tid;
        const bool in = i < total;
        const u32 key = in ? keys[i] : 0u;
        const bool first = in && (i == 0 || (keys[i - 1] >> 3) != (key >> 3));
        const u32 r = block_rank(first, warp_counts, &sh_total);
        if (first) {
            u8 m = 0;
            for (u32 e = i; e < total && (keys[e] >> 3) == (key >> 3); ++e) m |= (u8)(1u << (keys[e] & 7u));
            urows[ub + fixed + sh_out + r] = key >> 3;
            umask[ub + fixed + sh_out + r] = m;
        }
        __syncthreads();
        if (tid == 0) sh_out += sh_total;
        __syncthreads();
    }
    if (tid == 0) ucount[(u64)b * g.heads + h] = fixed + sh_out;
}

// The fetch: every union row's bf16 K|V record, host pages -> HBM rows [b][h][umax][2D]. One
// warp per row (4D bytes: 16-byte lanes). grid = (batch, Hkv, row chunks of 8), block = 256.
extern "C" __global__ void paged_fetch(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                       const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                       const u32* __restrict__ urows, const u32* __restrict__ ucount,
                                       u16* __restrict__ rows) {
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ub = ((u64)b * g.heads + h) * a.umax;
    const u32 cnt = ucount[(u64)b * g.heads + h];
    for (u32 r = blockIdx.z * 8 + warp; r < cnt; r += gridDim.z * 8) {
        const u32 t = urows[ub + r];
        const u32 page = tables[(u64)d.slot * g.max_pages + t / g.page_tokens];
        const uint4* src = (const uint4*)((const u16*)(pool + (u64)page * g.page_bytes + g.records_at) +
                                          ((u64)h * g.page_tokens + t % g.page_tokens) * 2 * DIM);
        uint4* dst = (uint4*)(rows + (ub + r) * 2 * DIM);
        for (u32 i = lane; i < 2 * DIM * 2 / 16; i += 32) dst[i] = src[i];
    }
}

// Exact attention of one query head over its own set (the union rows whose mask has its bit),
// from the HBM rows, or over every token read from the pages when dense; an online softmax
// over chunks of 32 rows. grid = (batch, Hq), block = DIM.
extern "C" __global__ void paged_attend(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                        const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                        const float* __restrict__ qf, const u16* __restrict__ rows,
                                        const u8* __restrict__ umask, const u32* __restrict__ ucount,
                                        float* __restrict__ out) {
    __shared__ float qs[DIM];
    __shared__ float logits[32];
    __shared__ const u16* recs[32];
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, hq = blockIdx.y, c = threadIdx.x;
    const u32 lane = c & 31, warp = c >> 5, nwarps = DIM / 32;
    const u32 h = hq / GQ, gq = hq % GQ;
    const u32 n = d.n0 + d.m;
    const u64 qi = ((u64)b * g.heads * GQ + hq) * DIM;
    qs[c] = qf[qi + c];
    const u64 ub = ((u64)b * g.heads + h) * a.umax;
    const u32 total = a.dense ? n : ucount[(u64)b * g.heads + h];
    float M = -INFINITY, L = 0.0f, acc = 0.0f;
    __syncthreads();
    for (u32 j0 = 0; j0 < total; j0 += 32) {
        const u32 cnt = min(32u, total - j0);
        if (c < 32) {
            const u16* rp = 0;
            if (c < cnt) {
                const u32 j = j0 + c;
                if (a.dense) {
                    const u32 page = tables[(u64)d.slot * g.max_pages + j / g.page_tokens];
                    rp = (const u16*)(pool + (u64)page * g.page_bytes + g.records_at) +
                         ((u64)h * g.page_tokens + j % g.page_tokens) * 2 * DIM;
                } else if ((umask[ub + j] >> gq) & 1u) {
                    rp = rows + (ub + j) * 2 * DIM;
                }
            }
            recs[c] = rp;
        }
        __syncthreads();
        for (u32 r = warp; r < cnt; r += nwarps) {
            const u16* rec = recs[r];
            float s = -INFINITY;
            if (rec) {
                s = 0.0f;
                for (u32 ch = lane; ch < DIM; ch += 32) s += qs[ch] * bf16_to_f32(rec[ch]);
                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                s *= a.scale;
            }
            if (lane == 0) logits[r] = s;
        }
        __syncthreads();
        float cm = M;
        for (u32 r = 0; r < cnt; ++r) cm = fmaxf(cm, logits[r]);
        if (cm != -INFINITY) {
            const float corr = M == -INFINITY ? 0.0f : expf(M - cm);
            L *= corr;
            acc *= corr;
            for (u32 r = 0; r < cnt; ++r) {
                const u16* rec = recs[r];
                if (!rec) continue;
                const float p = expf(logits[r] - cm);
                L += p;
                acc += p * bf16_to_f32(rec[DIM + c]);
            }
            M = cm;
        }
        __syncthreads();
    }
    out[qi + c] = L > 0.0f ? acc / L : 0.0f;
}
