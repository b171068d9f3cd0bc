// Sink attention on Hopper's warpgroup tensor cores (wgmma, sm_90a): k_attention_mma's
// function (attention_mma.cu, compiled into the same module after it) at head_dim 512 and
// 64 heads per block, with the same roundings: keys exact in bf16, queries and
// probabilities rounded to bf16 for the products, scores, sums and outputs in fp32.
//
// Why: k_attention_mma gives each warp 16 heads, so every warp loads every key tile from
// shared memory through ldmatrix (4x per key) and waits on its own mma.sync chains; one
// wgmma of a warpgroup multiplies all 64 heads by a key tile read once by the tensor cores
// from shared memory, asynchronously.
//
// grid (rows, n_heads / 64, nsplit), 256 threads = two warpgroups. Block (r, y, s): heads
// y*64 .. +64 of row r over the row's keys s*split_keys .. (s+1)*split_keys (window, then
// compressed entries, as in the split kernel), in tiles of ATW_T = 64 keys. Warpgroup wg
// owns channels 256 wg .. +256: per tile
//   scores  S_wg[64 heads x 64 keys] = Q[:, half] K[:, half]^T, 16 wgmma m64n64k16 (both
//           operands from shared memory); each thread swaps its 32 partial scores with the
//           thread of the other warpgroup that holds the same (head, key) places (tid ^ 128,
//           a 64-thread named barrier per warp pair) and both add them in the same order
//           (half 0 + half 1), so both warpgroups hold the same scores, softmax and
//           probabilities;
//   softmax in registers, rows g and g + 8 of each warp's 16 heads, the row max and sum
//           across the lane quad; running max and sum in registers;
//   values  O_wg[64 x 256] += P V[:, half], the probabilities (bf16) straight from the score
//           accumulators into wgmma's A registers, V the same shared key tile read
//           MN-major: 4 k-steps of 16 keys x 4 wgmma m64n64k16 over 64-channel blocks.
// Output as k_attention_mma: direct (the sink joins here; fp32 `out`, or the o-projection's
// bf16 input with the rope channels rotated back) or the split kernel's partials.
//
// Shared memory (MmaPlan::shared_bytes in ops/attention_mma.rs), from a 1024-byte aligned
// base: queries [8 column blocks][64 heads][128 B], two key tiles of the same shape, the
// partial scores [8][256 threads] float4, two tiles' key and fp8 scale addresses. A column
// block holds 64 channels of every row, each row 128 bytes with its 16-byte chunks swizzled
// (chunk j of row x at j ^ (x % 8): wgmma's 128-byte swizzle), so the same tile is the K-major
// B of the scores and the MN-major B of the values.
#define ATW_T 64
#define ATW_HD 512
#define ATW_CB 8192
#define ATW_TILE_BYTES (8 * ATW_CB)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Byte offset of channels c .. c + 7 (c a multiple of 8) of row x in a [64 x 512] bf16 tile.
__device__ __forceinline__ u32 atw_off(int x, int c) {
    return (u32)((c >> 6) * ATW_CB + x * 128 + ((((c >> 3) & 7) ^ (x & 7)) << 4));
}

