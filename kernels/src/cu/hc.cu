// Manifold-constrained hyper-connections (fp32): pre/post/comb mapping, stream update, head.

#define HC_MAX 16

// Row r's post weights and its Sinkhorn-normalised comb matrix by one warp, hc * hc <= 32:
// lane t holds c[t / hc][t % hc], the same sums in the same order as the serial path of
// hc_mix_weights, through shuffles instead of shared memory. HC: hc at compile time (0:
// at run time), so each sum's shuffles are issued together.
template <int HC>
__device__ void hc_mix_warp(const float* m, const float* base, const float* scale, float* post, float* comb, int r,
                            int hc_rt, int iters, float eps) {
    const int hc = HC ? HC : hc_rt;
    int t = threadIdx.x, i = t / hc, j = t % hc;
    bool on = t < hc * hc;
    if (t < hc) post[(i64)r * hc + t] = 2.f * sigmoidf_(m[hc + t] * scale[1] + base[hc + t]);
    float v = on ? m[2 * hc + t] * scale[2] + base[2 * hc + t] : 0.f;
    int row0 = on ? i * hc : 0, col0 = on ? j : 0;
    float mx = NEG_INF;
#pragma unroll
    for (int q = 0; q < hc; q++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, v, row0 + q));
    v = expf(v - mx);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < hc; q++) sum += __shfl_sync(0xffffffffu, v, row0 + q);
    v = v / sum + eps;
    int rounds = iters > 1 ? iters : 1;
    for (int it = 0; it < rounds; it++) {
        if (it > 0) {
            float acc = 0.f;
#pragma unroll
            for (int q = 0; q < hc; q++) acc += __shfl_sync(0xffffffffu, v, row0 + q);
            v /= acc + eps;
        }
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < hc; q++) acc += __shfl_sync(0xffffffffu, v, col0 + q * hc);
        v /= acc + eps;
    }
    if (on) comb[(i64)r * hc * hc + t] = v;
}

// Row r's post weights and its Sinkhorn-normalised comb matrix, by the calling warp (c:
// shared scratch for hc * hc > 32, which lane 0 computes serially).
__device__ void hc_mix_weights(const float* m, const float* base, const float* scale, float* post, float* comb,
                               float* c, int r, int hc, int iters, float eps) {
    if (hc == 4) {
        hc_mix_warp<4>(m, base, scale, post, comb, r, hc, iters, eps);
    } else if (hc * hc <= 32) {
        hc_mix_warp<0>(m, base, scale, post, comb, r, hc, iters, eps);
    } else if (threadIdx.x == 0) {
        for (int k = 0; k < hc; k++) post[(i64)r * hc + k] = 2.f * sigmoidf_(m[hc + k] * scale[1] + base[hc + k]);
        for (int i = 0; i < hc * hc; i++) c[i] = m[2 * hc + i] * scale[2] + base[2 * hc + i];
        for (int i = 0; i < hc; i++) {
            float mx = NEG_INF;
            for (int j = 0; j < hc; j++) mx = fmaxf(mx, c[i * hc + j]);
            float s = 0.f;
            for (int j = 0; j < hc; j++) { c[i * hc + j] = expf(c[i * hc + j] - mx); s += c[i * hc + j]; }
            for (int j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / s + eps;
        }
        // Columns once, then (rows, columns) for each further iteration.
        int rounds = iters > 1 ? iters : 1;
        for (int it = 0; it < rounds; it++) {
            if (it > 0) {
                for (int i = 0; i < hc; i++) {
                    float acc = 0.f;
                    for (int j = 0; j < hc; j++) acc += c[i * hc + j];
                    float s = acc + eps;
                    for (int j = 0; j < hc; j++) c[i * hc + j] /= s;
                }
            }
            for (int j = 0; j < hc; j++) {
                float acc = 0.f;
                for (int i = 0; i < hc; i++) acc += c[i * hc + j];
                float s = acc + eps;
                for (int i = 0; i < hc; i++) c[i * hc + j] /= s;
            }
        }
        for (int i = 0; i < hc * hc; i++) comb[(i64)r * hc * hc + i] = c[i];
    }
}

// One block per row. mix: [rows, (2+hc)*hc]; streams: [rows, hc*h]. `norm` 1 or 2: the mix
// logits are of the raw rows and each is scaled here by its row's unweighted RMS norm
// (norm_eps; k_row_inv_rms's value, then k_scale_rows' product: the same bits as those two
// kernels); 2: the norm's pass leaves the row in dynamic shared memory (hc * h floats) for
// the collapse, so the streams are read from memory once (16-byte rows only; else as 1).
// 0: the mix is used as it is. Warp 0 computes the row's post and comb weights (the
// Sinkhorn rounds: a serial chain) while the other warps collapse the streams with the pre
// weights, which each of them computes itself: the two are independent, so the block takes
// the longer of them instead of their sum.
extern "C" __global__ void k_hc_pre(const float* streams, const float* mix, const float* base, const float* scale,
                                    float* post, float* comb, float* collapsed, int h, int hc, int iters, float eps,
                                    int norm, float norm_eps) {
    pdl_enter();
    extern __shared__ float4 row4[];
    __shared__ float c[HC_MAX * HC_MAX];
    __shared__ float ms[(2 + HC_MAX) * HC_MAX];
    __shared__ float sh[32];
    int r = blockIdx.x, nmix = (2 + hc) * hc;
    const float* s = streams + (i64)r * hc * h;
    bool vec = vec4_rows(h, streams, collapsed), staged = norm == 2 && vec;
    // x * 1 is x exactly: the plain mix passes through unchanged.
    float rinv = norm ? row_inv_rms(s, hc * h, norm_eps, sh, staged ? row4 : nullptr) : 1.f;
    for (int i = threadIdx.x; i < nmix; i += blockDim.x) ms[i] = mix[(i64)r * nmix + i] * rinv;
    __syncthreads();
    if (staged) s = reinterpret_cast<const float*>(row4);
    const float* m = ms;
    // With a single warp it does both, the weights first.
    int first = blockDim.x > 32 ? 32 : 0;
    if (threadIdx.x < 32) hc_mix_weights(m, base, scale, post, comb, c, r, hc, iters, eps);
    if ((int)threadIdx.x < first) return;
    float pre[HC_MAX];
#pragma unroll
    for (int k = 0; k < HC_MAX; k++) pre[k] = k < hc ? sigmoidf_(m[k] * scale[0] + base[k]) + eps : 0.f;
    int tid = threadIdx.x - first, threads = blockDim.x - first;
    float* dst = collapsed + (i64)r * h;
    if (vec) {
        // Four channels per thread and step (the same sums, 16-byte accesses).
        for (int d = tid * 4; d < h; d += threads * 4) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int k = 0; k < HC_MAX; k++) {
                if (k >= hc) break;
                float4 v = *reinterpret_cast<const float4*>(s + (i64)k * h + d);
                acc.x += pre[k] * v.x;
                acc.y += pre[k] * v.y;
                acc.z += pre[k] * v.z;
                acc.w += pre[k] * v.w;
            }
            *reinterpret_cast<float4*>(dst + d) = acc;
        }
        return;
    }
    for (int d = tid; d < h; d += threads) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < HC_MAX; k++) {
            if (k >= hc) break;
            acc += pre[k] * s[(i64)k * h + d];
        }
        dst[d] = acc;
    }
}

