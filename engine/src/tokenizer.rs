//! The tokenizer lives in `pdserve-tokenizer` (the router needs it without the engine);
//! re-exported here for the kernels' GPU checks, which tokenize through the engine crate.

pub use pdserve_tokenizer::{Tokenizer, TokenizerError};
