//! The HTTP router: OpenAI-style `POST /v1/completions` and `POST /v1/chat/completions`
//! (SSE and not), `GET /v1/models`, `GET /health`, `GET /live`, `GET /ready`,
//! `GET /config`, `GET /metrics`
//! (Prometheus). For each request it picks a prefill worker P and a decode worker D
//! through a [`policy::RoutingPolicy`], asks D to generate with P as its prefill source,
//! and streams D's tokens to the client. A failure before the first token is retried on
//! another pair; a decode worker lost after it hands the stream to another pair
//! (`--migration-limit`, [`migration`]); other failures end the stream with an error event.
//!
//! Workers come from flags/config and from `POST /workers` / `DELETE /workers/{address}`
//! (`GET /workers` lists them with circuit state and load); a health loop polls each
//! worker's `Worker.Info` and drives its circuit breaker.

mod admin;
pub mod auth;
pub mod chat;
pub mod circuit;
mod completions;
mod detok;
pub mod discovery;
mod driver;
mod error;
pub mod extract;
mod generation;
pub mod health;
pub mod http;
pub mod limits;
mod logprobs;
pub mod metrics;
mod migration;
mod params;
pub mod policy;
mod probes;
pub mod reply;
pub mod served_model;
mod shape;
mod sse;
mod stop;
mod structured;
mod tokenize;
mod trace;
mod workers;

pub use error::ApiError;
pub use workers::{Role, Worker, Workers};

use pdserve_tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RouterSettings {
    /// Names the model is served under (`model` in requests may be omitted).
    pub model: served_model::ServedModel,
    /// Prefill worker addresses (host:port).
    pub prefill: Vec<String>,
    /// Decode worker addresses (host:port).
    pub decode: Vec<String>,
    /// Model end-of-sequence ids, used as stop tokens unless a request sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Deadline from request to first token (admission, prefill and transfer included).
    pub first_token_timeout: Duration,
    /// Deadline between two tokens of a stream.
    pub token_timeout: Duration,
    /// Deadline for connecting to a worker.
    pub connect_timeout: Duration,
    /// How often worker health is checked.
    pub health_interval: Duration,
    /// Pairs tried for one request before its first token.
    pub max_attempts: usize,
    /// Times one stream may move to another pair after its decode worker is lost (0: never).
    pub migration_limit: u32,
    /// Routing policy for prefill workers (see [`policy::NAMES`]).
    pub prefill_policy: String,
    /// Routing policy for decode workers.
    pub decode_policy: String,
    /// Effective configuration with sources, served at `GET /config`.
    pub config: serde_json::Value,
    /// Positions the model handles: prompt + generated tokens must fit.
    pub context_length: usize,
    /// Token ids in requests must be below this.
    pub vocab_size: usize,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// How chat messages become a prompt; None: the model has no chat format and chat
    /// requests are refused.
    pub chat_renderer: Option<Arc<chat::Renderer>>,
    /// Compiles structured-output grammars to check them (the decode servers compile
    /// them again to enforce them); None when the model has no tokenizer.json.
    pub grammar: Option<Arc<pdserve_grammar::GrammarEnv>>,
    /// `--chat-template-kwargs`: defaults a request's `chat_template_kwargs` overrides.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// API and admin keys (see [`auth`]).
    pub keys: auth::KeySource,
    /// Serve without an API key on a non-loopback address (otherwise refused at start).
    pub allow_unauthenticated: bool,
    /// Most completion requests in flight (429 past it).
    pub max_concurrent_requests: usize,
    /// Header/body deadlines and the connection limit.
    pub http: http::HttpLimits,
    /// The cluster token (see [`pdserve_proto::cluster`]): workers must prove it.
    pub cluster_token: Option<pdserve_proto::cluster::ClusterToken>,
    /// Mutual TLS to every worker (see [`pdserve_proto::tls`]).
    pub tls: Option<pdserve_proto::tls::ClusterTls>,
    /// DNS names (host:port) whose addresses are the prefill workers (see [`discovery`]).
    pub discover_prefill: Vec<String>,
    /// DNS names (host:port) whose addresses are the decode workers.
    pub discover_decode: Vec<String>,
    /// How often the discovery names are resolved again.
    pub discover_interval: Duration,
}

pub struct AppState {
    pub settings: RouterSettings,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub workers: Arc<Workers>,
    pub prefill_policy: Box<dyn policy::RoutingPolicy>,
    pub decode_policy: Box<dyn policy::RoutingPolicy>,
    pub auth: Arc<auth::Auth>,
    pub concurrency: Arc<limits::ConcurrencyLimit>,
    pub tokenizers: limits::Tokenizers,
    /// Longest text prompt in bytes (see [`limits::prompt_bytes_limit`]).
    pub prompt_bytes_limit: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("worker address `{addr}`: {reason}")]
    Address { addr: String, reason: String },
    #[error("HTTP server: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Policy(#[from] policy::UnknownPolicy),
    #[error(transparent)]
    Keys(#[from] auth::KeyError),
    #[error(
        "no API key is configured and {0} is not a loopback address: anyone who can reach it could use the model and see every prompt; set --api-key / --api-key-file (or PDSERVE_API_KEY), listen on 127.0.0.1, or pass --allow-unauthenticated"
    )]
    Unauthenticated(std::net::SocketAddr),
}

