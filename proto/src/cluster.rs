//! The cluster token: a secret every process of one cluster shares, proving membership on
//! the gRPC hops where TLS is off.
//!
//! - Callers send it in [`TOKEN`] metadata on `Prefill.Prefill` and `Decode.Generate`;
//!   those services refuse a call without it (UNAUTHENTICATED), compared in constant
//!   time on SHA-256 digests.
//! - `Worker.Info` / `Health` stay open (they carry no secret, and the router must talk
//!   to a worker before trusting it), but a caller may send a random [`CHALLENGE`]; a
//!   worker holding the token answers with [`PROOF`] = HMAC-SHA256(token, "identity",
//!   challenge). The router admits (`POST /workers`) and keeps polling a worker only while its proofs
//!   verify, and never sends the token itself to a worker that has not proved it holds it.
//! - On every `Decode.Generate` the router sends a pull grant, [`GRANT`] =
//!   HMAC-SHA256(token, "pull", request id, prefill address); a decode server holding the
//!   token refuses (PERMISSION_DENIED), before connecting anywhere, a call whose grant does
//!   not name the prefill address it asks for. So a decode server pulls only from prefill
//!   servers a router chose for that request, never from an address a caller made up.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Metadata key of the token on calls that do work.
pub const TOKEN: &str = "x-pdserve-cluster-token";
/// Metadata key of a caller's random challenge on `Worker.Info`.
pub const CHALLENGE: &str = "x-pdserve-challenge";
/// Response metadata key of the worker's answer to the challenge.
pub const PROOF: &str = "x-pdserve-proof";
/// Metadata key of the router's pull grant on `Decode.Generate`.
pub const GRANT: &str = "x-pdserve-pull-grant";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("the cluster token is empty")]
    Empty,
    #[error("the cluster token must be visible ASCII (it travels in gRPC metadata)")]
    NotAscii,
}

/// The shared secret. `Debug` never shows it.
#[derive(Clone)]
pub struct ClusterToken {
    secret: Arc<str>,
    digest: [u8; 32],
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(redacted)")
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ClusterToken {
    pub fn new(secret: &str) -> Result<Self, TokenError> {
        let s = secret.trim();
        if s.is_empty() {
            return Err(TokenError::Empty);
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotAscii);
        }
        Ok(ClusterToken {
            secret: s.into(),
            digest: Sha256::digest(s.as_bytes()).into(),
        })
    }

    /// A fresh random token (for `pdserve up`): 32 random bytes as hex.
    pub fn random() -> Self {
        let bytes: [u8; 32] = rand::random();
        ClusterToken::new(&hex(&bytes)).unwrap_or_else(|_| unreachable!("hex is visible ASCII"))
    }

    /// The secret itself, to hand to child processes (never to log).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    fn accepts(&self, presented: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(presented).into();
        bool::from(self.digest.ct_eq(&d))
    }

    /// HMAC-SHA256(token, domain || 0 || parts joined by 0). The domains (`identity`,
    /// `pull`) keep the two uses apart: `Worker.Info` answers any caller's challenge, and
    /// that answer must never be a pull grant (metadata values hold no 0 byte, so the
    /// message splits one way only).
    fn mac(&self, domain: &str, parts: &[&str]) -> String {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(self.secret.as_bytes())
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(domain.as_bytes());
        for p in parts {
            m.update(b"\0");
            m.update(p.as_bytes());
        }
        hex(&m.finalize().into_bytes())
    }

    /// The answer to `challenge`: hex HMAC-SHA256(token, "identity" 0 challenge).
    pub fn prove(&self, challenge: &str) -> String {
        self.mac("identity", &[challenge])
    }

    /// Whether `proof` answers `challenge` (constant time).
    pub fn verify(&self, challenge: &str, proof: &str) -> bool {
        let want = self.prove(challenge);
        bool::from(want.as_bytes().ct_eq(proof.as_bytes()))
    }

    /// The router's pull grant for one request: hex HMAC-SHA256(token, "pull" 0
    /// request id 0 prefill address).
    fn grant(&self, request_id: &str, prefill_addr: &str) -> String {
        self.mac("pull", &[request_id, prefill_addr])
    }

    /// Grant the decode server called with `req` (a `Generate` call, its request id
    /// already attached) the pull of its prompt's KV from `prefill_addr`.
    pub fn grant_pull<T>(&self, req: &mut tonic::Request<T>, prefill_addr: &str) {
        let g = self.grant(&crate::request_id(req), prefill_addr);
        if let Ok(v) = g.parse() {
            req.metadata_mut().insert(GRANT, v);
        }
    }

    /// Whether `req` carries this cluster's grant to pull from `prefill_addr` for its
    /// request id (constant time). A decode server checks it before connecting anywhere.
    pub fn check_grant<T>(
        &self,
        req: &tonic::Request<T>,
        prefill_addr: &str,
    ) -> Result<(), tonic::Status> {
        let want = self.grant(&crate::request_id(req), prefill_addr);
        match req.metadata().get(GRANT) {
            Some(g) if bool::from(want.as_bytes().ct_eq(g.as_bytes())) => Ok(()),
            Some(_) => Err(tonic::Status::permission_denied(format!(
                "no valid router grant to pull from {prefill_addr}: a decode server pulls only from the prefill servers its router names"
            ))),
            None => Err(tonic::Status::permission_denied(format!(
                "refusing to pull from {prefill_addr}: the call carries no router grant ({GRANT})"
            ))),
        }
    }

    /// Put the token on an outgoing call.
    pub fn attach<T>(&self, req: &mut tonic::Request<T>) {
        if let Ok(v) = self.secret.parse() {
            req.metadata_mut().insert(TOKEN, v);
        }
    }

    /// A fresh random challenge.
    pub fn challenge() -> String {
        hex(&rand::random::<[u8; 16]>())
    }
}

