// Routed experts on tensor cores inside decode steps (ops/moe_mma.rs): each expert's picks
// against its weights as bf16 mma.sync m16n8k16 with fp32 accumulators, weights as the
// A operand (16 weight rows per warp) and picks as B (8 per n-tile), so a step's few picks
// per expert still fill the instruction. Weights are read in their own format (bf16,
// stored FP8 or FP4) once per 32 picks and dequantized in registers to bf16, which holds
// every stored weight exactly; the activations come in as bf16 (the gate/up input rounded,
// the SwiGLU output written in bf16), as in the padded cuBLAS path.
//
// A block owns 128 weight rows and streams them through shared memory in stages of 128
// bytes per row (64 bf16, 128 FP8 or 256 FP4 weights), with the same columns of its picks'
// activation rows, by cp.async, STAGES deep, so many bytes are in flight per SM.
//
// The reduction dimension is permuted, identically for both operands: lane (g, t) takes
// the 16-byte units p = t and t + 4 of its weight rows' stage slab (VEC weights each), and
// k-step s of a unit takes its elements 4s .. 4s + 3 as the fragment's k = 2t, 2t + 1,
// 2t + 8, 2t + 9; the activation fragments of pick g take the same elements of the pick's
// row. A dot product does not depend on which terms share an instruction, only on the
// summation order, which the fp32 accumulators fix per (k-step, lane).
//
// grid (E, ceil(units / 64 or 128)), 8 warps; blocks past the used experts return.
// Gate/up: warp w owns intermediate units 64 y + 8 w + (0..8), its M rows g = gate row of
// unit g, g + 8 = up row of unit g, so SwiGLU runs on the accumulators. Down: warp w owns
// output channels 128 y + 16 w + (0..16).
// Requires: K a multiple of the stage's weights (64 bf16, 128 FP8, 256 FP4), 16-byte
// aligned weight and activation rows. Dynamic shared memory: STAGES x (128 x 128 bytes of
// weights + 32 pick rows x the stage's bf16 activations) (ops/moe_mma.rs `shared_bytes`).

// PT: n-tiles of 8 picks held at once, a kernel's template parameter: 4 (32 picks per
// pass, two blocks per SM) or 1 for batches of at most 8 rows (8 picks; 80 registers and
// a quarter of the activation tile, so three blocks per SM: more warps hide the latency of
// the dequantizing arithmetic, which bounds these kernels at small batches).
#define MMA_WARPS 8
#define MMA_ROWS 128  // weight rows per block, 16 per warp
#define MMA_SLAB 128  // bytes of each weight row per stage

__device__ __forceinline__ u32 mm_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <int N>
__device__ __forceinline__ void mm_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A weight format as the kernels stream it: VEC weights per 16-byte unit, KS per stage
// slab, STAGES of them in shared memory; `bytes` a row's first byte; the scale of the unit
// starting at column k (`Scale`, in the form `pair` takes); pair j of a unit (its four
// words) as bf16 (weights 2j, 2j + 1; exact: FP8 and FP4 values times a power of two fit
// bf16). ODD_X: the activation tile's swizzle of odd pick rows (conflict-free reads).
// STAGE_SCALE: a row has one scale across a stage slab.
struct SliceBf16 {
    static constexpr int VEC = 8, KS = 64, STAGES = 4, ODD_X = 4;
    static constexpr bool HAS_SLOW = false, STAGE_SCALE = true;
    typedef float Scale;
    __device__ static const unsigned char* bytes(const RowBf16& r) { return (const unsigned char*)r.p; }
    __device__ static Scale scale(const RowBf16&, int) { return 1.f; }
    __device__ static bool fast(Scale) { return true; }
    template <bool FAST>
    __device__ static u32 pair(const u32 (&w)[4], Scale, int j) { return w[j]; }
};

