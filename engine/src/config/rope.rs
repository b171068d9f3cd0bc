//! Rope parameters: the "main" and "compress" families as transformers resolves them
//! (flat legacy `rope_scaling` or nested `rope_parameters`, YaRN defaults derived), and their
//! inverse frequencies computed with transformers' float32 steps.

use serde_json::{Map, Value};

use super::error::{ensure, field_err, Res};
use super::fields::Obj;

/// Rope frequency scaling of one rope family.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum RopeScaling {
    Default,
    /// YaRN with every derived value resolved. `attention_factor` is 1.0 for the compress rope of a
    /// flat (legacy `rope_scaling`) config when unset, as `DeepseekV4Config.__post_init__` injects;
    /// otherwise an unset value is derived from `factor` / `mscale` / `mscale_all_dim` like
    /// `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
    },
}

/// One rope family (`rope_parameters.main` or `rope_parameters.compress`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RopeParams {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// `int(head_dim * partial_rotary_factor)` as Python computes it.
pub(super) fn rope_dim_of(head_dim: usize, prf: f64, field: &str) -> Res<usize> {
    let d = head_dim as f64 * prf;
    if !d.is_finite() || d < 0.0 {
        return Err(field_err(
            field,
            format!("gives an invalid rope dimension {d}"),
        ));
    }
    Ok(d.trunc() as usize)
}

/// Returns `(main, compress)`.
pub(super) fn parse_rope(
    f: &Obj,
    max_pos: usize,
    head_dim: usize,
    rope_dim: usize,
) -> Res<(RopeParams, RopeParams)> {
    let rope_theta = f.f64_or("rope_theta", 10_000.0)?;
    let compress_rope_theta = f.f64_or("compress_rope_theta", 160_000.0)?;
    // `convert_rope_params_to_dict`: `rope_scaling or rope_parameters` (an empty dict is falsy).
    let (dict, name) = match f.opt_object("rope_scaling")? {
        Some(d) if !d.is_empty() => (Some(d), "rope_scaling"),
        _ => (f.opt_object("rope_parameters")?, "rope_parameters"),
    };
    let empty = Map::new();
    let dict = dict.unwrap_or(&empty);
    if !dict.contains_key("main") && !dict.contains_key("compress") {
        // Flat form: main = plain rope at `rope_theta`; compress = the flat dict at
        // `compress_rope_theta` with `attention_factor` defaulting to 1.0 for yarn.
        check_theta(rope_theta, "rope_theta")?;
        let main = RopeParams {
            theta: rope_theta,
            scaling: RopeScaling::Default,
        };
        let sub = Obj {
            map: dict,
            prefix: name,
        };
        // The flat dict's own `rope_theta` (if any) is overwritten by `compress_rope_theta`.
        check_theta(compress_rope_theta, "compress_rope_theta")?;
        let compress = rope_family(&sub, compress_rope_theta, max_pos, true)?;
        return Ok((main, compress));
    }
    let family = |label: &str| -> Res<RopeParams> {
        let field = format!("{name}.{label}");
        let Some(Value::Object(m)) = dict.get(label) else {
            return Err(field_err(
                field,
                "nested rope parameters need both `main` and `compress` objects",
            ));
        };
        let sub = Obj {
            map: m,
            prefix: &field,
        };
        // Nested families default their theta to the top-level `rope_theta` (standardize_rope_params).
        let theta = sub.f64_or("rope_theta", rope_theta)?;
        let theta_field = if sub.get("rope_theta").is_some() {
            sub.name("rope_theta")
        } else {
            "rope_theta".into()
        };
        check_theta(theta, &theta_field)?;
        // A per-family `partial_rotary_factor` sets that family's rope width in transformers; the
        // engine has one `qk_rope_head_dim`, so the families must agree with it.
        if let Some(p) = sub.opt_f64("partial_rotary_factor")? {
            let prf_field = sub.name("partial_rotary_factor");
            let d = rope_dim_of(head_dim, p, &prf_field)?;
            ensure(d == rope_dim, &prf_field, || {
                format!("gives rope dim {d}, but qk_rope_head_dim is {rope_dim}")
            })?;
        }
        rope_family(&sub, theta, max_pos, false)
    };
    Ok((family("main")?, family("compress")?))
}

