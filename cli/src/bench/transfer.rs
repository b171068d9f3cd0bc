//! `pdserve bench transfer`: GB/s of KV page sets from 1 MB up through the gRPC transfer
//! path (`pdserve_kv_transfer`: the prefill server's encoding into CRC-checked chunks, one
//! HTTP/2 stream over TCP, the decode side's `pull_prefill` verifying and reassembling
//! every chunk), between a sender and a receiver in this process over loopback. The
//! sender serves pages that already exist, so the figure is the transfer's alone, with
//! no prefill compute in it.

use super::config::ModelFlags;
use super::stats::median;
use super::table::{num, Table};
use anyhow::{bail, Context, Result};
use pdserve_engine::kv::KvLayout;
use pdserve_engine::SeqSnapshot;
use pdserve_kv_transfer::{
    prefill_messages, pull_prefill, Expected, Prefilled, PullOptions, PullRequest,
};
use pdserve_proto::pb;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

#[derive(clap::Args, Debug)]
pub struct TransferArgs {
    /// The model whose KV layout (page and state sizes) the pages have.
    #[command(flatten)]
    pub model: ModelFlags,
    /// Page-set sizes, comma-separated, with a K, M or G suffix (powers of 2); each is
    /// rounded up to whole pages.
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M,256M,1G")]
    pub sizes: Vec<String>,
    /// Largest page chunk on the wire (the prefill server's default).
    #[arg(long, default_value_t = 1 << 20)]
    pub chunk_bytes: usize,
    /// Timed transfers per size (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Untimed transfers per size first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Raw NCCL send/recv of the same byte counts between two GPUs of this machine, the
    /// physical reference for the transfer paths: `auto` (cuda:0 -> cuda:1 where two GPUs
    /// and NCCL exist, else a line saying why not), `off`, or `A,B` (required).
    #[arg(long, default_value = "auto")]
    pub raw_nccl: String,
    /// Also write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TransferRow {
    pub transport: &'static str,
    pub bytes: usize,
    pub pages: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
}

/// `1M` -> 1 << 20 (K, M, G: powers of 2; no suffix: bytes).
fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (digits, shift) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 10),
        Some((i, 'M' | 'm')) => (&s[..i], 20),
        Some((i, 'G' | 'g')) => (&s[..i], 30),
        _ => (s, 0),
    };
    let n: usize = digits
        .parse()
        .with_context(|| format!("--sizes: `{s}` is not a size like 64M"))?;
    if n == 0 {
        bail!("--sizes: `{s}` is empty");
    }
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .with_context(|| format!("--sizes: `{s}` is too large"))
}

/// A sequence of `pages` pages of `layout` with deterministic, non-constant contents.
fn page_set(layout: &KvLayout, pages: usize, vocab: usize) -> Prefilled {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    };
    Prefilled {
        snapshot: SeqSnapshot {
            layout_fingerprint: layout.fingerprint(),
            len: pages * layout.page_tokens,
            pages: (0..pages).map(|_| bytes(layout.page_bytes)).collect(),
            state: bytes(layout.state_bytes),
        },
        last_logits: vec![0.5; vocab],
        first_token: 1,
    }
}

/// The sender: answers every prefill request with the page set of its prompt's length.
struct Sender {
    layout: KvLayout,
    sets: Arc<Vec<Prefilled>>,
    chunk_bytes: usize,
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Sender {
    type PrefillStream = ReceiverStream<Result<pb::PrefillMessage, Status>>;

    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let len = req.into_inner().prompt.len();
        let i = self
            .sets
            .iter()
            .position(|p| p.snapshot.len == len)
            .ok_or_else(|| Status::invalid_argument(format!("no page set of {len} positions")))?;
        let (sets, layout, chunk_bytes) =
            (self.sets.clone(), self.layout.clone(), self.chunk_bytes);
        // As the prefill server sends: each message built as the connection takes the last.
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            for m in prefill_messages(&layout, &sets[i], chunk_bytes) {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

pub fn run(a: &TransferArgs) -> Result<Vec<TransferRow>> {
    if a.repeats == 0 || a.sizes.is_empty() {
        bail!("--sizes needs at least one size and --repeats at least 1");
    }
    super::check_output(a.json.as_deref(), "--json")?;
    let cfg = a.model.config()?;
    let layout = a.model.layout(&cfg)?;
    let sizes: Vec<usize> = a
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    let pages: Vec<usize> = sizes
        .iter()
        .map(|&b| b.div_ceil(layout.page_bytes).max(1))
        .collect();
    println!(
        "layout: {} B pages of {} positions, {} B state slot; chunks of {} B",
        layout.page_bytes, layout.page_tokens, layout.state_bytes, a.chunk_bytes
    );
    let sets: Arc<Vec<Prefilled>> = Arc::new(
        pages
            .iter()
            .map(|&n| page_set(&layout, n, cfg.vocab_size))
            .collect(),
    );
    let raw = raw_nccl_devices(&a.raw_nccl)?;
    let rt = tokio::runtime::Runtime::new().context("tokio runtime")?;
    let mut rows = rt.block_on(transfer_rows(a, &layout, cfg.vocab_size, sets.clone()))?;
    if let Some(devices) = raw {
        rows.extend(raw_nccl_rows(a, devices, &sets)?);
    }
    println!("{}", table(&rows));
    if let Some(path) = &a.json {
        super::write_json(path, &serde_json::to_value(&rows)?)?;
    }
    Ok(rows)
}

async fn transfer_rows(
    a: &TransferArgs,
    layout: &KvLayout,
    vocab: usize,
    sets: Arc<Vec<Prefilled>>,
) -> Result<Vec<TransferRow>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the sender on loopback")?;
    let addr = listener.local_addr()?.to_string();
    let sender = Sender {
        layout: layout.clone(),
        sets: sets.clone(),
        chunk_bytes: a.chunk_bytes,
    };
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                pb::prefill_server::PrefillServer::new(sender)
                    .max_encoding_message_size(usize::MAX)
                    .max_decoding_message_size(usize::MAX),
            )
            .serve_with_incoming(pdserve_worker::no_delay(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
            )),
    );
    let mut rows = Vec::new();
    for set in sets.iter() {
        let positions = set.snapshot.len;
        let expected = Expected {
            positions,
            reserved_pages: set.snapshot.pages.len(),
            vocab_size: vocab,
        };
        let mut times = Vec::new();
        for i in 0..a.warmup + a.repeats {
            let t = Instant::now();
            let got = pull_prefill(
                &addr,
                layout,
                expected,
                PullRequest {
                    prompt: vec![0; positions],
                    sampling: pb::SamplingParams::default(),
                    request_id: "bench-transfer".into(),
                    first_token: None,
                },
                PullOptions::default(),
            )
            .await
            .with_context(|| format!("transferring {} pages", set.snapshot.pages.len()))?;
            let dt = t.elapsed().as_secs_f64();
            if got.snapshot.pages != set.snapshot.pages || got.snapshot.state != set.snapshot.state
            {
                bail!("the received pages differ from the sent ones");
            }
            if i >= a.warmup {
                times.push(dt);
            }
        }
        let seconds = median(times);
        let bytes = set.payload_bytes();
        rows.push(TransferRow {
            transport: "grpc",
            bytes,
            pages: set.snapshot.pages.len(),
            seconds,
            gb_per_s: bytes as f64 / seconds / 1e9,
        });
    }
    server.abort();
    Ok(rows)
}

