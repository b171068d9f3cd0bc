// Sink attention: every row attends over its sliding window (earlier positions from the
// state ring, this forward's from kv_new rounded through the KV dtype) and its compressed
// entries (mode 0: none, 1: every visible entry, 2: the indexer's picks). K = V.
// grid (rows, n_heads); dynamic shared memory: max_keys + warps * hd floats (scores, then
// the warps' partial outputs). hd: a multiple of 32, at most 32 * ATT_MAXQ.
#define ATT_MAXQ 16
extern "C" __global__ void k_attention(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                       i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                       const int* positions, const float* q, const float* kv_new, const float* sinks,
                                       const int* sel, int topk, float* out, int n_heads, int hd, int window,
                                       i64 win_off, int rate, int mode, i64 comp_off, int comp_epp, int page_tokens,
                                       int dt, float scale, int max_keys) {
    extern __shared__ float lg[];
    __shared__ float red[32];
    __shared__ int nsel;
    int r = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int* sq = seq + row_seq[r] * SEQ_INTS;
    int start = sq[SEQ_START], row0 = sq[SEQ_ROW0];
    const unsigned char* st = states + (i64)sq[SEQ_STATE] * state_bytes + win_off;
    const u32* table = pt + sq[SEQ_PT];
    int pos = positions[r];
    int lo = pos + 1 - window;
    if (lo < 0) lo = 0;
    int nwin = pos - lo + 1;
    if (threadIdx.x == 0) {
        int n = 0;
        if (mode == 1) n = (pos + 1) / rate;
        if (mode == 2)
            for (int j = 0; j < topk; j++) n += sel[(i64)r * topk + j] >= 0;
        nsel = n;
    }
    __syncthreads();
    int nk = nwin + nsel;
    int eb = dt_bytes(dt);
    const float* qh = q + ((i64)r * n_heads + h) * hd;
    // Key j: window position lo+j (earlier ones from the ring, this forward's from kv_new,
    // rounded through the KV dtype), then compressed entries. Addressed once per key.
#define KEY_PTR(j, ptr, fresh)                                                                     \
    {                                                                                              \
        int j_ = (j);                                                                              \
        fresh = false;                                                                             \
        if (j_ < nwin) {                                                                           \
            int kp = lo + j_;                                                                      \
            if (kp < start) ptr = st + (i64)(kp % window) * hd * eb;                               \
            else {                                                                                 \
                ptr = (const unsigned char*)(kv_new + (i64)(row0 + kp - start) * hd);              \
                fresh = true;                                                                      \
            }                                                                                      \
        } else {                                                                                   \
            int e = mode == 1 ? j_ - nwin : sel[(i64)r * topk + (j_ - nwin)];                      \
            u32 pg = table[(e * rate) / page_tokens];                                              \
            ptr = pages + (i64)pg * page_bytes + comp_off + (i64)(e % comp_epp) * hd * eb;         \
        }                                                                                          \
    }
#define KEY_VAL(ptr, fresh, c) ((fresh) ? round_dt(((const float*)(ptr))[c], dt) : ld_entry((ptr), (c), dt))
    // Scores: one warp per key; lane holds channels lane + 32*q of the query in registers.
    int nq = hd >> 5;
    float qv[ATT_MAXQ];
#pragma unroll
    for (int q = 0; q < ATT_MAXQ; q++) qv[q] = q < nq ? qh[lane + 32 * q] : 0.f;
    for (int j = warp; j < nk; j += nw) {
        float d = 0.f;
        const unsigned char* kptr;
        bool fresh;
        KEY_PTR(j, kptr, fresh);
#pragma unroll
        for (int q = 0; q < ATT_MAXQ; q++)
            if (q < nq) d += qv[q] * KEY_VAL(kptr, fresh, lane + 32 * q);
        d = warp_sum(d);
        if (lane == 0) lg[j] = d * scale;
    }
    __syncthreads();
    float sink = sinks[h];
    float m = sink;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) m = fmaxf(m, lg[j]);
    m = block_max(m, red);
    float s = 0.f;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        float e = expf(lg[j] - m);
        lg[j] = e;
        s += e;
    }
    s = block_sum(s, red) + expf(sink - m);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) lg[j] = lg[j] / s;
    __syncthreads();
    // Output: warp w sums keys w, w + nw, ... over all channels (lane: channels lane + 32*q),
    // then the warps' partial sums are added in warp order.
    float acc[ATT_MAXQ];
#pragma unroll
    for (int q = 0; q < ATT_MAXQ; q++) acc[q] = 0.f;
    for (int j = warp; j < nk; j += nw) {
        float p = lg[j];
        const unsigned char* kptr;
        bool fresh;
        KEY_PTR(j, kptr, fresh);
#pragma unroll
        for (int q = 0; q < ATT_MAXQ; q++)
            if (q < nq) acc[q] += p * KEY_VAL(kptr, fresh, lane + 32 * q);
    }
    float* part = lg + max_keys;
#pragma unroll
    for (int q = 0; q < ATT_MAXQ; q++)
        if (q < nq) part[warp * hd + lane + 32 * q] = acc[q];
    __syncthreads();
    float* o = out + ((i64)r * n_heads + h) * hd;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float v = 0.f;
        for (int w = 0; w < nw; w++) v += part[w * hd + c];
        o[c] = v;
    }
#undef KEY_PTR
#undef KEY_VAL
}

// Store rows into the sliding-window rings: only each sequence's last `window` positions.
extern "C" __global__ void k_window_store(unsigned char* states, i64 state_bytes, const int* seq, const int* row_seq,
                                          const int* positions, const float* kv_new, int hd, int window, i64 win_off,
                                          int dt) {
    int r = blockIdx.x;
    const int* sq = seq + row_seq[r] * SEQ_INTS;
    int end = sq[SEQ_START] + sq[SEQ_LEN];
    int pos = positions[r];
    if (pos + window < end) return;
    unsigned char* dst = states + (i64)sq[SEQ_STATE] * state_bytes + win_off + (i64)(pos % window) * hd * dt_bytes(dt);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) st_entry(dst, c, dt, kv_new[(i64)r * hd + c]);
}
