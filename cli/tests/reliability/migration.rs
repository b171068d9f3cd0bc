//! Mid-stream migration: SIGKILL the decode server of a running stream and the router
//! continues the same client stream on another pair, its text (greedy, and seeded with
//! penalties) equal to the unbroken single-process run, usage and finish reason intact;
//! with `--migration-limit 0` the stream ends with an error event instead.

use super::pd::*;
use crate::support::*;
use pdserve_engine::sampling::SamplingParams;
use serde_json::json;

/// Long enough that the kill lands mid-stream (~0.5 s of decoding here; the migration
/// counter checks that it did).
const TOKENS: usize = 2000;

fn seeded() -> (SamplingParams, serde_json::Value) {
    let s = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        seed: 7,
        presence_penalty: 0.3,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    let body = json!({
        "temperature": 0.9, "top_k": 40, "seed": 7, "presence_penalty": 0.3, "frequency_penalty": 0.5,
    });
    (s, body)
}

/// Stream `body` on `addr`, SIGKILL the decode server running it ~100 ms after the
/// client's first token (a few hundred tokens in), restart that server, and return how
/// the stream ended.
fn kill_mid_stream(pd: &mut Pd, addr: &str, body: serde_json::Value) -> Outcome {
    let h = in_flight(addr, vec![body]);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let victim = pd.busiest_decode_of(addr);
    pd.decode[victim].kill();
    let out = h.into_iter().next().unwrap().join().unwrap();
    pd.decode[victim].restart();
    pd.wait_all_healthy(30);
    out
}

#[test]
fn a_decode_killed_mid_stream_hands_the_stream_on_and_the_text_equals_the_unbroken_run() {
    let mut pd = Pd::start(1, 2, &[]);
    let mut e = engine();
    let (seeded_params, seeded_body) = seeded();
    let cases = [
        ("greedy", SamplingParams::default(), json!({})),
        ("seeded with penalties", seeded_params, seeded_body),
    ];
    for (k, (name, params, extra)) in cases.into_iter().enumerate() {
        let p = prompt(40 + k as u64, 24);
        let want = reference(&mut e, &p, TOKENS, params);
        let mut body = greedy(&p, TOKENS);
        for (key, v) in extra.as_object().unwrap() {
            body[key] = v.clone();
        }
        let addr = pd.addr.clone();
        match kill_mid_stream(&mut pd, &addr, body) {
            Outcome::Done(ids, finish, usage) => {
                assert_eq!(ids.len(), TOKENS, "{name}");
                assert_eq!(
                    ids, want,
                    "{name}: the migrated stream differs from the reference"
                );
                assert_eq!(
                    (finish.as_str(), usage),
                    ("length", TOKENS as u64),
                    "{name}"
                );
            }
            Outcome::Failed(e) => panic!("{name}: the stream failed: {e}"),
        }
        let (ok, failed, _) = pd.counters();
        assert_eq!(
            (ok, failed),
            (k as f64 + 1.0, 0.0),
            "{name}: migration counters"
        );
    }
    pd.wait_idle(10);

    // --migration-limit 0: the same kill ends the stream with an error event naming the
    // decode worker (another router on the same workers).
    let (r0, a0) = role(
        "router",
        &[
            "--prefill",
            &pd.prefill[0].addr.clone(),
            "--decode",
            &format!("{},{}", pd.decode[0].addr, pd.decode[1].addr),
            "--migration-limit",
            "0",
        ],
    );
    wait_healthy(&a0, 30);
    match kill_mid_stream(&mut pd, &a0, greedy(&prompt(50, 24), TOKENS)) {
        Outcome::Failed(e) => assert!(e.contains("decode worker"), "{e}"),
        other => panic!("with --migration-limit 0 the stream went on: {other:?}"),
    }
    drop(r0);
    pd.wait_idle(10);
}

/// Each choice's token ids, `logprobs` chunks and finish reason, and the usage, of a
/// streamed request read to its end.
type Choices = (
    Vec<(Vec<u32>, Vec<serde_json::Value>, String)>,
    serde_json::Value,
);

fn collect_choices(
    addr: &str,
    body: &serde_json::Value,
    first: Option<std::sync::mpsc::Sender<()>>,
) -> Result<Choices, String> {
    let (st, mut sse) = stream(addr, body, std::time::Duration::from_secs(30));
    assert_eq!(st, 200);
    let mut first = first;
    let mut choices: Vec<(Vec<u32>, Vec<serde_json::Value>, String)> = Vec::new();
    let mut usage = serde_json::Value::Null;
    while let Some((ev, data)) = sse.next() {
        if ev == "error" {
            return Err(data);
        }
        if data == "[DONE]" {
            return Ok((choices, usage));
        }
        let v: serde_json::Value = serde_json::from_str(&data).unwrap();
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if choices.len() <= i {
                choices.resize(i + 1, Default::default());
            }
            let ch = &mut choices[i];
            ch.0.extend(
                c["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32),
            );
            if !c["logprobs"].is_null() {
                ch.1.push(c["logprobs"].clone());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                ch.2 = f.to_string();
            }
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}

/// `n` choices with log-probabilities: a migrated request gives exactly what the unbroken
/// one gave, choice by choice, log-probabilities included (each choice migrates on its own).
#[test]
fn n_choices_with_logprobs_come_out_of_a_migration_unchanged() {
    let mut pd = Pd::start(1, 2, &[]);
    let body = json!({
        "prompt": prompt(60, 16), "max_tokens": 1500, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": 0.8, "seed": 3, "n": 2, "logprobs": 2,
    });
    let unbroken = collect_choices(&pd.addr, &body, None).unwrap();
    assert_eq!(unbroken.0.len(), 2);
    assert_ne!(
        unbroken.0[0].0, unbroken.0[1].0,
        "the two choices are alike"
    );
    assert_eq!(unbroken.1["completion_tokens"], 3000);

    let (tx, rx) = std::sync::mpsc::channel();
    let (addr, b) = (pd.addr.clone(), body.clone());
    let h = std::thread::spawn(move || collect_choices(&addr, &b, Some(tx)));
    rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let victim = pd.busiest_decode();
    pd.decode[victim].kill();
    let migrated = h.join().unwrap().unwrap();
    assert!(pd.counters().0 >= 1.0, "nothing migrated");
    for i in 0..2 {
        assert_eq!(migrated.0[i].0, unbroken.0[i].0, "choice {i}: tokens");
        assert_eq!(migrated.0[i].2, "length", "choice {i}");
        let all = |c: &[serde_json::Value], key: &str| -> Vec<serde_json::Value> {
            c.iter()
                .flat_map(|l| l[key].as_array().unwrap().clone())
                .collect()
        };
        let (m, u) = (&migrated.0[i].1, &unbroken.0[i].1);
        assert_eq!(
            all(m, "top_logprobs"),
            all(u, "top_logprobs"),
            "choice {i}: top log-probabilities"
        );
        let (m, u) = (all(m, "token_logprobs"), all(u, "token_logprobs"));
        assert_eq!(m.len(), 1500, "choice {i}: one logprob per token");
        assert_eq!(m, u, "choice {i}: log-probabilities");
    }
    assert_eq!(migrated.1, unbroken.1, "usage");
    pd.wait_idle(10);
}
