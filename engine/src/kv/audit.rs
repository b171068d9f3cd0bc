//! The KV canary (`--kv-audit`, `--kv-audit-every N`): checksums of every page and state
//! slot, computed where the pool lives ([`KvStorage::page_checksums`]), compared against
//! the writes everyone announced:
//!
//! - **pages**, around every `every`-th step: before it, since the last check only pages
//!   in the pool's [`Written`] set (imports, host-tier loads) or covering an unchecked
//!   step's new positions may have changed; in it, only the pages covering its sequences'
//!   new positions (two passes over the pages per check: one pass could not tell a stray
//!   write between steps into a page the next step writes from that step's own write);
//! - **state slots**, around every step (a step rewrites its sequences' whole slots, so a
//!   slot can only be checked right before and after): between steps only slots written
//!   through the pool (resets, imports) may change, in a step only its sequences' own.
//!
//! What changed outside those sets is logged, counted (`pdserve_kv_audit_violations_total`)
//! and stays marked corrupt while someone holds it, so exactly its owners fail: a step's own
//! sequences at once ([`crate::Engine::forward_each`]), the others when they next run.

use super::canary_regions::RegionMap;
use super::checksum::sections;
use super::{DevicePool, PageId, SeqKv, StateSlot, Written};
use crate::backend::{BResult, BackendError, BatchPlan, KvStorage};
use std::collections::{BTreeMap, BTreeSet};

/// Ids found changed, each with the checksum sections of it that changed.
pub type Changed = BTreeMap<u32, Vec<usize>>;

/// Pages and state slots found corrupt that a sequence holds.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("pages {pages:?} and state slots {states:?} changed outside a step's expected writes")]
    Corrupt {
        pages: Vec<PageId>,
        states: Vec<StateSlot>,
    },
}

/// Where a test-only scribble lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScribbleTarget {
    /// A whole page.
    Page(PageId),
    /// One index-K entry of a CSA layer inside a page (`entry` counts within the page).
    IndexK {
        page: PageId,
        layer: usize,
        entry: usize,
    },
    /// A whole state slot.
    State(StateSlot),
}

/// A test-only write that bypasses the pool's [`Written`] set, as a kernel writing out of
/// bounds would: `in_step` lands between the step and its check, otherwise after the check
/// (found by the next audited step's between-steps check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scribble {
    pub target: ScribbleTarget,
    pub in_step: bool,
}

/// The canary's state between steps and what it has found corrupt so far.
#[derive(Debug, Default)]
pub struct StepAudit {
    /// Check the pages at every `every`-th step (0: the canary is off). State slots are
    /// checked at every step: a step writes its sequences' whole slots, so a slot can only
    /// be checked against the step just before it.
    every: u32,
    /// Steps run since the pages were last checked.
    since: u32,
    /// Page checksums at the last page check, and the pages written since.
    page_base: Option<Vec<u64>>,
    pages_written: BTreeSet<PageId>,
    /// State-slot checksums after the last step.
    state_base: Option<Vec<u64>>,
    /// Pages/slots found corrupt; sequences holding them fail until they are freed.
    poisoned_pages: BTreeSet<PageId>,
    poisoned_states: BTreeSet<StateSlot>,
    scribble: Option<Scribble>,
}

/// The checksums a step's audit took before the step (pages only at a page check).
pub struct BeforeStep {
    pages: Option<Vec<u64>>,
    states: Option<Vec<u64>>,
}

impl StepAudit {
    /// Check pages every `every`-th step (state slots every step); 0 turns the canary off.
    pub fn set_every<B: KvStorage>(&mut self, every: u32, pool: &mut DevicePool<B>) {
        *self = StepAudit {
            every,
            poisoned_pages: std::mem::take(&mut self.poisoned_pages),
            poisoned_states: std::mem::take(&mut self.poisoned_states),
            ..StepAudit::default()
        };
        pool.track_writes(every > 0);
    }

    pub fn every(&self) -> u32 {
        self.every
    }

    /// Whether the audit marked `page` corrupt.
    pub fn is_poisoned(&self, page: PageId) -> bool {
        self.poisoned_pages.contains(&page)
    }

    /// `page` was freed (its contents no longer matter).
    pub fn forget_page(&mut self, page: PageId) {
        self.poisoned_pages.remove(&page);
    }

    /// `slot` was freed or handed out fresh.
    pub fn forget_state(&mut self, slot: StateSlot) {
        self.poisoned_states.remove(&slot);
    }

    /// Plant a test-only scribble at the next step.
    pub fn scribble_at_next_step(&mut self, s: Scribble) {
        self.scribble = Some(s);
    }

