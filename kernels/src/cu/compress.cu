// Compressor: feed projected kv/gate rows into the per-sequence fp32 ring; each window a
// row closes is pooled (softmax over slots + position bias), RMS-normed, roped at w*rate
// and stored as entry w in the sequence's pages. Decode steps: one block per sequence walks
// its rows in order (the ring is sequential state), k_compress. Prefill: one block per
// window this forward closes, rows of this forward read from the projections and earlier
// ones from the ring (k_compress by window), then k_compress_ring stores the last rows in
// the ring; each window's arithmetic is the same in both, so the entries are bitwise equal.
//
// seq/pt: sequence table and page tables (common.cuh). bias: [rate, width];
// norm_w: [dim]; cs/sn: [rows, rd/2], cos/sin at the window position of rows that close one.
// Dynamic shared memory: dim floats, then (rotating) dim doubles from the next 8-byte
// boundary. fp8 index-K entries (dt 2) keep their scale at scale_off; fp8 compressed-KV
// entries (dt 3, the last rd values the bf16 rope part) their scale bytes at scale_off
// (st_fp8kv). rot_scale_bits != 0 (deepseek numerics, the indexer's keys): after the rope,
// each entry is rotated and FP4-quantized (rotate_fp4; the bits are dim^-0.5's f64).
// Where one sequence's compressor rows live: positions from `proj_from` on in this
// forward's projections (row row0 + pos - start), earlier ones in the ring.
struct CompressRows {
    const float* ring;
    const float* proj_kv;
    const float* proj_gate;
    int proj_from, start, row0, slots, width;
};

__device__ __forceinline__ const float* comp_kv(const CompressRows& s, int p) {
    return p >= s.proj_from ? s.proj_kv + (i64)(s.row0 + p - s.start) * s.width
                            : s.ring + (i64)(p % s.slots) * 2 * s.width;
}

__device__ __forceinline__ const float* comp_gate(const CompressRows& s, int p) {
    return p >= s.proj_from ? s.proj_gate + (i64)(s.row0 + p - s.start) * s.width
                            : s.ring + (i64)(p % s.slots) * 2 * s.width + s.width;
}

// Pool window w (closed by plan row r), norm, rope, store as entry w. All threads of the
// block; `pooled` holds dim floats of shared memory.
__device__ void compress_window(const CompressRows& src, int w, i64 r, unsigned char* pages, i64 page_bytes,
                                const u32* table, const float* bias, const float* norm_w, const float* cs,
                                const float* sn, int rate, int overlap, i64 entry_off, i64 scale_off,
                                int entries_per_page, int page_tokens, int dt, int rd, float eps, float* pooled,
                                float* red, float* tile_sc, double* rot_tmp, i64 rot_scale_bits) {
    int width = src.width;
    int dim = overlap ? width / 2 : width;
    int half = overlap ? dim : 0;
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float m = NEG_INF;
        if (overlap && w > 0)
            for (int j = 0; j < rate; j++) m = fmaxf(m, comp_gate(src, (w - 1) * rate + j)[c] + bias[j * width + c]);
        for (int j = 0; j < rate; j++) m = fmaxf(m, comp_gate(src, w * rate + j)[half + c] + bias[j * width + half + c]);
        float s = 0.f, acc = 0.f;
        if (overlap && w > 0)
            for (int j = 0; j < rate; j++) {
                int p = (w - 1) * rate + j;
                float e = expf(comp_gate(src, p)[c] + bias[j * width + c] - m);
                s += e;
                acc += e * comp_kv(src, p)[c];
            }
        for (int j = 0; j < rate; j++) {
            int p = w * rate + j;
            float e = expf(comp_gate(src, p)[half + c] + bias[j * width + half + c] - m);
            s += e;
            acc += e * comp_kv(src, p)[half + c];
        }
        float p = acc / s;
        pooled[c] = p;
        ss += p * p;
    }
    ss = block_sum(ss, red) / (float)dim;
    float rr = 1.f / sqrtf(ss + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) pooled[c] = norm_w[c] * (pooled[c] * rr);
    __syncthreads();
    for (int k = threadIdx.x; k < rd / 2; k += blockDim.x) {
        float cc = cs[r * (rd / 2) + k], s = sn[r * (rd / 2) + k];
        float* p = pooled + dim - rd + 2 * k;
        float x0 = p[0], x1 = p[1];
        p[0] = x0 * cc + (-x1) * s;
        p[1] = x1 * cc + x0 * s;
    }
    __syncthreads();
    if (rot_scale_bits) rotate_fp4(pooled, pooled, rot_tmp, dim, __longlong_as_double(rot_scale_bits));
    u32 page = table[(i64)w * rate / page_tokens];
    int slot_in_page = w % entries_per_page;
    i64 row_bytes = dt == 3 ? fp8kv_row_bytes(dim - rd, rd) : (i64)dim * dt_bytes(dt);
    unsigned char* dst = pages + (i64)page * page_bytes + entry_off + (i64)slot_in_page * row_bytes;
    if (dt == 3) {
        unsigned char* sc = pages + (i64)page * page_bytes + scale_off + (i64)slot_in_page * fp8kv_scale_bytes(dim - rd);
        st_fp8kv(pooled, dst, sc, dim - rd, rd, tile_sc);
    } else if (dt == 2) {
        // fp8: one scale per entry, amax / 448, as kv::fp8::quantize_entry.
        float am = 0.f;
        for (int c = threadIdx.x; c < dim; c += blockDim.x) am = fmaxf(am, fabsf(pooled[c]));
        float sc = block_max(am, red) / 448.f;
        for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = sc > 0.f ? f_to_e4m3(pooled[c] / sc) : 0;
        if (threadIdx.x == 0) *(float*)(pages + (i64)page * page_bytes + scale_off + (i64)slot_in_page * 4) = sc;
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) st_entry(dst, c, dt, pooled[c]);
    }
    __syncthreads();
}