/// Server side: the interceptor of the services that do work. With no token configured
/// every call passes (a cluster started without one).
#[derive(Clone, Debug)]
pub struct RequireToken(pub Option<ClusterToken>);

impl tonic::service::Interceptor for RequireToken {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(t) = &self.0 else {
            return Ok(req);
        };
        match req.metadata().get(TOKEN) {
            Some(v) if t.accepts(v.as_bytes()) => Ok(req),
            Some(_) => Err(tonic::Status::unauthenticated("wrong cluster token")),
            None => Err(tonic::Status::unauthenticated(
                "this worker requires the cluster token (--cluster-token-file)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn tokens_check_in_constant_time_and_prove_challenges() {
        let t = ClusterToken::new(" s3cret ").unwrap();
        assert!(t.accepts(b"s3cret"));
        assert!(!t.accepts(b"s3cre"));
        let c = ClusterToken::challenge();
        let p = t.prove(&c);
        assert_eq!(p.len(), 64);
        assert!(t.verify(&c, &p));
        assert!(!t.verify(&ClusterToken::challenge(), &p));
        let other = ClusterToken::new("other").unwrap();
        assert!(!t.verify(&c, &other.prove(&c)));
        assert!(matches!(ClusterToken::new("  "), Err(TokenError::Empty)));
        assert!(matches!(
            ClusterToken::new("a b"),
            Err(TokenError::NotAscii)
        ));
        assert!(!format!("{t:?}").contains("s3cret"));
        assert_ne!(
            ClusterToken::random().secret(),
            ClusterToken::random().secret()
        );
    }

    #[test]
    fn pull_grants_name_one_request_and_one_prefill_address() {
        let t = ClusterToken::new("s3cret").unwrap();
        let call = |id: &str| crate::with_request_id((), id);
        let mut granted = call("req-1");
        t.grant_pull(&mut granted, "10.0.0.1:50061");
        assert!(t.check_grant(&granted, "10.0.0.1:50061").is_ok());
        let e = t.check_grant(&granted, "10.0.0.9:50061").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("10.0.0.9:50061"), "{e:?}");
        // The same grant under another request id, or from another cluster, is refused.
        let mut moved = call("req-2");
        let g = granted.metadata().get(GRANT).unwrap().clone();
        moved.metadata_mut().insert(GRANT, g);
        assert!(t.check_grant(&moved, "10.0.0.1:50061").is_err());
        let mut foreign = call("req-1");
        ClusterToken::new("other")
            .unwrap()
            .grant_pull(&mut foreign, "10.0.0.1:50061");
        assert!(t.check_grant(&foreign, "10.0.0.1:50061").is_err());
        let none = t.check_grant(&call("req-1"), "10.0.0.1:50061").unwrap_err();
        assert!(none.message().contains("no router grant"), "{none:?}");
        // Worker.Info answers any challenge: no challenge's proof is ever a grant.
        let g = granted
            .metadata()
            .get(GRANT)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert_ne!(t.prove("req-1\x0010.0.0.1:50061"), g);
        assert_ne!(t.prove("pull\x00req-1\x0010.0.0.1:50061"), g);
    }

    #[test]
    fn the_interceptor_refuses_missing_and_wrong_tokens() {
        let t = ClusterToken::new("s3cret").unwrap();
        let mut require = RequireToken(Some(t.clone()));
        let e = require.call(tonic::Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let mut wrong = tonic::Request::new(());
        ClusterToken::new("nope").unwrap().attach(&mut wrong);
        assert_eq!(
            require.call(wrong).unwrap_err().message(),
            "wrong cluster token"
        );
        let mut right = tonic::Request::new(());
        t.attach(&mut right);
        assert!(require.call(right).is_ok());
        assert!(RequireToken(None).call(tonic::Request::new(())).is_ok());
    }
}
