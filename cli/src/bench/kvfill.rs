//! Random KV contents laid out by [`KvLayout`]: every region a step can read holds valid
//! values of its dtype (random normals; fp8 index-K keys with unit scales), so a decode
//! step at position `p` reads real-looking data without a `p`-token prefill.

use pdserve_engine::backend::counter_rng::{bits, value};
use pdserve_engine::backend::WeightInit;
use pdserve_engine::kv::fp8::f32_to_e4m3;
use pdserve_engine::kv::{EntryDtype, KvLayout};

const INIT: WeightInit = WeightInit::Normal {
    mean: 0.0,
    std: 1.0,
};

/// Write `n` values of `dtype` at `off` (fp8: codes only).
fn fill(buf: &mut [u8], off: usize, n: usize, dtype: EntryDtype, seed: u64) {
    let w = dtype.bytes();
    for i in 0..n {
        let v = value(INIT, seed, i as u64);
        let at = off + i * w;
        match dtype {
            EntryDtype::F32 => buf[at..at + 4].copy_from_slice(&v.to_le_bytes()),
            EntryDtype::Bf16 => {
                buf[at..at + 2].copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes())
            }
            EntryDtype::Fp8E4m3 => buf[at] = f32_to_e4m3(v),
        }
    }
}

/// One random page (`variant` picks among distinct contents).
pub fn page(layout: &KvLayout, variant: u64) -> Vec<u8> {
    let mut buf = vec![0u8; layout.page_bytes];
    for (li, l) in layout.layers.iter().enumerate() {
        let seed = bits(variant, li as u64 * 4);
        fill(
            &mut buf,
            l.comp_page_offset,
            l.comp_entries_per_page * layout.head_dim,
            layout.kv_dtype,
            seed,
        );
        if l.index_entries_per_page > 0 {
            let n = l.index_entries_per_page * layout.index_head_dim;
            fill(
                &mut buf,
                l.index_page_offset,
                n,
                layout.index_k_dtype,
                seed ^ 1,
            );
            if layout.index_k_dtype.scale_bytes() > 0 {
                for s in 0..l.index_entries_per_page {
                    let (_, Some(at)) = layout.index_entry_offsets(l, s) else {
                        continue;
                    };
                    buf[at..at + 4].copy_from_slice(&(1.0f32 / 64.0).to_le_bytes());
                }
            }
        }
    }
    buf
}

/// One random state slot: window rings in the KV dtype, compressor rings in fp32.
pub fn state(layout: &KvLayout, variant: u64) -> Vec<u8> {
    let mut buf = vec![0u8; layout.state_bytes];
    for (li, l) in layout.layers.iter().enumerate() {
        let seed = bits(variant ^ 0x5eed, li as u64 * 4);
        let window = layout.sliding_window * layout.head_dim;
        fill(
            &mut buf,
            l.window_state_offset,
            window,
            layout.kv_dtype,
            seed,
        );
        let comp = l.comp_ring_slots * l.comp_row_floats();
        fill(
            &mut buf,
            l.comp_state_offset,
            comp,
            EntryDtype::F32,
            seed ^ 1,
        );
        let idx = l.index_ring_slots * l.index_row_floats();
        fill(
            &mut buf,
            l.index_state_offset,
            idx,
            EntryDtype::F32,
            seed ^ 2,
        );
    }
    buf
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::config::ModelFlags;

    #[test]
    fn every_entry_region_is_filled_with_finite_values() {
        for (kv, idx) in [("f32", "f32"), ("bf16", "bf16"), ("bf16", "fp8")] {
            let f = ModelFlags {
                device: "cpu".into(),
                layers: 4,
                experts: 4,
                tiny: true,
                seed: 0,
                kv_dtype: kv.into(),
                index_k_dtype: idx.into(),
                cuda_weights: "bf16".into(),
                weights: "bf16".into(),
                deterministic: false,
            };
            let cfg = f.config().unwrap();
            let layout = f.layout(&cfg).unwrap();
            let p = page(&layout, 1);
            assert_eq!(p.len(), layout.page_bytes);
            assert_ne!(p, page(&layout, 2));
            let l = &layout.layers[2]; // CSA
            let e = layout.kv_dtype.bytes();
            let region = &p[l.comp_page_offset
                ..l.comp_page_offset + l.comp_entries_per_page * layout.head_dim * e];
            // No all-zero value in the compressed region, and every value finite.
            for v in region.chunks(e) {
                let x = match layout.kv_dtype {
                    EntryDtype::F32 => f32::from_le_bytes(v.try_into().unwrap()),
                    _ => half::bf16::from_bits(u16::from_le_bytes(v.try_into().unwrap())).to_f32(),
                };
                assert!(x.is_finite() && x != 0.0, "{x}");
            }
            let s = state(&layout, 1);
            assert_eq!(s.len(), layout.state_bytes);
            let ring = &s[l.comp_state_offset
                ..l.comp_state_offset + l.comp_ring_slots * l.comp_row_floats() * 4];
            assert!(ring
                .chunks(4)
                .all(|c| f32::from_le_bytes(c.try_into().unwrap()).is_finite()));
            assert!(ring.iter().any(|&b| b != 0));
        }
    }
}
