//! Prefix cache (device and host tiers) against cold runs, the write audit, KV metrics,
//! and pools of different layouts refusing each other.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use pdserve_engine::generate::prefill;
use pdserve_engine::kv::{EntryDtype, HostPool, KvLayout, KvLayoutSpec, PrefixCache};
use pdserve_engine::{CpuBackend, Engine, EngineError, ForwardItem, Logits};

/// Logits of every prompt position, then of `decode` greedy-free continuation tokens.
fn cold(eng: &mut Engine<CpuBackend>, prompt: &[u32], decode: &[u32]) -> Vec<Vec<f32>> {
    let mut seq = eng.new_sequence().unwrap();
    let mut rows = prefill(eng, &mut seq, prompt, 0, Logits::All).unwrap();
    rows.extend(decode_steps(eng, &mut seq, decode));
    eng.release(seq).unwrap();
    rows
}

fn decode_steps(
    eng: &mut Engine<CpuBackend>,
    seq: &mut pdserve_engine::Sequence,
    decode: &[u32],
) -> Vec<Vec<f32>> {
    decode
        .iter()
        .map(|t| {
            let out = eng
                .forward(&mut [ForwardItem {
                    seq: &mut *seq,
                    tokens: std::slice::from_ref(t),
                    logits: Logits::Last,
                }])
                .unwrap();
            out[0].data.clone()
        })
        .collect()
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// `base[..share]` then a tail that differs from `base` right after the shared part.
fn prompt(base: &[u32], share: usize, tail: usize, vocab: u32) -> Vec<u32> {
    let mut p = base[..share].to_vec();
    p.extend((0..tail).map(|i| 2 + (base[share + i] + 1 + i as u32) % (vocab - 2)));
    p
}

/// Fixture `name`, its smallest page size, and two engines on it with f32 KV in 64 pages
/// of that size: one for cold runs, one to put behind a prefix cache.
fn cache_engines(name: &str) -> (Fixture, usize, Engine<CpuBackend>, Engine<CpuBackend>) {
    let fx = load_fixture(name);
    let p = smallest_page_tokens(&fx.dir);
    let cold = engine_sized(&fx.dir, EntryDtype::F32, p, 64);
    let eng = engine_sized(&fx.dir, EntryDtype::F32, p, 64);
    (fx, p, cold, eng)
}

#[test]
fn prefix_hits_are_bit_identical_to_cold_runs() {
    for name in fixture_names() {
        let (fx, p, mut coldeng, mut eng) = cache_engines(&name);
        let vocab = fx.logits[0].len() as u32;
        let n = fx.tokens.len();
        // The audit also proves no step writes a shared (cached) page.
        eng.set_kv_audit(true);
        let host = HostPool::new(eng.layout(), 128);
        let mut cache = PrefixCache::new(&eng, host).unwrap();
        // Warm the cache with the longest prompt the shares below can use.
        let longest = n - 4;
        let warm = cache
            .prefill(&mut eng, &fx.tokens[..longest], 0, Logits::Last)
            .unwrap();
        assert_eq!(warm.hit_tokens, 0);
        eng.release(warm.seq).unwrap();
        let decode = &fx.tokens[n - 3..];
        let shares: Vec<usize> = [1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 2, longest - 1]
            .into_iter()
            .filter(|&s| s + 3 <= longest)
            .collect();
        for &share in &shares {
            let pr = prompt(&fx.tokens, share, 3, vocab);
            let want = cold(&mut coldeng, &pr, decode);
            let got = cache.prefill(&mut eng, &pr, 0, Logits::All).unwrap();
            let mut seq = got.seq;
            let expect_hit = (share / p) * p;
            assert_eq!(got.hit_tokens, expect_hit, "{name}: share {share}");
            assert_eq!(got.host_hit_tokens, 0);
            let mut rows = got.logits;
            rows.extend(decode_steps(&mut eng, &mut seq, decode));
            assert!(
                bits(&rows) == bits(&want[expect_hit..]),
                "{name}: share {share} (hit {expect_hit}) differs from a cold run"
            );
            eng.release(seq).unwrap();
            cache.verify(&eng).unwrap();
        }
        println!("{name}: page {p}, device-tier hits bit-identical for shares {shares:?}");

        // Push everything to the host tier, then hit it.
        while cache.evict_one_device(&mut eng).unwrap() {}
        let st = cache.stats();
        assert_eq!(st.device_pages, 0);
        assert!(st.host_pages > 0);
        assert_eq!(
            eng.allocator().free_page_count(),
            eng.allocator().total_pages()
        );
        let share = longest - 2;
        let pr = prompt(&fx.tokens, share, 2, vocab);
        let want = cold(&mut coldeng, &pr, decode);
        let got = cache.prefill(&mut eng, &pr, 7, Logits::All).unwrap();
        let expect_hit = (share / p) * p;
        assert_eq!(got.hit_tokens, expect_hit, "{name}: host share {share}");
        assert_eq!(got.host_hit_tokens, expect_hit);
        let mut seq = got.seq;
        let mut rows = got.logits;
        rows.extend(decode_steps(&mut eng, &mut seq, decode));
        assert!(
            bits(&rows) == bits(&want[expect_hit..]),
            "{name}: host-tier hit differs from a cold run"
        );
        eng.release(seq).unwrap();
        cache.verify(&eng).unwrap();
        println!("{name}: host-tier hit of {expect_hit} tokens bit-identical");

        cache.clear(&mut eng).unwrap();
        assert_eq!(
            eng.allocator().free_page_count(),
            eng.allocator().total_pages()
        );
        assert_eq!(cache.host().used_pages(), 0);
    }
}

/// A server's deferred cut points (`set_defer_final_cuts`): the prompt's last forward's
/// cut points are not in the tree when the prefill returns, survive the sequence's
/// release, go in at `finish_pending` (or at the next prefill, before its lookup), and
/// hits on them are bit-identical to cold runs; `clear` with some pending frees all.
#[test]
fn deferred_cut_points_are_cached_after_the_answer() {
    for name in fixture_names() {
        let (fx, p, mut coldeng, mut eng) = cache_engines(&name);
        let vocab = fx.logits[0].len() as u32;
        let n = fx.tokens.len();
        let (pages0, states0) = (
            eng.allocator().free_page_count(),
            eng.allocator().free_state_count(),
        );
        let mut cache = PrefixCache::new(&eng, HostPool::new(eng.layout(), 128)).unwrap();
        cache.set_defer_final_cuts(true);
        let longest = n - 4;
        // Chunks of 2 pages + 1: the cut points of the earlier forwards go in at once.
        let chunk = 2 * p + 1;
        let warm = cache
            .prefill(&mut eng, &fx.tokens[..longest], chunk, Logits::Last)
            .unwrap();
        let before = cache.stats().nodes;
        assert!(
            before <= longest / p,
            "{name}: {before} nodes before the answer"
        );
        eng.release(warm.seq).unwrap();
        cache.finish_pending(&mut eng).unwrap();
        assert!(!cache.has_pending());
        assert_eq!(cache.stats().nodes, longest / p, "{name}");
        assert_eq!(
            eng.allocator().free_state_count(),
            states0,
            "{name}: scratch slots"
        );
        cache.verify(&eng).unwrap();

        let decode = &fx.tokens[n - 3..];
        // A prompt that shares only its first token, then one that extends it: the second
        // hits all of the first's pages, which were still pending when it started.
        let t = ((n - 3) / p).min(3) * p;
        let first = prompt(&fx.tokens, 1, t, vocab);
        let mut second = first.clone();
        second.extend_from_slice(&fx.tokens[..2]);
        for (pr, expect_hit) in [(first, 0), (second, t)] {
            let want = cold(&mut coldeng, &pr, decode);
            let got = cache.prefill(&mut eng, &pr, 0, Logits::All).unwrap();
            assert_eq!(got.hit_tokens, expect_hit, "{name}: prompt of {}", pr.len());
            // The first's last forward has page boundaries: pending; the second's none.
            assert_eq!(cache.has_pending(), expect_hit == 0, "{name}");
            let mut seq = got.seq;
            let mut rows = got.logits;
            rows.extend(decode_steps(&mut eng, &mut seq, decode));
            assert!(
                bits(&rows) == bits(&want[expect_hit..]),
                "{name}: prompt of {} (hit {expect_hit}) differs from a cold run",
                pr.len()
            );
            eng.release(seq).unwrap();
        }
        cache.verify(&eng).unwrap();
        cache.clear(&mut eng).unwrap();
        assert!(!cache.has_pending());
        assert_eq!(eng.allocator().free_page_count(), pages0, "{name}: pages");
        assert_eq!(
            eng.allocator().free_state_count(),
            states0,
            "{name}: states"
        );
    }
}

#[test]
fn a_small_device_pool_evicts_to_host_and_stays_exact() {
    let fx = load_fixture("mixed");
    let p = smallest_page_tokens(&fx.dir);
    let vocab = fx.logits[0].len() as u32;
    // 6 pages: one 89-token prompt needs 6, so every earlier cut must go to the host.
    let mut eng = engine_sized(&fx.dir, EntryDtype::F32, p, 6);
    let mut coldeng = engine_sized(&fx.dir, EntryDtype::F32, p, 64);
    let host = HostPool::new(eng.layout(), 8);
    let mut cache = PrefixCache::new(&eng, host).unwrap();
    let mut host_hits = 0;
    // The second prompt diverges early and pushes the first one's cuts to the host; the
    // third shares the first one's prefix again and loads them back.
    let traffic = [(80, 4), (5, 60), (85, 4), (20, 4), (5, 60), (33, 4)];
    for (i, (share, tail)) in traffic.into_iter().enumerate() {
        let pr = prompt(&fx.tokens, share, tail, vocab);
        let want = cold(&mut coldeng, &pr, &[]);
        let got = cache.prefill(&mut eng, &pr, 0, Logits::All).unwrap();
        assert!(
            bits(&got.logits) == bits(&want[got.hit_tokens..]),
            "prompt {i}"
        );
        host_hits += got.host_hit_tokens;
        eng.release(got.seq).unwrap();
        cache.verify(&eng).unwrap();
    }
    assert!(host_hits > 0, "no host-tier hit happened");
    assert!(cache.host().used_pages() <= 8);
}

#[test]
fn audit_catches_a_write_outside_the_expected_pages() {
    let fx = load_fixture("mixed");
    let p = smallest_page_tokens(&fx.dir);
    let mut eng = engine_sized(&fx.dir, EntryDtype::F32, p, 32);
    eng.set_kv_audit(true);
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        // Normal prefill + decode under audit: no violation, same logits as without.
        let mut plain = engine_sized(&fx.dir, EntryDtype::F32, p, 32);
        let want = cold(&mut plain, &fx.tokens[..40], &fx.tokens[40..43]);
        let got = cold(&mut eng, &fx.tokens[..40], &fx.tokens[40..43]);
        assert!(bits(&got) == bits(&want));

        let mut a = eng.new_sequence().unwrap();
        prefill(&mut eng, &mut a, &fx.tokens[..2 * p], 0, Logits::None).unwrap();
        let mut b = eng.new_sequence().unwrap();
        prefill(&mut eng, &mut b, &fx.tokens[..p + 3], 0, Logits::None).unwrap();
        // A scribble on the page this step writes is not flagged (the set is exact, not "all").
        let own = b.kv().pages[1];
        eng.debug_scribble_after_next_forward(own);
        decode_steps(&mut eng, &mut b, &[5]);
        // A scribble on another sequence's page is caught: the step itself succeeds (none of
        // its sequences was hit) and the owner of the corrupted page fails when it next runs.
        let victim = a.kv().pages[0];
        eng.debug_scribble_after_next_forward(victim);
        eng.forward(&mut [ForwardItem {
            seq: &mut b,
            tokens: &[7],
            logits: Logits::Last,
        }])
        .unwrap();
        assert!(eng.is_poisoned(victim));
        let err = eng
            .forward(&mut [ForwardItem {
                seq: &mut a,
                tokens: &[7],
                logits: Logits::Last,
            }])
            .unwrap_err();
        match &err {
            EngineError::KvAudit { pages, states } => {
                assert_eq!(pages, &vec![victim]);
                assert!(states.is_empty());
            }
            other => panic!("expected a KV audit error, got {other}"),
        }
        assert!(err.to_string().contains(&format!("[{victim}]")), "{err}");
        eng.release(a).unwrap();
        eng.release(b).unwrap();
        assert!(!eng.is_poisoned(victim));
    });
    let violations: u64 = snap
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "pdserve_kv_audit_violations_total")
        .map(|(.., v)| match v {
            DebugValue::Counter(c) => c,
            _ => 0,
        })
        .sum();
    assert_eq!(violations, 1);
}

