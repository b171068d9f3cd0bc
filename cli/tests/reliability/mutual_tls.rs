//! Mutual TLS on the gRPC hops and the router's pull grants: a cluster on TLS serves; a
//! rogue gRPC client without a certificate, with one from another CA, or speaking plain
//! gRPC is refused by every server; a worker whose certificate is from another CA is
//! refused by `POST /workers`; a decode server asked to pull from a prefill address the
//! router did not grant refuses without connecting there; bad TLS files fail at startup.

use crate::support::*;
use pdserve_proto::pb;
use pdserve_proto::tls::{ClusterTls, Hops, TlsFiles};
use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const TOKEN: &str = "tls-test-token-7";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `pdserve certs --out DIR`: a fresh CA and per-role files.
fn certs(dir: &Path) {
    let out = bin()
        .args([
            "certs",
            "--out",
            dir.to_str().unwrap(),
            "--host",
            "127.0.0.1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn files(dir: &Path, role: &str) -> TlsFiles {
    TlsFiles {
        cert: dir.join(format!("{role}.pem")),
        key: dir.join(format!("{role}.key")),
        ca: dir.join("ca.pem"),
    }
}

/// The `--tls-*` flags of `role` from `dir`.
fn tls_args(dir: &Path, role: &str) -> Vec<String> {
    let f = files(dir, role);
    [
        ("--tls-cert", f.cert),
        ("--tls-key", f.key),
        ("--tls-ca", f.ca),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v.to_str().unwrap().to_string()])
    .collect()
}

fn start(role_name: &str, dir: &Path, role_files: &str, extra: &[&str]) -> (Proc, String) {
    let mut args = tls_args(dir, role_files);
    args.extend(["--cluster-token", TOKEN].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    role(role_name, &refs)
}

/// How a client reaches a server in these tests.
enum Client<'a> {
    Plain,
    /// TLS trusting `ca`, presenting `identity` (a role's files) if any.
    Tls {
        ca: &'a Path,
        identity: Option<(&'a Path, &'a str)>,
    },
}

fn endpoint(addr: &str, how: &Client) -> Endpoint {
    match how {
        Client::Plain => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        Client::Tls { ca, identity } => {
            let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(
                std::fs::read(ca.join("ca.pem")).unwrap(),
            ));
            if let Some((dir, role)) = identity {
                let f = files(dir, role);
                tls = tls.identity(Identity::from_pem(
                    std::fs::read(f.cert).unwrap(),
                    std::fs::read(f.key).unwrap(),
                ));
            }
            Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(tls)
                .unwrap()
        }
    }
    .connect_timeout(Duration::from_secs(5))
}

/// `Worker.Info` on `addr` as `how`: the call's outcome.
fn info(addr: &str, how: &Client) -> Result<pb::WorkerInfo, String> {
    rt().block_on(async {
        let ch = endpoint(addr, how)
            .connect()
            .await
            .map_err(|e| format!("connect: {e:?}"))?;
        let mut c = pb::worker_client::WorkerClient::new(ch);
        tokio::time::timeout(Duration::from_secs(5), c.info(pb::Empty {}))
            .await
            .map_err(|_| "no answer within 5 s".to_string())?
            .map(|r| r.into_inner())
            .map_err(|s| format!("{s:?}"))
    })
}

#[test]
fn a_tls_cluster_serves_and_every_server_refuses_peers_outside_its_ca() {
    let ours = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    certs(ours.path());
    certs(theirs.path());
    let d = ours.path();
    let (_p, ap) = start("prefill", d, "prefill", &[]);
    let (_d, ad) = start("decode", d, "decode", &[]);
    let (router, ar) = start("router", d, "router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);
    let (ids, _) = complete(&ar, &greedy(&prompt(1, 12), 6)).unwrap();
    assert_eq!(ids.len(), 6, "the cluster answers over mutual TLS");

    for (name, addr) in [("prefill", &ap), ("decode", &ad)] {
        // A member's certificate gets through (so the refusals below are the TLS check).
        let member = Client::Tls {
            ca: d,
            identity: Some((d, "router")),
        };
        assert!(info(addr, &member).is_ok(), "{name}: a member is refused");
        for (who, how) in [
            ("plain gRPC", Client::Plain),
            (
                "TLS without a client certificate",
                Client::Tls {
                    ca: d,
                    identity: None,
                },
            ),
            (
                "a client certificate from another CA",
                Client::Tls {
                    ca: d,
                    identity: Some((theirs.path(), "router")),
                },
            ),
        ] {
            let r = info(addr, &how);
            assert!(
                r.is_err(),
                "{name} answered a rogue client with {who}: {r:?}"
            );
        }
        // A client that trusts another CA does not take this server for a member either.
        let fooled = Client::Tls {
            ca: theirs.path(),
            identity: Some((theirs.path(), "router")),
        };
        assert!(info(addr, &fooled).is_err(), "{name}");
    }

    // POST /workers: a decode server whose certificate is from another CA (even with the
    // right cluster token) is refused; one under the cluster's CA is admitted.
    let add = |addr: &str| {
        http(
            &ar,
            "POST",
            "/workers",
            Some(&json!({"address": addr, "role": "decode"})),
            Duration::from_secs(10),
        )
    };
    let (_rogue, a_rogue) = start("decode", theirs.path(), "decode", &[]);
    let (st, body) = add(&a_rogue);
    assert_eq!(st, 403, "{body}");
    assert!(
        body.contains("worker_unauthenticated") && body.contains("TLS handshake failed"),
        "{body}"
    );
    let (_member, a_member) = start("decode", d, "decode", &[]);
    let (st, body) = add(&a_member);
    assert_eq!(st, 201, "{body}");
    drop(router);
}

/// `Decode.Generate` over TLS as a member, naming `prefill` with `grant` (the prefill
/// address the grant was made for, or none).
fn generate(dir: &Path, addr: &str, prefill: &str, grant: Option<&str>) -> tonic::Status {
    rt().block_on(async {
        let tls = ClusterTls::load(&files(dir, "router"), Hops::Client).unwrap();
        let ch = pdserve_proto::tls::endpoint(addr, Some(&tls))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = pb::decode_client::DecodeClient::new(ch);
        let req = pb::GenerateRequest {
            prompt: vec![5, 6, 7],
            sampling: None,
            max_new_tokens: 2,
            stop_tokens: Vec::new(),
            prefill_addr: prefill.to_string(),
            top_logprobs: None,
            ..Default::default()
        };
        let mut call = pdserve_proto::with_request_id(req, "rogue-1");
        let token = pdserve_proto::cluster::ClusterToken::new(TOKEN).unwrap();
        token.attach(&mut call);
        if let Some(g) = grant {
            token.grant_pull(&mut call, g);
        }
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            let mut s = c.generate(call).await?.into_inner();
            while s.message().await?.is_some() {}
            Ok::<_, tonic::Status>(())
        })
        .await
        .expect("Generate did not end within 10 s");
        r.expect_err("Generate with a bad grant succeeded")
    })
}

