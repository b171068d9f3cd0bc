//! Random KV contents laid out by [`KvLayout`]: every region a step can read holds valid
//! values of its dtype (random normals; fp8 index-K keys with unit scales, fp8 KV entries
//! quantized as the engine stores them), so a decode
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

/// Write `n` compressed-KV / window entries of the layout's KV dtype: rows from `rows`,
/// fp8 scales (FlashMLA's V4 entries, [`KvLayout::fp8_kv_format`]) from `scales`.
fn fill_kv(buf: &mut [u8], layout: &KvLayout, (rows, scales): (usize, usize), n: usize, seed: u64) {
    let Some(f) = layout.fp8_kv_format() else {
        fill(buf, rows, n * layout.head_dim, layout.kv_dtype, seed);
        return;
    };
    let hd = layout.head_dim;
    let mut vals = vec![0f32; hd];
    for e in 0..n {
        for (j, v) in vals.iter_mut().enumerate() {
            *v = value(INIT, seed, (e * hd + j) as u64);
        }
        let (row, Some(sc)) = layout.kv_entry_offsets(rows, scales, e) else {
            continue;
        };
        let mut scale_buf = vec![0u8; f.scale_bytes()];
        f.encode(&vals, &mut buf[row..row + f.row_bytes()], &mut scale_buf);
        buf[sc..sc + f.scale_bytes()].copy_from_slice(&scale_buf);
    }
}

/// One random page (`variant` picks among distinct contents).
pub fn page(layout: &KvLayout, variant: u64) -> Vec<u8> {
    let mut buf = vec![0u8; layout.page_bytes];
    for (li, l) in layout.layers.iter().enumerate() {
        let seed = bits(variant, li as u64 * 4);
        let comp = (l.comp_page_offset, l.comp_scale_offset);
        fill_kv(&mut buf, layout, comp, l.comp_entries_per_page, seed);
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
        let window = (l.window_state_offset, l.window_scale_offset);
        fill_kv(&mut buf, layout, window, layout.sliding_window, seed);
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
        for (kv, idx) in [
            ("f32", "f32"),
            ("bf16", "bf16"),
            ("bf16", "fp8"),
            ("fp8", "fp8"),
        ] {
            let f = ModelFlags {
                device: "cpu".into(),
                layers: 4,
                experts: 4,
                tiny: true,
                seed: 0,
                kv_dtype: kv.into(),
                index_k_dtype: idx.into(),
                numerics: "transformers".into(),
                cuda_weights: "bf16".into(),
                weights: vec!["bf16".into()],
                deterministic: false,
                attention: "auto".into(),
                expert_kernel: "auto".into(),
                dense_kernel: "auto".into(),
                expert_lanes: pdserve_kernels::DEFAULT_LANES,
                no_pdl: false,
                indexer: "auto".into(),
            };
            let cfg = f.config().unwrap();
            let layout = f.layout(&cfg).unwrap();
            let p = page(&layout, 1);
            assert_eq!(p.len(), layout.page_bytes);
            assert_ne!(p, page(&layout, 2));
            let l = &layout.layers[2]; // CSA
            if let Some(f) = layout.fp8_kv_format() {
                // Every entry decodes to finite values, none all zero.
                let mut vals = vec![0f32; layout.head_dim];
                for slot in 0..l.comp_entries_per_page {
                    let (row, sc) =
                        layout.kv_entry_offsets(l.comp_page_offset, l.comp_scale_offset, slot);
                    let sc = sc.unwrap();
                    f.decode(
                        &p[row..row + f.row_bytes()],
                        &p[sc..sc + f.scale_bytes()],
                        &mut vals,
                    );
                    assert!(vals.iter().all(|v| v.is_finite()) && vals.iter().any(|&v| v != 0.0));
                }
                continue;
            }
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
