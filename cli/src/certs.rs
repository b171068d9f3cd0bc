//! A throwaway certificate authority and one certificate per role, for a local cluster
//! with mutual TLS (`pdserve up` by default, and `pdserve certs` for hand-started roles).
//!
//! The CA's private key lives only in this process's memory and is never written: once
//! the files exist nobody can mint another certificate this cluster trusts, and a new run
//! makes a new CA. Each role gets the uses it needs (the router is a client only, a
//! prefill server a server only, a decode server both), so a router's key cannot serve
//! as a worker, nor a prefill server's dial one.

use anyhow::{Context, Result};
use pdserve_proto::tls::{Hops, TlsFiles};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long the certificates stay valid: throwaway material for one cluster's lifetime.
pub const VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// The roles that get a certificate, with the hops each takes.
pub const ROLES: [(&str, Hops); 3] = [
    ("router", Hops::Client),
    ("prefill", Hops::Server),
    ("decode", Hops::Both),
];

/// The CA certificate's file name in a certificate folder.
pub const CA_FILE: &str = "ca.pem";

/// The files of `role` in a folder written by [`generate`].
pub fn files(dir: &Path, role: &str) -> TlsFiles {
    TlsFiles {
        cert: dir.join(format!("{role}.pem")),
        key: dir.join(format!("{role}.key")),
        ca: dir.join(CA_FILE),
    }
}

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Folder to write ca.pem and router/prefill/decode .pem + .key into (created, mode 0700).
    #[arg(long)]
    out: PathBuf,
    /// Names and addresses the worker certificates are valid for (repeated or
    /// comma-separated): what the router and decode servers dial.
    #[arg(long, value_delimiter = ',', default_values_t = ["127.0.0.1".to_string(), "localhost".to_string(), "::1".to_string()])]
    host: Vec<String>,
}

/// `pdserve certs`.
pub fn certs(a: CertsArgs) -> Result<()> {
    generate(&a.out, &a.host)?;
    println!(
        "pdserve certs: wrote {} and a certificate + key for router, prefill and decode into {} (valid {} days for {}); pass each role --tls-cert, --tls-key and --tls-ca",
        CA_FILE,
        a.out.display(),
        VALIDITY.as_secs() / 86400,
        a.host.join(", ")
    );
    Ok(())
}

fn params(common_name: &str, sans: &[String]) -> Result<CertificateParams> {
    let mut p = CertificateParams::new(sans.to_vec()).context("certificate names")?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    p.distinguished_name = dn;
    let now = time::OffsetDateTime::now_utc();
    // An hour of slack for clocks a little behind this one.
    p.not_before = now - time::Duration::hours(1);
    p.not_after = now + VALIDITY;
    Ok(p)
}

/// Write a fresh CA certificate and, for every role of [`ROLES`], a certificate signed by
/// it (valid for `hosts`) and its key into `dir`. Keys are written mode 0600.
pub fn generate(dir: &Path, hosts: &[String]) -> Result<()> {
    create_private_dir(dir)?;
    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca = params("pdserve throwaway CA", &[])?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).context("signing the CA")?;
    write(&dir.join(CA_FILE), ca_cert.pem().as_bytes(), 0o644)?;
    let issuer = Issuer::new(ca, ca_key);
    for (role, hops) in ROLES {
        let key = KeyPair::generate().with_context(|| format!("generating the {role} key"))?;
        let mut p = params(&format!("pdserve-{role}"), hosts)?;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = match hops {
            Hops::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            Hops::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Hops::Both => vec![
                ExtendedKeyUsagePurpose::ClientAuth,
                ExtendedKeyUsagePurpose::ServerAuth,
            ],
        };
        let cert = p
            .signed_by(&key, &issuer)
            .with_context(|| format!("signing the {role} certificate"))?;
        let f = files(dir, role);
        write(&f.cert, cert.pem().as_bytes(), 0o644)?;
        write(&f.key, key.serialize_pem().as_bytes(), 0o600)?;
    }
    Ok(())
}

fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pdserve_proto::tls::{ClusterTls, TlsError};

    #[test]
    fn every_role_loads_for_its_hops_and_not_for_the_others() {
        let dir = tempfile::tempdir().unwrap();
        generate(dir.path(), &["127.0.0.1".into()]).unwrap();
        for (role, hops) in ROLES {
            ClusterTls::load(&files(dir.path(), role), hops).unwrap();
        }
        // The router's certificate is a client's only; the prefill server's a server's.
        let e = ClusterTls::load(&files(dir.path(), "router"), Hops::Server).unwrap_err();
        assert!(
            matches!(
                e,
                TlsError::NotUnderCa {
                    usage: "server",
                    ..
                }
            ),
            "{e}"
        );
        let e = ClusterTls::load(&files(dir.path(), "prefill"), Hops::Both).unwrap_err();
        assert!(
            matches!(
                e,
                TlsError::NotUnderCa {
                    usage: "client",
                    ..
                }
            ),
            "{e}"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(files(dir.path(), "decode").key)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn mismatched_or_foreign_files_are_startup_errors_naming_the_flag() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        generate(a.path(), &["127.0.0.1".into()]).unwrap();
        generate(b.path(), &["127.0.0.1".into()]).unwrap();
        let mut f = files(a.path(), "decode");
        f.key = files(a.path(), "prefill").key;
        let e = ClusterTls::load(&f, Hops::Both).unwrap_err();
        assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");
        assert!(e.to_string().starts_with("--tls-key "), "{e}");
        let mut f = files(a.path(), "decode");
        f.ca = b.path().join(CA_FILE);
        let e = ClusterTls::load(&f, Hops::Both).unwrap_err();
        assert!(
            e.to_string()
                .contains("is not a valid client certificate under --tls-ca"),
            "{e}"
        );
        let mut f = files(a.path(), "decode");
        f.cert = a.path().join("missing.pem");
        let e = ClusterTls::load(&f, Hops::Both).unwrap_err();
        assert!(e.to_string().starts_with("--tls-cert "), "{e}");
        let mut f = files(a.path(), "decode");
        f.ca = f.key.clone();
        let e = ClusterTls::load(&f, Hops::Both).unwrap_err();
        assert!(e.to_string().contains("holds no PEM certificate"), "{e}");
    }
}
