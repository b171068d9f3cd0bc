//! A worker's circuit breaker: whether the router sends it traffic.
//!
//! `unknown` (added, not yet checked) -> `closed` on the first passing health check.
//! `closed` -> `open` on a failed health check, a connect failure (gRPC `unavailable`) or
//! [`FAILURE_THRESHOLD`] request failures in a row. `open` -> `half_open` when a health
//! check passes again; `half_open` takes traffic and goes back to `closed` after the next
//! passing health check or successful request, or to `open` on any failure.

use std::time::Instant;

/// Request failures in a row (timeouts, internal errors, data loss) that open the circuit.
pub const FAILURE_THRESHOLD: u32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Circuit {
    Unknown,
    Closed,
    HalfOpen,
    Open,
}

impl Circuit {
    /// Whether requests are routed to the worker.
    pub fn in_rotation(self) -> bool {
        matches!(self, Circuit::Closed | Circuit::HalfOpen)
    }

    pub const ALL: [Circuit; 4] = [
        Circuit::Unknown,
        Circuit::Closed,
        Circuit::HalfOpen,
        Circuit::Open,
    ];

    /// The `state` label of `pdserve_worker_circuit_state` (as `GET /workers` spells it).
    pub fn name(self) -> &'static str {
        match self {
            Circuit::Unknown => "unknown",
            Circuit::Closed => "closed",
            Circuit::HalfOpen => "half_open",
            Circuit::Open => "open",
        }
    }
}

#[derive(Debug)]
pub struct Breaker {
    pub circuit: Circuit,
    /// Request failures since the last success.
    pub failures: u32,
    /// Why the circuit last opened.
    pub last_error: String,
    pub since: Instant,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            circuit: Circuit::Unknown,
            failures: 0,
            last_error: String::new(),
            since: Instant::now(),
        }
    }
}

impl Breaker {
    fn set(&mut self, c: Circuit) -> Option<(Circuit, Circuit)> {
        let was = self.circuit;
        if was == c {
            return None;
        }
        self.circuit = c;
        self.since = Instant::now();
        Some((was, c))
    }

    /// A passing health check. Returns the transition, if any.
    pub fn health_ok(&mut self) -> Option<(Circuit, Circuit)> {
        match self.circuit {
            Circuit::Unknown | Circuit::HalfOpen => {
                self.failures = 0;
                self.set(Circuit::Closed)
            }
            Circuit::Open => self.set(Circuit::HalfOpen),
            Circuit::Closed => None,
        }
    }

    /// A failed health check or a connect failure: open at once.
    pub fn fail_hard(&mut self, why: &str) -> Option<(Circuit, Circuit)> {
        self.last_error = why.to_string();
        self.set(Circuit::Open)
    }

    /// A request failure the worker caused (not a connect failure).
    pub fn request_failed(&mut self, why: &str) -> Option<(Circuit, Circuit)> {
        self.failures += 1;
        self.last_error = why.to_string();
        if self.circuit == Circuit::HalfOpen || self.failures >= FAILURE_THRESHOLD {
            return self.set(Circuit::Open);
        }
        None
    }

    pub fn request_ok(&mut self) -> Option<(Circuit, Circuit)> {
        self.failures = 0;
        if self.circuit == Circuit::HalfOpen {
            return self.set(Circuit::Closed);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_and_closes_through_half_open() {
        let mut b = Breaker::default();
        assert!(!b.circuit.in_rotation());
        assert_eq!(b.health_ok(), Some((Circuit::Unknown, Circuit::Closed)));
        assert_eq!(b.request_failed("x"), None);
        assert_eq!(b.request_failed("x"), None);
        assert_eq!(
            b.request_failed("boom"),
            Some((Circuit::Closed, Circuit::Open))
        );
        assert_eq!(b.last_error, "boom");
        assert!(!b.circuit.in_rotation());
        assert_eq!(b.health_ok(), Some((Circuit::Open, Circuit::HalfOpen)));
        assert!(b.circuit.in_rotation());
        // One failure while half open opens again.
        assert_eq!(
            b.request_failed("y"),
            Some((Circuit::HalfOpen, Circuit::Open))
        );
        b.health_ok();
        assert_eq!(b.request_ok(), Some((Circuit::HalfOpen, Circuit::Closed)));
        assert_eq!(b.failures, 0);
        // A success resets the failure count.
        b.request_failed("a");
        b.request_failed("b");
        b.request_ok();
        assert_eq!(b.request_failed("c"), None);
        assert_eq!(b.fail_hard("down"), Some((Circuit::Closed, Circuit::Open)));
        b.health_ok();
        assert_eq!(b.health_ok(), Some((Circuit::HalfOpen, Circuit::Closed)));
    }
}
