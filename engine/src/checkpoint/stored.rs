//! A weight kept in DeepSeek's stored format (block-scaled FP8 or group-scaled FP4) instead
//! of f32: the bytes and ue8m0 scales exactly as the checkpoint holds them, for a backend
//! that computes on them directly (the CUDA FP8/FP4 kernels). [`StoredWeight::dequantize`]
//! is the exact f32 value every backend must agree with; [`StoredWeight::quantize`] makes
//! one from f32 values the way DeepSeek's conversion does (power-of-two scales rounded up
//! from the block's absolute maximum), for synthetic weights in the stored formats.

use super::dequant::{fp4_group_scaled, fp8_block_scaled};
use crate::config::{FP4_GROUP, WEIGHT_BLOCK};
use crate::kv::fp8::f32_to_e4m3;

/// How one float tensor is stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// F32, BF16 or F16.
    Float,
    /// F8_E4M3 with an F8_E8M0 `.scale` of shape `[ceil(out/128), ceil(in/128)]`.
    Fp8Block,
    /// FP4 e2m1 packed two per byte as I8 `[out, in/2]`, F8_E8M0 `.scale` `[out, in/32]`.
    Fp4Packed,
}

/// Largest e4m3 magnitude.
const E4M3_MAX: f32 = 448.0;
/// Largest e2m1 magnitude.
const E2M1_MAX: f32 = 6.0;

/// A quantized `rows x cols` weight. Rows come in groups of `group_rows` (a whole tensor,
/// or one part of a tensor stacked from per-expert parts: gate, up, down of each expert),
/// each group with its own scale grid, as the parts are stored on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredWeight {
    /// [`WeightFormat::Fp8Block`] or [`WeightFormat::Fp4Packed`].
    pub format: WeightFormat,
    pub rows: usize,
    /// Logical columns (FP4 stores `cols / 2` bytes per row).
    pub cols: usize,
    /// Rows per scale grid; divides `rows`.
    pub group_rows: usize,
    /// Row-major e4m3 bytes, or e2m1 nibbles two per byte (element `2k` in the low nibble).
    pub data: Vec<u8>,
    /// ue8m0 scale bytes, grid after grid ([`StoredWeight::scale_grid`] each).
    pub scale: Vec<u8>,
}

impl StoredWeight {
    /// `(rows, cols)` of one group's scale grid: FP8 one scale per 128x128 block, FP4 one
    /// per 32 inputs of a row.
    pub fn scale_grid(format: WeightFormat, group_rows: usize, cols: usize) -> (usize, usize) {
        match format {
            WeightFormat::Fp8Block => (
                group_rows.div_ceil(WEIGHT_BLOCK[0]),
                cols.div_ceil(WEIGHT_BLOCK[1]),
            ),
            _ => (group_rows, cols.div_ceil(FP4_GROUP)),
        }
    }

    /// Bytes of one stored row.
    pub fn row_bytes(format: WeightFormat, cols: usize) -> usize {
        match format {
            WeightFormat::Fp4Packed => cols / 2,
            _ => cols,
        }
    }

    /// Bytes the weight occupies as stored (values and scales).
    pub fn stored_bytes(format: WeightFormat, rows: usize, cols: usize, group_rows: usize) -> u64 {
        let (sr, sc) = Self::scale_grid(format, group_rows, cols);
        let groups = rows / group_rows.max(1);
        (rows * Self::row_bytes(format, cols) + groups * sr * sc) as u64
    }

    /// Whether `format` can store a `rows x cols` weight in groups of `group_rows` rows: a
    /// stored format, whole groups, FP4 rows of whole bytes.
    pub fn shape_fits(format: WeightFormat, rows: usize, cols: usize, group_rows: usize) -> bool {
        matches!(format, WeightFormat::Fp8Block | WeightFormat::Fp4Packed)
            && group_rows > 0
            && rows.is_multiple_of(group_rows)
            && (format != WeightFormat::Fp4Packed || cols.is_multiple_of(2))
    }

    /// Checks that the byte counts match the shape and format.
    pub fn check(&self) -> Result<(), String> {
        let (sr, sc) = Self::scale_grid(self.format, self.group_rows, self.cols);
        // shape_fits first: it guarantees group_rows > 0 for the division.
        if !Self::shape_fits(self.format, self.rows, self.cols, self.group_rows)
            || self.data.len() != self.rows * Self::row_bytes(self.format, self.cols)
            || self.scale.len() != (self.rows / self.group_rows) * sr * sc
        {
            return Err(format!(
                "{:?} weight {}x{} (groups of {} rows) with {} value bytes and {} scale bytes",
                self.format,
                self.rows,
                self.cols,
                self.group_rows,
                self.data.len(),
                self.scale.len()
            ));
        }
        Ok(())
    }

    /// The exact f32 values, row-major (see [`super::dequant`]).
    pub fn dequantize(&self) -> Result<Vec<f32>, String> {
        self.check()?;
        let (sr, sc) = Self::scale_grid(self.format, self.group_rows, self.cols);
        let group_bytes = self.group_rows * Self::row_bytes(self.format, self.cols);
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for (q, s) in self
            .data
            .chunks(group_bytes.max(1))
            .zip(self.scale.chunks((sr * sc).max(1)))
        {
            out.extend(match self.format {
                WeightFormat::Fp8Block => fp8_block_scaled(q, self.group_rows, self.cols, s)?,
                _ => fp4_group_scaled(q, self.group_rows, self.cols, s)?,
            });
        }
        Ok(out)
    }

