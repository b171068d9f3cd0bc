//! A rogue prefill peer against a real decode server that is serving real traffic: a
//! header lying about its length, 10^9 positions, short logits, a message far over the
//! limit, silence after accepting, a first token ahead of the KV and then silence or a
//! header disagreeing with it. Only the rogue's requests fail, each at once (or, silent,
//! within the progress deadline), after streaming only the token it announced early; the
//! other streams' outputs are unchanged, the decode server's memory stays bounded and
//! every page and slot comes back.

use crate::support::*;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{KvLayout, KvLayoutSpec};
use pdserve_engine::SeqSnapshot;
use pdserve_kv_transfer::{encode_prefill, first_token_message, Prefilled};
use pdserve_proto::pb;
use pdserve_proto::pb::prefill_message::Kind;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// The decode server's progress deadline here (the smallest it accepts).
const PROGRESS_S: f64 = 2.0;
const MAX_BATCH: usize = 4;

/// What the rogue does, chosen by the request's first prompt token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A header claiming 4090 positions (and the 16 pages that takes) for a short prompt.
    LyingLength = 3,
    /// A header announcing 10^9 positions.
    Billion = 4,
    /// A header with 3 logits instead of one per vocabulary entry.
    ShortLogits = 5,
    /// An honest header, then a 64 MiB page chunk.
    Oversize = 6,
    /// Accepts the call and sends nothing.
    Silent = 7,
    /// Sends the first token ahead of the KV (as asked), then nothing.
    EarlyThenSilent = 8,
    /// Sends first token 1 ahead of the KV, then an honest header saying token 0.
    EarlyMismatch = 9,
    /// Sends the first token ahead of the KV, then fails as a server going down does.
    EarlyThenDown = 10,
}

const MODES: [Mode; 8] = [
    Mode::LyingLength,
    Mode::Billion,
    Mode::ShortLogits,
    Mode::Oversize,
    Mode::Silent,
    Mode::EarlyThenSilent,
    Mode::EarlyMismatch,
    Mode::EarlyThenDown,
];

fn embedded_layout() -> (KvLayout, usize) {
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let layout = KvLayout::new(&cfg, KvLayoutSpec::default_for(&cfg)).unwrap();
    (layout, cfg.vocab_size)
}

struct Rogue {
    layout: KvLayout,
    vocab: usize,
}

impl Rogue {
    /// The header an honest prefill server would send for `len` positions.
    fn honest_header(&self, len: usize) -> pb::PrefillHeader {
        let p = Prefilled {
            snapshot: SeqSnapshot {
                layout_fingerprint: self.layout.fingerprint(),
                len,
                pages: Vec::new(),
                state: Vec::new(),
            },
            last_logits: vec![0.0; self.vocab],
            first_token: 0,
        };
        match encode_prefill(&self.layout, &p, 1 << 20)
            .swap_remove(0)
            .kind
        {
            Some(Kind::Header(mut h)) => {
                h.num_pages = self.layout.pages_for(len) as u32;
                h
            }
            _ => unreachable!("the first message is the header"),
        }
    }