// A shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart, `lbo`
// between 64-element blocks along the leading dimension (MN-major operands; K-major ones
// ignore it).
__device__ __forceinline__ unsigned long long atw_desc(u32 addr, u32 lbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void atw_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void atw_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void atw_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keeps the compiler from touching accumulators across an asynchronous wgmma's issue/wait.
__device__ __forceinline__ void atw_keep(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

#define ATW_D8(i)                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define ATW_REGS32                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d = (acc ? d : 0) + A B: A [64 x 16] and B [16 x 64] K-major in shared memory.
__device__ __forceinline__ void atw_ss(float (&d)[32], unsigned long long a, unsigned long long b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATW_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : ATW_D8(0), ATW_D8(8), ATW_D8(16), ATW_D8(24)
        : "l"(a), "l"(b), "r"(acc));
}

// d += A B: A [64 x 16] bf16 in registers (mma.sync's A fragment layout, per warp 16 rows),
// B [16 x 64] MN-major in shared memory.
__device__ __forceinline__ void atw_rs(float (&d)[32], const u32 (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATW_REGS32
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : ATW_D8(0), ATW_D8(8), ATW_D8(16), ATW_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// Whether any of the four e4m3 codes of w is a NaN code (0x7f or 0xff): adding 1 to each
// byte's low 7 bits carries into its top bit only from 0x7f.
__device__ __forceinline__ bool atw_nan_code(u32 w) { return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u; }

// Eight e4m3 codes (lo: channels 0-3, hi: 4-7) times their tile's scale 2^(sb - 127) as
// bf16, the bits atm_fp8_pair gives. In hardware (e4m3x2_to_bf16x2, as moe_mma.cu's
// dequantization) where that is exact, 16 <= sb <= 134 (no bf16 subnormal, no overflow);
// NaN codes and other scales go through f32 as before.
__device__ __forceinline__ uint4 atw_fp8_chunk(u32 lo, u32 hi, u32 sb) {
    if (sb < 16u || sb > 134u || atw_nan_code(lo) || atw_nan_code(hi)) {
        float s = e8m0_to_f((unsigned char)sb);
        return make_uint4(atm_fp8_pair(lo, s), atm_fp8_pair(lo >> 16, s), atm_fp8_pair(hi, s),
                          atm_fp8_pair(hi >> 16, s));
    }
    u32 k2 = fp8_bf16x2_factor(sb);
    u32 codes[4] = {lo & 0xffffu, lo >> 16, hi & 0xffffu, hi >> 16}, out[4];
#pragma unroll
    for (int i = 0; i < 4; i++) out[i] = e4m3x2_to_bf16x2((unsigned short)codes[i], k2);
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Ordinary shared-memory writes (cp.async, st.shared) made visible to the tensor cores'
// reads; each writing thread, before the barrier.
__device__ __forceinline__ void atw_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void atw_body(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                         i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                         const int* positions, const float* q, const unsigned char* new_rows,
                                         const unsigned char* new_scales, const float* sinks, const int* sel,
                                         int topk, const bf16_t* q_bf16, float* out, const float* un_cs,
                                         const float* un_sn, bf16_t* out_bf16, float* part, float* part_ml,
                                         int n_heads, int window, i64 win_off, int rate, int mode, i64 comp_off,
                                         int comp_epp, int page_tokens, int dt, float scale, int rd,
                                         i64 win_scale_off, i64 comp_scale_off, int split_keys, int nsplit,
                                         int direct) {
    extern __shared__ __align__(1024) unsigned char atw_raw[];
    unsigned char* sh = (unsigned char*)(((unsigned long long)atw_raw + 1023) & ~1023ull);
    unsigned char* qs = sh;
    unsigned char* ks = sh + ATW_TILE_BYTES;
    float4* sx = (float4*)(sh + 3 * ATW_TILE_BYTES);
    unsigned long long* kaddr = (unsigned long long*)(sx + 8 * 256);  // [2][ATW_T]
    unsigned long long* saddr = kaddr + 2 * ATW_T;                    // [2][ATW_T]
    const int hd = ATW_HD;
    int r = blockIdx.x, h0 = blockIdx.y * 64, split = blockIdx.z;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const AttnRow keys = attn_row(r, pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, new_rows,
                                  new_scales, sel, topk, hd, window, win_off, rate, mode, comp_off, comp_epp,
                                  page_tokens, dt, rd, win_scale_off, comp_scale_off);
    int nk = attn_row_keys(keys, mode, rate, sel, topk, r);
    int k0 = split * split_keys, k1 = min(nk, k0 + split_keys);
    i64 rh = (i64)r * n_heads + h0;  // (row, first head) of this block
    if (k0 >= k1) {
        attn_empty_split(part_ml, rh, 64, nsplit, split);
        return;
    }
    int nope = hd - rd;
    int ntiles = (k1 - k0 + ATW_T - 1) / ATW_T;
    // Addresses of tile t's keys into slot t % 2 (past the split's keys: its last key
    // again, whose scores are masked, so that every loaded value is a finite key).
    auto stage = [&](int t) {
        if (tid < ATW_T) {
            unsigned long long a, sa;
            keys.key(min(k0 + t * ATW_T + tid, k1 - 1), a, sa);
            kaddr[(t & 1) * ATW_T + tid] = a;
            saddr[(t & 1) * ATW_T + tid] = sa;
        }
    };
    // Tile t's staged keys into its buffer: this thread's 16-byte chunk c8 (8 channels) of
    // keys tid / 64 + 4u. bf16 entries by cp.async; fp8 ones loaded 8 keys at a time, then
    // converted (codes times their tile's power-of-two scale, exact in bf16).
    const int c8 = tid & 63, c = c8 * 8;
    auto load = [&](int t) {
        unsigned char* kb = ks + (t & 1) * ATW_TILE_BYTES;
        const unsigned long long* ka = kaddr + (t & 1) * ATW_T;
        const unsigned long long* sa = saddr + (t & 1) * ATW_T;
        if (dt == 1) {
#pragma unroll 4
            for (int u = 0; u < 16; u++) {
                int key = (tid >> 6) + 4 * u;
                tc_cp16(kb + atw_off(key, c), (const unsigned char*)ka[key] + c * 2);
            }
            return;
        }
#pragma unroll
        for (int u0 = 0; u0 < 16; u0 += 8) {
            uint4 raw[8];
            u32 sb[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int key = (tid >> 6) + 4 * (u0 + u);
                const unsigned char* a = (const unsigned char*)ka[key];
                if (c < nope) {
                    uint2 codes = *reinterpret_cast<const uint2*>(a + c);
                    raw[u] = make_uint4(codes.x, codes.y, 0u, 0u);
                    sb[u] = ((const unsigned char*)sa[key])[c / KV_TILE];
                } else {
                    raw[u] = *reinterpret_cast<const uint4*>(a + nope + (i64)(c - nope) * 2);
                    sb[u] = 127u;
                }
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int key = (tid >> 6) + 4 * (u0 + u);
                uint4 w = raw[u];
                if (c < nope) {
                    w = atw_fp8_chunk(raw[u].x, raw[u].y, sb[u]);
                }
                *reinterpret_cast<uint4*>(kb + atw_off(key, c)) = w;
            }
        }
    };
    // The first tile's copies go out before the queries are read.
    stage(0);
    __syncthreads();
    load(0);
#pragma unroll 4
    for (int u = 0; u < 16; u++) {
        int h = (tid >> 6) + 4 * u;
        unsigned char* d = qs + atw_off(h, c);
        if (q_bf16) {
            // Already normed, roped and rounded (k_query_heads_bf16).
            tc_cp16(d, q_bf16 + (rh + h) * hd + c);
        } else {
            const float* src = q + (rh + h) * hd + c;
            float4 v0 = *reinterpret_cast<const float4*>(src), v1 = *reinterpret_cast<const float4*>(src + 4);
            *reinterpret_cast<uint4*>(d) = make_uint4(atm_pack(v0.x, v0.y), atm_pack(v0.z, v0.w),
                                                      atm_pack(v1.x, v1.y), atm_pack(v1.z, v1.w));
        }
    }
    tc_commit();
    int g = lane >> 2, tq = lane & 3;
    int hg = warp & 3, wg = warp >> 2;
    u32 qbase = tc_smem(qs), kbase = tc_smem(ks);
    // Running max and sum of heads 16 hg + g (index 0) and + 8 (index 1).
    float mrun[2] = {NEG_INF, NEG_INF}, lrun[2] = {0.f, 0.f};
    // o[nb]: channels 256 wg + 64 nb .. +64, wgmma's accumulator layout.
    float o[4][32];
#pragma unroll
    for (int nb = 0; nb < 4; nb++)
#pragma unroll
        for (int e = 0; e < 32; e++) o[nb][e] = 0.f;
    // One barrier per tile: tile t's keys and tile t + 1's addresses are visible, and every
    // warp is done with tile t - 1 (its buffer and address slot, which tile t + 1 takes
    // next, and the partial scores the pairs read). Tile t + 1's keys load while the tensor
    // cores score tile t.
    for (int t = 0; t < ntiles; t++) {
        if (t + 1 < ntiles) stage(t + 1);
        asm volatile("cp.async.wait_all;" ::: "memory");
        atw_proxy_fence();
        __syncthreads();
        u32 kt = kbase + (t & 1) * ATW_TILE_BYTES;
        int lim = min(ATW_T, k1 - k0 - t * ATW_T);  // keys of this tile
        // s[4j + e]: keys 8j + 2tq + (e & 1), head 16 hg + g + 8 (e >> 1).
        float s[32];
#pragma unroll
        for (int e = 0; e < 32; e++) s[e] = 0.f;
        atw_fence();
#pragma unroll
        for (int k = 0; k < 16; k++) {
            u32 off = (4 * wg + (k >> 2)) * ATW_CB + (k & 3) * 32;
            atw_ss(s, atw_desc(qbase + off, 16), atw_desc(kt + off, 16), k);
        }
        atw_commit();
        if (t + 1 < ntiles) {
            load(t + 1);
            tc_commit();
        }
        atw_wait();
        atw_keep(s);
        // Swap halves with the other warpgroup's thread; both add (half 0) + (half 1).
#pragma unroll
        for (int j = 0; j < 8; j++) sx[j * 256 + tid] = make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
        atm_pair_sync(warp);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float4 p = sx[j * 256 + (tid ^ 128)];
            float other[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float sum = wg == 0 ? s[4 * j + e] + other[e] : other[e] + s[4 * j + e];
                int col = j * 8 + 2 * tq + (e & 1);
                s[4 * j + e] = col < lim ? sum * scale : NEG_INF;
            }
        }
        // Online softmax of heads g (i = 0) and g + 8 (i = 1); pa[kq]: the A fragment of
        // keys 16 kq .. +16.
        float alpha[2];
        u32 pa[4][4];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; j++) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(mrun[i], mx);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                int col = j * 8 + 2 * tq;
                float p0 = col < lim ? expf(s[4 * j + 2 * i] - mn) : 0.f;
                float p1 = col + 1 < lim ? expf(s[4 * j + 2 * i + 1] - mn) : 0.f;
                bf16_t b0 = f_to_bf16(p0), b1 = f_to_bf16(p1);
                // The sum of what the products take: the bf16 values.
                sum += bf16_to_f(b0) + bf16_to_f(b1);
                pa[j >> 1][(j & 1) * 2 + i] = (u32)b0 | ((u32)b1 << 16);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            alpha[i] = expf(mrun[i] - mn);
            mrun[i] = mn;
            lrun[i] = lrun[i] * alpha[i] + sum;
        }
        // Once the running max settles, alpha is 1 in most tiles: skipped per warp (exact).
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e = 0; e < 32; e++) o[nb][e] *= alpha[(e >> 1) & 1];
        }
        atw_fence();
#pragma unroll
        for (int kq = 0; kq < 4; kq++)
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
                atw_rs(o[nb], pa[kq], atw_desc(kt + (4 * wg + nb) * ATW_CB + kq * 16 * 128, ATW_CB));
        atw_commit();
        atw_wait();
#pragma unroll
        for (int nb = 0; nb < 4; nb++) atw_keep(o[nb]);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int hh = hg * 16 + g + i * 8;
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
                for (int nb = 0; nb < 4; nb++)
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        int cc = 256 * wg + 64 * nb + 8 * j + 2 * tq;
                        *reinterpret_cast<u32*>(db + cc) = atm_out_pair(o[nb][4 * j + 2 * i] * w,
                                                                        o[nb][4 * j + 2 * i + 1] * w, cc, nope, rd,
                                                                        r, un_cs, un_sn);
                    }
                continue;
            }
            dst = out + (rh + hh) * hd;
        } else {
            dst = part + ((rh + hh) * nsplit + split) * hd;
            if (wg == 0 && tq == 0) {
                part_ml[((rh + hh) * nsplit + split) * 2] = mrun[i];
                part_ml[((rh + hh) * nsplit + split) * 2 + 1] = lrun[i];
            }
        }
