// Weights kept in DeepSeek's stored formats (WF_FP8 / WF_FP4, see common.cuh): the fused
// GEMM of small batches (weights dequantized in the inner loop), dequantization to bf16
// for the tensor-core GEMMs of larger batches, and quantization of synthetic f32 weights
// exactly as pdserve_engine::checkpoint::StoredWeight::quantize does it.

// Rows of x per block row of k_matmul_q.
#define QMM_TILE 8

// fp32 activations read 8 at a time (two 16-byte loads; rows 16-byte aligned).
struct XF32 {
    const float* p;
    __device__ bool vec8() const { return ((unsigned long long)p & 15) == 0; }
    __device__ float ld(int c) const { return p[c]; }
    __device__ void ld8(int c, float* o) const { ld8f(p + c, o); }
};

// bf16 activations (x rounded once, as the bf16 tensor-core path rounds it).
struct XBf16 {
    RowBf16 r;
    __device__ bool vec8() const { return r.vec8(8); }
    __device__ float ld(int c) const { return r.ld(c); }
    __device__ void ld8(int c, float* o) const { r.ld8(c, o); }
};

__device__ __forceinline__ XF32 x_row(const float* x, i64 off) { return XF32{x + off}; }
__device__ __forceinline__ XBf16 x_row(const bf16_t* x, i64 off) { return XBf16{RowBf16{x + off}}; }

