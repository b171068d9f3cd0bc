// Sampling on the device: the greedy token of each row of a decode step's fp32 logits,
// so that only ids (not `vocab`-long rows) go back to the host.

// The better of two (value, id) candidates under pdserve_engine::sampling::argmax's rule:
// the higher value, ties to the lower id. A missing candidate is (-inf, INT_MAX): every
// samplable value beats it.
__device__ __forceinline__ void argmax_merge(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// grid (rows, parts): block (r, p) takes ids [p * span, min(cols, (p + 1) * span)) of row r
// of `logits` ([rows, cols]) and writes its best (value, id), (-inf, INT_MAX) when none is
// samplable, and whether all its logits are finite to part_v / part_i / part_f [r * parts
// + p]. Each thread scans its strided ids in ascending order keeping the first of equal
// maxima (`v > bv` is false for NaN, and for -inf against the empty candidate); the merges
// keep the lower id of equal values, so a part's result is the sequential scan's whatever
// the block size, and k_argmax_rows' merge of the parts in order is the whole row's.
extern "C" __global__ void k_argmax_parts(const float* logits, int cols, int span, float* part_v, int* part_i,
                                          int* part_f) {
    pdl_enter();
    const float* x = logits + (i64)blockIdx.x * cols;
    int lo = blockIdx.y * span, hi = min(cols, lo + span);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    int finite = 1;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = x[i];
        finite &= isfinite(v) ? 1 : 0;
        if (v > bv) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, bv, o);
        int oi = __shfl_down_sync(0xffffffffu, bi, o);
        argmax_merge(bv, bi, ov, oi);
    }
    __shared__ float wv[32];
    __shared__ int wi[32];
    if ((threadIdx.x & 31) == 0) {
        wv[threadIdx.x >> 5] = bv;
        wi[threadIdx.x >> 5] = bi;
    }
    int all_finite = __syncthreads_and(finite);
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)((blockDim.x + 31) / 32); w++) argmax_merge(bv, bi, wv[w], wi[w]);
        i64 at = (i64)blockIdx.x * gridDim.y + blockIdx.y;
        part_v[at] = bv;
        part_i[at] = bi;
        part_f[at] = all_finite;
    }
}

// One thread per row: the row's parts merged in order. out[r]: the row's highest logit's
// id, ties to the lowest id, NaN and -inf never winning, -1 when no logit is samplable;
// out[rows + r]: 1 when every logit of the row is finite.
extern "C" __global__ void k_argmax_rows(const float* part_v, const int* part_i, const int* part_f, int parts,
                                         int rows, int* out) {
    pdl_enter();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float bv = NEG_INF;
    int bi = 0x7fffffff, finite = 1;
    for (int p = 0; p < parts; p++) {
        i64 at = (i64)r * parts + p;
        argmax_merge(bv, bi, part_v[at], part_i[at]);
        finite &= part_f[at];
    }
    out[r] = bi == 0x7fffffff ? -1 : bi;
    out[rows + r] = finite;
}