struct SliceFp8 {
    static constexpr int VEC = 16, KS = 128, STAGES = 4, ODD_X = 1;
    // One scale per 128 columns: a whole stage.
    static constexpr bool HAS_SLOW = true, STAGE_SCALE = true;
    typedef u32 Scale;  // the ue8m0 byte
    __device__ static const unsigned char* bytes(const RowFp8& r) { return r.q; }
    __device__ static Scale scale(const RowFp8& r, int c) { return r.s[c >> 7]; }
    // Scales up to 2^7 (all that checkpoints hold) take the hardware conversion, on sm_89+.
    __device__ static bool fast(Scale sb) {
#if __CUDA_ARCH__ >= 890
        return sb <= 134;
#else
        return false;
#endif
    }
    template <bool FAST>
    __device__ static u32 pair(const u32 (&w)[4], Scale sb, int j) {
        u32 b = w[j >> 1] >> (16 * (j & 1));
#if __CUDA_ARCH__ >= 890
        if (FAST) return e4m3x2_to_bf16x2((unsigned short)b, fp8_bf16x2_factor(sb));
#endif
        // Larger scales, and before sm_89 (no e4m3 conversion): through f32, e4m3w's 2^120
        // folded in.
        float sc = e8m0_to_f((unsigned char)sb) * 0x1p120f;
        float lo = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * sc;
        float hi = __uint_as_float(((b & 0x8000u) << 16) | ((b & 0x7f00u) << 12)) * sc;
        return mm_pack(lo, hi);
    }
};

struct SliceFp4 {
    static constexpr int VEC = 32, KS = 256, STAGES = 3, ODD_X = 2;
    static constexpr bool HAS_SLOW = false, STAGE_SCALE = false;
    typedef float Scale;
    __device__ static const unsigned char* bytes(const RowFp4& r) { return r.q; }
    __device__ static bool fast(Scale) { return true; }
    // e2m1w's 2^126 folded into the group scale.
    __device__ static Scale scale(const RowFp4& r, int c) { return e8m0_to_f(r.s[c >> 5]) * 0x1p126f; }
    template <bool FAST>
    __device__ static u32 pair(const u32 (&w)[4], Scale sc, int j) {
        u32 b = w[j >> 2] >> (8 * (j & 3));
        float lo = __uint_as_float(((b & 8u) << 28) | ((b & 7u) << 22)) * sc;
        float hi = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x70u) << 18)) * sc;
        return mm_pack(lo, hi);
    }
};

// Shared-memory tile offsets: 16-byte unit u of weight row r and of pick row r, swizzled so
// a warp's 8-lane read phases hit 8 distinct unit columns.
__device__ __forceinline__ int mm_w_unit(int r, int u) { return u ^ ((r & 1) << 2); }
template <typename S>
__device__ __forceinline__ int mm_a_unit(int r, int u) {
    return u ^ ((u >> 3) & 1) ^ ((r & 1) ? S::ODD_X : 0);
}

template <typename S, int PT>
struct MmaTile {
    static constexpr int PICKS = 8 * PT;
    static constexpr int A_UNITS = S::KS * 2 / 16;  // 16-byte units of a pick row per stage
    static constexpr int W_BYTES = MMA_ROWS * MMA_SLAB;
    static constexpr int STAGE = W_BYTES + PICKS * A_UNITS * 16;
    static constexpr int W_PER_THREAD = MMA_ROWS * (MMA_SLAB / 16) / (32 * MMA_WARPS);
    static constexpr int A_PER_THREAD = (PICKS * A_UNITS + 32 * MMA_WARPS - 1) / (32 * MMA_WARPS);
};

