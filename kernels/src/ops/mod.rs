//! The backend's ops, one file per family; each takes the device ([`crate::device::Gpu`])
//! and the tensors, validates shapes, and launches kernels. Nothing here imports
//! `backend.rs`.

pub(crate) mod attention;
pub(crate) mod attention_dequant;
pub(crate) mod attention_mma;
pub(crate) mod attention_split;
pub(crate) mod compress;
pub(crate) mod dense;
pub(crate) mod fp8_linear;
pub(crate) mod hc;
pub(crate) mod indexer;
pub(crate) mod kv_reach;
pub(crate) mod moe;
pub(crate) mod moe_fp8;
pub(crate) mod moe_gemm;
pub(crate) mod moe_mma;
pub(crate) mod numerics;
pub(crate) mod random;
pub(crate) mod rope_tables;
pub(crate) mod sample;
pub(crate) mod spread;
pub(crate) mod stored;
pub(crate) mod tensors;
