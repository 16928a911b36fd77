// Attend of the paged cache (docs/SPEC.md §5, §6.1) for a ragged batch, one layer: each
// session's query (its last token) is scanned against the session's paged store read in
// place from mapped host memory (zero-copy: no staging), each query head takes its own top-k
// of the middle tokens, and attends exactly over its own sink + local + top-k set, reading
// the bf16 K|V records of the union once per KV head (from an HBM row cache when there).
// Compiled by NVRTC with -DGQ=<G> -DDIM=<D>. The parameter structs mirror `#[repr(C)]` ones
// in src/cuda/cache/params.rs (sizes asserted there). The stages follow in scan.cu,
// select.cu, fetch.cu and attention.cu, concatenated in that order (ATTEND_SRC).
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
#define FUSE_TARGET 6  // results/fidelity/filtered-select/README.md: 1.1 % of rows fall back at 6, 2.8 % at 4

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

