// MoE: routing (scores, top-k or hash table), routed experts over bf16 weights with fp32
// accumulation, weighted combine in expert order plus the shared expert.

// One warp per row, its lanes over the experts (E at most 1024). logits [rows, E] become
// scores in place. scoring: 0 sqrt(softplus), 1 sigmoid, 2 softmax. bias / hash may be
// null. Top-k: k rounds of a warp arg-max of score + bias over the experts not yet taken
// (ties: the lower expert id, as the CPU's sort; a NaN score counts as -inf); weights:
// score / (the picks' scores summed in pick order + 1e-20) * routed_scaling.
extern "C" __global__ void k_moe_route(float* logits, const float* bias, const u32* hash, int* ids, float* wts,
                                       int rows, int E, int k, int scoring, float routed_scaling) {
    pdl_enter();
    int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    float* s = logits + (i64)r * E;
    if (scoring == 0) {
        for (int i = lane; i < E; i += 32) {
            float x = s[i];
            s[i] = sqrtf(x > 20.f ? x : log1pf(expf(x)));
        }
    } else if (scoring == 1) {
        for (int i = lane; i < E; i += 32) s[i] = sigmoidf_(s[i]);
    } else {
        float m = NEG_INF, t = 0.f;
        for (int i = lane; i < E; i += 32) m = fmaxf(m, s[i]);
        m = warp_max(m);
        for (int i = lane; i < E; i += 32) {
            float e = expf(s[i] - m);
            s[i] = e;
            t += e;
        }
        t = warp_sum(t);
        for (int i = lane; i < E; i += 32) s[i] /= t;
    }
    __syncwarp();
    int* id = ids + (i64)r * k;
    if (hash) {
        for (int j = lane; j < k; j += 32) id[j] = (int)hash[(i64)r * k + j];
    } else {
        unsigned taken = 0;  // bit q: expert lane + 32 q
        for (int j = 0; j < k; j++) {
            float bv = NEG_INF;
            int bi = 0x7fffffff;
            for (int q = 0, i = lane; i < E; q++, i += 32) {
                if ((taken >> q) & 1u) continue;
                float v = s[i] + (bias ? bias[i] : 0.f);
                if (v != v) v = NEG_INF;
                if (bi == 0x7fffffff || v > bv) {
                    bv = v;
                    bi = i;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
            if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
            if (lane == 0) id[j] = bi;
        }
    }
    __syncwarp();
    if (lane == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum += s[id[j]];
        sum += 1e-20f;
        for (int j = 0; j < k; j++) wts[(i64)r * k + j] = s[id[j]] / sum * routed_scaling;
    }
}


// Tokens per expert: list[e * rows + j] = the j-th pick (row * k + slot, ascending) that
// chose expert e; count[e] = how many; active[0..count of used experts) = the used experts in
// ascending order, active[E] = how many there are. One block: a warp per expert, which
// scans the picks 32 at a time and places its matches by ballot (the lanes below a match
// that match too come first, so the order is the picks' order).
extern "C" __global__ void k_moe_lists(const int* ids, int* list, int* count, int* active, int rows, int E,
                                       int k) {
    pdl_enter();
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5, picks = rows * k;
    u32 below = (1u << lane) - 1u;
    for (int e = threadIdx.x >> 5; e < E; e += warps) {
        int n = 0;
        for (int a0 = 0; a0 < picks; a0 += 32) {
            int a = a0 + lane;
            bool hit = a < picks && ids[a] == e;
            u32 m = __ballot_sync(0xffffffffu, hit);
            if (hit) list[(i64)e * rows + n + __popc(m & below)] = a;
            n += __popc(m);
        }
        if (lane == 0) count[e] = n;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        int m = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            bool used = e0 + lane < E && count[e0 + lane] > 0;
            u32 b = __ballot_sync(0xffffffffu, used);
            if (used) active[m + __popc(b & below)] = e0 + lane;
            m += __popc(b);
        }
        if (lane == 0) active[E] = m;
    }
}

// Picks handled per pass over an expert's weights (per-lane accumulators in registers):
// MOE_TILE, or MOE_TILE_SMALL in the `_small` kernels for batches of at most that many
// rows (an expert then has at most that many picks; fewer registers, more warps resident
// and more weight loads in flight). Per pick the arithmetic is the same in both.
#define MOE_TILE 8
#define MOE_TILE_SMALL 2

// grid (E, ceil(I / warps)): each warp owns one intermediate unit of one expert and runs
// every pick of that expert against it, reading the weight rows once per TILE picks.
// Per pick the sums are formed exactly as in moe_gate_up (lane-strided, then warp_sum).
// `gu` is any weight matrix of common.cuh (bf16, f32, stored FP8/FP4).
template <int TILE, typename M>
__device__ void moe_gate_up_grouped(const float* x, M gu, const int* list, const int* count,
                                    const int* active, float* act, int rows, int E, int H, int I, int k,
                                    float limit) {
    if ((int)blockIdx.x >= active[E]) return;
    int e = active[blockIdx.x], lane = threadIdx.x & 31;
    int i = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int n = count[e];
    if (i >= I) return;
    auto g = gu.row((i64)e * 2 * I + i);
    auto u = gu.row((i64)e * 2 * I + I + i);
    const int* picks = list + (i64)e * rows;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int nt = min(TILE, n - t0);
        float dg[TILE], du[TILE];
        const float* xr[TILE];
        for (int t = 0; t < TILE; t++) {
            dg[t] = 0.f;
            du[t] = 0.f;
            xr[t] = x + (i64)(picks[t0 + min(t, nt - 1)] / k) * H;
        }
        // 8 weights per lane per load (wider loads of the stored formats measured slower
        // here at batch 8+: more registers per pick tile): a warp reads 256 weights of a row.
        // The small tile unrolls the row loop: several loads in flight per lane.
        constexpr int V = 8;
        constexpr int UNROLL = TILE <= MOE_TILE_SMALL ? 4 : 1;
        if (g.vec8(H) && u.vec8(H)) {
#pragma unroll UNROLL
            for (int c = lane * V; c < H; c += 32 * V) {
                float wg[V], wu[V];
                g.ld8(c, wg);
                u.ld8(c, wu);
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    if (t < nt) {
                        float xc[V];
#pragma unroll
                        for (int h = 0; h < V; h += 8) ld8f(xr[t] + c + h, xc + h);
#pragma unroll
                        for (int q = 0; q < V; q++) {
                            dg[t] += xc[q] * wg[q];
                            du[t] += xc[q] * wu[q];
                        }
                    }
                }
            }
        } else {
            for (int c = lane; c < H; c += 32) {
                float wg = g.ld(c), wu = u.ld(c);
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    float xv = xr[t][c];
                    dg[t] += xv * wg;
                    du[t] += xv * wu;
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            float a = warp_sum(dg[t]), b = warp_sum(du[t]);
            if (lane == 0 && t < nt) act[(i64)picks[t0 + t] * I + i] = swiglu_(a, b, limit);
        }
    }
}

