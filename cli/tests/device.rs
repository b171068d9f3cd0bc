//! `--device` selection: cpu by default, cuda:N fails clearly without CUDA, auto falls
//! back to the CPU with a warning.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    c.env(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache-device"),
    );
    c.env("RUST_LOG", "warn");
    c
}

fn cuda_driver_present() -> bool {
    pdserve_kernels::device::driver_present()
}

fn gen(device: &str) -> std::process::Output {
    bin()
        .args([
            "generate",
            "--device",
            device,
            "--tokens",
            "5,6,7",
            "--max-new-tokens",
            "3",
        ])
        .output()
        .unwrap()
}

#[test]
fn cuda_device_without_cuda_fails_clearly() {
    if cuda_driver_present() {
        eprintln!("SKIPPED: CUDA driver present");
        return;
    }
    let out = gen("cuda:0");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuda:0") && err.contains("libcuda"), "{err}");
}

#[test]
fn auto_falls_back_to_cpu_with_a_warning() {
    if cuda_driver_present() {
        eprintln!("SKIPPED: CUDA driver present");
        return;
    }
    let auto = gen("auto");
    assert!(
        auto.status.success(),
        "{}",
        String::from_utf8_lossy(&auto.stderr)
    );
    let err = String::from_utf8_lossy(&auto.stderr);
    assert!(err.contains("CUDA unavailable"), "{err}");
    let cpu = gen("cpu");
    assert!(cpu.status.success());
    assert_eq!(
        auto.stdout, cpu.stdout,
        "auto on a CUDA-less machine is the CPU engine"
    );
}

#[test]
fn unknown_device_is_rejected() {
    let out = gen("tpu:0");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown device `tpu:0`"), "{err}");
}
