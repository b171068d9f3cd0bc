//! Memory-mapped safetensors checkpoints (single file or sharded with an index), the tensor
//! inventory transformers' `DeepseekV4ForCausalLM.state_dict()` saves, and validation of one
//! against the other.

pub mod dequant;
mod formats;
pub mod names;
mod reader;
pub mod stored;

use std::collections::BTreeSet;
use std::fmt;
use std::io::IsTerminal;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub use reader::{scale_name, Checkpoint, CheckpointTensor, RawTensor, StoredPart, StoredScale};

use crate::config::{LayerKind, MlpKind, ModelConfig};

pub use formats::{weight_format, WeightFormat};
pub use stored::StoredWeight;

/// Element type of a tensor as stored on disk.
pub use safetensors::Dtype as DiskDtype;

pub(crate) const SINGLE_FILE: &str = "model.safetensors";
pub(crate) const INDEX_FILE: &str = "model.safetensors.index.json";
/// How many entries of each problem kind a [`ValidationReport`] prints.
const REPORT_CAP: usize = 20;
/// Elements converted per parallel work item.
pub(crate) const CONVERT_CHUNK: usize = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("no {SINGLE_FILE} or {INDEX_FILE} in {}", dir.display())]
    NoCheckpoint { dir: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a valid safetensors file: {source}", path.display())]
    Format {
        path: PathBuf,
        #[source]
        source: safetensors::SafeTensorError,
    },
    #[error("invalid index {}: {reason}", path.display())]
    Index { path: PathBuf, reason: String },
    #[error("tensor `{name}` is not in the checkpoint")]
    NotFound { name: String },
    #[error("tensor `{name}` has dtype {dtype:?}; expected {expected}")]
    Dtype {
        name: String,
        dtype: DiskDtype,
        expected: &'static str,
    },
    #[error("tensor `{name}`: {reason}")]
    Corrupt { name: String, reason: String },
    #[error("checkpoint does not match the model config:\n{0}")]
    Invalid(ValidationReport),
}

/// One tensor the model needs: name and shape as transformers saves them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// Integer tensor (`tid2eid`); all others are floating point.
    pub int: bool,
}

/// Name of the output projection to load: `lm_head.weight`, or the embedding when tied
/// (tied checkpoints usually omit `lm_head.weight`; transformers ties it to `embed_tokens`).
pub fn lm_head_name(cfg: &ModelConfig) -> &'static str {
    if cfg.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    }
}

/// Accumulates [`ExpectedTensor`]s.
struct Inventory(Vec<ExpectedTensor>);

impl Inventory {
    fn float(&mut self, name: String, shape: &[usize]) {
        self.0.push(ExpectedTensor {
            name,
            shape: shape.to_vec(),
            int: false,
        });
    }

    fn int(&mut self, name: String, shape: &[usize]) {
        self.0.push(ExpectedTensor {
            name,
            shape: shape.to_vec(),
            int: true,
        });
    }
}