    /// The corrupt pages and state slot `kv` holds, if any.
    pub fn fault_of(&self, kv: &SeqKv) -> Option<AuditError> {
        if self.poisoned_pages.is_empty() && self.poisoned_states.is_empty() {
            return None;
        }
        let pages: Vec<PageId> = kv
            .pages
            .iter()
            .copied()
            .filter(|p| self.poisoned_pages.contains(p))
            .collect();
        let states: Vec<StateSlot> = Some(kv.state)
            .filter(|s| self.poisoned_states.contains(s))
            .into_iter()
            .collect();
        if pages.is_empty() && states.is_empty() {
            return None;
        }
        Some(AuditError::Corrupt { pages, states })
    }

    /// Before a step: the between-steps checks (state slots always, pages when this step
    /// is a page check), and the checksums the in-step checks start from.
    pub fn before_step<B: KvStorage>(
        &mut self,
        backend: &B,
        pool: &mut DevicePool<B>,
    ) -> BResult<BeforeStep> {
        if self.every == 0 {
            return Ok(BeforeStep {
                pages: None,
                states: None,
            });
        }
        let written = pool.take_written();
        self.pages_written.extend(&written.pages);
        let states = backend.state_checksums(pool.store())?;
        let (per_page, per_state) = per_region(pool);
        if let Some(base) = self.state_base.take() {
            let bad = changed_outside(&base, &states, &written.states, per_state);
            self.record(pool, Changed::new(), bad, "between steps");
        }
        let pages = match self.since + 1 >= self.every {
            false => None,
            true => {
                let now = backend.page_checksums(pool.store())?;
                if let Some(base) = self.page_base.take() {
                    let bad = changed_outside(&base, &now, &self.pages_written, per_page);
                    self.record(pool, bad, Changed::new(), "since the last page check");
                }
                self.pages_written.clear();
                Some(now)
            }
        };
        Ok(BeforeStep {
            pages,
            states: Some(states),
        })
    }

    /// After the step of `plan`: the in-step checks (only its sequences' slots and the
    /// pages covering their new positions may have changed); an unchecked step's writes
    /// are allowed at the next page check.
    pub fn after_step<B: KvStorage>(
        &mut self,
        backend: &B,
        pool: &mut DevicePool<B>,
        before: BeforeStep,
        plan: &BatchPlan,
    ) -> BResult<()> {
        let scribble = self.scribble.take();
        if let Some(s) = scribble.filter(|s| s.in_step) {
            write_garbage(backend, pool, s.target)?;
        }
        if self.every == 0 {
            return Ok(());
        }
        let expected = expected_writes(plan, pool.layout().page_tokens);
        let (per_page, per_state) = per_region(pool);
        if let Some(start) = before.states {
            let now = backend.state_checksums(pool.store())?;
            let bad = changed_outside(&start, &now, &expected.states, per_state);
            self.record(pool, Changed::new(), bad, "in the step");
            self.state_base = Some(now);
        }
        self.since += 1;
        match before.pages {
            None => self.pages_written.extend(&expected.pages),
            Some(start) => {
                let now = backend.page_checksums(pool.store())?;
                let bad = changed_outside(&start, &now, &expected.pages, per_page);
                self.record(pool, bad, Changed::new(), "in the step");
                self.page_base = Some(now);
                self.since = 0;
            }
        }
        if let Some(s) = scribble.filter(|s| !s.in_step) {
            write_garbage(backend, pool, s.target)?;
        }
        Ok(())
    }

    /// Log, count and mark what changed outside the expected writes: each page with its
    /// holder count and each page or slot with the byte ranges (and the layout regions
    /// they hold) whose checksums changed.
    fn record<B: KvStorage>(
        &mut self,
        pool: &DevicePool<B>,
        pages: Changed,
        states: Changed,
        when: &str,
    ) {
        let count = pages.len() + states.len();
        if count == 0 {
            return;
        }
        let layout = pool.layout();
        let alloc = pool.allocator();
        let held_pages: Vec<(PageId, u32)> =
            pages.keys().map(|&p| (p, alloc.refcount(p))).collect();
        let changed = |what: &str, map: &RegionMap, bytes: usize, ids: &Changed| -> Vec<String> {
            let len = bytes / sections(bytes);
            ids.iter()
                .flat_map(|(id, secs)| {
                    secs.iter().map(move |&s| {
                        let range = s * len..(s + 1) * len;
                        format!(
                            "{what} {id} bytes {}..{} ({})",
                            range.start,
                            range.end,
                            map.describe(range.clone())
                        )
                    })
                })
                .collect()
        };
        let mut bytes = changed("page", &RegionMap::page(layout), layout.page_bytes, &pages);
        bytes.extend(changed(
            "state slot",
            &RegionMap::state(layout),
            layout.state_bytes,
            &states,
        ));
        tracing::error!(
            when,
            pages = ?held_pages,
            states = ?states.keys().collect::<Vec<_>>(),
            changed = %bytes.join("; "),
            "KV canary: pages (id, holders) and state slots changed that nobody wrote"
        );
        super::metrics::audit_violations(count);
        self.poisoned_pages.extend(
            held_pages
                .iter()
                .filter(|(_, refs)| *refs > 0)
                .map(|(p, _)| p),
        );
        self.poisoned_states.extend(states.into_keys());
    }
}