// `w` holds the weights in format `fmt` (WF_*), `s` their scales (stored formats only).
template <int TILE>
__device__ void moe_gate_up_grouped_fmt(const float* x, const unsigned char* w, const unsigned char* s, int fmt,
                                        int group_rows, const int* list, const int* active, const int* count,
                                        float* act, int rows, int E, int H, int I, int k, float limit) {
    if (fmt == WF_BF16)
        moe_gate_up_grouped<TILE>(x, MatBf16{(const bf16_t*)w, H}, list, count, active, act, rows, E, H, I, k, limit);
    else if (fmt == WF_F32)
        moe_gate_up_grouped<TILE>(x, MatF32{(const float*)w, H}, list, count, active, act, rows, E, H, I, k, limit);
    else if (fmt == WF_FP8)
        moe_gate_up_grouped<TILE>(x, MatFp8{w, s, H, group_rows}, list, count, active, act, rows, E, H, I, k, limit);
    else
        moe_gate_up_grouped<TILE>(x, MatFp4{w, s, H}, list, count, active, act, rows, E, H, I, k, limit);
}

extern "C" __global__ void k_moe_gate_up_grouped(const float* x, const unsigned char* w, const unsigned char* s,
                                                 int fmt, int group_rows, const int* list, const int* active,
                                                 const int* count, float* act, int rows, int E, int H, int I,
                                                 int k, float limit) {
    pdl_enter();
    moe_gate_up_grouped_fmt<MOE_TILE>(x, w, s, fmt, group_rows, list, active, count, act, rows, E, H, I, k, limit);
}