// y[r, j] = sum_c x[r, (j / dout) * K + c] * w[j, c]: one warp per output column j, QMM_TILE
// rows per block row; each output's sum is lane-strided in 8-weight loads, then a butterfly:
// a fixed order whatever the batch (batch-invariant). x is fp32 or bf16 (`T`).
// grid (ceil(N / warps), ceil(M / QMM_TILE)).
template <typename M, typename T>
__device__ void matmul_q(const T* x, M w, float* y, int m, int n, int K, int ldx, int dout) {
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int r0 = blockIdx.y * QMM_TILE;
    if (j >= n || r0 >= m) return;
    int nt = min(QMM_TILE, m - r0);
    auto wr = w.row(j);
    i64 base = (i64)r0 * ldx + (i64)(j / dout) * K;
    float d[QMM_TILE];
#pragma unroll
    for (int t = 0; t < QMM_TILE; t++) d[t] = 0.f;
    bool x_vec = ldx % 8 == 0 && x_row(x, base).vec8();
    constexpr int V = decltype(wr)::VEC;
    if (wr.vecv(K) && x_vec) {
        // V weights (one 16-byte load) per lane; unrolled so several loads are in flight
        // per lane (one warp streams a row).
#pragma unroll 2
        for (int c = lane * V; c < K; c += 32 * V) {
            float wv[V];
            wr.ldv(c, wv);
#pragma unroll
            for (int t = 0; t < QMM_TILE; t++) {
                if (t < nt) {
                    auto xr = x_row(x, base + (i64)t * ldx);
                    float xc[V];
#pragma unroll
                    for (int h = 0; h < V; h += 8) xr.ld8(c + h, xc + h);
#pragma unroll
                    for (int q = 0; q < V; q++) d[t] = fmaf(wv[q], xc[q], d[t]);
                }
            }
        }
    } else {
        for (int c = lane; c < K; c += 32) {
            float wv = wr.ld(c);
#pragma unroll
            for (int t = 0; t < QMM_TILE; t++)
                if (t < nt) d[t] = fmaf(wv, x_row(x, base + (i64)t * ldx).ld(c), d[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < QMM_TILE; t++) d[t] = warp_sum(d[t]);
    if (lane == 0)
        for (int t = 0; t < nt; t++) y[(i64)(r0 + t) * n + j] = d[t];
}

template <typename T>
__device__ void matmul_q_fmt(const T* x, const unsigned char* q, const unsigned char* s, int fmt, int group_rows,
                             float* y, int m, int n, int k, int ldx, int dout) {
    if (fmt == WF_FP8)
        matmul_q(x, MatFp8{q, s, k, group_rows}, y, m, n, k, ldx, dout);
    else
        matmul_q(x, MatFp4{q, s, k}, y, m, n, k, ldx, dout);
}

// One of x (fp32) and xb (bf16) is given.
extern "C" __global__ void k_matmul_q(const float* x, const bf16_t* xb, const unsigned char* q,
                                      const unsigned char* s, int fmt, int group_rows, float* y, int m, int n,
                                      int k, int ldx, int dout) {
    pdl_enter();
    if (xb)
        matmul_q_fmt(xb, q, s, fmt, group_rows, y, m, n, k, ldx, dout);
    else
        matmul_q_fmt(x, q, s, fmt, group_rows, y, m, n, k, ldx, dout);
}

// out[r, c] = bf16 of the stored weight's value (exact: e4m3 and e2m1 values times a power
// of two fit bf16). Rows of whole scale groups: one thread per group of VEC values (16
// FP8, 32 FP4: one 16-byte load, one scale, 16-byte stores), 32-bit index arithmetic
// where the weight allows. Otherwise one thread per 8 values of a row (per value when
// cols % 8 != 0).
template <typename M>
__device__ void dequant_rows(M w, bf16_t* out, int rows, int cols) {
    constexpr int V = decltype(w.row(0))::VEC;
    if (cols % V == 0) {
        u32 per_row = (u32)(cols / V);
        i64 n = (i64)rows * per_row;
        bool narrow = n < (1ll << 31);
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
            i64 r = narrow ? (i64)((u32)i / per_row) : i / per_row;
            int c = (int)(i - r * per_row) * V;
            auto row = w.row(r);
            bf16_t* o = out + r * cols + c;
            if (row.vecv(cols) && ((unsigned long long)o & 15) == 0) {
                float v[V];
                row.ldv(c, v);
                uint4* o4 = reinterpret_cast<uint4*>(o);
#pragma unroll
                for (int k = 0; k < V / 8; k++) {
                    u32 p[4];
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        p[j] = (u32)f_to_bf16(v[8 * k + 2 * j]) | ((u32)f_to_bf16(v[8 * k + 2 * j + 1]) << 16);
                    o4[k] = make_uint4(p[0], p[1], p[2], p[3]);
                }
            } else {
                for (int q = 0; q < V; q++) o[q] = f_to_bf16(row.ld(c + q));
            }
        }
        return;
    }
    int step = cols % 8 == 0 ? 8 : 1;
    i64 per_row = cols / step, n = (i64)rows * per_row;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / per_row;
        int c = (int)(i % per_row) * step;
        auto row = w.row(r);
        bf16_t* o = out + r * cols + c;
        if (step == 8 && row.vec8(cols)) {
            float v[8];
            row.ld8(c, v);
#pragma unroll
            for (int q = 0; q < 8; q++) o[q] = f_to_bf16(v[q]);
        } else {
            for (int q = 0; q < step; q++) o[q] = f_to_bf16(row.ld(c + q));
        }
    }
}

extern "C" __global__ void k_dequant_bf16(const unsigned char* q, const unsigned char* s, int fmt, int group_rows,
                                          bf16_t* out, int rows, int cols) {
    pdl_enter();
    if (fmt == WF_FP8)
        dequant_rows(MatFp8{q, s, cols, group_rows}, out, rows, cols);
    else
        dequant_rows(MatFp4{q, s, cols}, out, rows, cols);
}

// The ue8m0 byte of the smallest power of two >= x (at least 2^-126, at most 2^127).
__device__ __forceinline__ unsigned char ue8m0_at_least(float x) {
    if (!(x > 1.17549435e-38f)) return 1;
    u32 bits = __float_as_uint(x);
    int e = (int)(bits >> 23) + ((bits & 0x7fffffu) != 0);
    return (unsigned char)min(max(e, 1), 254);
}

// The e2m1 nibble nearest to x (ties to the even code), saturating at +-6.
__device__ __forceinline__ u32 f_to_e2m1(float x) {
    const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    u32 sign = signbit(x) ? 8u : 0u;
    float a = fabsf(x);
    if (isnan(a)) return 7u;
    u32 code = 7u;
    for (int i = 0; i < 7; i++) {
        float mid = (mag[i] + mag[i + 1]) * 0.5f;
        if (a < mid || (a == mid && i % 2 == 0)) { code = (u32)i; break; }
    }
    return code == 0 ? 0u : (sign | code);
}

// One block per 128x128 block of a group: amax, its ue8m0 scale, then every value's code.
// grid (ceil(group_rows/128) * (rows / group_rows), ceil(cols/128)).
extern "C" __global__ void k_quantize_fp8(const float* x, unsigned char* q, unsigned char* s, int rows, int cols,
                                          int group_rows) {
    pdl_enter();
    __shared__ float sh[32];
    int grid_rows = (group_rows + 127) / 128, scols = (cols + 127) / 128;
    int g = blockIdx.x / grid_rows, br = blockIdx.x % grid_rows, bc = blockIdx.y;
    int r0 = g * group_rows + br * 128, r1 = min(r0 + 128, (g + 1) * group_rows);
    int c0 = bc * 128, c1 = min(c0 + 128, cols);
    int w = c1 - c0, n = (r1 - r0) * w;
    float amax = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        amax = fmaxf(amax, fabsf(x[(i64)(r0 + i / w) * cols + c0 + i % w]));
    amax = block_max(amax, sh);
    unsigned char b = ue8m0_at_least(amax / 448.f);
    if (threadIdx.x == 0) s[(i64)blockIdx.x * scols + bc] = b;
    float sc = e8m0_to_f(b);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        i64 at = (i64)(r0 + i / w) * cols + c0 + i % w;
        q[at] = f_to_e4m3(x[at] / sc);
    }
}

