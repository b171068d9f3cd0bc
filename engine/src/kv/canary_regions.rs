//! What the bytes of a page or state slot hold, for the KV canary's violation log: a
//! changed checksum section ([`super::checksum::sections`]) is reported as the layout
//! regions it overlaps ("layer 3 index-K +0..1024"), so an operator sees which layer's
//! compressed KV, index-K, window ring or compressor ring was written, not just a page id.

use super::KvLayout;
use std::ops::Range;

/// Named regions of a page or state slot, by start offset; each runs to the next start.
pub struct RegionMap {
    starts: Vec<(usize, String)>,
    total: usize,
}

impl RegionMap {
    fn new(mut starts: Vec<(usize, String)>, total: usize) -> Self {
        starts.sort_by_key(|s| s.0);
        // Regions that start at the same offset (an empty one before its neighbour) are
        // named together.
        let mut merged: Vec<(usize, String)> = Vec::with_capacity(starts.len());
        for (at, name) in starts {
            match merged.last_mut() {
                Some(last) if last.0 == at => {
                    last.1.push('/');
                    last.1.push_str(&name);
                }
                _ => merged.push((at, name)),
            }
        }
        RegionMap {
            starts: merged,
            total,
        }
    }

    /// The regions of a page: per layer, its compressed-KV and index-K entries.
    pub fn page(layout: &KvLayout) -> Self {
        let mut starts = Vec::new();
        for (li, l) in layout.layers.iter().enumerate() {
            if l.comp_entries_per_page > 0 {
                starts.push((l.comp_page_offset, format!("layer {li} compressed KV")));
            }
            if l.index_entries_per_page > 0 {
                starts.push((l.index_page_offset, format!("layer {li} index-K")));
            }
        }
        RegionMap::new(starts, layout.page_bytes)
    }

    /// The regions of a state slot: per layer, its window ring and compressor rings.
    pub fn state(layout: &KvLayout) -> Self {
        let mut starts = Vec::new();
        for (li, l) in layout.layers.iter().enumerate() {
            starts.push((l.window_state_offset, format!("layer {li} window ring")));
            if l.comp_ring_slots > 0 {
                starts.push((l.comp_state_offset, format!("layer {li} compressor ring")));
            }
            if l.index_ring_slots > 0 {
                starts.push((
                    l.index_state_offset,
                    format!("layer {li} indexer compressor ring"),
                ));
            }
        }
        RegionMap::new(starts, layout.state_bytes)
    }

    /// `bytes` as the regions it overlaps, each with the offsets inside it.
    pub fn describe(&self, bytes: Range<usize>) -> String {
        let mut parts = Vec::new();
        let head = self.starts.first().map_or(self.total, |s| s.0);
        if bytes.start < head {
            parts.push(format!("header +{}..{}", bytes.start, bytes.end.min(head)));
        }
        for (i, (at, name)) in self.starts.iter().enumerate() {
            let end = self.starts.get(i + 1).map_or(self.total, |s| s.0);
            let (lo, hi) = (bytes.start.max(*at), bytes.end.min(end));
            if lo < hi {
                parts.push(format!("{name} +{}..{}", lo - at, hi - at));
            }
        }
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_named_by_the_regions_it_overlaps() {
        let map = RegionMap::new(
            vec![
                (1024, "layer 1 index-K".into()),
                (0, "layer 0 compressed KV".into()),
                (3072, "layer 2 compressed KV".into()),
                (3072, "layer 2 index-K".into()),
            ],
            4096,
        );
        assert_eq!(map.describe(0..1024), "layer 0 compressed KV +0..1024");
        assert_eq!(
            map.describe(512..2048),
            "layer 0 compressed KV +512..1024, layer 1 index-K +0..1024"
        );
        assert_eq!(
            map.describe(3072..4096),
            "layer 2 compressed KV/layer 2 index-K +0..1024"
        );
        let late = RegionMap::new(vec![(256, "layer 0 window ring".into())], 512);
        assert_eq!(
            late.describe(0..512),
            "header +0..256, layer 0 window ring +0..256"
        );
    }
}