// One 16-byte unit of the two weight rows against every n-tile: 8 activations (two k-steps)
// of each per pass. A macro for the two conversions (FAST: the format's in-range one).
#define MM_UNIT(FAST)                                                                                          \
    do {                                                                                                       \
        _Pragma("unroll") for (int q = 0; q < S::VEC / 8; q++) {                                               \
            u32 b[PT][4];                                                                          \
            _Pragma("unroll") for (int nt = 0; nt < PT; nt++) {                                   \
                if (nt < tiles) {                                                                              \
                    int pr = nt * 8 + g;                                                                       \
                    uint4 v = *reinterpret_cast<const uint4*>(                                                 \
                        at + (pr * T::A_UNITS + mm_a_unit<S>(pr, p * (S::VEC / 8) + q)) * 16);                  \
                    b[nt][0] = v.x; b[nt][1] = v.y; b[nt][2] = v.z; b[nt][3] = v.w;                            \
                }                                                                                              \
            }                                                                                                  \
            _Pragma("unroll") for (int s = 0; s < 2; s++) {                                                    \
                int j = 4 * q + 2 * s;                                                                         \
                u32 a[4] = {S::template pair<FAST>(wl, cl, j), S::template pair<FAST>(wh, ch, j),              \
                            S::template pair<FAST>(wl, cl, j + 1), S::template pair<FAST>(wh, ch, j + 1)};     \
                _Pragma("unroll") for (int nt = 0; nt < PT; nt++) if (nt < tiles)                 \
                    tc_mma(acc[nt], a, b[nt][2 * s], b[nt][2 * s + 1]);                                        \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)

// The picks `picks[0 .. n)` (null: picks 0 .. n, a dense GEMM's rows) of expert `e`
// against stages [s0, s1) of its weights. GATE_UP: x bf16 [rows, H] -> act bf16 [picks, I]
// (SwiGLU of the gate and up rows). Otherwise: x bf16 [picks, K] -> out f32 [picks, units]
// (a split's partial sums where [s0, s1) is not the whole of K).
// `units`: I (gate/up) or the outputs; `K`: the reduction; `per_row`: k (gate/up: pick ->
// row) or 1.
template <bool GATE_UP, typename S, int PT, typename M>
__device__ void mm_run(const bf16_t* x, i64 ldx, M w, const int* picks, int n, int e, void* out, int units, int K,
                       int per_row, float limit, int s0, int s1) {
    typedef MmaTile<S, PT> T;
    extern __shared__ __align__(16) unsigned char mm_sh[];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, t = lane & 3;
    // Tile row r's weight row: gate/up rows interleave per warp (8 gate, then their 8 up).
    auto weight_row = [&](int r) -> i64 {
        if (GATE_UP) {
            int unit = min((int)blockIdx.y * (8 * MMA_WARPS) + 8 * (r >> 4) + (r & 7), units - 1);
            return (i64)e * 2 * units + ((r & 15) >= 8 ? units : 0) + unit;
        }
        return (i64)e * units + min((int)blockIdx.y * MMA_ROWS + r, units - 1);
    };
    // The rows this thread copies (unit tid % 8 of rows tid / 8 + 32 j) and computes.
    const unsigned char* wsrc[T::W_PER_THREAD];
#pragma unroll
    for (int j = 0; j < T::W_PER_THREAD; j++) wsrc[j] = S::bytes(w.row(weight_row((tid >> 3) + 32 * j))) + (tid & 7) * 16;
    int r_lo = 16 * warp + g, r_hi = r_lo + 8;
    auto lo = w.row(weight_row(r_lo)), hi = w.row(weight_row(r_hi));
    int u_lo, u_hi;  // the output units of accumulator rows g and g + 8
    if (GATE_UP) {
        u_lo = u_hi = blockIdx.y * (8 * MMA_WARPS) + warp * 8 + g;
    } else {
        u_lo = blockIdx.y * MMA_ROWS + r_lo;
        u_hi = blockIdx.y * MMA_ROWS + r_hi;
    }
    auto pick_at = [&](int j) -> i64 { return picks ? picks[j] : j; };
    for (int p0 = 0; p0 < n; p0 += T::PICKS) {
        int np = min(T::PICKS, n - p0), tiles = (np + 7) / 8;
        // The activation units this thread copies: pick row i / A_UNITS, unit i % A_UNITS.
        const unsigned char* asrc[T::A_PER_THREAD];
#pragma unroll
        for (int j = 0; j < T::A_PER_THREAD; j++) {
            int i = tid + 32 * MMA_WARPS * j, pr = i / T::A_UNITS;
            asrc[j] = pr < np && i < T::PICKS * T::A_UNITS
                          ? (const unsigned char*)(x + pick_at(p0 + pr) / per_row * ldx) + (i % T::A_UNITS) * 16
                          : nullptr;
        }
        auto issue = [&](int st) {
            unsigned char* wt = mm_sh + ((st - s0) % S::STAGES) * T::STAGE;
            unsigned char* at = wt + T::W_BYTES;
#pragma unroll
            for (int j = 0; j < T::W_PER_THREAD; j++) {
                int r = (tid >> 3) + 32 * j;
                tc_cp16(wt + r * MMA_SLAB + mm_w_unit(r, tid & 7) * 16, wsrc[j] + (i64)st * MMA_SLAB);
            }
#pragma unroll
            for (int j = 0; j < T::A_PER_THREAD; j++) {
                if (asrc[j]) {
                    int i = tid + 32 * MMA_WARPS * j, pr = i / T::A_UNITS;
                    tc_cp16(at + (pr * T::A_UNITS + mm_a_unit<S>(pr, i % T::A_UNITS)) * 16,
                            asrc[j] + (i64)st * S::KS * 2);
                }
            }
        };
        float acc[PT][4];
#pragma unroll
        for (int nt = 0; nt < PT; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[nt][q] = 0.f;
#pragma unroll
        for (int st = s0; st < s0 + S::STAGES - 1; st++) {
            if (st < s1) issue(st);
            tc_commit();
        }
        // Scales of units t and t + 4 of both rows, one stage ahead (their loads are not in
        // the copies' pipeline).
        typename S::Scale sc[2][2], sn[2][2];
        // (One load per row where a scale spans the stage: both units share it.)
        auto scales = [&](int k0, typename S::Scale(&o)[2][2]) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int c = min(k0, K - S::KS) + (t + 4 * h) * S::VEC;
                o[h][0] = S::STAGE_SCALE && h ? o[0][0] : S::scale(lo, c);
                o[h][1] = S::STAGE_SCALE && h ? o[0][1] : S::scale(hi, c);
            }
        };
        scales(s0 * S::KS, sc);
        for (int st = s0; st < s1; st++) {
            scales((st + 1) * S::KS, sn);
            mm_wait<S::STAGES - 2>();
            __syncthreads();
            if (st + S::STAGES - 1 < s1) issue(st + S::STAGES - 1);
            tc_commit();
            const unsigned char* wt = mm_sh + ((st - s0) % S::STAGES) * T::STAGE;
            const unsigned char* at = wt + T::W_BYTES;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int p = t + 4 * h;
                uint4 vl = *reinterpret_cast<const uint4*>(wt + r_lo * MMA_SLAB + mm_w_unit(r_lo, p) * 16);
                uint4 vh = *reinterpret_cast<const uint4*>(wt + r_hi * MMA_SLAB + mm_w_unit(r_hi, p) * 16);
                const u32 wl[4] = {vl.x, vl.y, vl.z, vl.w}, wh[4] = {vh.x, vh.y, vh.z, vh.w};
                typename S::Scale cl = sc[h][0], ch = sc[h][1];
                // The format's conversion for in-range scales where the whole warp has them.
                if (!S::HAS_SLOW || __all_sync(0xffffffffu, S::fast(cl) && S::fast(ch)))
                    MM_UNIT(true);
                else
                    MM_UNIT(false);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                sc[h][0] = sn[h][0];
                sc[h][1] = sn[h][1];
            }
        }
        mm_wait<0>();
        __syncthreads();  // the next pick group's copies reuse the stages
        // Accumulator q: row g (q < 2) or g + 8, pick 2t + (q & 1) of the n-tile.
#pragma unroll
        for (int nt = 0; nt < PT; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int j = nt * 8 + 2 * t + c;
                if (j >= np) continue;
                i64 pick = pick_at(p0 + j);
                if (GATE_UP) {
                    if (u_lo < units)
                        ((bf16_t*)out)[pick * units + u_lo] = f_to_bf16(swiglu_(acc[nt][c], acc[nt][2 + c], limit));
                } else {
                    float* y = (float*)out + pick * units;
                    if (u_lo < units) y[u_lo] = acc[nt][c];
                    if (u_hi < units) y[u_hi] = acc[nt][2 + c];
                }
            }
        }
    }
}

