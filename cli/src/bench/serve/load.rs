//! Drive the sessions through the router: closed loop (`--concurrency N`: N sessions at
//! once, the next one starting when one ends) or open loop (`--request-rate R`: sessions
//! start at Poisson arrivals, R per second, optionally at most N at once). A session's
//! turns run one after the other, each as soon as the previous answer is in (no think
//! time); a failed turn ends its session and its later turns are counted as skipped.

use super::client::{Ask, Client, Completed, Failure};
use super::workload::{History, Session};
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// How sessions are started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Closed {
        concurrency: usize,
    },
    Open {
        rate: f64,
        max_in_flight: Option<usize>,
    },
}

/// What every request of the run shares.
pub struct Ctx {
    pub client: Client,
    pub prefix: Vec<u32>,
    pub temperature: f64,
    pub ignore_eos: bool,
    pub seed: u64,
    pub progress: ProgressBar,
}

/// One request sent.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub session: usize,
    pub turn: usize,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub result: Result<Completed, Failure>,
}

pub struct Run {
    /// In (session, turn) order.
    pub outcomes: Vec<Outcome>,
    /// Turns not sent because an earlier turn of their session failed.
    pub skipped: usize,
    /// From the first request sent to the last one ended.
    pub duration_s: f64,
}

/// The sampling seed of one request: fixed by `--seed`, different per request, and
/// below 2^63 (the API's `seed` is a signed 64-bit integer).
fn request_seed(seed: u64, session: usize, turn: usize) -> u64 {
    let mixed = seed ^ ((session as u64) << 16 | turn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    mixed & i64::MAX as u64
}

async fn session(ctx: &Ctx, s: &Session) -> (Vec<Outcome>, usize) {
    let mut history = History::new(&ctx.prefix);
    let mut out = Vec::with_capacity(s.turns.len());
    for (k, turn) in s.turns.iter().enumerate() {
        let prompt = history.ask(&turn.user);
        let ask = Ask {
            prompt: &prompt,
            max_tokens: turn.max_tokens,
            temperature: ctx.temperature,
            ignore_eos: ctx.ignore_eos,
            seed: request_seed(ctx.seed, s.id, k),
        };
        let result = ctx.client.complete(&ask).await;
        ctx.progress.inc(1);
        let answer = result.as_ref().ok().map(|c| c.tokens.clone());
        out.push(Outcome {
            session: s.id,
            turn: k,
            prompt,
            max_tokens: turn.max_tokens,
            result,
        });
        match answer {
            Some(a) => history.answered(&a),
            None => return (out, s.turns.len() - k - 1),
        }
    }
    (out, 0)
}

/// Run every session as `mode` says; returns when all have ended.
pub async fn run(ctx: Arc<Ctx>, sessions: Vec<Session>, mode: Mode) -> Result<Run> {
    let sessions = Arc::new(sessions);
    let t0 = Instant::now();
    let mut tasks: JoinSet<(Vec<Outcome>, usize)> = JoinSet::new();
    match mode {
        Mode::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..concurrency.min(sessions.len()) {
                let (ctx, sessions, next) = (ctx.clone(), sessions.clone(), next.clone());
                tasks.spawn(async move {
                    let (mut all, mut skipped) = (Vec::new(), 0);
                    while let Some(s) = sessions.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let (o, k) = session(&ctx, s).await;
                        all.extend(o);
                        skipped += k;
                    }
                    (all, skipped)
                });
            }
        }
        Mode::Open {
            rate,
            max_in_flight,
        } => {
            let limit = max_in_flight.map(|n| Arc::new(Semaphore::new(n)));
            let mut rng = ChaCha8Rng::seed_from_u64(ctx.seed ^ 0x0A11_1CA7_E5EE_D000);
            let start = tokio::time::Instant::now();
            let mut at = 0f64;
            for i in 0..sessions.len() {
                // Exponential gaps: a Poisson process of `rate` arrivals per second.
                let u: f64 = rng.random();
                at += -(1.0 - u).ln() / rate;
                tokio::time::sleep_until(start + std::time::Duration::from_secs_f64(at)).await;
                let permit = match &limit {
                    Some(l) => Some(l.clone().acquire_owned().await.context("session limit")?),
                    None => None,
                };
                let (ctx, sessions) = (ctx.clone(), sessions.clone());
                tasks.spawn(async move {
                    let _permit = permit;
                    session(&ctx, &sessions[i]).await
                });
            }
        }
    }
    let (mut outcomes, mut skipped) = (Vec::new(), 0);
    while let Some(done) = tasks.join_next().await {
        let (o, k) = done.context("a session task panicked")?;
        outcomes.extend(o);
        skipped += k;
    }
    let duration_s = t0.elapsed().as_secs_f64();
    outcomes.sort_by_key(|o| (o.session, o.turn));
    Ok(Run {
        outcomes,
        skipped,
        duration_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_seeds_differ_per_request_and_follow_the_run_seed() {
        let a = request_seed(1, 0, 0);
        assert_ne!(a, request_seed(1, 0, 1));
        assert_ne!(a, request_seed(1, 1, 0));
        assert_ne!(a, request_seed(2, 0, 0));
        assert_eq!(a, request_seed(1, 0, 0));
        assert!((0..64).all(|t| request_seed(u64::MAX, 3, t) <= i64::MAX as u64));
    }
}
