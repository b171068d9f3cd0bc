//! pdserve's `deepseek` numerics functions against an independent re-implementation of
//! DeepSeek-V4's reference quantization (scripts/numerics_fixtures.py, numpy + ml_dtypes):
//! act_quant (per 128 and per 64, ue8m0 scales, amax floor, ties, saturation range),
//! fp4_act_quant, the indexer's Hadamard rotation, and FlashMLA's V4 fp8 compressed-KV
//! entry bytes. Every value must match bit for bit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::kv::fp8_kv::Fp8KvFormat;
use pdserve_engine::numerics::{act_quant, fp4_act_quant, hadamard, quantize_e4m3_block};
use serde_json::Value;
use std::path::Path;

fn cases() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/numerics/quant_reference.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: {g} vs {w}");
    }
}

fn of_fn<'a>(all: &'a [Value], f: &str) -> Vec<&'a Value> {
    let v: Vec<&Value> = all.iter().filter(|c| c["fn"] == f).collect();
    assert!(!v.is_empty(), "no {f} case in the fixture");
    v
}

#[test]
fn act_quant_matches_the_reference_values_and_scales() {
    let all = cases();
    for c in of_fn(&all, "act_quant") {
        let name = c["name"].as_str().unwrap();
        let block = c["block"].as_u64().unwrap() as usize;
        let x = f32s(&c["x"]);
        let mut y = x.clone();
        act_quant(&mut y, block);
        assert_bits(&y, &f32s(&c["y"]), name);
        let mut codes = vec![0u8; block];
        let scales: Vec<f32> = x
            .chunks(block)
            .map(|b| quantize_e4m3_block(b, &mut codes))
            .collect();
        assert_bits(&scales, &f32s(&c["scales"]), &format!("{name} scales"));
    }
}

#[test]
fn fp4_act_quant_matches_the_reference() {
    let all = cases();
    for c in of_fn(&all, "fp4_act_quant") {
        let block = c["block"].as_u64().unwrap() as usize;
        let mut y = f32s(&c["x"]);
        fp4_act_quant(&mut y, block);
        assert_bits(&y, &f32s(&c["y"]), c["name"].as_str().unwrap());
    }
}

#[test]
fn indexer_rotation_and_fp4_simulation_match_the_reference() {
    let all = cases();
    for c in of_fn(&all, "hadamard_fp4") {
        let hd = c["head_dim"].as_u64().unwrap() as usize;
        let mut v = f32s(&c["x"]);
        for head in v.chunks_mut(hd) {
            hadamard(head);
        }
        assert_bits(&v, &f32s(&c["rotated"]), "rotated");
        for head in v.chunks_mut(hd) {
            fp4_act_quant(head, 32);
        }
        assert_bits(&v, &f32s(&c["y"]), "rotated + fp4");
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn fp8_kv_entry_bytes_match_flashmla_v4_layout() {
    let all = cases();
    for c in of_fn(&all, "fp8_kv_entry") {
        let f = Fp8KvFormat::new(
            c["head_dim"].as_u64().unwrap() as usize,
            c["rope_dim"].as_u64().unwrap() as usize,
        );
        assert_eq!(f.entry_bytes(), 584);
        let x = f32s(&c["x"]);
        let mut row = vec![0u8; f.row_bytes()];
        let mut scales = vec![0u8; f.scale_bytes()];
        f.encode(&x, &mut row, &mut scales);
        assert_eq!(hex(&row), c["row_hex"].as_str().unwrap(), "row bytes");
        assert_eq!(
            hex(&scales),
            c["scales_hex"].as_str().unwrap(),
            "scale bytes"
        );
        // Decoding gives the reference's simulated values: act_quant(nope, 64), bf16 rope.
        let mut back = vec![0f32; x.len()];
        f.decode(&row, &scales, &mut back);
        let mut want = x.clone();
        act_quant(&mut want[..f.nope], 64);
        for v in &mut want[f.nope..] {
            *v = half::bf16::from_f32(*v).to_f32();
        }
        assert_bits(&back, &want, "decoded entry");
    }
}
