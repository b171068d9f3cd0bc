//! Eviction (device -> host, host-only leaves), removal, clearing and the bookkeeping
//! check of the prefix cache.

use super::{internal, Node, NodeId, PrefixCache, ROOT};
use crate::backend::Backend;
use crate::engine::{Engine, EngineError};
use crate::kv::PageId;
use std::cmp::Reverse;
use std::collections::HashSet;

impl PrefixCache {
    /// Evict the least recently used device page nobody but the cache holds, backing it
    /// up to the host pool. False when there is none.
    pub fn evict_one_device<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
    ) -> Result<bool, EngineError> {
        let mut cands: Vec<(u64, Reverse<usize>, NodeId, PageId)> = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(id, n)| {
                let n = n.as_ref()?;
                let p = n.device?;
                (engine.page_refcount(p) == 1).then_some((n.last_use, Reverse(n.depth), id, p))
            })
            .collect();
        cands.sort_unstable();
        for (_, _, id, p) in cands {
            if self.node(id)?.host.is_none() {
                match self.host_page()? {
                    Some(hp) => {
                        if let Err(e) = engine.backup_page(&mut self.host, p, hp) {
                            self.host.free(hp)?;
                            return Err(e);
                        }
                        self.node_mut(id)?.host = Some(hp);
                    }
                    None if self.node(id)?.children.is_empty() => {
                        self.remove_node(engine, id)?;
                        return Ok(true);
                    }
                    None => continue,
                }
            }
            engine.release_pages(&[p])?;
            self.node_mut(id)?.device = None;
            return Ok(true);
        }
        Ok(false)
    }

    /// A free host page, evicting host-only leaves (then host copies of pages also on
    /// the device) if the pool is full.
    fn host_page(&mut self) -> Result<Option<PageId>, EngineError> {
        loop {
            if let Some(hp) = self.host.alloc() {
                return Ok(Some(hp));
            }
            let leaf = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(id, n)| {
                    let n = n.as_ref()?;
                    (n.device.is_none() && n.host.is_some() && n.children.is_empty())
                        .then_some((n.last_use, id))
                })
                .min();
            if let Some((_, id)) = leaf {
                self.drop_host_leaf(id)?;
                continue;
            }
            let copy = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(id, n)| {
                    let n = n.as_ref()?;
                    (n.device.is_some() && n.host.is_some()).then_some((n.last_use, id))
                })
                .min();
            match copy {
                Some((_, id)) => {
                    if let Some(hp) = self.node_mut(id)?.host.take() {
                        self.host.free(hp)?;
                    }
                }
                None => return Ok(None),
            }
        }
    }

    fn drop_host_leaf(&mut self, id: NodeId) -> Result<(), EngineError> {
        let n = self.detach(id)?;
        if let Some(hp) = n.host {
            self.host.free(hp)?;
        }
        Ok(())
    }

    fn remove_node<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        id: NodeId,
    ) -> Result<(), EngineError> {
        let n = self.detach(id)?;
        if let Some(p) = n.device {
            engine.release_pages(&[p])?;
        }
        if let Some(hp) = n.host {
            self.host.free(hp)?;
        }
        Ok(())
    }

    /// Take a leaf out of the tree.
    fn detach(&mut self, id: NodeId) -> Result<Node, EngineError> {
        if id == ROOT || !self.node(id)?.children.is_empty() {
            return Err(internal(format!("node {id} is not a removable leaf")));
        }
        let n = self.nodes[id]
            .take()
            .ok_or_else(|| internal(format!("node {id} missing")))?;
        self.node_mut(n.parent)?.children.remove(&n.key);
        self.free_ids.push(id);
        Ok(n)
    }

    /// Drop every cached prefix, giving back its device and host pages.
    pub fn clear<B: Backend>(&mut self, engine: &mut Engine<B>) -> Result<(), EngineError> {
        // Pending cut points hold pages and state slots: into the tree, then out with it.
        self.finish_pending(engine)?;
        for id in 1..self.nodes.len() {
            if let Some(n) = self.nodes[id].take() {
                if let Some(p) = n.device {
                    engine.release_pages(&[p])?;
                }
                if let Some(hp) = n.host {
                    self.host.free(hp)?;
                }
            }
        }
        self.nodes.truncate(1);
        self.free_ids.clear();
        self.node_mut(ROOT)?.children.clear();
        Ok(())
    }

    /// Check the tree's bookkeeping against both pools (tests, debugging).
    pub fn verify<B: Backend>(&self, engine: &Engine<B>) -> Result<(), String> {
        let mut dev = HashSet::new();
        let mut host = HashSet::new();
        for (id, n) in self.nodes.iter().enumerate().skip(1) {
            let Some(n) = n else { continue };
            if n.device.is_none() && n.host.is_none() {
                return Err(format!("node {id} holds no page"));
            }
            if let Some(p) = n.device {
                if !dev.insert(p) {
                    return Err(format!("device page {p} owned by two nodes"));
                }
                if engine.page_refcount(p) == 0 {
                    return Err(format!("node {id}'s device page {p} is free"));
                }
            }
            if let Some(hp) = n.host {
                if !host.insert(hp) {
                    return Err(format!("host page {hp} owned by two nodes"));
                }
            }
            if n.key.len() != self.page_tokens
                || n.state.len() != engine.layout().cut_snapshot_bytes()
            {
                return Err(format!("node {id} has a key or state of the wrong size"));
            }
            let parent = self.nodes[n.parent]
                .as_ref()
                .ok_or(format!("node {id}'s parent is gone"))?;
            if parent.children.get(&n.key) != Some(&id) {
                return Err(format!("node {id} not linked from its parent"));
            }
        }
        if host.len() != self.host.used_pages() {
            return Err(format!(
                "host pool has {} pages in use, tree holds {}",
                self.host.used_pages(),
                host.len()
            ));
        }
        Ok(())
    }
}
