//! The model's parameters, loaded from a checkpoint onto a backend.

use crate::backend::{Backend, BackendError, HostTensor, WeightUse};
use crate::checkpoint::{Checkpoint, CheckpointError, LoadProgress};
use crate::config::{LayerKind, MlpKind, ModelConfig};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
}

pub struct HcWeights<B: Backend> {
    pub fn_: B::Tensor,
    pub base: B::Tensor,
    pub scale: B::Tensor,
}

pub struct CompressorWeights<B: Backend> {
    pub kv_proj: B::Tensor,
    pub gate_proj: B::Tensor,
    pub position_bias: B::Tensor,
    pub kv_norm: B::Tensor,
}

pub struct IndexerWeights<B: Backend> {
    pub compressor: CompressorWeights<B>,
    pub q_b_proj: B::Tensor,
    pub weights_proj: B::Tensor,
}

pub struct LayerWeights<B: Backend> {
    pub kind: LayerKind,
    pub mlp_kind: MlpKind,
    pub attn_hc: HcWeights<B>,
    pub ffn_hc: HcWeights<B>,
    pub input_layernorm: B::Tensor,
    pub post_attention_layernorm: B::Tensor,
    pub q_a_proj: B::Tensor,
    pub q_a_norm: B::Tensor,
    pub q_b_proj: B::Tensor,
    pub kv_proj: B::Tensor,
    pub kv_norm: B::Tensor,
    pub o_a_proj: B::Tensor,
    pub o_b_proj: B::Tensor,
    pub sinks: B::Tensor,
    pub compressor: Option<CompressorWeights<B>>,
    pub indexer: Option<IndexerWeights<B>>,
    pub router: B::Tensor,
    pub correction_bias: Option<B::Tensor>,
    /// `tid2eid` flattened `[vocab * top_k]` (hash layers).
    pub tid2eid: Option<Vec<u32>>,
    pub gate_up: B::Tensor,
    pub down: B::Tensor,
    pub shared_gate: B::Tensor,
    pub shared_up: B::Tensor,
    pub shared_down: B::Tensor,
}

pub struct ModelWeights<B: Backend> {
    pub embed_tokens: B::Tensor,
    pub layers: Vec<LayerWeights<B>>,
    pub norm: B::Tensor,
    pub hc_head: HcWeights<B>,
    /// `None` when tied to `embed_tokens`.
    pub lm_head: Option<B::Tensor>,
}

/// Where a model's tensors come from: a checkpoint, or a random generator (benchmarks).
/// The loader asks for every tensor by its canonical name; the source decides values.
pub trait TensorSource<B: Backend> {
    /// Float tensor `name` as 2-D (leading dims flattened into rows; 1-D is one row).
    fn float(&mut self, backend: &B, name: &str) -> Result<B::Tensor, LoadError>;
    /// `tid2eid` table `name`, flattened, every id checked against `n_experts`.
    fn expert_ids(&mut self, name: &str, n_experts: usize) -> Result<Vec<u32>, LoadError>;
    /// Whether the optional tensor `name` exists (`lm_head.weight` when tied).
    fn has(&self, name: &str) -> bool;
    /// Loading is over (progress bars end).
    fn finish(&mut self) {}
}

/// Tensors read from a checkpoint.
struct CheckpointSource<'a> {
    ckpt: &'a Checkpoint,
    progress: LoadProgress,
}