extern "C" __global__ void k_moe_gate_up_grouped_small(const float* x, const unsigned char* w,
                                                       const unsigned char* s, int fmt, int group_rows,
                                                       const int* list, const int* active, const int* count,
                                                       float* act, int rows, int E, int H, int I, int k,
                                                       float limit) {
    pdl_enter();
    moe_gate_up_grouped_fmt<MOE_TILE_SMALL>(x, w, s, fmt, group_rows, list, active, count, act, rows, E, H, I, k,
                                            limit);
}

// grid (E, ceil(H / warps)); the down projection of every pick of expert e, as moe_down.
template <int TILE, typename M>
__device__ void moe_down_grouped(const float* act, M down, const int* list, const int* count,
                                 const int* active, float* y, int rows, int E, int H, int I) {
    if ((int)blockIdx.x >= active[E]) return;
    int e = active[blockIdx.x], lane = threadIdx.x & 31;
    int hh = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int n = count[e];
    if (hh >= H) return;
    auto w = down.row((i64)e * H + hh);
    const int* picks = list + (i64)e * rows;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int nt = min(TILE, n - t0);
        float d[TILE];
        const float* ar[TILE];
        for (int t = 0; t < TILE; t++) {
            d[t] = 0.f;
            ar[t] = act + (i64)picks[t0 + min(t, nt - 1)] * I;
        }
        constexpr int V = 8;
        constexpr int UNROLL = TILE <= MOE_TILE_SMALL ? 4 : 1;
        if (w.vec8(I)) {
#pragma unroll UNROLL
            for (int c = lane * V; c < I; c += 32 * V) {
                float wv[V];
                w.ld8(c, wv);
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    if (t < nt) {
                        float ac[V];
#pragma unroll
                        for (int h = 0; h < V; h += 8) ld8f(ar[t] + c + h, ac + h);
#pragma unroll
                        for (int q = 0; q < V; q++) d[t] += ac[q] * wv[q];
                    }
                }
            }
        } else {
            for (int c = lane; c < I; c += 32) {
                float wv = w.ld(c);
#pragma unroll
                for (int t = 0; t < TILE; t++) d[t] += ar[t][c] * wv;
            }
        }
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            float v = warp_sum(d[t]);
            if (lane == 0 && t < nt) y[(i64)picks[t0 + t] * H + hh] = v;
        }
    }
}

template <int TILE>
__device__ void moe_down_grouped_fmt(const float* act, const unsigned char* w, const unsigned char* s, int fmt,
                                     int group_rows, const int* list, const int* active, const int* count, float* y,
                                     int rows, int E, int H, int I) {
    if (fmt == WF_BF16)
        moe_down_grouped<TILE>(act, MatBf16{(const bf16_t*)w, I}, list, count, active, y, rows, E, H, I);
    else if (fmt == WF_F32)
        moe_down_grouped<TILE>(act, MatF32{(const float*)w, I}, list, count, active, y, rows, E, H, I);
    else if (fmt == WF_FP8)
        moe_down_grouped<TILE>(act, MatFp8{w, s, I, group_rows}, list, count, active, y, rows, E, H, I);
    else
        moe_down_grouped<TILE>(act, MatFp4{w, s, I}, list, count, active, y, rows, E, H, I);
}

extern "C" __global__ void k_moe_down_grouped(const float* act, const unsigned char* w, const unsigned char* s,
                                              int fmt, int group_rows, const int* list, const int* active,
                                              const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_down_grouped_fmt<MOE_TILE>(act, w, s, fmt, group_rows, list, active, count, y, rows, E, H, I);
}

extern "C" __global__ void k_moe_down_grouped_small(const float* act, const unsigned char* w, const unsigned char* s,
                                                    int fmt, int group_rows, const int* list, const int* active,
                                                    const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_down_grouped_fmt<MOE_TILE_SMALL>(act, w, s, fmt, group_rows, list, active, count, y, rows, E, H, I);
}

// Padded per-expert batches for one strided-batched GEMM: xp[e, t] = bf16(x[row of the
// t-th pick of e]) for t < count[e], zeros after. grid (E, rows).
extern "C" __global__ void k_moe_gather_padded(const float* x, const int* list, const int* count, bf16_t* xp,
                                               int rows, int H, int k) {
    pdl_enter();
    int e = blockIdx.x, t = blockIdx.y;
    bf16_t* dst = xp + ((i64)e * rows + t) * H;
    if (t >= count[e]) {
        for (int c = threadIdx.x; c < H; c += blockDim.x) dst[c] = 0;
        return;
    }
    const float* src = x + (i64)(list[(i64)e * rows + t] / k) * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) dst[c] = f_to_bf16(src[c]);
}