// Expert `active[blockIdx.x]`'s picks, the whole reduction.
template <bool GATE_UP, typename S, int PT, typename M>
__device__ void moe_mma(const bf16_t* x, M w, const int* list, const int* count, const int* active, void* out,
                        int rows, int E, int units, int K, int per_row, float limit) {
    if ((int)blockIdx.x >= active[E]) return;
    int e = active[blockIdx.x];
    mm_run<GATE_UP, S, PT>(x, K, w, list + (i64)e * rows, count[e], e, out, units, K, per_row, limit, 0, K / S::KS);
}

// A dense GEMM y = x @ w^T of `rows` rows (decode batches), per
// group of `dout` outputs (group i: x's columns i K .., x row stride ldx): grid
// (ceil(rows / 8 PT), ceil(N / 128), splits), block x taking rows 8 PT x .. (the blocks of
// one weight slab run together, so it is read from memory about once); split z writes its
// stages' partial sums to ys + z rows N, which k_split_sum adds in split order. dout is a
// multiple of 128 where there are several groups (a block within one group).
template <typename S, int PT, typename M>
__device__ void matmul_mma(const bf16_t* x, int ldx, M w, float* ys, int rows, int N, int K, int dout) {
    int nst = K / S::KS, z = blockIdx.z, splits = gridDim.z;
    int s0 = (int)((i64)nst * z / splits), s1 = (int)((i64)nst * (z + 1) / splits);
    int r0 = blockIdx.x * 8 * PT, group = (int)blockIdx.y * MMA_ROWS / dout;
    mm_run<false, S, PT>(x + (i64)r0 * ldx + (i64)group * K, ldx, w, nullptr, min(8 * PT, rows - r0), 0,
                     ys + (i64)z * rows * N + (i64)r0 * N, N, K, 1, 0.f, s0, s1);
}

