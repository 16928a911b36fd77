// The non-matmul operations of the GPU forward (fathom-gpu, docs/SPEC.md §7): embedding,
// RMSNorm, QK-norm + RoPE, the gated activations, the masked softmax of the dense prefill
// attention and the sliding-window decode attention. Compiled by NVRTC with -DDIM=<head dim>
// and --fmad=false, so each operation rounds as its CPU reference (fathom-model's layer loop in
// WeightMode::Bf16) does, up to the order of sums.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Round-to-nearest-even f32 -> bf16 bits (NaN stays NaN), as half::bf16::from_f32.
__device__ __forceinline__ u16 f2bf(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ float bf_round(float f) { return bf2f(f2bf(f)); }

// Sum over the CTA (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ float block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? sh[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(FULL, t, o);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

__device__ float block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? sh[lane] : NEG_INF;
        for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(FULL, t, o));
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

// grid rows, 256 threads: x[r] = scale · bf16 table[tokens[r]].
extern "C" __global__ void embed(const u32* __restrict__ tokens, const u16* __restrict__ table,
                                 u32 e, float scale, float* __restrict__ x) {
    const u64 tok = tokens[blockIdx.x];
    for (u32 i = threadIdx.x; i < e; i += blockDim.x) {
        float v = bf2f(table[tok * e + i]);
        if (scale != 1.0f) v *= scale;
        x[(u64)blockIdx.x * e + i] = v;
    }
}

// grid rows, 256 threads: out[r] = bf16(x[r] / sqrt(mean x[r]^2 + eps) * w).
extern "C" __global__ void rmsnorm_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                        u32 e, float eps, u16* __restrict__ out) {
    __shared__ float sh[33];
    const float* row = x + (u64)blockIdx.x * e;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < e; i += blockDim.x) ss += row[i] * row[i];
    ss = block_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)e + eps);
    for (u32 i = threadIdx.x; i < e; i += blockDim.x)
        out[(u64)blockIdx.x * e + i] = f2bf(row[i] * r * w[i]);
}

// grid rows, 256 threads: x[r] += a[r], through an RMSNorm of a[r] with weight w when w is not
// null (Gemma 3's post-attention and post-MLP norms).
extern "C" __global__ void norm_add(float* __restrict__ x, const float* __restrict__ a,
                                    const float* __restrict__ w, u32 e, float eps) {
    __shared__ float sh[33];
    const float* ar = a + (u64)blockIdx.x * e;
    float* xr = x + (u64)blockIdx.x * e;
    float r = 1.0f;
    if (w) {
        float ss = 0.0f;
        for (u32 i = threadIdx.x; i < e; i += blockDim.x) ss += ar[i] * ar[i];
        ss = block_sum(ss, sh);
        r = 1.0f / sqrtf(ss / (float)e + eps);
    }
    for (u32 i = threadIdx.x; i < e; i += blockDim.x) xr[i] += w ? ar[i] * r * w[i] : ar[i];
}

// grid (rows, Hq + 2 Hkv), DIM threads. One head of the fused q|k|v projection row
// qkv[r] = [Hq + 2 Hkv][DIM]: q and k heads get the per-head RMSNorm (when the weights are not
// null) and RoPE at position pos[r] (angle pos · base^(-2i/DIM) in double, pairs (2i, 2i+1)
// or, with neox, (i, i + DIM/2)); k and v are rounded to bf16 (what the cache stores).
extern "C" __global__ void qkv_post(const float* __restrict__ qkv, const u32* __restrict__ pos,
                                    const float* __restrict__ qn, const float* __restrict__ kn,
                                    u32 hq, u32 hkv, float eps, float base, u32 neox,
                                    float* __restrict__ q, float* __restrict__ k,
                                    float* __restrict__ v) {
    __shared__ float sh[DIM];
    __shared__ float red[33];
    const u32 r = blockIdx.x, j = blockIdx.y, t = threadIdx.x;
    const u32 nh = hq + 2 * hkv;
    float x = qkv[((u64)r * nh + j) * DIM + t];
    if (j >= hq + hkv) {
        v[((u64)r * hkv + (j - hq - hkv)) * DIM + t] = bf_round(x);
        return;
    }
    const bool is_q = j < hq;
    const float* nw = is_q ? qn : kn;
    if (nw) {
        const float ss = block_sum(x * x, red);
        const float rr = 1.0f / sqrtf(ss / (float)DIM + eps);
        x = x * rr * nw[t];
    }
    sh[t] = x;
    __syncthreads();
    const u32 half = DIM / 2;
    u32 i;
    float a, b;
    bool first;
    if (neox) {
        first = t < half;
        i = first ? t : t - half;
        a = sh[i];
        b = sh[i + half];
    } else {
        first = (t & 1) == 0;
        i = t / 2;
        a = sh[2 * i];
        b = sh[2 * i + 1];
    }
    const double inv = pow((double)base, -2.0 * (double)i / (double)DIM);
    const double ang = (double)pos[r] * inv;
    const float c = (float)cos(ang), s = (float)sin(ang);
    const float y = first ? a * c - b * s : a * s + b * c;
    if (is_q) q[((u64)r * hq + j) * DIM + t] = y;
    else k[((u64)r * hkv + (j - hq)) * DIM + t] = bf_round(y);
}

