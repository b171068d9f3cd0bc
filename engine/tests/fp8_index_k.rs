//! fp8 e4m3 index-K (one fp32 scale per entry) on the reference fixtures: how far the
//! logits move from the one-shot reference, next to bf16.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use pdserve_engine::generate::logits_prefill_decode;
use pdserve_engine::kv::EntryDtype;

const TOL: f64 = 1e-4;

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
}

#[test]
fn fp8_index_k_stays_close_to_reference() {
    let mut results = Vec::new();
    for name in fixture_names() {
        let fx = load_fixture(&name);
        let k = fx.prefill_lens[fx.prefill_lens.len() / 2];
        for dtype in [EntryDtype::Fp8E4m3, EntryDtype::Bf16] {
            let mut eng = engine(&fx.dir, dtype, None);
            let got = logits_prefill_decode(&mut eng, &fx.tokens, k, 0).unwrap();
            let errs: Vec<f64> = got
                .iter()
                .zip(&fx.logits)
                .map(|(g, w)| rel_err(g, w))
                .collect();
            let n = errs.len() as f64;
            let exact = errs.iter().filter(|&&e| e < TOL).count() as f64 / n;
            let greedy = got
                .iter()
                .zip(&fx.logits)
                .filter(|(g, w)| argmax(g) == argmax(w))
                .count() as f64
                / n;
            let max = errs.iter().copied().fold(0.0, f64::max);
            let mean = errs.iter().sum::<f64>() / n;
            println!("{name} {dtype}: rel err max {max:.3e} mean {mean:.3e}, rows within {TOL:e}: {:.1}%, same greedy token: {:.1}%", exact * 100.0, greedy * 100.0);
            results.push((name.clone(), dtype, max, mean, exact, greedy));
        }
    }
    for (name, dtype, max, mean, exact, greedy) in results {
        match dtype {
            // Measured (prefill of the middle prefill length, then decode), fp8 rel err
            // max / mean: default_schedule 5.6e-2 / 1.7e-3, legacy 0.19 / 2.7e-2, mixed
            // 0.60 / 4.2e-2; greedy token agreement 100% / 94.7% / 95.6%. These models'
            // indexers keep 3-8 entries of 16-32 dims, so one e4m3 rounding often swaps a
            // near-tied pick and moves that row a lot (bf16 reaches 0.19 on legacy too).
            // At V4's real dims (128-dim keys, top-64 of 512) fp8 keeps 98% of the picks
            // (backend::cpu_attention::tests).
            EntryDtype::Fp8E4m3 => {
                assert!(mean < 6e-2, "{name} fp8: mean rel err {mean:.3e}");
                assert!(max < 0.9, "{name} fp8: max rel err {max:.3e}");
                assert!(greedy >= 0.9, "{name} fp8: greedy agreement {greedy:.3}");
            }
            _ => {
                assert!(
                    exact >= 0.5,
                    "{name} {dtype}: only {:.1}% of rows within {TOL:e}",
                    exact * 100.0
                );
                assert!(
                    greedy >= 0.9,
                    "{name} {dtype}: greedy agreement {greedy:.3}"
                );
            }
        }
    }
}
