// Stage 5, the attention (docs/SPEC.md §5): exact attention of each query head over its own
// set, split, then combined.
// NVRTC compiles it after shared.cuh and the stages before it (src/cuda/cache/params.rs,
// ATTEND_SRC), so it uses their types, helpers and #defines.
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