/// Every persistent tensor of `DeepseekV4ForCausalLM.state_dict()` for `cfg`, in module order.
/// Rotary `inv_freq` buffers are non-persistent and never saved; unweighted norms (`q_b_norm`,
/// the hyper-connection `input_norm`s) have no parameters. `lm_head.weight` is listed only when
/// embeddings are untied (see [`validate`] for the tied case).
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<ExpectedTensor> {
    let (v, h, nh, hd) = (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.head_dim,
    );
    let (ql, e, i, hc) = (
        cfg.q_lora_rank,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
        cfg.hc_mult,
    );
    let (ihd, inh) = (cfg.index_head_dim, cfg.index_n_heads);
    let og = cfg.o_groups * cfg.o_lora_rank;
    let mut t = Inventory(Vec::new());
    t.float("model.embed_tokens.weight".into(), &[v, h]);
    for (layer, (kind, mlp)) in cfg.layer_types.iter().zip(&cfg.mlp_layer_types).enumerate() {
        let p = format!("model.layers.{layer}.");
        let a = format!("{p}self_attn.");
        t.float(format!("{a}q_a_proj.weight"), &[ql, h]);
        t.float(format!("{a}q_a_norm.weight"), &[ql]);
        t.float(format!("{a}q_b_proj.weight"), &[nh * hd, ql]);
        t.float(format!("{a}kv_proj.weight"), &[hd, h]);
        t.float(format!("{a}kv_norm.weight"), &[hd]);
        // DeepseekV4GroupedLinear(nh * hd / o_groups, o_groups * o_lora_rank): one nn.Linear weight.
        t.float(format!("{a}o_a_proj.weight"), &[og, nh * hd / cfg.o_groups]);
        t.float(format!("{a}o_b_proj.weight"), &[h, og]);
        t.float(format!("{a}sinks"), &[nh]);
        let c = format!("{a}compressor.");
        match kind {
            LayerKind::Sliding => {}
            LayerKind::Hca => {
                t.float(format!("{c}kv_proj.weight"), &[hd, h]);
                t.float(format!("{c}gate_proj.weight"), &[hd, h]);
                t.float(format!("{c}position_bias"), &[cfg.compress_rate_hca, hd]);
                t.float(format!("{c}kv_norm.weight"), &[hd]);
            }
            LayerKind::Csa => {
                let rate = cfg.compress_rate_csa;
                t.float(format!("{c}kv_proj.weight"), &[2 * hd, h]);
                t.float(format!("{c}gate_proj.weight"), &[2 * hd, h]);
                t.float(format!("{c}position_bias"), &[rate, 2 * hd]);
                t.float(format!("{c}kv_norm.weight"), &[hd]);
                let x = format!("{c}indexer.");
                t.float(format!("{x}kv_proj.weight"), &[2 * ihd, h]);
                t.float(format!("{x}gate_proj.weight"), &[2 * ihd, h]);
                t.float(format!("{x}position_bias"), &[rate, 2 * ihd]);
                t.float(format!("{x}kv_norm.weight"), &[ihd]);
                t.float(format!("{x}q_b_proj.weight"), &[inh * ihd, ql]);
                t.float(format!("{x}scorer.weights_proj.weight"), &[inh, h]);
            }
        }
        let m = format!("{p}mlp.");
        t.float(format!("{m}gate.weight"), &[e, h]);
        match mlp {
            // nn.Buffer (persistent by default).
            MlpKind::TopK => t.float(format!("{m}gate.e_score_correction_bias"), &[e]),
            // nn.Buffer(..., persistent=True), int64.
            MlpKind::HashMoe => t.int(format!("{m}gate.tid2eid"), &[v, cfg.num_experts_per_tok]),
        }
        t.float(format!("{m}experts.gate_up_proj"), &[e, 2 * i, h]);
        t.float(format!("{m}experts.down_proj"), &[e, h, i]);
        t.float(format!("{m}shared_experts.gate_proj.weight"), &[i, h]);
        t.float(format!("{m}shared_experts.up_proj.weight"), &[i, h]);
        t.float(format!("{m}shared_experts.down_proj.weight"), &[h, i]);
        t.float(format!("{p}input_layernorm.weight"), &[h]);
        t.float(format!("{p}post_attention_layernorm.weight"), &[h]);
        for site in ["attn_hc", "ffn_hc"] {
            t.float(format!("{p}{site}.fn"), &[(2 + hc) * hc, hc * h]);
            t.float(format!("{p}{site}.base"), &[(2 + hc) * hc]);
            t.float(format!("{p}{site}.scale"), &[3]);
        }
    }
    t.float("model.norm.weight".into(), &[h]);
    t.float("model.hc_head.hc_fn".into(), &[hc, hc * h]);
    t.float("model.hc_head.hc_base".into(), &[hc]);
    t.float("model.hc_head.hc_scale".into(), &[1]);
    if !cfg.tie_word_embeddings {
        t.float("lm_head.weight".into(), &[v, h]);
    }
    t.0
}

/// Keys transformers drops on load: `(^|\.)mtp\..*` (multi-token-prediction layers).
/// A stored shape that differs from the config's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeMismatch {
    pub name: String,
    pub expected: Vec<usize>,
    pub found: Vec<usize>,
}

/// Everything wrong with a checkpoint relative to a config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValidationReport {
    pub missing: Vec<String>,
    pub unexpected: Vec<String>,
    pub wrong_shape: Vec<ShapeMismatch>,
    /// Tensors whose dtype is unsupported for their role (float: F32/BF16/F16 or the quantized
    /// format the config prescribes, with F8_E8M0 scales; int: I64/I32).
    pub bad_dtype: Vec<(String, DiskDtype)>,
    /// Tensors whose values cannot be used (e.g. `tid2eid` expert ids out of range).
    pub bad_values: Vec<String>,
}

impl ValidationReport {
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.wrong_shape.is_empty()
            && self.bad_dtype.is_empty()
            && self.bad_values.is_empty()
    }
}

fn write_section<T>(
    f: &mut fmt::Formatter<'_>,
    title: &str,
    items: &[T],
    line: impl Fn(&T) -> String,
) -> fmt::Result {
    if items.is_empty() {
        return Ok(());
    }
    writeln!(f, "{title} ({}):", items.len())?;
    for item in items.iter().take(REPORT_CAP) {
        writeln!(f, "  {}", line(item))?;
    }
    if items.len() > REPORT_CAP {
        writeln!(f, "  ... and {} more", items.len() - REPORT_CAP)?;
    }
    Ok(())
}

impl fmt::Display for ValidationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_section(f, "missing tensors", &self.missing, |n| n.clone())?;
        write_section(f, "unexpected tensors", &self.unexpected, |n| n.clone())?;
        write_section(f, "wrong shapes", &self.wrong_shape, |m| {
            format!("{}: expected {:?}, found {:?}", m.name, m.expected, m.found)
        })?;
        write_section(f, "unsupported dtypes", &self.bad_dtype, |(n, d)| {
            format!("{n}: {d:?}")
        })?;
        write_section(f, "invalid values", &self.bad_values, |s| s.clone())
    }
}