impl<B: Backend> TensorSource<B> for CheckpointSource<'_> {
    fn float(&mut self, backend: &B, name: &str) -> Result<B::Tensor, LoadError> {
        // FP8/FP4 weights go to the backend as stored: the CUDA backend keeps the bytes, the
        // CPU backend dequantizes them exactly (checkpoint::dequant).
        if let Some(w) = self.ckpt.stored_weight(name)? {
            self.progress.advance(self.ckpt.tensor_bytes(name));
            let usage = weight_use(name, w.rows, w.cols);
            return Ok(backend.upload_stored(w, usage)?);
        }
        let t = self.ckpt.tensor_f32(name)?;
        self.progress.advance(self.ckpt.tensor_bytes(name));
        let (rows, cols) = rows_cols(&t.shape);
        let host = HostTensor {
            rows,
            cols,
            data: t.data,
        };
        Ok(backend.upload_weight(host, weight_use(name, rows, cols))?)
    }

    fn expert_ids(&mut self, name: &str, n_experts: usize) -> Result<Vec<u32>, LoadError> {
        let (_, ids) = self.ckpt.tensor_i64(name)?;
        self.progress.advance(self.ckpt.tensor_bytes(name));
        ids.iter()
            .map(|&i| {
                u32::try_from(i)
                    .ok()
                    .filter(|&v| (v as usize) < n_experts)
                    .ok_or_else(|| LoadError::Tensor {
                        name: name.to_string(),
                        reason: format!("expert id {i} outside 0..{n_experts}"),
                    })
            })
            .collect()
    }

    fn has(&self, name: &str) -> bool {
        self.ckpt.shape(name).is_some()
    }

    fn finish(&mut self) {
        self.progress.finish();
    }
}

/// How the model uses weight `name` (canonical, stored `rows x cols`), which decides its
/// storage. Kept fp32: the MoE router (`mlp.gate.weight`: its top-k picks are discrete;
/// DeepSeek's reference computes it in fp32) and the hyper-connection `fn` maps (fp32 in
/// the reference too). Vectors (norm weights, sinks, biases, scales) are one row or one
/// column; every other weight is a matrix.
pub fn weight_use(name: &str, rows: usize, cols: usize) -> WeightUse {
    let keep_f32 = name.ends_with(".mlp.gate.weight")
        || name.ends_with("_hc.fn")
        || name.ends_with("hc_head.hc_fn");
    if rows < 2 || cols < 2 {
        WeightUse::Vector
    } else if keep_f32 {
        WeightUse::KeepF32
    } else {
        WeightUse::Matrix
    }
}

/// A tensor shape as the 2-D `(rows, cols)` the backends store: leading dims flattened.
pub fn rows_cols(shape: &[usize]) -> (usize, usize) {
    let cols = shape.last().copied().unwrap_or(1);
    let rows = if shape.len() <= 1 {
        1
    } else {
        shape[..shape.len() - 1].iter().product()
    };
    (rows, cols)
}

