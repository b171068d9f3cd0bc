//! `tokenizer.json` through the `tokenizers` crate, and how a text prompt begins as
//! `tokenizer_config.json` says (`add_bos_token`).

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
    prompt_start: PromptStart,
}

/// What a text prompt (a completion's, not a rendered chat template's, which writes its
/// own) starts with, as transformers tokenizes it with `add_special_tokens=True`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptStart {
    /// `add_bos_token: true`: this BOS id first (once: not again when the text's own
    /// tokens start with it).
    Bos(u32),
    /// `add_bos_token: false`: the text's tokens only.
    Nothing,
    /// No `add_bos_token`: what the tokenizer's post-processor adds (none: nothing).
    PostProcessor,
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
        let prompt_start = prompt_start(&dir.join("tokenizer_config.json"), &inner)?;
        Ok(Some(Tokenizer {
            inner,
            prompt_start,
        }))
    }

    pub fn prompt_start(&self) -> PromptStart {
        self.prompt_start
    }

    /// A completion prompt's ids: the text's, begun as [`PromptStart`] says.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self.prompt_start {
            PromptStart::Nothing => self.encode(text),
            PromptStart::Bos(bos) => {
                let mut ids = self.encode(text)?;
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
                Ok(ids)
            }
            PromptStart::PostProcessor => self
                .inner
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Codec(e.to_string())),
        }
    }

    /// The text's own tokens, no special tokens added.
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

/// `add_bos_token` and `bos_token` (a string or an `{"content": ...}` token) of
/// `tokenizer_config.json`, when there is one.
fn prompt_start(path: &Path, t: &tokenizers::Tokenizer) -> Result<PromptStart, TokenizerError> {
    let bad = |reason: String| TokenizerError::Load {
        path: path.to_path_buf(),
        reason,
    };
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(PromptStart::PostProcessor);
    };
    let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    match cfg.get("add_bos_token") {
        None | Some(serde_json::Value::Null) => Ok(PromptStart::PostProcessor),
        Some(serde_json::Value::Bool(false)) => Ok(PromptStart::Nothing),
        Some(serde_json::Value::Bool(true)) => {
            let bos = cfg.get("bos_token");
            let name = bos
                .and_then(|b| b.as_str().or_else(|| b.get("content")?.as_str()))
                .ok_or_else(|| bad("add_bos_token is true but there is no bos_token".into()))?;
            t.token_to_id(name)
                .map(PromptStart::Bos)
                .ok_or_else(|| bad(format!("bos_token {name:?} is not in the vocabulary")))
        }
        Some(x) => Err(bad(format!("add_bos_token must be a boolean, got {x}"))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The embedded model's tokenizer in a folder with `config` as its
    /// tokenizer_config.json.
    fn with_config(config: Option<&str>) -> Result<Tokenizer, TokenizerError> {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded/tokenizer.json");
        std::fs::copy(src, dir.path().join("tokenizer.json")).unwrap();
        if let Some(c) = config {
            std::fs::write(dir.path().join("tokenizer_config.json"), c).unwrap();
        }
        Tokenizer::from_model_dir(dir.path()).map(Option::unwrap)
    }

    #[test]
    fn completion_prompts_begin_as_the_tokenizer_config_says() {
        let plain = with_config(None).unwrap();
        let ids = plain.encode("hello").unwrap();
        // No config and no post-processor: the text's tokens.
        assert_eq!(plain.prompt_start(), PromptStart::PostProcessor);
        assert_eq!(plain.encode_prompt("hello").unwrap(), ids);
        let bos = plain.token_id("<|begin_of_text|>").unwrap();
        let t = with_config(Some(
            r#"{"add_bos_token": true, "bos_token": {"content": "<|begin_of_text|>"}}"#,
        ))
        .unwrap();
        assert_eq!(t.prompt_start(), PromptStart::Bos(bos));
        let mut want = vec![bos];
        want.extend(&ids);
        assert_eq!(t.encode_prompt("hello").unwrap(), want);
        // A prompt that already starts with BOS does not get a second one.
        assert_eq!(t.encode_prompt("<|begin_of_text|>hello").unwrap(), want);
        // Chat templates write their own BOS: `encode` adds nothing.
        assert_eq!(t.encode("hello").unwrap(), ids);
        let off = with_config(Some(
            r#"{"add_bos_token": false, "bos_token": "<|begin_of_text|>"}"#,
        ))
        .unwrap();
        assert_eq!(off.encode_prompt("hello").unwrap(), ids);
        for bad in [
            r#"{"add_bos_token": true}"#,
            r#"{"add_bos_token": true, "bos_token": "<nope>"}"#,
            r#"{"add_bos_token": "yes"}"#,
        ] {
            assert!(
                matches!(with_config(Some(bad)), Err(TokenizerError::Load { .. })),
                "{bad}"
            );
        }
    }
}
