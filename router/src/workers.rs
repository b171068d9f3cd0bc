//! The worker set: one lazily connected gRPC channel per worker, its circuit breaker and
//! the load it last reported. Workers come from flags/config and from `POST /workers`;
//! the set changes at run time (requests hold their own `Arc<Worker>`).

use crate::circuit::{Breaker, Circuit};
use crate::ServeError;
use pdserve_layout_fields::first_difference;
use pdserve_proto::cluster::{self, ClusterToken};
use pdserve_proto::pb;
use pdserve_proto::tls::ClusterTls;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;
use tonic::transport::Channel;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug)]
pub struct Worker {
    pub addr: String,
    pub role: Role,
    pub channel: Channel,
    /// The cluster token: challenges on every `Info`, sent on calls that do work.
    pub token: Option<ClusterToken>,
    /// The channel speaks mutual TLS: a worker proves itself in the handshake.
    pub tls: bool,
    breaker: Mutex<Breaker>,
    /// The last `Worker.Info` answer (model, layout, load).
    info: Mutex<Option<pb::WorkerInfo>>,
    /// Requests this router has in flight on the worker (prefill: until the first token).
    inflight: AtomicU32,
}

/// Counts a request in flight on a worker until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<Worker>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Worker {
    /// A worker reached over plain gRPC.
    pub fn new(
        addr: &str,
        role: Role,
        connect_timeout: Duration,
        token: Option<ClusterToken>,
    ) -> Result<Arc<Self>, ServeError> {
        Worker::with_tls(addr, role, connect_timeout, token, None)
    }

    /// A worker reached over mutual TLS when `tls` is given.
    pub fn with_tls(
        addr: &str,
        role: Role,
        connect_timeout: Duration,
        token: Option<ClusterToken>,
        tls: Option<&ClusterTls>,
    ) -> Result<Arc<Self>, ServeError> {
        let channel = pdserve_proto::tls::endpoint(addr, tls)
            .map_err(|e| ServeError::Address {
                addr: addr.to_string(),
                reason: e.to_string(),
            })?
            .connect_timeout(connect_timeout)
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(2))
            .keep_alive_while_idle(true)
            .connect_lazy();
        Ok(Arc::new(Worker {
            addr: addr.to_string(),
            role,
            channel,
            token,
            tls: tls.is_some(),
            breaker: Mutex::new(Breaker::default()),
            info: Mutex::new(None),
            inflight: AtomicU32::new(0),
        }))
    }

    /// In rotation: circuit closed or half open.
    pub fn is_healthy(&self) -> bool {
        self.circuit().in_rotation()
    }

    pub fn circuit(&self) -> Circuit {
        lock(&self.breaker).circuit
    }

    pub fn last_error(&self) -> String {
        lock(&self.breaker).last_error.clone()
    }

    fn log(&self, t: Option<(Circuit, Circuit)>, why: &str) {
        if let Some((from, to)) = t {
            if to.in_rotation() {
                tracing::info!(addr = %self.addr, role = self.role.name(), ?from, ?to, "worker back in rotation");
            } else {
                tracing::warn!(addr = %self.addr, role = self.role.name(), ?from, ?to, reason = why, "worker taken out of rotation");
            }
            self.record_circuit();
        }
    }

    /// `pdserve_worker_circuit_state{worker, role, state}`: 1 for the current state, 0
    /// for the others (an enum as a label, so dashboards need no number legend).
    pub fn record_circuit(&self) {
        let now = self.circuit();
        for c in Circuit::ALL {
            metrics::gauge!("pdserve_worker_circuit_state", "worker" => self.addr.clone(), "role" => self.role.name(), "state" => c.name())
                .set(if c == now { 1.0 } else { 0.0 });
        }
    }

    /// A passing health check with the worker's info.
    pub fn health_ok(&self, info: pb::WorkerInfo) {
        *lock(&self.info) = Some(info);
        let t = lock(&self.breaker).health_ok();
        self.log(t, "");
    }

    /// A failed health check or connect failure: out of rotation at once.
    pub fn fail_hard(&self, why: &str) {
        let t = lock(&self.breaker).fail_hard(why);
        self.log(t, why);
    }

    /// A request failure this worker caused.
    pub fn request_failed(&self, why: &str) {
        let t = lock(&self.breaker).request_failed(why);
        self.log(t, why);
    }

    pub fn request_ok(&self) {
        let t = lock(&self.breaker).request_ok();
        self.log(t, "");
    }

    pub fn info(&self) -> Option<pb::WorkerInfo> {
        lock(&self.info).clone()
    }

    /// Set the reported info without a health transition (policy tests).
    pub fn set_info(&self, info: pb::WorkerInfo) {
        *lock(&self.info) = Some(info);
    }

    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Count one more request in flight until the guard drops.
    pub fn start_request(self: &Arc<Self>) -> InFlight {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Requests queued or running: the larger of the worker's last report and this
    /// router's own in-flight count (fresher between health checks).
    pub fn queue(&self) -> u32 {
        let reported = lock(&self.info)
            .as_ref()
            .map_or(0, |i| i.running + i.waiting);
        reported.max(self.inflight())
    }

    /// Fraction of the device KV pool in use, prefix-cache pages excluded (0 when unknown).
    pub fn pages_used_fraction(&self) -> f64 {
        lock(&self.info).as_ref().map_or(0.0, |i| {
            let used = i
                .total_pages
                .saturating_sub(i.free_pages)
                .saturating_sub(i.cached_pages);
            used as f64 / i.total_pages.max(1) as f64
        })
    }

    /// The worker's KV page size in tokens, from its reported layout.
    pub fn page_tokens(&self) -> Option<usize> {
        let info = lock(&self.info);
        let layout = info.as_ref()?.layout.as_ref()?;
        layout
            .fields
            .iter()
            .find(|f| f.name == "page_tokens")?
            .value
            .parse()
            .ok()
    }
}

