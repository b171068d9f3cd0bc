// Sink attention split over the keys (flash-decoding): the same function as k_attention
// (attention.cu), computed by more blocks. Key j of a row is window position lo+j
// (earlier positions from the state ring, this forward's from `new_rows`: its keys stored
// as entries of the KV dtype by k_kv_entries), then its compressed entries (mode 0: none,
// 1: every visible entry, 2: the indexer's picks). K = V. Every key is an entry of one
// dtype, so a tile's loads are one branch-free run per dtype, all in flight at once.
//
// grid (rows, n_heads / G, nsplit): block (r, y, s) handles heads y*G .. y*G+G of row r
// over keys s*split_keys .. (s+1)*split_keys, in tiles of ATS_TILE keys with a running
// (max, sum, accumulator) per head. It writes the result directly (`direct`, only with
// nsplit == 1) or its partial (max, sum) and accumulator, which k_attention_combine merges
// in split order: every result is a fixed function of split_keys, whatever the grid.
//
// A tile: each warp loads ATS_KPW keys into registers (lane: channels lane + 32*q) and
// keeps their values in shared memory, scores them against every head's query, then each
// thread accumulates 4 heads x 8 channels of the output over the tile's keys. The tile is
// one key per lane of a warp and ATS_KPW keys per warp of a 256-thread block.
// Dynamic shared memory: SplitPlan::shared_bytes (ops/attention_split.rs) gives the layout
// below. hd: a multiple of 32, at most 32 * ATS_MAXQ;
// G at most ATS_MAXG and (hd / 8) * ceil(G / 4) at most blockDim.x.
#define ATS_TILE 32
#define ATS_KPW 4
#define ATS_MAXQ 16
#define ATS_MAXG 16

// The warp sums of v0..v3 (one per key) in 6 shuffles: lane 8u holds the sum of v_u.
__device__ __forceinline__ float ats_sum4(float v0, float v1, float v2, float v3, int lane) {
    bool hi = lane & 16;
    float k0 = hi ? v2 : v0, k1 = hi ? v3 : v1;
    float s0 = hi ? v0 : v2, s1 = hi ? v1 : v3;
    k0 += __shfl_xor_sync(0xffffffffu, s0, 16);
    k1 += __shfl_xor_sync(0xffffffffu, s1, 16);
    bool h8 = lane & 8;
    float k = h8 ? k1 : k0, s = h8 ? k0 : k1;
    k += __shfl_xor_sync(0xffffffffu, s, 8);
    k += __shfl_xor_sync(0xffffffffu, k, 4);
    k += __shfl_xor_sync(0xffffffffu, k, 2);
    k += __shfl_xor_sync(0xffffffffu, k, 1);
    return k;
}

// Keys warp*ATS_KPW .. +ATS_KPW of a tile into kv (lane: channels lane + 32*q), for the
// tile's first n keys (past n: key n-1 again, never used). DT: the entry dtype. Every load
// is issued before any value is used.
template <int DT>
__device__ __forceinline__ void ats_load_keys(const unsigned long long* kaddr, const unsigned long long* saddr, int n,
                                              int warp, int lane, int nq, int nope, float (&kv)[ATS_KPW][ATS_MAXQ]) {
    u32 raw[ATS_KPW][ATS_MAXQ];
#pragma unroll
    for (int u = 0; u < ATS_KPW; u++) {
        int jj = min(warp * ATS_KPW + u, n - 1);
        const unsigned char* a = (const unsigned char*)kaddr[jj];
        const unsigned char* sa = (const unsigned char*)saddr[jj];
#pragma unroll
        for (int qq = 0; qq < ATS_MAXQ; qq++) {
            int c = lane + 32 * min(qq, nq - 1);
            if (DT == 0) {
                raw[u][qq] = __ldg((const u32*)a + c);
            } else if (DT == 1) {
                raw[u][qq] = __ldg((const bf16_t*)a + c);
            } else {
                // fp8 entry: code and its tile's scale byte, or a bf16 rope value.
                u32 b = 0, sc = 0, h = 0;
                if (c < nope) {
                    b = __ldg(a + c);
                    sc = __ldg(sa + c / KV_TILE);
                } else {
                    h = __ldg((const bf16_t*)(a + nope) + (c - nope));
                }
                raw[u][qq] = c < nope ? (b | (sc << 8)) : h;
            }
        }
    }
#pragma unroll
    for (int u = 0; u < ATS_KPW; u++)
#pragma unroll
        for (int qq = 0; qq < ATS_MAXQ; qq++) {
            u32 w = raw[u][qq];
            int c = lane + 32 * min(qq, nq - 1);
            if (DT == 0) kv[u][qq] = __uint_as_float(w);
            else if (DT == 1) kv[u][qq] = __uint_as_float(w << 16);
            else kv[u][qq] = c < nope ? e4m3_to_f((unsigned char)(w & 0xff)) * e8m0_to_f((unsigned char)(w >> 8))
                                      : __uint_as_float(w << 16);
        }
}

