//! DeepSeek's activation quantization (`act_quant`, `fp4_act_quant` of the reference's
//! `kernel.py`), as the quantize-then-dequantize simulation the reference itself uses for
//! its KV and indexer and that an FP8 GEMM's inputs amount to.
//!
//! Per block of `block` consecutive values (the reference asserts whole blocks; a last
//! partial block here is quantized on its own values, which is what zero padding gives):
//! `amax = max(max|x|, floor)`, `scale = 2^ceil(log2(amax * (1/max)))` taken from the f32
//! bits as the kernel's `fast_round_scale` does, `code = round_nearest_even(clamp(x /
//! scale, -max, max))` in the target format, value `code * scale`. The reference feeds
//! bf16 activations; pdserve's are f32, quantized as they are.

pub use crate::checkpoint::dequant::e2m1_to_f32;
use crate::kv::fp8::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};

/// Elements sharing one scale in an FP8 activation (the linears' `block_size`).
pub const ACT_BLOCK: usize = 128;
/// Elements sharing one scale in the FP4 simulation (`fp4_block_size`).
pub const FP4_BLOCK: usize = 32;
/// Largest e2m1 magnitude.
pub const FP4_MAX: f32 = 6.0;
/// `act_quant`'s amax floor.
const FP8_AMAX_FLOOR: f32 = 1e-4;
/// `fp4_act_quant`'s amax floor: `6 * 2^-126`.
const FP4_AMAX_FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;

/// `fast_round_scale(amax, max_inv)`: `2^ceil(log2(amax * max_inv))`, the ceiling read
/// from the product's exponent and mantissa bits (a power of two maps to itself).
pub fn pow2_scale(amax: f32, max_inv: f32) -> f32 {
    let bits = (amax * max_inv).to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + i32::from(bits & 0x7f_ffff != 0);
    f32::from_bits(((exp + 127).clamp(0, 255) as u32) << 23)
}

/// `1/max` as the kernel's constant: the f64 quotient rounded to f32.
fn inv(max: f32) -> f32 {
    (1.0 / f64::from(max)) as f32
}

fn amax(vals: &[f32]) -> f32 {
    vals.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Quantize one FP8 block: e4m3 codes into `codes`, returns the power-of-two scale.
pub fn quantize_e4m3_block(vals: &[f32], codes: &mut [u8]) -> f32 {
    let scale = pow2_scale(amax(vals).max(FP8_AMAX_FLOOR), inv(E4M3_MAX));
    for (c, &v) in codes.iter_mut().zip(vals) {
        *c = f32_to_e4m3((v / scale).clamp(-E4M3_MAX, E4M3_MAX));
    }
    scale
}

/// `act_quant(x, block, "ue8m0", inplace=True)`: every value replaced by its FP8 value.
pub fn act_quant(vals: &mut [f32], block: usize) {
    let mut codes = vec![0u8; block];
    for chunk in vals.chunks_mut(block) {
        let scale = quantize_e4m3_block(chunk, &mut codes);
        for (v, &c) in chunk.iter_mut().zip(&codes) {
            *v = e4m3_to_f32(c) * scale;
        }
    }
}

/// Round-to-nearest-even onto e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), saturating at 6;
/// bit 3 is the sign.
pub fn f32_to_e2m1(x: f32) -> u8 {
    let a = x.abs();
    // Midpoints between neighbours; a tie goes to the even code (mantissa bit 0).
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    code | if x.is_sign_negative() { 8 } else { 0 }
}

/// `fp4_act_quant(x, block, inplace=True)`: every value replaced by its FP4 value.
pub fn fp4_act_quant(vals: &mut [f32], block: usize) {
    for chunk in vals.chunks_mut(block) {
        let scale = pow2_scale(amax(chunk).max(FP4_AMAX_FLOOR), inv(FP4_MAX));
        for v in chunk.iter_mut() {
            *v = e2m1_to_f32(f32_to_e2m1((*v / scale).clamp(-FP4_MAX, FP4_MAX))) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_scale_is_the_ceiling_power_of_two() {
        assert_eq!(pow2_scale(448.0, inv(448.0)), 1.0);
        assert_eq!(pow2_scale(449.0, inv(448.0)), 2.0);
        assert_eq!(pow2_scale(6.0, inv(6.0)), 1.0);
        assert_eq!(pow2_scale(1.0, 0.75), 1.0);
        assert_eq!(pow2_scale(1.0, 0.5), 0.5);
        assert_eq!(pow2_scale(1.0, 0.3), 0.5);
    }

    #[test]
    fn e2m1_rounds_to_nearest_even_and_round_trips() {
        for c in 0u8..16 {
            assert_eq!(f32_to_e2m1(e2m1_to_f32(c)), c);
        }
        for (x, want) in [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
        ] {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "{x}");
        }
        for (x, want) in [(3.5, 4.0), (5.0, 4.0), (5.1, 6.0), (-0.8, -1.0), (9.0, 6.0)] {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "{x}");
        }
    }

    #[test]
    fn act_quant_keeps_block_amax_and_zero_blocks() {
        let mut v: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) / 7.0).collect();
        let before = v.clone();
        act_quant(&mut v, ACT_BLOCK);
        for (chunk, orig) in v.chunks(ACT_BLOCK).zip(before.chunks(ACT_BLOCK)) {
            for (a, b) in chunk.iter().zip(orig) {
                assert!((a - b).abs() <= b.abs() / 16.0 + 1e-6, "{a} vs {b}");
            }
        }
        let mut z = vec![0f32; 64];
        act_quant(&mut z, 64);
        assert!(z.iter().all(|&x| x == 0.0));
    }
}