#[test]
fn metrics_count_pages_and_prefix_hits() {
    let fx = load_fixture("default_schedule");
    let p = smallest_page_tokens(&fx.dir);
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let (held, host_hit) = metrics::with_local_recorder(&recorder, || {
        let mut eng = engine_sized(&fx.dir, EntryDtype::F32, p, 40);
        let mut cache = PrefixCache::new(&eng, HostPool::new(eng.layout(), 50)).unwrap();
        let a = cache
            .prefill(&mut eng, &fx.tokens[..30], 0, Logits::Last)
            .unwrap(); // 30 misses, cuts at 8, 16, 24
        eng.release(a.seq).unwrap();
        let b = cache
            .prefill(&mut eng, &fx.tokens[..20], 0, Logits::Last)
            .unwrap(); // 16 device hits, 4 misses
        assert_eq!(b.hit_tokens, 16);
        eng.release(b.seq).unwrap();
        while cache.evict_one_device(&mut eng).unwrap() {}
        let c = cache
            .prefill(&mut eng, &fx.tokens[..26], 0, Logits::Last)
            .unwrap(); // 24 host hits, 2 misses
        let held = eng.allocator().total_pages() - eng.allocator().free_page_count();
        (held, c.host_hit_tokens)
    });
    assert_eq!(host_hit, 24);
    let mut got = std::collections::BTreeMap::new();
    for (k, _, _, v) in snap.snapshot().into_vec() {
        let labels: Vec<String> = k
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let v = match v {
            DebugValue::Counter(c) => c as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(_) => f64::NAN,
        };
        got.insert(format!("{}{{{}}}", k.key().name(), labels.join(",")), v);
    }
    println!("{got:#?}");
    let g = |k: &str| got.get(k).copied().unwrap_or(-1.0);
    assert_eq!(g("pdserve_prefix_cache_miss_tokens_total{}"), 36.0);
    assert_eq!(
        g("pdserve_prefix_cache_hit_tokens_total{tier=device}"),
        16.0
    );
    assert_eq!(g("pdserve_prefix_cache_hit_tokens_total{tier=host}"), 24.0);
    // vLLM's pair: every looked-up token is a query, hits from either tier.
    assert_eq!(
        g("pdserve_prefix_cache_queries_total{}"),
        36.0 + 16.0 + 24.0
    );
    assert_eq!(g("pdserve_prefix_cache_hits_total{}"), 16.0 + 24.0);
    assert_eq!(g("pdserve_kv_pages_capacity{pool=device}"), 40.0);
    assert_eq!(g("pdserve_kv_pages_used{pool=device}"), held as f64);
    assert_eq!(g("pdserve_kv_pages_capacity{pool=host}"), 50.0);
    // Cuts at 8, 16, 24 were backed up once each and stay on the host.
    assert_eq!(g("pdserve_kv_pages_used{pool=host}"), 3.0);
}