// One kernel per weight format and pick tile, each with its own register allocation
// (written out: the handles' signature test reads each parameter list). `_p8`: 8 picks
// per pass (PT = 1, three blocks per SM), for batches of at most 8 rows. x: bf16 [rows,
// H]; act: bf16 [rows * k, I]; y: f32 [rows * k, H].
extern "C" __launch_bounds__(256, 2) __global__ void k_moe_gate_up_mma_bf16(
    const bf16_t* x, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, bf16_t* act, int rows, int E, int H, int I, int k, float limit) {
    pdl_enter();
    moe_mma<true, SliceBf16, 4>(x, MatBf16{(const bf16_t*)w, H}, list, count, active, act, rows, E, I, H, k, limit);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_moe_down_mma_bf16(
    const bf16_t* act, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_mma<false, SliceBf16, 4>(act, MatBf16{(const bf16_t*)w, I}, list, count, active, y, rows, E, H, I, 1, 0.f);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_moe_gate_up_mma_fp8(
    const bf16_t* x, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, bf16_t* act, int rows, int E, int H, int I, int k, float limit) {
    pdl_enter();
    moe_mma<true, SliceFp8, 4>(x, MatFp8{w, s, H, group_rows}, list, count, active, act, rows, E, I, H, k, limit);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_moe_down_mma_fp8(
    const bf16_t* act, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_mma<false, SliceFp8, 4>(act, MatFp8{w, s, I, group_rows}, list, count, active, y, rows, E, H, I, 1, 0.f);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_moe_gate_up_mma_fp4(
    const bf16_t* x, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, bf16_t* act, int rows, int E, int H, int I, int k, float limit) {
    pdl_enter();
    moe_mma<true, SliceFp4, 4>(x, MatFp4{w, s, H}, list, count, active, act, rows, E, I, H, k, limit);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_moe_down_mma_fp4(
    const bf16_t* act, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_mma<false, SliceFp4, 4>(act, MatFp4{w, s, I}, list, count, active, y, rows, E, H, I, 1, 0.f);
}

// Dense weights (bf16, FP8 block-scaled, FP4): x bf16 [rows, ldx]; ys f32 [splits, rows, N].
extern "C" __launch_bounds__(256, 2) __global__ void k_matmul_mma_bf16(
    const bf16_t* x, int ldx, const unsigned char* w, const unsigned char* s, int group_rows, float* ys, int rows,
    int N, int K, int dout) {
    pdl_enter();
    matmul_mma<SliceBf16, 4>(x, ldx, MatBf16{(const bf16_t*)w, K}, ys, rows, N, K, dout);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_matmul_mma_fp8(
    const bf16_t* x, int ldx, const unsigned char* w, const unsigned char* s, int group_rows, float* ys, int rows,
    int N, int K, int dout) {
    pdl_enter();
    matmul_mma<SliceFp8, 4>(x, ldx, MatFp8{w, s, K, group_rows}, ys, rows, N, K, dout);
}

extern "C" __launch_bounds__(256, 2) __global__ void k_matmul_mma_fp4(
    const bf16_t* x, int ldx, const unsigned char* w, const unsigned char* s, int group_rows, float* ys, int rows,
    int N, int K, int dout) {
    pdl_enter();
    matmul_mma<SliceFp4, 4>(x, ldx, MatFp4{w, s, K}, ys, rows, N, K, dout);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_moe_gate_up_mma_bf16_p8(
    const bf16_t* x, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, bf16_t* act, int rows, int E, int H, int I, int k, float limit) {
    pdl_enter();
    moe_mma<true, SliceBf16, 1>(x, MatBf16{(const bf16_t*)w, H}, list, count, active, act, rows, E, I, H, k, limit);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_moe_down_mma_bf16_p8(
    const bf16_t* act, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_mma<false, SliceBf16, 1>(act, MatBf16{(const bf16_t*)w, I}, list, count, active, y, rows, E, H, I, 1, 0.f);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_moe_gate_up_mma_fp8_p8(
    const bf16_t* x, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, bf16_t* act, int rows, int E, int H, int I, int k, float limit) {
    pdl_enter();
    moe_mma<true, SliceFp8, 1>(x, MatFp8{w, s, H, group_rows}, list, count, active, act, rows, E, I, H, k, limit);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_moe_down_mma_fp8_p8(
    const bf16_t* act, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_mma<false, SliceFp8, 1>(act, MatFp8{w, s, I, group_rows}, list, count, active, y, rows, E, H, I, 1, 0.f);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_moe_gate_up_mma_fp4_p8(
    const bf16_t* x, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, bf16_t* act, int rows, int E, int H, int I, int k, float limit) {
    pdl_enter();
    moe_mma<true, SliceFp4, 1>(x, MatFp4{w, s, H}, list, count, active, act, rows, E, I, H, k, limit);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_moe_down_mma_fp4_p8(
    const bf16_t* act, const unsigned char* w, const unsigned char* s, int group_rows, const int* list,
    const int* active, const int* count, float* y, int rows, int E, int H, int I) {
    pdl_enter();
    moe_mma<false, SliceFp4, 1>(act, MatFp4{w, s, I}, list, count, active, y, rows, E, H, I, 1, 0.f);
}

// Dense weights (bf16, FP8 block-scaled, FP4): x bf16 [rows, ldx]; ys f32 [splits, rows, N].
extern "C" __launch_bounds__(256, 3) __global__ void k_matmul_mma_bf16_p8(
    const bf16_t* x, int ldx, const unsigned char* w, const unsigned char* s, int group_rows, float* ys, int rows,
    int N, int K, int dout) {
    pdl_enter();
    matmul_mma<SliceBf16, 1>(x, ldx, MatBf16{(const bf16_t*)w, K}, ys, rows, N, K, dout);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_matmul_mma_fp8_p8(
    const bf16_t* x, int ldx, const unsigned char* w, const unsigned char* s, int group_rows, float* ys, int rows,
    int N, int K, int dout) {
    pdl_enter();
    matmul_mma<SliceFp8, 1>(x, ldx, MatFp8{w, s, K, group_rows}, ys, rows, N, K, dout);
}

extern "C" __launch_bounds__(256, 3) __global__ void k_matmul_mma_fp4_p8(
    const bf16_t* x, int ldx, const unsigned char* w, const unsigned char* s, int group_rows, float* ys, int rows,
    int N, int K, int dout) {
    pdl_enter();
    matmul_mma<SliceFp4, 1>(x, ldx, MatFp4{w, s, K}, ys, rows, N, K, dout);
}

// y[i] = sum over splits z (in order) of ys[z, i]; n = rows N.
extern "C" __global__ void k_split_sum(const float* ys, float* y, i64 n, int splits) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = 0.f;
        for (int z = 0; z < splits; z++) v += ys[z * n + i];
        y[i] = v;
    }
}
