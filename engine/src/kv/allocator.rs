//! [`KvAllocator`]: hands out a pool's page ids and state slots. Storage lives in the
//! backend; this only decides which ids are free, and counts references so a shared
//! page is freed once.

use super::layout::{PageId, StateSlot};

/// One request's KV handle: its page table and its state slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqKv {
    pub pages: Vec<PageId>,
    pub state: StateSlot,
    /// Positions already written (the next token's position).
    pub len: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("KV pool exhausted: asked for {asked} pages, {free} of {total} free")]
    PagesExhausted {
        asked: usize,
        free: usize,
        total: usize,
    },
    #[error("KV pool exhausted: no free state slot ({total} in use)")]
    StatesExhausted { total: usize },
    #[error("page {0} freed while not allocated")]
    DoubleFreePage(PageId),
    #[error("state slot {0} freed while not allocated")]
    DoubleFreeState(StateSlot),
}

/// Allocator of a pool's token pages (reference counted) and state slots.
#[derive(Debug)]
pub struct KvAllocator {
    refcount: Vec<u32>,
    free_pages: Vec<PageId>,
    state_used: Vec<bool>,
    free_states: Vec<StateSlot>,
}

impl KvAllocator {
    pub fn new(pages: usize, states: usize) -> Self {
        KvAllocator {
            refcount: vec![0; pages],
            // Pop from the end: hand out low ids first.
            free_pages: (0..pages as PageId).rev().collect(),
            state_used: vec![false; states],
            free_states: (0..states as StateSlot).rev().collect(),
        }
    }

    pub fn total_pages(&self) -> usize {
        self.refcount.len()
    }

    /// References held on `page` (0: free or out of range).
    pub fn refcount(&self, page: PageId) -> u32 {
        self.refcount.get(page as usize).copied().unwrap_or(0)
    }

    pub fn free_page_count(&self) -> usize {
        self.free_pages.len()
    }

    pub fn total_states(&self) -> usize {
        self.state_used.len()
    }

    pub fn free_state_count(&self) -> usize {
        self.free_states.len()
    }

    /// All or nothing: either `n` pages or an error with nothing taken.
    pub fn alloc_pages(&mut self, n: usize) -> Result<Vec<PageId>, PoolError> {
        if n > self.free_pages.len() {
            return Err(PoolError::PagesExhausted {
                asked: n,
                free: self.free_pages.len(),
                total: self.refcount.len(),
            });
        }
        let at = self.free_pages.len() - n;
        let pages: Vec<PageId> = self.free_pages.split_off(at).into_iter().rev().collect();
        for &p in &pages {
            self.refcount[p as usize] = 1;
        }
        Ok(pages)
    }

    /// Add a reference to pages already allocated (a shared prefix).
    pub fn retain_pages(&mut self, pages: &[PageId]) -> Result<(), PoolError> {
        for &p in pages {
            match self.refcount.get_mut(p as usize) {
                Some(rc) if *rc > 0 => *rc += 1,
                _ => return Err(PoolError::DoubleFreePage(p)),
            }
        }
        Ok(())
    }

    pub fn release_pages(&mut self, pages: &[PageId]) -> Result<(), PoolError> {
        for &p in pages {
            match self.refcount.get_mut(p as usize) {
                Some(rc) if *rc > 0 => {
                    *rc -= 1;
                    if *rc == 0 {
                        self.free_pages.push(p);
                    }
                }
                _ => return Err(PoolError::DoubleFreePage(p)),
            }
        }
        Ok(())
    }

    pub fn alloc_state(&mut self) -> Result<StateSlot, PoolError> {
        let s = self.free_states.pop().ok_or(PoolError::StatesExhausted {
            total: self.state_used.len(),
        })?;
        self.state_used[s as usize] = true;
        Ok(s)
    }

    pub fn release_state(&mut self, s: StateSlot) -> Result<(), PoolError> {
        match self.state_used.get_mut(s as usize) {
            Some(used) if *used => {
                *used = false;
                self.free_states.push(s);
                Ok(())
            }
            _ => Err(PoolError::DoubleFreeState(s)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn alloc_release_roundtrip_and_errors() {
        let mut p = KvAllocator::new(4, 2);
        let a = p.alloc_pages(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert!(matches!(
            p.alloc_pages(2),
            Err(PoolError::PagesExhausted {
                asked: 2,
                free: 1,
                total: 4
            })
        ));
        assert_eq!(p.free_page_count(), 1);
        p.retain_pages(&a[..1]).unwrap();
        p.release_pages(&a).unwrap();
        assert_eq!(p.free_page_count(), 3);
        p.release_pages(&a[..1]).unwrap();
        assert_eq!(p.free_page_count(), 4);
        assert_eq!(p.release_pages(&[0]), Err(PoolError::DoubleFreePage(0)));
        let s0 = p.alloc_state().unwrap();
        let _s1 = p.alloc_state().unwrap();
        assert!(p.alloc_state().is_err());
        p.release_state(s0).unwrap();
        assert_eq!(p.release_state(s0), Err(PoolError::DoubleFreeState(s0)));
    }
}
