//! The `pdserve` command-line contracts other tests and tools rely on.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    // Keep the embedded model's cache inside the target dir, not the user's home.
    c.env(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache"),
    );
    c.env("RUST_LOG", "warn");
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn read_expected(dir: &Path) -> (Vec<u32>, Vec<Vec<f32>>) {
    safetensors_reader(&std::fs::read(dir.join("expected.safetensors")).unwrap())
}

/// Minimal reader of the two tensors in expected.safetensors (header JSON + raw data).
fn safetensors_reader(bytes: &[u8]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let range = |name: &str| {
        let o = header[name]["data_offsets"].as_array().unwrap();
        &data[o[0].as_u64().unwrap() as usize..o[1].as_u64().unwrap() as usize]
    };
    let tokens = range("tokens")
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let vocab = header["logits"]["shape"][1].as_u64().unwrap() as usize;
    let flat: Vec<f32> = range("logits")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (tokens, flat.chunks(vocab).map(<[f32]>::to_vec).collect())
}

#[test]
fn logits_command_matches_reference() {
    let dir = fixture("mixed");
    let (tokens, want) = read_expected(&dir);
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mixed-logits.json");
    let toks: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let status = bin()
        .args(["logits", "--model"])
        .arg(&dir)
        .args(["--tokens", &toks.join(","), "--prefill-len", "37", "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let rows = v["logits"].as_array().unwrap();
    assert_eq!(rows.len(), tokens.len());
    for (t, (row, w)) in rows.iter().zip(&want).enumerate() {
        let g: Vec<f32> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(g.len(), w.len());
        let num: f64 = g.iter().zip(w).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let den: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum();
        assert!((num / den).sqrt() < 1e-4, "row {t}");
    }
}

#[test]
fn generate_runs_the_embedded_model_with_no_arguments() {
    let out = bin().arg("generate").output().unwrap();
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.trim().is_empty(), "no completion printed");
    // Greedy is deterministic: the same text twice.
    let again = bin().arg("generate").output().unwrap();
    assert_eq!(String::from_utf8(again.stdout).unwrap(), text);
}

#[test]
fn generate_json_is_seeded_and_bounded() {
    let run = |seed: &str| {
        let out = bin()
            .args([
                "generate",
                "--prompt",
                "Hello world",
                "--max-new-tokens",
                "12",
                "--temperature",
                "0.9",
            ])
            .args(["--top-p", "0.95", "--seed", seed, "--ignore-eos", "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let a = run("7");
    assert_eq!(a["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(a["finish_reason"], "length");
    assert_eq!(a, run("7"));
    assert!(a["text"].is_string());
}

#[test]
fn bad_inputs_fail_with_clear_errors() {
    let out = bin()
        .args([
            "logits",
            "--model",
            "/nonexistent/model",
            "--tokens",
            "1,2",
            "--prefill-len",
            "1",
            "--out",
            "/dev/null",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model"), "{err}");

    let out = bin()
        .args(["generate", "--tokens", "1,x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`x`"));

    let out = bin()
        .args(["generate", "--tokens", "1,999999"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("vocabulary"));

    let out = bin()
        .args(["generate", "--device", "cuda:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cuda:0"));
}
