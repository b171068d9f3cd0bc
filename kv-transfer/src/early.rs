//! The first token announced ahead of the KV ([`crate::first_token_message`]), as each side
//! waits for it: the prefill server's service for its engine's sample, the decode server's
//! for its pull's announcement.

use tokio::sync::oneshot;

/// A wait for the first token, or nothing when it was not asked for.
#[derive(Debug)]
pub struct EarlyToken(Option<oneshot::Receiver<u32>>);

impl EarlyToken {
    /// The sender to hand the token's producer (None when not `asked`) and the wait.
    pub fn channel(asked: bool) -> (Option<oneshot::Sender<u32>>, EarlyToken) {
        match asked {
            true => {
                let (tx, rx) = oneshot::channel();
                (Some(tx), EarlyToken(Some(rx)))
            }
            false => (None, EarlyToken(None)),
        }
    }

    /// Whether the token may still come (a `select!` branch's condition).
    pub fn pending(&self) -> bool {
        self.0.is_some()
    }

    /// The token; None when its producer went away without it. Resolves once: afterwards,
    /// or when it was not asked for, it never resolves. Cancel-safe.
    pub async fn recv(&mut self) -> Option<u32> {
        let Some(rx) = self.0.as_mut() else {
            return std::future::pending().await;
        };
        let got = rx.await.ok();
        self.0 = None;
        got
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn resolves_once_with_the_token_or_none() {
        let (tx, mut early) = EarlyToken::channel(true);
        tx.unwrap().send(7).unwrap();
        assert!(early.pending());
        assert_eq!(early.recv().await, Some(7));
        assert!(!early.pending());
        let (tx, mut early) = EarlyToken::channel(true);
        drop(tx);
        assert_eq!(early.recv().await, None);
        let (tx, mut early) = EarlyToken::channel(false);
        assert!(tx.is_none() && !early.pending());
        let never = tokio::time::timeout(std::time::Duration::from_millis(20), early.recv());
        assert!(never.await.is_err());
    }
}
