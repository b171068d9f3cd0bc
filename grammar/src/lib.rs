//! Structured output: which tokens a request may sample next so that its text follows a
//! grammar (a JSON schema, a regular expression or a Lark grammar), computed by
//! llguidance, the constrained-decoding engine vLLM and SGLang use.
//!
//! The router compiles a request's grammar once to refuse a bad one with a 400 and sends
//! it to the decode server in llguidance's own JSON form ([`Grammar::to_wire`]); the
//! decode server compiles it again into a [`Constraint`] that yields one token mask per
//! step, on the CPU, for that request alone.

mod tok_env;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("tokenizer {path} for structured output: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    /// The request's grammar or schema does not compile: the client's fault.
    #[error("{0}")]
    Invalid(String),
    /// The grammar could not go on (no token allowed, a token it refuses, a limit of the
    /// parser reached) after it compiled.
    #[error("structured output failed: {0}")]
    Failed(String),
}

/// A request's grammar, in llguidance's terms.
#[derive(Debug, Clone)]
pub struct Grammar(TopLevelGrammar);

impl Grammar {
    pub fn json_schema(schema: serde_json::Value) -> Self {
        Grammar(TopLevelGrammar::from_json_schema(compact_json(schema)))
    }

    /// Any JSON object (OpenAI's `json_object`).
    pub fn json_object() -> Self {
        Self::json_schema(serde_json::json!({"type": "object"}))
    }

    /// The whole reply matches `rx` (Rust `regex` syntax).
    pub fn regex(rx: &str) -> Self {
        Grammar(TopLevelGrammar::from_regex(rx))
    }

    /// A grammar in llguidance's Lark dialect (which also embeds JSON schemas as
    /// `%json { ... }`).
    pub fn lark(source: String) -> Self {
        Grammar(TopLevelGrammar::from_lark(source))
    }

    /// The form the decode server receives.
    pub fn to_wire(&self) -> Result<String, GrammarError> {
        serde_json::to_string(&self.0)
            .map_err(|e| GrammarError::Failed(format!("serializing the grammar: {e}")))
    }

    pub fn from_wire(s: &str) -> Result<Self, GrammarError> {
        serde_json::from_str(s)
            .map(Grammar)
            .map_err(|e| GrammarError::Invalid(format!("grammar from the wire: {e}")))
    }
}

