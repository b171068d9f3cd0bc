//! Log-probabilities in the OpenAI shapes, from the decode server's `ScoredToken`s
//! (computed there from the logits the sampler saw): completions'
//! `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` and chat's
//! `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.

use pdserve_proto::pb::ScoredToken;
use pdserve_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// A token's text (special tokens decode to nothing; a piece of a character shows as
/// U+FFFD, as in the other servers).
fn text(tok: Option<&Tokenizer>, id: u32) -> String {
    tok.and_then(|t| t.decode(&[id]).ok()).unwrap_or_default()
}

/// Completions: `offset` is the text offset (in characters) of the first token, and is
/// advanced past these tokens.
pub fn completion(tok: Option<&Tokenizer>, scored: &[ScoredToken], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for s in scored {
        let t = text(tok, s.token);
        offsets.push(*offset);
        *offset += t.chars().count();
        tokens.push(t);
        lps.push(s.logprob);
        let mut top = Map::new();
        for (id, lp) in s.top_ids.iter().zip(&s.top_logprobs) {
            top.insert(text(tok, *id), json!(lp));
        }
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

fn entry(tok: Option<&Tokenizer>, id: u32, logprob: f32) -> Map<String, Value> {
    let t = text(tok, id);
    let mut m = Map::new();
    m.insert("token".into(), json!(t));
    m.insert("logprob".into(), json!(logprob));
    m.insert("bytes".into(), json!(t.as_bytes()));
    m
}

/// Chat: one `content` entry per token.
pub fn chat(tok: Option<&Tokenizer>, scored: &[ScoredToken]) -> Value {
    let content: Vec<Value> = scored
        .iter()
        .map(|s| {
            let mut e = entry(tok, s.token, s.logprob);
            let top: Vec<Value> = s
                .top_ids
                .iter()
                .zip(&s.top_logprobs)
                .map(|(id, lp)| Value::Object(entry(tok, *id, *lp)))
                .collect();
            e.insert("top_logprobs".into(), Value::Array(top));
            Value::Object(e)
        })
        .collect();
    json!({ "content": content })
}
