// Lightning indexer: score = sum_h (w_h * n_heads^-0.5) * relu(q_h . k) * head_dim^-0.5 over
// every visible index-K entry, then the top `topk` entries per row (ties: lower index),
// written ascending with -1 padding.

// grid (rows, ceil(max_nv / warps)); one warp per entry. scores: [rows, max_nv].
extern "C" __global__ void k_index_scores(const unsigned char* pages, i64 page_bytes, const int* seq, const u32* pt,
                                          const int* row_seq, const int* positions, const float* q, const float* wts,
                                          float* scores, int max_nv, int n_heads, int ihd, int rate, i64 entry_off,
                                          int entries_per_page, int page_tokens, int dt, float softmax_scale,
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
    float total = 0.f;
    for (int h = 0; h < n_heads; h++) {
        float d = 0.f;
        for (int c = lane; c < ihd; c += 32) d += qr[h * ihd + c] * ld_entry(k, c, dt);
        d = warp_sum(d);
        total += fmaxf(d, 0.f) * softmax_scale * (wts[(i64)r * n_heads + h] * weight_scale);
    }
    if (lane == 0) scores[(i64)r * max_nv + s] = total;
}

// One block per row. flags: [rows, max_nv] scratch. sel: [rows, topk].
extern "C" __global__ void k_topk(const float* scores, const int* positions, unsigned char* flags, int* sel,
                                  int max_nv, int topk, int rate) {
    int r = blockIdx.x;
    int nv = (positions[r] + 1) / rate;
    int* out = sel + (i64)r * topk;
    if (nv <= topk) {
        for (int j = threadIdx.x; j < topk; j += blockDim.x) out[j] = j < nv ? j : -1;
        return;
    }
    const float* sc = scores + (i64)r * max_nv;
    unsigned char* fl = flags + (i64)r * max_nv;
    for (int s = threadIdx.x; s < nv; s += blockDim.x) {
        float v = sc[s];
        int rank = 0;
        for (int j = 0; j < nv && rank < topk; j++) {
            float u = sc[j];
            rank += (u > v) || (u == v && j < s);
        }
        fl[s] = rank < topk;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = 0;
        for (int s = 0; s < nv && n < topk; s++)
            if (fl[s]) out[n++] = s;
        for (; n < topk; n++) out[n] = -1;
    }
}