// One thread per 32 inputs of a row: scale, then 16 packed bytes. grid-stride.
extern "C" __global__ void k_quantize_fp4(const float* x, unsigned char* q, unsigned char* s, int rows, int cols) {
    pdl_enter();
    int scols = (cols + 31) / 32;
    i64 n = (i64)rows * scols;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / scols;
        int c0 = (int)(i % scols) * 32, c1 = min(c0 + 32, cols);
        const float* xr = x + r * cols;
        float amax = 0.f;
        for (int c = c0; c < c1; c++) amax = fmaxf(amax, fabsf(xr[c]));
        unsigned char b = ue8m0_at_least(amax / 6.f);
        s[i] = b;
        float sc = e8m0_to_f(b);
        unsigned char* qr = q + r * (cols / 2);
        for (int c = c0; c < c1; c += 2)
            qr[c / 2] = (unsigned char)(f_to_e2m1(xr[c] / sc) | (f_to_e2m1(xr[c + 1] / sc) << 4));
    }
}

// Warp w's row and 128-block of `kb` blocks a row, in 32-bit division while w fits (every
// launch under 2^31 blocks; 64-bit division costs a warp more than its whole block's
// conversion).
__device__ __forceinline__ void warp_block(i64 w, int kb, int& r, int& b) {
    if (w <= 0x7fffffffll) {
        u32 q = (u32)w / (u32)kb;
        r = (int)q, b = (int)((u32)w - q * (u32)kb);
    } else {
        r = (int)(w / kb), b = (int)(w % kb);
    }
}

// Values c0 .. c0 + 3 of a row (0 past `cols`): one 16-byte load where all four lie in the
// row at an aligned address, else one at a time (the same values either way).
__device__ __forceinline__ void aq_load4(const float* xr, int c0, int cols, float v[4]) {
    if (c0 + 3 < cols && ((unsigned long long)(xr + c0) & 15ull) == 0) {
        float4 f = *reinterpret_cast<const float4*>(xr + c0);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        return;
    }
    for (int i = 0; i < 4; i++) v[i] = c0 + i < cols ? xr[c0 + i] : 0.f;
}