struct Loader<'a, B: Backend> {
    src: &'a mut dyn TensorSource<B>,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn t(&mut self, name: &str) -> Result<B::Tensor, LoadError> {
        self.src.float(self.backend, name)
    }

    fn hc(
        &mut self,
        prefix: &str,
        fn_name: &str,
        base: &str,
        scale: &str,
    ) -> Result<HcWeights<B>, LoadError> {
        Ok(HcWeights {
            fn_: self.t(&format!("{prefix}.{fn_name}"))?,
            base: self.t(&format!("{prefix}.{base}"))?,
            scale: self.t(&format!("{prefix}.{scale}"))?,
        })
    }

    fn compressor(&mut self, prefix: &str) -> Result<CompressorWeights<B>, LoadError> {
        Ok(CompressorWeights {
            kv_proj: self.t(&format!("{prefix}.kv_proj.weight"))?,
            gate_proj: self.t(&format!("{prefix}.gate_proj.weight"))?,
            position_bias: self.t(&format!("{prefix}.position_bias"))?,
            kv_norm: self.t(&format!("{prefix}.kv_norm.weight"))?,
        })
    }

    fn tid2eid(&mut self, name: &str, cfg: &ModelConfig) -> Result<Vec<u32>, LoadError> {
        self.src.expert_ids(name, cfg.n_routed_experts)
    }

    fn layer(&mut self, cfg: &ModelConfig, i: usize) -> Result<LayerWeights<B>, LoadError> {
        let p = format!("model.layers.{i}");
        let kind = cfg.layer_types[i];
        let mlp_kind = cfg.mlp_layer_types[i];
        let a = format!("{p}.self_attn");
        let compressor = match kind {
            LayerKind::Sliding => None,
            _ => Some(self.compressor(&format!("{a}.compressor"))?),
        };
        let indexer = match kind {
            LayerKind::Csa => {
                let ip = format!("{a}.compressor.indexer");
                Some(IndexerWeights {
                    compressor: self.compressor(&ip)?,
                    q_b_proj: self.t(&format!("{ip}.q_b_proj.weight"))?,
                    weights_proj: self.t(&format!("{ip}.scorer.weights_proj.weight"))?,
                })
            }
            _ => None,
        };
        let m = format!("{p}.mlp");
        Ok(LayerWeights {
            kind,
            mlp_kind,
            attn_hc: self.hc(&format!("{p}.attn_hc"), "fn", "base", "scale")?,
            ffn_hc: self.hc(&format!("{p}.ffn_hc"), "fn", "base", "scale")?,
            input_layernorm: self.t(&format!("{p}.input_layernorm.weight"))?,
            post_attention_layernorm: self.t(&format!("{p}.post_attention_layernorm.weight"))?,
            q_a_proj: self.t(&format!("{a}.q_a_proj.weight"))?,
            q_a_norm: self.t(&format!("{a}.q_a_norm.weight"))?,
            q_b_proj: self.t(&format!("{a}.q_b_proj.weight"))?,
            kv_proj: self.t(&format!("{a}.kv_proj.weight"))?,
            kv_norm: self.t(&format!("{a}.kv_norm.weight"))?,
            o_a_proj: self.t(&format!("{a}.o_a_proj.weight"))?,
            o_b_proj: self.t(&format!("{a}.o_b_proj.weight"))?,
            sinks: self.t(&format!("{a}.sinks"))?,
            compressor,
            indexer,
            router: self.t(&format!("{m}.gate.weight"))?,
            correction_bias: match mlp_kind {
                MlpKind::TopK => Some(self.t(&format!("{m}.gate.e_score_correction_bias"))?),
                MlpKind::HashMoe => None,
            },
            tid2eid: match mlp_kind {
                MlpKind::HashMoe => Some(self.tid2eid(&format!("{m}.gate.tid2eid"), cfg)?),
                MlpKind::TopK => None,
            },
            gate_up: self.t(&format!("{m}.experts.gate_up_proj"))?,
            down: self.t(&format!("{m}.experts.down_proj"))?,
            shared_gate: self.t(&format!("{m}.shared_experts.gate_proj.weight"))?,
            shared_up: self.t(&format!("{m}.shared_experts.up_proj.weight"))?,
            shared_down: self.t(&format!("{m}.shared_experts.down_proj.weight"))?,
        })
    }
}

impl<B: Backend> ModelWeights<B> {
    /// Validate the checkpoint against the config (one error listing every problem), then load.
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, backend: &B) -> Result<Self, LoadError> {
        crate::checkpoint::validate(ckpt, cfg)?;
        let mut src = CheckpointSource {
            ckpt,
            progress: LoadProgress::new(ckpt.total_bytes()),
        };
        Self::from_source(&mut src, cfg, backend)
    }

    /// Random weights for `cfg`, generated by the backend (benchmarks; no checkpoint).
    pub fn random(cfg: &ModelConfig, backend: &B, seed: u64) -> Result<Self, LoadError> {
        let mut src = super::random_weights::RandomSource::new(cfg, seed);
        Self::from_source(&mut src, cfg, backend)
    }

    /// Build every tensor of `cfg` from `src` (names and order as transformers saves them).
    pub fn from_source(
        src: &mut dyn TensorSource<B>,
        cfg: &ModelConfig,
        backend: &B,
    ) -> Result<Self, LoadError> {
        let mut l = Loader { src, backend };
        let embed_tokens = l.t("model.embed_tokens.weight")?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| l.layer(cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = l.t("model.norm.weight")?;
        let hc_head = l.hc("model.hc_head", "hc_fn", "hc_base", "hc_scale")?;
        let lm_head = if l.src.has("lm_head.weight") {
            Some(l.t("lm_head.weight")?)
        } else {
            None
        };
        l.src.finish();
        Ok(ModelWeights {
            embed_tokens,
            layers,
            norm,
            hc_head,
            lm_head,
        })
    }

    pub fn lm_head(&self) -> &B::Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }
}
