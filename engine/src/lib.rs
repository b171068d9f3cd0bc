//! pdserve's engine: DeepSeek-V4 config and weights, paged KV state, the forward pass
//! against a backend trait (CPU in fp32 here), sampling and tokenization.

pub mod backend;
pub mod config;
pub mod embedded;
pub mod engine;
pub mod generate;
pub mod kv;
pub mod model;
pub mod rope;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

pub use backend::cpu::CpuBackend;
pub use engine::{Engine, EngineError, ErrorClass, ForwardItem, Logits, PoolSize, SeqSnapshot, Sequence};