/// `schema` with llguidance's JSON layout options set (unless it sets its own
/// `x-guidance`): JSON written as Python's `json.dumps` writes it, `, ` and `: ` between
/// items and no other whitespace. Free whitespace would let a model pad a reply with
/// blank lines until `max_tokens` instead of finishing it.
pub fn compact_json(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// The compiler of grammars for one model's tokenizer (built once per process).
pub struct GrammarEnv {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEnv")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl GrammarEnv {
    /// From `dir/tokenizer.json`, or `Ok(None)` when the folder has none (structured
    /// output then needs token ids the server cannot map to text: it is refused).
    pub fn from_model_dir(
        dir: &Path,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Option<Arc<Self>>, GrammarError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| GrammarError::Tokenizer {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let env: TokEnv = Arc::new(tok_env::ModelTokEnv::new(&path, &text, vocab_size, eos)?);
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        // Errors go to the request, not to stderr.
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // A bad request's error names the problem, not the whole parser state.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Some(Arc::new(GrammarEnv { factory })))
    }

    /// Compile `g` for one request.
    pub fn constraint(&self, g: &Grammar) -> Result<Constraint, GrammarError> {
        let parser = self
            .factory
            .create_parser(g.0.clone())
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Constraint { matcher })
    }
}

/// One request's grammar state: the tokens sampled so far, and the mask of the next.
pub struct Constraint {
    matcher: Matcher,
}

/// Which tokens may come next.
#[derive(Debug, Clone)]
pub struct Mask(SimpleVob);

impl Mask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Set every refused token's logit to -inf (`logits` is the model's vocabulary).
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if !self.allows(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

impl Constraint {
    /// The mask of the next token. Once the grammar is complete only the end tokens are
    /// allowed.
    pub fn mask(&mut self) -> Result<Mask, GrammarError> {
        let m = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Failed(e.to_string()))?;
        if m.is_zero() {
            return Err(GrammarError::Failed(
                "the grammar allows no token here".into(),
            ));
        }
        Ok(Mask(m))
    }

    /// Advance past a sampled token.
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Failed(e.to_string()))
    }

    /// The grammar is complete and nothing may follow: the reply is finished.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn env() -> Arc<GrammarEnv> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
        GrammarEnv::from_model_dir(&dir, 512, &[1])
            .unwrap()
            .unwrap()
    }

    fn decoder() -> tokenizers::Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
        tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap()
    }

    /// Greedy decoding over fixed pseudo-random logits, masked: the text the grammar
    /// forces, ending at the end token.
    fn run(c: &mut Constraint) -> (Vec<u32>, bool) {
        let mut out = Vec::new();
        for step in 0..200u32 {
            let mask = c.mask().unwrap();
            let mut logits: Vec<f32> = (0..512u32)
                .map(|i| ((i * 7919 + step * 104729) % 1000) as f32 / 100.0)
                .collect();
            mask.apply(&mut logits);
            let t = (0..512)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as u32;
            if t == 1 {
                return (out, true);
            }
            c.commit(t).unwrap();
            out.push(t);
            if c.is_finished() {
                return (out, false);
            }
        }
        panic!("no end in 200 tokens: {out:?}");
    }

    #[test]
    fn a_regex_forces_its_text_and_then_the_end() {
        let mut c = env()
            .constraint(&Grammar::regex("(yes|no) [0-9]{3}"))
            .unwrap();
        let (ids, _) = run(&mut c);
        let text = decoder().decode(&ids, false).unwrap();
        let re_ok = (text.starts_with("yes ") || text.starts_with("no "))
            && text.rsplit(' ').next().unwrap().len() == 3
            && text
                .rsplit(' ')
                .next()
                .unwrap()
                .bytes()
                .all(|b| b.is_ascii_digit());
        assert!(re_ok, "{text:?}");
        // Complete: only the end token is allowed now.
        let m = c.mask().unwrap();
        let a = decoder().token_to_id("a").unwrap();
        assert!(m.allows(1) && !m.allows(a));
    }

    #[test]
    fn a_schema_yields_json_that_matches_it() {
        let schema = serde_json::json!({"type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                           "c": {"enum": ["red", "blue"]}},
            "required": ["n", "c"], "additionalProperties": false});
        let g = Grammar::from_wire(&Grammar::json_schema(schema).to_wire().unwrap()).unwrap();
        let mut c = env().constraint(&g).unwrap();
        let (ids, _) = run(&mut c);
        let v: serde_json::Value =
            serde_json::from_str(&decoder().decode(&ids, false).unwrap()).unwrap();
        let n = v["n"].as_u64().unwrap();
        assert!(
            n <= 99 && ["red", "blue"].contains(&v["c"].as_str().unwrap()),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 2);
        // Written compactly, as json.dumps writes it.
        let text = decoder().decode(&ids, false).unwrap();
        assert_eq!(text, format!("{{\"n\": {n}, \"c\": {}}}", v["c"]));
    }

    #[test]
    fn json_object_starts_with_a_brace() {
        let tok = decoder();
        let mut c = env().constraint(&Grammar::json_object()).unwrap();
        let m = c.mask().unwrap();
        let (brace, bracket, a) = (
            tok.token_to_id("{").unwrap(),
            tok.token_to_id("[").unwrap(),
            tok.token_to_id("a").unwrap(),
        );
        assert!(m.allows(brace) && !m.allows(bracket) && !m.allows(a) && !m.allows(1));
        for t in tok.encode("{\"k\": [1, 2]}", false).unwrap().get_ids() {
            c.commit(*t).unwrap();
        }
        assert!(c.is_finished() || c.mask().unwrap().allows(1));
    }

    #[test]
    fn bad_grammars_are_refused_and_a_refused_token_fails() {
        let e = env();
        for g in [
            Grammar::json_schema(serde_json::json!({"type": "nonsense"})),
            Grammar::regex("(unclosed"),
            Grammar::lark("start: undefined_rule".into()),
        ] {
            assert!(
                matches!(e.constraint(&g), Err(GrammarError::Invalid(_))),
                "{g:?}"
            );
        }
        let (a, bang) = (
            decoder().token_to_id("a").unwrap(),
            decoder().token_to_id("!").unwrap(),
        );
        let mut c = e.constraint(&Grammar::regex("a+")).unwrap();
        let m = c.mask().unwrap();
        assert!(m.allows(a) && !m.allows(bang) && !m.allows(1));
        assert!(matches!(c.commit(bang), Err(GrammarError::Failed(_))));
    }
}
