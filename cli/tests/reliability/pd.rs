//! A loopback cluster of several prefill and decode servers behind one router, whose
//! workers the fault tests kill, stop, continue and restart on the same address; streams
//! read to the end with deadlines; page accounting through each worker's `Worker.Info`.

use crate::support::*;
use pdserve_proto::pb;
use serde_json::Value;
use std::io::ErrorKind;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Every worker runs with this: migration is exact only in deterministic mode.
pub const WORKER_ARGS: &[&str] = &["--deterministic"];

pub struct Node {
    pub proc: Option<Proc>,
    pub addr: String,
    role: &'static str,
    args: Vec<String>,
}

impl Node {
    fn start(role: &'static str, listen: &str, args: &[&str]) -> Node {
        let mut c = bin();
        c.arg(role).args(["--listen", listen]).args(args);
        let p = Proc::start(c);
        let l = p.wait_line("listening on", 60);
        let addr = l.rsplit(' ').next().unwrap().to_string();
        Node {
            proc: Some(p),
            addr,
            role,
            args: args.iter().map(|a| a.to_string()).collect(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("the worker is running").pid()
    }

    pub fn kill(&mut self) {
        kill9(self.pid());
        // Dropping the Proc reaps the child.
        self.proc = None;
    }

    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "kill {sig}");
    }

    /// Start the same role again on the same address.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "restart of a running worker");
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let n = Node::start(self.role, &self.addr.clone(), &args);
        assert_eq!(n.addr, self.addr);
        *self = n;
    }
}

pub struct Pd {
    pub prefill: Vec<Node>,
    pub decode: Vec<Node>,
    pub router: Option<Proc>,
    pub addr: String,
    router_args: Vec<String>,
    rt: tokio::runtime::Runtime,
}

impl Pd {
    pub fn start(prefills: usize, decodes: usize, router_args: &[&str]) -> Pd {
        Pd::start_with(prefills, decodes, &[], router_args)
    }

    /// As [`Pd::start`], the decode servers with `decode_args` too.
    pub fn start_with(
        prefills: usize,
        decodes: usize,
        decode_args: &[&str],
        router_args: &[&str],
    ) -> Pd {
        let prefill: Vec<Node> = (0..prefills)
            .map(|_| Node::start("prefill", "127.0.0.1:0", WORKER_ARGS))
            .collect();
        let dargs: Vec<&str> = WORKER_ARGS.iter().chain(decode_args).copied().collect();
        let decode: Vec<Node> = (0..decodes)
            .map(|_| Node::start("decode", "127.0.0.1:0", &dargs))
            .collect();
        let join = |ns: &[Node]| {
            ns.iter()
                .map(|n| n.addr.clone())
                .collect::<Vec<_>>()
                .join(",")
        };
        let (pa, da) = (join(&prefill), join(&decode));
        let mut args = vec!["--prefill".to_string(), pa, "--decode".to_string(), da];
        args.extend(router_args.iter().map(|a| a.to_string()));
        let mut pd = Pd {
            prefill,
            decode,
            router: None,
            addr: "127.0.0.1:0".into(),
            router_args: args,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        };
        pd.restart_router();
        pd
    }

    /// SIGKILL the router.
    pub fn kill_router(&mut self) {
        let p = self.router.take().expect("the router is running");
        kill9(p.pid());
        // Dropping the Proc reaps the child.
        drop(p);
    }

    /// Start the router (again) on its address, and wait until every worker is healthy.
    pub fn restart_router(&mut self) {
        assert!(self.router.is_none(), "restart of a running router");
        let mut c = bin();
        c.args(["router", "--listen", &self.addr])
            .args(&self.router_args);
        let p = Proc::start(c);
        let l = p.wait_line("listening on", 60);
        self.addr = l.rsplit(' ').next().unwrap().to_string();
        self.router = Some(p);
        wait_healthy(&self.addr, 60);
    }

    /// A worker's `Worker.Info`; None when it does not answer within a second.
    pub fn info(&self, addr: &str) -> Option<pb::WorkerInfo> {
        self.rt.block_on(async {
            let call = async {
                let mut c = pb::worker_client::WorkerClient::connect(format!("http://{addr}"))
                    .await
                    .ok()?;
                c.info(pb::Empty {}).await.ok().map(|r| r.into_inner())
            };
            tokio::time::timeout(Duration::from_secs(1), call)
                .await
                .ok()
                .flatten()
        })
    }

