//! fp8 e4m3 ("e4m3fn": no infinities, largest finite 448) with one fp32 scale per entry,
//! as serving systems store the lightning indexer's keys: `scale = amax / 448`,
//! `code = e4m3(v / scale)`, dequantised as `e4m3_to_f32(code) * scale`.

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Round-to-nearest-even conversion, saturating at +-448; NaN maps to the NaN code.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Below the smallest normal (2^-6) the spacing is 2^-9; `a * 512` is exact here, and
    // a rounded value of 8 is exactly the code of the smallest normal (0x08).
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mant = bits & 0x7f_ffff;
    let keep = mant >> 20;
    let rem = mant & 0xf_ffff;
    let half = 0x8_0000;
    let mut m = keep;
    if rem > half || (rem == half && keep & 1 == 1) {
        m += 1;
        if m == 8 {
            m = 0;
            e += 1;
        }
    }
    let code = (((e + 7) as u32) << 3) | m;
    sign | code.min(0x7e) as u8
}

pub fn e4m3_to_f32(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        s * m * (1.0 / 512.0)
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Quantise one entry: codes into `codes`, returns the scale.
pub fn quantize_entry(vals: &[f32], codes: &mut [u8]) -> f32 {
    let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / E4M3_MAX;
    for (c, &v) in codes.iter_mut().zip(vals) {
        *c = if scale > 0.0 {
            f32_to_e4m3(v / scale)
        } else {
            0
        };
    }
    scale
}

pub fn dequantize_entry(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = e4m3_to_f32(c) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn finite_codes() -> impl Iterator<Item = u8> {
        (0u8..=255).filter(|b| b & 0x7f != 0x7f)
    }

    #[test]
    fn every_code_round_trips() {
        for b in finite_codes() {
            let v = e4m3_to_f32(b);
            assert_eq!(f32_to_e4m3(v), b, "code {b:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
    }

    /// Brute force: the nearest representable value, ties to the even code.
    fn nearest(x: f32) -> u8 {
        let mut best = 0u8;
        let mut best_d = f32::INFINITY;
        for b in finite_codes() {
            let d = (e4m3_to_f32(b) - x).abs();
            let better = d < best_d || (d == best_d && b & 1 == 0 && best & 1 == 1);
            let same_sign = (b & 0x80 != 0) == x.is_sign_negative() || e4m3_to_f32(b) == 0.0;
            if better && same_sign {
                best = b;
                best_d = d;
            }
        }
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn conversion_is_nearest_even(x in -447.9f32..447.9) {
            let got = f32_to_e4m3(x);
            let want = nearest(x);
            prop_assert_eq!(e4m3_to_f32(got), e4m3_to_f32(want), "x = {}", x);
        }
    }

    #[test]
    fn entry_error_is_bounded_by_the_scale() {
        let vals: Vec<f32> = (0..128)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 6.0)
            .collect();
        let mut codes = vec![0u8; 128];
        let scale = quantize_entry(&vals, &mut codes);
        let mut back = vec![0f32; 128];
        dequantize_entry(&codes, scale, &mut back);
        let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in vals.iter().zip(&back) {
            // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals,
            // absolute error <= scale * 2^-10 in the subnormal range.
            assert!(
                (a - b).abs() <= a.abs() / 16.0 + scale / 1024.0,
                "{a} vs {b}"
            );
        }
        assert_eq!(back.iter().fold(0f32, |m, v| m.max(v.abs())), amax);
        let mut zero = vec![0u8; 4];
        assert_eq!(quantize_entry(&[0.0; 4], &mut zero), 0.0);
        assert_eq!(zero, vec![0; 4]);
    }
}
