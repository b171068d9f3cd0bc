//! `--served-model-name` on the router and the workers: the names /v1/models lists, the
//! names a request may use (served ones and the model folder's), the one responses carry,
//! and what the workers report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use support::api::*;
use support::*;

const NAMES: [&str; 3] = ["--served-model-name", "ds-v4", "deepseek"];

#[test]
fn served_names_are_listed_accepted_and_reported() {
    let (_p, paddr, _) = start_logged("prefill", &NAMES);
    let (_d, daddr, _) = start_logged("decode", &NAMES);
    let mut router_args = vec!["--prefill", &paddr, "--decode", &daddr];
    router_args.extend(NAMES);
    let (_r, addr, _) = start_logged("router", &router_args);
    wait_healthy(&addr, 60);
    let addr = addr.as_str();

    let (st, _, b) = raw(addr, "GET", "/v1/models", &[], b"", T);
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["ds-v4", "deepseek"],
        "the folder's name is not listed"
    );

    // Any served name or the folder's is a model; the card carries the name asked for.
    for name in ["ds-v4", "deepseek", "pdserve-embedded"] {
        let (st, _, b) = raw(addr, "GET", &format!("/v1/models/{name}"), &[], b"", T);
        assert_eq!(st, 200, "{name}: {b}");
        let card: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(card["id"], name);
        let mut body = greedy(&[5, 17, 2, 9], 2);
        body["model"] = json!(name);
        let (st, _, v) = post(addr, "/v1/completions", &body, &[]);
        assert_eq!(st, 200, "{name}: {v}");
        assert_eq!(v["model"], "ds-v4", "responses carry the first served name");
        assert_eq!(v["usage"]["completion_tokens"], 2);
    }
    for name in ["gpt-17", "DS-V4", "ds-v4 "] {
        let mut body = greedy(&[5, 17], 1);
        body["model"] = json!(name);
        let (st, _, v) = post(addr, "/v1/completions", &body, &[]);
        assert_eq!(st, 404, "{name}: {v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("serves `ds-v4`, `deepseek`"), "{msg}");
    }
    let (st, _, b) = raw(addr, "GET", "/v1/models/gpt-17", &[], b"", T);
    assert_eq!(st, 404);
    assert!(b.contains("model_not_found"), "{b}");

    // The workers report the first served name (Worker.Info; the router pairs on it).
    let (st, _, b) = raw(addr, "GET", "/workers", &[], b"", T);
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let workers = v["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "{v}");
    for w in workers {
        assert_eq!(w["model"], "ds-v4", "{w}");
    }
}

#[test]
fn served_model_name_layers_and_validation() {
    // The environment gives several names comma-separated; a flag overrides it.
    let out = bin()
        .args(["router", "--print-config"])
        .env("PDSERVE_SERVED_MODEL_NAME", "a,b")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("served_model_name"))
        .unwrap_or_else(|| panic!("no served_model_name in:\n{text}"));
    assert!(
        line.contains(r#"["a","b"]"#) && line.contains("env"),
        "{line}"
    );

    let out = bin()
        .args(["decode", "--print-config", "--served-model-name", "x"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("served_model_name") && l.contains(r#"["x"]"#)),
        "{text}"
    );

    for (role, names, msg) in [
        ("router", &["a", "a"][..], "`a` is given twice"),
        ("prefill", &["m", ""][..], "must be non-empty"),
        ("decode", &[" m"][..], "leading or trailing spaces"),
    ] {
        let out = bin()
            .args([role, "--print-config", "--served-model-name"])
            .args(names)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{role} {names:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(msg), "{role} {names:?}: {err}");
    }
}
