//! Incremental detokenization: the text each new token adds, holding back an incomplete
//! UTF-8 character until it completes (a byte-level BPE token can end mid-character).
//!
//! Only a window of recent ids is decoded per token: `prefix..read` is text already
//! emitted (kept as context so decoders that look at neighbours stay right), `read..` is
//! new. A decode ending in U+FFFD is an incomplete character and is held.

use pdserve_tokenizer::Tokenizer;
use std::sync::Arc;

pub struct Detok {
    tok: Option<Arc<Tokenizer>>,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

const REPLACEMENT: char = '\u{FFFD}';

impl Detok {
    pub fn new(tok: Option<Arc<Tokenizer>>) -> Self {
        Detok {
            tok,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Text newly completed by `id` (empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        self.delta(false)
    }

    /// Whatever is left at the end of the stream (an incomplete character comes out as
    /// U+FFFD, as a whole-sequence decode would show it).
    pub fn finish(&mut self) -> String {
        self.delta(true)
    }

    fn delta(&mut self, last: bool) -> String {
        let Some(tok) = self.tok.as_deref() else {
            return String::new();
        };
        let (Ok(before), Ok(now)) = (
            tok.decode(&self.ids[self.prefix..self.read]),
            tok.decode(&self.ids[self.prefix..]),
        ) else {
            return String::new();
        };
        if now.len() <= before.len() || (!last && now.ends_with(REPLACEMENT)) {
            return String::new();
        }
        match now.get(before.len()..) {
            Some(d) if now.starts_with(&before) => {
                let d = d.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                d
            }
            // The window's decode is not prefix-stable here: wait for more tokens.
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn embedded() -> Arc<Tokenizer> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
        Arc::new(Tokenizer::from_model_dir(&dir).unwrap().unwrap())
    }

    #[test]
    fn streamed_multibyte_text_equals_the_whole_decode_and_never_splits_a_character() {
        let tok = embedded();
        let text = "naïve café: 日本語のテキスト 🎉🦀 and ĳ ßüñ — \"quotes\" ok";
        let ids = tok.encode(text).unwrap();
        // The test means something only if some token boundary falls inside a character.
        let mid_char = (1..ids.len())
            .filter(|&i| tok.decode(&ids[..i]).unwrap().ends_with(REPLACEMENT))
            .count();
        assert!(mid_char > 0, "no token ends mid-character: {ids:?}");
        let mut d = Detok::new(Some(tok.clone()));
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(id);
            assert!(
                !piece.contains(REPLACEMENT),
                "emitted a broken character: {piece:?}"
            );
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, tok.decode(&ids).unwrap());
        assert!(out.contains("日本語のテキスト 🎉🦀"), "{out:?}");
    }

    #[test]
    fn an_unfinished_character_at_the_end_comes_out_as_a_replacement() {
        let tok = embedded();
        let ids = tok.encode("ok 🦀").unwrap();
        // Drop tokens from the end until the decode ends mid-character.
        let cut = (1..ids.len())
            .rev()
            .find(|&i| tok.decode(&ids[..i]).unwrap().ends_with(REPLACEMENT))
            .unwrap();
        let mut d = Detok::new(Some(tok.clone()));
        let streamed: String = ids[..cut].iter().map(|&i| d.push(i)).collect();
        assert!(!streamed.contains(REPLACEMENT));
        let tail = d.finish();
        assert_eq!(
            format!("{streamed}{tail}"),
            tok.decode(&ids[..cut]).unwrap()
        );
        assert!(tail.ends_with(REPLACEMENT));
    }

    #[test]
    fn no_tokenizer_means_no_text() {
        let mut d = Detok::new(None);
        assert_eq!(d.push(5), "");
        assert_eq!(d.finish(), "");
    }
}
