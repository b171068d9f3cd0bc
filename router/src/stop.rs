//! Stop strings over streamed text. Text that could still turn out to be the start of a
//! stop string is held back, so a stream never emits text that a later token makes part of
//! a stop string; on a match the text before it is released and the rest is dropped.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

/// What one push releases.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string matched: `text` ends just before it and generation must stop.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Add newly decoded text.
    pub fn push(&mut self, delta: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return Released {
                text: delta.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(delta);
        // The earliest match of any stop string ends the text.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        // Hold the longest suffix that is a proper prefix of some stop string.
        let keep = self.partial_suffix_len();
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// The end of the stream without a match: everything held is released.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn partial_suffix_len(&self) -> usize {
        let h = self.held.as_str();
        let mut best = 0;
        for s in &self.stops {
            let max = s.len().saturating_sub(1).min(h.len());
            for k in (best + 1..=max).rev() {
                let start = h.len() - k;
                if h.is_char_boundary(start) && s.starts_with(&h[start..]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Feed `pieces`; returns (emitted text, stopped, every emitted piece).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool, Vec<String>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        let mut emitted = Vec::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            emitted.push(r.text.clone());
            if r.stopped {
                return (out, true, emitted);
            }
        }
        let tail = m.finish();
        out.push_str(&tail);
        emitted.push(tail);
        (out, false, emitted)
    }

    #[test]
    fn stop_split_across_tokens_is_never_emitted() {
        let (out, stopped, emitted) = run(&["\n\nEND"], &["abc\n", "\nE", "N", "Dxyz"]);
        assert_eq!(out, "abc");
        assert!(stopped);
        // Nothing of the stop string left the matcher before the match was known.
        assert_eq!(emitted, vec!["abc", "", "", ""]);
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let (out, stopped, emitted) = run(&["STOP"], &["xS", "T", "ay", " here"]);
        assert_eq!(out, "xSTay here");
        assert!(!stopped);
        assert_eq!(emitted, vec!["x", "", "STay", " here", ""]);
    }

    #[test]
    fn earliest_of_several_stops_wins_and_held_text_flushes_at_the_end() {
        let (out, stopped, _) = run(&["world", "lo w"], &["hel", "lo wor", "ld"]);
        assert_eq!((out.as_str(), stopped), ("hel", true));
        let (out, stopped, _) = run(&["</s>"], &["a</"]);
        assert_eq!((out.as_str(), stopped), ("a</", false));
        let (out, stopped, _) = run(&["x"], &["x"]);
        assert_eq!((out.as_str(), stopped), ("", true));
    }

    #[test]
    fn multibyte_stop_strings_and_text() {
        let (out, stopped, emitted) = run(&["éé"], &["café", "é!"]);
        assert_eq!((out.as_str(), stopped), ("caf", true));
        assert_eq!(emitted, vec!["caf", ""]);
        let (out, stopped, _) = run(&["日本"], &["日", "曜日", "本語"]);
        assert_eq!((out.as_str(), stopped), ("日曜", true));
    }

    #[test]
    fn no_stops_passes_text_through() {
        let (out, stopped, emitted) = run(&[], &["a", "b"]);
        assert_eq!((out.as_str(), stopped), ("ab", false));
        assert_eq!(emitted, vec!["a", "b", ""]);
    }
}
