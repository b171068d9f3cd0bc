//! llguidance's view of the model's tokenizer: every token's bytes (read from
//! `tokenizer.json` by llguidance's own reader) in a token trie, and the `tokenizers`
//! crate for the text llguidance tokenizes itself (forced and literal spans).

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use std::path::Path;
use std::str::FromStr;

pub struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl ModelTokEnv {
    /// From `tokenizer.json` (its text, already read), for a model of `vocab_size` logits
    /// (ids past the tokenizer's own are placeholders no grammar allows) whose generation
    /// ends at `eos` (allowed wherever the grammar may end).
    pub fn new(
        path: &Path,
        text: &str,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self, crate::GrammarError> {
        let load = |reason: String| crate::GrammarError::Tokenizer {
            path: path.to_path_buf(),
            reason,
        };
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| load(e.to_string()))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| load(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(load(format!(
                "{} tokens, more than the model's vocab_size {vocab_size}",
                words.len()
            )));
        }
        // Placeholders for ids the model has and the tokenizer does not: special tokens
        // (the marker byte first) that no grammar literal can match.
        while words.len() < vocab_size {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let Some((&first, _)) = eos.split_first() else {
            return Err(load("the model names no end-of-sequence token".into()));
        };
        if let Some(t) = eos.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(load(format!(
                "end-of-sequence token {t} is outside the vocabulary (0..{vocab_size})"
            )));
        }
        let info = TokRxInfo::new(vocab_size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let tokenizer = tokenizers::Tokenizer::from_str(text).map_err(|e| load(e.to_string()))?;
        Ok(ModelTokEnv { trie, tokenizer })
    }
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            // The trie's greedy split stands in when the tokenizer refuses the text (it
            // never does for byte-level BPE): a valid, if not canonical, tokenization.
            match self.tokenizer.encode(s, false) {
                Ok(e) => e.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s.as_bytes()),
            }
        })
    }
}
