//! Mutual TLS on the gRPC hops (router -> decode, decode -> prefill, the router's health
//! polls and `POST /workers` checks), through tonic's rustls support.
//!
//! Every process has one certificate and key (`--tls-cert`, `--tls-key`) and trusts one
//! CA (`--tls-ca`). Servers require a client certificate signed by that CA (a peer
//! without one, or with one from another CA, fails the handshake before any RPC), and
//! clients check the server's certificate against the same CA and the address they dial
//! (so a server certificate names its host: a DNS name or an IP address).
//!
//! [`ClusterTls::load`] reads and checks the files at startup, so a wrong path, a key
//! that does not belong to the certificate or a certificate outside the CA is a startup
//! error naming the flag, not a handshake failure at the first request.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, TrustAnchor, UnixTime};
use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How long a server waits for a peer to finish its TLS handshake: a peer that opens a
/// connection and stalls holds it no longer than this.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The three files of `--tls-cert`, `--tls-key`, `--tls-ca`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// Which ends of the gRPC hops a process takes: what its certificate must be good for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hops {
    /// The router: a client only.
    Client,
    /// A prefill server: a server only.
    Server,
    /// A decode server: serves the router and dials prefill servers.
    Both,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls-{flag} {path}: {reason}")]
    Read {
        flag: &'static str,
        path: String,
        reason: String,
    },
    #[error("--tls-key {key} does not belong to --tls-cert {cert}: {reason}")]
    KeyMismatch {
        key: String,
        cert: String,
        reason: String,
    },
    #[error("--tls-cert {cert} is not a valid {usage} certificate under --tls-ca {ca}: {reason}")]
    NotUnderCa {
        cert: String,
        ca: String,
        usage: &'static str,
        reason: String,
    },
    #[error("--tls-ca {ca}: {reason}")]
    BadCa { ca: String, reason: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// A process's TLS material, checked; cheap to clone.
#[derive(Clone)]
pub struct ClusterTls {
    identity: Identity,
    ca: Certificate,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls(..)")
    }
}

fn shown(p: &Path) -> String {
    p.display().to_string()
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Read {
        flag,
        path: shown(path),
        reason: e.to_string(),
    })
}

fn certs(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |reason: String| TlsError::Read {
        flag,
        path: shown(path),
        reason,
    };
    let v = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not a PEM certificate file ({e})")))?;
    if v.is_empty() {
        return Err(bad(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    Ok(v)
}

impl ClusterTls {
    /// Read and check `files` for a process taking `hops`: the key must be the
    /// certificate's, and the certificate must chain to the CA and be valid now for the
    /// uses `hops` needs (client and/or server authentication).
    pub fn load(files: &TlsFiles, hops: Hops) -> Result<Self, TlsError> {
        let cert_pem = read("cert", &files.cert)?;
        let key_pem = read("key", &files.key)?;
        let ca_pem = read("ca", &files.ca)?;
        let chain = certs("cert", &files.cert, &cert_pem)?;
        let cas = certs("ca", &files.ca, &ca_pem)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Read {
            flag: "key",
            path: shown(&files.key),
            reason: format!("holds no PEM private key ({e})"),
        })?;
        let provider = rustls::crypto::ring::default_provider();
        rustls::sign::CertifiedKey::from_der(chain.clone(), key, &provider).map_err(|e| {
            TlsError::KeyMismatch {
                key: shown(&files.key),
                cert: shown(&files.cert),
                reason: e.to_string(),
            }
        })?;
        let anchors = cas
            .iter()
            .map(|c| webpki::anchor_from_trusted_cert(c).map(|a| a.to_owned()))
            .collect::<Result<Vec<TrustAnchor<'static>>, _>>()
            .map_err(|e| TlsError::BadCa {
                ca: shown(&files.ca),
                reason: format!("not a usable CA certificate ({e})"),
            })?;
        let not_under = |usage, reason: String| TlsError::NotUnderCa {
            cert: shown(&files.cert),
            ca: shown(&files.ca),
            usage,
            reason,
        };
        let leaf = webpki::EndEntityCert::try_from(&chain[0])
            .map_err(|e| not_under("X.509", e.to_string()))?;
        let uses: &[(&'static str, webpki::KeyUsage)] = match hops {
            Hops::Client => &[("client", webpki::KeyUsage::client_auth())],
            Hops::Server => &[("server", webpki::KeyUsage::server_auth())],
            Hops::Both => &[
                ("client", webpki::KeyUsage::client_auth()),
                ("server", webpki::KeyUsage::server_auth()),
            ],
        };
        for (usage, eku) in uses {
            leaf.verify_for_usage(
                provider.signature_verification_algorithms.all,
                &anchors,
                &chain[1..],
                UnixTime::now(),
                eku,
                None,
                None,
            )
            .map_err(|e| not_under(usage, format!("{e:?}")))?;
        }
        Ok(ClusterTls {
            identity: Identity::from_pem(cert_pem, key_pem),
            ca: Certificate::from_pem(ca_pem),
        })
    }

    /// The server side: this identity, a client certificate under the CA required, and
    /// [`HANDSHAKE_TIMEOUT`] for the handshake.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// The client side: the server checked against the CA, this identity presented.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
    }
}

/// The endpoint of a gRPC peer at `addr` (host:port): `https` with mutual TLS when `tls`
/// is given, plain `http` otherwise. The one place peers' endpoints are made.
pub fn endpoint(addr: &str, tls: Option<&ClusterTls>) -> Result<Endpoint, tonic::transport::Error> {
    match tls {
        None => Endpoint::from_shared(format!("http://{addr}")),
        Some(t) => Endpoint::from_shared(format!("https://{addr}"))?.tls_config(t.client()),
    }
}

/// Whether an error (a failed call's status or a connect error) comes from a TLS
/// handshake the peer failed: a certificate outside the CA, for another name, or none.
pub fn is_handshake_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        cur = err.source();
    }
    false
}