// This forward's keys as entries of the KV dtype `dt` (what attention reads back from the
// ring or a page once they are stored): row r at rows + r * row bytes, fp8 (dt 3) scale
// bytes at scales + r * scale bytes. One block per row.
extern "C" __global__ void k_kv_entries(const float* x, unsigned char* rows, unsigned char* scales, int hd, int rd,
                                        int dt) {
    pdl_enter();
    __shared__ float tile_sc[32];
    int r = blockIdx.x;
    const float* v = x + (i64)r * hd;
    if (dt == 3) {
        int nope = hd - rd;
        st_fp8kv(v, rows + (i64)r * fp8kv_row_bytes(nope, rd), scales + (i64)r * fp8kv_scale_bytes(nope), nope, rd,
                 tile_sc);
        return;
    }
    unsigned char* dst = rows + (i64)r * hd * dt_bytes(dt);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) st_entry(dst, c, dt, v[c]);
}

extern "C" __global__ void k_attention_split(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                             i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                             const int* positions, const float* q, const unsigned char* new_rows,
                                             const unsigned char* new_scales, const float* sinks, const int* sel, int topk, float* out, float* part,
                                             float* part_ml, int n_heads, int hd, int window, i64 win_off, int rate,
                                             int mode, i64 comp_off, int comp_epp, int page_tokens, int dt,
                                             float scale, int G, int rd, i64 win_scale_off, i64 comp_scale_off,
                                             int split_keys, int nsplit, int direct) {
    pdl_enter();
    extern __shared__ float smem[];
    int gp = (G + 3) & ~3;
    float* qs = smem;                     // [G][hd] queries
    float* tile = qs + G * hd;            // [ATS_TILE][hd] the tile's key values
    float* pr = tile + ATS_TILE * hd;     // [ATS_TILE][gp] scores, then probabilities
    float* mrun = pr + ATS_TILE * gp;     // [ATS_MAXG] running max per head
    float* lrun = mrun + ATS_MAXG;        // [ATS_MAXG] running sum
    float* alpha = lrun + ATS_MAXG;       // [ATS_MAXG] rescale of this tile
    unsigned long long* kaddr = (unsigned long long*)(alpha + ATS_MAXG);  // [ATS_TILE]
    unsigned long long* saddr = kaddr + ATS_TILE;  // fp8 (dt 3): scale bytes per key
    int r = blockIdx.x, h0 = blockIdx.y * G, split = blockIdx.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const AttnRow keys = attn_row(r, pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, new_rows,
                                  new_scales, sel, topk, hd, window, win_off, rate, mode, comp_off, comp_epp,
                                  page_tokens, dt, rd, win_scale_off, comp_scale_off);
    int nk = attn_row_keys(keys, mode, rate, sel, topk, r);
    int k0 = split * split_keys, k1 = min(nk, k0 + split_keys);
    i64 rh = (i64)r * n_heads + h0;  // (row, first head) of this block
    if (k0 >= k1) {
        attn_empty_split(part_ml, rh, G, nsplit, split);
        return;
    }
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = q[rh * hd + i];
    if (threadIdx.x < ATS_MAXG) {
        mrun[threadIdx.x] = NEG_INF;
        lrun[threadIdx.x] = 0.f;
    }
    int nope = hd - rd;
    int nq = hd >> 5;
    // Output items: 8 channels (ca .. ca+4 and cb .. cb+4, one half of the head apart, so
    // that a quarter-warp's 16-byte loads hit distinct banks) of 4 heads (hq .. hq+4).
    int octets = hd >> 3;
    bool has_item = (int)threadIdx.x < octets * (gp >> 2);
    int ca = (threadIdx.x % octets) * 4, cb = ca + (hd >> 1), hq = (threadIdx.x / octets) * 4;
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[i][k] = 0.f;
    for (int kt = k0; kt < k1; kt += ATS_TILE) {
        int n = min(ATS_TILE, k1 - kt);
        // Key addresses of the tile (and fp8 scale addresses).
        if ((int)threadIdx.x < n) {
            unsigned long long a, sa;
            keys.key(kt + threadIdx.x, a, sa);
            kaddr[threadIdx.x] = a;
            saddr[threadIdx.x] = sa;
        }
        __syncthreads();
        // Scores: warp w holds keys w*ATS_KPW .. +ATS_KPW of the tile.
        {
            float kv[ATS_KPW][ATS_MAXQ];
            if (dt == 1) ats_load_keys<1>(kaddr, saddr, n, warp, lane, nq, nope, kv);
            else if (dt == 0) ats_load_keys<0>(kaddr, saddr, n, warp, lane, nq, nope, kv);
            else ats_load_keys<3>(kaddr, saddr, n, warp, lane, nq, nope, kv);
#pragma unroll
            for (int u = 0; u < ATS_KPW; u++) {
                int jj = warp * ATS_KPW + u;
                if (jj < n)
#pragma unroll
                    for (int qq = 0; qq < ATS_MAXQ; qq++)
                        if (qq < nq) tile[jj * hd + lane + 32 * qq] = kv[u][qq];
            }
            for (int g = 0; g < G; g++) {
                float d[ATS_KPW];
#pragma unroll
                for (int u = 0; u < ATS_KPW; u++) d[u] = 0.f;
#pragma unroll
                for (int qq = 0; qq < ATS_MAXQ; qq++)
                    if (qq < nq) {
                        float qv = qs[g * hd + lane + 32 * qq];
#pragma unroll
                        for (int u = 0; u < ATS_KPW; u++) d[u] += qv * kv[u][qq];
                    }
                float s = ats_sum4(d[0], d[1], d[2], d[3], lane);
                int jj = warp * ATS_KPW + (lane >> 3);
                if ((lane & 7) == 0 && jj < n) pr[jj * gp + g] = s * scale;
            }
        }
        __syncthreads();
        // Running softmax: one warp per head, lane j = key j of the tile.
        for (int g = warp; g < G; g += blockDim.x >> 5) {
            float s = lane < n ? pr[lane * gp + g] : NEG_INF;
            float mo = mrun[g];
            float mn = fmaxf(mo, warp_max(s));
            float p = lane < n ? expf(s - mn) : 0.f;
            float sum = warp_sum(p);
            if (lane < n) pr[lane * gp + g] = p;
            if (lane == 0) {
                float al = expf(mo - mn);
                alpha[g] = al;
                mrun[g] = mn;
                lrun[g] = lrun[g] * al + sum;
            }
        }
        __syncthreads();
        if (has_item) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float al = hq + i < G ? alpha[hq + i] : 0.f;
#pragma unroll
                for (int k = 0; k < 8; k++) acc[i][k] *= al;
            }
#pragma unroll 4
            for (int j = 0; j < n; j++) {
                float4 p = *reinterpret_cast<const float4*>(pr + j * gp + hq);
                float4 va = *reinterpret_cast<const float4*>(tile + j * hd + ca);
                float4 vb = *reinterpret_cast<const float4*>(tile + j * hd + cb);
                float pv[4] = {p.x, p.y, p.z, p.w};
                float v[8] = {va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int k = 0; k < 8; k++) acc[i][k] += pv[i] * v[k];
            }
        }
        __syncthreads();
    }
    if (has_item)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int g = hq + i;
            if (g >= G) break;
            float* dst;
            float w = 1.f;
            if (direct) {
                // The sink joins the softmax here (as in k_attention_combine for nsplit 1).
                w = attn_sink_weight(mrun[g], lrun[g], sinks[h0 + g]);
                dst = out + (rh + g) * hd;
            } else {
                dst = part + ((rh + g) * nsplit + split) * hd;
            }
            *reinterpret_cast<float4*>(dst + ca) =
                make_float4(acc[i][0] * w, acc[i][1] * w, acc[i][2] * w, acc[i][3] * w);
            *reinterpret_cast<float4*>(dst + cb) =
                make_float4(acc[i][4] * w, acc[i][5] * w, acc[i][6] * w, acc[i][7] * w);
        }
    if (!direct && (int)threadIdx.x < G) {
        part_ml[((rh + threadIdx.x) * nsplit + split) * 2] = mrun[threadIdx.x];
        part_ml[((rh + threadIdx.x) * nsplit + split) * 2 + 1] = lrun[threadIdx.x];
    }
}

// Merge k_attention_split's partials of each (row, head) in split order, with the sink's
// logit in the softmax. grid (rows, n_heads); threads over channels.
extern "C" __global__ void k_attention_combine(const float* part, const float* part_ml, const float* sinks,
                                               float* out, int n_heads, int hd, int nsplit) {
    pdl_enter();
    i64 rh = (i64)blockIdx.x * n_heads + blockIdx.y;
    const float* ml = part_ml + rh * nsplit * 2;
    float sink = sinks[blockIdx.y];
    float mx = sink;
    for (int s = 0; s < nsplit; s++)
        if (ml[2 * s + 1] > 0.f) mx = fmaxf(mx, ml[2 * s]);
    float l = expf(sink - mx);
    for (int s = 0; s < nsplit; s++)
        if (ml[2 * s + 1] > 0.f) l += ml[2 * s + 1] * expf(ml[2 * s] - mx);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < nsplit; s++)
            if (ml[2 * s + 1] > 0.f) o += part[(rh * nsplit + s) * hd + c] * expf(ml[2 * s] - mx);
        out[rh * hd + c] = o / l;
    }
}
