//! The cluster token on the gRPC hops: a rogue client without it (or with a wrong one) is
//! refused by every server, a worker that cannot prove it is refused by `POST /workers`,
//! and a cluster whose processes share it serves as before.

use crate::support::*;
use pdserve_proto::pb;
use serde_json::json;
use std::time::Duration;

const TOKEN: &str = "cluster-test-token-42";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert(pdserve_proto::cluster::TOKEN, t.parse().unwrap());
    }
    r
}

fn generate_status(addr: &str, prefill: &str, token: Option<&str>) -> tonic::Status {
    rt().block_on(async {
        let mut c = pb::decode_client::DecodeClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let req = pb::GenerateRequest {
            prompt: vec![5, 6, 7],
            sampling: None,
            max_new_tokens: 2,
            stop_tokens: Vec::new(),
            prefill_addr: prefill.to_string(),
            ..Default::default()
        };
        c.generate(with_token(req, token)).await.unwrap_err()
    })
}

fn prefill_status(addr: &str, token: Option<&str>) -> tonic::Status {
    rt().block_on(async {
        let mut c = pb::prefill_client::PrefillClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let req = pb::PrefillRequest {
            prompt: vec![5, 6, 7],
            sampling: None,
            receiver_layout: None,
            early_first_token: false,
        };
        c.prefill(with_token(req, token)).await.unwrap_err()
    })
}

#[test]
fn the_cluster_token_guards_every_grpc_hop_and_worker_admission() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster-token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let f = file.to_str().unwrap();
    let (_p, ap) = role("prefill", &["--cluster-token-file", f]);
    let (_d, ad) = role("decode", &["--cluster-token-file", f]);
    let mut c = bin();
    c.env("PDSERVE_CLUSTER_TOKEN", TOKEN).args([
        "router",
        "--listen",
        "127.0.0.1:0",
        "--prefill",
        &ap,
        "--decode",
        &ad,
    ]);
    let router = Proc::start(c);
    let ar = router
        .wait_line("listening on", 60)
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    wait_healthy(&ar, 60);
    let (ids, _) = complete(&ar, &greedy(&prompt(1, 12), 6)).unwrap();
    assert_eq!(ids.len(), 6, "the cluster serves with the token");

    // Rogue gRPC clients: no token, or a wrong one, on each server.
    for (who, st) in [
        ("decode, no token", generate_status(&ad, &ap, None)),
        (
            "decode, wrong token",
            generate_status(&ad, &ap, Some("guess")),
        ),
        ("prefill, no token", prefill_status(&ap, None)),
        ("prefill, wrong token", prefill_status(&ap, Some("guess"))),
    ] {
        assert_eq!(st.code(), tonic::Code::Unauthenticated, "{who}: {st:?}");
    }
    // With the token the call reaches the service (which then checks the request itself).
    let st = prefill_status(&ap, Some(TOKEN));
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");

    // A rogue worker (no token, or another cluster's) is refused; a member is admitted.
    let add = |addr: &str| {
        http(
            &ar,
            "POST",
            "/workers",
            Some(&json!({"address": addr, "role": "decode"})),
            Duration::from_secs(10),
        )
    };
    let (_rogue, a_rogue) = role("decode", &[]);
    let (st, body) = add(&a_rogue);
    assert_eq!(st, 403, "{body}");
    assert!(
        body.contains("worker_unauthenticated") && body.contains("no cluster-token proof"),
        "{body}"
    );
    let (_other, a_other) = role("decode", &["--cluster-token", "another-cluster"]);
    let (st, body) = add(&a_other);
    assert_eq!(st, 403, "{body}");
    assert!(body.contains("proof is wrong"), "{body}");
    let (_member, a_member) = role("decode", &["--cluster-token-file", f]);
    let (st, body) = add(&a_member);
    assert_eq!(st, 201, "{body}");

    // The token never shows in a worker's reported configuration.
    let info = rt().block_on(async {
        let mut c = pb::worker_client::WorkerClient::connect(format!("http://{ad}"))
            .await
            .unwrap();
        c.info(pb::Empty {}).await.unwrap().into_inner()
    });
    let cfg = format!("{:?}", info.config);
    assert!(!cfg.contains(TOKEN), "{cfg}");
}
