// Conversions, embedding, row gathers and SwiGLU.

// Four values per thread and step where both buffers allow 16- and 8-byte accesses (the
// same rounding either way).
extern "C" __global__ void k_f32_to_bf16(const float* x, bf16_t* y, i64 n) {
    pdl_enter();
    i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x, done = 0;
    if ((((unsigned long long)x & 15) | ((unsigned long long)y & 7)) == 0) {
        i64 n4 = n >> 2;
        for (i64 i = t; i < n4; i += stride) {
            float4 v = reinterpret_cast<const float4*>(x)[i];
            reinterpret_cast<uint2*>(y)[i] = make_uint2((u32)f_to_bf16(v.x) | ((u32)f_to_bf16(v.y) << 16),
                                                        (u32)f_to_bf16(v.z) | ((u32)f_to_bf16(v.w) << 16));
        }
        done = n4 << 2;
    }
    for (i64 i = done + t; i < n; i += stride) y[i] = f_to_bf16(x[i]);
}

extern "C" __global__ void k_bf16_to_f32(const bf16_t* x, float* y, i64 n) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf16_to_f(x[i]);
}

extern "C" __global__ void k_swiglu(const float* g, const float* u, float* y, i64 n, float limit) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = swiglu_(g[i], u[i], limit);
}

// x: [rows, 2*inter] (gate columns, then up columns) -> y: [rows, inter].
extern "C" __global__ void k_swiglu_halves(const float* x, float* y, i64 n, int inter, float limit) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / inter, c = i % inter;
        y[i] = swiglu_(x[r * 2 * inter + c], x[r * 2 * inter + inter + c], limit);
    }
}

// One block per row: `copies` copies of table row tokens[r].
extern "C" __global__ void k_embed_bf16(const bf16_t* table, const u32* tokens, float* out, int h, int copies) {
    pdl_enter();
    int r = blockIdx.x;
    const bf16_t* src = table + (i64)tokens[r] * h;
    float* dst = out + (i64)r * h * copies;
    if (((h & 7) | (((unsigned long long)src | (unsigned long long)dst) & 15)) == 0) {
        // Eight values per thread and step: one 16-byte load, written to every copy.
        for (int u = threadIdx.x; u < h / 8; u += blockDim.x) {
            uint4 q = reinterpret_cast<const uint4*>(src)[u];
            const u32 w[4] = {q.x, q.y, q.z, q.w};
            float v[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[2 * j] = __uint_as_float(w[j] << 16);
                v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
            }
            for (int c = 0; c < copies; c++) {
                float4* o = reinterpret_cast<float4*>(dst + (i64)c * h) + 2 * u;
                o[0] = make_float4(v[0], v[1], v[2], v[3]);
                o[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < h * copies; i += blockDim.x) dst[i] = bf16_to_f(src[i % h]);
}

extern "C" __global__ void k_embed_f32(const float* table, const u32* tokens, float* out, int h, int copies) {
    pdl_enter();
    int r = blockIdx.x;
    const float* src = table + (i64)tokens[r] * h;
    float* dst = out + (i64)r * h * copies;
    for (int i = threadIdx.x; i < h * copies; i += blockDim.x) dst[i] = src[i % h];
}

extern "C" __global__ void k_gather_rows(const float* x, const int* idx, float* out, int cols) {
    pdl_enter();
    int r = blockIdx.x;
    const float* src = x + (i64)idx[r] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(i64)r * cols + i] = src[i];
}

// out[r] = bf16(x[idx[r]]), one block per row (the bf16 input of the prefill's expert GEMMs).
extern "C" __global__ void k_gather_rows_bf16(const float* x, const int* idx, bf16_t* out, int cols) {
    pdl_enter();
    int r = blockIdx.x;
    const float* src = x + (i64)idx[r] * cols;
    bf16_t* dst = out + (i64)r * cols;
    if (vec4_rows(cols, x, out)) {
        for (int i = threadIdx.x * 4; i < cols; i += blockDim.x * 4) {
            float4 v = *reinterpret_cast<const float4*>(src + i);
            *reinterpret_cast<uint2*>(dst + i) = make_uint2((u32)f_to_bf16(v.x) | ((u32)f_to_bf16(v.y) << 16),
                                                            (u32)f_to_bf16(v.z) | ((u32)f_to_bf16(v.w) << 16));
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = f_to_bf16(src[i]);
    }
}

// rinv[r] = 1 / sqrt(mean(x[r]^2) + eps), one block per row: the scale of an unweighted RMS
// norm, applied after a GEMM on the raw rows (the hyper-connection mix).
extern "C" __global__ void k_row_inv_rms(const float* x, float* rinv, int cols, float eps) {
    pdl_enter();
    __shared__ float sh[32];
    float r = row_inv_rms(x + (i64)blockIdx.x * cols, cols, eps, sh, nullptr);
    if (threadIdx.x == 0) rinv[blockIdx.x] = r;
}

// y[r, c] *= s[r] over `rows` rows of `cols`.
extern "C" __global__ void k_scale_rows(float* y, const float* s, int rows, int cols) {
    pdl_enter();
    i64 n = (i64)rows * cols;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] *= s[i / cols];
}

// --deterministic: y[r, j] = x[r, (j / dout) * K ..] . w[j, :K] with one fixed reduction
// order per output (lane-strided partial sums in ascending k, then a butterfly across the
// warp), whatever M is or which rows share the launch: a row's result is independent of its
// batch. One warp per output column j, MM_TILE rows per block row. grid (ceil(N / warps),
// ceil(M / MM_TILE)).
#define MM_TILE 8
__device__ __forceinline__ float load_w(const bf16_t* w, int c) { return bf16_to_f(w[c]); }
__device__ __forceinline__ float load_w(const float* w, int c) { return w[c]; }

template <typename W>
__device__ void matmul_rows(const float* x, const W* w, float* y, int M, int N, int K, int ldx,
                            int dout) {
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int r0 = blockIdx.y * MM_TILE;
    if (j >= N || r0 >= M) return;
    int nt = min(MM_TILE, M - r0);
    const W* wr = w + (i64)j * K;
    const float* xb = x + (i64)r0 * ldx + (i64)(j / dout) * K;
    float d[MM_TILE];
#pragma unroll
    for (int t = 0; t < MM_TILE; t++) d[t] = 0.f;
    for (int c = lane; c < K; c += 32) {
        float wv = load_w(wr, c);
#pragma unroll
        for (int t = 0; t < MM_TILE; t++)
            if (t < nt) d[t] = fmaf(wv, xb[(i64)t * ldx + c], d[t]);
    }
#pragma unroll
    for (int t = 0; t < MM_TILE; t++)
        for (int o = 16; o > 0; o >>= 1) d[t] += __shfl_xor_sync(0xffffffffu, d[t], o);
    if (lane == 0)
        for (int t = 0; t < nt; t++) y[(i64)(r0 + t) * N + j] = d[t];
}

extern "C" __global__ void k_matmul_rows_bf16(const float* x, const bf16_t* w, float* y, int m, int n,
                                              int k, int ldx, int dout) {
    pdl_enter();
    matmul_rows(x, w, y, m, n, k, ldx, dout);
}

extern "C" __global__ void k_matmul_rows_f32(const float* x, const float* w, float* y, int m, int n,
                                             int k, int ldx, int dout) {
    pdl_enter();
    matmul_rows(x, w, y, m, n, k, ldx, dout);
}
