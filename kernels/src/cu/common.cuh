// Shared helpers, prepended to every kernel source before NVRTC compiles it.
// No system headers: bf16 is handled as raw 16-bit storage with round-to-nearest-even.
typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

#define NEG_INF (__int_as_float(0xff800000))

// First statement of every kernel (a CPU test holds every __global__ function to it).
// Under programmatic dependent launch (Gpu::launch with the PDL attribute) a kernel may be
// scheduled while the previous one in the stream is still running: it waits here for that
// kernel to complete and its memory to be visible before touching any memory, then lets
// the next kernel be scheduled in turn, so each launch's latency overlaps the previous
// kernel's tail. Without the attribute both instructions return at once.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f(bf16_t b) { return __uint_as_float(((u32)b) << 16); }

// Same rounding as the `half` crate: NaN keeps a quiet payload, otherwise nearest-even.
__device__ __forceinline__ bf16_t f_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// KV entry dtypes (EntryDtype): 0 = f32, 1 = bf16, 2 = fp8 e4m3 with one f32 scale per
// entry stored apart (index-K; see f_to_e4m3), 3 = fp8 compressed-KV / window entries in
// FlashMLA's V4 layout (see st_fp8kv).
__device__ __forceinline__ int dt_bytes(int dt) { return dt == 0 ? 4 : dt == 1 ? 2 : 1; }

// e4m3fn exactly as pdserve_engine::kv::fp8 computes it: round to nearest even,
// saturating at +-448, subnormals below 2^-6, NaN to the NaN code. In integer arithmetic:
// f_to_e4m3 takes it before sm_89.
__device__ __forceinline__ unsigned char f_to_e4m3_soft(float x) {
    if (isnan(x)) return 0x7f;
    unsigned char sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (a >= 448.f) return sign | 0x7e;
    if (a < 1.f / 64.f) return sign | (unsigned char)rintf(a * 512.f);
    u32 bits = __float_as_uint(a);
    int e = (int)((bits >> 23) & 0xff) - 127;
    u32 mant = bits & 0x7fffffu;
    u32 keep = mant >> 20, rem = mant & 0xfffffu, m = keep;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) {
        m += 1;
        if (m == 8) { m = 0; e += 1; }
    }
    u32 code = ((u32)(e + 7) << 3) | m;
    return sign | (unsigned char)min(code, 0x7eu);
}

// The same code in hardware from sm_89 (one cvt.rn.satfinite: round to nearest even,
// magnitudes above 448 to 448, subnormals kept, the sign of a zero kept); NaN to 0x7f as
// above. k_e4m3_selfcheck holds it (and e4m3_to_f, fp8kv_code, fp8kv_codes4) to the
// integer forms over every f32 pattern (gpu-check's `e4m3 conversions` row).
__device__ __forceinline__ unsigned char f_to_e4m3(float x) {
#if __CUDA_ARCH__ >= 890
    if (isnan(x)) return 0x7f;
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.f), "f"(x));
    return (unsigned char)(two & 0xffu);
#else
    return f_to_e4m3_soft(x);
#endif
}

// An e4m3 code's value, in integer and f32 arithmetic: e4m3_to_f takes it before sm_89.
__device__ __forceinline__ float e4m3_to_f_soft(unsigned char b) {
    float s = (b & 0x80) ? -1.f : 1.f;
    int e = (b >> 3) & 0xf;
    float m = (float)(b & 7);
    if (e == 0xf && (b & 7) == 7) return __int_as_float(0x7fc00000);
    if (e == 0) return s * m * (1.f / 512.f);
    return s * ldexpf(1.f + m / 8.f, e - 7);
}

// The same value in hardware from sm_89: the code to f16 (exact: every e4m3 value is a
// normal f16 or a zero) and on to f32; the NaN codes to the one NaN above.
__device__ __forceinline__ float e4m3_to_f(unsigned char b) {
#if __CUDA_ARCH__ >= 890
    if ((b & 0x7f) == 0x7f) return __int_as_float(0x7fc00000);
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)b));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h2 & 0xffffu)));
    return f;
#else
    return e4m3_to_f_soft(b);
#endif
}

