//! The mutual-TLS flags every role takes, and the rules tying them to the cluster token.

use crate::layered::{flag, Flags};
use anyhow::{bail, Result};
use pdserve_proto::cluster::ClusterToken;
use pdserve_proto::tls::{ClusterTls, Hops, TlsFiles};
use std::path::PathBuf;

/// `--tls-cert`, `--tls-key`, `--tls-ca` (config keys `tls_cert`, `tls_key`, `tls_ca`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsFlags {
    /// PEM certificate of this process for mutual TLS on every gRPC hop (with --tls-key
    /// and --tls-ca). Signed by --tls-ca; a worker's names the address others dial (DNS
    /// name or IP).
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate of the cluster's CA: peers must present a certificate it signed.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
}

impl TlsFlags {
    pub fn put(&self, f: &mut Flags) {
        flag(f, "tls_cert", &self.tls_cert);
        flag(f, "tls_key", &self.tls_key);
        flag(f, "tls_ca", &self.tls_ca);
    }
}

/// The effective TLS material: none when no file is named, all three or an error
/// otherwise, checked for `hops` (see [`ClusterTls::load`]).
pub fn cluster_tls(
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
    ca: &Option<PathBuf>,
    hops: Hops,
) -> Result<Option<ClusterTls>> {
    match (cert, key, ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(ca)) => {
            let files = TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            };
            Ok(Some(ClusterTls::load(&files, hops)?))
        }
        _ => {
            let missing: Vec<&str> = [("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)]
                .into_iter()
                .filter(|(_, v)| v.is_none())
                .map(|(n, _)| n)
                .collect();
            bail!(
                "--tls-cert, --tls-key and --tls-ca go together; missing {}",
                missing.join(", ")
            )
        }
    }
}

/// A router or decode server with TLS also needs the cluster token: it keys the pull
/// grants (the router signs which prefill server each request pulls from, the decode
/// server checks it before connecting), which TLS alone cannot say.
pub fn require_grant_key(
    role: &str,
    tls: &Option<ClusterTls>,
    token: &Option<ClusterToken>,
) -> Result<()> {
    if tls.is_some() && token.is_none() {
        bail!(
            "{role} with --tls-*: give it the cluster token too (--cluster-token-file or PDSERVE_CLUSTER_TOKEN): the router signs each request's prefill address with it and decode servers pull only from a signed one"
        );
    }
    Ok(())
}
