//! Property tests of the KV memory system: random allocate / write / free / back up /
//! load back sequences on device + host pools for every dtype combination, and random
//! prefix-cache traffic (hits in both tiers, eviction, live sequences) against cold runs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::generate::prefill;
use pdserve_engine::kv::{DevicePool, EntryDtype, HostPool, KvLayout, KvLayoutSpec, PrefixCache};
use pdserve_engine::{CpuBackend, Logits};
use proptest::prelude::*;
use std::sync::OnceLock;

#[derive(Debug, Clone)]
enum PoolOp {
    Alloc(usize),
    Write(usize, u8),
    Free(usize),
    Backup(usize),
    Load(usize),
    FreeHost(usize),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        (1usize..4).prop_map(PoolOp::Alloc),
        (any::<usize>(), any::<u8>()).prop_map(|(i, s)| PoolOp::Write(i, s)),
        any::<usize>().prop_map(PoolOp::Free),
        any::<usize>().prop_map(PoolOp::Backup),
        any::<usize>().prop_map(PoolOp::Load),
        any::<usize>().prop_map(PoolOp::FreeHost),
    ]
}

fn dtypes() -> impl Strategy<Value = (EntryDtype, EntryDtype)> {
    (
        prop::sample::select(EntryDtype::ALL.to_vec()),
        prop::sample::select(EntryDtype::ALL.to_vec()),
    )
}

fn page_pattern(len: usize, seed: u8, page: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 * 31 + u32::from(seed) * 7 + page) as u8)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// No page owned twice, nothing leaked, host <-> device copies byte-identical.
    #[test]
    fn device_and_host_pools_keep_their_books(
        (kv_dt, ik_dt) in dtypes(),
        ops in prop::collection::vec(pool_op(), 1..60),
    ) {
        let cfg = ModelConfig::from_model_dir(&fixtures_dir().join("mixed")).unwrap();
        let mut spec = KvLayoutSpec::default_for(&cfg);
        spec.kv_dtype = kv_dt;
        spec.index_k_dtype = ik_dt;
        spec.page_tokens = 16;
        let layout = KvLayout::new(&cfg, spec).unwrap();
        let be = CpuBackend;
        let mut dev = DevicePool::new(&be, layout.clone(), 8, 1).unwrap();
        let mut host = HostPool::new(&layout, 10);
        // What each owned page must hold.
        let mut owned: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut hosted: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut pages = pdserve_engine::kv::KvAllocator::new(8, 0);
        for op in ops {
            match op {
                PoolOp::Alloc(n) => {
                    if let Ok(ps) = pages.alloc_pages(n) {
                        for p in ps {
                            prop_assert!(owned.iter().all(|(q, _)| *q != p), "page {} handed out twice", p);
                            let bytes = dev.read_page(&be, p).unwrap();
                            owned.push((p, bytes));
                        }
                    } else {
                        prop_assert!(pages.free_page_count() < n);
                    }
                }
                PoolOp::Write(i, seed) if !owned.is_empty() => {
                    let k = i % owned.len();
                    let bytes = page_pattern(layout.page_bytes, seed, owned[k].0);
                    dev.write_page(&be, owned[k].0, &bytes).unwrap();
                    owned[k].1 = bytes;
                }
                PoolOp::Free(i) if !owned.is_empty() => {
                    let (p, _) = owned.swap_remove(i % owned.len());
                    pages.release_pages(&[p]).unwrap();
                    prop_assert!(pages.release_pages(&[p]).is_err() || owned.iter().any(|(q, _)| *q == p));
                }
                PoolOp::Backup(i) if !owned.is_empty() => {
                    let (p, bytes) = owned[i % owned.len()].clone();
                    if let Some(hp) = host.alloc() {
                        prop_assert!(hosted.iter().all(|(q, _)| *q != hp));
                        host.backup(&be, &dev, p, hp).unwrap();
                        prop_assert_eq!(host.read(hp).unwrap(), &bytes[..]);
                        hosted.push((hp, bytes));
                    }
                }
                PoolOp::Load(i) if !hosted.is_empty() => {
                    let (hp, bytes) = hosted[i % hosted.len()].clone();
                    if let Ok(mut v) = pages.alloc_pages(1) {
                        let p = v.pop().unwrap();
                        host.load(&be, &mut dev, hp, p).unwrap();
                        prop_assert_eq!(dev.read_page(&be, p).unwrap(), bytes.clone());
                        owned.push((p, bytes));
                    }
                }
                PoolOp::FreeHost(i) if !hosted.is_empty() => {
                    let (hp, _) = hosted.swap_remove(i % hosted.len());
                    host.free(hp).unwrap();
                    prop_assert!(host.free(hp).is_err());
                }
                _ => {}
            }
            // Books balance and every page still holds what was last written to it.
            prop_assert_eq!(pages.free_page_count() + owned.len(), 8);
            prop_assert_eq!(host.used_pages(), hosted.len());
            for (p, bytes) in &owned {
                prop_assert_eq!(&dev.read_page(&be, *p).unwrap(), bytes);
            }
            for (hp, bytes) in &hosted {
                prop_assert_eq!(host.read(*hp).unwrap(), &bytes[..]);
            }
        }
        for (p, _) in owned.drain(..) {
            pages.release_pages(&[p]).unwrap();
        }
        for (hp, _) in hosted.drain(..) {
            host.free(hp).unwrap();
        }
        prop_assert_eq!(pages.free_page_count(), 8);
        prop_assert_eq!(host.used_pages(), 0);
    }
}

