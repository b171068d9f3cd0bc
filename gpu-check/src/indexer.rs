//! The tensor-core indexer scores as a prefill launches them (row pairs sharing each
//! entry tile, several tiles per block, the causally invisible tiles skipped:
//! `CudaBackend::set_indexer_blocking`) against one row and one tile per block (the
//! kernel's first launch shape), on the same inputs: the embedded model under bf16
//! weights with bf16 index-K. Prefills long enough that a row's visible entries span
//! several tiles, then decode steps of many sequences at once (rows of different
//! sequences in one block take turns). Each (row, entry)'s products and sums are the same
//! at any blocking, so every logit must be bitwise equal.

use crate::attention::{bitwise_ab, AnyResult};
use crate::check::CheckRow;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::Engine;
use pdserve_kernels::{CudaBackend, IndexerBlocking, WeightDtype};
use pdserve_tokenizer::Tokenizer;

/// Prompt length: at compression rate 4 its last rows see 260 entries, three tiles of 128
/// (two blocks of two tiles: a full block, then one tile and the rest past the mask).
const PROMPT: usize = 1040;
/// Decode steps after it.
const STEPS: usize = 8;
/// The blocking under test, against one row and one tile per block.
const PAIRS: IndexerBlocking = IndexerBlocking { rows: 2, tiles: 2 };
const SINGLE: IndexerBlocking = IndexerBlocking { rows: 1, tiles: 1 };

/// Two rows: every prompt prefilled (logits of every position) and decoded `STEPS` steps
/// teacher-forced; and the attention group's batch of short prompts decoded together.
pub fn check_indexer_blocking(ordinal: usize) -> AnyResult<Vec<CheckRow>> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let tok = Tokenizer::from_model_dir(&dir)?.ok_or("the embedded model has no tokenizer")?;
    let cfg = ModelConfig::from_model_dir(&dir)?;
    let mut spec = KvLayoutSpec::default_for(&cfg);
    spec.kv_dtype = EntryDtype::Bf16;
    spec.index_k_dtype = EntryDtype::Bf16;
    let name = format!(
        "embedded w=bf16 index-k=bf16 indexer {} rows x {} tiles per block == 1 x 1",
        PAIRS.rows, PAIRS.tiles
    );
    bitwise_ab(&tok, &name, PROMPT, STEPS, |pairs, pool| {
        let mut backend = CudaBackend::with_weights(ordinal, None, WeightDtype::Bf16)?;
        backend.set_indexer_blocking(Some(if pairs { PAIRS } else { SINGLE }));
        Ok(Engine::load(&dir, backend, Some(spec), pool)?)
    })
}