// by_window 0 (decode steps), grid (sequences): one block per sequence, every row into the
// ring, each window it closes pooled from the ring (a grid the batch alone fixes, so
// captured graphs replay it). by_window 1 (prefill), grid (sequences, most windows one
// sequence closes): block (s, k) pools the k-th window sequence s closes in this forward,
// this forward's rows read from the projections; the ring is only read (k_compress_ring
// writes it afterwards).
extern "C" __global__ void k_compress(unsigned char* pages, unsigned char* states, i64 page_bytes, i64 state_bytes,
                                      const int* seq, const u32* pt, const float* proj_kv, const float* proj_gate,
                                      const float* bias, const float* norm_w, const float* cs, const float* sn,
                                      int width, int rate, int slots, int overlap, i64 ring_off, i64 entry_off,
                                      i64 scale_off, int entries_per_page, int page_tokens, int dt, int rd,
                                      float eps, int by_window, i64 rot_scale_bits) {
    pdl_enter();
    extern __shared__ float pooled[];
    int dim = overlap ? width / 2 : width;
    double* rot_tmp = (double*)(pooled + ((dim + 1) & ~1));
    __shared__ float red[32];
    __shared__ float tile_sc[32];
    const int* sq = seq + blockIdx.x * SEQ_INTS;
    int start = sq[SEQ_START], len = sq[SEQ_LEN], row0 = sq[SEQ_ROW0];
    float* ring = (float*)(states + (i64)sq[SEQ_STATE] * state_bytes + ring_off);
    const u32* table = pt + sq[SEQ_PT];
    if (by_window) {
        int w = (start + rate) / rate - 1 + (int)blockIdx.y;
        if (w >= (start + len) / rate) return;
        CompressRows src = {ring, proj_kv, proj_gate, start, start, row0, slots, width};
        i64 r = row0 + ((w + 1) * rate - 1 - start);
        compress_window(src, w, r, pages, page_bytes, table, bias, norm_w, cs, sn, rate, overlap, entry_off,
                        scale_off, entries_per_page, page_tokens, dt, rd, eps, pooled, red, tile_sc, rot_tmp,
                        rot_scale_bits);
        return;
    }
    CompressRows src = {ring, proj_kv, proj_gate, 0x7fffffff, start, row0, slots, width};
    for (int i = 0; i < len; i++) {
        int pos = start + i;
        i64 r = row0 + i;
        float* slot = ring + (i64)(pos % slots) * 2 * width;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            slot[c] = proj_kv[r * width + c];
            slot[width + c] = proj_gate[r * width + c];
        }
        __syncthreads();
        if ((pos + 1) % rate != 0) continue;
        compress_window(src, (pos + 1) / rate - 1, r, pages, page_bytes, table, bias, norm_w, cs, sn, rate, overlap,
                        entry_off, scale_off, entries_per_page, page_tokens, dt, rd, eps, pooled, red, tile_sc,
                        rot_tmp, rot_scale_bits);
    }
}

// After k_compress by window: each sequence's last `slots` rows of this forward into its
// ring (what the next forward's windows read). One block per sequence.
extern "C" __global__ void k_compress_ring(unsigned char* states, i64 state_bytes, const int* seq,
                                           const float* proj_kv, const float* proj_gate, int width, int slots,
                                           i64 ring_off) {
    pdl_enter();
    const int* sq = seq + blockIdx.x * SEQ_INTS;
    int start = sq[SEQ_START], len = sq[SEQ_LEN], row0 = sq[SEQ_ROW0];
    float* ring = (float*)(states + (i64)sq[SEQ_STATE] * state_bytes + ring_off);
    int first = max(start, start + len - slots);
    for (int pos = first; pos < start + len; pos++) {
        i64 r = row0 + pos - start;
        float* slot = ring + (i64)(pos % slots) * 2 * width;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            slot[c] = proj_kv[r * width + c];
            slot[width + c] = proj_gate[r * width + c];
        }
    }
}