/// Why two workers cannot serve one request together.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{field} differs: {a_addr} has `{a}`, {b_addr} has `{b}`")]
pub struct Mismatch {
    pub field: String,
    pub a_addr: String,
    pub a: String,
    pub b_addr: String,
    pub b: String,
}

/// Compare two workers' model and KV layout; the first differing field, if any.
pub fn compare(
    a: &Worker,
    ai: &pb::WorkerInfo,
    b: &Worker,
    bi: &pb::WorkerInfo,
) -> Option<Mismatch> {
    let mm = |field: &str, x: &str, y: &str| Mismatch {
        field: field.to_string(),
        a_addr: a.addr.clone(),
        a: x.to_string(),
        b_addr: b.addr.clone(),
        b: y.to_string(),
    };
    if ai.model != bi.model {
        return Some(mm("model", &ai.model, &bi.model));
    }
    let empty = pb::KvLayoutInfo::default();
    let (la, lb) = (
        ai.layout.as_ref().unwrap_or(&empty),
        bi.layout.as_ref().unwrap_or(&empty),
    );
    if let Some(d) = first_difference(&pairs(la), &pairs(lb)) {
        let absent = "(absent)";
        return Some(mm(
            d.field,
            d.ours.unwrap_or(absent),
            d.theirs.unwrap_or(absent),
        ));
    }
    if la.fingerprint != lb.fingerprint {
        return Some(mm("layout fingerprint", &la.fingerprint, &lb.fingerprint));
    }
    None
}

fn pairs(layout: &pb::KvLayoutInfo) -> Vec<(&str, &str)> {
    layout
        .fields
        .iter()
        .map(|f| (f.name.as_str(), f.value.as_str()))
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error(transparent)]
    Address(#[from] ServeError),
    #[error("worker {0} is already in the set")]
    Duplicate(String),
    #[error("refusing worker {addr}: {reason}")]
    Identity { addr: String, reason: InfoError },
    #[error("worker {addr} did not answer Worker.Info within {secs:.1} s: {reason}")]
    Unreachable {
        addr: String,
        secs: f64,
        reason: String,
    },
    #[error("worker {addr} says it is a {actual} server, not {wanted}")]
    WrongRole {
        addr: String,
        actual: String,
        wanted: &'static str,
    },
    #[error("refusing worker {addr}: {mismatch}")]
    Mismatch { addr: String, mismatch: Mismatch },
}

#[derive(Debug)]
pub struct Workers {
    prefill: RwLock<Vec<Arc<Worker>>>,
    decode: RwLock<Vec<Arc<Worker>>>,
    connect_timeout: Duration,
    token: Option<ClusterToken>,
    tls: Option<ClusterTls>,
}

fn read(l: &RwLock<Vec<Arc<Worker>>>) -> Vec<Arc<Worker>> {
    l.read().unwrap_or_else(|e| e.into_inner()).clone()
}

