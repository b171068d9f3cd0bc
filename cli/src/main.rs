//! `pdserve`: the user-facing command line.

mod bench;
mod certs;
mod commands;
mod engine_spec;
mod gpu_check;
mod inspect;
mod layered;
mod model_args;
mod reference;
mod roles;
mod serve;
mod trust;
mod up;
mod up_devices;
mod wait_ready;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// jemalloc keeps freed pages for reuse (dirty pages decay over 10 s). glibc's malloc
/// returned each request's megabytes of transfer buffers to the kernel and faulted fresh
/// ones in for the next: on the H200 host an 8K prompt's 4.3 MB KV transfer took 12.5 ms
/// of its time to first token with glibc, 6.9 ms with freed memory kept
/// (docs/performance.md, "Time to first token").
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "pdserve",
    version,
    about = "Prefill/decode-disaggregated inference for DeepSeek-V4-architecture models"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "PDSERVE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion in this process and print only its text on stdout.
    Generate(commands::GenerateArgs),
    /// Write next-token logits for every position of a token sequence as JSON.
    Logits(commands::LogitsArgs),
    /// Summarise a model: config, quantization, every tensor's storage on disk and on the
    /// GPU with totals per storage class, KV layout and pool (--json: all of it as JSON).
    /// Reads config.json and the safetensors headers only: no weights, no device.
    Inspect(inspect::InspectArgs),
    /// Run a prefill server (gRPC): prompts in, KV pages out to decode servers.
    #[command(after_help = reference::ENV_HELP)]
    Prefill(roles::WorkerFlags),
    /// Run a decode server (gRPC): continuous batching over KV pulled from prefill servers.
    #[command(after_help = reference::ENV_HELP)]
    Decode(roles::WorkerFlags),
    /// Run the HTTP router (OpenAI-style completions) in front of prefill/decode workers.
    #[command(after_help = reference::ENV_HELP)]
    Router(roles::RouterFlags),
    /// Start router + prefill + decode servers on this machine and wait for Ctrl-C.
    Up(up::UpArgs),
    /// Write a throwaway CA and a certificate + key per role, for mutual TLS by hand.
    Certs(certs::CertsArgs),
    /// Compare the CUDA backend with the CPU engine on reference fixtures (pass/fail table).
    GpuCheck(gpu_check::GpuCheckArgs),
    /// Benchmarks: decode and prefill on a synthetic V4-Flash-shaped model with random
    /// weights; `serve`: load and a reference check on a running cluster.
    Bench(bench::BenchArgs),
    /// Wait until a process's GET /ready answers 200 (for service managers and health checks).
    WaitReady(wait_ready::WaitReadyArgs),
    /// Print the flag reference of the serving roles (docs/flags.md) as Markdown.
    #[command(hide = true)]
    FlagReference,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.command {
        Command::Generate(a) => commands::generate(a),
        Command::Logits(a) => commands::logits(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Prefill(f) => serve::worker(roles::WorkerRole::Prefill, f),
        Command::Decode(f) => serve::worker(roles::WorkerRole::Decode, f),
        Command::Router(f) => serve::router(f),
        Command::Up(a) => up::up(a, matches!(cli.log_format, LogFormat::Json)),
        Command::Certs(a) => certs::certs(a),
        Command::GpuCheck(a) => gpu_check::gpu_check(a),
        Command::Bench(a) => bench::bench(a),
        Command::WaitReady(a) => wait_ready::wait_ready(a),
        Command::FlagReference => reference::render().map(|md| print!("{md}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
