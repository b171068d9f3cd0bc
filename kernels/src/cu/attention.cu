// Sink attention: every row attends over its sliding window (earlier positions from the
// state ring, this forward's from kv_new rounded through the KV dtype) and its compressed
// entries (mode 0: none, 1: every visible entry, 2: the indexer's picks). K = V.
// grid (rows, n_heads / G): one block per row and group of G heads (K = V is shared by all
// heads, so each key is read once per group). Dynamic shared memory:
// G * hd floats (queries) + G * max_keys floats (scores) + max_keys key addresses.
// hd: a multiple of 32, at most 32 * ATT_MAXQ; G at most ATT_G.
#define ATT_MAXQ 16
#define ATT_G 4
extern "C" __global__ void k_attention(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                       i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                       const int* positions, const float* q, const float* kv_new, const float* sinks,
                                       const int* sel, int topk, float* out, int n_heads, int hd, int window,
                                       i64 win_off, int rate, int mode, i64 comp_off, int comp_epp, int page_tokens,
                                       int dt, float scale, int max_keys, int G, int rd, i64 win_scale_off,
                                       i64 comp_scale_off) {
    pdl_enter();
    extern __shared__ float smem[];
    float* qs = smem;                       // [G][hd]
    float* lg = qs + G * hd;                // [G][max_keys]
    unsigned long long* kaddr = (unsigned long long*)(lg + G * max_keys + ((G * (hd + max_keys)) & 1));
    // fp8 entries (dt 3): each key's scale bytes, after the key addresses.
    unsigned long long* saddr = kaddr + max_keys;
    __shared__ float red[32];
    __shared__ int nsel;
    int r = blockIdx.x, h0 = blockIdx.y * G;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int* sq = seq + row_seq[r] * SEQ_INTS;
    int start = sq[SEQ_START], row0 = sq[SEQ_ROW0];
    const unsigned char* st = states + (i64)sq[SEQ_STATE] * state_bytes + win_off;
    const unsigned char* st_sc = states + (i64)sq[SEQ_STATE] * state_bytes + win_scale_off;
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
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = q[((i64)r * n_heads + h0) * hd + i];
    __syncthreads();
    int nk = nwin + nsel;
    int nope = hd - rd;
    i64 eb = dt == 3 ? fp8kv_row_bytes(nope, rd) : (i64)hd * dt_bytes(dt);
    i64 sb = fp8kv_scale_bytes(nope);
    // Key j: window position lo+j (earlier ones from the ring, this forward's from kv_new,
    // rounded through the KV dtype), then compressed entries. Address computed once per key;
    // bit 0 marks this forward's fp32 rows.
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        unsigned long long a, sa = 0;
        if (j < nwin) {
            int kp = lo + j;
            if (kp < start) {
                a = (unsigned long long)(st + (i64)(kp % window) * eb);
                sa = (unsigned long long)(st_sc + (i64)(kp % window) * sb);
            } else {
                a = (unsigned long long)(kv_new + (i64)(row0 + kp - start) * hd) | 1ull;
            }
        } else {
            int e = mode == 1 ? j - nwin : sel[(i64)r * topk + (j - nwin)];
            u32 pg = table[(e * rate) / page_tokens];
            a = (unsigned long long)(pages + (i64)pg * page_bytes + comp_off + (i64)(e % comp_epp) * eb);
            sa = (unsigned long long)(pages + (i64)pg * page_bytes + comp_scale_off + (i64)(e % comp_epp) * sb);
        }
        kaddr[j] = a;
        if (dt == 3) saddr[j] = sa;
    }
    __syncthreads();
    // fp8 (dt 3): kv_new rows come already rounded through an entry (k_kv_round_trip).
