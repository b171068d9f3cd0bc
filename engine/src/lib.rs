//! pdserve's engine: DeepSeek-V4 config and weights, paged KV state, the forward pass
//! against a backend trait (CPU in fp32 here), sampling and tokenization.
//!
//! # Layers
//!
//! The modules form six layers; a module uses its own layer and the ones below it, never
//! one above (`cli/tests/structure.rs` checks every import):
//!
//! 0. **foundation**: `config` (with `config::quant`, the stored weight formats), `rope`,
//!    `checkpoint` (checkpoint files and their exact FP8/FP4 dequantization), `sampling`,
//!    `embedded`, and the KV layout (`kv::layout`, `kv::layout_table`,
//!    `kv::sizing`, `kv::fp8`, `kv::fp8_kv`, `kv::peer`, `kv::metrics`, `kv::checksum`),
//!    `numerics` (the numerics mode and DeepSeek's quantization functions): values and
//!    plain algorithms.
//! 1. **backend** (`backend`): the traits a backend implements (tensor ops, KV storage,
//!    step running) and the CPU backend. It knows the layout, not who allocates pages.
//! 2. **pools** (`kv::allocator`, `kv::device`, `kv::host`, `kv::audit`): page and state-slot
//!    allocation, the device pool over a backend's KV storage, the host pool, the
//!    per-step write audit.
//! 3. **model** (`model`): the parameters and the forward pass, written against the
//!    backend traits.
//! 4. **engine** (`engine`, `generate`): sequences, the batched forward, chunked
//!    prefill and the single-request drivers. The engine owns its device pool and lends
//!    it through methods, never fields.
//! 5. **prefix cache** (`kv::prefix`): answers lookups and inserts through the engine's
//!    page interface.
//!
//! `lib.rs` and `kv/mod.rs` only declare modules and re-export. New code goes in the
//! lowest layer whose modules it needs; a module that would need a higher layer takes
//! what it needs as a parameter or a small trait instead. A new module gets its line in
//! `LAYERS` of `cli/tests/structure.rs`.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod embedded;
pub mod engine;
pub mod generate;
pub mod kv;
pub mod model;
pub mod numerics;
pub mod rope;
pub mod sampling;

pub use backend::cpu::CpuBackend;
pub use engine::{
    CutSlots, Engine, EngineError, ErrorClass, ForwardItem, ItemOutput, LoadFormat, Logits,
    PoolSize, PoolSpec, SeqSnapshot, Sequence,
};
