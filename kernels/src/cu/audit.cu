// The KV canary's checksums (pdserve_engine::kv::checksum defines the value): one block
// per item (page or state slot) of `words` 8-byte words starting at `base`; each thread
// sums its words' keyed mixes, the block adds the partial sums (a wrapping sum has no
// order) and item `blockIdx.x` gets mix(sum ^ words).

typedef unsigned long long u64_t;

__device__ __forceinline__ u64_t canary_mix(u64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void k_region_checksums(const u64_t* base, i64 words, u64_t* out) {
    pdl_enter();
    const u64_t* p = base + (i64)blockIdx.x * words;
    u64_t s = 0;
    for (i64 i = threadIdx.x; i < words; i += blockDim.x)
        s += canary_mix(p[i] + (u64_t)(i + 1) * 0x9E3779B97F4A7C15ULL);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    __shared__ u64_t part[32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64_t t = 0;
        for (int w = 0; w < (int)((blockDim.x + 31) / 32); w++) t += part[w];
        out[blockIdx.x] = canary_mix(t ^ (u64_t)words);
    }
}
