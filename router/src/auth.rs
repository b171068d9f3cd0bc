//! API keys: `Authorization: Bearer <key>` on the OpenAI endpoints (`/v1/...`), a separate
//! set of admin keys on `/workers` and `/config`; `/health` and `/metrics` stay open (load
//! balancers and Prometheus). A missing or wrong key is a 401 in the OpenAI error shape.
//!
//! Keys are kept only as SHA-256 digests and a presented key is compared against every one
//! of them with `subtle`'s constant-time equality (hashing first makes the comparison
//! independent of the keys' lengths too). No key, presented or configured, is ever logged
//! or returned. Key files (one key per line, `#` comments) are re-read on SIGHUP, so keys
//! rotate without a restart.

use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use subtle::ConstantTimeEq;

/// Where the keys come from: given directly and/or read from files.
#[derive(Clone, Default)]
pub struct KeySource {
    pub api_keys: Vec<String>,
    pub api_key_file: Option<PathBuf>,
    pub admin_keys: Vec<String>,
    pub admin_key_file: Option<PathBuf>,
}

/// Never prints a key: only how many there are and the files' paths.
impl std::fmt::Debug for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySource")
            .field("api_keys", &self.api_keys.len())
            .field("api_key_file", &self.api_key_file)
            .field("admin_keys", &self.admin_keys.len())
            .field("admin_key_file", &self.admin_key_file)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading key file {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: an empty key (or a key of only spaces) would let anyone in")]
    Empty { what: String },
    #[error("key file {0} holds no key")]
    NoKeyInFile(PathBuf),
}

/// Which keys an endpoint takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The OpenAI endpoints (and unknown paths, so their 404s say nothing to strangers).
    Api,
    /// `/workers` (list, add, remove) and `/config`.
    Admin,
    /// `/health` and `/metrics`.
    Open,
}

pub fn scope(path: &str) -> Scope {
    match path {
        "/health" | "/metrics" | "/live" | "/ready" => Scope::Open,
        "/config" | "/workers" => Scope::Admin,
        p if p.starts_with("/workers/") => Scope::Admin,
        _ => Scope::Api,
    }
}

type KeyDigest = [u8; 32];

fn digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

#[derive(Default)]
struct Digests {
    api: Vec<KeyDigest>,
    admin: Vec<KeyDigest>,
}

fn read_file(path: &PathBuf) -> Result<Vec<String>, KeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::File {
        path: path.clone(),
        source,
    })?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    if keys.is_empty() {
        return Err(KeyError::NoKeyInFile(path.clone()));
    }
    Ok(keys)
}

fn collect(
    what: &str,
    given: &[String],
    file: &Option<PathBuf>,
) -> Result<Vec<KeyDigest>, KeyError> {
    let mut keys = given.to_vec();
    if let Some(p) = file {
        keys.extend(read_file(p)?);
    }
    keys.iter()
        .map(|k| match k.trim() {
            "" => Err(KeyError::Empty { what: what.into() }),
            // Bearer values are trimmed by clients and by us: the key is its trimmed form.
            t => Ok(digest(t.as_bytes())),
        })
        .collect()
}

fn load(src: &KeySource) -> Result<Digests, KeyError> {
    Ok(Digests {
        api: collect("--api-key", &src.api_keys, &src.api_key_file)?,
        admin: collect("--admin-key", &src.admin_keys, &src.admin_key_file)?,
    })
}

/// The router's keys, reloadable.
pub struct Auth {
    source: KeySource,
    digests: RwLock<Digests>,
}

impl Auth {
    pub fn new(source: KeySource) -> Result<Self, KeyError> {
        let digests = RwLock::new(load(&source)?);
        Ok(Auth { source, digests })
    }

    /// Re-read the key files; on an error the keys in force stay as they were.
    pub fn reload(&self) -> Result<(), KeyError> {
        let fresh = load(&self.source)?;
        *self.digests.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        Ok(())
    }