    /// The decode server with the most streams of the router at `router` in flight
    /// (the router's own count: fresher than a worker poll).
    pub fn busiest_decode_of(&self, router: &str) -> usize {
        let (st, body) = http(router, "GET", "/workers", None, Duration::from_secs(5));
        assert_eq!(st, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let inflight = |addr: &str| {
            v["workers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w["address"] == addr && w["role"] == "decode")
                .and_then(|w| w["inflight"].as_u64())
                .unwrap_or(0)
        };
        let best = (0..self.decode.len())
            .filter(|&i| self.decode[i].proc.is_some())
            .max_by_key(|&i| inflight(&self.decode[i].addr))
            .unwrap();
        assert!(
            inflight(&self.decode[best].addr) > 0,
            "no stream in flight: {body}"
        );
        best
    }

    pub fn busiest_decode(&self) -> usize {
        self.busiest_decode_of(&self.addr)
    }

    /// Wait until every running worker is idle with all its pages back (a prefill
    /// server's prefix cache may keep pages: cached pages count as given back).
    pub fn wait_idle(&self, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        for n in self.prefill.iter().chain(&self.decode) {
            if n.proc.is_none() {
                continue;
            }
            loop {
                let i = self.info(&n.addr);
                if let Some(i) = &i {
                    if i.running == 0
                        && i.waiting == 0
                        && i.free_pages + i.cached_pages == i.total_pages
                    {
                        break;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "{} {} not idle with every page free within {secs} s: {i:?}",
                    n.role,
                    n.addr
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Wait until the router has every worker in rotation again.
    pub fn wait_all_healthy(&self, secs: u64) {
        wait_healthy(&self.addr, secs);
    }

    /// `pdserve_router_migrations_total{outcome}` and `pdserve_router_retries_total`.
    pub fn counters(&self) -> (f64, f64, f64) {
        let (st, text) = http(&self.addr, "GET", "/metrics", None, Duration::from_secs(5));
        assert_eq!(st, 200);
        let get = |name: &str, label: &str| {
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .find(|l| l.split([' ', '{']).next() == Some(name) && l.contains(label))
                .and_then(|l| l.rsplit(' ').next())
                .map_or(0.0, |v| v.parse().unwrap())
        };
        (
            get("pdserve_router_migrations_total", "outcome=\"ok\""),
            get("pdserve_router_migrations_total", "outcome=\"failed\""),
            get("pdserve_router_retries_total", ""),
        )
    }
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Token ids, finish reason, and `usage.completion_tokens`.
    Done(Vec<u32>, String, u64),
    /// An error event (its data) or a cut stream.
    Failed(String),
}

/// A streamed completion of `body` (with usage), read to its end; every read has a 30 s
/// deadline, so a hung stream fails the test. `first` (taken) gets one message when the
/// first token arrives.
pub fn stream_to_end(addr: &str, body: &Value, first: &mut Option<mpsc::Sender<()>>) -> Outcome {
    let mut b = body.clone();
    b["stream"] = true.into();
    b["stream_options"] = serde_json::json!({ "include_usage": true });
    let (st, mut sse) = stream(addr, &b, Duration::from_secs(30));
    if st != 200 {
        return Outcome::Failed(format!("status {st}"));
    }
    let (mut ids, mut finish) = (Vec::new(), String::new());
    loop {
        let (ev, data) = match sse.try_next() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("no event for 30 s: the stream hangs")
            }
            Err(e) => return Outcome::Failed(format!("the stream was cut: {e}")),
        };
        if ev == "error" {
            return Outcome::Failed(data);
        }
        if data == "[DONE]" {
            return Outcome::Failed("[DONE] before usage".into());
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
            let done = sse.next().map(|x| x.1);
            assert_eq!(done.as_deref(), Some("[DONE]"));
            return Outcome::Done(ids, finish, u);
        }
        let c = &v["choices"][0];
        ids.extend(
            c["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32),
        );
        if !ids.is_empty() {
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    Outcome::Failed("the stream ended without [DONE]".into())
}

/// `bodies` streamed at once, each on its own thread; returns once every stream has its
/// first token (or ended), with the handles to join.
pub fn in_flight(addr: &str, bodies: Vec<Value>) -> Vec<std::thread::JoinHandle<Outcome>> {
    let (tx, rx) = mpsc::channel();
    let n = bodies.len();
    let handles: Vec<_> = bodies
        .into_iter()
        .map(|b| {
            let (addr, tx) = (addr.to_string(), tx.clone());
            std::thread::spawn(move || {
                let mut first = Some(tx);
                let out = stream_to_end(&addr, &b, &mut first);
                // An early end counts as "started" too, so the wait below cannot hang.
                if let Some(tx) = first {
                    let _ = tx.send(());
                }
                out
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for _ in 0..n {
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("a stream did not start within 60 s");
    }
    handles
}
