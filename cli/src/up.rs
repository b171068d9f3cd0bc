//! `pdserve up`: router + prefill + decode servers as child processes of this binary on
//! loopback, health-checked, stopped together on Ctrl-C or when any of them dies.

use crate::serve::{shutdown_signal, LISTENING};
use crate::up_devices::DeviceFlags;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Prefill servers to start.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode servers to start.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Router port on 127.0.0.1 (0: a free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model folder for every process. Default: the embedded model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Name(s) the model is served under, for every process (see `pdserve router
    /// --help`). Default: the model folder's name.
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// TOML config file passed to every prefill and decode server.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Extra flags for every prefill server (one string, split on spaces).
    #[arg(long, allow_hyphen_values = true)]
    prefill_args: Option<String>,
    /// Extra flags for every decode server (one string, split on spaces).
    #[arg(long, allow_hyphen_values = true)]
    decode_args: Option<String>,
    /// Extra flags for the router (one string, split on spaces).
    #[arg(long, allow_hyphen_values = true)]
    router_args: Option<String>,
    /// Deadline for every process to come up and report healthy, in seconds.
    #[arg(long, default_value_t = 120.0)]
    ready_timeout_s: f64,
    /// Device of every prefill and decode server: cpu, cuda:N, cuda (this machine's GPUs
    /// handed out in order, prefill servers first, then decode, wrapping around: one
    /// prefill and one decode server on two GPUs run on cuda:0 and cuda:1) or auto (cuda
    /// where a GPU exists, else cpu). Default: each server's own (`--device` in --config or
    /// the role's args; cpu).
    #[arg(long)]
    device: Option<String>,
    /// Devices of the prefill servers, over --device: one for all, or one per server
    /// (comma-separated).
    #[arg(long, value_delimiter = ',')]
    prefill_device: Vec<String>,
    /// Devices of the decode servers, over --device: one for all, or one per server
    /// (comma-separated).
    #[arg(long, value_delimiter = ',')]
    decode_device: Vec<String>,
    /// Plain gRPC between the processes (the cluster token still authenticates them).
    /// Default: mutual TLS with a throwaway CA and per-role certificates made for this
    /// run (in a private temporary folder, deleted on exit).
    #[arg(long)]
    no_tls: bool,
}

struct Proc {
    name: String,
    /// The `--device` it was given (`None`: its own flags or config decide).
    device: Option<String>,
    child: Child,
    pid: u32,
    addr: String,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.pid
    }
}

async fn spawn(name: String, mut cmd: Command, deadline: Instant) -> Result<Proc> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let pid = child.id().unwrap_or(0);
    let stdout = child
        .stdout
        .take()
        .context("child stdout was not captured")?;
    let mut lines = BufReader::new(stdout).lines();
    let wait = deadline.saturating_duration_since(Instant::now());
    let line = tokio::time::timeout(wait, lines.next_line())
        .await
        .map_err(|_| anyhow::anyhow!("{name} did not start listening in time"))?
        .with_context(|| format!("reading {name}'s output"))?;
    let addr = line
        .as_deref()
        .and_then(|l| l.split(LISTENING).nth(1))
        .map(|a| a.trim().to_string())
        .with_context(|| format!("{name} exited before listening (see its log above)"))?;
    // Keep draining its stdout so it never blocks on a full pipe.
    let tag = name.clone();
    tokio::spawn(async move {
        while let Ok(Some(l)) = lines.next_line().await {
            eprintln!("[{tag}] {l}");
        }
    });
    Ok(Proc {
        device: None,
        name,
        child,
        pid,
        addr,
    })
}

/// GET /health on the router: Ok(true) once every worker is healthy.
async fn router_healthy(addr: &str) -> bool {
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(
            format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await?;
        Ok::<_, std::io::Error>(
            buf.starts_with("HTTP/1.1 200") && buf.contains("\"status\":\"ok\""),
        )
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), probe).await,
        Ok(Ok(true))
    )
}

/// The prompt of the first request `up` sends, to show the cluster answering.
const SMOKE_PROMPT: &str = "The quick brown fox";

/// One non-streamed completion through the router: the text of its first choice.
async fn first_answer(addr: &str) -> Result<String> {
    let body = serde_json::json!({ "prompt": SMOKE_PROMPT, "max_tokens": 16, "temperature": 0 })
        .to_string();
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let raw = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .context("the first completion took longer than 60 s")??;
    let (head, json) = raw
        .split_once("\r\n\r\n")
        .context("malformed HTTP response from the router")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "the first completion failed: {} {json}",
            head.lines().next().unwrap_or_default()
        );
    }
    let v: serde_json::Value =
        serde_json::from_str(json).context("router answered with invalid JSON")?;
    v["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .context("router answer has no choices[0].text")
}

/// The first child that has exited, with its status.
fn exited(procs: &mut [Proc]) -> Option<String> {
    for p in procs.iter_mut() {
        if let Ok(Some(st)) = p.child.try_wait() {
            return Some(format!("{} (pid {}) exited: {st}", p.name, p.pid()));
        }
    }
    None
}

async fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter() {
        if let Some(pid) = p.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    for p in procs.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, p.child.wait()).await.is_err() {
            let _ = p.child.start_kill();
            let _ = p.child.wait().await;
        }
    }
}

