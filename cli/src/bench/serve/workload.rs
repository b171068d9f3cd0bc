//! What `bench serve` sends, fixed before the first request from `--seed`: sessions of
//! turns, each turn new user tokens and an output length, all prompts token ids drawn from
//! the model's ordinary vocabulary (so every prompt has exactly the asked length; no text
//! round trip can change it).

use anyhow::{bail, Context, Result};
use pdserve_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// A length: fixed (`128`) or uniform over an inclusive range (`64:256`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LenDist {
    pub min: usize,
    pub max: usize,
}

impl std::str::FromStr for LenDist {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let num = |t: &str| {
            t.trim()
                .parse::<usize>()
                .with_context(|| format!("`{t}` is not a non-negative integer"))
        };
        let (min, max) = match s.split_once(':') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(s)?, num(s)?),
        };
        if min > max {
            bail!("`{s}`: the minimum {min} is above the maximum {max}");
        }
        Ok(LenDist { min, max })
    }
}

impl std::fmt::Display for LenDist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}:{}", self.min, self.max)
        }
    }
}

impl LenDist {
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        rng.random_range(self.min..=self.max)
    }
}

/// Token ids a prompt may use: not BOS/EOS, and (with a tokenizer) ids that decode to
/// non-empty text which encodes back to exactly that id, which leaves out special and
/// control tokens (they decode to nothing) as vLLM's random dataset does.
pub struct Vocab<'a> {
    size: u32,
    excluded: Vec<u32>,
    tokenizer: Option<&'a Tokenizer>,
    checked: HashMap<u32, bool>,
}

/// Rejection sampling gives up after this many unusable ids in a row.
const MAX_REJECTS: usize = 10_000;

impl<'a> Vocab<'a> {
    pub fn new(size: usize, excluded: Vec<u32>, tokenizer: Option<&'a Tokenizer>) -> Result<Self> {
        let size = u32::try_from(size).context("vocabulary size")?;
        if size == 0 {
            bail!("the model's vocabulary is empty");
        }
        Ok(Vocab {
            size,
            excluded,
            tokenizer,
            checked: HashMap::new(),
        })
    }

    fn usable(&mut self, id: u32) -> bool {
        if self.excluded.contains(&id) {
            return false;
        }
        let Some(tok) = self.tokenizer else {
            return true;
        };
        *self.checked.entry(id).or_insert_with(|| {
            tok.decode(&[id])
                .ok()
                .filter(|t| !t.is_empty())
                .and_then(|t| tok.encode(&t).ok())
                .is_some_and(|ids| ids == [id])
        })
    }

    /// `n` usable ids, uniform over the usable vocabulary.
    pub fn tokens(&mut self, rng: &mut impl Rng, n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        let mut rejects = 0;
        while out.len() < n {
            let id = rng.random_range(0..self.size);
            if self.usable(id) {
                out.push(id);
                rejects = 0;
            } else {
                rejects += 1;
                if rejects >= MAX_REJECTS {
                    bail!("{MAX_REJECTS} random token ids in a row were special or do not round-trip through the tokenizer");
                }
            }
        }
        Ok(out)
    }
}

/// One request of a session: the new user tokens and how many tokens to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub user: Vec<u32>,
    pub max_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: usize,
    pub turns: Vec<Turn>,
}

/// The shape of a run.
#[derive(Debug, Clone)]
pub struct Shape {
    pub sessions: usize,
    pub turns: usize,
    pub prompt_len: LenDist,
    pub output_len: LenDist,
    pub shared_prefix_len: usize,
    pub seed: u64,
}

impl Shape {
    /// The longest context a request of this shape can need (last turn's prompt plus its
    /// output, every length at its maximum).
    pub fn max_context(&self) -> usize {
        self.shared_prefix_len + self.turns * (self.prompt_len.max + self.output_len.max)
    }
}