    /// `values` (`rows x cols`, row-major) in `format`, one scale grid per `group_rows`
    /// rows. Each block's (FP8: 128x128; FP4: 32 inputs of a row) scale is the power of two
    /// at or above `amax / max_code` (DeepSeek's ue8m0 scales), values rounded to nearest
    /// even.
    pub fn quantize(
        format: WeightFormat,
        values: &[f32],
        rows: usize,
        cols: usize,
        group_rows: usize,
    ) -> Result<StoredWeight, String> {
        if !Self::shape_fits(format, rows, cols, group_rows) || values.len() != rows * cols {
            return Err(format!(
                "cannot quantize {} values as a {rows}x{cols} {format:?} weight in groups of {group_rows} rows",
                values.len()
            ));
        }
        let (sr, sc) = Self::scale_grid(format, group_rows, cols);
        let (br, bc) = match format {
            WeightFormat::Fp8Block => (WEIGHT_BLOCK[0], WEIGHT_BLOCK[1]),
            _ => (1, FP4_GROUP),
        };
        let groups = rows / group_rows;
        let mut scale = vec![0u8; groups * sr * sc];
        for g in 0..groups {
            for (b, s) in scale[g * sr * sc..][..sr * sc].iter_mut().enumerate() {
                let (r0, c0) = (g * group_rows + (b / sc) * br, (b % sc) * bc);
                let r1 = (r0 + br).min((g + 1) * group_rows);
                let amax = (r0..r1)
                    .flat_map(|r| &values[r * cols + c0..r * cols + (c0 + bc).min(cols)])
                    .fold(0f32, |m, v| m.max(v.abs()));
                let max_code = if format == WeightFormat::Fp8Block {
                    E4M3_MAX
                } else {
                    E2M1_MAX
                };
                *s = ue8m0_at_least(amax / max_code);
            }
        }
        let scale_of = |r: usize, c: usize| {
            let g = r / group_rows;
            let b = ((r % group_rows) / br) * sc + c / bc;
            super::dequant::e8m0_to_f32(scale[g * sr * sc + b]).unwrap_or(1.0)
        };
        let data = match format {
            WeightFormat::Fp8Block => (0..rows * cols)
                .map(|i| f32_to_e4m3(values[i] / scale_of(i / cols, i % cols)))
                .collect(),
            _ => (0..rows * cols / 2)
                .map(|k| {
                    let (r, c) = ((2 * k) / cols, (2 * k) % cols);
                    let lo = f32_to_e2m1(values[2 * k] / scale_of(r, c));
                    let hi = f32_to_e2m1(values[2 * k + 1] / scale_of(r, c + 1));
                    lo | (hi << 4)
                })
                .collect(),
        };
        Ok(StoredWeight {
            format,
            rows,
            cols,
            group_rows,
            data,
            scale,
        })
    }
}

/// The ue8m0 byte of the smallest power of two `>= x` (at least `2^-126`, at most `2^127`).
fn ue8m0_at_least(x: f32) -> u8 {
    if x.is_nan() || x <= f32::MIN_POSITIVE {
        return 1;
    }
    let bits = x.to_bits();
    let exp = (bits >> 23) as i32; // biased; x is normal and positive
    let up = i32::from(bits & 0x7f_ffff != 0);
    (exp + up).clamp(1, 254) as u8
}

/// The e2m1 nibble nearest to `x` (ties to the even code), saturating at +-6.
pub fn f32_to_e2m1(x: f32) -> u8 {
    /// Magnitudes of codes 0..8 and the midpoints between neighbours.
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 7; // no NaN code: the largest magnitude
    }
    let mut code = 7u8;
    for i in 0..7 {
        let mid = (MAG[i] + MAG[i + 1]) / 2.0;
        if a < mid || (a == mid && i % 2 == 0) {
            code = i as u8;
            break;
        }
    }
    if code == 0 {
        0
    } else {
        sign | code
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::checkpoint::dequant::e2m1_to_f32;

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        let cases = [
            (0.2, 0.0),
            (0.25, 0.0),
            (0.26, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.1, 6.0),
            (100.0, 6.0),
            (-2.9, -3.0),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "{x}");
        }
        for code in 0u8..16 {
            let v = e2m1_to_f32(code);
            assert_eq!(e2m1_to_f32(f32_to_e2m1(v)), v, "code {code}");
        }
    }

    #[test]
    fn ue8m0_is_the_power_of_two_at_or_above() {
        assert_eq!(ue8m0_at_least(1.0), 127);
        assert_eq!(ue8m0_at_least(1.5), 128);
        assert_eq!(ue8m0_at_least(0.25), 125);
        assert_eq!(ue8m0_at_least(0.0), 1);
    }

    #[test]
    fn quantize_then_dequantize_keeps_every_value_within_its_code_step() {
        let (rows, cols, group) = (2 * 130, 160, 130);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i % 5) as f32)
            .collect();
        for (format, rel) in [
            (WeightFormat::Fp8Block, 1.0 / 16.0),
            (WeightFormat::Fp4Packed, 0.5),
        ] {
            let w = StoredWeight::quantize(format, &values, rows, cols, group).unwrap();
            assert_eq!(
                w.data.len() as u64 + w.scale.len() as u64,
                StoredWeight::stored_bytes(format, rows, cols, group)
            );
            let back = w.dequantize().unwrap();
            // Largest magnitude in the data is 5: every error is within a code step of it.
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= rel * 5.0 + 1e-6, "{format:?}: {a} vs {b}");
            }
            // Quantizing exact values again changes nothing.
            let again = StoredWeight::quantize(format, &back, rows, cols, group).unwrap();
            assert_eq!(again.dequantize().unwrap(), back, "{format:?}");
        }
    }
}
