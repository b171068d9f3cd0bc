// RMS norm over groups and interleaved partial rope.

// Values per thread the register-resident norms hold.
#define RN_MAX 16

// Values first + stride i (i < RN_MAX, below n) of a row held in registers, with the
// weight's: all the loads in flight at once instead of one pass to sum the squares and
// another to scale. Returns this thread's sum of squares in the order of the two-pass loop
// (values past n add +0), so the norm keeps its bits.
__device__ __forceinline__ float rn_load(const float* v, const float* w, int n, int first, int stride,
                                         float (&a)[RN_MAX], float (&b)[RN_MAX]) {
#pragma unroll
    for (int i = 0; i < RN_MAX; i++) {
        int k = first + i * stride;
        a[i] = k < n ? v[k] : 0.f;
        b[i] = w && k < n ? w[k] : 1.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < RN_MAX; i++) ss += a[i] * a[i];
    return ss;
}

// The scaled values back to o: w * (v * r) (v * r without a weight).
__device__ __forceinline__ void rn_store(float* o, bool has_w, int n, int first, int stride, float r,
                                         const float (&a)[RN_MAX], const float (&b)[RN_MAX]) {
#pragma unroll
    for (int i = 0; i < RN_MAX; i++) {
        int k = first + i * stride;
        if (k < n) o[k] = has_w ? b[i] * (a[i] * r) : a[i] * r;
    }
}

// One block per group of `group` consecutive values; `w` (length `group`) may be null.
// Groups of up to RN_MAX values per thread (4096 with 256 threads) stay in registers.
extern "C" __global__ void k_rms_norm(const float* x, const float* w, float* out, int group, float eps) {
    pdl_enter();
    __shared__ float sh[32];
    const float* v = x + (i64)blockIdx.x * group;
    float* o = out + (i64)blockIdx.x * group;
    if (group <= RN_MAX * (int)blockDim.x) {
        float a[RN_MAX], b[RN_MAX];
        float ss = rn_load(v, w, group, threadIdx.x, blockDim.x, a, b);
        ss = block_sum(ss, sh) / (float)group;
        rn_store(o, w != nullptr, group, threadIdx.x, blockDim.x, 1.f / sqrtf(ss + eps), a, b);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) ss += v[i] * v[i];
    ss = block_sum(ss, sh) / (float)group;
    float r = 1.f / sqrtf(ss + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x)
        o[i] = w ? w[i] * (v[i] * r) : v[i] * r;
}

// 1 / rms of the `group` values at v, for every lane of the warp that reads them.
__device__ __forceinline__ float warp_inv_rms(const float* v, int group, int lane, float eps) {
    float ss = 0.f;
    for (int i = lane; i < group; i += 32) ss += v[i] * v[i];
    ss = warp_sum(ss) / (float)group;
    return 1.f / sqrtf(ss + eps);
}

// One warp per group (groups of at most a few thousand values, e.g. per-head norms): grid
// ceil(groups / warps per block); `groups` groups of `group` values. Groups of up to
// RN_MAX values per lane (512) stay in registers, with warp_inv_rms's sums (the fused
// query-head kernel's norm has the same bits).
extern "C" __global__ void k_rms_norm_warp(const float* x, const float* w, float* out, int group, int groups,
                                           float eps) {
    pdl_enter();
    int gi = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (gi >= groups) return;
    const float* v = x + (i64)gi * group;
    float* o = out + (i64)gi * group;
    if (group <= RN_MAX * 32) {
        float a[RN_MAX], b[RN_MAX];
        float ss = warp_sum(rn_load(v, w, group, lane, 32, a, b)) / (float)group;
        rn_store(o, w != nullptr, group, lane, 32, 1.f / sqrtf(ss + eps), a, b);
        return;
    }
    float r = warp_inv_rms(v, group, lane, eps);
    for (int i = lane; i < group; i += 32) o[i] = w ? w[i] * (v[i] * r) : v[i] * r;
}

// One block per row. cos/sin: [rows, rd/2] at each row's position. Rotates the trailing
// `rd` channels of every `head_dim` head; `inverse` uses -sin.
extern "C" __global__ void k_rope(float* x, const float* cs, const float* sn, int cols, int head_dim, int rd, int inverse) {
    pdl_enter();
    int r = blockIdx.x;
    int half = rd / 2, heads = cols / head_dim;
    float* row = x + (i64)r * cols;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        int hh = t / half, i = t % half;
        float c = cs[(i64)r * half + i];
        float s = sn[(i64)r * half + i];
        if (inverse) s = -s;
        float* p = row + hh * head_dim + head_dim - rd + 2 * i;
        float x0 = p[0], x1 = p[1];
        p[0] = rope_rotate0(x0, x1, c, s);
        p[1] = rope_rotate1(x0, x1, c, s);
    }
}

// Attention's queries as its tensor-core kernel reads them: every head of `head_dim` values
// RMS-normed (unweighted, k_rms_norm_warp's sums and products), its trailing `rd` channels
// roped by cs/sn ([rows, rd/2], k_rope's products), rounded to bf16. One warp per head:
// grid ceil(groups / warps per block); `groups` = rows x heads_per_row heads. head_dim even.
extern "C" __global__ void k_query_heads_bf16(const float* x, const float* cs, const float* sn, bf16_t* out,
                                              int head_dim, int groups, int heads_per_row, int rd, float eps) {
    pdl_enter();
    int gi = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (gi >= groups) return;
    const float* v = x + (i64)gi * head_dim;
    bf16_t* o = out + (i64)gi * head_dim;
    float r = warp_inv_rms(v, head_dim, lane, eps);
    int nope = head_dim - rd, half = rd / 2;
    i64 row = gi / heads_per_row;
    for (int c = 2 * lane; c < head_dim; c += 64) {
        float x0 = v[c] * r, x1 = v[c + 1] * r;
        if (c >= nope) {
            int k = (c - nope) >> 1;
            float cv = cs[row * half + k], sv = sn[row * half + k];
            float y0 = rope_rotate0(x0, x1, cv, sv), y1 = rope_rotate1(x0, x1, cv, sv);
            x0 = y0;
            x1 = y1;
        }
        *reinterpret_cast<u32*>(o + c) = (u32)f_to_bf16(x0) | ((u32)f_to_bf16(x1) << 16);
    }
}
