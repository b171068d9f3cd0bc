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
// nsplit == 1) or the split kernel's partials, which k_attention_combine merges. A direct
// launch with `out_bf16` writes the o-projection's input there instead of `out`: the rope
// channels rotated back by the tables un_cs/un_sn ([rows, rd/2], as k_rope's), in bf16.
// `q_bf16` (bf16 products only), when set, holds the queries instead of `q`: rounded
// already (k_query_heads_bf16), the same bits the kernel's own rounding of `q` gives.
//
// A tile: the keys' bf16 values in shared memory (cp.async for bf16 entries, the next
// tile's copies in flight while this one computes; fp8 entries converted on the way). Warp
// w owns heads 16 (w % 4) .. +16 and channels (w / 4) hd/2 .. +hd/2, its partner w ^ 4 the
// other half of the same heads:
//   scores  each warp takes S[16 x ATM_T] = Q K^T over its half of the channels; the pair
//           swaps halves through shared memory (a 64-thread named barrier) and both add
//           them in the same order, so both hold the same scores in registers;
//   softmax in registers, each thread two heads (rows g and g + 8 of the mma layout), the
//           row max and sum across the lane quad; running max and sum in registers;
//   values  O[16 x hd/2] += P V: the probabilities go from the score accumulators straight
//           into the mma's A operand (as bf16), the accumulators in registers across tiles.
// Shared rows are padded by ATM_PAD bf16 (16 bytes): ldmatrix's 8 rows hit distinct banks.
// Requires hd a multiple of 32, at most 16 * ATM_MAXNT (the host takes multiples of 64 up
// to 512); fp8 entries with 16-byte aligned rows (nope a multiple of 16). Dynamic
// shared memory: MmaPlan::shared_bytes (ops/attention_mma.rs) gives the layout below (the
// exact variant: the lo halves of the queries after the key tiles).
#define ATM_H 64
#define ATM_T 32
#define ATM_PAD 8
#define ATM_THREADS 256
// 8-channel output tiles of one warp: hd / 2 / 8 at hd 512.
#define ATM_MAXNT 32

