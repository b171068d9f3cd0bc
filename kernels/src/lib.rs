//! CUDA backend for pdserve: kernels compiled with NVRTC at start-up for the device's
//! architecture (cached on disk), cuBLAS for dense GEMMs, bf16 weight matrices with fp32
//! activations and accumulation. Builds with no CUDA installed: every library loads at
//! run time, and [`CudaBackend::new`] says clearly why a device cannot be used.

pub mod backend;
pub mod bench;
pub mod check;
pub mod compile;
pub mod device;
mod graph_mode;
mod hc;
pub mod kv_ops;
mod kv_store;
mod moe;
mod random;
pub mod tensor;

pub use backend::CudaBackend;
pub use compile::{CompileError, MODULES};
pub use device::DeviceError;
pub use graph_mode::GraphMode;
pub use kv_ops::{GpuKv, GpuSelection};
pub use tensor::{GpuTensor, WeightDtype};