impl Workers {
    /// Workers reached over plain gRPC.
    pub fn new(
        prefill: &[String],
        decode: &[String],
        connect_timeout: Duration,
        token: Option<ClusterToken>,
    ) -> Result<Self, ServeError> {
        Workers::with_tls(prefill, decode, connect_timeout, token, None)
    }

    /// Workers (those given now and those added later) reached over mutual TLS when
    /// `tls` is given.
    pub fn with_tls(
        prefill: &[String],
        decode: &[String],
        connect_timeout: Duration,
        token: Option<ClusterToken>,
        tls: Option<ClusterTls>,
    ) -> Result<Self, ServeError> {
        let make = |addrs: &[String], role| {
            addrs
                .iter()
                .map(|a| Worker::with_tls(a, role, connect_timeout, token.clone(), tls.as_ref()))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Workers {
            prefill: RwLock::new(make(prefill, Role::Prefill)?),
            decode: RwLock::new(make(decode, Role::Decode)?),
            connect_timeout,
            token,
            tls,
        })
    }

    fn list(&self, role: Role) -> &RwLock<Vec<Arc<Worker>>> {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// The current prefill workers.
    pub fn prefill(&self) -> Vec<Arc<Worker>> {
        read(&self.prefill)
    }

    /// The current decode workers.
    pub fn decode(&self) -> Vec<Arc<Worker>> {
        read(&self.decode)
    }

    pub fn of(&self, role: Role) -> Vec<Arc<Worker>> {
        read(self.list(role))
    }

    pub fn all(&self) -> Vec<Arc<Worker>> {
        let mut v = self.prefill();
        v.extend(self.decode());
        v
    }

    pub fn find(&self, addr: &str) -> Option<Arc<Worker>> {
        self.all().into_iter().find(|w| w.addr == addr)
    }

    /// Add a worker at run time: it must answer `Worker.Info` within the connect
    /// timeout, say it has `role`, and match every current worker's model and KV layout.
    /// It enters rotation at once (circuit closed).
    pub async fn add(&self, addr: &str, role: Role) -> Result<Arc<Worker>, AddError> {
        if self.find(addr).is_some() {
            return Err(AddError::Duplicate(addr.to_string()));
        }
        let w = Worker::with_tls(
            addr,
            role,
            self.connect_timeout,
            self.token.clone(),
            self.tls.as_ref(),
        )?;
        let info = fetch_info(&w, self.connect_timeout.max(Duration::from_secs(1)))
            .await
            .map_err(|e| match e {
                InfoError::Unreachable(reason) => AddError::Unreachable {
                    addr: addr.to_string(),
                    secs: self
                        .connect_timeout
                        .max(Duration::from_secs(1))
                        .as_secs_f64(),
                    reason,
                },
                identity => AddError::Identity {
                    addr: addr.to_string(),
                    reason: identity,
                },
            })?;
        if info.role != role.name() {
            return Err(AddError::WrongRole {
                addr: addr.to_string(),
                actual: info.role.clone(),
                wanted: role.name(),
            });
        }
        for other in self.all() {
            if let Some(oi) = other.info() {
                if let Some(mismatch) = compare(&w, &info, &other, &oi) {
                    return Err(AddError::Mismatch {
                        addr: addr.to_string(),
                        mismatch,
                    });
                }
            }
        }
        w.health_ok(info);
        let mut list = self.list(role).write().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|x| x.addr == addr) {
            return Err(AddError::Duplicate(addr.to_string()));
        }
        list.push(w.clone());
        tracing::info!(addr, role = role.name(), "worker added");
        Ok(w)
    }

    /// Take a worker out of the set; requests already on it finish there.
    pub fn remove(&self, addr: &str) -> Option<Arc<Worker>> {
        for role in [Role::Prefill, Role::Decode] {
            let mut list = self.list(role).write().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = list.iter().position(|w| w.addr == addr) {
                let w = list.remove(i);
                tracing::info!(addr, role = role.name(), "worker removed");
                return Some(w);
            }
        }
        None
    }
}

/// Why `Worker.Info` gave no usable answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum InfoError {
    #[error("{0}")]
    Unreachable(String),
    /// It answered, but is not a member of this cluster.
    #[error("{0}: not a member of this cluster (wrong or missing --cluster-token)")]
    Identity(&'static str),
    /// Its TLS handshake failed: no certificate under this cluster's CA for its address.
    #[error("TLS handshake failed ({0}): not a member of this cluster (its certificate must be signed by --tls-ca and name its address)")]
    Certificate(String),
}