/// `--raw-nccl`: the two devices to time, if any.
fn raw_nccl_devices(v: &str) -> Result<Option<[usize; 2]>> {
    use pdserve_kernels::nccl_p2p::unavailable;
    let devices = match v.trim() {
        "off" => return Ok(None),
        "auto" => {
            return Ok(match unavailable([0, 1]) {
                None => Some([0, 1]),
                Some(why) => {
                    println!("raw NCCL send/recv: not timed ({why})");
                    None
                }
            })
        }
        pair => {
            let d: Vec<usize> = pair
                .split(',')
                .map(|x| x.trim().trim_start_matches("cuda:").parse())
                .collect::<Result<_, _>>()
                .ok()
                .filter(|d: &Vec<usize>| d.len() == 2)
                .with_context(|| format!("--raw-nccl `{pair}`: expected auto, off or A,B"))?;
            [d[0], d[1]]
        }
    };
    if let Some(why) = unavailable(devices) {
        bail!("--raw-nccl {}: {why}", v.trim());
    }
    Ok(Some(devices))
}

/// Raw NCCL sends of each page set's byte count from one GPU to the other.
fn raw_nccl_rows(
    a: &TransferArgs,
    devices: [usize; 2],
    sets: &[Prefilled],
) -> Result<Vec<TransferRow>> {
    let pair = pdserve_kernels::nccl_p2p::NcclPair::open(devices)?;
    let mut rows = Vec::new();
    for set in sets {
        let bytes = set.payload_bytes();
        let times = pair.time_sends(bytes, a.warmup, a.repeats)?;
        let seconds = median(times);
        rows.push(TransferRow {
            transport: "nccl raw",
            bytes,
            pages: set.snapshot.pages.len(),
            seconds,
            gb_per_s: bytes as f64 / seconds / 1e9,
        });
    }
    Ok(rows)
}

fn table(rows: &[TransferRow]) -> Table {
    Table {
        headers: vec!["transport", "MB", "pages", "seconds", "GB/s"],
        rows: rows
            .iter()
            .map(|r| {
                vec![
                    r.transport.to_string(),
                    num(r.bytes as f64 / 1e6),
                    r.pages.to_string(),
                    num(r.seconds),
                    num(r.gb_per_s),
                ]
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        for bad in ["", "M", "0M", "x", "1T", "99999999999999G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn raw_nccl_flag() {
        assert_eq!(raw_nccl_devices("off").unwrap(), None);
        // auto never fails: where NCCL cannot run, it says why and times nothing.
        let auto = raw_nccl_devices("auto").unwrap();
        assert!(auto.is_none() || auto == Some([0, 1]));
        for bad in ["0,1,2", "x", "0"] {
            let e = raw_nccl_devices(bad).unwrap_err().to_string();
            assert!(e.contains("expected auto, off or A,B"), "{bad}: {e}");
        }
        // One device for both ranks is refused (or, without CUDA, the missing driver is).
        let e = raw_nccl_devices("cuda:3,cuda:3").unwrap_err().to_string();
        assert!(
            e.starts_with("--raw-nccl cuda:3,cuda:3: ")
                && (e.contains("NCCL needs two devices")
                    || e.contains("library path")
                    || e.contains("no CUDA")),
            "{e}"
        );
    }
}