/// The axum application (routes and state), for embedding and tests.
pub fn app(state: Arc<AppState>) -> axum::Router {
    use axum::routing::{delete, get, post};
    if let Err(e) = metrics::handle() {
        tracing::warn!(error = e, "GET /metrics is unavailable");
    }
    let limit = axum::extract::DefaultBodyLimit::max(state.settings.max_body_bytes);
    let concurrency = state.concurrency.clone();
    let limited =
        || axum::middleware::from_fn_with_state(concurrency.clone(), limits::limit_concurrency);
    axum::Router::new()
        .route(
            "/v1/completions",
            post(completions::completions).layer(limited()),
        )
        .route(
            "/v1/chat/completions",
            post(completions::chat_completions).layer(limited()),
        )
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/models", get(completions::models))
        .route("/v1/models/{model}", get(completions::model))
        .route("/health", get(completions::health))
        .route("/live", get(probes::live))
        .route("/ready", get(probes::ready))
        .route("/config", get(completions::config))
        .route("/workers", get(admin::list).post(admin::add))
        .route("/workers/{address}", delete(admin::remove))
        .route("/metrics", get(completions::metrics))
        .fallback(completions::not_found)
        .method_not_allowed_fallback(completions::method_not_allowed)
        .layer(limit)
        .layer(axum::middleware::from_fn_with_state(
            state.auth.clone(),
            auth::require_key,
        ))
        .layer(axum::middleware::from_fn(trace::request_context))
        .with_state(state)
}

/// Serve until `shutdown` resolves.
pub async fn serve(
    settings: RouterSettings,
    tokenizer: Option<Tokenizer>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    // Before anything records: worker gauges go to the same process-wide recorder.
    if let Err(e) = metrics::handle() {
        tracing::warn!(error = e, "GET /metrics is unavailable");
    }
    let auth = Arc::new(auth::Auth::new(settings.keys.clone())?);
    let local = listener.local_addr()?;
    if !auth::may_serve(
        local.ip(),
        auth.has_api_keys(),
        settings.allow_unauthenticated,
    ) {
        return Err(ServeError::Unauthenticated(local));
    }
    let reload = tokio::spawn(auth::reload_on_sighup(auth.clone()));
    let workers = Arc::new(Workers::with_tls(
        &settings.prefill,
        &settings.decode,
        settings.connect_timeout,
        settings.cluster_token.clone(),
        settings.tls.clone(),
    )?);
    let prefill_policy = policy::by_name(&settings.prefill_policy)?;
    let decode_policy = policy::by_name(&settings.decode_policy)?;
    let health = tokio::spawn(health::health_loop(
        workers.clone(),
        settings.health_interval,
    ));
    let upkeep = tokio::spawn(metrics::upkeep(Duration::from_secs(5)));
    let prompt_bytes_limit = tokenizer.as_ref().map_or(usize::MAX, |t| {
        limits::prompt_bytes_limit(settings.context_length, t.max_token_bytes())
    });
    let state = Arc::new(AppState {
        concurrency: Arc::new(limits::ConcurrencyLimit::new(
            settings.max_concurrent_requests,
        )),
        tokenizers: limits::Tokenizers::per_core(settings.first_token_timeout),
        prompt_bytes_limit,
        tokenizer: tokenizer.map(Arc::new),
        workers,
        prefill_policy,
        decode_policy,
        auth,
        settings,
    });
    let mut discovery = Vec::new();
    for (role, names) in [
        (Role::Prefill, &state.settings.discover_prefill),
        (Role::Decode, &state.settings.discover_decode),
    ] {
        if !names.is_empty() {
            let interval = state.settings.discover_interval;
            discovery.push(tokio::spawn(discovery::follow(
                state.clone(),
                role,
                names.clone(),
                interval,
            )));
        }
    }
    tracing::info!(addr = ?listener.local_addr().ok(), api_keys = state.auth.has_api_keys(), admin_keys = state.auth.has_admin_keys(), prefill = ?state.settings.prefill, decode = ?state.settings.decode, prefill_policy = state.prefill_policy.name(), decode_policy = state.decode_policy.name(), "router ready");
    let limits = state.settings.http;
    let res = http::serve(listener, app(state), limits, shutdown).await;
    health.abort();
    upkeep.abort();
    reload.abort();
    for d in discovery {
        d.abort();
    }
    Ok(res?)
}
