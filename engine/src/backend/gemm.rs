//! Multi-threaded fp32 `x @ w^T` for the CPU backend.
//!
//! Every output element is one [`dot`] with a fixed summation order, whatever the
//! number of rows or threads: results are bitwise independent of batching and chunking.

use rayon::prelude::*;

/// Dot product with 8 independent accumulators, combined in a fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Rows of `x` below which we parallelise over output columns instead of rows.
const ROW_PARALLEL_MIN: usize = 16;
/// Output columns per task when parallelising over columns.
const COL_BLOCK: usize = 64;

/// `out[i][j] = dot(x[i], w[j])` for `x: [n, k]` and `w: [m, k]`, `out: [n, m]`.
pub fn matmul_nt(x: &[f32], n: usize, k: usize, w: &[f32], m: usize, out: &mut [f32]) {
    debug_assert!(x.len() >= n * k && w.len() >= m * k && out.len() >= n * m);
    if n == 0 || m == 0 {
        return;
    }
    let work = n * m * k;
    if work < 1 << 15 {
        for i in 0..n {
            let xi = &x[i * k..(i + 1) * k];
            for j in 0..m {
                out[i * m + j] = dot(xi, &w[j * k..(j + 1) * k]);
            }
        }
    } else if n >= ROW_PARALLEL_MIN {
        out[..n * m]
            .par_chunks_mut(m)
            .enumerate()
            .for_each(|(i, row)| {
                let xi = &x[i * k..(i + 1) * k];
                for (j, o) in row.iter_mut().enumerate() {
                    *o = dot(xi, &w[j * k..(j + 1) * k]);
                }
            });
    } else {
        let blocks: Vec<(usize, Vec<f32>)> = (0..m.div_ceil(COL_BLOCK))
            .into_par_iter()
            .map(|b| {
                let j0 = b * COL_BLOCK;
                let j1 = (j0 + COL_BLOCK).min(m);
                let mut buf = vec![0f32; n * (j1 - j0)];
                for i in 0..n {
                    let xi = &x[i * k..(i + 1) * k];
                    for j in j0..j1 {
                        buf[i * (j1 - j0) + (j - j0)] = dot(xi, &w[j * k..(j + 1) * k]);
                    }
                }
                (j0, buf)
            })
            .collect();
        for (j0, buf) in blocks {
            let width = buf.len() / n;
            for i in 0..n {
                out[i * m + j0..i * m + j0 + width]
                    .copy_from_slice(&buf[i * width..(i + 1) * width]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
        let mut o = vec![0f32; n * m];
        for i in 0..n {
            for j in 0..m {
                o[i * m + j] = dot(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
            }
        }
        o
    }

    #[test]
    fn all_paths_agree_bitwise() {
        let k = 67;
        let m = 300;
        let w: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        for n in [1, 3, 15, 16, 40] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 104729) % 97) as f32 / 48.0 - 1.0)
                .collect();
            let mut out = vec![0f32; n * m];
            matmul_nt(&x, n, k, &w, m, &mut out);
            assert_eq!(out, naive(&x, n, k, &w, m), "n={n}");
            // Row 0 alone gives the same bits as inside the batch.
            let mut one = vec![0f32; m];
            matmul_nt(&x[..k], 1, k, &w, m, &mut one);
            assert_eq!(&one[..], &out[..m]);
        }
    }

    #[test]
    fn dot_matches_reference_sum() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b = vec![1f32; 19];
        assert_eq!(dot(&a, &b), (0..19).sum::<i32>() as f32);
    }
}
