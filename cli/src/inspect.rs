//! `pdserve inspect [MODEL_DIR]`: what a model is and what it occupies. The config summary
//! (dims, layer schedule, experts, quantization), every tensor's storage (dtype on disk,
//! shape, `.scale`, bytes on disk and in GPU memory) with totals per storage class, and the
//! KV layout and pool the flags give; `--json` prints all of it (the effective config and
//! layout in full) as one JSON object.
//!
//! Everything comes from config.json, the safetensors headers and the flags: no weight is
//! read and no device is opened, so it is instant on a 160 GB checkpoint. `backend` is
//! what `--device` selects: the CPU backend's name, or `cuda:N (not opened)`.

use crate::bench::table::{size, Table};
use crate::model_args::{BackendChoice, EnginePlan, ModelArgs};
use anyhow::Result;
use pdserve_engine::backend::TensorOps;
use pdserve_engine::checkpoint::Checkpoint;
use pdserve_engine::config::{ModelConfig, Quantization};
use pdserve_engine::model::storage::{storage_report, StorageReport};
use pdserve_engine::{CpuBackend, LoadFormat};
use pdserve_kernels::WeightDtype;
use std::fmt::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Model folder (the same as --model). Default: the embedded model.
    #[arg(value_name = "MODEL_DIR", conflicts_with = "model")]
    dir: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Print one JSON object (config, storage per tensor and class, KV layout and pool).
    #[arg(long)]
    json: bool,
}

pub fn inspect(mut a: InspectArgs) -> Result<()> {
    if let Some(d) = a.dir.take() {
        a.model.model = Some(d);
    }
    // The element size of GPU matrix weights under --cuda-weights (also with --device cpu:
    // the report says what a CUDA server would hold).
    let matrix_elem = match a.model.cuda_spec()?.weights {
        WeightDtype::Bf16 => 2,
        WeightDtype::F32 => 4,
    };
    // Headers and flags only: the config, the engine the flags describe (layout, pool
    // sizes) and the safetensors headers. Loading the weights would dequantize a released
    // FP8/FP4 checkpoint on the CPU (hours, hundreds of GB) just to print this.
    if a.model.load_format != LoadFormat::Auto {
        anyhow::bail!(
            "inspect reports the checkpoint's tensors; --load-format {:?} has none (leave it at auto)",
            a.model.load_format
        );
    }
    let plan = a.model.plan()?;
    let backend = backend_name(a.model.backend_choice()?);
    let storage = storage_report(&Checkpoint::open(&plan.spec.dir)?, matrix_elem);
    let report = Report {
        plan: &plan,
        backend,
        cuda_weights: &a.model.cuda_weights,
        storage: &storage,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// The backend the flags select, as the report names it. The CPU backend is named as it
/// names itself (opening it costs nothing); a CUDA device is not opened by `inspect`.
fn backend_name(choice: BackendChoice) -> String {
    match choice {
        BackendChoice::Cpu => CpuBackend.name(),
        BackendChoice::Cuda(n) => format!("cuda:{n} (not opened)"),
        BackendChoice::CudaElseCpu => "auto: cuda:0 if it opens, else cpu (not opened)".into(),
    }
}

struct Report<'a> {
    plan: &'a EnginePlan,
    backend: String,
    cuda_weights: &'a str,
    storage: &'a StorageReport,
}

impl Report<'_> {
    /// Bytes of the device pool: its pages and state slots.
    fn device_bytes(&self) -> usize {
        let (pool, layout) = (&self.plan.spec.pool, &self.plan.layout);
        pool.pages * layout.page_bytes + pool.states * layout.state_bytes
    }

    fn json(&self) -> serde_json::Value {
        let (p, layout) = (self.plan, &self.plan.layout);
        serde_json::json!({
            "model_dir": p.spec.dir,
            "backend": self.backend,
            "config": p.cfg,
            "storage": self.storage,
            "cuda_weights": self.cuda_weights,
            "kv_layout": layout,
            "kv_layout_fingerprint": layout.fingerprint(),
            "kv_pool": {
                "device_pages": p.spec.pool.pages,
                "state_slots": p.spec.pool.states,
                "host_pages": p.host_pages,
                "device_bytes": self.device_bytes(),
                "host_bytes": p.host_pages * layout.page_bytes,
            },
            "kv_audit": p.spec.kv_audit_every > 0,
        })
    }

    fn text(&self) -> String {
        let (p, storage) = (self.plan, self.storage);
        let mut out = format!("model: {}\n", p.spec.dir.display());
        out += &config_summary(&p.cfg);
        out += &format!("\ntensors ({}):\n", storage.tensors.len());
        out += &tensor_table(storage).to_string();
        out += &format!(
            "\nstorage classes (GPU: --cuda-weights {}, FP8/FP4 held as stored):\n",
            self.cuda_weights
        );
        out += &class_table(storage).to_string();
        if storage.unused_bytes > 0 {
            out += &format!("unused on disk (mtp.*): {}\n", bytes(storage.unused_bytes));
        }
        let layout = &p.layout;
        let _ = writeln!(
            out,
            "\nKV layout {} ({} tokens per page, {} per page); pool: {} device pages ({}), {} host pages ({}); backend {}",
            layout.fingerprint(),
            layout.page_tokens,
            size(layout.page_bytes as f64),
            p.spec.pool.pages,
            size(self.device_bytes() as f64),
            p.host_pages,
            size((p.host_pages * layout.page_bytes) as f64),
            self.backend,
        );
        out
    }
}

