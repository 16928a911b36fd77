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
    u32 pad;
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

// Scores of every token of one 64-token block of one (session, KV head) under its plan:
// s_g = sum_c q_gc * khat_t(c) (fathom_plan::scan). grid = (batch, Hkv, most blocks), block = 64.
extern "C" __global__ void paged_scan(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                      const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                      const float* __restrict__ qf, const u8* __restrict__ depths,
                                      float* __restrict__ scores) {
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
    const u32 page = tables[(u64)d.slot * g.max_pages + (z * 64) / g.page_tokens];
    const u32 bb = (z * 64 % g.page_tokens) / 64;
    const u8* base = pool + (u64)page * g.page_bytes;
    const u64* words = (const u64*)base;
    const u16* sc = (const u16*)(base + g.scales_at);
    for (u32 c = tid; c < DIM; c += 64) {
        const u32 t = dep[c];
        ts[c] = (u8)t;
        const u64 w0 = ((u64)(h * DIM + c) * 4) * bp + bb;
        for (u32 p = 0; p < 4; ++p) ws[c][p] = p < t ? words[w0 + (u64)p * bp] : 0ull;
        ms[c] = t > 0 ? f16_to_f32(sc[(u64)(h * DIM + c) * bp + bb]) : 0.0f;
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

// Exact attention of one query head over its own set (or every token when dense), with an
// online softmax over chunks of 32 rows read from the pages. grid = (batch, Hq), block = DIM.
extern "C" __global__ void paged_attend(const AppendDesc* __restrict__ descs, const u32* __restrict__ tables,
                                        const u8* __restrict__ pool, PoolGeom g, AttendGeom a,
                                        const float* __restrict__ qf, const u32* __restrict__ winners,
                                        const u32* __restrict__ counts, float* __restrict__ out) {
    __shared__ float qs[DIM];
    __shared__ float logits[32];
    __shared__ u32 toks[32];
    const AppendDesc d = descs[blockIdx.x];
    const u32 b = blockIdx.x, hq = blockIdx.y, c = threadIdx.x;
    const u32 lane = c & 31, warp = c >> 5, nwarps = DIM / 32;
    const u32 h = hq / GQ;
    const u32 n = d.n0 + d.m;
    const u64 qi = ((u64)b * g.heads * GQ + hq) * DIM;
    qs[c] = qf[qi + c];
    const u32 sink_end = min(a.sink, n);
    const u32 local_start = max(n > a.local ? n - a.local : 0u, sink_end);
    const u32 nwin = a.dense ? 0 : counts[b * g.heads * GQ + hq];
    const u32* win = winners + ((u64)b * g.heads * GQ + hq) * a.max_k;
    const u32 rows = a.dense ? n : sink_end + (n - local_start) + nwin;
    const u64 rec_stride = 2 * DIM;
    float M = -INFINITY, L = 0.0f, acc = 0.0f;
    __syncthreads();
    for (u32 j0 = 0; j0 < rows; j0 += 32) {
        const u32 cnt = min(32u, rows - j0);
        if (c < cnt) {
            const u32 j = j0 + c;
            u32 t;
            if (a.dense || j < sink_end) t = j;
            else if (j < sink_end + (n - local_start)) t = local_start + (j - sink_end);
            else t = win[j - sink_end - (n - local_start)];
            toks[c] = t;
        }
        __syncthreads();
        for (u32 r = warp; r < cnt; r += nwarps) {
            const u32 t = toks[r];
            const u32 page = tables[(u64)d.slot * g.max_pages + t / g.page_tokens];
            const u16* rec = (const u16*)(pool + (u64)page * g.page_bytes + g.records_at) +
                             ((u64)h * g.page_tokens + t % g.page_tokens) * rec_stride;
            float s = 0.0f;
            for (u32 ch = lane; ch < DIM; ch += 32) s += qs[ch] * bf16_to_f32(rec[ch]);
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) logits[r] = s * a.scale;
        }
        __syncthreads();
        float cm = M;
        for (u32 r = 0; r < cnt; ++r) cm = fmaxf(cm, logits[r]);
        const float corr = M == -INFINITY ? 0.0f : expf(M - cm);
        L *= corr;
        acc *= corr;
        for (u32 r = 0; r < cnt; ++r) {
            const u32 t = toks[r];
            const u32 page = tables[(u64)d.slot * g.max_pages + t / g.page_tokens];
            const u16* rec = (const u16*)(pool + (u64)page * g.page_bytes + g.records_at) +
                             ((u64)h * g.page_tokens + t % g.page_tokens) * rec_stride;
            const float p = expf(logits[r] - cm);
            L += p;
            acc += p * bf16_to_f32(rec[DIM + c]);
        }
        M = cm;
        __syncthreads();
    }
    out[qi + c] = L > 0.0f ? acc / L : 0.0f;
}
