//! CUDA backend for pdserve: kernels compiled with NVRTC at start-up for the device's
//! architecture (cached on disk), cuBLAS for dense GEMMs, bf16 weight matrices with fp32
//! activations and accumulation. Builds with no CUDA installed: every library loads at
//! run time, and [`CudaBackend::new`] says clearly why a device cannot be used.

mod alloc;
pub mod backend;
mod blas;
pub mod blas_fp8;
mod buf;
pub mod compile;
pub mod device;
mod devmem;
mod early_download;
pub mod fp8_host;
mod graph_cache;
pub mod graph_metrics;
mod graph_mode;
pub mod graphs;
mod kernels;
mod kv_store;
mod lanes;
mod launch;
pub mod nccl_p2p;
mod ops;
pub mod probe;
mod recorder;
mod rope_cache;
mod step;
mod step_output;
pub mod tensor;

pub use backend::CudaBackend;
pub use compile::{CompileError, MODULES};
pub use device::{
    AttentionKernel, DenseKernel, DeviceError, ExpertKernel, IndexerBlocking, KeyConversion,
};
pub use devmem::DevMem;
pub use graph_cache::{GraphStats, StepPhases};
pub use graph_mode::GraphMode;
pub use kv_store::GpuKv;
pub use lanes::DEFAULT_LANES;
pub use ops::indexer::GpuSelection;
pub use tensor::{GpuTensor, WeightDtype};
