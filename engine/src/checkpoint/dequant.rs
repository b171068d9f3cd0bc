//! Exact decoding of DeepSeek's stored weight formats to f32: FP8 e4m3 with one ue8m0
//! (power-of-two) scale per 128x128 block, and FP4 e2m1 packed two per byte with one ue8m0
//! scale per 32 inputs of a row. Every product is a small-mantissa value times a power of
//! two, so f32 holds it exactly: the CPU backend computes on the very weights the
//! checkpoint encodes, and is the oracle for the GPU kernels that will read them as stored.

use rayon::prelude::*;

use crate::config::{FP4_GROUP, WEIGHT_BLOCK};

/// `2^e` for an exponent in f32's normal range, built from its bits (const-evaluable).
const fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The value of one e4m3 byte: sign, 4-bit exponent (bias 7), 3-bit mantissa; exponent 0 is
/// subnormal (`m * 2^-9`); `0x7f`/`0xff` are NaN; there are no infinities.
const fn e4m3_value(b: u8) -> f32 {
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    let magnitude = if e == 0xf && b & 7 == 7 {
        f32::NAN
    } else if e == 0 {
        m * pow2(-9)
    } else {
        (1.0 + m / 8.0) * pow2(e - 7)
    };
    if b & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = e4m3_value(b as u8);
        b += 1;
    }
    t
}

static E4M3: [f32; 256] = e4m3_table();

/// e2m1 magnitudes by the low three bits (exponent bias 1; exponent 0 is subnormal).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The value of an e4m3 byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3[usize::from(b)]
}

/// The value of an e2m1 nibble (the low four bits of `n`; bit 3 is the sign).
pub fn e2m1_to_f32(n: u8) -> f32 {
    let v = E2M1[usize::from(n & 7)];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// The scale a ue8m0 byte encodes, `2^(b-127)`; `None` for 255 (NaN), which no usable
/// checkpoint contains. `b = 0` gives the f32 subnormal `2^-127`, still exact.
pub fn e8m0_to_f32(b: u8) -> Option<f32> {
    match b {
        255 => None,
        0 => Some(f32::from_bits(1 << 22)),
        b => Some(f32::from_bits(u32::from(b) << 23)),
    }
}

/// Scales of one tensor decoded up front, naming the first NaN byte.
fn decode_scales(scale: &[u8]) -> Result<Vec<f32>, String> {
    scale
        .iter()
        .enumerate()
        .map(|(i, &b)| e8m0_to_f32(b).ok_or_else(|| format!("scale element {i} is NaN (0xff)")))
        .collect()
}

/// `w[i][j] = e4m3(q[i][j]) * 2^(s[i/128][j/128]-127)` for a `rows x cols` weight whose scale
/// is `[ceil(rows/128), ceil(cols/128)]` (the last block row/column may be partial).
pub fn fp8_block_scaled(
    q: &[u8],
    rows: usize,
    cols: usize,
    scale: &[u8],
) -> Result<Vec<f32>, String> {
    let [br, bc] = WEIGHT_BLOCK;
    let scale_cols = cols.div_ceil(bc);
    if q.len() != rows * cols || scale.len() != rows.div_ceil(br) * scale_cols {
        return Err(format!(
            "{} weight bytes and {} scale bytes for a {rows}x{cols} block-scaled weight",
            q.len(),
            scale.len()
        ));
    }
    let s = decode_scales(scale)?;
    let mut out = vec![0f32; q.len()];
    out.par_chunks_mut(cols.max(1))
        .zip(q.par_chunks(cols.max(1)))
        .enumerate()
        .for_each(|(i, (row, qrow))| {
            let srow = &s[(i / br) * scale_cols..][..scale_cols];
            for (j, (o, &b)) in row.iter_mut().zip(qrow).enumerate() {
                *o = e4m3_to_f32(b) * srow[j / bc];
            }
        });
    Ok(out)
}

/// `w[i][j] = e2m1(nibble j of row i) * 2^(s[i][j/32]-127)` for a `rows x cols` weight stored
/// as `[rows, cols/2]` bytes, element `2k` in the low nibble of byte `k`, scale
/// `[rows, ceil(cols/32)]`.
pub fn fp4_group_scaled(
    packed: &[u8],
    rows: usize,
    cols: usize,
    scale: &[u8],
) -> Result<Vec<f32>, String> {
    let scale_cols = cols.div_ceil(FP4_GROUP);
    if !cols.is_multiple_of(2)
        || packed.len() * 2 != rows * cols
        || scale.len() != rows * scale_cols
    {
        return Err(format!(
            "{} packed bytes and {} scale bytes for a {rows}x{cols} FP4 weight",
            packed.len(),
            scale.len()
        ));
    }
    let s = decode_scales(scale)?;
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols.max(1))
        .zip(packed.par_chunks((cols / 2).max(1)))
        .enumerate()
        .for_each(|(i, (row, prow))| {
            let srow = &s[i * scale_cols..][..scale_cols];
            for (k, &b) in prow.iter().enumerate() {
                let j = 2 * k;
                row[j] = e2m1_to_f32(b & 0xf) * srow[j / FP4_GROUP];
                row[j + 1] = e2m1_to_f32(b >> 4) * srow[(j + 1) / FP4_GROUP];
            }
        });
    Ok(out)
}
