// Lightning indexer: score = sum_h (w_h * n_heads^-0.5) * relu(q_h . k) * head_dim^-0.5 over
// every visible index-K entry, then the top `topk` entries per row (ties: lower index),
// written ascending with -1 padding.

// grid (rows, ceil(max_nv / warps)); one warp per entry. scores: [rows, max_nv].
extern "C" __global__ void k_index_scores(const unsigned char* pages, i64 page_bytes, const int* seq, const u32* pt,
                                          const int* row_seq, const int* positions, const float* q, const float* wts,
                                          float* scores, int max_nv, int n_heads, int ihd, int rate, i64 entry_off,
                                          i64 scale_off, int entries_per_page, int page_tokens, int dt, float softmax_scale,
                                          float weight_scale) {
    int r = blockIdx.x;
    int lane = threadIdx.x & 31;
    int s = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (s >= max_nv) return;
    int nv = (positions[r] + 1) / rate;
    if (s >= nv) {
        if (lane == 0) scores[(i64)r * max_nv + s] = NEG_INF;
        return;
    }
    const int* sq = seq + row_seq[r] * SEQ_INTS;
    u32 page = pt[sq[SEQ_PT] + (i64)s * rate / page_tokens];
    const unsigned char* k = pages + (i64)page * page_bytes + entry_off + (i64)(s % entries_per_page) * ihd * dt_bytes(dt);
    const float* qr = q + (i64)r * n_heads * ihd;
    float sc = dt == 2 ? *(const float*)(pages + (i64)page * page_bytes + scale_off + (i64)(s % entries_per_page) * 4) : 1.f;
    float total = 0.f;
    for (int h = 0; h < n_heads; h++) {
        float d = 0.f;
        for (int c = lane; c < ihd; c += 32)
            d += qr[h * ihd + c] * (dt == 2 ? e4m3_to_f(k[c]) * sc : ld_entry(k, c, dt));
        d = warp_sum(d);
        total += fmaxf(d, 0.f) * softmax_scale * (wts[(i64)r * n_heads + h] * weight_scale);
    }
    if (lane == 0) scores[(i64)r * max_nv + s] = total;
}