/// One rope family dict. `theta` is already resolved; `flat_compress` applies the
/// `attention_factor = 1.0` default that `__post_init__` injects only in the flat form.
fn rope_family(sub: &Obj, theta: f64, max_pos: usize, flat_compress: bool) -> Res<RopeParams> {
    // standardize_rope_params: `setdefault("rope_type", get("type", "default"))`.
    let (type_key, type_value) = match sub.get("rope_type") {
        Some(v) => ("rope_type", Some(v)),
        None => ("type", sub.get("type")),
    };
    let rope_type = match type_value {
        None => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(sub.wrong(type_key, "a rope type string", other)),
    };
    match rope_type {
        "default" => Ok(RopeParams {
            theta,
            scaling: RopeScaling::Default,
        }),
        "yarn" => {
            let orig = sub
                .opt_f64("original_max_position_embeddings")?
                .unwrap_or(max_pos as f64);
            let orig_field = sub.name("original_max_position_embeddings");
            ensure(orig.is_finite() && orig > 0.0, &orig_field, || {
                format!("must be > 0, got {orig}")
            })?;
            let factor = match sub.get("factor") {
                None => return Err(field_err(sub.name("factor"), "required for yarn rope")),
                Some(Value::Null) => max_pos as f64 / orig,
                Some(_) => sub.f64_or("factor", 1.0)?,
            };
            ensure(
                factor.is_finite() && factor > 0.0,
                &sub.name("factor"),
                || format!("must be > 0, got {factor}"),
            )?;
            let attention_factor = match sub.opt_f64("attention_factor")? {
                Some(a) => a,
                None if flat_compress && sub.get("attention_factor").is_none() => 1.0,
                None => {
                    let mscale = sub.opt_f64("mscale")?.unwrap_or(0.0);
                    let mscale_all_dim = sub.opt_f64("mscale_all_dim")?.unwrap_or(0.0);
                    if mscale != 0.0 && mscale_all_dim != 0.0 {
                        get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                    } else {
                        get_mscale(factor, 1.0)
                    }
                }
            };
            // `rope_parameters.get("beta_fast") or 32`: missing, null and 0 all mean the default.
            let or_default = |key: &str, d: f64| -> Res<f64> {
                Ok(sub.opt_f64(key)?.filter(|v| *v != 0.0).unwrap_or(d))
            };
            Ok(RopeParams {
                theta,
                scaling: RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: orig,
                    beta_fast: or_default("beta_fast", 32.0)?,
                    beta_slow: or_default("beta_slow", 1.0)?,
                    attention_factor,
                },
            })
        }
        other => Err(field_err(
            sub.name("rope_type"),
            format!("unsupported rope type \"{other}\" (expected \"default\" or \"yarn\")"),
        )),
    }
}

fn check_theta(theta: f64, field: &str) -> Res<()> {
    ensure(theta.is_finite() && theta > 1.0, field, || {
        format!("rope base must be > 1, got {theta}")
    })
}

/// `get_mscale` of `_compute_yarn_parameters`.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeParams {
    /// Inverse frequencies (one per rotated pair, `ceil(rope_dim / 2)` entries) computed with the
    /// same float32 steps as transformers: `compute_default_rope_parameters` /
    /// `_compute_yarn_parameters`. `rope_dim` should be even (true of `qk_rope_head_dim`).
    pub fn inv_freq(&self, rope_dim: usize) -> Vec<f32> {
        let dim_f = rope_dim as f32;
        let base = self.theta as f32;
        // torch: `base ** (arange(0, dim, 2).float() / dim)`, every step in float32.
        let pos_freqs: Vec<f32> = (0..rope_dim)
            .step_by(2)
            .map(|i| base.powf(i as f32 / dim_f))
            .collect();
        match &self.scaling {
            RopeScaling::Default => pos_freqs.iter().map(|p| 1.0f32 / p).collect(),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                ..
            } => {
                // transformers reads `truncate` from `config.rope_parameters` — the NESTED
                // {main, compress} dict for V4 — so a per-family `truncate` is never seen and the
                // correction range is always truncated.
                let truncate = true;
                let (low, high) = find_correction_range(
                    *beta_fast,
                    *beta_slow,
                    rope_dim,
                    self.theta,
                    *original_max_position_embeddings,
                    truncate,
                );
                // linear_ramp_factor(low, high, dim // 2): Python scalars, cast to f32 by torch.
                let max = if low == high { high + 0.001 } else { high };
                let min_f = low as f32;
                let span = (max - low) as f32;
                let factor_f = *factor as f32;
                pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(k, &p)| {
                        let ramp = ((k as f32 - min_f) / span).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0f32 - ramp;
                        let extrapolation = 1.0f32 / p;
                        let interpolation = 1.0f32 / (factor_f * p);
                        interpolation * (1.0f32 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        }
    }

    /// Factor applied to cos and sin: 1.0 for default rope, YaRN's `attention_factor` otherwise.
    pub fn attention_scaling(&self) -> f64 {
        match &self.scaling {
            RopeScaling::Default => 1.0,
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
        }
    }
}

/// `find_correction_range` of `_compute_yarn_parameters` (Python float math).
fn find_correction_range(
    low_rot: f64,
    high_rot: f64,
    dim: usize,
    base: f64,
    max_pos: f64,
    truncate: bool,
) -> (f64, f64) {
    let correction_dim = |rot: f64| {
        (dim as f64 * (max_pos / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(low_rot), correction_dim(high_rot));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}
