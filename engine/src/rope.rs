//! Interleaved partial rope tables (pairs `2i, 2i+1` of the trailing `dim` channels).

use crate::config::RopeParams;

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// One inverse frequency per rotated pair, as transformers computes them in f32.
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN attention factor; 1.0 otherwise).
    scaling: f32,
}

impl Rope {
    pub fn new(params: &RopeParams, rope_dim: usize) -> Self {
        Rope {
            inv_freq: params.inv_freq(rope_dim),
            scaling: params.attention_scaling() as f32,
        }
    }

    /// Rotated channels per head.
    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// `cos` and `sin` of each pair at `pos`, computed like torch: the product in f32, then cos/sin.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for (i, f) in self.inv_freq.iter().enumerate() {
            let a = f * p;
            cos[i] = a.cos() * self.scaling;
            sin[i] = a.sin() * self.scaling;
        }
    }

    /// Rotate the trailing `dim()` channels of `head` in place.
    pub fn apply(&self, head: &mut [f32], cos: &[f32], sin: &[f32], inverse: bool) {
        let rd = self.dim();
        let off = head.len() - rd;
        for i in 0..rd / 2 {
            let c = cos[i];
            let s = if inverse { -sin[i] } else { sin[i] };
            let x0 = head[off + 2 * i];
            let x1 = head[off + 2 * i + 1];
            head[off + 2 * i] = x0 * c + (-x1) * s;
            head[off + 2 * i + 1] = x1 * c + x0 * s;
        }
    }
}
