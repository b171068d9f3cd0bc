//! Shared helpers of the cluster tests: real `pdserve` processes on loopback, a minimal
//! HTTP/1.1 client (with SSE), and single-process reference generations.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

pub mod api;
pub mod prom;

use pdserve_engine::generate::{generate, GenerateRequest};
use pdserve_engine::sampling::SamplingParams;
use pdserve_engine::{CpuBackend, Engine, PoolSize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    c.env(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache"),
    );
    c.env("RUST_LOG", "warn");
    for (k, _) in std::env::vars() {
        if k.starts_with("PDSERVE_") && k != "PDSERVE_CACHE_DIR" {
            c.env_remove(k);
        }
    }
    c
}

/// A child process whose stdout lines arrive on a channel; killed on drop.
pub struct Proc {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
}

impl Proc {
    pub fn start(mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines: rx }
    }

    /// The first stdout line containing `pat`, within `secs`.
    pub fn wait_line(&self, pat: &str, secs: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(pat) => return l,
                Ok(_) => {}
                Err(e) => panic!("no line with `{pat}` within {secs} s: {e}"),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn kill9(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}

/// `pdserve <role> --listen 127.0.0.1:0 <args>`; returns the process and its address.
pub fn role(role: &str, args: &[&str]) -> (Proc, String) {
    let mut c = bin();
    c.arg(role).args(["--listen", "127.0.0.1:0"]).args(args);
    let p = Proc::start(c);
    let l = p.wait_line("listening on", 60);
    let addr = l.rsplit(' ').next().unwrap().to_string();
    (p, addr)
}

/// `role` with `--metrics-listen 127.0.0.1:0` too; returns the process, its gRPC address
/// and its side port's address.
pub fn worker_with_metrics(role_name: &str, args: &[&str]) -> (Proc, String, String) {
    let mut all = vec!["--metrics-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let (p, addr) = role(role_name, &all);
    let l = p.wait_line("metrics on http://", 10);
    let side = l.rsplit("http://").next().unwrap().to_string();
    (p, addr, side)
}

/// Poll `GET path` on `addr` until it answers `want`, within `secs`.
pub fn wait_status(addr: &str, path: &str, want: u16, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if TcpStream::connect(addr).is_ok()
            && http(addr, "GET", path, None, Duration::from_secs(5)).0 == want
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{addr}{path} did not answer {want} within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `pdserve up` with a free router port; kills every child it started on drop.
pub struct Up {
    pub proc: Proc,
    pub addr: String,
    pub pids: Vec<(String, u32)>,
    /// What `up` printed up to "ready".
    pub startup: Vec<String>,
}

impl Up {
    pub fn start(args: &[&str]) -> Up {
        let mut c = bin();
        c.args(["up", "--port", "0"]).args(args);
        let proc = Proc::start(c);
        let (mut pids, mut startup) = (Vec::new(), Vec::new());
        let deadline = Instant::now() + Duration::from_secs(120);
        let addr = loop {
            let l = proc
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("pdserve up did not become ready");
            startup.push(l.clone());
            if let Some(rest) = l.strip_prefix("pdserve up: ready at http://") {
                break rest.trim().to_string();
            }
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.len() >= 5 && w[0] == "pdserve" && w[3] == "pid" {
                pids.push((w[2].to_string(), w[4].parse().unwrap()));
            }
        };
        Up {
            proc,
            addr,
            pids,
            startup,
        }
    }

    pub fn pid_of(&self, name: &str) -> u32 {
        self.pids.iter().find(|(n, _)| n == name).unwrap().1
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.proc.pid().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(6);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.proc.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for (_, pid) in &self.pids {
            kill9(*pid);
        }
    }
}

fn connect(addr: &str, timeout: Duration) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    s
}

fn request(
    s: &mut TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
    out
}

/// One request; returns (status, body).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> (u16, String) {
    let mut s = connect(addr, timeout);
    request(&mut s, addr, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = &raw[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_vec()
    };
    (status, String::from_utf8(body).unwrap())
}

/// A streaming completion: (status, SSE reader).
pub fn stream(addr: &str, body: &serde_json::Value, timeout: Duration) -> (u16, Sse) {
    let mut s = connect(addr, timeout);
    request(&mut s, addr, "POST", "/v1/completions", Some(body));
    let mut r = BufReader::new(s);
    let mut status = 0;
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        if status == 0 {
            status = l.split_whitespace().nth(1).unwrap().parse().unwrap();
        }
        if l.trim().is_empty() {
            break;
        }
    }
    (status, Sse { r })
}

pub struct Sse {
    r: BufReader<TcpStream>,
}

impl Sse {
    /// Next (event name, data); None at end of stream. Read errors (timeouts) panic.
    pub fn next(&mut self) -> Option<(String, String)> {
        self.try_next().expect("reading the event stream")
    }

    /// As [`Sse::next`], read errors (a reset connection, a timeout) returned.
    pub fn try_next(&mut self) -> std::io::Result<Option<(String, String)>> {
        let mut event = "message".to_string();
        loop {
            let mut l = String::new();
            if self.r.read_line(&mut l)? == 0 {
                return Ok(None);
            }
            let l = l.trim_end_matches(['\r', '\n']);
            if let Some(e) = l.strip_prefix("event:") {
                event = e.trim().to_string();
            } else if let Some(d) = l.strip_prefix("data:") {
                return Ok(Some((event, d.trim_start().to_string())));
            }
        }
    }

    /// Token ids of a whole stream and its finish reason; Err(data) on an error event.
    pub fn collect(mut self) -> Result<(Vec<u32>, String), String> {
        let mut ids = Vec::new();
        let mut finish = String::new();
        while let Some((ev, data)) = self.next() {
            if ev == "error" {
                return Err(data);
            }
            if data == "[DONE]" {
                return Ok((ids, finish));
            }
            let v: serde_json::Value = serde_json::from_str(&data).unwrap();
            let c = &v["choices"][0];
            ids.extend(
                c["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32),
            );
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
        Err("stream ended without [DONE]".into())
    }
}

/// Non-streaming completion: token ids and finish reason, or (status, body) on failure.
pub fn complete(addr: &str, body: &serde_json::Value) -> Result<(Vec<u32>, String), (u16, String)> {
    let (st, b) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(body),
        Duration::from_secs(60),
    );
    if st != 200 {
        return Err((st, b));
    }
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    let c = &v["choices"][0];
    Ok((
        c["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect(),
        c["finish_reason"].as_str().unwrap().to_string(),
    ))
}

pub fn greedy(prompt: &[u32], max_tokens: usize) -> serde_json::Value {
    serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true })
}

/// The embedded model in this process (what `pdserve generate` runs).
pub fn engine() -> Engine<CpuBackend> {
    std::env::set_var(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache"),
    );
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    Engine::load(&dir, CpuBackend, None, PoolSize::default()).unwrap()
}

pub fn reference(
    e: &mut Engine<CpuBackend>,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
) -> Vec<u32> {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling,
        stop_tokens: Vec::new(),
        chunk_size: 512,
    };
    generate(e, &req, |_| {}).unwrap().tokens
}

/// A deterministic prompt of `n` token ids from `seed` (ids 3..500 of the 512 vocab).
pub fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((x >> 33) % 497) as u32
        })
        .collect()
}

pub fn wait_healthy(addr: &str, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(mut s) = TcpStream::connect(addr) {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            request(&mut s, addr, "GET", "/health", None);
            let mut raw = String::new();
            let _ = s.read_to_string(&mut raw);
            if raw.starts_with("HTTP/1.1 200") && raw.contains("\"status\":\"ok\"") {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "router at {addr} not healthy within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A raw HTTP/1.1 exchange: any method, content type, headers and body bytes.
/// Returns (status, lower-cased head, body).
pub fn raw(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> (u16, String, String) {
    let mut s = connect(addr, timeout);
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before reading a large body; a failed write is fine.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP response: {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = &raw[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_vec()
    };
    (status, head, String::from_utf8(body).unwrap())
}
