//! `--numerics deepseek` from the command line: the logits command runs it (and refuses it
//! without fp8 compressed KV), inspect shows it in the KV layout, and a prefill and a
//! decode server that disagree on it refuse each other naming the field.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};
use support::*;

fn logits(extra: &[&str]) -> Result<Vec<Vec<f32>>, String> {
    let out_file = tempfile::NamedTempFile::new().unwrap();
    let out = bin()
        .args([
            "logits",
            "--tokens",
            "5,17,2,9,30,41,7,8,12",
            "--prefill-len",
            "5",
        ])
        .arg("--out")
        .arg(out_file.path())
        .args(extra)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_file.path()).unwrap()).unwrap();
    Ok(serde_json::from_value(v["logits"].clone()).unwrap())
}

#[test]
fn logits_run_under_deepseek_numerics_and_need_fp8_kv() {
    let base = logits(&[]).unwrap();
    let ds = logits(&["--numerics", "deepseek", "--kv-dtype", "fp8"]).unwrap();
    assert_eq!(base.len(), ds.len());
    assert!(ds.iter().flatten().all(|v| v.is_finite()));
    assert_ne!(base, ds, "deepseek numerics changed no logit");
    let err = logits(&["--numerics", "deepseek"]).unwrap_err();
    assert!(
        err.contains("kv_dtype") && err.contains("--kv-dtype fp8"),
        "{err}"
    );
    let err = logits(&["--numerics", "bf16"]).unwrap_err();
    assert!(
        err.contains("--numerics") && err.contains("deepseek"),
        "{err}"
    );
    // The mode runs on the GPU (gpu-check --only deepseek holds it to the CPU): on a
    // machine without one, what stops `cuda:0` is the device, never the numerics.
    match logits(&[
        "--numerics",
        "deepseek",
        "--kv-dtype",
        "fp8",
        "--device",
        "cuda:0",
    ]) {
        Ok(gpu) => assert!(gpu.iter().flatten().all(|v| v.is_finite())),
        Err(err) => assert!(err.contains("CUDA") && !err.contains("numerics"), "{err}"),
    }
}

#[test]
fn inspect_shows_numerics_and_the_fp8_entry_size() {
    let out = bin()
        .args([
            "inspect",
            "--json",
            "--numerics",
            "deepseek",
            "--kv-dtype",
            "fp8",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["kv_layout"]["numerics"], "deepseek");
    assert_eq!(v["kv_layout"]["kv_dtype"], "Fp8E4m3");
}

#[test]
fn prefill_and_decode_disagreeing_on_numerics_refuse_naming_it() {
    // Same fp8 compressed KV on both sides: only the numerics differ.
    let up = Up::start(&[
        "--prefill-args",
        "--numerics deepseek --kv-dtype fp8",
        "--decode-args",
        "--kv-dtype fp8",
    ]);
    let t0 = Instant::now();
    let (st, body) = complete(&up.addr, &greedy(&prompt(1, 10), 4)).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(st, 502, "{body}");
    assert!(body.contains("numerics"), "{body}");
}

/// `scripts/ab-logits.sh OLD NEW` (the bitwise A/B of two binaries, run on the GPU before
/// timing a change that only moves work around) on the CPU: its four cases (the embedded
/// model, and random deepseek-numerics models in the released formats) run and pass for
/// one binary against itself, and fail, exit status 1, against a binary whose logits
/// files gain a byte.
#[test]
fn ab_logits_script_passes_equal_binaries_and_fails_differing_ones() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let exe = env!("CARGO_BIN_EXE_pdserve");
    let run = |new: &str| {
        std::process::Command::new("bash")
            .arg(root.join("scripts/ab-logits.sh"))
            .args([exe, new])
            .env("DEVICE", "cpu")
            .output()
            .unwrap()
    };
    let same = run(exe);
    let text = String::from_utf8_lossy(&same.stdout).into_owned();
    assert!(
        same.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&same.stderr)
    );
    for case in [
        "embedded-kv-bf16",
        "embedded-kv-fp8",
        "deepseek-fp8-experts",
        "deepseek-fp4-experts",
        "v4-attention-kv-fp8",
    ] {
        assert!(
            text.contains(&format!("PASS {case}: logits bitwise equal")),
            "{text}"
        );
    }
    // A binary whose logits files end in one more byte than the real one's.
    let dir = tempfile::tempdir().unwrap();
    let tampered = dir.path().join("pdserve-tampered");
    std::fs::write(
        &tampered,
        format!(
            "#!/usr/bin/env bash\n\"{exe}\" \"$@\" || exit $?\nprev=\nfor a in \"$@\"; do [ \"$prev\" = --out ] && echo >> \"$a\"; prev=$a; done\n"
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tampered, std::fs::Permissions::from_mode(0o755)).unwrap();
    let differ = run(tampered.to_str().unwrap());
    let text = String::from_utf8_lossy(&differ.stdout).into_owned();
    assert_eq!(differ.status.code(), Some(1), "{text}");
    assert_eq!(text.matches("FAIL ").count(), 5, "{text}");
    assert!(
        text.contains("FAIL deepseek-fp4-experts: logits differ"),
        "{text}"
    );
    assert!(
        text.contains("FAIL v4-attention-kv-fp8: logits differ"),
        "{text}"
    );
}
