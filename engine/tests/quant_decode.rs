//! The FP8 / FP4 / ue8m0 decode tables against independent arithmetic, every code.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::checkpoint::dequant::{
    e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, fp4_group_scaled, fp8_block_scaled,
};

/// `(-1)^s * 2^(e-bias) * (1 + m/2^mbits)`, subnormal `2^(1-bias) * m/2^mbits` at e = 0.
fn minifloat(code: u32, ebits: u32, mbits: u32, bias: i32) -> f64 {
    let s = code >> (ebits + mbits);
    let e = ((code >> mbits) & ((1 << ebits) - 1)) as i32;
    let m = f64::from(code & ((1 << mbits) - 1)) / f64::from(1u32 << mbits);
    let v = if e == 0 {
        2f64.powi(1 - bias) * m
    } else {
        2f64.powi(e - bias) * (1.0 + m)
    };
    if s == 1 {
        -v
    } else {
        v
    }
}

#[test]
fn e4m3_every_byte() {
    for b in 0..=255u8 {
        let got = e4m3_to_f32(b);
        if b & 0x7f == 0x7f {
            assert!(got.is_nan(), "{b:#04x} is NaN");
            continue;
        }
        let want = minifloat(u32::from(b), 4, 3, 7);
        assert_eq!(f64::from(got), want, "{b:#04x}");
        assert_eq!(got.is_sign_negative(), b & 0x80 != 0, "{b:#04x} sign");
    }
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert!((0..=255u8).all(|b| !e4m3_to_f32(b).is_infinite()));
}

#[test]
fn e2m1_every_nibble() {
    let magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for n in 0..16u8 {
        let want = minifloat(u32::from(n), 2, 1, 1);
        assert_eq!(f64::from(e2m1_to_f32(n)), want, "{n:#x}");
        assert_eq!(
            f64::from(e2m1_to_f32(n)).abs(),
            magnitudes[usize::from(n & 7)]
        );
    }
}

#[test]
fn e8m0_every_byte() {
    for b in 0..=254u8 {
        let want = 2f64.powi(i32::from(b) - 127);
        assert_eq!(f64::from(e8m0_to_f32(b).unwrap()), want, "{b}");
    }
    assert_eq!(e8m0_to_f32(255), None);
}

#[test]
fn block_and_group_scaled_products_use_the_right_scale() {
    // 130 x 129: a 2 x 2 scale grid whose last block row and column hold one element.
    let (rows, cols) = (130, 129);
    let q: Vec<u8> = (0..rows * cols).map(|i| (i % 0x7e) as u8).collect();
    let scale = [127u8, 128, 100, 254];
    let w = fp8_block_scaled(&q, rows, cols, &scale).unwrap();
    for i in 0..rows {
        for j in 0..cols {
            let s = scale[(i / 128) * 2 + j / 128];
            let want = f64::from(e4m3_to_f32(q[i * cols + j])) * 2f64.powi(i32::from(s) - 127);
            assert_eq!(f64::from(w[i * cols + j]), want, "({i}, {j})");
        }
    }
    assert!(fp8_block_scaled(&q, rows, cols, &[127, 128, 255, 1]).is_err());
    assert!(fp8_block_scaled(&q, rows, cols, &scale[..3]).is_err());

    // 2 x 64 FP4: low nibble is the even element; one scale per 32 columns.
    let packed: Vec<u8> = (0..64).map(|k| (k * 37 % 256) as u8).collect();
    let scale = [120u8, 130, 127, 1];
    let w = fp4_group_scaled(&packed, 2, 64, &scale).unwrap();
    for i in 0..2 {
        for j in 0..64 {
            let byte = packed[i * 32 + j / 2];
            let nibble = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
            let s = scale[i * 2 + j / 32];
            let want = f64::from(e2m1_to_f32(nibble)) * 2f64.powi(i32::from(s) - 127);
            assert_eq!(f64::from(w[i * 64 + j]), want, "({i}, {j})");
        }
    }
    assert!(fp4_group_scaled(&packed, 2, 64, &[120, 255, 127, 1]).is_err());
}
