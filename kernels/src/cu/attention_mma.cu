// Sink attention on tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators):
// the function of k_attention_split (attention_split.cu) for bf16 and fp8 KV entries
// (dt 1 and 3), with every head of a row in one block, so that each key is loaded once for
// all of them (K = V). The keys are exact bf16 values (bf16 entries, or fp8 codes times a
// power-of-two scale and bf16 rope channels); the queries and the probabilities are
// rounded to bf16 for the products, as FlashMLA does; scores, sums and outputs stay fp32.
// The `_exact` variant (gpu-check's A/B under fp32 weights) splits each query and
// probability into two bf16 halves, hi + lo, and takes both products: ~16 bits, close to
// the fp32 kernel, for twice the tensor-core work and 70 KiB more shared memory.
//
// grid (rows, ceil(n_heads / ATM_H), nsplit), ATM_THREADS threads: block (r, y, s) handles
// heads y*ATM_H .. +ATM_H of row r (past n_heads: zero queries, outputs dropped) over the
// row's keys s*split_keys .. (s+1)*split_keys (window then compressed entries, as in the
// split kernel), in tiles of ATM_T keys. It writes the result itself (`direct`, only with
// nsplit == 1) or the split kernel's partials, which k_attention_combine merges.
//
// A tile: the keys' bf16 values in shared memory (cp.async for bf16 entries, the next
// tile's copies in flight while this one computes; fp8 entries converted on the way), then
//   scores  S[ATM_H x ATM_T] = Q K^T: warp w computes heads 16 (w % 4) .. +16 over keys
//           16 (w / 4) .. +16, the whole head_dim;
//   softmax one warp per 8 heads, lane = key: running max and sum per head, P as bf16;
//   values  O[ATM_H x hd] += P V: warp w owns channels w hd/8 .. +hd/8 of every head, its
//           accumulators in registers across the tiles.
// Shared rows are padded by ATM_PAD bf16 (16 bytes): ldmatrix's 8 rows hit distinct banks.
// Requires hd a multiple of 64, at most 64 * ATM_MAXNT; fp8 entries with 16-byte aligned
// rows (nope a multiple of 16). Dynamic shared memory: MmaPlan::shared_bytes
// (ops/attention_mma.rs) gives the layout below (the exact variant: the lo halves of the
// probabilities and queries after the key tiles).
#define ATM_H 64
#define ATM_T 32
#define ATM_PAD 8
#define ATM_THREADS 256
#define ATM_MAXNT 8
#define ATM_SST (ATM_T + 4)
#define ATM_PST (ATM_T + ATM_PAD)

