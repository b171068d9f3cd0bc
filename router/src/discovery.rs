//! Worker discovery by DNS: every interval, resolve each `--discover-prefill` /
//! `--discover-decode` name (`host:port`) and make the discovered part of the worker set
//! equal the addresses it resolves to. Behind a Kubernetes headless Service, whose DNS
//! name lists exactly the ready pods its label selector matches, the router follows pods
//! as they come, go, and drain (a draining pod turns not ready and leaves the record).
//! New addresses join through [`Workers::add`] (the same checks as `POST /workers`);
//! vanished ones leave as `DELETE /workers/{address}` does (requests on them finish).
//! Workers given by flags or `POST /workers` are never touched.

use crate::workers::Role;
use crate::AppState;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// What to change so that the discovered workers `known` become `found`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub add: Vec<String>,
    pub remove: Vec<String>,
}

pub fn plan(known: &BTreeSet<String>, found: &BTreeSet<String>) -> Plan {
    Plan {
        add: found.difference(known).cloned().collect(),
        remove: known.difference(found).cloned().collect(),
    }
}

/// Every address `names` resolve to within `deadline`; None when any lookup failed (a
/// DNS hiccup must not empty the worker set).
pub async fn resolve(names: &[String], deadline: Duration) -> Option<BTreeSet<String>> {
    let mut found = BTreeSet::new();
    for name in names {
        match tokio::time::timeout(deadline, tokio::net::lookup_host(name.as_str())).await {
            Ok(Ok(addrs)) => found.extend(addrs.map(|a| a.to_string())),
            Ok(Err(e)) => {
                tracing::warn!(name = %name, error = %e, "worker discovery: lookup failed");
                return None;
            }
            Err(_) => {
                tracing::warn!(name = %name, "worker discovery: lookup timed out after {deadline:?}");
                return None;
            }
        }
    }
    Some(found)
}

/// Follow `names` for `role`, forever.
pub async fn follow(state: Arc<AppState>, role: Role, names: Vec<String>, interval: Duration) {
    let mut known = BTreeSet::new();
    loop {
        if let Some(found) = resolve(&names, interval.max(Duration::from_secs(1))).await {
            let p = plan(&known, &found);
            for addr in p.remove {
                if state.workers.remove(&addr).is_some() {
                    state.prefill_policy.forget(&addr);
                    state.decode_policy.forget(&addr);
                    tracing::info!(%addr, role = role.name(), "worker discovery: gone; removed");
                }
                known.remove(&addr);
            }
            for addr in p.add {
                match state.workers.add(&addr, role).await {
                    Ok(_) => {
                        tracing::info!(%addr, role = role.name(), "worker discovery: added");
                        known.insert(addr);
                    }
                    Err(e) => {
                        tracing::warn!(%addr, role = role.name(), error = %e, "worker discovery: not added (retried next round)")
                    }
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_plan_adds_what_appeared_and_removes_what_vanished() {
        let p = plan(
            &set(&["10.0.0.1:1", "10.0.0.2:1"]),
            &set(&["10.0.0.2:1", "10.0.0.3:1"]),
        );
        assert_eq!(
            p,
            Plan {
                add: vec!["10.0.0.3:1".into()],
                remove: vec!["10.0.0.1:1".into()],
            }
        );
        assert_eq!(plan(&set(&["a:1"]), &set(&["a:1"])), Plan::default());
    }

    #[tokio::test]
    async fn names_resolve_to_socket_addresses_and_failures_to_none() {
        let names = vec!["127.0.0.1:50062".to_string()];
        assert_eq!(
            resolve(&names, Duration::from_secs(2)).await,
            Some(set(&["127.0.0.1:50062"]))
        );
        let bad = vec!["no-such-host.invalid:1".to_string()];
        assert_eq!(resolve(&bad, Duration::from_secs(5)).await, None);
    }
}
