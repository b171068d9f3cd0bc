//! `tokenizer.json` through the `tokenizers` crate.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("model folder {0} has no tokenizer.json: pass token ids instead of text")]
    Missing(PathBuf),
    #[error("tokenizer {path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("tokenizer: {0}")]
    Codec(String),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// `dir/tokenizer.json`, or `Ok(None)` when the folder has none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, TokenizerError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(Some(Tokenizer { inner }))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The longest vocabulary entry, in UTF-8 bytes of its stored form (which is never
    /// shorter than the text it stands for: byte-level and byte-fallback forms are longer).
    /// A prompt of B bytes needs at least about B / this many tokens, so a router can
    /// refuse a prompt that cannot fit its context before paying for tokenizing it.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }
}
