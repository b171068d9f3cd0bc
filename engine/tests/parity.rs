//! Prefill + decode logits against the transformers one-shot reference (fixtures made
//! by scripts/gen_fixtures.py), and invariance under chunking and batching.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use pdserve_engine::generate::{logits_prefill_decode, prefill};
use pdserve_engine::kv::EntryDtype;
use pdserve_engine::{ForwardItem, Logits};

const TOL: f64 = 1e-4;

#[test]
fn prefill_then_decode_matches_reference() {
    for name in fixture_names() {
        let fx = load_fixture(&name);
        let mut eng = engine(&fx.dir, EntryDtype::F32, None);
        for &k in &fx.prefill_lens {
            let got = logits_prefill_decode(&mut eng, &fx.tokens, k, 0).unwrap();
            let (err, row) = max_rel_err(&got, &fx.logits);
            println!(
                "{name}: prefill {k} + {} decode steps: max rel err {err:.3e} (row {row})",
                fx.tokens.len() - k
            );
            assert!(
                err < TOL,
                "{name} prefill {k}: rel err {err:.3e} at row {row}"
            );
        }
        assert_eq!(
            eng.allocator().free_page_count(),
            eng.allocator().total_pages(),
            "{name}: pages leaked"
        );
    }
}

/// bf16 index-K changes only the indexer's scores; where two candidates are closer than
/// bf16 rounding, a different entry gets picked (as in every serving system that stores
/// index-K below fp32). Measure how far that moves the logits on the fixtures.
#[test]
fn bf16_index_k_stays_close_to_reference() {
    for name in fixture_names() {
        let fx = load_fixture(&name);
        let mut eng = engine(&fx.dir, EntryDtype::Bf16, None);
        let k = fx.prefill_lens[0];
        let got = logits_prefill_decode(&mut eng, &fx.tokens, k, 0).unwrap();
        let errs: Vec<f64> = got
            .iter()
            .zip(&fx.logits)
            .map(|(g, w)| rel_err(g, w))
            .collect();
        let exact = errs.iter().filter(|&&e| e < TOL).count() as f64 / errs.len() as f64;
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
        };
        let same_greedy = got
            .iter()
            .zip(&fx.logits)
            .filter(|(g, w)| argmax(g) == argmax(w))
            .count() as f64
            / errs.len() as f64;
        let max = errs.iter().copied().fold(0.0, f64::max);
        println!("{name}: bf16 index-K: max rel err {max:.3e}, rows within {TOL:e}: {:.1}%, same greedy token: {:.1}%", exact * 100.0, same_greedy * 100.0);
        assert!(
            exact >= 0.5,
            "{name}: only {:.1}% of rows within {TOL:e}",
            exact * 100.0
        );
        assert!(
            same_greedy >= 0.9,
            "{name}: greedy token differs on {:.1}% of rows",
            (1.0 - same_greedy) * 100.0
        );
    }
}

#[test]
fn every_chunking_gives_identical_logits() {
    for name in fixture_names() {
        let fx = load_fixture(&name);
        let n = fx.tokens.len();
        // Small pages so sequences span many of them.
        let cfg = pdserve_engine::config::ModelConfig::from_model_dir(&fx.dir).unwrap();
        let page = pdserve_engine::kv::KvLayoutSpec::default_for(&cfg).page_tokens;
        for dtype in [EntryDtype::F32, EntryDtype::Bf16] {
            let mut eng = engine(
                &fx.dir,
                dtype,
                Some(page.min(cfg.compress_rate_hca.max(cfg.compress_rate_csa))),
            );
            let mut reference: Option<Vec<Vec<f32>>> = None;
            for chunk in [0, 1, 2, 3, 5, 8, 13, 64] {
                let mut seq = eng.new_sequence().unwrap();
                let rows = prefill(&mut eng, &mut seq, &fx.tokens, chunk, Logits::All).unwrap();
                eng.release(seq).unwrap();
                assert_eq!(rows.len(), n);
                match &reference {
                    None => {
                        let (err, _) = max_rel_err(&rows, &fx.logits);
                        assert!(
                            dtype != EntryDtype::F32 || err < TOL,
                            "{name}: whole-prompt prefill rel err {err:.3e}"
                        );
                        reference = Some(rows);
                    }
                    Some(r) => assert!(
                        rows == *r,
                        "{name} ({dtype}): chunk size {chunk} changed the logits"
                    ),
                }
            }
        }
    }
}

