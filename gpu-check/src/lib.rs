//! The GPU check harness of `pdserve gpu-check` (scripts/gpu-check.sh): the CUDA backend
//! against the fp32 CPU engine on reference fixtures and the embedded model
//! ([`check`]), and decode steps replayed from CUDA graphs against eager runs
//! ([`graphs`]), and batched decode against one-at-a-time decode and the CPU
//! ([`batched`]), weights kept in DeepSeek's stored FP8/FP4 formats ([`stored`]), DeepSeek's
//! numerics (`--numerics deepseek`) against the CPU's ([`deepseek`]), cuBLASLt's
//! block-scaled FP8 GEMM against the host ([`fp8_gemm`]), the
//! split-key attention kernel against the one it replaced ([`attention`]) and the wgmma
//! kernel against mma.sync at the V4 head shape ([`attention_wgmma`]), greedy tokens
//! sampled on the device against the host's argmax ([`device_argmax`]), the states at
//! cuts inside a forward against the CPU engine's ([`cuts`]), and the routing
//! and indexer picks behind every bf16 row that jumps away from the CPU ([`picks`]). It
//! uses only the public API of `pdserve-kernels`, so the check code is not part of the
//! backend library.

pub mod attention;
pub mod attention_wgmma;
pub mod batched;
pub mod check;
pub mod cuts;
pub mod deepseek;
pub mod device_argmax;
pub mod fp8_gemm;
pub mod graphs;
pub mod indexer;
pub mod picks;
pub mod stored;
