// Stage 2, the scan (docs/SPEC.md §2, §6.1): the plane scan of each page in place, with the
// top-k's level-1 histogram, and the block-table scan of landmark and Quest.
// NVRTC compiles it after shared.cuh and the stages before it (src/cuda/cache/params.rs,
// ATTEND_SRC), so it uses their types, helpers and #defines.
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

