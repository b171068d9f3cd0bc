//! The indexer's `rotate_activation`: a normalized Walsh-Hadamard transform (Sylvester
//! order, `x @ H * n^-0.5`) over each head's values, applied before the FP4 simulation so
//! that outlier channels spread over the whole head.

/// The normalization `n^-0.5` of an `n`-point transform, in f64 (the GPU's rotation takes
/// these bits, so both round the same product).
pub fn hadamard_scale(n: usize) -> f64 {
    (n as f64).powf(-0.5)
}

/// Rotate `vals` in place; its length must be a power of two. The butterflies run in f64
/// and round once, so the result is the correctly rounded product up to f64 error.
pub fn hadamard(vals: &mut [f32]) {
    let n = vals.len();
    debug_assert!(n.is_power_of_two(), "hadamard over {n} values");
    let mut x: Vec<f64> = vals.iter().map(|&v| f64::from(v)).collect();
    let mut h = 1;
    while h < n {
        for block in x.chunks_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, w) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *w);
                *u = p + q;
                *w = p - q;
            }
        }
        h *= 2;
    }
    let scale = hadamard_scale(n);
    for (v, y) in vals.iter_mut().zip(x) {
        *v = (y * scale) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_sylvester_matrix_and_is_orthogonal() {
        let n = 8;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 1.7 - 3.0).sin()).collect();
        let mut y = x.clone();
        hadamard(&mut y);
        for (j, &yj) in y.iter().enumerate() {
            // Sylvester H[i][j] = (-1)^popcount(i & j).
            let want: f64 = x
                .iter()
                .enumerate()
                .map(|(i, &xi)| {
                    f64::from(xi)
                        * if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        }
                })
                .sum::<f64>()
                / (n as f64).sqrt();
            assert!((f64::from(yj) - want).abs() < 1e-6);
        }
        hadamard(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