// An f32 or bf16 entry's value i (fp8 entries are read with their scale: ld_fp8).
__device__ __forceinline__ float ld_entry(const unsigned char* p, int i, int dt) {
    return dt == 0 ? ((const float*)p)[i] : bf16_to_f(((const bf16_t*)p)[i]);
}

__device__ __forceinline__ void st_entry(unsigned char* p, int i, int dt, float v) {
    if (dt == 0) ((float*)p)[i] = v;
    else ((bf16_t*)p)[i] = f_to_bf16(v);
}

// What a store then a load through `dt` gives (f32 and bf16; fp8 entries round per
// entry: k_kv_round_trip).
__device__ __forceinline__ float round_dt(float v, int dt) {
    return dt == 1 ? bf16_to_f(f_to_bf16(v)) : v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum; blockDim.x must be a multiple of 32; `sh` holds 32 floats.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = (int)threadIdx.x < nw ? sh[threadIdx.x] : 0.f;
    if (w == 0) v = warp_sum(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

// Whether rows of `n` values at every one of `p` take 4-wide 16-byte accesses: n a multiple
// of 4 and each address 16-byte aligned.
template <typename... P>
__device__ __forceinline__ bool vec4_rows(int n, const P*... p) {
    return ((n & 3) | ((0ull | ... | (unsigned long long)p) & 15)) == 0;
}

// 1 / sqrt(mean(v^2) + eps) of one row of `cols` floats, by the whole block (every thread
// calls it; blockDim.x a multiple of 32; `sh` holds 32 floats): k_row_inv_rms's value, and
// k_hc_pre's fused norm, the same sums in the same order. `keep` (may be null): where the
// 16-byte path leaves a copy of the row (shared memory: k_hc_pre's second pass reads it).
// The 16-byte path issues RMS_BATCH loads before using any: one load per step, each
// followed by its store to `keep`, left every load waiting for the one before (k_hc_pre's
// 16 steps of a 64 KiB row took ~300 us per 8K-row layer).
#define RMS_BATCH 8
__device__ float row_inv_rms(const float* v, int cols, float eps, float* sh, float4* keep) {
    float ss = 0.f;
    if (vec4_rows(cols, v)) {
        int step = blockDim.x * 4;
        for (int i0 = threadIdx.x * 4; i0 < cols; i0 += step * RMS_BATCH) {
            float4 a[RMS_BATCH];
#pragma unroll
            for (int u = 0; u < RMS_BATCH; u++)
                if (i0 + u * step < cols) a[u] = *reinterpret_cast<const float4*>(v + i0 + u * step);
#pragma unroll
            for (int u = 0; u < RMS_BATCH; u++) {
                int i = i0 + u * step;
                if (i >= cols) break;
                if (keep) keep[i >> 2] = a[u];
                ss += a[u].x * a[u].x + a[u].y * a[u].y + a[u].z * a[u].z + a[u].w * a[u].w;
            }
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += v[i] * v[i];
    }
    ss = block_sum(ss, sh) / (float)cols;
    return 1.f / sqrtf(ss + eps);
}

__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = (int)threadIdx.x < nw ? sh[threadIdx.x] : NEG_INF;
    if (w == 0) v = warp_max(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float silu_(float x) { return x * sigmoidf_(x); }

// Clamped SwiGLU of one gate/up pair.
__device__ __forceinline__ float swiglu_(float g, float u, float limit) {
    return silu_(fminf(g, limit)) * fminf(fmaxf(u, -limit), limit);
}

// Sequence table: 6 ints per sequence (start, len, row0, state slot, page-table offset,
// pages held); page tables are concatenated u32 page ids.
#define SEQ_START 0
#define SEQ_LEN 1
#define SEQ_ROW0 2
#define SEQ_STATE 3
#define SEQ_PT 4
#define SEQ_NPAGES 5
#define SEQ_INTS 6

// ---- Weight matrices as the kernels read them: bf16, f32, or DeepSeek's stored formats.
// A `Mat*` gives row `r` as a `Row*`, whose `ld(c)` is weight c of the row as an exact f32
// (the value pdserve_engine::checkpoint::StoredWeight::dequantize gives), and `ld8(c, o)`
// weights c..c+8 in one load where `vec8(n)` says a row of n weights allows it (c % 8 == 0).
// The stored formats also have `ldv`/`vecv`: VEC weights in one 16-byte load (16 FP8, 32
// FP4 values).

// Weight formats (the `fmt` argument; kernels/src/tensor.rs `Buf::format_code`): f32,
// bf16, and the stored ones: FP8 e4m3 with one ue8m0 scale per 128x128 block of each group
// of `group_rows` rows; FP4 e2m1 two per byte (element 2k in the low nibble of byte k) with
// one ue8m0 scale per 32 inputs of a row.
#define WF_F32 0
#define WF_BF16 1
#define WF_FP8 2
#define WF_FP4 3

// 2^(b-127) of a ue8m0 byte; b = 0 is the subnormal 2^-127.
__device__ __forceinline__ float e8m0_to_f(unsigned char b) {
    return b == 0 ? __uint_as_float(1u << 22) : __uint_as_float((u32)b << 23);
}

// An e4m3 byte's value (no NaN codes in weights): its exponent and mantissa bits placed
// in an f32's low exponent / high mantissa bits, then scaled by 2^(127-7); subnormals come
// out right because the f32 is then subnormal too.
__device__ __forceinline__ float e4m3w(u32 b) {
    return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 0x1p120f;
}

// An e2m1 nibble's value, the same way (scaled by 2^(127-1)).
__device__ __forceinline__ float e2m1w(u32 n) {
    return __uint_as_float(((n & 8u) << 28) | ((n & 7u) << 22)) * 0x1p126f;
}

__device__ __forceinline__ void ld8f(const float* p, float* out) {
    float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

struct RowBf16 {
    const bf16_t* p;
    __device__ bool vec8(int n) const { return n % 8 == 0 && ((unsigned long long)p & 15) == 0; }
    __device__ float ld(int c) const { return bf16_to_f(p[c]); }
    __device__ void ld8(int c, float* o) const {
        uint4 v = *reinterpret_cast<const uint4*>(p + c);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            o[2 * q] = __uint_as_float(w[q] << 16);
            o[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
        }
    }
};

struct RowF32 {
    const float* p;
    __device__ bool vec8(int) const { return false; }
    __device__ float ld(int c) const { return p[c]; }
    __device__ void ld8(int c, float* o) const {
#pragma unroll
        for (int q = 0; q < 8; q++) o[q] = p[c + q];
    }
};

// s: the row's scales, one per 128 columns.
struct RowFp8 {
    static constexpr int VEC = 16;
    const unsigned char* q;
    const unsigned char* s;
    __device__ bool vec8(int n) const { return n % 8 == 0 && ((unsigned long long)q & 7) == 0; }
    __device__ bool vecv(int n) const { return n % 16 == 0 && ((unsigned long long)q & 15) == 0; }
    // 16 weights of one 128-block (c % 16 == 0): one scale.
    __device__ void ldv(int c, float* o) const {
        uint4 v = *reinterpret_cast<const uint4*>(q + c);
        float sc = e8m0_to_f(s[c >> 7]);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 16; i++) o[i] = e4m3w(w[i >> 2] >> (8 * (i & 3))) * sc;
    }
    __device__ float ld(int c) const { return e4m3w(q[c]) * e8m0_to_f(s[c >> 7]); }
    __device__ void ld8(int c, float* o) const {
        uint2 v = *reinterpret_cast<const uint2*>(q + c);
        float sc = e8m0_to_f(s[c >> 7]);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            o[k] = e4m3w(v.x >> (8 * k)) * sc;
            o[4 + k] = e4m3w(v.y >> (8 * k)) * sc;
        }
    }
};

// q: the row's packed bytes; s: its scales, one per 32 columns.
struct RowFp4 {
    static constexpr int VEC = 32;
    const unsigned char* q;
    const unsigned char* s;
    __device__ bool vec8(int n) const { return n % 8 == 0 && ((unsigned long long)q & 3) == 0; }
    __device__ bool vecv(int n) const { return n % 32 == 0 && ((unsigned long long)q & 15) == 0; }
    // 32 weights of one scale group (c % 32 == 0).
    __device__ void ldv(int c, float* o) const {
        uint4 v = *reinterpret_cast<const uint4*>(q + (c >> 1));
        float sc = e8m0_to_f(s[c >> 5]);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 32; i++) o[i] = e2m1w(w[i >> 3] >> (4 * (i & 7))) * sc;
    }
    __device__ float ld(int c) const {
        return e2m1w((u32)q[c >> 1] >> ((c & 1) * 4)) * e8m0_to_f(s[c >> 5]);
    }
    __device__ void ld8(int c, float* o) const {
        u32 v = *reinterpret_cast<const u32*>(q + (c >> 1));
        float sc = e8m0_to_f(s[c >> 5]);
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = e2m1w(v >> (4 * k)) * sc;
    }
};

struct MatBf16 {
    const bf16_t* w;
    int cols;
    __device__ RowBf16 row(i64 r) const { return RowBf16{w + r * cols}; }
};

struct MatF32 {
    const float* w;
    int cols;
    __device__ RowF32 row(i64 r) const { return RowF32{w + r * cols}; }
};

struct MatFp8 {
    const unsigned char* q;
    const unsigned char* s;
    int cols, group_rows;
    __device__ RowFp8 row(i64 r) const {
        i64 scols = (cols + 127) / 128, grid_rows = (group_rows + 127) / 128;
        i64 srow = (r / group_rows) * grid_rows + (r % group_rows) / 128;
        return RowFp8{q + r * cols, s + srow * scols};
    }
};

struct MatFp4 {
    const unsigned char* q;
    const unsigned char* s;
    int cols;
    __device__ RowFp4 row(i64 r) const {
        return RowFp4{q + r * (cols / 2), s + r * ((cols + 31) / 32)};
    }
};

// ---- fp8 compressed-KV / window entries (dt 3), as pdserve_engine::kv::fp8_kv: a row of
// `nope` e4m3 codes then `rope` bf16 values, and in the region's scale block one ue8m0
// byte per 64 non-rope values, padded to 8 bytes. Quantization is DeepSeek's act_quant
// (pdserve_engine::numerics::quantize_e4m3_block): scale = the power of two at or above
// max(amax, 1e-4) / 448 (computed as a product with the f32 of 1/448), codes rounded to
// nearest even after clamping to +-448.
#define KV_TILE 64

__device__ __forceinline__ int fp8kv_row_bytes(int nope, int rope) { return nope + 2 * rope; }
__device__ __forceinline__ int fp8kv_scale_bytes(int nope) { return ((nope + KV_TILE - 1) / KV_TILE + 7) / 8 * 8; }

// `fast_round_scale`: the power of two at or above x, read from its bits
// (pdserve_engine::numerics::pow2_scale).
__device__ __forceinline__ float pow2_at_or_above(float x) {
    u32 bits = __float_as_uint(x);
    int e = (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0);
    return __uint_as_float((u32)min(max(e + 127, 0), 255) << 23);
}

__device__ __forceinline__ float fp8kv_scale(float amax) {
    return pow2_at_or_above(fmaxf(amax, 1e-4f) * (float)(1.0 / 448.0));
}

// The scale of tile t (non-rope values t*64 .. min(nope, t*64 + 64)) of entry `vals`.
__device__ __forceinline__ float fp8kv_tile_scale(const float* vals, int t, int nope) {
    float am = 0.f;
    for (int c = t * KV_TILE; c < min(nope, (t + 1) * KV_TILE); c++) am = fmaxf(am, fabsf(vals[c]));
    return fp8kv_scale(am);
}

// The e4m3 code of non-rope value c of an entry under its tile scale `s`, a power of two
// (fp8kv_scale's): v times 1/s is v / s exactly (1/s is exact from 2^-126 to 2^127, and 0
// for s = inf, as v / inf), and the reciprocal is shared by every call with the same s.
// The clamp sends NaN to -448.
__device__ __forceinline__ unsigned char fp8kv_code(float v, float s) {
    return f_to_e4m3(fminf(fmaxf(v * (1.f / s), -448.f), 448.f));
}

// fp8kv_code of v[0..4), packed low byte first.
__device__ __forceinline__ u32 fp8kv_codes4(const float v[4], float s) {
#if __CUDA_ARCH__ >= 890
    float inv = 1.f / s, c[4];
    for (int i = 0; i < 4; i++) c[i] = fminf(fmaxf(v[i] * inv, -448.f), 448.f);
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(c[1]), "f"(c[0]));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(c[3]), "f"(c[2]));
    return (u32)lo | ((u32)hi << 16);
#else
    u32 w = 0;
    for (int i = 0; i < 4; i++) w |= (u32)fp8kv_code(v[i], s) << (8 * i);
    return w;
#endif
}

