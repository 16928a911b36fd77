// Appends of the paged cache (docs/SPEC.md §2, §6.1): quantize and pack the new tokens'
// keys into the bit-plane pages, re-quantizing every 64-token block they touch (the partial
// last block included), and write each token's bf16 K|V record. Compiled by NVRTC with
// -DDIM=<D>; no fast-math, so every division and rounding is IEEE and the result equals
// fathom-store's CPU quantizer bit for bit. The parameter structs mirror `#[repr(C)]` ones in
// cuda_cache.rs.
#include "common.cuh"

// One session of an append batch.
struct AppendDesc {
    u32 slot;  // session slot (row of the page-table and tail arrays)
    u32 n0;    // tokens before the append
    u32 m;     // new tokens
    u32 row0;  // first row of its tokens in the layer's K/V arrays
};

// One layer's pool geometry (paged_layout.rs).
struct PoolGeom {
    u64 page_bytes;  // stride of pages in the pool
    u32 run_bytes;   // one channel run: S bytes of fp16 scales, then 4 planes of B words
    u32 scale_pad;   // S
    u64 recs;            // device address of page 0's K|V records (in the page, or the split
                         // residency's records pool)
    u64 rec_page_bytes;  // stride between pages' record sections
    u32 page_tokens; // P
    u32 max_pages;   // page-table row length
    u32 heads;       // Hkv
    u32 layers;      // L (the tail array holds every layer)
};

#define BLOCK 64

