//! `pdserve prefill`, `pdserve decode`, `pdserve router`: one role per process.

use crate::engine_spec::{layout_spec, numerics, open_engine, CudaSpec, Device, EngineSpec};
use crate::layered::{render, Entry};
use crate::roles::{RouterFlags, WorkerConfig, WorkerFlags, WorkerRole};
use anyhow::{Context, Result};
use pdserve_decode_server::{DebugScribble, ScribbleKind};
use pdserve_engine::backend::{Backend, BackendError};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::sizing::{self, HostSize};
use pdserve_engine::kv::KvLayout;
use pdserve_engine::{CpuBackend, Engine, PoolSize};
use pdserve_kernels::WeightDtype;
use pdserve_proto::pb;
use pdserve_router::served_model::ServedModel;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Printed on stdout once the listener is bound; `pdserve up` and tests read it.
pub const LISTENING: &str = "listening on";

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}

fn config_pb(entries: &[Entry]) -> Vec<pb::ConfigEntry> {
    entries
        .iter()
        .map(|e| pb::ConfigEntry {
            key: e.key.clone(),
            value: e.value.clone(),
            source: e.source.clone(),
        })
        .collect()
}

/// The model folder and the names it is served under: `served` (--served-model-name),
/// and the folder's name (`pdserve-embedded` for the embedded model).
fn model_dir(model: &Option<PathBuf>, served: &[String]) -> Result<(PathBuf, ServedModel)> {
    let (dir, folder) = match model {
        Some(d) => {
            let name = d
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| d.display().to_string());
            (d.clone(), name)
        }
        None => (
            pdserve_engine::embedded::model_dir()?,
            "pdserve-embedded".to_string(),
        ),
    };
    let names = served.to_vec();
    Ok((dir, ServedModel { names, folder }))
}

/// The gRPC listener and, with `--metrics-listen`, the side port (its address printed as
/// `pdserve <role> metrics on http://ADDR`, after the gRPC line).
async fn bind_worker(cfg: &WorkerConfig, role: &str) -> Result<pdserve_worker::Ports> {
    let grpc = bind(&cfg.listen, role).await?;
    let metrics = match &cfg.metrics_listen {
        None => None,
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("{role}: --metrics-listen {addr}"))?;
            println!("pdserve {role} metrics on http://{}", l.local_addr()?);
            Some(l)
        }
    };
    Ok(pdserve_worker::Ports { grpc, metrics })
}

async fn bind(listen: &str, role: &str) -> Result<tokio::net::TcpListener> {
    let l = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("{role}: listening on {listen}"))?;
    // One line on stdout: the bound address (port 0 picks a free port).
    println!("pdserve {role} {LISTENING} {}", l.local_addr()?);
    Ok(l)
}

type EngineFactory<B> = Box<dyn FnOnce() -> Result<Engine<B>, pdserve_engine::EngineError> + Send>;

/// The engine loader for a validated worker config (runs on the engine thread, which
/// also opens the backend there with `open`), and the host pool's pages (0: no host
/// tier), sized from the same layout at startup.
#[allow(clippy::result_large_err)]
fn engine_factory<B: Backend + 'static>(
    cfg: &WorkerConfig,
    dir: PathBuf,
    open: impl FnOnce() -> Result<B, BackendError> + Send + 'static,
) -> Result<(EngineFactory<B>, usize)> {
    let mcfg =
        ModelConfig::from_model_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
    let mut layout = layout_spec(&mcfg, &cfg.index_k_dtype, &cfg.kv_dtype, cfg.page_tokens)?;
    layout.numerics = numerics(&cfg.numerics)?;
    let host = match (cfg.hicache_size, cfg.hicache_ratio) {
        (Some(gb), _) => Some(HostSize::Gb(gb)),
        (None, r) if r > 0.0 => Some(HostSize::Ratio(r)),
        _ => None,
    };
    let host_pages = match host {
        None => 0,
        Some(h) => {
            let layout = KvLayout::new(&mcfg, layout).context("KV layout")?;
            let used = cfg.kv_pages * layout.page_bytes + cfg.max_batch * layout.state_bytes;
            let left = sizing::host_memory_available().map(|a| a.saturating_sub(used as u64));
            sizing::host_pages(&layout, cfg.kv_pages, h, left)?
        }
    };
    let spec = EngineSpec {
        dir,
        layout,
        pool: PoolSize {
            pages: cfg.kv_pages,
            states: cfg.max_batch,
        },
        kv_audit_every: cfg.kv_audit_every,
        pool_fraction: None,
        load_format: cfg.load_format()?,
    };
    let factory: EngineFactory<B> = Box::new(move || open_engine(&spec, open()?));
    Ok((factory, host_pages))
}

