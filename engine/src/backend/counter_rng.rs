//! Deterministic synthetic weights (benchmarks with no checkpoint): a counter-based
//! generator, so that element `i` of a tensor depends only on `(seed, i)` and any backend
//! can produce it in parallel. `kernels/src/cu/random.cu` implements the same arithmetic
//! on the GPU (`k_random_*`); keep the two in step.
//!
//! Element `i`: `h = splitmix64(seed + i * GOLDEN)`; its four 16-bit lanes give uniforms
//! `u_j = (lane_j + 0.5) / 65536`. A normal draw is the Irwin-Hall sum
//! `(u_0 + u_1 + u_2 + u_3 - 2) * sqrt(3)` (mean 0, variance 1, bounded by +-3.46);
//! a uniform draw is `u_0`. No transcendental functions, so host and device agree to
//! the rounding of a few float additions.

use super::HostTensor;

/// How one synthetic tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightInit {
    /// `mean + std * z`, `z` approximately standard normal.
    Normal { mean: f32, std: f32 },
    /// Uniform on `[lo, hi)`.
    Uniform { lo: f32, hi: f32 },
}

impl WeightInit {
    /// `(kind, a, b)` as the device kernels take them: 0 = normal(a = mean, b = std),
    /// 1 = uniform(a = lo, b = hi).
    pub fn kernel_params(self) -> (i32, f32, f32) {
        match self {
            WeightInit::Normal { mean, std } => (0, mean, std),
            WeightInit::Uniform { lo, hi } => (1, lo, hi),
        }
    }
}

pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser.
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seed of one named tensor: the run's seed mixed with an FNV-1a hash of the name, so
/// every tensor differs and none depends on load order.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    splitmix64(h ^ seed.wrapping_mul(GOLDEN))
}

/// 64 random bits of element `i`.
pub fn bits(seed: u64, i: u64) -> u64 {
    splitmix64(seed.wrapping_add(i.wrapping_mul(GOLDEN)))
}

fn lane(h: u64, j: u32) -> f32 {
    (((h >> (16 * j)) & 0xffff) as f32 + 0.5) * (1.0 / 65536.0)
}

/// Value of element `i` under `init`.
pub fn value(init: WeightInit, seed: u64, i: u64) -> f32 {
    let h = bits(seed, i);
    match init {
        WeightInit::Normal { mean, std } => {
            let s = lane(h, 0) + lane(h, 1) + lane(h, 2) + lane(h, 3);
            mean + std * ((s - 2.0) * 1.732_050_8)
        }
        WeightInit::Uniform { lo, hi } => lo + (hi - lo) * lane(h, 0),
    }
}

/// A whole tensor on the host (the default [`super::TensorOps::random_weight`]).
pub fn host_tensor(rows: usize, cols: usize, init: WeightInit, seed: u64) -> HostTensor {
    use rayon::prelude::*;
    let data = (0..rows * cols)
        .into_par_iter()
        .map(|i| value(init, seed, i as u64))
        .collect();
    HostTensor { rows, cols, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        (mean, var.sqrt())
    }

    #[test]
    fn normal_has_the_asked_mean_and_std() {
        let t = host_tensor(
            100,
            1000,
            WeightInit::Normal {
                mean: 1.0,
                std: 0.2,
            },
            7,
        );
        let (m, s) = moments(&t.data);
        assert!((m - 1.0).abs() < 0.002, "mean {m}");
        assert!((s - 0.2).abs() < 0.002, "std {s}");
        assert!(t.data.iter().all(|v| (v - 1.0).abs() <= 0.2 * 3.47));
    }

    #[test]
    fn uniform_stays_in_range_and_fills_it() {
        let t = host_tensor(1, 50_000, WeightInit::Uniform { lo: 0.5, hi: 1.5 }, 3);
        assert!(t.data.iter().all(|&v| (0.5..1.5).contains(&v)));
        let (m, _) = moments(&t.data);
        assert!((m - 1.0).abs() < 0.01, "mean {m}");
        assert!(t.data.iter().any(|&v| v < 0.51) && t.data.iter().any(|&v| v > 1.49));
    }

    #[test]
    fn deterministic_and_seed_dependent() {
        let init = WeightInit::Normal {
            mean: 0.0,
            std: 1.0,
        };
        let a = host_tensor(3, 5, init, tensor_seed(1, "w"));
        let b = host_tensor(3, 5, init, tensor_seed(1, "w"));
        let c = host_tensor(3, 5, init, tensor_seed(1, "v"));
        let d = host_tensor(3, 5, init, tensor_seed(2, "w"));
        assert_eq!(a, b);
        assert_ne!(a.data, c.data);
        assert_ne!(a.data, d.data);
        // Neighbouring elements are uncorrelated.
        let big = host_tensor(1, 100_000, init, tensor_seed(1, "w"));
        let lag1: f64 = big
            .data
            .windows(2)
            .map(|w| f64::from(w[0]) * f64::from(w[1]))
            .sum::<f64>()
            / big.data.len() as f64;
        assert!(lag1.abs() < 0.02, "lag-1 correlation {lag1}");
    }
}