// k_hc_post's rows with HC streams (a compile-time count, so the streams' values stay in
// registers), four channels per thread and step: the same sums in the same order.
template <int HC>
__device__ __forceinline__ void hc_post_vec4(const float* s, const float* o, const float* cb, const float* ps,
                                             float* dst, int h) {
    for (int d = threadIdx.x * 4; d < h; d += blockDim.x * 4) {
        float4 sv[HC];
#pragma unroll
        for (int j = 0; j < HC; j++) sv[j] = *reinterpret_cast<const float4*>(s + (i64)j * h + d);
        float4 od = *reinterpret_cast<const float4*>(o + d);
#pragma unroll
        for (int k = 0; k < HC; k++) {
            float4 mixv = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < HC; j++) {
                float c = cb[j * HC + k];
                mixv.x += c * sv[j].x;
                mixv.y += c * sv[j].y;
                mixv.z += c * sv[j].z;
                mixv.w += c * sv[j].w;
            }
            *reinterpret_cast<float4*>(dst + (i64)k * h + d) =
                make_float4(ps[k] * od.x + mixv.x, ps[k] * od.y + mixv.y, ps[k] * od.z + mixv.z, ps[k] * od.w + mixv.w);
        }
    }
}

// new[k] = post[k] * out + sum_j comb[j,k] * streams[j]; one block per row. Each thread
// takes channel d of every stream once and writes all hc outputs of it (the sums in j
// order, as before: the same values with a quarter of the stream loads at hc = 4).
extern "C" __global__ void k_hc_post(const float* streams, const float* out, const float* post, const float* comb,
                                     float* res, int h, int hc) {
    pdl_enter();
    __shared__ float cb[HC_MAX * HC_MAX];
    __shared__ float ps[HC_MAX];
    int r = blockIdx.x;
    const float* s = streams + (i64)r * hc * h;
    const float* o = out + (i64)r * h;
    for (int i = threadIdx.x; i < hc * hc; i += blockDim.x) cb[i] = comb[(i64)r * hc * hc + i];
    for (int i = threadIdx.x; i < hc; i += blockDim.x) ps[i] = post[(i64)r * hc + i];
    __syncthreads();
    float* dst = res + (i64)r * hc * h;
    if (hc == 4 && vec4_rows(h, streams, out) && vec4_rows(h, res)) {
        hc_post_vec4<4>(s, o, cb, ps, dst, h);
        return;
    }
    for (int d = threadIdx.x; d < h; d += blockDim.x) {
        float sv[HC_MAX];
#pragma unroll
        for (int j = 0; j < HC_MAX; j++) sv[j] = j < hc ? s[(i64)j * h + d] : 0.f;
        float od = o[d];
#pragma unroll
        for (int k = 0; k < HC_MAX; k++) {
            if (k >= hc) break;
            float mixv = 0.f;
#pragma unroll
            for (int j = 0; j < HC_MAX; j++)
                if (j < hc) mixv += cb[j * hc + k] * sv[j];
            dst[(i64)k * h + d] = ps[k] * od + mixv;
        }
    }
}

// sum_k (sigmoid(mix_k*scale + base_k) + eps) * streams[k]; one block per row.
extern "C" __global__ void k_hc_head(const float* streams, const float* mix, const float* base, const float* scale,
                                     float* out, int h, int hc, float eps) {
    pdl_enter();
    __shared__ float pre[HC_MAX];
    int r = blockIdx.x;
    if (threadIdx.x < hc) pre[threadIdx.x] = sigmoidf_(mix[(i64)r * hc + threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
    __syncthreads();
    const float* s = streams + (i64)r * hc * h;
    for (int d = threadIdx.x; d < h; d += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < hc; k++) acc += pre[k] * s[(i64)k * h + d];
        out[(i64)r * h + d] = acc;
    }
}
