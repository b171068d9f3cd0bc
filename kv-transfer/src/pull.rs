//! The decode side of a transfer: ask a prefill server to run a prompt and receive its KV.

use crate::{layout_info, max_message_bytes, Assembler, Expected, Prefilled, TransferError};
use pdserve_engine::kv::KvLayout;
use pdserve_proto::cluster::ClusterToken;
use pdserve_proto::pb;
use pdserve_proto::pb::prefill_client::PrefillClient;
use pdserve_proto::tls::ClusterTls;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How often a prefill server sends [`crate::progress_message`] while it computes; a
/// receiver's progress deadline must be well above it.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// HTTP/2 flow-control windows the receiving side grants: the stream's (several chunks of
/// [`crate::MAX_CHUNK_BYTES`]) and the connection's.
const STREAM_WINDOW: u32 = 32 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;
/// The largest HTTP/2 frame the receiving side accepts (the protocol's default is 16 KiB):
/// the header with its logits crosses in one frame and a page chunk in a few, not in
/// hundreds of small writes and reads. (h2 buffers a whole frame before tonic sees its
/// message's length, so this also bounds what one frame may make the receiver hold.)
const MAX_FRAME: u32 = 1 << 20;

#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Deadline for the TCP/HTTP2 connection.
    pub connect_timeout: Duration,
    /// Deadline for the prefill to finish (queueing and compute, up to the header).
    pub prefill_timeout: Duration,
    /// Deadline for each next message: a peer that sends nothing (not even its
    /// heartbeat) for this long fails the transfer, however long the transfer is.
    pub progress_timeout: Duration,
    /// Sent to the prefill server (which refuses calls without it when it has one).
    pub cluster_token: Option<ClusterToken>,
    /// Mutual TLS to the prefill server (its certificate checked against the CA).
    pub tls: Option<ClusterTls>,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            connect_timeout: Duration::from_secs(2),
            prefill_timeout: Duration::from_secs(120),
            progress_timeout: Duration::from_secs(10),
            cluster_token: None,
            tls: None,
        }
    }
}

/// What a pull asks the prefill server for.
#[derive(Debug)]
pub struct PullRequest {
    pub prompt: Vec<u32>,
    pub sampling: pb::SamplingParams,
    pub request_id: String,
    /// Where the sampled token goes as soon as the prefill server sends it, ahead of the
    /// header and the pages (None: it comes with the header only).
    pub first_token: Option<oneshot::Sender<u32>>,
}

/// Prefill `req.prompt` on the server at `addr` (host:port) and receive its verified KV
/// state, which must be what `expected` says (checked at the header, before any page is
/// kept). No message may exceed [`max_message_bytes`]. Dropping the returned future
/// cancels the prefill on the server.
pub async fn pull_prefill(
    addr: &str,
    layout: &KvLayout,
    expected: Expected,
    req: PullRequest,
    opts: PullOptions,
) -> Result<Prefilled, TransferError> {
    let t0 = Instant::now();
    let unreachable = |reason: String| TransferError::Unreachable {
        addr: addr.to_string(),
        reason,
    };
    let endpoint = pdserve_proto::tls::endpoint(addr, opts.tls.as_ref())
        .map_err(|e| unreachable(e.to_string()))?
        .connect_timeout(opts.connect_timeout)
        // HTTP/2's default 64 KiB windows cap a bulk stream at one window per round trip:
        // the receiver grants the prefill server a window of several chunks.
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| unreachable(format!("{e}: {}", source_chain(&e))))?;
    let connected = t0.elapsed();
    let mut client = PrefillClient::new(channel)
        .max_decoding_message_size(max_message_bytes(layout, expected.vocab_size))
        .max_encoding_message_size(usize::MAX);
    let PullRequest {
        prompt,
        sampling,
        request_id,
        mut first_token,
    } = req;
    let req = pb::PrefillRequest {
        prompt,
        sampling: Some(sampling),
        receiver_layout: Some(layout_info(layout)),
        early_first_token: first_token.is_some(),
    };
    let timeout = |what: &'static str| TransferError::Timeout {
        addr: addr.to_string(),
        what,
        secs: t0.elapsed().as_secs_f64(),
    };
    let peer = |status: tonic::Status| {
        // The prefill server itself never answers Unknown: that code is a broken connection.
        if matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown
        ) {
            unreachable(status.message().to_string())
        } else if status.code() == tonic::Code::OutOfRange {
            // Our own decoder's verdict on a message over max_message_bytes: the peer's
            // fault, never the client's.
            TransferError::Protocol(format!("from {addr}: {}", status.message()))
        } else {
            TransferError::Peer {
                addr: addr.to_string(),
                status,
            }
        }
    };
    let prefill_left = || opts.prefill_timeout.saturating_sub(t0.elapsed());
    let mut call = pdserve_proto::with_request_id(req, &request_id);
    if let Some(t) = &opts.cluster_token {
        t.attach(&mut call);
    }
    let mut stream = tokio::time::timeout(
        opts.progress_timeout.min(prefill_left()),
        client.prefill(call),
    )
    .await
    .map_err(|_| timeout("the prefill to start"))?
    .map_err(peer)?
    .into_inner();
    let mut asm = Assembler::new(layout, expected);
    let (mut header_at, mut first_at) = (None, None);
    loop {
        // Before the header the prefill's own deadline also applies; after it only
        // progress counts (the header has bounded what may still come).
        let (wait, what) = match asm.has_header() {
            false if prefill_left() < opts.progress_timeout => {
                (prefill_left(), "the prefill to finish")
            }
            false => (
                opts.progress_timeout,
                "progress (no message, not even a heartbeat)",
            ),
            true => (opts.progress_timeout, "the next KV message"),
        };
        let msg = tokio::time::timeout(wait, stream.message())
            .await
            .map_err(|_| timeout(what))?
            .map_err(peer)?;
        match msg {
            Some(m) => {
                if let Some(t) = asm.push(m)? {
                    first_at = Some(t0.elapsed());
                    // A receiver that stopped waiting for it has nothing to be told.
                    if let Some(tx) = first_token.take() {
                        let _ = tx.send(t);
                    }
                }
            }
            None => break,
        }
        if header_at.is_none() && asm.has_header() {
            header_at = Some(t0.elapsed());
        }
    }
    let done = asm.finish()?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    tracing::debug!(
        connect_ms = ms(connected),
        first_token_ms = first_at.map_or(0.0, ms),
        header_ms = header_at.map_or(0.0, ms),
        done_ms = ms(t0.elapsed()),
        bytes = done.payload_bytes(),
        "KV pulled"
    );
    Ok(done)
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut parts = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}