const SHARES: [usize; 6] = [0, 5, 8, 16, 21, 33];
const TAIL: usize = 6;

/// Every (kv dtype, index-K dtype) combination.
fn combos() -> Vec<(EntryDtype, EntryDtype)> {
    [EntryDtype::F32, EntryDtype::Bf16]
        .into_iter()
        .flat_map(|kv| EntryDtype::ALL.into_iter().map(move |ik| (kv, ik)))
        .collect()
}

struct Prompts {
    page_tokens: usize,
    prompts: Vec<Vec<u32>>,
    /// Cold logits of every position, per dtype combination, per prompt.
    cold: Vec<Vec<Vec<Vec<f32>>>>,
}

/// Prompts sharing prefixes of several lengths (some shorter than a page), with their
/// cold-run logits, computed once.
fn prompts() -> &'static Prompts {
    static P: OnceLock<Prompts> = OnceLock::new();
    P.get_or_init(|| {
        let fx = load_fixture("default_schedule");
        let p = smallest_page_tokens(&fx.dir);
        let vocab = fx.logits[0].len() as u32;
        let mut prompts = Vec::new();
        for share in SHARES {
            for variant in 0..2u32 {
                let mut pr = fx.tokens[..share].to_vec();
                pr.extend(
                    (0..TAIL as u32)
                        .map(|i| 2 + (fx.tokens[share] + 1 + i + variant * 3) % (vocab - 2)),
                );
                prompts.push(pr);
            }
        }
        prompts.push(fx.tokens[..45].to_vec());
        let cold = combos()
            .into_iter()
            .map(|(kv, ik)| {
                let mut eng = engine_dtypes(&fx.dir, kv, ik, p, 64);
                prompts
                    .iter()
                    .map(|pr| {
                        let mut seq = eng.new_sequence().unwrap();
                        let rows = prefill(&mut eng, &mut seq, pr, 0, Logits::All).unwrap();
                        eng.release(seq).unwrap();
                        rows
                    })
                    .collect()
            })
            .collect();
        Prompts {
            page_tokens: p,
            prompts,
            cold,
        }
    })
}

#[derive(Debug, Clone)]
enum CacheOp {
    /// Prefill prompt `i` in chunks of `chunk` (0: whole); keep the sequence alive or not.
    Prefill { i: usize, chunk: usize, keep: bool },
    /// Evict `n` device pages to the host.
    Evict(usize),
    /// Release the oldest live sequence.
    Release,
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        3 => (any::<usize>(), prop::sample::select(vec![0usize, 3, 8, 13]), any::<bool>())
            .prop_map(|(i, chunk, keep)| CacheOp::Prefill { i, chunk, keep }),
        1 => (1usize..6).prop_map(CacheOp::Evict),
        1 => Just(CacheOp::Release),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random cache traffic in every dtype combination: every prefill's logits equal the
    /// cold run's bit for bit,
    /// the tree's books match the pools, nothing leaks.
    #[test]
    fn prefix_cache_traffic_is_exact_and_leak_free(
        combo in 0usize..6,
        device_pages in 20usize..28,
        host_ratio in 1.0f64..3.0,
        ops in prop::collection::vec(cache_op(), 1..10),
    ) {
        let pr = prompts();
        let fx_dir = fixtures_dir().join("default_schedule");
        let (kv, ik) = combos()[combo];
        let mut eng = engine_dtypes(&fx_dir, kv, ik, pr.page_tokens, device_pages);
        eng.set_kv_audit(true);
        let host_pages = pdserve_engine::kv::sizing::host_pages(
            eng.layout(),
            device_pages,
            pdserve_engine::kv::sizing::HostSize::Ratio(host_ratio),
            None,
        ).unwrap();
        let mut cache = PrefixCache::new(&eng, HostPool::new(eng.layout(), host_pages)).unwrap();
        let mut live = std::collections::VecDeque::new();
        for op in ops {
            match op {
                CacheOp::Prefill { i, chunk, keep } => {
                    let i = i % pr.prompts.len();
                    // At most 2 live sequences of <= 6 pages, so a prefill always fits.
                    if live.len() >= 2 {
                        eng.release(live.pop_front().unwrap()).unwrap();
                    }
                    let got = cache.prefill(&mut eng, &pr.prompts[i], chunk, Logits::All).unwrap();
                    prop_assert_eq!(got.hit_tokens % pr.page_tokens, 0);
                    prop_assert!(got.hit_tokens < pr.prompts[i].len());
                    let want = &pr.cold[combo][i][got.hit_tokens..];
                    prop_assert!(got.logits == want, "prompt {} after a hit of {}", i, got.hit_tokens);
                    if keep { live.push_back(got.seq) } else { eng.release(got.seq).unwrap() }
                }
                CacheOp::Evict(n) => {
                    for _ in 0..n {
                        cache.evict_one_device(&mut eng).unwrap();
                    }
                }
                CacheOp::Release => {
                    if let Some(s) = live.pop_front() {
                        eng.release(s).unwrap();
                    }
                }
            }
            cache.verify(&eng).map_err(TestCaseError::fail)?;
            prop_assert!(cache.host().used_pages() <= host_pages);
        }
        for s in live {
            eng.release(s).unwrap();
        }
        cache.clear(&mut eng).unwrap();
        prop_assert_eq!(eng.allocator().free_page_count(), eng.allocator().total_pages());
        prop_assert_eq!(eng.allocator().free_state_count(), eng.allocator().total_states());
        prop_assert_eq!(cache.host().used_pages(), 0);
    }
}
