//! The cache of captured decode-step graphs: graphs by exact step signature (looked up
//! by slice, least recently used dropped first) and the step counters the backend
//! reports. State only: capturing and replaying is `graphs.rs`.

use cudarc::driver::CudaGraph;
use std::collections::HashMap;

/// FNV-1a over 8-byte words of a step signature (tens of KB): fast; lookups still
/// compare every byte.
fn signature_hash(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        hash = (hash ^ u64::from_le_bytes(w)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Values keyed by step signature, looked up by slice (a replayed step copies nothing),
/// with least-recently-used eviction.
pub(crate) struct SignatureMap<G> {
    buckets: HashMap<u64, Vec<(Vec<u8>, G, u64)>>,
    len: usize,
}

impl<G> Default for SignatureMap<G> {
    fn default() -> Self {
        SignatureMap {
            buckets: HashMap::new(),
            len: 0,
        }
    }
}

impl<G> SignatureMap<G> {
    /// The value stored for exactly `sig`, marked used at `tick`.
    pub(crate) fn get_mut(&mut self, sig: &[u8], tick: u64) -> Option<&mut G> {
        let (_, g, used) = self
            .buckets
            .get_mut(&signature_hash(sig))?
            .iter_mut()
            .find(|(k, _, _)| k == sig)?;
        *used = tick;
        Some(g)
    }

    pub(crate) fn insert_hashed(&mut self, hash: u64, sig: &[u8], g: G, tick: u64) {
        self.buckets
            .entry(hash)
            .or_default()
            .push((sig.to_vec(), g, tick));
        self.len += 1;
    }

    pub(crate) fn insert(&mut self, sig: &[u8], g: G, tick: u64) {
        self.insert_hashed(signature_hash(sig), sig, g, tick);
    }

    /// Drop the least recently used value.
    pub(crate) fn evict_oldest(&mut self) {
        let oldest = self
            .buckets
            .iter()
            .flat_map(|(h, v)| v.iter().enumerate().map(move |(i, e)| (e.2, *h, i)))
            .min();
        if let Some((_, h, i)) = oldest {
            if let Some(v) = self.buckets.get_mut(&h) {
                v.swap_remove(i);
                if v.is_empty() {
                    self.buckets.remove(&h);
                }
                self.len -= 1;
            }
        }
    }

    /// Drop the value stored for exactly `sig`; whether there was one.
    pub(crate) fn remove(&mut self, sig: &[u8]) -> bool {
        let h = signature_hash(sig);
        let Some(v) = self.buckets.get_mut(&h) else {
            return false;
        };
        let Some(i) = v.iter().position(|(k, _, _)| k == sig) else {
            return false;
        };
        v.swap_remove(i);
        if v.is_empty() {
            self.buckets.remove(&h);
        }
        self.len -= 1;
        true
    }

    pub(crate) fn clear(&mut self) {
        self.buckets.clear();
        self.len = 0;
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// A captured graph. `CudaGraph` holds raw driver handles and is not `Send`.
pub(crate) struct Captured(pub(crate) CudaGraph);

// SAFETY: a graph is only touched with the `GraphCache` mutex held, so calls on it are
// serialised as the driver requires; the handles stay valid on any thread of the process.
#[allow(unsafe_code)]
unsafe impl Send for Captured {}

/// Captured graphs by signature.
#[derive(Default)]
pub(crate) struct GraphCache {
    pub graphs: SignatureMap<Captured>,
    pub tick: u64,
    pub captures: u64,
    pub replays: u64,
    /// `--verify-graphs` steps whose graph replay differed from the eager run.
    pub verify_mismatches: u64,
    pub phases: StepPhases,
}

/// Host time of decode steps by phase, summed over steps (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepPhases {
    pub steps: u64,
    /// The dry pass: the forward's host code, recording launches and staging inputs.
    pub dry: f64,
    /// Eager launches, or the staged-input copy and graph launch.
    pub submit: f64,
    /// Waiting for the device to finish the step.
    pub wait: f64,
    /// Copying the step's outputs (logits rows, greedy ids) back after it finished.
    pub copy: f64,
}

impl GraphCache {
    pub fn held(&self) -> usize {
        self.graphs.len()
    }
}

impl std::fmt::Debug for GraphCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphCache({} graphs)", self.graphs.len())
    }
}

/// Graph statistics of a backend.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GraphStats {
    /// Graphs captured so far.
    pub captures: u64,
    /// Steps replayed from a graph.
    pub replays: u64,
    /// `--verify-graphs` steps whose graph replay differed from the eager run (each
    /// dropped its graph and kept the eager result).
    pub verify_mismatches: u64,
    /// Graphs held now.
    pub held: usize,
    pub phases: StepPhases,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn signatures_compare_every_byte() {
        let mut m = SignatureMap::default();
        m.insert(b"kernel-a 1 2 3", 'a', 1);
        assert_eq!(m.get_mut(b"kernel-a 1 2 3", 2), Some(&mut 'a'));
        assert_eq!(m.get_mut(b"kernel-a 1 2 4", 2), None);
        // Equal hashes never make different signatures equal.
        m.insert_hashed(signature_hash(b"kernel-a 1 2 3"), b"other", 'o', 3);
        assert_eq!(m.get_mut(b"kernel-a 1 2 3", 4), Some(&mut 'a'));
        assert_eq!(m.get_mut(b"other", 4), None);
        assert_eq!(m.len(), 2);
        assert!(m.remove(b"kernel-a 1 2 3"));
        assert!(!m.remove(b"kernel-a 1 2 3"));
        assert_eq!(m.get_mut(b"kernel-a 1 2 3", 5), None);
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn the_least_recently_used_signature_is_evicted() {
        let mut m = SignatureMap::default();
        m.insert(b"one", 1, 1);
        m.insert(b"two", 2, 2);
        m.get_mut(b"one", 3);
        m.evict_oldest();
        assert_eq!(m.len(), 1);
        assert_eq!(m.get_mut(b"two", 4), None);
        assert_eq!(m.get_mut(b"one", 5), Some(&mut 1));
        m.clear();
        assert_eq!(m.len(), 0);
    }
}
