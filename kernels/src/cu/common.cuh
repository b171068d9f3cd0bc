// Shared helpers, prepended to every kernel source before NVRTC compiles it.
// No system headers: bf16 is handled as raw 16-bit storage with round-to-nearest-even.
typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf16_to_f(bf16_t b) { return __uint_as_float(((u32)b) << 16); }

// Same rounding as the `half` crate: NaN keeps a quiet payload, otherwise nearest-even.
__device__ __forceinline__ bf16_t f_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// KV entry dtypes (EntryDtype): 0 = f32, 1 = bf16, 2 = fp8 e4m3 with one f32 scale per
// entry stored apart (index-K only; see f_to_e4m3).
__device__ __forceinline__ int dt_bytes(int dt) { return dt == 0 ? 4 : dt == 1 ? 2 : 1; }

// e4m3fn exactly as pdserve_engine::kv::fp8 computes it: round to nearest even,
// saturating at +-448, subnormals below 2^-6, NaN to the NaN code.
__device__ __forceinline__ unsigned char f_to_e4m3(float x) {
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

__device__ __forceinline__ float e4m3_to_f(unsigned char b) {
    float s = (b & 0x80) ? -1.f : 1.f;
    int e = (b >> 3) & 0xf;
    float m = (float)(b & 7);
    if (e == 0xf && (b & 7) == 7) return __int_as_float(0x7fc00000);
    if (e == 0) return s * m * (1.f / 512.f);
    return s * ldexpf(1.f + m / 8.f, e - 7);
}

// An f32 or bf16 entry's value i (fp8 entries are read with their scale: ld_fp8).
__device__ __forceinline__ float ld_entry(const unsigned char* p, int i, int dt) {
    return dt == 0 ? ((const float*)p)[i] : bf16_to_f(((const bf16_t*)p)[i]);
}

__device__ __forceinline__ void st_entry(unsigned char* p, int i, int dt, float v) {
    if (dt == 0) ((float*)p)[i] = v;
    else ((bf16_t*)p)[i] = f_to_bf16(v);
}

// What a store then a load through `dt` gives.
__device__ __forceinline__ float round_dt(float v, int dt) {
    return dt == 0 ? v : bf16_to_f(f_to_bf16(v));
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