// The same scores on tensor cores for bf16 index-K entries (decode steps and short
// forwards under bf16 weights): per row, S[entries x heads] = K Q^T as bf16 mma.sync with
// fp32 accumulators (the queries rounded to bf16; the entries are bf16 already), then
// relu, head weights and the sum over heads in registers. grid (rows, ceil(max_nv /
// IXM_E)), 8 warps: warp w takes entries 16 w .. +16 of the block's IXM_E against every
// head (heads past n_heads: zero queries). Requires n_heads <= IXM_H, ihd a multiple of 16
// up to IXM_MAXD, 16-byte aligned entry rows. Dynamic shared memory (IxmPlan::shared_bytes,
// ops/indexer.rs): queries [IXM_H][ihd + 8] then entries [IXM_E][ihd + 8], bf16.
#define IXM_H 64
#define IXM_E 128
#define IXM_MAXD 256
extern "C" __global__ void k_index_scores_mma(const unsigned char* pages, i64 page_bytes, const int* seq,
                                              const u32* pt, const int* row_seq, const int* positions, const float* q,
                                              const float* wts, float* scores, int max_nv, int n_heads, int ihd,
                                              int rate, i64 entry_off, int entries_per_page, int page_tokens,
                                              float softmax_scale, float weight_scale) {
    extern __shared__ __align__(16) unsigned char ixm_sh[];
    int ld = ihd + 8;
    bf16_t* qs = (bf16_t*)ixm_sh;   // [IXM_H][ld]
    bf16_t* ks = qs + IXM_H * ld;   // [IXM_E][ld]
    int r = blockIdx.x, e0 = blockIdx.y * IXM_E;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int nv = (positions[r] + 1) / rate;
    const int* sq = seq + row_seq[r] * SEQ_INTS;
    const float* qr = q + (i64)r * n_heads * ihd;
    for (int i = tid * 4; i < IXM_H * ihd; i += blockDim.x * 4) {
        int h = i / ihd, c = i - h * ihd;
        float4 v = h < n_heads ? *reinterpret_cast<const float4*>(qr + (i64)h * ihd + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<uint2*>(qs + h * ld + c) =
            make_uint2((u32)f_to_bf16(v.x) | ((u32)f_to_bf16(v.y) << 16), (u32)f_to_bf16(v.z) | ((u32)f_to_bf16(v.w) << 16));
    }
    int cpr = ihd >> 3;  // 16-byte chunks per entry
    for (int i = tid; i < IXM_E * cpr; i += blockDim.x) {
        int j = i / cpr, c8 = i - j * cpr, s = e0 + j;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (s < nv) {
            u32 page = pt[sq[SEQ_PT] + (i64)s * rate / page_tokens];
            const unsigned char* k = pages + (i64)page * page_bytes + entry_off + (i64)(s % entries_per_page) * ihd * 2;
            w = *reinterpret_cast<const uint4*>(k + c8 * 16);
        }
        *reinterpret_cast<uint4*>(ks + j * ld + c8 * 8) = w;
    }
    __syncthreads();
    int g = lane >> 2, t = lane & 3;
    float acc[IXM_H / 8][4];
#pragma unroll
    for (int n = 0; n < IXM_H / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.f;
    // A: entries 16 warp + (lane & 15), channel (lane >> 4) * 8; B: heads 16 p + (lane & 7)
    // + (lane >> 4) * 8, channel ((lane >> 3) & 1) * 8.
    u32 ka = tc_smem(ks + (warp * 16 + (lane & 15)) * ld + (lane >> 4) * 8);
    u32 qa = tc_smem(qs + ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8);
    for (int kk = 0; kk < ihd; kk += 16) {
        u32 a[4];
        tc_ldsm_x4(ka + kk * 2, a);
#pragma unroll
        for (int p = 0; p < IXM_H / 16; p++) {
            u32 b[4];
            tc_ldsm_x4(qa + (p * 16 * ld + kk) * 2, b);
            tc_mma(acc[2 * p], a, b[0], b[1]);
            tc_mma(acc[2 * p + 1], a, b[2], b[3]);
        }
    }
    // Entry g (acc[.][0..1]) and g + 8 (acc[.][2..3]) of the warp's 16, heads 8 n + 2 t + {0, 1}.
    const float* wr = wts + (i64)r * n_heads;
    float top = 0.f, bot = 0.f;
#pragma unroll
    for (int n = 0; n < IXM_H / 8; n++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int h = n * 8 + 2 * t + u;
            float w = h < n_heads ? softmax_scale * (wr[h] * weight_scale) : 0.f;
            top += fmaxf(acc[n][u], 0.f) * w;
            bot += fmaxf(acc[n][2 + u], 0.f) * w;
        }
    top += __shfl_xor_sync(0xffffffffu, top, 1);
    top += __shfl_xor_sync(0xffffffffu, top, 2);
    bot += __shfl_xor_sync(0xffffffffu, bot, 1);
    bot += __shfl_xor_sync(0xffffffffu, bot, 2);
    if (t == 0) {
        int s0 = e0 + warp * 16 + g, s1 = s0 + 8;
        if (s0 < max_nv) scores[(i64)r * max_nv + s0] = s0 < nv ? top : NEG_INF;
        if (s1 < max_nv) scores[(i64)r * max_nv + s1] = s1 < nv ? bot : NEG_INF;
    }
}

// The prefill path (many rows of one sequence): its visible index-K entries gathered once
// into a dense fp32 matrix, the per-head dot products as one cuBLAS fp32 GEMM per chunk of
// rows, then k_index_reduce. Same values as k_index_scores up to the dot products' order.

// Entries 0..nv of sequence `si`, dequantized to f32 as k_index_scores reads them, into
// out [nv, ihd]. One warp per entry.
extern "C" __global__ void k_gather_index_k(const unsigned char* pages, i64 page_bytes, const int* seq, const u32* pt,
                                            int si, int nv, int ihd, int rate, i64 entry_off, i64 scale_off,
                                            int entries_per_page, int page_tokens, int dt, void* out, int out_bf16) {
    int s = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (s >= nv) return;
    const int* sq = seq + si * SEQ_INTS;
    u32 page = pt[sq[SEQ_PT] + (i64)s * rate / page_tokens];
    const unsigned char* base = pages + (i64)page * page_bytes;
    const unsigned char* k = base + entry_off + (i64)(s % entries_per_page) * ihd * dt_bytes(dt);
    float sc = dt == 2 ? *(const float*)(base + scale_off + (i64)(s % entries_per_page) * 4) : 1.f;
    for (int c = lane; c < ihd; c += 32) {
        float v = dt == 2 ? e4m3_to_f(k[c]) * sc : ld_entry(k, c, dt);
        if (out_bf16) ((bf16_t*)out)[(i64)s * ihd + c] = f_to_bf16(v);
        else ((float*)out)[(i64)s * ihd + c] = v;
    }
}

// Scores of plan rows row0.. from d [(r * n_heads + h) * nvs + s] (the chunk's per-head dot
// products over the sequence's nvs gathered entries): the sum over heads, in head order, of
// relu(d) * softmax_scale * (w_h * weight_scale) as k_index_scores; -inf past a row's
// visible entries. grid (rows, ceil(max_nv / blockDim.x)).
extern "C" __global__ void k_index_reduce(const float* d, int nvs, const int* positions, const float* wts,
                                          float* scores, int row0, int max_nv, int n_heads, int rate,
                                          float softmax_scale, float weight_scale) {
    int s = blockIdx.y * blockDim.x + threadIdx.x;
    if (s >= max_nv) return;
    int row = row0 + blockIdx.x;
    int nv = (positions[row] + 1) / rate;
    float total = NEG_INF;
    if (s < nv && s < nvs) {
        total = 0.f;
        const float* dr = d + (i64)blockIdx.x * n_heads * nvs + s;
        const float* w = wts + (i64)row * n_heads;
        for (int h = 0; h < n_heads; h++) total += fmaxf(dr[(i64)h * nvs], 0.f) * softmax_scale * (w[h] * weight_scale);
    }
    scores[(i64)row * max_nv + s] = total;
}

// Float order as unsigned order (larger float, larger key).
__device__ __forceinline__ u32 order_key(float v) {
    u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row: the `topk` highest scores of the row's `nv` entries (ties: lower
// index), written ascending, -1 padded. Radix select finds the topk-th largest key in four
// 8-bit passes; then each thread compacts a contiguous chunk. sel: [rows, topk].
extern "C" __global__ void k_topk(const float* scores, const int* positions, int* sel, int max_nv, int topk,
                                  int rate) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_mask;
    __shared__ int s_remaining;
    __shared__ int chunk_gt[256], chunk_eq[256];
    int r = blockIdx.x;
    int nv = (positions[r] + 1) / rate;
    int* out = sel + (i64)r * topk;
    if (nv <= topk) {
        for (int j = threadIdx.x; j < topk; j += blockDim.x) out[j] = j < nv ? j : -1;
        return;
    }
    const float* sc = scores + (i64)r * max_nv;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_remaining = topk;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        u32 prefix = s_prefix, mask = s_mask;
        for (int j = threadIdx.x; j < nv; j += blockDim.x) {
            u32 key = order_key(sc[j]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int want = s_remaining;
            int above = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (above + (int)hist[b] >= want) break;
                above += hist[b];
            }
            s_remaining = want - above;
            s_prefix = prefix | ((u32)b << shift);
            s_mask = mask | (255u << shift);
        }
        __syncthreads();
    }
    // Keys above the threshold are all taken; of those equal to it, the first `take`.
    u32 thr = s_prefix;
    int take = s_remaining;
    int per = (nv + blockDim.x - 1) / blockDim.x;
    int lo = threadIdx.x * per, hi = min(nv, lo + per);
    int gt = 0, eq = 0;
    for (int j = lo; j < hi; j++) {
        u32 key = order_key(sc[j]);
        gt += key > thr;
        eq += key == thr;
    }
    chunk_gt[threadIdx.x] = gt;
    chunk_eq[threadIdx.x] = eq;
    __syncthreads();
    if (threadIdx.x == 0) {
        // Exclusive scans: chunk_gt becomes the output position, chunk_eq the equal keys before.
        int pos = 0, eqs = 0;
        for (int t = 0; t < (int)blockDim.x; t++) {
            int g = chunk_gt[t], e = chunk_eq[t];
            int e_taken = max(0, min(e, take - eqs));
            chunk_gt[t] = pos;
            chunk_eq[t] = eqs;
            pos += g + e_taken;
            eqs += e;
        }
    }
    __syncthreads();
    int pos = chunk_gt[threadIdx.x], eqs = chunk_eq[threadIdx.x];
    for (int j = lo; j < hi; j++) {
        u32 key = order_key(sc[j]);
        if (key > thr || (key == thr && eqs++ < take)) out[pos++] = j;
    }
}