pub fn up(a: UpArgs, log_json: bool) -> Result<()> {
    if a.prefill == 0 || a.decode == 0 {
        bail!("pdserve up needs at least one prefill and one decode server");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(run(a, log_json))
}

async fn run(a: UpArgs, log_json: bool) -> Result<()> {
    let exe = std::env::current_exe().context("locating the pdserve binary")?;
    let deadline = Instant::now() + Duration::from_secs_f64(a.ready_timeout_s);
    // Every gRPC hop of the local cluster is authenticated: a fresh cluster token (or the
    // operator's PDSERVE_CLUSTER_TOKEN) reaches the children through their environment,
    // which other users cannot read, never through their command lines.
    let token = match std::env::var("PDSERVE_CLUSTER_TOKEN") {
        Ok(t) if !t.trim().is_empty() => t,
        _ => pdserve_proto::cluster::ClusterToken::random()
            .secret()
            .to_string(),
    };
    // Mutual TLS: a CA that lives for this run only (its key never touches the disk).
    let certs = if a.no_tls {
        None
    } else {
        let dir = tempfile::Builder::new()
            .prefix("pdserve-up-")
            .tempdir()
            .context("creating the run folder for the certificates")?;
        crate::certs::generate(dir.path(), &["127.0.0.1".into(), "localhost".into()])?;
        Some(dir)
    };
    let base = |role: &str| {
        let mut c = Command::new(&exe);
        c.arg(role).env("PDSERVE_CLUSTER_TOKEN", &token);
        match &certs {
            Some(dir) => {
                let f = crate::certs::files(dir.path(), role);
                c.env("PDSERVE_TLS_CERT", f.cert)
                    .env("PDSERVE_TLS_KEY", f.key)
                    .env("PDSERVE_TLS_CA", f.ca);
            }
            None => {
                for v in ["PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"] {
                    c.env_remove(v);
                }
            }
        }
        if log_json {
            c.args(["--log-format", "json"]);
        }
        if let Some(m) = &a.model {
            c.arg("--model").arg(m);
        }
        if !a.served_model_name.is_empty() {
            c.arg("--served-model-name").args(&a.served_model_name);
        }
        c
    };
    let devices = DeviceFlags {
        device: a.device.as_deref(),
        prefill_device: &a.prefill_device,
        decode_device: &a.decode_device,
        prefill: a.prefill,
        decode: a.decode,
    };
    let gpus = match devices.given() {
        true => pdserve_kernels::device::count().context("counting CUDA devices")?,
        false => 0,
    };
    let placement = devices.place(gpus)?;
    let mut procs: Vec<Proc> = Vec::new();
    let result = async {
        for (role, on, extra) in [
            ("prefill", &placement.prefill, &a.prefill_args),
            ("decode", &placement.decode, &a.decode_args),
        ] {
            for (i, device) in on.iter().enumerate() {
                let mut c = base(role);
                c.args(["--listen", "127.0.0.1:0"]);
                if let Some(cfg) = &a.config {
                    c.arg("--config").arg(cfg);
                }
                if let Some(d) = device {
                    c.args(["--device", d]);
                }
                if let Some(x) = extra {
                    c.args(x.split_whitespace());
                }
                let mut p = spawn(format!("{role}[{i}]"), c, deadline).await?;
                p.device = device.clone();
                procs.push(p);
            }
        }
        let addrs = |role: &str| {
            procs
                .iter()
                .filter(|p| p.name.starts_with(role))
                .map(|p| p.addr.clone())
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut c = base("router");
        c.args(["--listen", &format!("127.0.0.1:{}", a.port)])
            .args(["--prefill", &addrs("prefill"), "--decode", &addrs("decode")]);
        if let Some(x) = &a.router_args {
            c.args(x.split_whitespace());
        }
        let router = spawn("router".into(), c, deadline).await?;
        let url = format!("http://{}", router.addr);
        let raddr = router.addr.clone();
        procs.push(router);
        for p in &procs {
            match &p.device {
                Some(d) => println!(
                    "pdserve up: {} pid {} on {} ({d})",
                    p.name,
                    p.pid(),
                    p.addr
                ),
                None => println!("pdserve up: {} pid {} on {}", p.name, p.pid(), p.addr),
            }
        }
        loop {
            if let Some(why) = exited(&mut procs) {
                bail!("{why} before the cluster was ready");
            }
            if router_healthy(&raddr).await {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "the cluster was not healthy within {:.0} s (see {url}/health)",
                    a.ready_timeout_s
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        match &certs {
            Some(dir) => println!(
                "pdserve up: gRPC hops on mutual TLS (throwaway CA and certificates in {}) and a fresh cluster token",
                dir.path().display()
            ),
            None => println!(
                "pdserve up: gRPC hops authenticated with a fresh cluster token (--no-tls: not encrypted)"
            ),
        }
        println!("pdserve up: ready at {url}");
        match first_answer(&raddr).await {
            Ok(answer) => {
                println!("pdserve up: the cluster answers: {SMOKE_PROMPT:?} -> {answer:?}")
            }
            // Keep serving: the operator can see why at /workers and /health (e.g. workers
            // whose layouts differ are never paired).
            Err(e) => eprintln!(
                "pdserve up: WARNING: {e:#}; the cluster keeps running (see {url}/workers)"
            ),
        }
        println!(
            "  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \"The quick brown fox\", \"max_tokens\": 16}}'"
        );
        println!("pdserve up: Ctrl-C stops every process");
        let mut shutdown = std::pin::pin!(shutdown_signal());
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if let Some(why) = exited(&mut procs) {
                        bail!("{why}; stopping the others");
                    }
                }
            }
        }
    }
    .await;
    if let Err(e) = &result {
        eprintln!("pdserve up: {e:#}");
    }
    stop_all(&mut procs).await;
    result
}