fn config_summary(c: &ModelConfig) -> String {
    let schedule: Vec<String> = c
        .layer_types
        .iter()
        .zip(&c.mlp_layer_types)
        .map(|(a, m)| format!("{a:?}/{m:?}"))
        .collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "  {} layers: {}",
        c.num_hidden_layers,
        schedule.join(", ")
    );
    let _ = writeln!(
        s,
        "  hidden {}, vocab {}, {} heads x {} (rope {}), q_lora {}, output {} groups x {}, hc_mult {}",
        c.hidden_size,
        c.vocab_size,
        c.num_attention_heads,
        c.head_dim,
        c.qk_rope_head_dim,
        c.q_lora_rank,
        c.o_groups,
        c.o_lora_rank,
        c.hc_mult
    );
    let _ = writeln!(
        s,
        "  experts: {} routed (top {}) + {} shared, intermediate {}; indexer {} heads x {}, top {}; window {}, compress rates CSA {} / HCA {}",
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.n_shared_experts,
        c.moe_intermediate_size,
        c.index_n_heads,
        c.index_head_dim,
        c.index_topk,
        c.sliding_window,
        c.compress_rate_csa,
        c.compress_rate_hca
    );
    let _ = writeln!(
        s,
        "  quantization: {}",
        quantization(c.quantization.as_ref())
    );
    s
}

fn quantization(q: Option<&Quantization>) -> String {
    let Some(q) = q else {
        return "none (float weights)".into();
    };
    format!(
        "{} {} weights, {} scales per {}x{} block, {} activations; routed experts {}",
        json_name(&q.method),
        json_name(&q.fmt),
        json_name(&q.scale_fmt),
        q.weight_block_size[0],
        q.weight_block_size[1],
        json_name(&q.activation_scheme),
        json_name(&q.expert_dtype),
    )
}

/// The config.json spelling of a quantization field (its serde name).
fn json_name<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        other => format!("{other:?}"),
    }
}

/// Bytes with a decimal unit; below 1 kB exact.
fn bytes(n: u64) -> String {
    if n < 1000 {
        format!("{n} B")
    } else {
        size(n as f64)
    }
}

fn shape(s: &[usize]) -> String {
    let dims: Vec<String> = s.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(", "))
}

fn tensor_table(r: &StorageReport) -> Table {
    let mut tensors: Vec<_> = r.tensors.iter().collect();
    tensors.sort_by(|a, b| a.disk_name.cmp(&b.disk_name));
    let rows = tensors
        .into_iter()
        .map(|t| {
            let disk = if t.parts > 1 {
                format!("{} (+{} more)", t.disk_name, t.parts - 1)
            } else {
                t.disk_name.clone()
            };
            let scale = t.scale.as_ref().map_or("-".to_string(), |s| {
                format!("{} {}", s.dtype, shape(&s.shape))
            });
            vec![
                disk,
                t.class.name().to_string(),
                t.dtype.clone(),
                shape(&t.shape),
                shape(&t.stored_shape),
                scale,
                bytes(t.bytes),
                bytes(t.gpu_bytes),
            ]
        })
        .collect();
    Table {
        headers: vec![
            "on disk",
            "storage",
            "dtype",
            "shape",
            "stored",
            "scale",
            "bytes",
            "GPU bytes",
        ],
        rows,
    }
}

fn class_table(r: &StorageReport) -> Table {
    let row = |name: &str, c: &pdserve_engine::model::storage::ClassTotal| {
        vec![
            name.to_string(),
            c.tensors.to_string(),
            c.bytes.to_string(),
            bytes(c.bytes),
            c.gpu_bytes.to_string(),
            bytes(c.gpu_bytes),
        ]
    };
    let mut rows: Vec<Vec<String>> = r.by_class.iter().map(|(k, c)| row(k.name(), c)).collect();
    rows.push(row("all", &r.total));
    Table {
        headers: vec!["storage", "tensors", "bytes", "", "GPU bytes", ""],
        rows,
    }
}