// The e4m3 codes of v[0..4) over `sc` into qr[c0 ..] (none past `cols`): one 4-byte store
// where all four lie in the row at an aligned address, else byte by byte.
__device__ __forceinline__ void aq_store4(unsigned char* qr, int c0, int cols, const float v[4], float sc) {
    if (c0 + 3 < cols && ((unsigned long long)(qr + c0) & 3ull) == 0) {
        *reinterpret_cast<u32*>(qr + c0) = fp8kv_codes4(v, sc);
        return;
    }
    for (int i = 0; i < 4; i++)
        if (c0 + i < cols) qr[c0 + i] = fp8kv_code(v[i], sc);
}

// DeepSeek's act_quant of fp32 activations (pdserve_engine::numerics::quantize_e4m3_block):
// per 128 values of a row, the power-of-two scale at or above max(amax, 1e-4) / 448
// (fp8kv_scale's rule, the fp8 KV entries' too) and the e4m3 codes of the values over it,
// clamped to +-448 and rounded to nearest even. One warp per 128-value block (a partial
// last block on its own values), four values a lane, warp-strided over the blocks. Codes
// row-major (`cols` a row); scales as cuBLASLt's VEC128_32F reads them: [block][row], a
// block's run of `srows` rows (>= rows: a GEMM over rows padded to its tile).
extern "C" __global__ void k_act_quant_e4m3(const float* x, int ldx, unsigned char* q, float* s, int rows,
                                            int cols, int srows) {
    pdl_enter();
    int kb = (cols + 127) / 128, lane = threadIdx.x & 31;
    i64 total = (i64)rows * kb, stride = ((i64)gridDim.x * blockDim.x) >> 5;
    // The warp index is the same on every lane: whole warps loop and leave together.
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += stride) {
        int r, b;
        warp_block(w, kb, r, b);
        int c0 = b * 128 + lane * 4;
        float v[4], am = 0.f;
        aq_load4(x + (i64)r * ldx, c0, cols, v);
        for (int i = 0; i < 4; i++) am = fmaxf(am, fabsf(v[i]));
        float sc = fp8kv_scale(warp_max(am));
        aq_store4(q + (i64)r * cols, c0, cols, v, sc);
        if (lane == 0) s[(i64)b * srows + r] = sc;
    }
}

// deepseek numerics' act_quant (numerics::act_quant) of `rows` rows of `cols` values: every
// value replaced by its FP8 value per 128 of a row (a partial last block on its own
// values). Input f32 `x` or, where x is NULL, bf16 `x16`; output f32 `y` (may be x). One
// warp per block, warp-strided as k_act_quant_e4m3.
extern "C" __global__ void k_act_quant_f32(const float* x, const bf16_t* x16, float* y, int rows, int cols) {
    pdl_enter();
    int kb = (cols + 127) / 128, lane = threadIdx.x & 31;
    i64 total = (i64)rows * kb, stride = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += stride) {
        int ri, b;
        warp_block(w, kb, ri, b);
        i64 r = ri;
        int c0 = b * 128 + lane * 4;
        float v[4];
        for (int i = 0; i < 4; i++) {
            i64 at = r * cols + c0 + i;
            v[i] = c0 + i < cols ? (x ? x[at] : bf16_to_f(x16[at])) : 0.f;
        }
        act_quant_warp(v);
        for (int i = 0; i < 4; i++)
            if (c0 + i < cols) y[r * cols + c0 + i] = v[i];
    }
}

