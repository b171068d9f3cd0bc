// Sampling on the device: the greedy token of each row of a decode step's fp32 logits,
// so that only ids (not `vocab`-long rows) go back to the host.

// The better of two (value, id) candidates under pdserve_engine::sampling::argmax's rule:
// the higher value, ties to the lower id. A missing candidate is (-inf, INT_MAX): every
// samplable value beats it.
__device__ __forceinline__ void argmax_merge(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// One block per row of `logits` ([gridDim.x, cols]). out[r]: the row's highest logit's id,
// ties to the lowest id, NaN and -inf never winning, -1 when no logit is samplable;
// out[gridDim.x + r]: 1 when every logit of the row is finite. Each thread scans its
// strided ids in ascending order keeping the first of equal maxima (`v > bv` is false for
// NaN and for -inf against the empty candidate); the merges keep the lower id of equal
// values, so the result is the sequential scan's whatever the block size.
extern "C" __global__ void k_argmax_rows(const float* logits, int cols, int* out) {
    const float* x = logits + (i64)blockIdx.x * cols;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    int finite = 1;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[i];
        finite &= isfinite(v) ? 1 : 0;
        if (v > bv) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, bv, o);
        int oi = __shfl_down_sync(0xffffffffu, bi, o);
        argmax_merge(bv, bi, ov, oi);
    }
    __shared__ float part_v[32];
    __shared__ int part_i[32];
    if ((threadIdx.x & 31) == 0) {
        part_v[threadIdx.x >> 5] = bv;
        part_i[threadIdx.x >> 5] = bi;
    }
    int all_finite = __syncthreads_and(finite);
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)((blockDim.x + 31) / 32); w++) argmax_merge(bv, bi, part_v[w], part_i[w]);
        out[blockIdx.x] = bi == 0x7fffffff ? -1 : bi;
        out[gridDim.x + blockIdx.x] = all_finite;
    }
}