/// Every session of `shape` and the shared prefix, drawn from `seed` alone.
pub fn plan(shape: &Shape, vocab: &mut Vocab) -> Result<(Vec<u32>, Vec<Session>)> {
    if shape.prompt_len.min == 0 && shape.shared_prefix_len == 0 {
        bail!("--prompt-len must be at least 1 without --shared-prefix-len (an empty prompt is refused)");
    }
    if shape.output_len.min == 0 {
        bail!("--output-len must be at least 1");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(shape.seed);
    let prefix = vocab.tokens(&mut rng, shape.shared_prefix_len)?;
    let sessions = (0..shape.sessions)
        .map(|id| {
            let turns = (0..shape.turns)
                .map(|_| {
                    let n = shape.prompt_len.sample(&mut rng);
                    Ok(Turn {
                        user: vocab.tokens(&mut rng, n)?,
                        max_tokens: shape.output_len.sample(&mut rng),
                    })
                })
                .collect::<Result<_>>()?;
            Ok(Session { id, turns })
        })
        .collect::<Result<_>>()?;
    Ok((prefix, sessions))
}

/// A session's conversation so far: the shared prefix, then each turn's user tokens and
/// the answer the server gave to it. Turn k's prompt is turn k-1's prompt, its answer and
/// turn k's user tokens, so later turns reuse the earlier ones' KV (prefix cache).
#[derive(Debug, Clone)]
pub struct History {
    tokens: Vec<u32>,
}

impl History {
    pub fn new(prefix: &[u32]) -> Self {
        History {
            tokens: prefix.to_vec(),
        }
    }

    /// The prompt of the turn whose new user tokens are `user`.
    pub fn ask(&mut self, user: &[u32]) -> Vec<u32> {
        self.tokens.extend_from_slice(user);
        self.tokens.clone()
    }

    /// The server's answer to the last prompt.
    pub fn answered(&mut self, answer: &[u32]) {
        self.tokens.extend_from_slice(answer);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn lengths_parse_fixed_or_range() {
        assert_eq!(
            "128".parse::<LenDist>().unwrap(),
            LenDist { min: 128, max: 128 }
        );
        assert_eq!(
            "64:256".parse::<LenDist>().unwrap(),
            LenDist { min: 64, max: 256 }
        );
        assert_eq!("64:256".parse::<LenDist>().unwrap().to_string(), "64:256");
        for bad in ["", "x", "9:3", "1:", "-1"] {
            assert!(bad.parse::<LenDist>().is_err(), "{bad}");
        }
        let d: LenDist = "3:5".parse().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let seen: Vec<usize> = (0..200).map(|_| d.sample(&mut rng)).collect();
        assert!(seen.iter().all(|n| (3..=5).contains(n)));
        for n in 3..=5 {
            assert!(seen.contains(&n), "{n} never drawn");
        }
    }

    #[test]
    fn each_turn_extends_the_previous_prompt_by_its_answer_and_new_user_tokens() {
        let prefix = [7, 8];
        let mut h = History::new(&prefix);
        let p1 = h.ask(&[1, 2, 3]);
        assert_eq!(p1, [7, 8, 1, 2, 3]);
        h.answered(&[40, 41]);
        let p2 = h.ask(&[4, 5]);
        assert_eq!(p2, [7, 8, 1, 2, 3, 40, 41, 4, 5]);
        assert_eq!(&p2[..p1.len()], &p1[..]);
        h.answered(&[]);
        assert_eq!(h.ask(&[6]), [7, 8, 1, 2, 3, 40, 41, 4, 5, 6]);
    }

    fn shape(seed: u64) -> Shape {
        Shape {
            sessions: 3,
            turns: 2,
            prompt_len: "2:6".parse().unwrap(),
            output_len: "4".parse().unwrap(),
            shared_prefix_len: 5,
            seed,
        }
    }

    #[test]
    fn plans_are_seeded_and_avoid_excluded_ids() {
        let mut v = Vocab::new(16, vec![0, 1], None).unwrap();
        let (prefix, sessions) = plan(&shape(3), &mut v).unwrap();
        assert_eq!(prefix.len(), 5);
        assert_eq!(sessions.len(), 3);
        for s in &sessions {
            assert_eq!(s.turns.len(), 2);
            for t in &s.turns {
                assert!((2..=6).contains(&t.user.len()));
                assert_eq!(t.max_tokens, 4);
                assert!(t.user.iter().all(|&id| (2..16).contains(&id)), "{t:?}");
            }
        }
        assert!(prefix.iter().all(|&id| id >= 2));
        let again = plan(&shape(3), &mut Vocab::new(16, vec![0, 1], None).unwrap()).unwrap();
        assert_eq!(again, (prefix.clone(), sessions.clone()));
        let other = plan(&shape(4), &mut Vocab::new(16, vec![0, 1], None).unwrap()).unwrap();
        assert_ne!(other.1, sessions);
        assert_eq!(shape(0).max_context(), 5 + 2 * (6 + 4));
    }

    #[test]
    fn special_tokens_are_never_drawn_and_ordinary_ones_are() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
        let tok = Tokenizer::from_model_dir(&dir).unwrap().unwrap();
        // No ids excluded by number: the tokenizer alone must leave out its two special
        // tokens, <|begin_of_text|> (0) and <|end_of_text|> (1).
        let mut v = Vocab::new(512, Vec::new(), Some(&tok)).unwrap();
        let ids = v.tokens(&mut ChaCha8Rng::seed_from_u64(0), 4000).unwrap();
        assert!(!ids.contains(&0) && !ids.contains(&1));
        let distinct: std::collections::BTreeSet<u32> = ids.iter().copied().collect();
        // 382 of the 512 ids round-trip (the others are byte fragments and merges that
        // re-encode differently); at least half the vocabulary must stay usable.
        assert!(distinct.len() > 256, "only {} distinct ids", distinct.len());
        for id in distinct.iter().take(50) {
            let text = tok.decode(&[*id]).unwrap();
            assert_eq!(tok.encode(&text).unwrap(), [*id], "{id} {text:?}");
        }
    }

    #[test]
    fn a_vocabulary_of_only_excluded_ids_is_an_error_not_a_hang() {
        let mut v = Vocab::new(2, vec![0, 1], None).unwrap();
        let e = v.tokens(&mut ChaCha8Rng::seed_from_u64(0), 1).unwrap_err();
        assert!(e.to_string().contains("in a row"), "{e}");
    }
}
