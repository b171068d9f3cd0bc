//! FP8 compressed-KV entries in FlashMLA's DeepSeek-V4 ("MODEL1") layout: per entry the
//! `nope = head_dim - rope_dim` non-rope values as e4m3 codes, then the `rope_dim` rope
//! values as bf16, in one row; and per entry one ue8m0 scale byte per 64 non-rope values,
//! padded to 8 bytes, in a second block after all rows (FlashMLA keeps a page's rows and its
//! scales apart the same way). V4: 448 + 128 bytes of row, 7 + 1 of scales = 584 B.
//!
//! Quantization is the reference's `act_quant(kv[..., :-rope], 64, "ue8m0")` (see
//! [`crate::numerics`]), so storing a `deepseek`-numerics entry loses nothing the
//! reference does not lose, and decoding gives exactly the reference's simulated values.

use crate::checkpoint::dequant::e8m0_to_f32;
use crate::numerics::quantize_e4m3_block;
use half::bf16;

use super::fp8::e4m3_to_f32;

/// Non-rope values sharing one scale.
pub const SCALE_TILE: usize = 64;

/// Sizes of one FP8 compressed-KV entry, derived from the model's dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Fp8KvFormat {
    pub nope: usize,
    pub rope: usize,
}

impl Fp8KvFormat {
    pub fn new(head_dim: usize, rope_dim: usize) -> Self {
        Fp8KvFormat {
            nope: head_dim - rope_dim,
            rope: rope_dim,
        }
    }

    /// Scale tiles per entry (a last partial tile has its own scale).
    pub fn tiles(&self) -> usize {
        self.nope.div_ceil(SCALE_TILE)
    }

    /// Bytes of an entry's row: e4m3 non-rope values then bf16 rope values.
    pub fn row_bytes(&self) -> usize {
        self.nope + 2 * self.rope
    }

    /// Bytes of an entry's scales: one ue8m0 byte per tile, padded to 8.
    pub fn scale_bytes(&self) -> usize {
        self.tiles().next_multiple_of(8)
    }

    /// Bytes of one entry, row and scales.
    pub fn entry_bytes(&self) -> usize {
        self.row_bytes() + self.scale_bytes()
    }

    /// Encode `vals` (`nope + rope` values) into `row` and `scales`.
    pub fn encode(&self, vals: &[f32], row: &mut [u8], scales: &mut [u8]) {
        let (nope, rope) = vals.split_at(self.nope);
        let (codes, rope_bytes) = row.split_at_mut(self.nope);
        for ((v, c), s) in nope
            .chunks(SCALE_TILE)
            .zip(codes.chunks_mut(SCALE_TILE))
            .zip(scales.iter_mut())
        {
            *s = ue8m0_byte(quantize_e4m3_block(v, c));
        }
        scales[self.tiles()..].fill(0);
        for (v, b) in rope.iter().zip(rope_bytes.chunks_exact_mut(2)) {
            b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
        }
    }

    /// Decode `row` and `scales` into `out` (`nope + rope` values).
    pub fn decode(&self, row: &[u8], scales: &[u8], out: &mut [f32]) {
        let (nope, rope) = out.split_at_mut(self.nope);
        let (codes, rope_bytes) = row.split_at(self.nope);
        for ((o, c), &s) in nope
            .chunks_mut(SCALE_TILE)
            .zip(codes.chunks(SCALE_TILE))
            .zip(scales)
        {
            let scale = ue8m0_value(s);
            for (v, &b) in o.iter_mut().zip(c) {
                *v = e4m3_to_f32(b) * scale;
            }
        }
        for (v, b) in rope.iter_mut().zip(rope_bytes.chunks_exact(2)) {
            *v = bf16::from_le_bytes([b[0], b[1]]).to_f32();
        }
    }

    /// Replace `vals` by what a store and load gives.
    pub fn round_trip(&self, vals: &mut [f32]) {
        let mut row = vec![0u8; self.row_bytes()];
        let mut scales = vec![0u8; self.scale_bytes()];
        self.encode(vals, &mut row, &mut scales);
        self.decode(&row, &scales, vals);
    }
}

/// The ue8m0 byte of a power-of-two scale: its biased f32 exponent.
fn ue8m0_byte(scale: f32) -> u8 {
    ((scale.to_bits() >> 23) & 0xff) as u8
}

/// `2^(b - 127)` (NaN for the NaN byte 255, which the encoder never writes).
pub fn ue8m0_value(b: u8) -> f32 {
    e8m0_to_f32(b).unwrap_or(f32::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_entry_is_584_bytes() {
        let f = Fp8KvFormat::new(512, 64);
        assert_eq!(
            (f.nope, f.tiles(), f.row_bytes(), f.scale_bytes()),
            (448, 7, 576, 8)
        );
        assert_eq!(f.entry_bytes(), 584);
    }

    #[test]
    fn round_trip_is_idempotent_and_keeps_rope_in_bf16() {
        let f = Fp8KvFormat::new(144, 16);
        let mut v: Vec<f32> = (0..144)
            .map(|i| ((i * 29) % 83) as f32 / 9.0 - 4.0)
            .collect();
        let orig = v.clone();
        f.round_trip(&mut v);
        let once = v.clone();
        f.round_trip(&mut v);
        assert_eq!(v, once);
        for (a, b) in orig[128..].iter().zip(&v[128..]) {
            assert_eq!(bf16::from_f32(*a).to_f32(), *b);
        }
        assert_eq!(ue8m0_value(127), 1.0);
        assert_eq!(ue8m0_byte(0.25), 125);
    }
}
