//! The DeepSeek-V4 renderer against the reference encoder: every request in
//! tests/fixtures/dsv4_encoding.json (made by scripts/dsv4_golden.py from the reference
//! `encoding_dsv4.py` with SGLang's request mapping) renders to the recorded prompt,
//! byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_router::chat::{ChatInput, Renderer};
use serde_json::{Map, Value};

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/dsv4_encoding.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_reference_rendering_is_reproduced_byte_for_byte() {
    let f = fixture();
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 20, "only {} golden cases", cases.len());
    let mut failed = Vec::new();
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let want = c["prompt"].as_str().unwrap();
        let got = ChatInput::from_body(&c["request"], &Map::new())
            .unwrap_or_else(|e| panic!("{name}: refused: {}", e.message))
            .render(&Renderer::DeepSeekV4)
            .unwrap_or_else(|e| panic!("{name}: refused: {}", e.message));
        if got.text != want {
            let at = got
                .text
                .char_indices()
                .zip(want.chars())
                .find(|((_, a), b)| a != b)
                .map_or(got.text.len().min(want.len()), |((i, _), _)| i);
            failed.push(format!(
                "{name}: differs at byte {at}\n  got:  {:?}\n  want: {:?}",
                got.text.get(at..).unwrap_or_default(),
                want.get(at..).unwrap_or_default()
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn server_default_kwargs_apply_and_the_request_overrides_them() {
    let f = fixture();
    let case = |n: &str| {
        f["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == n)
            .unwrap()
            .clone()
    };
    let mut defaults = Map::new();
    defaults.insert("thinking".into(), true.into());
    // Thinking on by the router's default = the case with thinking in the request.
    let chat = case("chat_single_user");
    let think = case("thinking_single_user");
    let r = ChatInput::from_body(&chat["request"], &defaults)
        .unwrap()
        .render(&Renderer::DeepSeekV4)
        .unwrap();
    assert_eq!(r.text, think["prompt"].as_str().unwrap());
    assert!(r.thinking);
    // The request's explicit false beats the default.
    let off = case("thinking_false_explicit");
    let r = ChatInput::from_body(&off["request"], &defaults)
        .unwrap()
        .render(&Renderer::DeepSeekV4)
        .unwrap();
    assert_eq!(r.text, off["prompt"].as_str().unwrap());
    assert!(!r.thinking);
}
