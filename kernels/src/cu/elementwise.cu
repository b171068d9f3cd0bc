// Conversions, embedding, row gathers and SwiGLU.

extern "C" __global__ void k_f32_to_bf16(const float* x, bf16_t* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = f_to_bf16(x[i]);
}

extern "C" __global__ void k_bf16_to_f32(const bf16_t* x, float* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf16_to_f(x[i]);
}

extern "C" __global__ void k_swiglu(const float* g, const float* u, float* y, i64 n, float limit) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = swiglu_(g[i], u[i], limit);
}

// x: [rows, 2*inter] (gate columns, then up columns) -> y: [rows, inter].
extern "C" __global__ void k_swiglu_halves(const float* x, float* y, i64 n, int inter, float limit) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / inter, c = i % inter;
        y[i] = swiglu_(x[r * 2 * inter + c], x[r * 2 * inter + inter + c], limit);
    }
}

// One block per row: `copies` copies of table row tokens[r].
extern "C" __global__ void k_embed_bf16(const bf16_t* table, const u32* tokens, float* out, int h, int copies) {
    int r = blockIdx.x;
    const bf16_t* src = table + (i64)tokens[r] * h;
    float* dst = out + (i64)r * h * copies;
    for (int i = threadIdx.x; i < h * copies; i += blockDim.x) dst[i] = bf16_to_f(src[i % h]);
}

extern "C" __global__ void k_embed_f32(const float* table, const u32* tokens, float* out, int h, int copies) {
    int r = blockIdx.x;
    const float* src = table + (i64)tokens[r] * h;
    float* dst = out + (i64)r * h * copies;
    for (int i = threadIdx.x; i < h * copies; i += blockDim.x) dst[i] = src[i % h];
}

extern "C" __global__ void k_gather_rows(const float* x, const int* idx, float* out, int cols) {
    int r = blockIdx.x;
    const float* src = x + (i64)idx[r] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(i64)r * cols + i] = src[i];
}

// out[idx[r]] = x[r], one block per row.
extern "C" __global__ void k_scatter_rows(const float* x, const int* idx, float* out, int cols) {
    int r = blockIdx.x;
    float* dst = out + (i64)idx[r] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = x[(i64)r * cols + i];
}
