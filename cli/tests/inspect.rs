//! `pdserve inspect`: the config summary, per-tensor storage and totals per storage class,
//! as text and as JSON, on the quantized fixture and the embedded model.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::Value;
use std::path::PathBuf;
use support::*;

fn quantized() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/quantized")
        .display()
        .to_string()
}

fn run(args: &[&str]) -> String {
    let out = bin().arg("inspect").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend(args);
    serde_json::from_str(&run(&a)).unwrap()
}

fn tensor<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["storage"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed"))
}

#[test]
fn quantized_fixture_json() {
    let dir = quantized();
    let v = json(&[&dir]);
    assert_eq!(v["config"]["quantization"]["expert_dtype"], "fp4");
    assert_eq!(
        v["config"]["quantization"]["weight_block_size"],
        serde_json::json!([128, 128])
    );
    let wo_b = tensor(&v, "model.layers.1.self_attn.o_b_proj.weight");
    assert_eq!(wo_b["disk_name"], "layers.1.attn.wo_b.weight");
    assert_eq!(wo_b["class"], "fp8");
    assert_eq!(wo_b["dtype"], "F8_E4M3");
    assert_eq!(wo_b["scale"]["name"], "layers.1.attn.wo_b.scale");
    assert_eq!(wo_b["scale"]["shape"], serde_json::json!([2, 2]));
    assert_eq!(wo_b["bytes"], 160 * 160 + 4);
    assert_eq!(wo_b["gpu_bytes"], 160 * 160 + 4);
    let down = tensor(&v, "model.layers.0.mlp.experts.down_proj");
    assert_eq!(
        (down["class"].as_str(), down["parts"].as_u64()),
        (Some("fp4"), Some(4))
    );
    assert_eq!(down["shape"], serde_json::json!([4, 160, 64]));
    assert_eq!(down["stored_shape"], serde_json::json!([160, 32]));
    // 4 experts x [160, 64]: 160 x 32 packed bytes + 160 x 2 scales each.
    assert_eq!(down["bytes"], 4 * (160 * 32 + 160 * 2));

    let by_class = &v["storage"]["by_class"];
    assert_eq!(by_class["fp8"]["tensors"], 17);
    assert_eq!(by_class["fp4"]["tensors"], 4);
    assert_eq!(by_class["fp4"]["bytes"], 2 * 4 * 3 * (64 * 80 + 64 * 5));
    assert_eq!(by_class["int"]["gpu_bytes"], 0);
    assert_eq!(v["storage"]["gpu_matrix_elem_bytes"], 2);
    assert_eq!(v["cuda_weights"], "bf16");
    // mtp.0: enorm [160] bf16 + wq_a [144, 160] FP8 (+ 2x2 scales) + one FP4 expert w1.
    assert_eq!(
        v["storage"]["unused_bytes"],
        320 + 144 * 160 + 4 + 64 * 80 + 64 * 5
    );
    let total = &v["storage"]["total"];
    let sum = |k: &str| -> u64 {
        by_class
            .as_object()
            .unwrap()
            .values()
            .map(|c| c[k].as_u64().unwrap())
            .sum()
    };
    assert_eq!(total["bytes"].as_u64(), Some(sum("bytes")));
    assert_eq!(total["gpu_bytes"].as_u64(), Some(sum("gpu_bytes")));
    assert!(v["kv_layout_fingerprint"].is_string());

    // --cuda-weights f32 doubles only the bf16 matrices; FP8/FP4 stay as stored.
    let f32 = json(&[&dir, "--cuda-weights", "f32"]);
    let fb = &f32["storage"]["by_class"];
    assert_eq!(fb["fp8"]["gpu_bytes"], by_class["fp8"]["gpu_bytes"]);
    assert_eq!(fb["fp4"]["gpu_bytes"], by_class["fp4"]["gpu_bytes"]);
    let wkv = |v: &Value| {
        tensor(v, "model.layers.0.self_attn.compressor.kv_proj.weight")["gpu_bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!((wkv(&v), wkv(&f32)), (192 * 160 * 2, 192 * 160 * 4));
}

#[test]
fn quantized_fixture_text() {
    let t = run(&[&quantized()]);
    for want in [
        "2 layers: Csa/HashMoe, Hca/TopK",
        "hidden 160, vocab 96, 2 heads x 96 (rope 24), q_lora 144, output 2 groups x 80",
        "quantization: fp8 e4m3 weights, ue8m0 scales per 128x128 block, dynamic activations; routed experts fp4",
        "unused on disk (mtp.*): 28.8 kB",
        "storage classes (GPU: --cuda-weights bf16, FP8/FP4 held as stored)",
    ] {
        assert!(t.contains(want), "missing `{want}`:\n{t}");
    }
    // Table rows as trimmed cells, found by their first cell.
    let row = |first: &str| -> Vec<String> {
        t.lines()
            .map(|l| {
                l.split('|')
                    .map(|c| c.trim().to_string())
                    .collect::<Vec<_>>()
            })
            .find(|cells| cells.get(1).map(String::as_str) == Some(first))
            .unwrap_or_else(|| panic!("no row {first}:\n{t}"))
    };
    let wq_a = row("layers.0.attn.wq_a.weight");
    assert_eq!(
        wq_a[2..9],
        [
            "fp8",
            "F8_E4M3",
            "[144, 160]",
            "[144, 160]",
            "F8_E8M0 [2, 2]",
            "23.0 kB",
            "23.0 kB"
        ]
    );
    let experts = row("layers.1.ffn.experts.0.w1.weight (+7 more)");
    assert_eq!(
        experts[2..7],
        ["fp4", "I8", "[4, 128, 160]", "[64, 80]", "F8_E8M0 [64, 5]"]
    );
    let router = row("layers.1.ffn.gate.weight");
    assert_eq!(
        router[7..9],
        ["1.28 kB", "2.56 kB"],
        "bf16 on disk, fp32 on the GPU"
    );
    assert_eq!(row("fp8")[2], "17");
    assert_eq!(
        row("fp4")[2..4],
        [
            "4".to_string(),
            (2 * 4 * 3 * (64 * 80 + 64 * 5)).to_string()
        ]
    );
}

#[test]
fn embedded_model_is_float() {
    let v = json(&[]);
    assert!(v["config"]["quantization"].is_null());
    let classes: Vec<&String> = v["storage"]["by_class"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(classes, ["bf16", "int"]);
    let router = tensor(&v, "model.layers.3.mlp.gate.weight");
    assert_eq!(
        (router["bytes"].as_u64(), router["gpu_bytes"].as_u64()),
        (Some(16 * 128 * 2), Some(16 * 128 * 4))
    );
    assert_eq!(v["storage"]["unused_bytes"], 0);
    let t = run(&[]);
    assert!(t.contains("quantization: none (float weights)"), "{t}");
    assert!(!t.contains("unused on disk"), "{t}");

    // The folder positionally or by --model, not both.
    let out = bin()
        .args(["inspect", "x", "--model", "y"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

/// A copy of `src` whose safetensors files keep their headers but hold 0xff in every data
/// byte (NaN FP8/bf16 values and e8m0 scales, out-of-range `tid2eid` ids): reading any
/// weight fails, reading a header does not.
fn garbage_copy(src: &str) -> tempfile::TempDir {
    let dst = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let data = &mut bytes[8 + header..];
            assert!(!data.is_empty());
            data.fill(0xff);
        }
        std::fs::write(dst.path().join(path.file_name().unwrap()), bytes).unwrap();
    }
    dst
}

#[test]
fn reads_headers_only() {
    let intact = quantized();
    let garbage = garbage_copy(&intact);
    let gdir = garbage.path().to_str().unwrap();

    // Loading the garbage copy fails: its weights are unusable.
    let load = bin()
        .args([
            "generate",
            "--model",
            gdir,
            "--tokens",
            "1,2",
            "--max-new-tokens",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!load.status.success(), "the garbage weights loaded");

    // Inspecting it reads no weight: the same report as the intact copy's.
    let mut want = json(&[&intact]);
    let mut got = json(&[gdir]);
    assert_eq!(got["model_dir"], gdir);
    for v in [&mut want, &mut got] {
        v.as_object_mut().unwrap().remove("model_dir");
    }
    assert_eq!(got, want);
    let body = |t: String| t.lines().skip(1).collect::<Vec<_>>().join("\n");
    assert_eq!(body(run(&[gdir])), body(run(&[&intact])));

    // The pool comes from the flags, with no device opened.
    let v = json(&[
        gdir,
        "--kv-pages",
        "7",
        "--hicache-ratio",
        "3",
        "--kv-audit",
    ]);
    let pool = &v["kv_pool"];
    let page = v["kv_layout"]["page_bytes"].as_u64().unwrap();
    let state = v["kv_layout"]["state_bytes"].as_u64().unwrap();
    assert_eq!(
        (pool["device_pages"].as_u64(), pool["host_pages"].as_u64()),
        (Some(7), Some(21))
    );
    assert_eq!(pool["device_bytes"].as_u64(), Some(7 * page + 64 * state));
    assert_eq!(pool["host_bytes"].as_u64(), Some(21 * page));
    assert_eq!(v["kv_audit"], true);
    assert!(
        v["backend"].as_str().unwrap().starts_with("cpu"),
        "{}",
        v["backend"]
    );
    let cuda = json(&[gdir, "--device", "cuda:3"]);
    assert_eq!(cuda["backend"], "cuda:3 (not opened)");
    assert_eq!(cuda["storage"], want["storage"]);
}