#[test]
fn ragged_batch_equals_each_request_alone() {
    for name in fixture_names() {
        let fx = load_fixture(&name);
        let mut eng = engine(&fx.dir, EntryDtype::F32, None);
        let n = fx.tokens.len();
        // Three requests: different prompts (rotations of the fixture tokens), lengths and phases.
        let prompts: Vec<Vec<u32>> = vec![
            fx.tokens.clone(),
            fx.tokens[n / 3..].to_vec(),
            fx.tokens.iter().rev().take(n / 2 + 7).copied().collect(),
        ];
        let alone: Vec<Vec<Vec<f32>>> = prompts
            .iter()
            .map(|p| logits_prefill_decode(&mut eng, p, p.len() / 2 + 1, 0).unwrap())
            .collect();
        // Batched: every step, each unfinished request feeds its prefill chunk (first step)
        // or its next decode token, all in one forward.
        let mut seqs: Vec<_> = prompts
            .iter()
            .map(|_| eng.new_sequence().unwrap())
            .collect();
        let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
        let mut fed = vec![0usize; prompts.len()];
        // Stagger: request i starts at step i.
        for step in 0.. {
            let mut items = Vec::new();
            let mut who = Vec::new();
            for (i, seq) in seqs.iter_mut().enumerate() {
                let p = &prompts[i];
                if step < i || fed[i] == p.len() {
                    continue;
                }
                let take = if fed[i] == 0 { p.len() / 2 + 1 } else { 1 };
                items.push(ForwardItem {
                    seq,
                    tokens: &p[fed[i]..fed[i] + take],
                    logits: Logits::All,
                });
                who.push((i, take));
            }
            if items.is_empty() {
                break;
            }
            let out = eng.forward(&mut items).unwrap();
            for ((i, take), t) in who.into_iter().zip(out) {
                fed[i] += take;
                got[i].extend(t.data.chunks(t.cols).map(<[f32]>::to_vec));
            }
        }
        for seq in seqs {
            eng.release(seq).unwrap();
        }
        for i in 0..prompts.len() {
            assert!(got[i] == alone[i], "{name}: request {i} differs in a batch");
        }
        let (err, _) = max_rel_err(&alone[0], &fx.logits);
        assert!(err < TOL, "{name}: rel err {err:.3e}");
    }
}

/// Prefill in one engine, move the KV state as bytes into another, decode there: the
/// logits equal a single-engine run (what prefill -> decode transfer relies on).
#[test]
fn exported_state_continues_identically_in_another_engine() {
    let fx = load_fixture("legacy");
    let k = 133;
    let mut single = engine(&fx.dir, EntryDtype::F32, None);
    let want = logits_prefill_decode(&mut single, &fx.tokens, k, 0).unwrap();

    let mut p = engine(&fx.dir, EntryDtype::F32, None);
    let mut d = engine(&fx.dir, EntryDtype::F32, None);
    let mut seq = p.new_sequence().unwrap();
    let mut got = prefill(&mut p, &mut seq, &fx.tokens[..k], 0, Logits::All).unwrap();
    let snap = p.export_sequence(&seq).unwrap();
    p.release(seq).unwrap();
    assert_eq!(snap.pages.len(), d.layout().pages_for(k));
    // Occupy some pages first so the imported sequence lands on different page ids.
    let filler = d.new_sequence().unwrap();
    let mut moved = d.import_sequence(&snap).unwrap();
    assert_eq!(moved.len(), k);
    for t in &fx.tokens[k..] {
        let out = d
            .forward(&mut [ForwardItem {
                seq: &mut moved,
                tokens: std::slice::from_ref(t),
                logits: Logits::Last,
            }])
            .unwrap();
        got.push(out[0].data.clone());
    }
    assert!(got == want);
    d.release(moved).unwrap();
    d.release(filler).unwrap();

    let mut other = engine(&fx.dir, EntryDtype::Bf16, None);
    let err = other.import_sequence(&snap).unwrap_err().to_string();
    assert!(err.contains("layout"), "{err}");
}
