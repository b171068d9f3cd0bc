//! A worker's phase (loading, ready, draining) and the requests it has in flight, which
//! the probes (`/ready`, `grpc.health.v1`), the `Worker.Info` RPC and the graceful drain
//! all read from this one place.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Notify};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The engine thread is loading the model and allocating its pools.
    Loading,
    /// Engine loaded, pool allocated: taking requests.
    Ready,
    /// Told to stop (SIGTERM): finishing what is in flight, taking nothing new.
    Draining,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Loading => "loading",
            Phase::Ready => "ready",
            Phase::Draining => "draining",
        }
    }

    pub const ALL: [Phase; 3] = [Phase::Loading, Phase::Ready, Phase::Draining];
}

#[derive(Debug)]
pub struct Lifecycle {
    phase: AtomicU8,
    inflight: AtomicUsize,
    idle: Notify,
    aborted: AtomicBool,
    abort: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            phase: AtomicU8::new(Phase::Loading as u8),
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            aborted: AtomicBool::new(false),
            abort: watch::Sender::new(false),
        }
    }
}

/// Counts one request in flight until dropped (wakes a drain waiting for the last one).
#[derive(Debug)]
pub struct InFlight(Arc<Lifecycle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Why a request was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this worker is {}; not taking new requests", .0.name())]
pub struct NotTaking(pub Phase);

impl Lifecycle {
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::SeqCst) {
            0 => Phase::Loading,
            1 => Phase::Ready,
            _ => Phase::Draining,
        }
    }

    /// The engine is loaded and its pool allocated (a draining worker stays draining).
    pub fn set_ready(&self) {
        let _ = self.phase.compare_exchange(
            Phase::Loading as u8,
            Phase::Ready as u8,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    pub fn start_drain(&self) {
        self.phase.store(Phase::Draining as u8, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.phase() == Phase::Ready
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Count a new request in flight, unless the worker is not ready (loading or
    /// draining). Counted before the phase is read, so a drain that begins at the same
    /// moment either sees this request or this request sees the drain.
    pub fn enter(self: &Arc<Self>) -> Result<InFlight, NotTaking> {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(self.clone());
        match self.phase() {
            Phase::Ready => Ok(guard),
            other => Err(NotTaking(other)),
        }
    }

    /// Wait until nothing is in flight; false when `timeout` passed first.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let idle = async {
            loop {
                let notified = self.idle.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.inflight() == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, idle).await.is_ok()
    }

    /// Past the drain deadline: every request still in flight is to fail now.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.abort.send_replace(true);
    }

    /// For loops that poll (the engine threads).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Resolves once [`Lifecycle::abort`] was called (for request tasks to select on).
    pub async fn aborted(&self) {
        let mut rx = self.abort.subscribe();
        let _ = rx.wait_for(|a| *a).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn takes_requests_only_when_ready_and_drains_to_idle() {
        let l = Arc::new(Lifecycle::default());
        assert_eq!(l.enter().unwrap_err(), NotTaking(Phase::Loading));
        assert_eq!(l.inflight(), 0);
        l.set_ready();
        let a = l.enter().unwrap();
        let b = l.enter().unwrap();
        l.start_drain();
        l.set_ready();
        assert_eq!(l.phase(), Phase::Draining, "a drain is never undone");
        assert_eq!(l.enter().unwrap_err(), NotTaking(Phase::Draining));
        assert_eq!(l.inflight(), 2);
        assert!(!l.wait_idle(Duration::from_millis(20)).await);
        drop(a);
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.wait_idle(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(b);
        assert!(waiter.await.unwrap());
    }

    #[tokio::test]
    async fn abort_wakes_request_tasks() {
        let l = Arc::new(Lifecycle::default());
        let t = {
            let l = l.clone();
            tokio::spawn(async move { l.aborted().await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!t.is_finished() && !l.is_aborted());
        l.abort();
        tokio::time::timeout(Duration::from_secs(1), t)
            .await
            .unwrap()
            .unwrap();
        assert!(l.is_aborted());
        l.aborted().await;
    }
}
