//! Backpressure: a request enters the batch only with a batch slot and enough pages
//! reserved for its whole length (prompt + every token it may generate).

use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Admission {
    pages: std::sync::Arc<Semaphore>,
    slots: std::sync::Arc<Semaphore>,
    total_pages: usize,
}

/// Held while a request is admitted; dropping it (after its pages are released) frees the
/// reservation.
#[derive(Debug)]
pub struct Permit {
    _pages: OwnedSemaphorePermit,
    _slot: OwnedSemaphorePermit,
}

#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    #[error("request needs {need} KV pages; this decode server has {total} in all")]
    TooLarge { need: usize, total: usize },
    #[error("decode server busy: no batch slot and {need} free KV pages within {secs:.1} s")]
    Busy { need: usize, secs: f64 },
}

impl Admission {
    pub fn new(total_pages: usize, max_batch: usize) -> Self {
        Admission {
            pages: std::sync::Arc::new(Semaphore::new(total_pages)),
            slots: std::sync::Arc::new(Semaphore::new(max_batch)),
            total_pages,
        }
    }

    pub async fn admit(&self, need: usize, timeout: Duration) -> Result<Permit, AdmitError> {
        if need > self.total_pages {
            return Err(AdmitError::TooLarge {
                need,
                total: self.total_pages,
            });
        }
        let busy = AdmitError::Busy {
            need,
            secs: timeout.as_secs_f64(),
        };
        let n = u32::try_from(need).map_err(|_| AdmitError::TooLarge {
            need,
            total: self.total_pages,
        })?;
        let both = async {
            let slot = self.slots.clone().acquire_owned().await;
            let pages = self.pages.clone().acquire_many_owned(n).await;
            (slot, pages)
        };
        match tokio::time::timeout(timeout, both).await {
            Ok((Ok(slot), Ok(pages))) => Ok(Permit {
                _pages: pages,
                _slot: slot,
            }),
            _ => Err(busy),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn waits_for_pages_then_admits() {
        let a = Admission::new(10, 4);
        assert!(matches!(
            a.admit(11, Duration::from_millis(10)).await,
            Err(AdmitError::TooLarge {
                need: 11,
                total: 10
            })
        ));
        let p1 = a.admit(8, Duration::from_millis(10)).await.unwrap();
        assert!(matches!(
            a.admit(3, Duration::from_millis(20)).await,
            Err(AdmitError::Busy { need: 3, .. })
        ));
        drop(p1);
        let _p2 = a.admit(3, Duration::from_millis(20)).await.unwrap();
    }

    #[tokio::test]
    async fn batch_slots_bound_the_batch() {
        let a = Admission::new(100, 2);
        let _x = a.admit(1, Duration::from_millis(10)).await.unwrap();
        let _y = a.admit(1, Duration::from_millis(10)).await.unwrap();
        assert!(a.admit(1, Duration::from_millis(20)).await.is_err());
    }
}