/// The structured-output grammar compiler for the model in `dir` (None without a
/// tokenizer.json: such requests are refused).
fn grammar_env(dir: &Path) -> Result<Option<Arc<pdserve_grammar::GrammarEnv>>> {
    let mcfg =
        ModelConfig::from_model_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    let env =
        pdserve_grammar::GrammarEnv::from_model_dir(dir, mcfg.vocab_size, &mcfg.eos_token_ids)?;
    if env.is_none() {
        tracing::warn!(model = %dir.display(), "no tokenizer.json: structured output is refused");
    }
    Ok(env)
}

pub fn worker(role: WorkerRole, flags: WorkerFlags) -> Result<()> {
    let (cfg, entries) = flags.resolve(role)?;
    if flags.print_config {
        print!("{}", render(&entries));
        return cfg.validate(role);
    }
    cfg.validate(role)?;
    let scribble = flags
        .debug_kv_scribble
        .as_deref()
        .map(parse_scribble)
        .transpose()?;
    if scribble.is_some() && (role != WorkerRole::Decode || cfg.kv_audit_every == 0) {
        anyhow::bail!("--debug-kv-scribble plants a write for the canary: decode servers with --kv-audit only");
    }
    let (dir, served) = model_dir(&cfg.model, &cfg.served_model_name)?;
    let model_name = served.primary().to_string();
    let grammar = match role {
        WorkerRole::Decode => grammar_env(&dir)?,
        WorkerRole::Prefill => None,
    };
    match cfg.device()? {
        Device::Cuda(n) => {
            // Prefill forwards are multi-token and run eagerly; decode steps follow
            // --cuda-graph.
            let cuda = CudaSpec {
                weights: WeightDtype::Bf16,
                graphs: cfg.graphs()?.mode(role == WorkerRole::Decode),
                verify_graphs_every: cfg.verify_graphs_every,
                deterministic: cfg.deterministic,
            };
            let factory = engine_factory(&cfg, dir, move || cuda.open(n))?;
            serve_worker(role, cfg, entries, model_name, scribble, grammar, factory)
        }
        _ => {
            let factory = engine_factory(&cfg, dir, || Ok(CpuBackend))?;
            serve_worker(role, cfg, entries, model_name, scribble, grammar, factory)
        }
    }
}

fn serve_worker<B: Backend + 'static>(
    role: WorkerRole,
    cfg: WorkerConfig,
    entries: Vec<Entry>,
    model_name: String,
    scribble: Option<DebugScribble>,
    grammar: Option<Arc<pdserve_grammar::GrammarEnv>>,
    (make_engine, host_pages): (EngineFactory<B>, usize),
) -> Result<()> {
    let timeout = Duration::from_secs_f64(cfg.request_timeout_s);
    let cluster_token = crate::roles::cluster_token(&cfg.cluster_token, &cfg.cluster_token_file)?;
    let hops = match role {
        WorkerRole::Prefill => pdserve_proto::tls::Hops::Server,
        WorkerRole::Decode => pdserve_proto::tls::Hops::Both,
    };
    let tls = crate::trust::cluster_tls(&cfg.tls_cert, &cfg.tls_key, &cfg.tls_ca, hops)?;
    if role == WorkerRole::Decode {
        crate::trust::require_grant_key("a decode server", &tls, &cluster_token)?;
    }
    let drain_timeout = Duration::from_secs_f64(cfg.drain_timeout_s);
    // The recorder first (the servers reuse it), so that the decode graphs' counters
    // exist at zero on every decode server, CUDA or not.
    if pdserve_worker::metrics::install(&model_name, role.name()).is_ok()
        && role == WorkerRole::Decode
    {
        pdserve_kernels::graph_metrics::register();
    }
    runtime()?.block_on(async move {
        let ports = bind_worker(&cfg, role.name()).await?;
        match role {
            WorkerRole::Prefill => {
                let settings = pdserve_prefill_server::PrefillSettings {
                    model_name,
                    chunked_prefill_size: cfg.chunked_prefill_size,
                    host_pages,
                    transfer_chunk_bytes: 1 << 20,
                    request_timeout: timeout,
                    load_timeout: Duration::from_secs(600),
                    drain_timeout,
                    config: config_pb(&entries),
                    cluster_token,
                    tls,
                };
                pdserve_prefill_server::serve(settings, make_engine, ports, shutdown_signal())
                    .await?;
            }
            WorkerRole::Decode => {
                let settings = pdserve_decode_server::DecodeSettings {
                    model_name,
                    max_batch: cfg.max_batch,
                    admit_timeout: timeout,
                    transfer_timeout: timeout,
                    transfer_progress_timeout: Duration::from_secs_f64(
                        cfg.transfer_progress_timeout_s,
                    ),
                    connect_timeout: Duration::from_secs(2),
                    load_timeout: Duration::from_secs(600),
                    drain_timeout,
                    config: config_pb(&entries),
                    debug_kv_scribble: scribble,
                    cluster_token,
                    grammar,
                    tls,
                };
                pdserve_decode_server::serve(settings, make_engine, ports, shutdown_signal())
                    .await?;
            }
        }
        Ok(())
    })
}