fn int_dtype(d: DiskDtype) -> bool {
    matches!(d, DiskDtype::I64 | DiskDtype::I32)
}

/// Check `ckpt` against `cfg`: missing, unexpected, wrongly shaped and wrongly typed tensors
/// (quantized weights: the dtype the config's `quantization_config` prescribes, and a scale
/// of the right dtype and shape) and out-of-range `tid2eid` entries, all reported together
/// in one [`CheckpointError::Invalid`].
/// `mtp.*` tensors are ignored; with tied embeddings `lm_head.weight` may be absent.
pub fn validate(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<(), CheckpointError> {
    let mut expected = expected_tensors(cfg);
    let optional: BTreeSet<String> = if cfg.tie_word_embeddings && ckpt.contains("lm_head.weight") {
        expected.push(ExpectedTensor {
            name: "lm_head.weight".into(),
            shape: vec![cfg.vocab_size, cfg.hidden_size],
            int: false,
        });
        std::iter::once("lm_head.weight".to_string()).collect()
    } else {
        BTreeSet::new()
    };
    let mut report = ValidationReport::default();
    for t in &expected {
        let (Some(shape), Some(dtype)) = (ckpt.shape(&t.name), ckpt.dtype(&t.name)) else {
            if !optional.contains(&t.name) {
                report.missing.push(t.name.clone());
            }
            continue;
        };
        let mut usable = true;
        if shape != t.shape {
            report.wrong_shape.push(ShapeMismatch {
                name: t.name.clone(),
                expected: t.shape.clone(),
                found: shape,
            });
            usable = false;
        }
        if t.int {
            if !int_dtype(dtype) {
                report.bad_dtype.push((t.name.clone(), dtype));
                usable = false;
            }
        } else {
            let format = weight_format(cfg, &t.name);
            usable &= formats::check_stored(ckpt, &t.name, format, &mut report);
        }
        if t.int && usable {
            check_expert_ids(ckpt, &t.name, cfg.n_routed_experts, &mut report);
        }
    }
    let known: BTreeSet<&str> = expected.iter().map(|t| t.name.as_str()).collect();
    report.unexpected.extend(
        ckpt.names()
            .into_iter()
            .filter(|n| !known.contains(n.as_str())),
    );
    if report.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::Invalid(report))
    }
}

fn check_expert_ids(
    ckpt: &Checkpoint,
    name: &str,
    n_experts: usize,
    report: &mut ValidationReport,
) {
    match ckpt.tensor_i64(name) {
        Ok((shape, ids)) => {
            // A token's experts must be distinct: DeepSeek's tables are permutation
            // prefixes, and the CUDA MoE kernels give an expert at most one pick per row.
            let k = shape.get(1).copied().unwrap_or(1).max(1);
            let repeats: Vec<(usize, i64)> = ids
                .chunks(k)
                .enumerate()
                .filter_map(|(t, row)| {
                    row.iter()
                        .enumerate()
                        .find(|(i, e)| row[..*i].contains(e))
                        .map(|(_, &e)| (t, e))
                })
                .collect();
            if let Some(&(token, expert)) = repeats.first() {
                report.bad_values.push(format!(
                    "{name}: {} tokens route to one expert twice (first: token {token}, expert {expert})",
                    repeats.len()
                ));
            }
            let bad = ids
                .iter()
                .filter(|&&x| usize::try_from(x).map_or(true, |x| x >= n_experts))
                .count();
            if let Some(first) = ids
                .iter()
                .find(|&&x| usize::try_from(x).map_or(true, |x| x >= n_experts))
            {
                report.bad_values.push(format!(
                    "{name}: {bad} expert ids outside 0..{n_experts} (first: {first})"
                ));
            }
        }
        Err(e) => report.bad_values.push(format!("{name}: {e}")),
    }
}

/// Byte-level load progress on stderr; drawn only for loads of at least
/// [`LoadProgress::MIN_BYTES`] when stderr is a terminal.
#[derive(Debug, Clone)]
pub struct LoadProgress {
    bar: Option<ProgressBar>,
}

impl LoadProgress {
    pub const MIN_BYTES: u64 = 256 << 20;

    pub fn new(total_bytes: u64) -> Self {
        Self::with_label(total_bytes, "loading weights")
    }

    /// A bar that starts with `label` instead of "loading weights".
    pub fn with_label(total_bytes: u64, label: &str) -> Self {
        let visible = total_bytes >= Self::MIN_BYTES && std::io::stderr().is_terminal();
        let bar = visible.then(|| {
            let bar = ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::stderr());
            let template = format!(
                "{label} {{wide_bar}} {{bytes}}/{{total_bytes}} ({{binary_bytes_per_sec}}, eta {{eta}})"
            );
            if let Ok(style) = ProgressStyle::with_template(&template) {
                bar.set_style(style);
            }
            bar
        });
        LoadProgress { bar }
    }

    /// Whether a bar is being drawn.
    pub fn is_visible(&self) -> bool {
        self.bar.is_some()
    }

    /// Count `bytes` more as loaded (callable from several threads through clones).
    pub fn advance(&self, bytes: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
