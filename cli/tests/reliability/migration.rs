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