/// Overwrite the scribble's target with 0xA5 bytes straight through the backend (the
/// pool's [`Written`] set does not see it).
fn write_garbage<B: KvStorage>(
    backend: &B,
    pool: &mut DevicePool<B>,
    target: ScribbleTarget,
) -> BResult<()> {
    let layout = pool.layout().clone();
    match target {
        ScribbleTarget::Page(p) => {
            backend.write_page(&mut pool.store, p, &vec![0xA5; layout.page_bytes])
        }
        ScribbleTarget::State(s) => {
            backend.write_state(&mut pool.store, s, &vec![0xA5; layout.state_bytes])
        }
        ScribbleTarget::IndexK { page, layer, entry } => {
            let l = layout
                .layers
                .get(layer)
                .filter(|l| entry < l.index_entries_per_page)
                .ok_or_else(|| {
                    BackendError::Kv(format!("no index-K entry {entry} in layer {layer}"))
                })?;
            let width = layout.index_head_dim * layout.index_k_dtype.bytes();
            let at = l.index_page_offset + entry * width;
            let mut bytes = backend.page_bytes(&pool.store, page)?;
            bytes[at..at + width].fill(0xA5);
            backend.write_page(&mut pool.store, page, &bytes)
        }
    }
}

/// Pages and state slots a forward of `plan` may write: for each sequence, the pages
/// covering positions `[start, start + len)` and its state slot; each cut's state slot.
pub fn expected_writes(plan: &BatchPlan, page_tokens: usize) -> Written {
    let mut w = Written::default();
    // A cut's own state slot (its rings; it writes no page).
    w.states.extend(
        plan.cuts
            .iter()
            .flat_map(|c| c.seqs.iter().map(|s| s.state)),
    );
    for s in &plan.seqs {
        w.states.insert(s.state);
        if s.len == 0 {
            continue;
        }
        let first = s.start / page_tokens;
        let last = (s.start + s.len - 1) / page_tokens;
        w.pages
            .extend(s.pages.iter().take(last + 1).skip(first).copied());
    }
    w
}

/// Checksum sections per page and per state slot of `pool`'s layout.
fn per_region<B: KvStorage>(pool: &DevicePool<B>) -> (usize, usize) {
    let l = pool.layout();
    (sections(l.page_bytes), sections(l.state_bytes))
}

/// Ids (pages or slots of `per` checksum sections each) whose checksums changed from
/// `before` to `after`, outside `allowed`, each with its changed sections.
pub fn changed_outside(
    before: &[u64],
    after: &[u64],
    allowed: &BTreeSet<u32>,
    per: usize,
) -> Changed {
    let mut out = Changed::new();
    for (i, (x, y)) in before.iter().zip(after).enumerate() {
        let id = (i / per.max(1)) as u32;
        if x != y && !allowed.contains(&id) {
            out.entry(id).or_default().push(i % per.max(1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqPlan;

    #[test]
    fn expected_set_covers_exactly_the_written_positions() {
        let plan = BatchPlan {
            seqs: vec![
                SeqPlan {
                    start: 14,
                    len: 3,
                    row0: 0,
                    pages: vec![7, 3, 9],
                    state: 2,
                },
                SeqPlan {
                    start: 8,
                    len: 8,
                    row0: 3,
                    pages: vec![1, 5],
                    state: 0,
                },
            ],
            ..Default::default()
        };
        let w = expected_writes(&plan, 8);
        // 14..17 spans pages 1 and 2 of the first table; 8..16 only page 1 of the second.
        assert_eq!(w.pages.into_iter().collect::<Vec<_>>(), vec![3, 5, 9]);
        assert_eq!(w.states.into_iter().collect::<Vec<_>>(), vec![0, 2]);
    }

    #[test]
    fn changes_outside_the_allowed_set_are_reported() {
        let allowed = [1].into_iter().collect();
        let bad = changed_outside(&[1, 2, 3, 4], &[1, 9, 9, 4], &allowed, 1);
        assert_eq!(bad.into_iter().collect::<Vec<_>>(), vec![(2, vec![0])]);
        // Two sections per id: id 0's second and id 2's first section changed.
        let bad = changed_outside(&[1, 2, 3, 4, 5, 6], &[1, 7, 3, 4, 8, 6], &allowed, 2);
        assert_eq!(
            bad.into_iter().collect::<Vec<_>>(),
            vec![(0, vec![1]), (2, vec![0])]
        );
    }
}
