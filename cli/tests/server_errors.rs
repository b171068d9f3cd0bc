//! A server bug reaches the client as a server error: a worker's INTERNAL status travels
//! through a real decode server and a real router and arrives as HTTP 500 `server_error`,
//! never as a 400 that would blame the client. The bug itself is played by a prefill
//! server that answers every prefill with INTERNAL (the engine has no hook to break an
//! invariant on demand); everything downstream of it is the real thing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_proto::pb;
use std::time::Duration;
use support::*;
use tonic::{Request, Response, Status};

/// A prefill server with a bug: it reports the real decode server's model and layout
/// (so the router pairs them) and fails every prefill as the engine's invariant checks do.
struct BuggyPrefill {
    info: pb::WorkerInfo,
}

const BUG: &str = "internal error: prefix cache: node 3 missing";

#[tonic::async_trait]
impl pb::worker_server::Worker for BuggyPrefill {
    async fn info(&self, _req: Request<pb::Empty>) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn health(
        &self,
        _req: Request<pb::Empty>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse { ok: true }))
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for BuggyPrefill {
    type PrefillStream = tokio_stream::Empty<Result<pb::PrefillMessage, Status>>;

    async fn prefill(
        &self,
        _req: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        Err(Status::internal(BUG))
    }
}

#[test]
fn a_workers_internal_error_is_a_500_server_error() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (_d, ad) = role("decode", &[]);
    let mut info = rt.block_on(async {
        let mut c = pb::worker_client::WorkerClient::connect(format!("http://{ad}"))
            .await
            .unwrap();
        c.info(pb::Empty {}).await.unwrap().into_inner()
    });
    info.role = "prefill".into();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let ap = listener.local_addr().unwrap().to_string();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(pb::worker_server::WorkerServer::new(BuggyPrefill {
                info: info.clone(),
            }))
            .add_service(pb::prefill_server::PrefillServer::new(BuggyPrefill {
                info,
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let (_r, ar) = role("router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);

    let (st, body) = complete(&ar, &greedy(&prompt(3, 10), 4)).unwrap_err();
    assert_eq!(st, 500, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "server_error", "{body}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains(BUG),
        "{body}"
    );
    let (st, sse) = stream(
        &ar,
        &serde_json::json!({"prompt": prompt(4, 10), "max_tokens": 2, "stream": true}),
        Duration::from_secs(10),
    );
    assert_eq!(st, 500);
    drop(sse);
}