// Two e4m3 codes (bytes 0 and 1 of w) times the power-of-two scale s, as a bf16 pair (the
// products are exact in bf16).
__device__ __forceinline__ u32 atm_fp8_pair(u32 w, float s) {
    u32 b0 = w & 0xffu, b1 = (w >> 8) & 0xffu;
    float f0 = (b0 & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : e4m3w(b0) * s;
    float f1 = (b1 & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : e4m3w(b1) * s;
    return (u32)f_to_bf16(f0) | ((u32)f_to_bf16(f1) << 16);
}

// Channels c .. c + 7 of fp8 KV entry `a` (scale bytes `sa`) as bf16: e4m3 codes times
// their tile's power-of-two scale below `nope`, the stored bf16 rope values above it.
__device__ __forceinline__ uint4 atm_fp8_chunk(const unsigned char* a, const unsigned char* sa, int c, int nope) {
    if (c >= nope) return *reinterpret_cast<const uint4*>(a + nope + (i64)(c - nope) * 2);
    uint2 codes = *reinterpret_cast<const uint2*>(a + c);
    float s = e8m0_to_f(sa[c / KV_TILE]);
    return make_uint4(atm_fp8_pair(codes.x, s), atm_fp8_pair(codes.x >> 16, s), atm_fp8_pair(codes.y, s),
                      atm_fp8_pair(codes.y >> 16, s));
}

__device__ __forceinline__ u32 atm_pack(float lo, float hi) {
    return (u32)f_to_bf16(lo) | ((u32)f_to_bf16(hi) << 16);
}

// The 64 threads of warps w and w ^ 4 (barrier 1 + w % 4; 0 is __syncthreads').
__device__ __forceinline__ void atm_pair_sync(int warp) {
    asm volatile("bar.sync %0, 64;" ::"r"(1 + (warp & 3)) : "memory");
}

// Output channels c, c + 1 of row r as the o-projection's bf16 input: rope channels (c >=
// nope) rotated back at the row's position by the tables un_cs / un_sn (k_rope's inverse,
// the same products), then rounded.
__device__ __forceinline__ u32 atm_out_pair(float x0, float x1, int c, int nope, int rd, int r, const float* un_cs,
                                            const float* un_sn) {
    if (c >= nope) {
        int halfrd = rd >> 1, k = (c - nope) >> 1;
        float cv = un_cs[(i64)r * halfrd + k], sv = -un_sn[(i64)r * halfrd + k];
        float y0 = rope_rotate0(x0, x1, cv, sv), y1 = rope_rotate1(x0, x1, cv, sv);
        x0 = y0;
        x1 = y1;
    }
    return atm_pack(x0, x1);
}

template <bool EXACT>
__device__ __forceinline__ void atm_body(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, const bf16_t* q_bf16, float* out, const float* un_cs, const float* un_sn, bf16_t* out_bf16,
                                           float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    extern __shared__ __align__(16) unsigned char atm_sh[];
    const int ldk = hd + ATM_PAD;
    unsigned long long* kaddr = (unsigned long long*)atm_sh;  // [2][ATM_T] key addresses
    unsigned long long* saddr = kaddr + 2 * ATM_T;            // [2][ATM_T] fp8 scale addresses
    float* sx = (float*)(saddr + 2 * ATM_T);                  // [8 warps][4 tiles][32 lanes][4] partial scores
    bf16_t* qs = (bf16_t*)(sx + 8 * 4 * 32 * 4);              // [ATM_H][ldk] queries
    bf16_t* ks = qs + ATM_H * ldk;                            // [2][ATM_T][ldk] keys
    bf16_t* qs_lo = ks + 2 * ATM_T * ldk;                     // EXACT: [ATM_H][ldk]
    int r = blockIdx.x, h0 = blockIdx.y * ATM_H, split = blockIdx.z;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const AttnRow keys = attn_row(r, pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, new_rows,
                                  new_scales, sel, topk, hd, window, win_off, rate, mode, comp_off, comp_epp,
                                  page_tokens, dt, rd, win_scale_off, comp_scale_off);
    int nk = attn_row_keys(keys, mode, rate, sel, topk, r);
    int k0 = split * split_keys, k1 = min(nk, k0 + split_keys);
    int nh = min(ATM_H, n_heads - h0);
    i64 rh = (i64)r * n_heads + h0;  // (row, first head) of this block
    if (k0 >= k1) {
        attn_empty_split(part_ml, rh, nh, nsplit, split);
        return;
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
                *reinterpret_cast<uint4*>(d) =
                    atm_fp8_chunk(a, (const unsigned char*)saddr[b * ATM_T + key], c8 * 8, nope);
            }
        }
    };
    // The first tile's copies go out before the queries are read.
    stage(0, 0);
    __syncthreads();
    load(0);
    tc_commit();
    // Unrolled so that several rows' loads are in flight per thread (the block is alone on
    // its SM: nothing else hides their latency).
#pragma unroll 8
    for (int i = tid * 4; i < ATM_H * hd; i += ATM_THREADS * 4) {
        int h = i / hd, c = i - h * hd;
        if (!EXACT && q_bf16) {
            // Already normed, roped and rounded (k_query_heads_bf16).
            *reinterpret_cast<uint2*>(qs + h * ldk + c) =
                h < nh ? *reinterpret_cast<const uint2*>(q_bf16 + (rh + h) * hd + c) : make_uint2(0u, 0u);
            continue;
        }
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
    int g = lane >> 2, tq = lane & 3;
    int hg = warp & 3, half = warp >> 2;
    int hdh = hd >> 1;             // channels per warp
    int c0 = half * hdh;           // this warp's first channel
    int nt = hdh >> 3;             // its 8-channel output tiles
    float* sx_mine = sx + warp * (4 * 32 * 4);
    const float* sx_pair = sx + (warp ^ 4) * (4 * 32 * 4);
    // Running max and sum of heads hg*16 + g (index 0) and + 8 (index 1).
    float mrun[2] = {NEG_INF, NEG_INF}, lrun[2] = {0.f, 0.f};
    float acc[ATM_MAXNT][4];
#pragma unroll
    for (int ni = 0; ni < ATM_MAXNT; ni++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[ni][e] = 0.f;
    for (int t = 0; t < ntiles; t++) {
        int b = t & 1;
        if (t + 1 < ntiles) stage(t + 1, b ^ 1);
        // The next addresses are visible, and every warp is done with tile t - 1 (whose
        // buffer the next copies overwrite, and whose partial scores the pair read).
        __syncthreads();
        if (t + 1 < ntiles) load(b ^ 1);
        tc_commit();
        tc_wait_prev();
        __syncthreads();
        const bf16_t* kb = ks + b * ATM_T * ldk;
        int lim = min(ATM_T, k1 - k0 - t * ATM_T);  // keys of this tile
        // s[j]: keys 8j .. 8j+7; [0], [1] head g, [2], [3] head g + 8.
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.f;
        {
            u32 qa = tc_smem(qs + (hg * 16 + (lane & 15)) * ldk + c0 + (lane >> 4) * 8);
            u32 qa_lo = tc_smem(qs_lo + (hg * 16 + (lane & 15)) * ldk + c0 + (lane >> 4) * 8);
            u32 ka = tc_smem(kb + ((lane & 7) + (lane >> 4) * 8) * ldk + c0 + ((lane >> 3) & 1) * 8);
            u32 kb16 = 16 * ldk * 2;  // 16 keys further, in bytes
#pragma unroll 4
            for (int kk = 0; kk < hdh; kk += 16) {
                u32 a[4], k01[4], k23[4];
                tc_ldsm_x4(qa + kk * 2, a);
                tc_ldsm_x4(ka + kk * 2, k01);
                tc_ldsm_x4(ka + kb16 + kk * 2, k23);
                tc_mma(s[0], a, k01[0], k01[1]);
                tc_mma(s[1], a, k01[2], k01[3]);
                tc_mma(s[2], a, k23[0], k23[1]);
                tc_mma(s[3], a, k23[2], k23[3]);
                if (EXACT) {
                    tc_ldsm_x4(qa_lo + kk * 2, a);
                    tc_mma(s[0], a, k01[0], k01[1]);
                    tc_mma(s[1], a, k01[2], k01[3]);
                    tc_mma(s[2], a, k23[0], k23[1]);
                    tc_mma(s[3], a, k23[2], k23[3]);
                }
            }
        }
        // Swap halves with the partner warp; both add (half 0) + (half 1).
#pragma unroll
        for (int j = 0; j < 4; j++)
            *reinterpret_cast<float4*>(sx_mine + (j * 32 + lane) * 4) = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
        atm_pair_sync(warp);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float4 o = *reinterpret_cast<const float4*>(sx_pair + (j * 32 + lane) * 4);
            float lo[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float sum = half == 0 ? s[j][e] + lo[e] : lo[e] + s[j][e];
                int col = j * 8 + 2 * tq + (e & 1);
                s[j][e] = col < lim ? sum * scale : NEG_INF;
            }
        }
        // Online softmax of heads g (i = 0) and g + 8 (i = 1).
        float alpha[2];
        u32 pa[2][4], pl[2][4];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 4; j++) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(mrun[i], mx);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int col = j * 8 + 2 * tq;
                float p0 = col < lim ? expf(s[j][2 * i] - mn) : 0.f;
                float p1 = col + 1 < lim ? expf(s[j][2 * i + 1] - mn) : 0.f;
                bf16_t b0 = f_to_bf16(p0), b1 = f_to_bf16(p1);
                // The sum of what the products take: the bf16 value, or (EXACT) p itself.
                sum += EXACT ? p0 + p1 : bf16_to_f(b0) + bf16_to_f(b1);
                // A operand of k-step j / 2: a[0] head g, keys 0-7 of the step; a[1] head
                // g + 8; a[2], a[3] keys 8-15.
                pa[j >> 1][(j & 1) * 2 + i] = (u32)b0 | ((u32)b1 << 16);
                if (EXACT) pl[j >> 1][(j & 1) * 2 + i] = atm_pack(p0 - bf16_to_f(b0), p1 - bf16_to_f(b1));
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            alpha[i] = expf(mrun[i] - mn);
            mrun[i] = mn;
            lrun[i] = lrun[i] * alpha[i] + sum;
        }
#pragma unroll
        for (int ni = 0; ni < ATM_MAXNT; ni++) {
            acc[ni][0] *= alpha[0];
            acc[ni][1] *= alpha[0];
            acc[ni][2] *= alpha[1];
            acc[ni][3] *= alpha[1];
        }
#pragma unroll
        for (int kq = 0; kq < 2; kq++) {
            const bf16_t* vrow = kb + (kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ldk + c0;
#pragma unroll
            for (int nj = 0; nj < ATM_MAXNT / 2; nj++) {
                if (2 * nj < nt) {
                    u32 v[4];
                    tc_ldsm_x4_t(tc_smem(vrow + nj * 16 + (lane >> 4) * 8), v);
                    tc_mma(acc[2 * nj], pa[kq], v[0], v[1]);
                    tc_mma(acc[2 * nj + 1], pa[kq], v[2], v[3]);
                    if (EXACT) {
                        tc_mma(acc[2 * nj], pl[kq], v[0], v[1]);
                        tc_mma(acc[2 * nj + 1], pl[kq], v[2], v[3]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int hh = hg * 16 + g + i * 8;
        if (hh >= nh) continue;
        float w = 1.f;
        float* dst;
        if (direct) {
            // The sink joins the softmax here (as in k_attention_combine for nsplit 1).
            w = attn_sink_weight(mrun[i], lrun[i], sinks[h0 + hh]);
            if (out_bf16) {
                // The o-projection's input: rope channels rotated back at the row's
                // position (k_rope's inverse, the same products), rounded to bf16.
                bf16_t* db = out_bf16 + (rh + hh) * hd;
#pragma unroll
                for (int ni = 0; ni < ATM_MAXNT; ni++)
                    if (ni < nt) {
                        int c = c0 + ni * 8 + 2 * tq;
                        *reinterpret_cast<u32*>(db + c) =
                            atm_out_pair(acc[ni][2 * i] * w, acc[ni][2 * i + 1] * w, c, nope, rd, r, un_cs, un_sn);
                    }
                continue;
            }
            dst = out + (rh + hh) * hd;
        } else {
            dst = part + ((rh + hh) * nsplit + split) * hd;
            if (half == 0 && tq == 0) {
                part_ml[((rh + hh) * nsplit + split) * 2] = mrun[i];
                part_ml[((rh + hh) * nsplit + split) * 2 + 1] = lrun[i];
            }
        }
#pragma unroll
        for (int ni = 0; ni < ATM_MAXNT; ni++)
            if (ni < nt)
                *reinterpret_cast<float2*>(dst + c0 + ni * 8 + 2 * tq) =
                    make_float2(acc[ni][2 * i] * w, acc[ni][2 * i + 1] * w);
    }
}

// Products in bf16 (bf16 and stored-format weights).
extern "C" __launch_bounds__(256, 1) __global__ void k_attention_mma(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, const bf16_t* q_bf16, float* out, const float* un_cs, const float* un_sn, bf16_t* out_bf16,
                                           float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    pdl_enter();
    atm_body<false>(pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, q, new_rows, new_scales, sinks, sel, topk, q_bf16, out, un_cs, un_sn, out_bf16, part,
        part_ml, n_heads, hd, window, win_off, rate, mode, comp_off, comp_epp, page_tokens, dt, scale, rd, win_scale_off,
        comp_scale_off, split_keys, nsplit, direct);
}

// Products of hi + lo bf16 halves, ~16 bits (gpu-check's A/B under fp32 weights).
extern "C" __launch_bounds__(256, 1) __global__ void k_attention_mma_exact(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, const bf16_t* q_bf16, float* out, const float* un_cs, const float* un_sn, bf16_t* out_bf16,
                                           float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    pdl_enter();
    atm_body<true>(pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, q, new_rows, new_scales, sinks, sel, topk, q_bf16, out, un_cs, un_sn, out_bf16, part,
        part_ml, n_heads, hd, window, win_off, rate, mode, comp_off, comp_epp, page_tokens, dt, scale, rd, win_scale_off,
        comp_scale_off, split_keys, nsplit, direct);
}

// fp8 KV entries (FlashMLA's V4 layout, dt 3) as bf16 rows of hd channels, the bits the
// kernels' own conversion gives (atm_fp8_pair; the rope channels copied): a prefill's rows
// read each key hundreds of times, so they read these rows (dt 1) instead of converting
// every key per tile (ops/attention_dequant.rs). One warp per entry, 8 channels per lane
// and step. Entry i of `out`: i < n_ring, slot i % window of the window ring of sequence
// i / window (its state slot from `seq`); then n_comp compressed entries, entry
// (i - n_ring) % comp_epp of page pt[(i - n_ring) / comp_epp] (the batch's page tables
// concatenated); then this forward's n_new keys as stored (new_rows, new_scales).
extern "C" __global__ void k_kv_dequant_bf16(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                             i64 state_bytes, const int* seq, const u32* pt,
                                             const unsigned char* new_rows, const unsigned char* new_scales,
                                             bf16_t* out, int n_ring, int n_comp, int n_new, int window, i64 win_off,
                                             i64 win_scale_off, i64 comp_off, i64 comp_scale_off, int comp_epp, int hd,
                                             int rd) {
    pdl_enter();
    i64 i = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (i >= (i64)n_ring + n_comp + n_new) return;
    int nope = hd - rd;
    i64 eb = fp8kv_row_bytes(nope, rd), sb = fp8kv_scale_bytes(nope);
    const unsigned char *a, *sa;
    if (i < n_ring) {
        const unsigned char* st = states + (i64)seq[(i / window) * SEQ_INTS + SEQ_STATE] * state_bytes;
        a = st + win_off + (i % window) * eb;
        sa = st + win_scale_off + (i % window) * sb;
    } else if (i < (i64)n_ring + n_comp) {
        i64 e = i - n_ring;
        const unsigned char* pg = pages + (i64)pt[e / comp_epp] * page_bytes;
        a = pg + comp_off + (e % comp_epp) * eb;
        sa = pg + comp_scale_off + (e % comp_epp) * sb;
    } else {
        i64 r = i - n_ring - n_comp;
        a = new_rows + r * eb;
        sa = new_scales + r * sb;
    }
    unsigned char* d = (unsigned char*)(out + i * hd);
    for (int c = lane * 8; c < hd; c += 256) *reinterpret_cast<uint4*>(d + c * 2) = atm_fp8_chunk(a, sa, c, nope);
}
