// Counter-based random weights (engine/src/backend/counter_rng.rs has the same arithmetic on
// the host): element i = splitmix64(seed + i * GOLDEN); four 16-bit lanes give uniforms;
// normal = Irwin-Hall sum of four (mean 0, variance 1), uniform = the first lane.
// kind 0: a + b * normal (a = mean, b = std); kind 1: a + (b - a) * uniform.

__device__ __forceinline__ unsigned long long splitmix64_(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float lane_(unsigned long long h, int j) {
    return ((float)((h >> (16 * j)) & 0xffffull) + 0.5f) * (1.0f / 65536.0f);
}

__device__ __forceinline__ float random_value(unsigned long long seed, i64 i, int kind, float a, float b) {
    unsigned long long h = splitmix64_(seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull);
    if (kind == 0) {
        // Same order of additions as the host: ((l0 + l1) + l2) + l3.
        float s = __fadd_rn(__fadd_rn(__fadd_rn(lane_(h, 0), lane_(h, 1)), lane_(h, 2)), lane_(h, 3));
        return __fadd_rn(a, __fmul_rn(b, __fmul_rn(__fsub_rn(s, 2.0f), 1.7320508f)));
    }
    return __fadd_rn(a, __fmul_rn(__fsub_rn(b, a), lane_(h, 0)));
}

extern "C" __global__ void k_random_f32(float* out, i64 n, unsigned long long seed, int kind, float a, float b) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = random_value(seed, i, kind, a, b);
}

extern "C" __global__ void k_random_bf16(bf16_t* out, i64 n, unsigned long long seed, int kind, float a, float b) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = f_to_bf16(random_value(seed, i, kind, a, b));
}

// Read-bandwidth probe: every thread sums 16-byte loads over a grid-stride loop and
// writes one value per block (so the loads cannot be removed).
extern "C" __global__ void k_read_probe(const float4* x, i64 n4, float* out) {
    pdl_enter();
    float acc = 0.f;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
        float4 v = x[i];
        acc += v.x + v.y + v.z + v.w;
    }
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.x, acc);
}
