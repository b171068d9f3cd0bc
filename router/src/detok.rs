//! Incremental detokenization: the text each new token adds, holding back an incomplete
//! UTF-8 character until it completes.

use pdserve_engine::tokenizer::Tokenizer;

pub struct Detok<'a> {
    tok: Option<&'a Tokenizer>,
    ids: Vec<u32>,
    emitted: usize,
}

impl<'a> Detok<'a> {
    pub fn new(tok: Option<&'a Tokenizer>) -> Self {
        Detok {
            tok,
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// Text newly completed by `id` (empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let Some(tok) = self.tok else {
            return String::new();
        };
        let Ok(text) = tok.decode(&self.ids) else {
            return String::new();
        };
        if text.ends_with('\u{FFFD}')
            || text.len() < self.emitted
            || !text.is_char_boundary(self.emitted)
        {
            return String::new();
        }
        let delta = text[self.emitted..].to_string();
        self.emitted = text.len();
        delta
    }

    /// Whatever is left at the end of the stream.
    pub fn finish(&mut self) -> String {
        let Some(tok) = self.tok else {
            return String::new();
        };
        match tok.decode(&self.ids) {
            Ok(text) if text.len() > self.emitted && text.is_char_boundary(self.emitted) => {
                let d = text[self.emitted..].to_string();
                self.emitted = text.len();
                d
            }
            _ => String::new(),
        }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