// grid (rows, ceil(F / 256)), 256 threads: out[r][i] = bf16(act(g) · u) with g = gu[r][i],
// u = gu[r][F + i]; act is silu, or with gelu the tanh approximation of GELU.
extern "C" __global__ void act_mul(const float* __restrict__ gu, u32 f, u32 gelu,
                                   u16* __restrict__ out) {
    const u32 i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= f) return;
    const float g = gu[(u64)blockIdx.x * 2 * f + i];
    const float u = gu[(u64)blockIdx.x * 2 * f + f + i];
    float a;
    if (gelu) {
        const float c = 0.7978846f;
        a = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
    } else {
        a = g / (1.0f + expf(-g));
    }
    out[(u64)blockIdx.x * f + i] = f2bf(a * u);
}

// grid ceil(n / 256), 256 threads.
extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(x[i]);
}

// grid rows, 256 threads. Row r of s = [rows][cap] holds the scaled scores of the query at
// position pos0 + r against keys key0 .. key0 + cap; replaces it with the causal (and, with
// window > 0, sliding-window) softmax: key j is visible iff j <= p and j + window > p.
extern "C" __global__ void causal_softmax(float* __restrict__ s, u32 cap, u32 key0, u32 pos0,
                                          u32 window) {
    __shared__ float sh[33];
    float* row = s + (u64)blockIdx.x * cap;
    const u32 p = pos0 + blockIdx.x;
    const u32 lo = window && p + 1 > window ? p + 1 - window : 0;
    float m = NEG_INF;
    for (u32 i = threadIdx.x; i < cap; i += blockDim.x) {
        const u32 j = key0 + i;
        if (j <= p && j >= lo) m = fmaxf(m, row[i]);
    }
    m = block_max(m, sh);
    float z = 0.0f;
    for (u32 i = threadIdx.x; i < cap; i += blockDim.x) {
        const u32 j = key0 + i;
        const float e = (j <= p && j >= lo) ? expf(row[i] - m) : 0.0f;
        row[i] = e;
        z += e;
    }
    z = block_sum(z, sh);
    const float inv = 1.0f / z;
    for (u32 i = threadIdx.x; i < cap; i += blockDim.x) row[i] *= inv;
}

// grid (batch, Hq), 256 threads, dynamic shared memory cap floats. Decode attention of one
// query head over the counts[b] rows of its session's window (rows [b][0..counts[b]) of
// kw / vw = [batch][cap][Hkv][DIM], the newest last): out = softmax(scale q·k) · v.
extern "C" __global__ void window_decode(const float* __restrict__ q,
                                         const float* __restrict__ kw,
                                         const float* __restrict__ vw,
                                         const u32* __restrict__ counts, u32 cap, u32 hq,
                                         u32 hkv, float scale, float* __restrict__ out) {
    extern __shared__ float p[];
    __shared__ float qs[DIM];
    __shared__ float sh[33];
    const u32 b = blockIdx.x, hd = blockIdx.y, h = hd / (hq / hkv);
    const u32 n = counts[b];
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (u32 c = threadIdx.x; c < DIM; c += blockDim.x) qs[c] = q[((u64)b * hq + hd) * DIM + c];
    __syncthreads();
    for (u32 j = warp; j < n; j += nw) {
        const float* kr = kw + (((u64)b * cap + j) * hkv + h) * DIM;
        float acc = 0.0f;
        for (u32 c = lane; c < DIM; c += 32) acc += qs[c] * kr[c];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL, acc, o);
        if (lane == 0) p[j] = acc * scale;
    }
    __syncthreads();
    float m = NEG_INF;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, p[j]);
    m = block_max(m, sh);
    float z = 0.0f;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(p[j] - m);
        p[j] = e;
        z += e;
    }
    z = block_sum(z, sh);
    const float inv = 1.0f / z;
    for (u32 c = threadIdx.x; c < DIM; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = 0; j < n; ++j) acc += p[j] * vw[(((u64)b * cap + j) * hkv + h) * DIM + c];
        out[((u64)b * hq + hd) * DIM + c] = acc * inv;
    }
}

// grid rows, 256 threads: out[r] = argmax of logits[r] (the lowest index among equal maxima,
// as fathom_model::argmax); a NaN row gives index 0xffffffff.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, u32 v,
                                       u32* __restrict__ out) {
    __shared__ float bv[256];
    __shared__ u32 bi[256];
    const float* row = logits + (u64)blockIdx.x * v;
    float best = NEG_INF;
    u32 idx = 0xffffffffu;
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) {
        const float x = row[i];
        if (x > best) {  // strictly greater: each thread keeps its lowest index of a tie
            best = x;
            idx = i;
        }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float o = bv[threadIdx.x + s];
            const u32 oi = bi[threadIdx.x + s];
            if (o > bv[threadIdx.x] || (o == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = o;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = bi[0];
}

// splitmix64 of (i, seed): a uniform in [0, 1) from the top 24 bits.
__device__ __forceinline__ float uniform01(u64 i, u64 seed) {
    u64 z = i + seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// Synthetic weights (labelled where used): out[i] = bf16(scale · (2u − 1)).
extern "C" __global__ void fill_uniform_bf16(u16* __restrict__ out, u64 n, u64 seed, float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f2bf(scale * (2.0f * uniform01(i, seed) - 1.0f));
}

// Synthetic K/V rows `[n / DIM][DIM]` (labelled where used): out[i] = (2u − 1) · s_c with
// s_c = 1 for values, or 0.1 + c / DIM per channel c for keys (`slope` set), so keys have
// channels of different spread as real keys do.
extern "C" __global__ void fill_uniform_f32(float* __restrict__ out, u64 n, u64 seed, u32 slope) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float s = slope ? 0.1f + (float)(i % DIM) / (float)DIM : 1.0f;
        out[i] = s * (2.0f * uniform01(i, seed) - 1.0f);
    }
}