// gu: [n, 2*inter] (gate columns, then up columns) -> act: bf16 [n, inter].
// Row by row (a block-stride loop over the n / inter rows), four channels per thread and
// step where the rows allow 16-byte accesses.
extern "C" __global__ void k_swiglu_halves_bf16(const float* gu, bf16_t* act, i64 n, int inter, float limit) {
    pdl_enter();
    i64 rows = n / inter;
    bool vec = vec4_rows(inter, gu, act);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* g = gu + r * 2 * inter;
        const float* u = g + inter;
        bf16_t* y = act + r * inter;
        if (vec) {
            for (int c = threadIdx.x * 4; c < inter; c += blockDim.x * 4) {
                float4 a = *reinterpret_cast<const float4*>(g + c), b = *reinterpret_cast<const float4*>(u + c);
                *reinterpret_cast<uint2*>(y + c) =
                    make_uint2((u32)f_to_bf16(swiglu_(a.x, b.x, limit)) | ((u32)f_to_bf16(swiglu_(a.y, b.y, limit)) << 16),
                               (u32)f_to_bf16(swiglu_(a.z, b.z, limit)) | ((u32)f_to_bf16(swiglu_(a.w, b.w, limit)) << 16));
            }
        } else {
            for (int c = threadIdx.x; c < inter; c += blockDim.x) y[c] = f_to_bf16(swiglu_(g[c], u[c], limit));
        }
    }
}

// y[pick] = yp[e, t] for the t-th pick of expert e. grid (E, rows).
extern "C" __global__ void k_moe_scatter_padded(const float* yp, const int* list, const int* count, float* y,
                                                int rows, int H) {
    pdl_enter();
    int e = blockIdx.x, t = blockIdx.y;
    if (t >= count[e]) return;
    const float* src = yp + ((i64)e * rows + t) * H;
    float* dst = y + (i64)list[(i64)e * rows + t] * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) dst[c] = src[c];
}

// One block per row: out = sum over picks in ascending expert id of w * y, plus shared.
// grid (rows, ceil(H / COMBINE_COLS)): each block a slice of one row's channels, so a small
// batch still spreads over the device; four channels a thread (16-byte accesses where H
// and the buffers allow).
#define COMBINE_COLS 1024
// `pos` (may be null): the row of y that holds pick a is pos[a] (the prefill's expert GEMMs
// leave their outputs sorted by expert), else a.
extern "C" __global__ void k_moe_combine(const float* y, const int* pos, const int* ids, const float* wts,
                                         const float* shared, float* out, int H, int k) {
    pdl_enter();
    // Picks in ascending (expert id, pick) order, like the CPU's per-expert loop: thread j
    // places pick j at its rank among the row's keys (distinct: id * k + j).
    __shared__ float weight[64];
    __shared__ i64 src[64];
    int r = blockIdx.x, j = threadIdx.x;
    auto key_of = [&](int q) { return (i64)ids[(i64)r * k + q] * k + q; };
    if (j < k) {
        i64 key = key_of(j);
        int rank = 0;
        for (int q = 0; q < k; q++) rank += key_of(q) < key;
        i64 a = (i64)r * k + j;
        weight[rank] = wts[a];
        src[rank] = (pos ? (i64)pos[a] : a) * H;
    }
    __syncthreads();
    int c0 = blockIdx.y * COMBINE_COLS, end = min(H, c0 + COMBINE_COLS);
    const float* sh = shared + (i64)r * H;
    float* o = out + (i64)r * H;
    if (vec4_rows(H, y, shared, out)) {
        for (int c = c0 + threadIdx.x * 4; c < end; c += blockDim.x * 4) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int n = 0; n < k; n++) {
                float4 v = *reinterpret_cast<const float4*>(y + src[n] + c);
                float w = weight[n];
                acc.x += v.x * w;
                acc.y += v.y * w;
                acc.z += v.z * w;
                acc.w += v.w * w;
            }
            float4 sv = *reinterpret_cast<const float4*>(sh + c);
            *reinterpret_cast<float4*>(o + c) = make_float4(acc.x + sv.x, acc.y + sv.y, acc.z + sv.z, acc.w + sv.w);
        }
        return;
    }
    for (int c = c0 + threadIdx.x; c < end; c += blockDim.x) {
        float acc = 0.f;
        for (int n = 0; n < k; n++) acc += y[src[n] + c] * weight[n];
        o[c] = acc + sh[c];
    }
}