// Round-to-nearest-even f32 -> bf16 bits (NaN stays NaN), as half::bf16::from_f32.
__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// Round-to-nearest-even f32 -> f16 bits, as half::f16::from_f32.
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Element `i` of a K/V array of dtype 0 = f32, 1 = f16, 2 = bf16.
__device__ __forceinline__ float load_elem(const void* p, u64 i, u32 dtype) {
    if (dtype == 0) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return dtype == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

// The key as stored: bf16 of the model's key.
__device__ __forceinline__ float key_bf16(const void* k, u64 i, u32 dtype, u16* bits) {
    u16 b = f32_to_bf16_bits(load_elem(k, i, dtype));
    *bits = b;
    return bf16_to_f32(b);
}

// fp16 bits of x rounded toward -inf (fathom_baselines' round_down_f16: to nearest, then one
// step down where that went above x).
__device__ __forceinline__ u16 f16_down_bits(float x) {
    const u16 h = f32_to_f16_bits(x);
    if (f16_to_f32(h) > x) return x > 0.0f ? (u16)(h - 1) : (u16)(h + 1);
    return h;
}

// Block tables of the paged cache (docs/SPEC.md §6.1, "Block tables"): per page and KV head,
// landmark [P/8][DIM] and Quest [P/16][2][DIM] fp16; both pools have the same page stride.
struct TableGeom {
    u64 page_bytes;  // stride of pages in each table pool
    u64 landmark;    // device address of page 0's landmark table (0: none)
    u64 quest;       // device address of page 0's Quest table (0: none)
};

#define QS 4             // token quarters of a block: threads per channel
#define QT (BLOCK / QS)  // tokens per thread

// grid (blocks touched, Hkv, batch), DIM * QS threads: thread (c, qi) holds channel c's
// tokens [16 qi, 16 qi + 16) of the block. Re-quantizes block b = n0/64 + blockIdx.x of one
// session and head: its tokens before n0 come from the tail (the bf16 keys of the session's
// last partial block), the rest from the new rows. Writes all four plane words and the fp16
// scale of the block (bits past the session's length are zero). A non-finite key or a block
// maximum past fp16 skips the channel's write and counts a fault. With `fused` (every
// session's append lies in one block, as when decoding) it also writes the new tokens' K|V
// records and tail entries, so append_records is not launched: the tail positions written
// (>= n0 % 64) are not the ones read (< n0 % 64), and each is one thread's. Every load is
// issued before any store and unconditionally (clamped to a valid address).
//
// Writes that would not change a byte are skipped (the host pools' writes are small PCIe
// transactions, one per word): the pool already holds the quantization of the block's tokens
// before n0 (the previous append wrote it; a fork copies the partial page whole; a page's
// first block starts at n0 % 64 = 0 and is written whole), so where the block's fp16 maximum
// m16 equals that of its old tokens, their codes are unchanged, the scale is not written and a
// plane word is written only where a new token sets one of its bits (the old word is 0 at
// positions >= n0). The maximum of the old tokens is taken over their f16 roundings (rounding
// is monotone, so the largest rounding is the rounding of the largest value). A table row
// whose tokens all lie before n0 is unchanged too and not written.
//
// With `rot` (the PCA index of docs/SPEC.md §6.1: `[Hkv][D][D]` f32, row-major, column j the
// j-th basis vector) the block's bf16 keys are rotated before they are quantized: channel j
// of a token is the f32 rounding of sum_i u[i][j] x_i accumulated in f64 in order of i, as
// fathom_store::Basis::rotate (each product of two f32 is exact in f64, so a contraction to
// FMA changes no bit), and that f32 is quantized as it is (fathom_store::KeyStore of the bf16
// keys with the basis, bit for bit). The tail keeps the raw bf16 keys, so a later append
// re-rotates them; such a pass is launched with `fused` = 0 (the primary pass writes the
// records and the tail).
// DIM * QS threads (1024 at DIM = 256): the bound keeps the f64 rotation's registers within
// what a launch of that size may use.
extern "C" __global__ void __launch_bounds__(DIM * QS) append_quant(
    const AppendDesc* __restrict__ descs,
    const u32* __restrict__ tables,
    u8* pool,
    PoolGeom g,
    u16* tails,
    const void* __restrict__ k,
    const void* __restrict__ v,
    u32 dtype,
    u32 layer,
    u32 fused,
    u32* faults,
    const float* __restrict__ rot,
    TableGeom tg)
{
    __shared__ float smax[QS][DIM];
    __shared__ unsigned char sbad[QS][DIM];
    __shared__ u16 sold[QS][DIM];  // f16 bits of the largest |key| of the old tokens
    __shared__ u16 spart[QS][4][DIM];
    // The block's bf16 keys, [token][channel], for the rotation (DIM = 256: 32 KiB; with the
    // arrays above 46 KiB, under the 48 KiB of static shared memory).
    __shared__ u16 sx[BLOCK][DIM];
    const AppendDesc d = descs[blockIdx.z];
    const u32 h = blockIdx.y, c = threadIdx.x % DIM, qi = threadIdx.x / DIM;
    const u32 b = d.n0 / BLOCK + blockIdx.x;
    const u32 end = d.n0 + d.m;
    const u32 t0 = b * BLOCK;
    if (t0 >= end) return;  // uniform over the CTA
    // tails: [slot][layer][head][64][D] bf16
    u16* tail = tails + ((((u64)d.slot * g.layers + layer) * g.heads + h) * BLOCK) * DIM;
    const u16* __restrict__ tail_in = tail;
    const u32 j0 = qi * QT;
    float vals[QT];
#pragma unroll
    for (u32 jj = 0; jj < QT; ++jj) vals[jj] = bf16_to_f32(tail_in[(j0 + jj) * DIM + c]);
    if (d.m > 0) {
#pragma unroll
        for (u32 jj = 0; jj < QT; ++jj) {
            const u32 i = t0 + j0 + jj;
            const u32 ic = min(max(i, d.n0), end - 1);
            const float x = load_elem(k, ((u64)(d.row0 + ic - d.n0) * g.heads + h) * DIM + c, dtype);
            if (i >= d.n0) vals[jj] = i < end ? x : 0.0f;
        }
    } else {
#pragma unroll
        for (u32 jj = 0; jj < QT; ++jj)
            if (t0 + j0 + jj >= d.n0) vals[jj] = 0.0f;
    }
    const u32 bp = g.page_tokens / BLOCK;
    const u32 page = tables[(u64)d.slot * g.max_pages + t0 / g.page_tokens];
    u8* base = pool + (u64)page * g.page_bytes;
    u16* recs = (u16*)(g.recs + (u64)page * g.rec_page_bytes) + ((u64)h * g.page_tokens + t0 % g.page_tokens) * (2 * DIM);
    float mx = 0.0f;
    bool bad = false;
#pragma unroll
    for (u32 jj = 0; jj < QT; ++jj) {
        const u32 j = j0 + jj, i = t0 + j;
        if (i >= d.n0 && i < end) {
            // The key as stored: its bf16 rounding.
            const u16 bits = f32_to_bf16_bits(vals[jj]);
            vals[jj] = bf16_to_f32(bits);
            if (fused) {
                const u64 src = ((u64)(d.row0 + i - d.n0) * g.heads + h) * DIM + c;
                recs[(u64)j * 2 * DIM + c] = bits;
                recs[(u64)j * 2 * DIM + DIM + c] = f32_to_bf16_bits(load_elem(v, src, dtype));
                tail[j * DIM + c] = bits;
            }
        }
    }
    // The block tables from the raw bf16 keys (tg is empty in a PCA-index pass): this thread's
    // 16 tokens are one Quest page and two landmark groups (fathom_baselines::quest_bounds and
    // landmark_mean over the tokens < end, in token order; a group with none is not written).
    if (tg.landmark != 0 || tg.quest != 0) {
        const u32 s0 = t0 % g.page_tokens + j0;  // the thread's first token slot in the page
        const u32 i0 = t0 + j0;
        if (tg.quest != 0 && i0 < end && i0 + QT > d.n0) {
            float mn = INFINITY, mx = -INFINITY;
#pragma unroll
            for (u32 jj = 0; jj < QT; ++jj)
                if (i0 + jj < end) {
                    mn = fminf(mn, vals[jj]);
                    mx = fmaxf(mx, vals[jj]);
                }
            u16* row = (u16*)(tg.quest + (u64)page * tg.page_bytes) + ((u64)h * (g.page_tokens / 16) + s0 / 16) * 2 * DIM;
            row[c] = f16_down_bits(mn);
            row[DIM + c] = (u16)(f16_down_bits(-mx) ^ 0x8000u);
        }
        if (tg.landmark != 0) {
#pragma unroll
            for (u32 k2 = 0; k2 < 2; ++k2) {
                if (i0 + 8 * k2 >= end || i0 + 8 * k2 + 8 <= d.n0) continue;
                double sum = 0.0;
                u32 cnt = 0;
#pragma unroll
                for (u32 jj = 8 * k2; jj < 8 * k2 + 8; ++jj)
                    if (i0 + jj < end) {
                        sum += (double)vals[jj];
                        ++cnt;
                    }
                u16* row = (u16*)(tg.landmark + (u64)page * tg.page_bytes) + ((u64)h * (g.page_tokens / 8) + (s0 + 8 * k2) / 8) * DIM;
                row[c] = f32_to_f16_bits((float)(sum / (double)cnt));
            }
        }
    }
    if (rot != nullptr) {
        // vals are bf16 values here (tail entries, or new keys rounded above; 0 past the end).
#pragma unroll
        for (u32 jj = 0; jj < QT; ++jj) sx[j0 + jj][c] = f32_to_bf16_bits(vals[jj]);
        __syncthreads();
        const float* __restrict__ u = rot + (u64)h * DIM * DIM;
        double acc[QT];
#pragma unroll
        for (u32 jj = 0; jj < QT; ++jj) acc[jj] = 0.0;
        for (u32 i = 0; i < DIM; ++i) {
            const double ui = (double)u[(u64)i * DIM + c];
#pragma unroll
            for (u32 jj = 0; jj < QT; ++jj) acc[jj] += ui * (double)bf16_to_f32(sx[j0 + jj][i]);
        }
#pragma unroll
        for (u32 jj = 0; jj < QT; ++jj) vals[jj] = t0 + j0 + jj < end ? (float)acc[jj] : 0.0f;
    }
    float mx_old = 0.0f;
#pragma unroll
    for (u32 jj = 0; jj < QT; ++jj) {
        if (!isfinite(vals[jj])) bad = true;
        mx = fmaxf(mx, fabsf(vals[jj]));
        if (t0 + j0 + jj < d.n0) mx_old = fmaxf(mx_old, fabsf(vals[jj]));
    }
    smax[qi][c] = mx;
    sbad[qi][c] = bad ? 1 : 0;
    // Non-negative f16 bit patterns order as their values.
    u16 old16 = f32_to_f16_bits(mx_old);
    sold[qi][c] = old16;
    __syncthreads();
#pragma unroll
    for (u32 q = 0; q < QS; ++q) {
        mx = fmaxf(mx, smax[q][c]);
        bad = bad || sbad[q][c] != 0;
        old16 = max(old16, sold[q][c]);
    }
    const u16 m16 = f32_to_f16_bits(mx);
    const float m = f16_to_f32(m16);
    const bool skip = bad || !isfinite(m);
    u32 p0 = 0, p1 = 0, p2 = 0, p3 = 0;
    if (!skip) {
        const float delta = m / 8.0f;
#pragma unroll
        for (u32 jj = 0; jj < QT; ++jj) {
            if (t0 + j0 + jj < end) {
                u32 q = 8;
                if (m != 0.0f) {
                    float x = floorf(vals[jj] / delta) + 8.0f;
                    x = fminf(fmaxf(x, 0.0f), 15.0f);
                    q = (u32)x;
                }
                const u32 bit = 1u << jj;
                if (q & 8u) p0 |= bit;
                if (q & 4u) p1 |= bit;
                if (q & 2u) p2 |= bit;
                if (q & 1u) p3 |= bit;
            }
        }
    }
    spart[qi][0][c] = (u16)p0;
    spart[qi][1][c] = (u16)p1;
    spart[qi][2][c] = (u16)p2;
    spart[qi][3][c] = (u16)p3;
    __syncthreads();
    if (qi != 0) return;
    if (skip) {
        atomicAdd(faults + layer, 1u);
        return;
    }
    const u32 bb = (t0 % g.page_tokens) / BLOCK;
    u8* run = base + (u64)(h * DIM + c) * g.run_bytes;
    u64* words = (u64*)(run + g.scale_pad) + bb;
    // The pool holds the old tokens' codes where the scale is unchanged (see above).
    const bool same = t0 < d.n0 && old16 == m16;
    const u32 lo = d.n0 > t0 ? d.n0 - t0 : 0u;  // first new position in the block (< 64)
    const u64 fresh = ~0ull << lo;                 // positions of new tokens (and past the end: 0)
#pragma unroll
    for (u32 p = 0; p < 4; ++p) {
        u64 w = 0;
#pragma unroll
        for (u32 q = 0; q < QS; ++q) w |= (u64)spart[q][p][c] << (QT * q);
        if (!same || (w & fresh) != 0) words[p * (u64)bp] = w;
    }
    if (!same) ((u16*)run)[bb] = m16;
}

// grid (most new tokens of one session, Hkv, batch), DIM threads. Writes token n0 + x's bf16
// K|V record of one head, and, when the token is in the session's last block, its key into
// the tail (run after append_quant, which reads the old tail).
extern "C" __global__ void append_records(
    const AppendDesc* __restrict__ descs,
    const u32* __restrict__ tables,
    u8* pool,
    PoolGeom g,
    u16* tails,
    const void* __restrict__ k,
    const void* __restrict__ v,
    u32 dtype,
    u32 layer)
{
    const AppendDesc d = descs[blockIdx.z];
    const u32 h = blockIdx.y, c = threadIdx.x;
    const u32 j = blockIdx.x;
    if (j >= d.m || c >= DIM) return;
    const u32 tok = d.n0 + j;
    const u64 src = ((u64)(d.row0 + j) * g.heads + h) * DIM + c;
    u16 kb;
    key_bf16(k, src, dtype, &kb);
    const u16 vb = f32_to_bf16_bits(load_elem(v, src, dtype));
    const u32 page = tables[(u64)d.slot * g.max_pages + tok / g.page_tokens];
    const u32 s = tok % g.page_tokens;
    u16* rec = (u16*)(g.recs + (u64)page * g.rec_page_bytes) +
               ((u64)h * g.page_tokens + s) * (2 * DIM);
    rec[c] = kb;
    rec[DIM + c] = vb;
    const u32 end = d.n0 + d.m;
    if (tok >= ((end - 1) / BLOCK) * BLOCK) {
        u16* tail = tails + ((((u64)d.slot * g.layers + layer) * g.heads + h) * BLOCK) * DIM;
        tail[(tok % BLOCK) * DIM + c] = kb;
    }
}

#define READ_ROWS 8  // rows per CTA of read_rows

// grid (ceil(cap / READ_ROWS), Hkv, batch), DIM threads. Copies the last r = min(e, cap) tokens
// of each session of the batch (e = n0 + m, its length after this step's appends) as f32:
// token e - r + i of head h goes to k_out / v_out[((b * cap + i) * Hkv + h) * DIM + c]; rows
// i >= r are not written. Thread t reads word t of the record (K|V as 2 DIM bf16 = DIM u32),
// so a warp reads 128 contiguous bytes.
extern "C" __global__ void read_rows(
    const AppendDesc* __restrict__ descs,
    const u32* __restrict__ tables,
    const u8* __restrict__ pool,
    PoolGeom g,
    u32 cap,
    float* __restrict__ k_out,
    float* __restrict__ v_out)
{
    const AppendDesc d = descs[blockIdx.z];
    const u32 h = blockIdx.y, t = threadIdx.x;
    const u32 e = d.n0 + d.m;
    const u32 r = min(e, cap);
    const u32 first = e - r;
    for (u32 i = blockIdx.x * READ_ROWS; i < min(r, (blockIdx.x + 1) * READ_ROWS); ++i) {
        const u32 tok = first + i;
        const u32 page = tables[(u64)d.slot * g.max_pages + tok / g.page_tokens];
        const u32* rec = (const u32*)(g.recs + (u64)page * g.rec_page_bytes) +
                         ((u64)h * g.page_tokens + tok % g.page_tokens) * DIM;
        const u32 w = rec[t];
        const u32 e2 = 2 * t;  // element index in K|V of the word's low half
        float* out = e2 < DIM ? k_out : v_out;
        const u32 c = e2 < DIM ? e2 : e2 - DIM;
        const u64 o = (((u64)blockIdx.z * cap + i) * g.heads + h) * DIM + c;
        out[o] = __uint_as_float(w << 16);
        out[o + 1] = __uint_as_float(w & 0xffff0000u);
    }
}