/// The innermost cause of a failed handshake (rustls' own words).
fn handshake_reason(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = Some(e);
    let mut last = e.to_string();
    while let Some(err) = cur {
        last = err.to_string();
        cur = err.source();
    }
    last
}

/// `Worker.Info` with a deadline. With a cluster token, the call carries a fresh
/// challenge (never the token) and the answer counts only when the worker's proof
/// verifies: a worker that cannot prove it holds the token is never admitted, and one
/// replaced by an impostor at the same address leaves rotation at its next poll. With
/// TLS the handshake proves the same (a server certificate under the CA for the
/// worker's address); a failed one is an identity error, not an unreachable worker.
pub async fn fetch_info(w: &Worker, deadline: Duration) -> Result<pb::WorkerInfo, InfoError> {
    let mut c = pb::worker_client::WorkerClient::new(w.channel.clone());
    let mut req = tonic::Request::new(pb::Empty {});
    let challenge = w.token.as_ref().map(|_| ClusterToken::challenge());
    if let Some(ch) = &challenge {
        if let Ok(v) = ch.parse() {
            req.metadata_mut().insert(cluster::CHALLENGE, v);
        }
    }
    let resp = match tokio::time::timeout(deadline, c.info(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(s)) if w.tls && pdserve_proto::tls::is_handshake_failure(&s) => {
            return Err(InfoError::Certificate(handshake_reason(&s)))
        }
        Ok(Err(s)) => return Err(InfoError::Unreachable(s.message().to_string())),
        Err(_) => {
            return Err(InfoError::Unreachable(format!(
                "no answer within {deadline:?}"
            )))
        }
    };
    if let (Some(t), Some(ch)) = (&w.token, &challenge) {
        let proof = resp
            .metadata()
            .get(cluster::PROOF)
            .and_then(|v| v.to_str().ok());
        match proof {
            Some(p) if t.verify(ch, p) => {}
            Some(_) => return Err(InfoError::Identity("its cluster-token proof is wrong")),
            None => return Err(InfoError::Identity("it sent no cluster-token proof")),
        }
    }
    Ok(resp.into_inner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn info(model: &str, index_k: &str) -> pb::WorkerInfo {
        let field = |n: &str, v: &str| pb::LayoutField {
            name: n.into(),
            value: v.into(),
        };
        pb::WorkerInfo {
            model: model.into(),
            layout: Some(pb::KvLayoutInfo {
                fingerprint: format!("fp-{index_k}"),
                fields: vec![field("page_tokens", "256"), field("index_k_dtype", index_k)],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn comparisons_name_the_differing_field() {
        let a = Worker::new("a:1", Role::Prefill, Duration::from_secs(1), None).unwrap();
        let b = Worker::new("b:1", Role::Decode, Duration::from_secs(1), None).unwrap();
        assert_eq!(compare(&a, &info("m", "f32"), &b, &info("m", "f32")), None);
        let m = compare(&a, &info("m", "f32"), &b, &info("m", "bf16")).unwrap();
        assert_eq!(m.field, "index_k_dtype");
        assert_eq!(
            m.to_string(),
            "index_k_dtype differs: a:1 has `f32`, b:1 has `bf16`"
        );
        let m = compare(&a, &info("m", "f32"), &b, &info("other", "bf16")).unwrap();
        assert_eq!(m.field, "model");
        let mut extra = info("m", "f32");
        if let Some(l) = extra.layout.as_mut() {
            l.fields.push(pb::LayoutField {
                name: "kv_dtype".into(),
                value: "bf16".into(),
            });
        }
        let m = compare(&a, &info("m", "f32"), &b, &extra).unwrap();
        assert_eq!((m.field.as_str(), m.a.as_str()), ("kv_dtype", "(absent)"));
    }

    #[tokio::test]
    async fn workers_are_removed_by_address() {
        let ws = Workers::new(
            &["p:1".into()],
            &["d:1".into(), "d:2".into()],
            Duration::from_secs(1),
            None,
        )
        .unwrap();
        assert_eq!(ws.all().len(), 3);
        assert_eq!(ws.remove("d:1").unwrap().role, Role::Decode);
        assert!(ws.remove("d:1").is_none());
        let left: Vec<String> = ws.all().iter().map(|w| w.addr.clone()).collect();
        assert_eq!(left, ["p:1", "d:2"]);
    }
}
