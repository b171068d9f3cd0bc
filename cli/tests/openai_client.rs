//! The official `openai` Python client against a real `pdserve up` cluster
//! (tests/openai_client.py), its answers compared with `pdserve generate`.
//! The interpreter is `$PDSERVE_OPENAI_PYTHON` (set by .ci/run) or `python3`; without the
//! `openai` package the test fails under CI (`CI=true`) and is skipped locally.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_engine::generate::logits_prefill_decode;
use std::path::Path;
use std::process::Command;
use support::*;

const PROMPT: &str = "The quick brown fox";
const MAX_TOKENS: usize = 12;

fn python() -> Option<String> {
    let py = std::env::var("PDSERVE_OPENAI_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    let why = format!(
        "`{py} -c 'import openai'` failed: install the client (.ci/run does: a venv with openai==3.57.0, \
         exported as PDSERVE_OPENAI_PYTHON)"
    );
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{why}");
    }
    eprintln!("SKIPPED openai client test: {why}");
    None
}

/// `pdserve generate --json` on `prompt`: (text, prompt token count).
fn generate(prompt: &str) -> (String, usize) {
    let out = bin()
        .args(["generate", "--prompt", prompt, "--max-new-tokens"])
        .arg(MAX_TOKENS.to_string())
        .args(["--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["text"].as_str().unwrap().to_string(),
        v["prompt_tokens"].as_array().unwrap().len(),
    )
}

#[test]
fn official_openai_client_against_the_cluster() {
    let Some(py) = python() else { return };
    let up = Up::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/openai_client.py");
    let out = Command::new(&py)
        .arg(&script)
        .args(["--base-url", &format!("http://{}/v1", up.addr)])
        .args(["--prompt", PROMPT, "--max-tokens", &MAX_TOKENS.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_client.py failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    eprintln!("openai client summary: {v}");

    // Non-streamed greedy text (already checked equal to the streamed one by the script)
    // equals single-process generation.
    let (want, prompt_tokens) = generate(PROMPT);
    assert_eq!(v["completion"], want.as_str());
    assert_eq!(v["completion_prompt_tokens"], prompt_tokens);
    // Chat with the default template is a completion of "user: ...\nassistant:".
    let (want_chat, chat_prompt_tokens) = generate(&format!("user: {PROMPT}\nassistant:"));
    assert_eq!(v["chat"], want_chat.as_str());
    assert_eq!(v["chat_prompt_tokens"], chat_prompt_tokens);
    // The stop string is absent and the text is cut right before its first occurrence.
    let stop = v["stop"].as_str().unwrap();
    let stopped = v["stopped"].as_str().unwrap();
    assert!(!stop.is_empty() && !stopped.contains(stop));
    assert_eq!(stopped, &want[..want.find(stop).unwrap()]);

    // The log-probabilities the decode server reported are the log-softmax of the logits
    // the engine computes at each generated position (greedy: temperature 1), to 1e-5.
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, generated) = (ids("prompt_ids"), ids("completion_ids"));
    assert_eq!(generated.len(), MAX_TOKENS);
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let rows = logits_prefill_decode(&mut engine(), &all, prompt.len(), 0).unwrap();
    for (j, &t) in generated.iter().enumerate() {
        let row = &rows[prompt.len() - 1 + j];
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = max
            + row
                .iter()
                .map(|&x| (f64::from(x) - max).exp())
                .sum::<f64>()
                .ln();
        let want = f64::from(row[t as usize]) - lse;
        let got = v["token_logprobs"][j].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-5,
            "token {j}: {got} vs engine {want}"
        );
        let mut sorted: Vec<f64> = row.iter().map(|&x| f64::from(x) - lse).collect();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for (k, top) in v["top_logprobs"][j].as_array().unwrap().iter().enumerate() {
            let top = top.as_f64().unwrap();
            assert!(
                (top - sorted[k]).abs() < 1e-5,
                "token {j} top {k}: {top} vs {}",
                sorted[k]
            );
        }
    }
}
