// Stage 4, the fetch (docs/SPEC.md §6.1): the union's K|V records into HBM through the row
// cache, and the host gather's list, publish and copy.
// NVRTC compiles it after shared.cuh and the stages before it (src/cuda/cache/params.rs,
// ATTEND_SRC), so it uses their types, helpers and #defines.
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

