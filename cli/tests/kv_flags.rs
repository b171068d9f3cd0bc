//! KV flags: index-K dtypes, audit, pool sizing errors at startup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    c.env(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache"),
    );
    c.env("RUST_LOG", "warn");
    c
}

fn mixed() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/mixed")
        .display()
        .to_string()
}

fn inspect(extra: &[&str]) -> serde_json::Value {
    let out = bin()
        .args(["inspect", "--json", "--model", &mixed()])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn inspect_reports_layout_dtypes_and_pool_sizes() {
    let v = inspect(&["--index-k-dtype", "fp8", "--kv-pages", "10", "--kv-audit"]);
    assert_eq!(v["kv_layout"]["index_k_dtype"], "Fp8E4m3");
    assert_eq!(v["kv_pool"]["device_pages"], 10);
    assert_eq!(v["kv_pool"]["host_pages"], 20, "default ratio 2");
    assert_eq!(v["kv_audit"], true);
    let v = inspect(&["--kv-pages", "10", "--hicache-ratio", "3.5"]);
    assert_eq!(v["kv_pool"]["host_pages"], 35);
    let page = v["kv_layout"]["page_bytes"].as_u64().unwrap();
    let gb = format!("{}", (page * 25) as f64 / 1e9);
    let v = inspect(&["--kv-pages", "10", "--hicache-size", &gb]);
    assert_eq!(v["kv_pool"]["host_pages"], 25);
}

#[test]
fn generate_runs_with_fp8_index_k_under_audit() {
    let out = bin()
        .args([
            "generate",
            "--model",
            &mixed(),
            "--tokens",
            "5,17,2,9,11,40,3,8,22",
        ])
        .args([
            "--max-new-tokens",
            "4",
            "--index-k-dtype",
            "fp8",
            "--kv-audit",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 4, "{v}");
}

#[test]
fn bad_pool_sizes_are_startup_errors() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--hicache-ratio", "0.5"],
            "--hicache-ratio 0.5 is below 1",
        ),
        (
            &["--kv-pages", "100", "--hicache-size", "0.000001"],
            "fewer than the device pool",
        ),
        (&["--hicache-ratio", "1e15"], "memory are available"),
        (&["--kv-mem-fraction", "1.5"], "--kv-mem-fraction 1.5"),
        (&["--numerics", "deepseek"], "use --kv-dtype fp8"),
    ];
    for (args, msg) in cases {
        let out = bin()
            .args(["inspect", "--model", &mixed()])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(msg), "{args:?}: {err}");
    }
}

/// `--kv-mem-fraction` sizes the pool at load, after the weights, from the backend's free
/// memory (the host's on the CPU): the engine logs the size it took and the command runs.
#[test]
fn kv_mem_fraction_sizes_the_pool_after_loading() {
    let out = bin()
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .args([
            "generate",
            "--model",
            &mixed(),
            "--device",
            "cpu",
            "--kv-mem-fraction",
            "0.0005",
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("device KV pool sized from the memory free"))
        .unwrap_or_else(|| panic!("no sizing line: {err}"));
    let pages: usize = line
        .split("pages=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(pages > 0, "{line}");
}