    /// Whether any OpenAI-endpoint key is configured (without one the router must stay on
    /// loopback unless told otherwise).
    pub fn has_api_keys(&self) -> bool {
        !self.read().api.is_empty()
    }

    pub fn has_admin_keys(&self) -> bool {
        !self.read().admin.is_empty()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Digests> {
        self.digests.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Admit or refuse a request for `scope` presenting `bearer` (the Authorization value).
    pub fn check(&self, scope: Scope, bearer: Option<&[u8]>) -> Result<(), Refusal> {
        let d = self.read();
        let keys = match scope {
            Scope::Open => return Ok(()),
            Scope::Api if d.api.is_empty() => return Ok(()),
            Scope::Api => &d.api,
            // With API keys set, the admin endpoints never fall back to them: no admin key
            // configured means they are closed, not open.
            Scope::Admin if d.admin.is_empty() && d.api.is_empty() => return Ok(()),
            Scope::Admin if d.admin.is_empty() => return Err(Refusal::NoAdminKey),
            Scope::Admin => &d.admin,
        };
        let Some(presented) = bearer else {
            return Err(Refusal::Missing);
        };
        let got = digest(presented);
        // Every key is compared (no early exit), each comparison in constant time.
        let hit = keys
            .iter()
            .fold(subtle::Choice::from(0), |acc, k| acc | k.ct_eq(&got));
        if bool::from(hit) {
            Ok(())
        } else {
            Err(Refusal::Wrong)
        }
    }
}

/// Whether a router may serve on `ip`: always with API keys; without them only on a
/// loopback address, unless the operator said `--allow-unauthenticated`.
pub fn may_serve(ip: std::net::IpAddr, has_api_keys: bool, allow_unauthenticated: bool) -> bool {
    has_api_keys || allow_unauthenticated || ip.is_loopback()
}

/// Re-read the key files on every SIGHUP (rotation without a restart); a bad file is
/// logged and the keys in force stay.
pub async fn reload_on_sighup(auth: Arc<Auth>) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler: key files are read only at start");
            return;
        }
    };
    while hup.recv().await.is_some() {
        match auth.reload() {
            Ok(()) => tracing::info!(
                api_keys = auth.read().api.len(),
                admin_keys = auth.read().admin.len(),
                "SIGHUP: keys reloaded"
            ),
            Err(e) => tracing::error!(error = %e, "SIGHUP: keys NOT reloaded; the old keys stay"),
        }
    }
}

/// Why a request was refused (the messages never contain a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Wrong,
    NoAdminKey,
}

impl Refusal {
    fn message(self) -> &'static str {
        match self {
            Refusal::Missing => {
                "missing API key: send it as `Authorization: Bearer <key>`"
            }
            Refusal::Wrong => "incorrect API key provided",
            Refusal::NoAdminKey => {
                "this endpoint needs an admin key and the router has none configured (--admin-key or --admin-key-file)"
            }
        }
    }
}

/// The key in `Authorization: Bearer <key>` (scheme case-insensitive), trimmed.
fn bearer(req: &Request) -> Option<&[u8]> {
    let v = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = v.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    Some(rest.trim_ascii())
}