/// A listener that counts the connections it gets and closes each at once.
struct Bait {
    addr: String,
    seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Bait {
    fn start() -> Bait {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = seen.clone();
        // Runs until the test process ends (it only counts and closes).
        std::thread::spawn(move || {
            for c in l.incoming() {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(c);
            }
        });
        Bait { addr, seen }
    }

    fn seen(&self) -> usize {
        self.seen.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[test]
fn a_decode_server_pulls_only_from_the_prefill_address_its_router_granted() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path());
    let (_d, ad) = start("decode", dir.path(), "decode", &[]);
    // The address a rogue caller names: it must never see a connection.
    let bait = Bait::start();
    for (why, grant) in [
        ("no grant", None),
        ("a grant for another prefill address", Some("127.0.0.1:1")),
    ] {
        let st = generate(dir.path(), &ad, &bait.addr, grant);
        assert_eq!(st.code(), tonic::Code::PermissionDenied, "{why}: {st:?}");
        assert!(st.message().contains(&bait.addr), "{why}: {st:?}");
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        bait.seen(),
        0,
        "the decode server connected to an ungranted address"
    );
    // With the grant for that address the decode server does go there (and fails on the
    // bait, which closes at once): the check, not a broken pull, made the refusals above.
    let st = generate(dir.path(), &ad, &bait.addr, Some(&bait.addr));
    assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
    assert!(bait.seen() >= 1, "no connection to the granted address");
}

/// `pdserve <role> ARGS` must exit non-zero within seconds, saying `want` on stderr.
fn refuses_to_start(role_name: &str, args: &[&str], want: &str) {
    let out = bin()
        .arg(role_name)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{role_name} {args:?} started");
    assert!(err.contains(want), "{role_name} {args:?}: {err}");
}

#[test]
fn bad_tls_files_are_startup_errors_naming_the_flag() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    certs(a.path());
    certs(b.path());
    let p = |dir: &Path, f: &str| dir.join(f).to_str().unwrap().to_string();
    let (a_, b_) = (a.path(), b.path());
    let token = ["--cluster-token", TOKEN];
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--tls-cert".into(), p(a_, "decode.pem")],
            "--tls-cert, --tls-key and --tls-ca go together; missing --tls-key, --tls-ca",
        ),
        (
            vec![
                "--tls-cert".into(),
                p(a_, "decode.pem"),
                "--tls-key".into(),
                p(a_, "prefill.key"),
                "--tls-ca".into(),
                p(a_, "ca.pem"),
            ],
            "does not belong to --tls-cert",
        ),
        (
            vec![
                "--tls-cert".into(),
                p(a_, "decode.pem"),
                "--tls-key".into(),
                p(a_, "decode.key"),
                "--tls-ca".into(),
                p(b_, "ca.pem"),
            ],
            "is not a valid client certificate under --tls-ca",
        ),
        (
            vec![
                "--tls-cert".into(),
                p(a_, "nowhere.pem"),
                "--tls-key".into(),
                p(a_, "decode.key"),
                "--tls-ca".into(),
                p(a_, "ca.pem"),
            ],
            "--tls-cert ",
        ),
    ];
    for (args, want) in &cases {
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend(token);
        refuses_to_start("decode", &all, want);
    }
    // A router or decode server on TLS needs the cluster token: it keys the pull grants.
    let d = tls_args(a_, "decode");
    let d: Vec<&str> = d.iter().map(String::as_str).collect();
    refuses_to_start("decode", &d, "give it the cluster token too");
    // The prefill server's certificate is not a client's: the router cannot use it.
    let r = tls_args(a_, "prefill");
    let mut r: Vec<&str> = r.iter().map(String::as_str).collect();
    r.extend(token);
    refuses_to_start("router", &r, "is not a valid client certificate");
}