#define KEY_VAL(j, a, c)                                                                           \
    (((a) & 1ull) ? round_dt(((const float*)((a) & ~1ull))[c], dt)                                \
     : dt == 3    ? ld_fp8kv((const unsigned char*)(a), (const unsigned char*)saddr[j], (c), nope) \
                  : ld_entry((const unsigned char*)(a), (c), dt))
    // Scores: one warp per key; lane holds channels lane + 32*q of the key.
    int nq = hd >> 5;
    for (int j = warp; j < nk; j += nw) {
        unsigned long long a = kaddr[j];
        float kv[ATT_MAXQ];
#pragma unroll
        for (int qq = 0; qq < ATT_MAXQ; qq++) kv[qq] = qq < nq ? KEY_VAL(j, a, lane + 32 * qq) : 0.f;
        for (int g = 0; g < G; g++) {
            float d = 0.f;
#pragma unroll
            for (int qq = 0; qq < ATT_MAXQ; qq++)
                if (qq < nq) d += qs[g * hd + lane + 32 * qq] * kv[qq];
            d = warp_sum(d);
            if (lane == 0) lg[g * max_keys + j] = d * scale;
        }
    }
    __syncthreads();
    for (int g = 0; g < G; g++) {
        float* l = lg + g * max_keys;
        float sink = sinks[h0 + g];
        float m = sink;
        for (int j = threadIdx.x; j < nk; j += blockDim.x) m = fmaxf(m, l[j]);
        m = block_max(m, red);
        float s = 0.f;
        for (int j = threadIdx.x; j < nk; j += blockDim.x) {
            float e = expf(l[j] - m);
            l[j] = e;
            s += e;
        }
        s = block_sum(s, red) + expf(sink - m);
        for (int j = threadIdx.x; j < nk; j += blockDim.x) l[j] = l[j] / s;
    }
    __syncthreads();
    // Output: each thread owns channels c, summing keys in order for every head of the group.
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float acc[ATT_G];
#pragma unroll
        for (int g = 0; g < ATT_G; g++) acc[g] = 0.f;
        for (int j = 0; j < nk; j++) {
            float v = KEY_VAL(j, kaddr[j], c);
#pragma unroll
            for (int g = 0; g < ATT_G; g++)
                if (g < G) acc[g] += lg[g * max_keys + j] * v;
        }
        for (int g = 0; g < G; g++) out[((i64)r * n_heads + h0 + g) * hd + c] = acc[g];
    }
#undef KEY_VAL
}

// Store rows into the sliding-window rings: one block per (sequence, one of its last
// `window` positions); rows addressed through the sequence (row0 + pos - start), so the
// sequences of a cut plan, which share the forward's rows, each fill their own ring.
// fp8 (dt 3): the row's scale bytes at win_scale_off.
extern "C" __global__ void k_window_store(unsigned char* states, i64 state_bytes, const int* seq, const float* kv_new,
                                          int hd, int window, i64 win_off, int dt, int rd, i64 win_scale_off) {
    pdl_enter();
    __shared__ float tile_sc[32];
    const int* sq = seq + blockIdx.x * SEQ_INTS;
    int start = sq[SEQ_START], len = sq[SEQ_LEN];
    int n = min(window, len);
    if ((int)blockIdx.y >= n) return;
    int pos = start + len - n + (int)blockIdx.y;
    i64 r = sq[SEQ_ROW0] + (pos - start);
    unsigned char* slot = states + (i64)sq[SEQ_STATE] * state_bytes;
    if (dt == 3) {
        int nope = hd - rd;
        unsigned char* row = slot + win_off + (i64)(pos % window) * fp8kv_row_bytes(nope, rd);
        unsigned char* sc = slot + win_scale_off + (i64)(pos % window) * fp8kv_scale_bytes(nope);
        st_fp8kv(kv_new + (i64)r * hd, row, sc, nope, rd, tile_sc);
        return;
    }
    unsigned char* dst = slot + win_off + (i64)(pos % window) * hd * dt_bytes(dt);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) st_entry(dst, c, dt, kv_new[(i64)r * hd + c]);
}

// fp8 (dt 3): each row of x as a store and load of one entry gives it (this forward's keys,
// which attention reads before they are stored). One block per row.
extern "C" __global__ void k_kv_round_trip(const float* x, float* out, int hd, int rd) {
    pdl_enter();
    __shared__ float tile_sc[32];
    int r = blockIdx.x, nope = hd - rd;
    const float* v = x + (i64)r * hd;
    for (int t = threadIdx.x; t < (nope + KV_TILE - 1) / KV_TILE; t += blockDim.x)
        tile_sc[t] = fp8kv_tile_scale(v, t, nope);
    __syncthreads();
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float s = tile_sc[c / KV_TILE];
        out[(i64)r * hd + c] = c < nope ? e4m3_to_f(fp8kv_code(v[c], s)) * s : bf16_to_f(f_to_bf16(v[c]));
    }
}
