//! Routing policies: which worker of a role serves a request. One policy per role
//! (`--prefill-policy`, `--decode-policy`), picked by name.

mod least_load;
mod prefix_affinity;
mod round_robin;

pub use least_load::LeastLoad;
pub use prefix_affinity::PrefixAffinity;
pub use round_robin::RoundRobin;

use crate::workers::Worker;
use std::sync::Arc;

/// What a policy may look at: the request's prompt token ids.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    pub prompt: &'a [u32],
}

/// Picks one worker among candidates (in rotation, not yet tried for this request).
pub trait RoutingPolicy: Send + Sync {
    fn name(&self) -> &'static str;

    fn pick(&self, req: &RouteRequest<'_>, candidates: &[Arc<Worker>]) -> Option<Arc<Worker>>;

    /// The request was sent to `worker` (policies that remember placements learn here).
    fn routed(&self, _req: &RouteRequest<'_>, _worker: &Worker) {}

    /// `addr` left the worker set.
    fn forget(&self, _addr: &str) {}
}

/// Policy names accepted by `--prefill-policy` / `--decode-policy`.
pub const NAMES: &[&str] = &["round_robin", "least_load", "prefix_affinity"];

#[derive(Debug, thiserror::Error)]
#[error("unknown routing policy `{0}` (expected one of: round_robin, least_load, prefix_affinity)")]
pub struct UnknownPolicy(pub String);

/// The policy called `name` (dashes accepted for underscores).
pub fn by_name(name: &str) -> Result<Box<dyn RoutingPolicy>, UnknownPolicy> {
    match name.replace('-', "_").as_str() {
        "round_robin" => Ok(Box::new(RoundRobin::default())),
        "least_load" => Ok(Box::new(LeastLoad::default())),
        "prefix_affinity" => Ok(Box::new(PrefixAffinity::default())),
        _ => Err(UnknownPolicy(name.to_string())),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    #![allow(clippy::unwrap_used)]
    use crate::workers::{Role, Worker};
    use pdserve_proto::pb;
    use std::sync::Arc;
    use std::time::Duration;

    /// A worker (never connected) that reports this load, with 64-token pages.
    pub fn worker(addr: &str, running: u32, waiting: u32, free: u64) -> Arc<Worker> {
        let w = Worker::new(addr, Role::Prefill, Duration::from_secs(1), None).unwrap();
        w.set_info(pb::WorkerInfo {
            running,
            waiting,
            free_pages: free,
            total_pages: 100,
            layout: Some(pb::KvLayoutInfo {
                fields: vec![pb::LayoutField {
                    name: "page_tokens".into(),
                    value: "64".into(),
                }],
                ..Default::default()
            }),
            ..Default::default()
        });
        w
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn policies_by_name() {
        for n in NAMES {
            assert_eq!(by_name(n).unwrap().name(), *n);
        }
        assert_eq!(by_name("least-load").unwrap().name(), "least_load");
        let e = by_name("random").err().unwrap().to_string();
        assert!(
            e.contains("`random`") && e.contains("prefix_affinity"),
            "{e}"
        );
    }
}