// deepseek numerics, routed experts (the CPU's MoE under act_quant_routed): each pick's
// SwiGLU activation times its routing weight, then act_quant per 128 of its `inter` values,
// in place: the reference's order, the weight applied before w2's input is quantized. The
// activations are f32 (`act`) or, where act is NULL, bf16 (`act16`: the FP8 values are
// exact in bf16); pick p's row is pos[p] (pos NULL: row p). `unit[p] = 1`: the weight the
// combine then applies. One warp per (pick, 128-block).
extern "C" __global__ void k_moe_weight_act_quant(float* act, bf16_t* act16, const float* wts, const int* pos,
                                                  float* unit, int picks, int inter) {
    pdl_enter();
    int kb = (inter + 127) / 128, lane = threadIdx.x & 31;
    i64 total = (i64)picks * kb, stride = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += stride) {
        int p, b;
        warp_block(w, kb, p, b);
        int c0 = b * 128 + lane * 4;
        i64 row = (i64)(pos ? pos[p] : p) * inter;
        float wt = wts[p], v[4];
        for (int i = 0; i < 4; i++)
            v[i] = c0 + i < inter ? (act ? act[row + c0 + i] : bf16_to_f(act16[row + c0 + i])) * wt : 0.f;
        act_quant_warp(v);
        for (int i = 0; i < 4; i++) {
            if (c0 + i >= inter) continue;
            if (act) act[row + c0 + i] = v[i];
            else act16[row + c0 + i] = f_to_bf16(v[i]);
        }
        if (lane == 0 && b == 0) unit[p] = 1.f;
    }
}

// The FP8 operands of the routed experts' block-scaled GEMMs (a prefill under deepseek
// numerics): picks sorted by expert, each expert's run of rows padded to the GEMM's row
// tile. `map` holds four ints per sorted pick j: the pick (row * k + slot), its GEMM row,
// and where its scales go: block b's at `map[2] + b * map[3]` (each expert's scales are
// its own VEC128 [block][row] run). One warp per (pick, 128-block), warp-strided as
// k_act_quant_e4m3; the padding rows' codes and scales are left as the caller zeroed them.

// w2's input of pick j: SwiGLU of its gate and up halves (the gate/up GEMM's output at its
// GEMM row: bf16, or fp32 where the library writes it) times its routing weight, then
// act_quant (k_moe_weight_act_quant's order); `unit[pick] = 1`, the weight the combine
// then applies.
__device__ __forceinline__ void gemm_out_load4(const float* g, int c0, int n, float v[4]) { aq_load4(g, c0, n, v); }
__device__ __forceinline__ void gemm_out_load4(const bf16_t* g, int c0, int n, float v[4]) {
    for (int i = 0; i < 4; i++) v[i] = c0 + i < n ? bf16_to_f(g[c0 + i]) : 0.f;
}

template <typename T>
__device__ void moe_swiglu_quant_e4m3(const T* gu, const int* map, const float* wts, float* unit,
                                      unsigned char* q, float* s, int picks, int inter, float limit) {
    int kb = (inter + 127) / 128, lane = threadIdx.x & 31;
    i64 total = (i64)picks * kb, stride = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += stride) {
        int j, b;
        warp_block(w, kb, j, b);
        int c0 = b * 128 + lane * 4;
        int pick = map[4 * j], row = map[4 * j + 1];
        const T* g = gu + (i64)row * 2 * inter;
        float wt = wts[pick], gate[4], up[4], v[4], am = 0.f;
        gemm_out_load4(g, c0, inter, gate);
        gemm_out_load4(g + inter, c0, inter, up);
        for (int i = 0; i < 4; i++) {
            v[i] = c0 + i < inter ? swiglu_(gate[i], up[i], limit) * wt : 0.f;
            am = fmaxf(am, fabsf(v[i]));
        }
        float sc = fp8kv_scale(warp_max(am));
        aq_store4(q + (i64)row * inter, c0, inter, v, sc);
        if (lane == 0) s[map[4 * j + 2] + (i64)b * map[4 * j + 3]] = sc;
        if (lane == 0 && b == 0) unit[pick] = 1.f;
    }
}

extern "C" __global__ void k_moe_swiglu_quant_e4m3_bf16(const bf16_t* gu, const int* map, const float* wts,
                                                        float* unit, unsigned char* q, float* s, int picks,
                                                        int inter, float limit) {
    pdl_enter();
    moe_swiglu_quant_e4m3(gu, map, wts, unit, q, s, picks, inter, limit);
}

extern "C" __global__ void k_moe_swiglu_quant_e4m3_f32(const float* gu, const int* map, const float* wts,
                                                       float* unit, unsigned char* q, float* s, int picks,
                                                       int inter, float limit) {
    pdl_enter();
    moe_swiglu_quant_e4m3(gu, map, wts, unit, q, s, picks, inter, limit);
}