// Two e4m3 codes (bytes 0 and 1 of w) times the power-of-two scale s, as a bf16 pair (the
// products are exact in bf16).
__device__ __forceinline__ u32 atm_fp8_pair(u32 w, float s) {
    u32 b0 = w & 0xffu, b1 = (w >> 8) & 0xffu;
    float f0 = (b0 & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : e4m3w(b0) * s;
    float f1 = (b1 & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : e4m3w(b1) * s;
    return (u32)f_to_bf16(f0) | ((u32)f_to_bf16(f1) << 16);
}

template <bool EXACT>
__device__ __forceinline__ void atm_body(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, float* out, float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    extern __shared__ __align__(16) unsigned char atm_sh[];
    const int ldk = hd + ATM_PAD;
    unsigned long long* kaddr = (unsigned long long*)atm_sh;  // [2][ATM_T] key addresses
    unsigned long long* saddr = kaddr + 2 * ATM_T;            // [2][ATM_T] fp8 scale addresses
    float* mrun = (float*)(saddr + 2 * ATM_T);                // [ATM_H] running max
    float* lrun = mrun + ATM_H;                               // [ATM_H] running sum
    float* alpha = lrun + ATM_H;                              // [ATM_H] this tile's rescale
    float* ss = alpha + ATM_H;                                // [ATM_H][ATM_SST] scores
    bf16_t* ps = (bf16_t*)(ss + ATM_H * ATM_SST);             // [ATM_H][ATM_PST] probabilities
    bf16_t* qs = ps + ATM_H * ATM_PST;                        // [ATM_H][ldk] queries
    bf16_t* ks = qs + ATM_H * ldk;                            // [2][ATM_T][ldk] keys
    bf16_t* ps_lo = ks + 2 * ATM_T * ldk;                     // EXACT: [ATM_H][ATM_PST]
    bf16_t* qs_lo = ps_lo + ATM_H * ATM_PST;                  // EXACT: [ATM_H][ldk]
    int r = blockIdx.x, h0 = blockIdx.y * ATM_H, split = blockIdx.z;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const AttnRow keys = attn_row(r, pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, new_rows,
                                  new_scales, sel, topk, hd, window, win_off, rate, mode, comp_off, comp_epp,
                                  page_tokens, dt, rd, win_scale_off, comp_scale_off);
    int nwin = keys.nwin;
    int nsel = 0;
    if (mode == 1) nsel = (keys.pos + 1) / rate;
    if (mode == 2)
        for (int j0 = 0; j0 < topk; j0 += blockDim.x) {
            int j = j0 + tid;
            nsel += __syncthreads_count(j < topk && sel[(i64)r * topk + j] >= 0);
        }
    int nk = nwin + nsel;
    int k0 = split * split_keys, k1 = min(nk, k0 + split_keys);
    int nh = min(ATM_H, n_heads - h0);
    i64 rh = (i64)r * n_heads + h0;  // (row, first head) of this block
    if (k0 >= k1) {
        // A split past this row's keys: an empty partial, which the combine skips.
        for (int h = tid; h < nh; h += blockDim.x) {
            part_ml[((rh + h) * nsplit + split) * 2] = NEG_INF;
            part_ml[((rh + h) * nsplit + split) * 2 + 1] = 0.f;
        }
        return;
    }
    for (int i = tid * 4; i < ATM_H * hd; i += ATM_THREADS * 4) {
        int h = i / hd, c = i - h * hd;
        float4 v = h < nh ? *reinterpret_cast<const float4*>(q + (rh + h) * hd + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        bf16_t b0 = f_to_bf16(v.x), b1 = f_to_bf16(v.y), b2 = f_to_bf16(v.z), b3 = f_to_bf16(v.w);
        *reinterpret_cast<uint2*>(qs + h * ldk + c) =
            make_uint2((u32)b0 | ((u32)b1 << 16), (u32)b2 | ((u32)b3 << 16));
        if (EXACT) {
            bf16_t l0 = f_to_bf16(v.x - bf16_to_f(b0)), l1 = f_to_bf16(v.y - bf16_to_f(b1));
            bf16_t l2 = f_to_bf16(v.z - bf16_to_f(b2)), l3 = f_to_bf16(v.w - bf16_to_f(b3));
            *reinterpret_cast<uint2*>(qs_lo + h * ldk + c) =
                make_uint2((u32)l0 | ((u32)l1 << 16), (u32)l2 | ((u32)l3 << 16));
        }
    }
    if (tid < ATM_H) {
        mrun[tid] = NEG_INF;
        lrun[tid] = 0.f;
    }
    int nope = hd - rd;
    int ntiles = (k1 - k0 + ATM_T - 1) / ATM_T;
    // Addresses of tile t's keys into slot b (past the split's keys: its last key again,
    // whose scores are masked, so that every loaded value is a finite key).
    auto stage = [&](int t, int b) {
        if (tid < ATM_T) {
            unsigned long long a, sa;
            keys.key(min(k0 + t * ATM_T + tid, k1 - 1), a, sa);
            kaddr[b * ATM_T + tid] = a;
            saddr[b * ATM_T + tid] = sa;
        }
    };
    // The keys of slot b's addresses into key buffer b, 16 bytes (8 channels) at a time.
    int cpr = hd >> 3;
    auto load = [&](int b) {
        bf16_t* kb = ks + b * ATM_T * ldk;
        for (int i = tid; i < ATM_T * cpr; i += ATM_THREADS) {
            int key = i / cpr, c8 = i - key * cpr;
            const unsigned char* a = (const unsigned char*)kaddr[b * ATM_T + key];
            bf16_t* d = kb + key * ldk + c8 * 8;
            if (dt == 1) {
                tc_cp16(d, a + c8 * 16);
            } else {
                int c = c8 * 8;
                uint4 w;
                if (c < nope) {
                    uint2 codes = *reinterpret_cast<const uint2*>(a + c);
                    float s = e8m0_to_f(((const unsigned char*)saddr[b * ATM_T + key])[c / KV_TILE]);
                    w.x = atm_fp8_pair(codes.x, s);
                    w.y = atm_fp8_pair(codes.x >> 16, s);
                    w.z = atm_fp8_pair(codes.y, s);
                    w.w = atm_fp8_pair(codes.y >> 16, s);
                } else {
                    w = *reinterpret_cast<const uint4*>(a + nope + (i64)(c - nope) * 2);
                }
                *reinterpret_cast<uint4*>(d) = w;
            }
        }
    };
    stage(0, 0);
    __syncthreads();
    load(0);
    tc_commit();
    int g = lane >> 2, tq = lane & 3;
    int nt = hd >> 6;              // 8-channel n-tiles per warp in the values product
    int cw = warp * (hd >> 3);     // this warp's first output channel
    int mi_s = warp & 3, nk_s = (warp >> 2) * 16;  // this warp's score tile
    float acc[4][ATM_MAXNT][4];
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < ATM_MAXNT; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.f;
    for (int t = 0; t < ntiles; t++) {
        int b = t & 1;
        if (t + 1 < ntiles) stage(t + 1, b ^ 1);
        // The next addresses are visible, and every warp is done with tile t - 1 (whose
        // buffer the next copies overwrite).
        __syncthreads();
        if (t + 1 < ntiles) load(b ^ 1);
        tc_commit();
        tc_wait_prev();
        __syncthreads();
        const bf16_t* kb = ks + b * ATM_T * ldk;
        int lim = min(ATM_T, k1 - k0 - t * ATM_T);  // keys of this tile
        {
            float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
            u32 qa = tc_smem(qs + (mi_s * 16 + (lane & 15)) * ldk + (lane >> 4) * 8);
            u32 qa_lo = tc_smem(qs_lo + (mi_s * 16 + (lane & 15)) * ldk + (lane >> 4) * 8);
            u32 ka = tc_smem(kb + (nk_s + (lane & 7) + (lane >> 4) * 8) * ldk + ((lane >> 3) & 1) * 8);
#pragma unroll 4
            for (int kk = 0; kk < hd; kk += 16) {
                u32 a[4], kf[4];
                tc_ldsm_x4(qa + kk * 2, a);
                tc_ldsm_x4(ka + kk * 2, kf);
                tc_mma(s0, a, kf[0], kf[1]);
                tc_mma(s1, a, kf[2], kf[3]);
                if (EXACT) {
                    tc_ldsm_x4(qa_lo + kk * 2, a);
                    tc_mma(s0, a, kf[0], kf[1]);
                    tc_mma(s1, a, kf[2], kf[3]);
                }
            }
            int row = mi_s * 16 + g;
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const float* s = n == 0 ? s0 : s1;
                int col = nk_s + n * 8 + 2 * tq;
                float2 top = make_float2(col < lim ? s[0] * scale : NEG_INF, col + 1 < lim ? s[1] * scale : NEG_INF);
                float2 bot = make_float2(col < lim ? s[2] * scale : NEG_INF, col + 1 < lim ? s[3] * scale : NEG_INF);
                *reinterpret_cast<float2*>(ss + row * ATM_SST + col) = top;
                *reinterpret_cast<float2*>(ss + (row + 8) * ATM_SST + col) = bot;
            }
        }
        __syncthreads();
        for (int hh = warp; hh < ATM_H; hh += ATM_THREADS / 32) {
            float s = ss[hh * ATM_SST + lane];
            float mo = mrun[hh];
            float mn = fmaxf(mo, warp_max(s));
            float p = lane < lim ? expf(s - mn) : 0.f;
            bf16_t pb = f_to_bf16(p);
            // The sum of what the products take: the bf16 value, or (EXACT) p itself.
            float sum = warp_sum(EXACT ? p : bf16_to_f(pb));
            ps[hh * ATM_PST + lane] = pb;
            if (EXACT) ps_lo[hh * ATM_PST + lane] = f_to_bf16(p - bf16_to_f(pb));
            if (lane == 0) {
                float al = expf(mo - mn);
                alpha[hh] = al;
                mrun[hh] = mn;
                lrun[hh] = lrun[hh] * al + sum;
            }
        }
        __syncthreads();
#pragma unroll
        for (int mi = 0; mi < 4; mi++) {
            float a_top = alpha[mi * 16 + g], a_bot = alpha[mi * 16 + g + 8];
#pragma unroll
            for (int ni = 0; ni < ATM_MAXNT; ni++) {
                acc[mi][ni][0] *= a_top;
                acc[mi][ni][1] *= a_top;
                acc[mi][ni][2] *= a_bot;
                acc[mi][ni][3] *= a_bot;
            }
        }
#pragma unroll
        for (int kk = 0; kk < ATM_T; kk += 16) {
            u32 pa[4][4], pa_lo[4][4];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                int at = (mi * 16 + (lane & 15)) * ATM_PST + kk + (lane >> 4) * 8;
                tc_ldsm_x4(tc_smem(ps + at), pa[mi]);
                if (EXACT) tc_ldsm_x4(tc_smem(ps_lo + at), pa_lo[mi]);
            }
            const bf16_t* vrow = kb + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * ldk + cw;
#pragma unroll
            for (int nj = 0; nj < ATM_MAXNT / 2; nj++) {
                if (2 * nj + 1 < nt) {
                    u32 v[4];
                    tc_ldsm_x4_t(tc_smem(vrow + nj * 16 + (lane >> 4) * 8), v);
#pragma unroll
                    for (int mi = 0; mi < 4; mi++) {
                        tc_mma(acc[mi][2 * nj], pa[mi], v[0], v[1]);
                        tc_mma(acc[mi][2 * nj + 1], pa[mi], v[2], v[3]);
                        if (EXACT) {
                            tc_mma(acc[mi][2 * nj], pa_lo[mi], v[0], v[1]);
                            tc_mma(acc[mi][2 * nj + 1], pa_lo[mi], v[2], v[3]);
                        }
                    }
                } else if (2 * nj < nt) {
                    u32 v0, v1;
                    tc_ldsm_x2_t(tc_smem(vrow + nj * 16), v0, v1);
#pragma unroll
                    for (int mi = 0; mi < 4; mi++) {
                        tc_mma(acc[mi][2 * nj], pa[mi], v0, v1);
                        if (EXACT) tc_mma(acc[mi][2 * nj], pa_lo[mi], v0, v1);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int hh = mi * 16 + g + half * 8;
            if (hh >= nh) continue;
            float w = 1.f;
            float* dst;
            if (direct) {
                // The sink joins the softmax here (as in k_attention_combine for nsplit 1).
                float sink = sinks[h0 + hh], m = mrun[hh];
                float mx = fmaxf(m, sink);
                float e = expf(m - mx);
                w = e / (lrun[hh] * e + expf(sink - mx));
                dst = out + (rh + hh) * hd;
            } else {
                dst = part + ((rh + hh) * nsplit + split) * hd;
            }
#pragma unroll
            for (int ni = 0; ni < ATM_MAXNT; ni++)
                if (ni < nt)
                    *reinterpret_cast<float2*>(dst + cw + ni * 8 + 2 * tq) =
                        make_float2(acc[mi][ni][2 * half] * w, acc[mi][ni][2 * half + 1] * w);
        }
    if (!direct && tid < nh) {
        part_ml[((rh + tid) * nsplit + split) * 2] = mrun[tid];
        part_ml[((rh + tid) * nsplit + split) * 2 + 1] = lrun[tid];
    }
}

// Products in bf16 (bf16 and stored-format weights).
extern "C" __global__ void k_attention_mma(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, float* out, float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    atm_body<false>(pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, q, new_rows, new_scales, sinks, sel, topk, out, part,
        part_ml, n_heads, hd, window, win_off, rate, mode, comp_off, comp_epp, page_tokens, dt, scale, rd, win_scale_off,
        comp_scale_off, split_keys, nsplit, direct);
}

// Products of hi + lo bf16 halves, ~16 bits (gpu-check's A/B under fp32 weights).
extern "C" __global__ void k_attention_mma_exact(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, float* out, float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    atm_body<true>(pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, q, new_rows, new_scales, sinks, sel, topk, out, part,
        part_ml, n_heads, hd, window, win_off, rate, mode, comp_off, comp_epp, page_tokens, dt, scale, rd, win_scale_off,
        comp_scale_off, split_keys, nsplit, direct);
}