/// Middleware: refuse before the body is read or anything else runs.
pub async fn require_key(State(auth): State<Arc<Auth>>, req: Request, next: Next) -> Response {
    let sc = scope(req.uri().path());
    match auth.check(sc, bearer(&req)) {
        Ok(()) => next.run(req).await,
        Err(r) => {
            tracing::warn!(path = %req.uri().path(), scope = ?sc, reason = ?r, "request refused: not authenticated");
            let mut resp = ApiError::with_status(StatusCode::UNAUTHORIZED, r.message())
                .code("invalid_api_key")
                .into_response();
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn auth(api: &[&str], admin: &[&str]) -> Auth {
        Auth::new(KeySource {
            api_keys: api.iter().map(|s| s.to_string()).collect(),
            admin_keys: admin.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn paths_map_to_scopes() {
        assert_eq!(scope("/v1/completions"), Scope::Api);
        assert_eq!(scope("/v1/models/x"), Scope::Api);
        assert_eq!(scope("/nope"), Scope::Api);
        assert_eq!(scope("/workers"), Scope::Admin);
        assert_eq!(scope("/workers/1.2.3.4:5"), Scope::Admin);
        assert_eq!(scope("/config"), Scope::Admin);
        assert_eq!(scope("/health"), Scope::Open);
        assert_eq!(scope("/metrics"), Scope::Open);
        assert_eq!(scope("/live"), Scope::Open);
        assert_eq!(scope("/ready"), Scope::Open);
    }

    #[test]
    fn keys_are_checked_per_scope() {
        let a = auth(&["k1", "k2"], &["adm"]);
        assert_eq!(a.check(Scope::Api, None), Err(Refusal::Missing));
        assert_eq!(a.check(Scope::Api, Some(b"k3")), Err(Refusal::Wrong));
        assert_eq!(a.check(Scope::Api, Some(b"k")), Err(Refusal::Wrong));
        assert_eq!(a.check(Scope::Api, Some(b"k2")), Ok(()));
        assert_eq!(a.check(Scope::Api, Some(b"adm")), Err(Refusal::Wrong));
        assert_eq!(a.check(Scope::Admin, Some(b"k1")), Err(Refusal::Wrong));
        assert_eq!(a.check(Scope::Admin, Some(b"adm")), Ok(()));
        assert_eq!(a.check(Scope::Open, None), Ok(()));
    }

    #[test]
    fn admin_endpoints_close_when_only_api_keys_exist() {
        let a = auth(&["k1"], &[]);
        assert_eq!(a.check(Scope::Admin, Some(b"k1")), Err(Refusal::NoAdminKey));
        let open = auth(&[], &[]);
        assert_eq!(open.check(Scope::Admin, None), Ok(()));
        assert_eq!(open.check(Scope::Api, None), Ok(()));
    }

    #[test]
    fn empty_keys_are_refused_and_files_reload() {
        assert!(matches!(
            Auth::new(KeySource {
                api_keys: vec!["  ".into()],
                ..Default::default()
            }),
            Err(KeyError::Empty { .. })
        ));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys");
        std::fs::write(&f, "# rotated weekly\nold\n").unwrap();
        let a = Auth::new(KeySource {
            api_key_file: Some(f.clone()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(a.check(Scope::Api, Some(b"old")), Ok(()));
        std::fs::write(&f, "new\n").unwrap();
        a.reload().unwrap();
        assert_eq!(a.check(Scope::Api, Some(b"old")), Err(Refusal::Wrong));
        assert_eq!(a.check(Scope::Api, Some(b"new")), Ok(()));
        std::fs::write(&f, "\n").unwrap();
        assert!(matches!(a.reload(), Err(KeyError::NoKeyInFile(_))));
        assert_eq!(
            a.check(Scope::Api, Some(b"new")),
            Ok(()),
            "a failed reload keeps the keys"
        );
    }

    #[test]
    fn without_keys_only_loopback_serves_unless_allowed() {
        let any: std::net::IpAddr = "0.0.0.0".parse().unwrap();
        let lo6: std::net::IpAddr = "::1".parse().unwrap();
        assert!(may_serve("127.0.0.1".parse().unwrap(), false, false));
        assert!(may_serve(lo6, false, false));
        assert!(!may_serve(any, false, false));
        assert!(!may_serve("10.0.0.5".parse().unwrap(), false, false));
        assert!(may_serve(any, true, false));
        assert!(may_serve(any, false, true));
    }

    #[test]
    fn debug_never_shows_a_key() {
        let s = KeySource {
            api_keys: vec!["sk-secret".into()],
            ..Default::default()
        };
        assert!(!format!("{s:?}").contains("sk-secret"));
    }
}