#[test]
fn pools_of_different_layouts_refuse_each_other() {
    let fx = load_fixture("mixed");
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(&fx.dir).unwrap();
    let eng = engine_sized(&fx.dir, EntryDtype::Bf16, 16, 8);
    let cases = [
        (EntryDtype::Fp8E4m3, 16, "index_k_dtype"),
        (EntryDtype::Bf16, 32, "page_tokens"),
    ];
    for (dt, pt, field) in cases {
        let mut spec = KvLayoutSpec::default_for(&cfg);
        spec.index_k_dtype = dt;
        spec.page_tokens = pt;
        let other = KvLayout::new(&cfg, spec).unwrap();
        let err = match PrefixCache::new(&eng, HostPool::new(&other, 16)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a host pool of another layout was accepted"),
        };
        assert!(err.contains(&format!("`{field}`")), "{err}");
        let mut host = HostPool::new(&other, 16);
        let hp = host.alloc().unwrap();
        let err = host
            .backup(eng.backend(), eng.device_pool(), 0, hp)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("`{field}`")), "{err}");
    }
}

/// The state a forward writes for a cut inside it (`Engine::forward_with_cuts`) is, on
/// every range a continuation reads, the bytes a forward ending at the cut leaves; the
/// cuts' scratch slots are given back; a cut closer to the start than the rings reach is
/// refused before anything runs.
#[test]
fn cut_states_equal_the_state_of_a_forward_ending_there() {
    let mut tested = 0;
    for name in fixture_names() {
        let fx = load_fixture(&name);
        let p = smallest_page_tokens(&fx.dir);
        for kv in [EntryDtype::F32, EntryDtype::Bf16] {
            let mut eng = engine_dtypes(&fx.dir, kv, EntryDtype::F32, p, 64);
            let live = eng.layout().state_ranges_live_at_cut();
            let span = eng.cut_span();
            let n = fx.tokens.len();
            let cuts: Vec<usize> = (1..)
                .map(|k| k * p)
                .take_while(|&c| c < n)
                .filter(|&c| c >= span)
                .collect();
            if cuts.len() < 2 {
                println!("{name}: page {p}, {n} tokens, span {span}: fewer than two cuts fit");
                continue;
            }
            tested += 1;
            let free = eng.allocator().free_state_count();
            let mut seq = eng.new_sequence().unwrap();
            let item = ForwardItem {
                seq: &mut seq,
                tokens: &fx.tokens,
                logits: Logits::Last,
            };
            let (_, states) = eng.forward_with_cuts(item, &cuts).unwrap();
            assert_eq!(
                eng.allocator().free_state_count(),
                free - 1,
                "{name}: cut slots kept"
            );
            eng.release(seq).unwrap();
            for (&c, got) in cuts.iter().zip(&states) {
                let mut one = eng.new_sequence().unwrap();
                prefill(&mut eng, &mut one, &fx.tokens[..c], 0, Logits::None).unwrap();
                let full = eng.export_sequence(&one).unwrap().state;
                eng.release(one).unwrap();
                let want: Vec<u8> = live.iter().flat_map(|r| full[r.clone()].to_vec()).collect();
                assert_eq!(
                    got.len(),
                    want.len(),
                    "{name} kv={kv:?}: live bytes at cut {c}"
                );
                assert!(
                    *got == want,
                    "{name} kv={kv:?}: live state at cut {c} differs"
                );
            }
            // Too close to the start for the rings: refused, nothing allocated.
            let mut seq = eng.new_sequence().unwrap();
            let item = ForwardItem {
                seq: &mut seq,
                tokens: &fx.tokens,
                logits: Logits::Last,
            };
            assert!(eng.forward_with_cuts(item, &[span - 1]).is_err());
            assert_eq!(eng.allocator().free_state_count(), free - 1);
            eng.release(seq).unwrap();
        }
    }
    assert!(tested >= 2, "only {tested} fixture runs had two cuts");
}