// Value c of an entry whose row is at `row` and scales at `sc`.
__device__ __forceinline__ float ld_fp8kv(const unsigned char* row, const unsigned char* sc, int c, int nope) {
    if (c < nope) return e4m3_to_f(row[c]) * e8m0_to_f(sc[c / KV_TILE]);
    return bf16_to_f(((const bf16_t*)(row + nope))[c - nope]);
}

// Block-wide: store the nope + rope values `vals` as one entry. `tile_sc` is shared memory
// for the tile scales (at least 8 floats). Every thread of the block must call it.
__device__ void st_fp8kv(const float* vals, unsigned char* row, unsigned char* sc, int nope, int rope,
                         float* tile_sc) {
    int tiles = (nope + KV_TILE - 1) / KV_TILE, padded = fp8kv_scale_bytes(nope);
    for (int t = threadIdx.x; t < padded; t += blockDim.x) {
        if (t < tiles) {
            float s = fp8kv_tile_scale(vals, t, nope);
            tile_sc[t] = s;
            sc[t] = (unsigned char)((__float_as_uint(s) >> 23) & 0xff);
        } else {
            sc[t] = 0;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < nope + rope; c += blockDim.x) {
        if (c < nope) row[c] = fp8kv_code(vals[c], tile_sc[c / KV_TILE]);
        else ((bf16_t*)(row + nope))[c - nope] = f_to_bf16(vals[c]);
    }
    __syncthreads();
}

// ---- deepseek numerics (pdserve_engine::numerics), bit for bit.

// act_quant of one 128-value block held by a warp, 4 values a lane (values past the row
// as 0, which leave the amax alone): each value replaced by its FP8 value, e4m3 code times
// the block's power-of-two scale. Every lane of the warp must call it.
__device__ __forceinline__ void act_quant_warp(float* v) {
    float am = 0.f;
    for (int i = 0; i < 4; i++) am = fmaxf(am, fabsf(v[i]));
    float sc = fp8kv_scale(warp_max(am));
    for (int i = 0; i < 4; i++) v[i] = e4m3_to_f(fp8kv_code(v[i], sc)) * sc;
}

// The e2m1 value nearest to x (clamped to +-6 by the caller), ties to the even code, with
// x's sign (numerics::f32_to_e2m1 then e2m1_to_f32).
__device__ __forceinline__ float e2m1_round(float x) {
    float a = fabsf(x), r;
    if (a <= 0.25f) r = 0.f;
    else if (a < 0.75f) r = 0.5f;
    else if (a <= 1.25f) r = 1.f;
    else if (a < 1.75f) r = 1.5f;
    else if (a <= 2.5f) r = 2.f;
    else if (a < 3.5f) r = 3.f;
    else if (a <= 5.f) r = 4.f;
    else r = 6.f;
    return signbit(x) ? -r : r;
}

// The indexer's rotate_activation then fp4_act_quant over the n values of `in`, written
// to `out` (either may be shared or global memory, and they may be the same): the
// Walsh-Hadamard butterflies in f64 in the CPU's order (stage h pairs a and a + h inside
// blocks of 2h), y * scale (n^-0.5 as the host computes it) rounded once to f32; then per
// 32 values the power-of-two scale at or above max(amax, 6 * 2^-126) / 6 and each value's
// e2m1 value times it. n a power of two and a multiple of 32; `tmp` holds n doubles of
// shared memory; every thread of the block must call it (blockDim.x a multiple of 32, so a
// warp holds one 32-value block in the last loop).
__device__ void rotate_fp4(const float* in, float* out, double* tmp, int n, double scale) {
    for (int c = threadIdx.x; c < n; c += blockDim.x) tmp[c] = (double)in[c];
    __syncthreads();
    for (int h = 1; h < n; h *= 2) {
        for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
            int a = (i / h) * 2 * h + i % h;
            double p = tmp[a], q = tmp[a + h];
            tmp[a] = p + q;
            tmp[a + h] = p - q;
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        float v = (float)(tmp[c] * scale);
        float s = pow2_at_or_above(fmaxf(warp_max(fabsf(v)), 6.f * 0x1p-126f) * (float)(1.0 / 6.0));
        out[c] = e2m1_round(fminf(fmaxf(v / s, -6.f), 6.f)) * s;
    }
    __syncthreads();
}

// ---- The keys of one attention row, as the split-key and tensor-core kernels read them
// (one source for where each key lives). Key j < nwin is window position lo + j: earlier
// positions from the sequence's state ring, this forward's from `new_rows` (stored as
// entries of the KV dtype by k_kv_entries); then the row's compressed entries (mode 1:
// every visible entry, 2: the indexer's picks `sel`; mode 0: none). Entries take eb
// bytes, fp8 entries' scales sb bytes.
struct AttnRow {
    const unsigned char *ring, *ring_sc, *new_rows, *new_scales, *pages;
    const u32* table;
    const int* sel;  // this row's topk picks (mode 2)
    i64 eb, sb, page_bytes, comp_off, comp_scale_off;
    int start, row0, pos, lo, nwin, window, mode, rate, page_tokens, comp_epp;

    // Addresses of key j's entry and of its fp8 scale bytes.
    __device__ __forceinline__ void key(int j, unsigned long long& a, unsigned long long& sa) const {
        if (j < nwin) {
            int kp = lo + j;
            if (kp < start) {
                a = (unsigned long long)(ring + (i64)(kp % window) * eb);
                sa = (unsigned long long)(ring_sc + (i64)(kp % window) * sb);
            } else {
                a = (unsigned long long)(new_rows + (i64)(row0 + kp - start) * eb);
                sa = (unsigned long long)(new_scales + (i64)(row0 + kp - start) * sb);
            }
        } else {
            int e = mode == 1 ? j - nwin : sel[j - nwin];
            u32 pg = table[(e * rate) / page_tokens];
            a = (unsigned long long)(pages + (i64)pg * page_bytes + comp_off + (i64)(e % comp_epp) * eb);
            sa = (unsigned long long)(pages + (i64)pg * page_bytes + comp_scale_off + (i64)(e % comp_epp) * sb);
        }
    }
};

// Row r of a forward's attention (the kernels' common parameters). dt: the KV dtype code;
// hd, rd: head and rope dims (fp8 entry sizes).
__device__ __forceinline__ AttnRow attn_row(int r, const unsigned char* pages, const unsigned char* states,
                                            i64 page_bytes, i64 state_bytes, const int* seq, const u32* pt,
                                            const int* row_seq, const int* positions, const unsigned char* new_rows,
                                            const unsigned char* new_scales, const int* sel, int topk, int hd,
                                            int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                            int page_tokens, int dt, int rd, i64 win_scale_off,
                                            i64 comp_scale_off) {
    AttnRow k;
    const int* sq = seq + row_seq[r] * SEQ_INTS;
    const unsigned char* st = states + (i64)sq[SEQ_STATE] * state_bytes;
    k.start = sq[SEQ_START];
    k.row0 = sq[SEQ_ROW0];
    k.ring = st + win_off;
    k.ring_sc = st + win_scale_off;
    k.new_rows = new_rows;
    k.new_scales = new_scales;
    k.pages = pages;
    k.table = pt + sq[SEQ_PT];
    k.sel = sel + (i64)r * topk;
    int nope = hd - rd;
    k.eb = dt == 3 ? fp8kv_row_bytes(nope, rd) : (i64)hd * dt_bytes(dt);
    k.sb = fp8kv_scale_bytes(nope);
    k.page_bytes = page_bytes;
    k.comp_off = comp_off;
    k.comp_scale_off = comp_scale_off;
    k.pos = positions[r];
    k.lo = max(k.pos + 1 - window, 0);
    k.nwin = k.pos - k.lo + 1;
    k.window = window;
    k.mode = mode;
    k.rate = rate;
    k.page_tokens = page_tokens;
    k.comp_epp = comp_epp;
    return k;
}

// The keys of row r (window, then compressed entries: mode 1 every visible one, mode 2 the
// indexer's picks, -1 past them); every thread of the block calls it.
__device__ __forceinline__ int attn_row_keys(const AttnRow& keys, int mode, int rate, const int* sel, int topk, int r) {
    int nsel = 0;
    if (mode == 1) nsel = (keys.pos + 1) / rate;
    if (mode == 2)
        for (int j0 = 0; j0 < topk; j0 += blockDim.x) {
            int j = j0 + threadIdx.x;
            nsel += __syncthreads_count(j < topk && sel[(i64)r * topk + j] >= 0);
        }
    return keys.nwin + nsel;
}

// A split past its row's keys: an empty partial for heads rh .. rh + nh, which the combine
// skips.
__device__ __forceinline__ void attn_empty_split(float* part_ml, i64 rh, int nh, int nsplit, int split) {
    for (int h = threadIdx.x; h < nh; h += blockDim.x) {
        part_ml[((rh + h) * nsplit + split) * 2] = NEG_INF;
        part_ml[((rh + h) * nsplit + split) * 2 + 1] = 0.f;
    }
}

#if __CUDA_ARCH__ >= 890
// e4m3 codes to bf16 times a power-of-two scale 2^(sb - 127), in hardware (sm_89+): two
// codes (low byte first) to f16 (exact: every e4m3 value is a normal f16 or 0), re-read as
// bf16 with the f16 exponent field (the value times 2^-112, 0 stays 0), then times 2^112 *
// scale = 2^(sb - 15) in one bf16x2 product (exact for 4 significant bits while sb <= 134:
// no overflow; NaN codes do not survive the exponent move, so callers keep them out).
// `k2`: fp8_bf16x2_factor(sb).
__device__ __forceinline__ u32 fp8_bf16x2_factor(u32 sb) {
    u32 k = (sb + 112u) << 7;
    return k | (k << 16);
}
__device__ __forceinline__ u32 e4m3x2_to_bf16x2(unsigned short two, u32 k2) {
    u32 h, r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(two));
    u32 v = ((h & 0x7fff7fffu) >> 3) | (h & 0x80008000u);
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(k2), "r"(0x80008000u));
    return r;
}
#endif

