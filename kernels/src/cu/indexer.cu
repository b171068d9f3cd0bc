// Lightning indexer: score = sum_h (w_h * n_heads^-0.5) * relu(q_h . k) * head_dim^-0.5 over
// every visible index-K entry, then the top `topk` entries per row (ties: lower index),
// written ascending with -1 padding.

// grid (rows, ceil(max_nv / warps)); one warp per entry. scores: [rows, max_nv].
extern "C" __global__ void k_index_scores(const unsigned char* pages, i64 page_bytes, const int* seq, const u32* pt,
                                          const int* row_seq, const int* positions, const float* q, const float* wts,
                                          float* scores, int max_nv, int n_heads, int ihd, int rate, i64 entry_off,
                                          i64 scale_off, int entries_per_page, int page_tokens, int dt, float softmax_scale,
                                          float weight_scale) {
    pdl_enter();
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

// The same scores on tensor cores for bf16 index-K entries (under bf16 weights): per row,
// S[entries x heads] = K Q^T as bf16 mma.sync with fp32 accumulators (the queries rounded
// to bf16; the entries are bf16 already), then relu, head weights and the sum over heads
// in registers. grid (ceil(rows / rows_per_block), ceil(max_nv / (IXM_E * tiles))): a
// block takes `rows_per_block` (1 or 2) consecutive rows and `tiles` consecutive tiles of
// IXM_E entries. Two rows of one sequence share each entry tile (loaded once, by cp.async,
// the next tile's loads in flight while the current one is multiplied); rows of different
// sequences take their turns. Tiles past every row's visible entries (the causal mask) are
// written -inf without any product, so a prefill pays for the visible triangle only. 8
// warps: warp w takes entries 16 w .. +16 of each tile against every head (heads past
// n_heads: zero queries). Each (row, entry)'s products and sums are the same whatever the
// blocking, so every launch shape gives the same bits. Requires n_heads <= IXM_H, ihd a
// power of two from 16 to IXM_MAXD, 16-byte aligned entry rows, entries_per_page entries
// of `rate` positions filling a page. Dynamic shared memory
// (mma_shared_bytes, ops/indexer.rs): queries [2][IXM_H][ihd + 8] then entries
// [2 stages][IXM_E][ihd + 8], bf16, then the rows' head weights [2][IXM_H], f32.
#define IXM_H 64
#define IXM_E 128
#define IXM_MAXD 256

struct IxmArgs {
    const unsigned char* pages;
    i64 page_bytes;
    const u32* pt;  // the sequence's page table
    const int* positions;
    const float* q;
    const float* wts;
    float* scores;
    int max_nv, n_heads, ihd, rate;
    i64 entry_off;
    int entries_per_page, page_tokens;
    float softmax_scale, weight_scale;
};

__device__ __forceinline__ int ixm_visible(const IxmArgs& a, int r) { return (a.positions[r] + 1) / a.rate; }

// -inf for row r's entries [from, to).
__device__ __forceinline__ void ixm_fill_invisible(const IxmArgs& a, int r, int from, int to) {
    for (int s = from + (int)threadIdx.x; s < to; s += blockDim.x) a.scores[(i64)r * a.max_nv + s] = NEG_INF;
}

// Entries e0 .. e0 + IXM_E into `ks` (zeros from nv on): cp.async, not waited for. A
// thread keeps one 16-byte column of its entries (ihd / 8 columns, a power of two that
// divides blockDim.x) and steps through the entries and their pages incrementally: no
// division per copy.
__device__ __forceinline__ void ixm_load_tile(const IxmArgs& a, bf16_t* ks, int e0, int nv) {
    int ld = a.ihd + 8, cpr = a.ihd >> 3;
    int c8 = threadIdx.x & (cpr - 1), step = blockDim.x / cpr, j = threadIdx.x / cpr;
    int s = e0 + j, epp = a.entries_per_page;
    int pi = s / epp, off = s - pi * epp;
    for (; j < IXM_E; j += step, s += step) {
        bf16_t* dst = ks + j * ld + c8 * 8;
        if (s < nv) {
            tc_cp16(dst, a.pages + (i64)a.pt[pi] * a.page_bytes + a.entry_off + (i64)off * a.ihd * 2 + c8 * 16);
        } else {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
        for (off += step; off >= epp; off -= epp) pi++;
    }
}

// Rows rows[0 .. n) (one sequence; n is 1 or 2) over the block's entries [e_begin, e_end).
// ws: each row's head weights, softmax_scale * (w_h * weight_scale), 0 past n_heads.
__device__ void ixm_rows(const IxmArgs& a, const int (&rows)[2], int n, int e_begin, int e_end, bf16_t* qs,
                         bf16_t* ks, float* ws) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int ld = a.ihd + 8;
    int nv[2] = {ixm_visible(a, rows[0]), n > 1 ? ixm_visible(a, rows[1]) : 0};
    int nv_max = max(nv[0], nv[1]);
    int vis_end = min(e_end, nv_max);  // from here on -inf for every row
    int n_tiles = vis_end > e_begin ? (vis_end - e_begin + IXM_E - 1) / IXM_E : 0;
    if (n_tiles > 0) {
        __syncthreads();  // the last turn's readers are done with qs and ks
        // Each thread one 4-channel column of its heads (ihd / 4 columns divide blockDim.x).
        int c4 = a.ihd >> 2, c = (tid & (c4 - 1)) * 4;
        for (int j = 0; j < n; j++) {
            const float* qr = a.q + (i64)rows[j] * a.n_heads * a.ihd;
            bf16_t* qj = qs + j * IXM_H * ld;
            for (int h = tid / c4; h < IXM_H; h += blockDim.x / c4) {
                float4 v = h < a.n_heads ? *reinterpret_cast<const float4*>(qr + (i64)h * a.ihd + c)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
                *reinterpret_cast<uint2*>(qj + h * ld + c) = make_uint2(
                    (u32)f_to_bf16(v.x) | ((u32)f_to_bf16(v.y) << 16), (u32)f_to_bf16(v.z) | ((u32)f_to_bf16(v.w) << 16));
            }
            for (int h = tid; h < IXM_H; h += blockDim.x)
                ws[j * IXM_H + h] = h < a.n_heads ? a.softmax_scale * (a.wts[(i64)rows[j] * a.n_heads + h] * a.weight_scale) : 0.f;
        }
        ixm_load_tile(a, ks, e_begin, nv_max);
        tc_commit();
    }
    int g = lane >> 2, t = lane & 3;
    for (int tile = 0; tile < n_tiles; tile++) {
        int e0 = e_begin + tile * IXM_E;
        bf16_t* kt = ks + (tile & 1) * IXM_E * ld;
        if (tile + 1 < n_tiles) ixm_load_tile(a, ks + ((tile + 1) & 1) * IXM_E * ld, e0 + IXM_E, nv_max);
        tc_commit();
        tc_wait_prev();  // this tile's group has landed (the next one may be in flight)
        __syncthreads();
        float acc[2][IXM_H / 8][4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int m = 0; m < IXM_H / 8; m++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][m][e] = 0.f;
        // A: entries 16 warp + (lane & 15), channel (lane >> 4) * 8; B: heads 16 p + (lane & 7)
        // + (lane >> 4) * 8, channel ((lane >> 3) & 1) * 8.
        u32 ka = tc_smem(kt + (warp * 16 + (lane & 15)) * ld + (lane >> 4) * 8);
        u32 qa = tc_smem(qs + ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8);
        for (int kk = 0; kk < a.ihd; kk += 16) {
            u32 af[4];
            tc_ldsm_x4(ka + kk * 2, af);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                if (j >= n) break;
#pragma unroll
                for (int p = 0; p < IXM_H / 16; p++) {
                    u32 b[4];
                    tc_ldsm_x4(qa + ((j * IXM_H + p * 16) * ld + kk) * 2, b);
                    tc_mma(acc[j][2 * p], af, b[0], b[1]);
                    tc_mma(acc[j][2 * p + 1], af, b[2], b[3]);
                }
            }
        }
        // Entry g (acc[.][.][0..1]) and g + 8 (acc[.][.][2..3]) of the warp's 16, heads
        // 8 m + 2 t + {0, 1}.
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (j >= n) break;
            const float* wr = ws + j * IXM_H;
            float top = 0.f, bot = 0.f;
#pragma unroll
            for (int m = 0; m < IXM_H / 8; m++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    float w = wr[m * 8 + 2 * t + u];
                    top += fmaxf(acc[j][m][u], 0.f) * w;
                    bot += fmaxf(acc[j][m][2 + u], 0.f) * w;
                }
            top += __shfl_xor_sync(0xffffffffu, top, 1);
            top += __shfl_xor_sync(0xffffffffu, top, 2);
            bot += __shfl_xor_sync(0xffffffffu, bot, 1);
            bot += __shfl_xor_sync(0xffffffffu, bot, 2);
            if (t == 0) {
                int s0 = e0 + warp * 16 + g, s1 = s0 + 8;
                float* sr = a.scores + (i64)rows[j] * a.max_nv;
                if (s0 < a.max_nv) sr[s0] = s0 < nv[j] ? top : NEG_INF;
                if (s1 < a.max_nv) sr[s1] = s1 < nv[j] ? bot : NEG_INF;
            }
        }
        __syncthreads();  // every warp is done with this stage before tile + 2 loads into it
    }
    for (int j = 0; j < n; j++) ixm_fill_invisible(a, rows[j], e_begin + n_tiles * IXM_E, e_end);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_index_scores_mma(const unsigned char* pages, i64 page_bytes, const int* seq,
                                              const u32* pt, const int* row_seq, const int* positions, const float* q,
                                              const float* wts, float* scores, int max_nv, int n_heads, int ihd,
                                              int rate, i64 entry_off, int entries_per_page, int page_tokens,
                                              float softmax_scale, float weight_scale, int rows, int rows_per_block,
                                              int tiles) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char ixm_sh[];
    int ld = ihd + 8;
    bf16_t* qs = (bf16_t*)ixm_sh;     // [2][IXM_H][ld]
    bf16_t* ks = qs + 2 * IXM_H * ld;  // [2][IXM_E][ld]
    float* ws = (float*)(ks + 2 * IXM_E * ld);  // [2][IXM_H]
    int r0 = blockIdx.x * rows_per_block;
    int r1 = rows_per_block > 1 && r0 + 1 < rows ? r0 + 1 : -1;
    int e_begin = blockIdx.y * IXM_E * tiles;
    int e_end = min(e_begin + IXM_E * tiles, max_nv);
    IxmArgs a{pages, page_bytes, pt + seq[row_seq[r0] * SEQ_INTS + SEQ_PT], positions, q, wts, scores,
              max_nv, n_heads, ihd, rate, entry_off, entries_per_page, page_tokens, softmax_scale,
              weight_scale};
    if (r1 >= 0 && row_seq[r1] == row_seq[r0]) {
        const int both[2] = {r0, r1};
        ixm_rows(a, both, 2, e_begin, e_end, qs, ks, ws);
        return;
    }
    const int first[2] = {r0, r0};
    ixm_rows(a, first, 1, e_begin, e_end, qs, ks, ws);
    if (r1 >= 0) {
        const int second[2] = {r1, r1};
        a.pt = pt + seq[row_seq[r1] * SEQ_INTS + SEQ_PT];
        ixm_rows(a, second, 1, e_begin, e_end, qs, ks, ws);
    }
}

// The prefill path where k_index_scores_mma does not take the layer (the fp32 reference
// mode, fp32 or fp8 index-K, other dims): its visible index-K entries gathered once into a
// dense matrix, the per-head dot products as one cuBLAS GEMM per chunk of rows, then
// k_index_reduce. Same values as k_index_scores up to the dot products' order.

// Entries 0..nv of sequence `si`, dequantized to f32 as k_index_scores reads them, into
// out [nv, ihd]. One warp per entry.
extern "C" __global__ void k_gather_index_k(const unsigned char* pages, i64 page_bytes, const int* seq, const u32* pt,
                                            int si, int nv, int ihd, int rate, i64 entry_off, i64 scale_off,
                                            int entries_per_page, int page_tokens, int dt, void* out, int out_bf16) {
    pdl_enter();
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
    pdl_enter();
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
    pdl_enter();
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
