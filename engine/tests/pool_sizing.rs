//! `Engine::load_pool` with `PoolSpec::FreeFraction` (`--kv-mem-fraction`): the device pool
//! is sized after the weights are loaded, from the memory the backend has free then.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::backend::TensorOps;
use pdserve_engine::kv::sizing::SizingError;
use pdserve_engine::{CpuBackend, Engine, EngineError, PoolSize, PoolSpec};

#[test]
fn a_fraction_of_the_free_memory_sizes_the_pool_after_the_weights() {
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    let free_before = CpuBackend.memory_free().expect("MemAvailable on Linux");
    // A small fraction, so the pool stays small whatever the machine.
    let fraction = 1e-4;
    let states = 4;
    let engine = Engine::load_pool(
        &dir,
        CpuBackend,
        None,
        PoolSpec::FreeFraction { fraction, states },
    )
    .unwrap();
    let layout = engine.layout().clone();
    let pages = engine.device_pool().allocator().total_pages();
    assert_eq!(engine.device_pool().allocator().total_states(), states);
    assert!(pages > 0);
    // At most the fraction of what was free before loading (the weights took some since),
    // and no fewer pages than the same fraction of a quarter of it would give.
    let bytes = (pages * layout.page_bytes + states * layout.state_bytes) as f64;
    assert!(bytes <= free_before as f64 * fraction, "{bytes} bytes");
    let floor = (free_before as f64 * fraction / 4.0 - (states * layout.state_bytes) as f64)
        / layout.page_bytes as f64;
    assert!(pages as f64 >= floor, "{pages} pages, floor {floor}");
}

#[test]
fn a_fraction_that_cannot_work_is_a_sizing_error() {
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    for (fraction, want_bad) in [(0.0, true), (1.5, true), (1e-15, false)] {
        let err = Engine::load_pool(
            &dir,
            CpuBackend,
            None,
            PoolSpec::FreeFraction {
                fraction,
                states: 4,
            },
        )
        .err()
        .expect("refused");
        match err {
            EngineError::Sizing(SizingError::BadFraction(f)) => {
                assert!(want_bad, "{fraction}");
                assert_eq!(f, fraction);
            }
            EngineError::Sizing(SizingError::Empty { .. }) => assert!(!want_bad, "{fraction}"),
            other => panic!("{fraction}: {other}"),
        }
    }
    // A fixed size is what `Engine::load` takes.
    let e = Engine::load_pool(
        &dir,
        CpuBackend,
        None,
        PoolSpec::Size(PoolSize {
            pages: 7,
            states: 3,
        }),
    )
    .unwrap();
    assert_eq!(e.device_pool().allocator().total_pages(), 7);
}
