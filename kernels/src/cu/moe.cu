// MoE: routing (scores, top-k or hash table), routed experts over bf16 weights with fp32
// accumulation, weighted combine in expert order plus the shared expert.

// One thread per row. logits [rows, E] become scores in place. scoring: 0 sqrt(softplus),
// 1 sigmoid, 2 softmax. bias / hash may be null.
extern "C" __global__ void k_moe_route(float* logits, const float* bias, const u32* hash, int* ids, float* wts,
                                       int rows, int E, int k, int scoring, float routed_scaling) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float* s = logits + (i64)r * E;
    if (scoring == 0) {
        for (int i = 0; i < E; i++) {
            float x = s[i];
            s[i] = sqrtf(x > 20.f ? x : log1pf(expf(x)));
        }
    } else if (scoring == 1) {
        for (int i = 0; i < E; i++) s[i] = sigmoidf_(s[i]);
    } else {
        float m = NEG_INF, t = 0.f;
        for (int i = 0; i < E; i++) m = fmaxf(m, s[i]);
        for (int i = 0; i < E; i++) { s[i] = expf(s[i] - m); t += s[i]; }
        for (int i = 0; i < E; i++) s[i] /= t;
    }
    int* id = ids + (i64)r * k;
    for (int j = 0; j < k; j++) {
        if (hash) { id[j] = (int)hash[(i64)r * k + j]; continue; }
        int best = -1;
        float bv = NEG_INF;
        for (int i = 0; i < E; i++) {
            bool taken = false;
            for (int t = 0; t < j; t++) taken |= id[t] == i;
            if (taken) continue;
            float v = s[i] + (bias ? bias[i] : 0.f);
            if (best < 0 || v > bv) { best = i; bv = v; }
        }
        id[j] = best;
    }
    float sum = 0.f;
    for (int j = 0; j < k; j++) sum += s[id[j]];
    sum += 1e-20f;
    for (int j = 0; j < k; j++) wts[(i64)r * k + j] = s[id[j]] / sum * routed_scaling;
}

__device__ __forceinline__ float ldw(const bf16_t* p, i64 i) { return bf16_to_f(p[i]); }
__device__ __forceinline__ float ldw(const float* p, i64 i) { return p[i]; }

// grid (rows*k, ceil(I / warps)); one warp per intermediate unit: gate and up dot products,
// clamped SwiGLU. gu: [E*2I, H].
template <typename W>
__device__ void moe_gate_up(const float* x, const W* gu, const int* ids, float* act, int H, int I, int k,
                            float limit) {
    int a = blockIdx.x, lane = threadIdx.x & 31;
    int i = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= I) return;
    i64 e = ids[a];
    const float* xr = x + (i64)(a / k) * H;
    const W* g = gu + (e * 2 * I + i) * H;
    const W* u = gu + (e * 2 * I + I + i) * H;
    float dg = 0.f, du = 0.f;
    for (int c = lane; c < H; c += 32) {
        dg += xr[c] * ldw(g, c);
        du += xr[c] * ldw(u, c);
    }
    dg = warp_sum(dg);
    du = warp_sum(du);
    if (lane == 0) act[(i64)a * I + i] = swiglu_(dg, du, limit);
}

extern "C" __global__ void k_moe_gate_up_bf16(const float* x, const bf16_t* gu, const int* ids, float* act, int H,
                                              int I, int k, float limit) {
    moe_gate_up(x, gu, ids, act, H, I, k, limit);
}

extern "C" __global__ void k_moe_gate_up_f32(const float* x, const float* gu, const int* ids, float* act, int H,
                                             int I, int k, float limit) {
    moe_gate_up(x, gu, ids, act, H, I, k, limit);
}

// grid (rows*k, ceil(H / warps)); down: [E*H, I].
template <typename W>
__device__ void moe_down(const float* act, const W* down, const int* ids, float* y, int H, int I) {
    int a = blockIdx.x, lane = threadIdx.x & 31;
    int hh = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (hh >= H) return;
    i64 e = ids[a];
    const float* ar = act + (i64)a * I;
    const W* w = down + (e * H + hh) * I;
    float d = 0.f;
    for (int c = lane; c < I; c += 32) d += ar[c] * ldw(w, c);
    d = warp_sum(d);
    if (lane == 0) y[(i64)a * H + hh] = d;
}

extern "C" __global__ void k_moe_down_bf16(const float* act, const bf16_t* down, const int* ids, float* y, int H,
                                           int I) {
    moe_down(act, down, ids, y, H, I);
}

extern "C" __global__ void k_moe_down_f32(const float* act, const float* down, const int* ids, float* y, int H,
                                          int I) {
    moe_down(act, down, ids, y, H, I);
}

// One block per row: out = sum over picks in ascending expert id of w * y, plus shared.
extern "C" __global__ void k_moe_combine(const float* y, const int* ids, const float* wts, const float* shared,
                                         float* out, int H, int k) {
    int r = blockIdx.x;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.f;
        // picks in ascending (expert id, pick) order, like the CPU's per-expert loop
        i64 last = -1;
        for (int n = 0; n < k; n++) {
            int bj = -1;
            i64 bkey = 0;
            for (int j = 0; j < k; j++) {
                i64 key = (i64)ids[(i64)r * k + j] * k + j;
                if (key > last && (bj < 0 || key < bkey)) { bj = j; bkey = key; }
            }
            last = bkey;
            acc += y[((i64)r * k + bj) * H + c] * wts[(i64)r * k + bj];
        }
        out[(i64)r * H + c] = acc + shared[(i64)r * H + c];
    }
}
