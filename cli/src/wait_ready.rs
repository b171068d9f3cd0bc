//! `pdserve wait-ready`: poll a process's `GET /ready` until it answers 200, for service
//! managers without readiness probes of their own (the systemd units' `ExecStartPost=`,
//! container health checks). Plain HTTP/1.1 over std sockets: no client library needed.

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct WaitReadyArgs {
    /// host:port of the HTTP port serving /ready (a worker's --metrics-listen, the router's
    /// --listen); 0.0.0.0 means this host.
    #[arg(long, env = "PDSERVE_WAIT_ADDRESS")]
    pub address: String,
    /// Path to poll.
    #[arg(long, default_value = "/ready")]
    pub path: String,
    /// Give up (exit 1) after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
    /// Poll once: exit 0 when ready, 1 otherwise (a container HEALTHCHECK).
    #[arg(long)]
    pub once: bool,
}

/// The status code of one `GET path`, each step within `deadline`.
fn status(addr: SocketAddr, host: &str, path: &str, deadline: Duration) -> std::io::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, deadline)?;
    s.set_read_timeout(Some(deadline))?;
    s.set_write_timeout(Some(deadline))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = [0u8; 16];
    s.read_exact(&mut head)?;
    let text = String::from_utf8_lossy(&head);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))
}

pub fn wait_ready(a: WaitReadyArgs) -> Result<()> {
    if !(a.timeout_s.is_finite() && a.timeout_s >= 0.0) {
        bail!("--timeout-s must be a number of seconds >= 0");
    }
    let addr = a
        .address
        .to_socket_addrs()
        .with_context(|| format!("--address {}", a.address))?
        .next()
        .with_context(|| format!("--address {} resolves to nothing", a.address))?;
    let t0 = Instant::now();
    let budget = Duration::from_secs_f64(a.timeout_s);
    loop {
        let last = match status(addr, &a.address, &a.path, Duration::from_secs(2)) {
            Ok(200) => return Ok(()),
            Ok(code) => format!("answered {code}"),
            Err(e) => e.to_string(),
        };
        if a.once || t0.elapsed() >= budget {
            bail!(
                "{}{} not ready after {:.1} s: {last}",
                a.address,
                a.path,
                t0.elapsed().as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}
