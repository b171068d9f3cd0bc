//! The KV canary (`--kv-audit`, `--kv-audit-every`): a write that bypasses every known
//! writer, into one sequence's page, index-K entry or state slot, fails exactly that
//! sequence within one audited step, and the others' logits stay bitwise those of a run
//! without the canary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::result_large_err)]

mod common;

use common::*;
use pdserve_engine::config::LayerKind;
use pdserve_engine::generate::prefill;
use pdserve_engine::kv::audit::{Scribble, ScribbleTarget};
use pdserve_engine::kv::EntryDtype;
use pdserve_engine::{CpuBackend, Engine, EngineError, ForwardItem, Logits, Sequence};

/// Three sequences of different lengths (the first spans two pages).
fn start(eng: &mut Engine<CpuBackend>, tokens: &[u32], p: usize) -> Vec<Sequence> {
    [2 * p + 1, p + 3, 5]
        .iter()
        .map(|&n| {
            let mut s = eng.new_sequence().unwrap();
            prefill(eng, &mut s, &tokens[..n], 0, Logits::None).unwrap();
            s
        })
        .collect()
}

/// One batched decode step of every sequence on token `t`.
fn step(
    eng: &mut Engine<CpuBackend>,
    seqs: &mut [Sequence],
    t: u32,
) -> Vec<Result<Vec<f32>, EngineError>> {
    let toks = vec![t; seqs.len()];
    let mut items: Vec<ForwardItem<'_>> = seqs
        .iter_mut()
        .zip(&toks)
        .map(|(s, t)| ForwardItem {
            seq: s,
            tokens: std::slice::from_ref(t),
            logits: Logits::Last,
        })
        .collect();
    eng.forward_each(&mut items)
        .unwrap()
        .into_iter()
        .map(|r| r.map(|o| o.logits.data))
        .collect()
}

#[test]
fn a_scribble_fails_only_its_owner_within_one_audited_step() {
    let fx = load_fixture("mixed");
    let p = smallest_page_tokens(&fx.dir);
    let csa = {
        let probe = engine_sized(&fx.dir, EntryDtype::F32, p, 32);
        probe
            .layout()
            .layers
            .iter()
            .position(|l| l.kind == LayerKind::Csa)
            .expect("the mixed fixture has a CSA layer")
    };
    for every in [1u32, 3] {
        for kind in ["page", "index-k", "state"] {
            let mut eng = engine_sized(&fx.dir, EntryDtype::F32, p, 32);
            let mut plain = engine_sized(&fx.dir, EntryDtype::F32, p, 32);
            eng.set_kv_audit_every(every);
            let mut seqs = start(&mut eng, &fx.tokens, p);
            let mut twins = start(&mut plain, &fx.tokens, p);
            for t in 0..4 {
                for (got, want) in step(&mut eng, &mut seqs, t)
                    .into_iter()
                    .zip(step(&mut plain, &mut twins, t))
                {
                    assert_eq!(
                        got.unwrap(),
                        want.unwrap(),
                        "{kind} every {every}: clean step {t}"
                    );
                }
            }
            let victim = &seqs[0];
            let target = match kind {
                "page" => ScribbleTarget::Page(victim.kv().pages[0]),
                "index-k" => ScribbleTarget::IndexK {
                    page: victim.kv().pages[1],
                    layer: csa,
                    entry: 0,
                },
                _ => ScribbleTarget::State(victim.kv().state),
            };
            eng.debug_scribble(Scribble {
                target,
                in_step: false,
            });
            let mut caught_at = None;
            for t in 4..4 + 2 * every + 1 {
                let got = step(&mut eng, &mut seqs, t);
                let want = step(&mut plain, &mut twins, t);
                for (i, (g, w)) in got.iter().zip(&want).enumerate().skip(1) {
                    assert_eq!(
                        g.as_ref().unwrap(),
                        w.as_ref().unwrap(),
                        "{kind} every {every}: seq {i} step {t}"
                    );
                }
                if let Err(e) = &got[0] {
                    assert!(matches!(e, EngineError::KvAudit { .. }), "{e}");
                    caught_at.get_or_insert(t);
                }
            }
            // Planted after step 4, found by the next audited step: at most `every` later.
            let at = caught_at.unwrap_or_else(|| panic!("{kind} every {every}: not caught"));
            assert!(at <= 4 + every, "{kind} every {every}: caught at step {at}");
            // Its owner stays failed; freeing it clears the mark and the pool is clean again.
            assert!(eng.kv_fault(&seqs[0]).is_some());
            assert!(eng.kv_fault(&seqs[1]).is_none());
            let victim = seqs.remove(0);
            eng.release(victim).unwrap();
            twins.remove(0);
            for t in 20..20 + every {
                for r in step(&mut eng, &mut seqs, t) {
                    r.unwrap();
                }
            }
        }
    }
}

#[test]
fn cpu_checksums_match_the_definition_page_by_page() {
    use pdserve_engine::backend::KvStorage;
    use pdserve_engine::kv::checksum::{section_checksums, sections};
    let fx = load_fixture("mixed");
    let p = smallest_page_tokens(&fx.dir);
    let mut eng = engine_sized(&fx.dir, EntryDtype::Bf16, p, 8);
    let seqs = start(&mut eng, &fx.tokens, p);
    let pool = eng.device_pool();
    let pages = eng.backend().page_checksums(pool.store()).unwrap();
    let states = eng.backend().state_checksums(pool.store()).unwrap();
    let per_page = sections(pool.layout().page_bytes);
    assert_eq!(pages.len(), 8 * per_page);
    for (pg, sums) in pages.chunks(per_page).enumerate() {
        assert_eq!(
            sums,
            section_checksums(&pool.read_page(eng.backend(), pg as u32).unwrap())
        );
    }
    let per_state = sections(pool.layout().state_bytes);
    for (s, sums) in states.chunks(per_state).enumerate() {
        assert_eq!(
            sums,
            section_checksums(&pool.read_state(eng.backend(), s as u32).unwrap())
        );
    }
    drop(seqs);
}