    fn messages(&self, mode: Mode, prompt_len: usize) -> Vec<pb::PrefillMessage> {
        let header = |h: pb::PrefillHeader| pb::PrefillMessage {
            kind: Some(Kind::Header(h)),
        };
        let lie = |len: usize| pb::PrefillHeader {
            len: len as u64,
            num_pages: self.layout.pages_for(len) as u32,
            ..self.honest_header(prompt_len)
        };
        match mode {
            Mode::LyingLength => vec![header(lie(4090))],
            Mode::Billion => vec![header(lie(1_000_000_000))],
            Mode::ShortLogits => {
                let mut h = self.honest_header(prompt_len);
                h.last_logits.truncate(12);
                h.last_logits_crc32 = 0;
                vec![header(h)]
            }
            Mode::Oversize => vec![
                header(self.honest_header(prompt_len)),
                pb::PrefillMessage {
                    kind: Some(Kind::Pages(pb::PageChunk {
                        first_page: 0,
                        num_pages: 1,
                        data: vec![0u8; 64 << 20],
                        crc32: 0,
                    })),
                },
            ],
            Mode::Silent => Vec::new(),
            Mode::EarlyThenSilent | Mode::EarlyThenDown => vec![first_token_message(0)],
            Mode::EarlyMismatch => vec![
                first_token_message(1),
                header(self.honest_header(prompt_len)),
            ],
        }
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Rogue {
    type PrefillStream = ReceiverStream<Result<pb::PrefillMessage, Status>>;

    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let r = req.into_inner();
        assert!(
            r.early_first_token,
            "a plain greedy request asks for its first token ahead of the KV"
        );
        let mode = MODES
            .into_iter()
            .find(|m| *m as u32 == r.prompt[0])
            .unwrap();
        let msgs = self.messages(mode, r.prompt.len());
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            for m in msgs {
                let early = matches!(m.kind, Some(Kind::FirstToken(_)));
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
                if early {
                    // The decode server streams the token before the rest arrives.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            if mode == Mode::EarlyThenDown {
                let _ = tx.send(Err(Status::unavailable("rogue going down"))).await;
                return;
            }
            // Then hold the stream open, saying nothing.
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(tx);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn decode_info(addr: &str) -> pb::WorkerInfo {
    let mut c = pb::worker_client::WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    c.info(pb::Empty {}).await.unwrap().into_inner()
}

/// One Generate call on the decode server naming `prefill`; the status it ends with (or
/// Ok with its token count), the tokens streamed before that, and how long it took.
async fn generate(
    decode: &str,
    prefill: &str,
    prompt: Vec<u32>,
) -> (Result<usize, Status>, usize, Duration) {
    let t0 = Instant::now();
    let mut n = 0;
    let res = async {
        let mut c = pb::decode_client::DecodeClient::connect(format!("http://{decode}"))
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut s = c
            .generate(pb::GenerateRequest {
                prompt,
                sampling: Some(pb::SamplingParams {
                    temperature: 0.0,
                    top_p: 1.0,
                    top_k: 0,
                    seed: 0,
                    ..Default::default()
                }),
                max_new_tokens: 4,
                stop_tokens: Vec::new(),
                prefill_addr: prefill.to_string(),
                ..Default::default()
            })
            .await?
            .into_inner();
        while let Some(ev) = s.message().await? {
            if matches!(ev.kind, Some(pb::token_event::Kind::Token(_))) {
                n += 1;
            }
        }
        Ok(n)
    }
    .await;
    (res, n, t0.elapsed())
}

#[test]
fn a_rogue_prefill_fails_only_its_own_requests() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_p, ap) = role("prefill", &[]);
    let progress = PROGRESS_S.to_string();
    let batch = MAX_BATCH.to_string();
    let (d, ad) = role(
        "decode",
        &[
            "--max-batch",
            &batch,
            "--transfer-progress-timeout-s",
            &progress,
        ],
    );
    let (_r, ar) = role("router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);

    let (layout, vocab) = embedded_layout();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let rogue_addr = listener.local_addr().unwrap().to_string();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(pb::prefill_server::PrefillServer::new(Rogue {
                layout,
                vocab,
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    // The honest traffic's outputs before any rogue call, then while the rogue works.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(100 + i, 24)).collect();
    let baseline: Vec<_> = prompts
        .iter()
        .map(|p| complete(&ar, &greedy(p, 12)).unwrap())
        .collect();
    let rss_before = rss_kib(d.pid());

    let honest = std::thread::spawn({
        let (ar, prompts) = (ar.clone(), prompts.clone());
        move || {
            let mut outs = Vec::new();
            for _round in 0..3 {
                for p in &prompts {
                    outs.push(complete(&ar, &greedy(p, 12)));
                }
            }
            outs
        }
    });
    // Every rogue mode once, and enough silent calls to hold every batch slot.
    let mut calls = Vec::new();
    for m in MODES.into_iter().chain([Mode::Silent; MAX_BATCH]) {
        let (ad, rogue) = (ad.clone(), rogue_addr.clone());
        let mut p = prompt(m as u64, 3);
        p[0] = m as u32;
        calls.push((m, rt.spawn(async move { generate(&ad, &rogue, p).await })));
    }
    let results: Vec<_> = calls
        .into_iter()
        .map(|(m, h)| (m, rt.block_on(h).unwrap()))
        .collect();
    for (m, (res, streamed, took)) in &results {
        let st = res.as_ref().expect_err("a rogue transfer must fail");
        let msg = st.message();
        // Only a token announced ahead of the KV reaches the client before the failure.
        let early = matches!(
            m,
            Mode::EarlyThenSilent | Mode::EarlyMismatch | Mode::EarlyThenDown
        );
        assert_eq!(*streamed, usize::from(early), "{m:?}: {msg}");
        match m {
            Mode::LyingLength => {
                assert_eq!(st.code(), tonic::Code::DataLoss, "{m:?}: {msg}");
                assert!(
                    msg.contains("header announces 4090 positions for a prompt of 3"),
                    "{msg}"
                );
            }
            Mode::Billion => {
                assert_eq!(st.code(), tonic::Code::DataLoss, "{m:?}: {msg}");
                assert!(
                    msg.contains("1000000000 positions for a prompt of 3"),
                    "{msg}"
                );
            }
            Mode::ShortLogits => {
                assert_eq!(st.code(), tonic::Code::DataLoss, "{m:?}: {msg}");
                assert!(msg.contains("last logits of 12 bytes"), "{msg}");
            }
            Mode::Oversize => {
                assert_eq!(st.code(), tonic::Code::DataLoss, "{m:?}: {msg}");
                assert!(msg.contains("too large"), "{msg}");
            }
            Mode::Silent | Mode::EarlyThenSilent => {
                assert_eq!(st.code(), tonic::Code::DeadlineExceeded, "{m:?}: {msg}");
                assert!(msg.contains("progress"), "{msg}");
            }
            Mode::EarlyThenDown => {
                // The router moves such a stream to another pair, avoiding this prefill
                // server (the decode server names it).
                assert_eq!(st.code(), tonic::Code::Unavailable, "{m:?}: {msg}");
                assert!(msg.contains("rogue going down"), "{msg}");
                let failed = st.metadata().get(pdserve_proto::FAILED_WORKER);
                assert_eq!(failed.map(|v| v.as_bytes()), Some(&b"prefill"[..]), "{m:?}");
            }
            Mode::EarlyMismatch => {
                assert_eq!(st.code(), tonic::Code::DataLoss, "{m:?}: {msg}");
                assert!(
                    msg.contains("header's first token 0 differs from the 1 announced"),
                    "{msg}"
                );
            }
        }
        // Refused at once, or (silent) within the progress deadline; queued behind the
        // silent calls' slots at worst.
        let bound = 2.0 * PROGRESS_S + 3.0;
        assert!(took.as_secs_f64() < bound, "{m:?} took {took:?}");
    }

    let outs = honest.join().unwrap();
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(
            out.as_ref().unwrap(),
            &baseline[i % prompts.len()],
            "honest request {i} changed or failed"
        );
    }
    let grown_mib = rss_kib(d.pid()).saturating_sub(rss_before) / 1024;
    assert!(grown_mib < 48, "decode server RSS grew by {grown_mib} MiB");
    // Every slot and page is back: a full batch of honest requests runs at once.
    let info = rt.block_on(decode_info(&ad));
    assert_eq!(info.running, 0);
    assert_eq!(info.free_pages, info.total_pages, "pages leaked");
    let full: Vec<_> = (0..MAX_BATCH)
        .map(|i| {
            let (ad, ap) = (ad.clone(), ap.clone());
            rt.spawn(async move { generate(&ad, &ap, prompt(200 + i as u64, 8)).await })
        })
        .collect();
    for h in full {
        let (res, _, took) = rt.block_on(h).unwrap();
        assert_eq!(res.unwrap(), 4);
        assert!(took < Duration::from_secs(20), "{took:?}");
    }
}