#pragma unroll
        for (int nb = 0; nb < 4; nb++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                *reinterpret_cast<float2*>(dst + 256 * wg + 64 * nb + 8 * j + 2 * tq) =
                    make_float2(o[nb][4 * j + 2 * i] * w, o[nb][4 * j + 2 * i + 1] * w);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Products in bf16 on wgmma: head_dim 512, n_heads a multiple of 64, an sm_90a build (the
// host takes it only there; elsewhere the body traps).
extern "C" __launch_bounds__(256, 1) __global__ void k_attention_wgmma(const unsigned char* pages, const unsigned char* states, i64 page_bytes,
                                           i64 state_bytes, const int* seq, const u32* pt, const int* row_seq,
                                           const int* positions, const float* q, const unsigned char* new_rows,
                                           const unsigned char* new_scales, const float* sinks, const int* sel,
                                           int topk, const bf16_t* q_bf16, float* out, const float* un_cs, const float* un_sn, bf16_t* out_bf16,
                                           float* part, float* part_ml, int n_heads, int hd,
                                           int window, i64 win_off, int rate, int mode, i64 comp_off, int comp_epp,
                                           int page_tokens, int dt, float scale, int rd, i64 win_scale_off,
                                           i64 comp_scale_off, int split_keys, int nsplit, int direct) {
    pdl_enter();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (hd != ATW_HD) __trap();
    atw_body(pages, states, page_bytes, state_bytes, seq, pt, row_seq, positions, q, new_rows, new_scales, sinks, sel,
             topk, q_bf16, out, un_cs, un_sn, out_bf16, part, part_ml, n_heads, window, win_off, rate, mode, comp_off,
             comp_epp, page_tokens, dt, scale, rd, win_scale_off, comp_scale_off, split_keys, nsplit, direct);
#else
    __trap();
#endif
}
