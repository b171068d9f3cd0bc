//! Scalar and row helpers the CPU backend's dense and attention ops share (a leaf: it
//! imports nothing of the backend).

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// In-place max-subtracted softmax.
pub fn softmax(v: &mut [f32]) {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for x in v.iter_mut() {
        *x = (*x - m).exp();
        s += *x;
    }
    for x in v.iter_mut() {
        *x /= s;
    }
}

/// `x * rsqrt(mean(x^2) + eps)`, times `w` if given.
pub fn rms_norm_into(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ss + eps).sqrt();
    match w {
        Some(w) => {
            for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
                *o = g * (v * r);
            }
        }
        None => {
            for (o, v) in out.iter_mut().zip(x) {
                *o = v * r;
            }
        }
    }
}