// FP4 expert rows (e2m1 pairs, one ue8m0 scale byte per 32 of a row) expanded to e4m3
// codes with one f32 scale per 1 x 128 (VEC128: [block][row], `rows` a block's run), as
// DeepSeek's reference expands FP4 weights to FP8 inside its GEMM: the block's scale is
// 2^(smax - 127 - 6) for the largest of its four scale bytes, each value its e2m1 value times
// 2^(s - smax + 6) (at most 6 * 64 = 384). Exact while a block's four scales lie within
// 2^14 of each other (smaller values would fall below e4m3's subnormal step). One warp per
// (row, 128-block), four values a lane; cols a multiple of 128.
extern "C" __global__ void k_fp4_to_e4m3(const unsigned char* q4, const unsigned char* s4, unsigned char* q8,
                                         float* s8, int rows, int cols) {
    pdl_enter();
    int kb = cols / 128, lane = threadIdx.x & 31;
    i64 total = (i64)rows * kb, stride = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < total; w += stride) {
        i64 r = w / kb;
        int b = (int)(w % kb), c0 = b * 128 + lane * 4;
        int sb = s4[r * (cols / 32) + c0 / 32], smax = sb;
        for (int o = 16; o > 0; o >>= 1) smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, o));
        u32 two = *reinterpret_cast<const unsigned short*>(q4 + r * (cols / 2) + c0 / 2);
        float up = ldexpf(1.f, sb - smax + 6);
        u32 codes = 0;
        for (int i = 0; i < 4; i++) codes |= (u32)f_to_e4m3(e2m1w(two >> (4 * i)) * up) << (8 * i);
        *reinterpret_cast<u32*>(q8 + r * cols + c0) = codes;
        if (lane == 0) s8[(i64)b * rows + r] = ldexpf(1.f, smax - 133);
    }
}

// The experts' input: pick j's row of the tokens' act_quant (`xq` codes, row-major, `cols`
// a row; `xs` scales [block][token] over `n` tokens: k_act_quant_e4m3's output), row
// map[4j] / k, copied into its GEMM row map[4j+1] and its expert run's VEC128 scales
// (first map[4j+2], stride map[4j+3]). Each token is quantized once for its k picks; the
// codes and scales are those k_act_quant_e4m3 gives the row. One block per pick
// (block-strided), 16 bytes a thread where the rows are 16-byte aligned.
extern "C" __global__ void k_gather_quantized_picks(const unsigned char* xq, const float* xs, int n,
                                                    const int* map, unsigned char* q, float* s,
                                                    int picks, int cols, int k) {
    pdl_enter();
    int kb = (cols + 127) / 128;
    for (int j = blockIdx.x; j < picks; j += gridDim.x) {
        int t = map[4 * j] / k;
        const unsigned char* src = xq + (i64)t * cols;
        unsigned char* dst = q + (i64)map[4 * j + 1] * cols;
        if ((cols & 15) == 0) {
            for (int c = threadIdx.x * 16; c < cols; c += blockDim.x * 16)
                *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
        } else {
            for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
        }
        for (int b = threadIdx.x; b < kb; b += blockDim.x)
            s[map[4 * j + 2] + (i64)b * map[4 * j + 3]] = xs[(i64)b * n + t];
    }
}