/// `--debug-kv-scribble KIND@STEP`.
fn parse_scribble(s: &str) -> Result<DebugScribble> {
    let (kind, step) = s
        .split_once('@')
        .ok_or_else(|| anyhow::anyhow!("--debug-kv-scribble `{s}`: expected KIND@STEP"))?;
    let kind = match kind {
        "page" => ScribbleKind::Page,
        "index-k" => ScribbleKind::IndexK,
        "state" => ScribbleKind::State,
        k => anyhow::bail!("--debug-kv-scribble kind `{k}`: expected page, index-k or state"),
    };
    let after_step = step
        .parse()
        .map_err(|e| anyhow::anyhow!("--debug-kv-scribble step `{step}`: {e}"))?;
    Ok(DebugScribble { kind, after_step })
}

pub fn router(flags: RouterFlags) -> Result<()> {
    let (cfg, entries) = flags.resolve()?;
    if flags.print_config {
        print!("{}", render(&entries));
        return cfg.validate();
    }
    cfg.validate()?;
    let (dir, served) = model_dir(&cfg.model, &cfg.served_model_name)?;
    let mcfg =
        ModelConfig::from_model_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
    let tokenizer = pdserve_tokenizer::Tokenizer::from_model_dir(&dir)?;
    let chat_renderer =
        pdserve_router::chat::Renderer::resolve(&dir, cfg.chat_template.as_deref())?;
    match &chat_renderer {
        Some(r) => tracing::info!(renderer = r.describe(), "chat prompts"),
        None => tracing::warn!(
            model = %dir.display(),
            "the model has no chat template: /v1/chat/completions is refused (pass --chat-template)"
        ),
    }
    let context_length = match cfg.max_model_len {
        None => mcfg.max_position_embeddings,
        Some(n) if n >= 1 && n <= mcfg.max_position_embeddings => n,
        Some(n) => anyhow::bail!(
            "--max-model-len {n}: must be in 1..={} (the model's max_position_embeddings)",
            mcfg.max_position_embeddings
        ),
    };
    if cfg.max_body_bytes == 0 {
        anyhow::bail!("--max-body-bytes must be at least 1");
    }
    let config = serde_json::Value::Array(
        entries
            .iter()
            .map(|e| serde_json::json!({"key": e.key, "value": e.value, "source": e.source}))
            .collect(),
    );
    let cluster_token = crate::roles::cluster_token(&cfg.cluster_token, &cfg.cluster_token_file)?;
    let tls = crate::trust::cluster_tls(
        &cfg.tls_cert,
        &cfg.tls_key,
        &cfg.tls_ca,
        pdserve_proto::tls::Hops::Client,
    )?;
    crate::trust::require_grant_key("the router", &tls, &cluster_token)?;
    let settings = pdserve_router::RouterSettings {
        model: served,
        prefill: cfg.prefill.clone(),
        decode: cfg.decode.clone(),
        eos_token_ids: mcfg.eos_token_ids.clone(),
        first_token_timeout: Duration::from_secs_f64(cfg.first_token_timeout_s),
        token_timeout: Duration::from_secs_f64(cfg.token_timeout_s),
        connect_timeout: Duration::from_secs(2),
        health_interval: Duration::from_secs_f64(cfg.health_interval_s),
        max_attempts: cfg.max_attempts,
        migration_limit: cfg.migration_limit,
        prefill_policy: cfg.prefill_policy.clone(),
        decode_policy: cfg.decode_policy.clone(),
        config,
        context_length,
        vocab_size: mcfg.vocab_size,
        max_body_bytes: cfg.max_body_bytes,
        chat_renderer: chat_renderer.map(std::sync::Arc::new),
        grammar: grammar_env(&dir)?,
        chat_template_kwargs: cfg.chat_template_kwargs()?,
        keys: pdserve_router::auth::KeySource {
            api_keys: cfg.api_key.clone(),
            api_key_file: cfg.api_key_file.clone(),
            admin_keys: cfg.admin_key.clone(),
            admin_key_file: cfg.admin_key_file.clone(),
        },
        allow_unauthenticated: cfg.allow_unauthenticated,
        cluster_token,
        tls,
        max_concurrent_requests: cfg.max_concurrent_requests,
        http: pdserve_router::http::HttpLimits {
            header_timeout: Duration::from_secs_f64(cfg.header_timeout_s),
            body_timeout: Duration::from_secs_f64(cfg.body_timeout_s),
            max_connections: cfg.max_connections,
        },
        discover_prefill: cfg.discover_prefill.clone(),
        discover_decode: cfg.discover_decode.clone(),
        discover_interval: Duration::from_secs_f64(cfg.discover_interval_s),
    };
    runtime()?.block_on(async move {
        let listener = bind(&cfg.listen, "router").await?;
        pdserve_router::serve(settings, tokenizer, listener, shutdown_signal()).await?;
        Ok(())
    })
}
