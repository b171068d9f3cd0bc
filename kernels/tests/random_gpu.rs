//! On a machine with a CUDA device: `CudaBackend::random_weight` produces the same values
//! as the host generator (`pdserve_engine::backend::counter_rng`), bit for bit in fp32 and after
//! bf16 rounding, for every init kind; the bandwidth and GEMM probes return plausible
//! figures. Skipped (passes) where no device can be opened.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::backend::counter_rng::{host_tensor, tensor_seed};
use pdserve_engine::backend::{TensorOps, WeightInit, WeightUse};
use pdserve_kernels::{CudaBackend, WeightDtype};

fn open(w: WeightDtype) -> Option<CudaBackend> {
    if !pdserve_kernels::device::driver_present() {
        eprintln!("SKIPPED: no CUDA driver");
        return None;
    }
    match CudaBackend::with_weights(0, None, w) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

const INITS: [WeightInit; 3] = [
    WeightInit::Normal {
        mean: 0.0,
        std: 0.03,
    },
    WeightInit::Normal {
        mean: 1.0,
        std: 0.2,
    },
    WeightInit::Uniform { lo: 0.5, hi: 1.5 },
];

#[test]
fn device_random_weights_equal_the_host_generator() {
    let Some(f32b) = open(WeightDtype::F32) else {
        return;
    };
    let Some(bf16b) = open(WeightDtype::Bf16) else {
        return;
    };
    for (i, init) in INITS.into_iter().enumerate() {
        let seed = tensor_seed(9, &format!("model.layers.{i}.mlp.experts.down_proj"));
        let want = host_tensor(300, 257, init, seed);
        let got = f32b
            .to_host(
                &f32b
                    .random_weight(300, 257, init, seed, WeightUse::Matrix)
                    .unwrap(),
            )
            .unwrap();
        assert_eq!((got.rows, got.cols), (300, 257));
        let diff = got
            .data
            .iter()
            .zip(&want.data)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(diff, 0, "{init:?}: {diff} fp32 values differ");
        let got = bf16b
            .to_host(
                &bf16b
                    .random_weight(300, 257, init, seed, WeightUse::Matrix)
                    .unwrap(),
            )
            .unwrap();
        let rounded: Vec<f32> = want
            .data
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(got.data, rounded, "{init:?}: bf16 values differ");
    }
}

#[test]
fn ceilings_are_plausible() {
    let Some(b) = open(WeightDtype::Bf16) else {
        return;
    };
    let bw = b.measure_bandwidth(256 << 20, 3).unwrap();
    assert!(bw.copy > 1e10 && bw.read > 1e10, "{bw:?}");
    let gemm = b.measure_gemm_bf16(2048, 3).unwrap();
    assert!(gemm > 1e12, "{gemm}");
}
