//! `--load-format dummy[:SEED]`: a folder holding only config.json serves random weights of
//! its shapes (as `pdserve bench` draws them), and prefill and decode servers drawing with
//! one seed hold the same weights: the cluster's greedy tokens equal a single-process
//! engine's on the same seed, and another seed gives other tokens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_engine::sampling::SamplingParams;
use pdserve_engine::{CpuBackend, Engine, LoadFormat, PoolSize, PoolSpec};
use std::path::Path;
use support::*;

/// `pdserve args`: whether it succeeded, and its stderr.
fn run(args: &[&str]) -> (bool, String) {
    let out = bin().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The bench's tiny synthetic config (vocab 97) in a folder of its own (`bench config
/// --out` makes the folder): no weights.
fn config_only_folder(name: &str) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(name)
        .join("model");
    let _ = std::fs::remove_dir_all(&dir);
    let config = dir.join("config.json");
    let (ok, err) = run(&[
        "bench",
        "config",
        "--tiny",
        "--out",
        config.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    dir
}

fn dummy_engine(dir: &Path, seed: u64) -> Engine<CpuBackend> {
    let pool = PoolSpec::Size(PoolSize::default());
    Engine::load_format(dir, CpuBackend, None, pool, LoadFormat::Dummy { seed }).unwrap()
}

#[test]
fn dummy_weights_serve_through_the_cluster_as_in_one_process() {
    let dir = config_only_folder("dummy-weights-model");
    let model = dir.to_str().unwrap();
    let args = ["--model", model, "--load-format", "dummy:3"];
    let (_p, pa) = role("prefill", &args);
    let (_d, da) = role("decode", &args);
    let (_r, ra) = role(
        "router",
        &["--model", model, "--prefill", &pa, "--decode", &da],
    );
    wait_healthy(&ra, 60);
    // Ids 2..96 of the 97-token vocabulary (0 and 1 are BOS and EOS).
    let prompt: Vec<u32> = (0..40u32).map(|i| 2 + (i * 37 + 11) % 95).collect();
    let want = reference(
        &mut dummy_engine(&dir, 3),
        &prompt,
        10,
        SamplingParams::default(),
    );
    let (got, finish) = complete(&ra, &greedy(&prompt, 10)).unwrap();
    assert_eq!(got, want, "cluster on dummy:3 weights vs one process");
    assert_eq!(finish, "length");
    let other = reference(
        &mut dummy_engine(&dir, 4),
        &prompt,
        10,
        SamplingParams::default(),
    );
    assert_ne!(other, want, "another seed draws other weights");
}

#[test]
fn load_format_is_checked_at_startup() {
    let dir = config_only_folder("dummy-weights-bad-format");
    let model = dir.to_str().unwrap();
    let (ok, err) = run(&["prefill", "--model", model, "--load-format", "dummy:x"]);
    assert!(!ok);
    assert!(
        err.contains("--load-format") && err.contains("dummy:SEED"),
        "{err}"
    );
    // Without dummy weights, a folder with no safetensors is a clear load error.
    let (ok, err) = run(&["generate", "--model", model, "--tokens", "5,6"]);
    assert!(!ok);
    assert!(err.contains("no model.safetensors"), "{err}");
    let (ok, err) = run(&[
        "generate",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--tokens",
        "5,6",
        "--max-new-tokens",
        "3",
    ]);
    assert!(ok, "{err}");
}