// ---- Tensor-core helpers (sm_80+ PTX): shared addresses, ldmatrix fragments, bf16
// mma.sync m16n8k16 with fp32 accumulators, 16-byte cp.async.
__device__ __forceinline__ u32 tc_smem(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void tc_ldsm_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void tc_ldsm_x4_t(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void tc_ldsm_x2_t(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}

// d += a (16x16, row-major fragments) * b (16x8, column fragments).
__device__ __forceinline__ void tc_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void tc_cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(tc_smem(dst)), "l"(src));
}

__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void tc_wait_prev() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// A rope pair (x0, x1) rotated by (c, s): x0 c - x1 s and x1 c + x0 s, each product and
// sum rounded on its own (no fused multiply-add), as the CPU engine's Rope::apply computes
// it; k_rope and the attention epilogue that rotates its output back share it.
__device__ __forceinline__ float rope_rotate0(float x0, float x1, float c, float s) {
    return __fadd_rn(__fmul_rn(x0, c), __fmul_rn(-x1, s));
}
__device__ __forceinline__ float rope_rotate1(float x0, float x1, float c, float s) {
    return __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
}

// The output weight of a head whose keys gave running max m and sum l once its sink joins
// the softmax: e^(m - mx) / (l e^(m - mx) + e^(sink - mx)), mx = max(m, sink).
__device__ __forceinline__ float attn_sink_weight(float m, float l, float sink) {
    float mx = fmaxf(m, sink);
    float e = expf(m - mx);
    return e / (l * e + expf(sink - mx));
}