// rotate_fp4 (common.cuh) of one head of 32 V values by one warp, lane l holding values
// V l .. V l + V - 1 in f64 registers: the Hadamard stages below V inside the lane, the
// others across lanes by shuffles, in rotate_fp4's order and with its operations (each
// stage's sums and differences are the same f64 operations, so the same bits); each FP4
// block of 32 values is 32 / V lanes, its maximum taken across them.
template <int V>
__device__ __forceinline__ void rotate_fp4_warp(const float* in, float* out, double scale) {
    const unsigned full = 0xffffffffu;
    int lane = threadIdx.x & 31;
    double v[V];
#pragma unroll
    for (int j = 0; j < V; j++) v[j] = (double)in[lane * V + j];
#pragma unroll
    for (int h = 1; h < V; h *= 2)
#pragma unroll
        for (int j = 0; j < V; j++)
            if (!(j & h)) {
                double p = v[j], q = v[j + h];
                v[j] = p + q;
                v[j + h] = p - q;
            }
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        bool upper = lane & d;
#pragma unroll
        for (int j = 0; j < V; j++) {
            double o = __shfl_xor_sync(full, v[j], d);
            v[j] = upper ? o - v[j] : v[j] + o;
        }
    }
    float f[V], am = 0.f;
#pragma unroll
    for (int j = 0; j < V; j++) {
        f[j] = (float)(v[j] * scale);
        am = fmaxf(am, fabsf(f[j]));
    }
#pragma unroll
    for (int o = 16 / V; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(full, am, o));
    float s = pow2_at_or_above(fmaxf(am, 6.f * 0x1p-126f) * (float)(1.0 / 6.0));
#pragma unroll
    for (int j = 0; j < V; j++) out[lane * V + j] = e2m1_round(fminf(fmaxf(f[j] / s, -6.f), 6.f)) * s;
}

// deepseek numerics, the indexer's queries: each of the `n` `hd`-wide heads of `x` rotated
// and FP4-quantized into `y` (rotate_fp4; `scale_bits` the f64 bits of hd^-0.5), one warp
// per head (rotate_fp4_warp). hd a power of two from 32 to 512.
extern "C" __global__ void k_rotate_fp4(const float* x, float* y, i64 n, int hd, i64 scale_bits) {
    pdl_enter();
    i64 head = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (head >= n) return;
    const float* in = x + head * hd;
    float* out = y + head * hd;
    double scale = __longlong_as_double(scale_bits);
    switch (hd) {
        case 32: rotate_fp4_warp<1>(in, out, scale); break;
        case 64: rotate_fp4_warp<2>(in, out, scale); break;
        case 128: rotate_fp4_warp<4>(in, out, scale); break;
        case 256: rotate_fp4_warp<8>(in, out, scale); break;
        case 512: rotate_fp4_warp<16>(in, out, scale); break;
        default: break;
    }
}

// Self-check of the e4m3 conversions against their integer forms (gpu-check), over every
// f32 bit pattern x: f_to_e4m3(x) == f_to_e4m3_soft(x), fp8kv_code and fp8kv_codes4 (x,
// -x, x / 2 and x with its top mantissa bit flipped) against the soft code of v / s, with
// s from 2^-30 to 2^30 and inf by the pattern; and for every code, e4m3_to_f ==
// e4m3_to_f_soft bit for bit. bad[0] += the failing patterns, bad[1] = min(bad[1], the
// smallest failing pattern). Grid-stride over 2^32.
extern "C" __global__ void k_e4m3_selfcheck(unsigned long long* bad) {
    pdl_enter();
    unsigned long long n = 0, first = ~0ull;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
         i += stride) {
        u32 bits = (u32)i, se = bits % 62;
        float x = __uint_as_float(bits), s = __uint_as_float((se == 61 ? 255u : 97u + se) << 23);
        float v[4] = {x, -x, x * 0.5f, __uint_as_float(bits ^ 0x00400000u)};
        bool ok = f_to_e4m3(x) == f_to_e4m3_soft(x);
        u32 want = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = f_to_e4m3_soft(fminf(fmaxf(v[k] / s, -448.f), 448.f));
            ok = ok && fp8kv_code(v[k], s) == c;
            want |= (u32)c << (8 * k);
        }
        ok = ok && fp8kv_codes4(v, s) == want;
        if (i < 256) ok = ok && __float_as_uint(e4m3_to_f((unsigned char)i)) == __float_as_uint(e4m3_to_f_soft((unsigned char)i));
        if (!ok) n++, first = min(first, i);
    }
    if (n) {
        atomicAdd(&bad[0], n);
        atomicMin(&bad[1], first);
    }
}
