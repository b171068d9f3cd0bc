//! Kill (SIGKILL), stop (SIGSTOP) and restart of each role with requests in flight: every
//! request ends with its full output (equal to the single-process reference) or a clear
//! terminal error, nothing hangs (every read has a deadline), and the surviving workers
//! give every page back.

use super::pd::*;
use crate::support::*;
use pdserve_engine::sampling::SamplingParams;
use std::thread::JoinHandle;

/// Streams per burst, and tokens per stream: long enough to be mid-stream at the fault
/// (about a second of decoding for the burst on one embedded-model CPU server).
const STREAMS: usize = 6;
const TOKENS: usize = 1200;

struct Burst {
    bodies: Vec<serde_json::Value>,
    want: Vec<Vec<u32>>,
}

fn burst(seed: u64, prompt_len: usize) -> Burst {
    let mut e = engine();
    let prompts: Vec<Vec<u32>> = (0..STREAMS)
        .map(|i| prompt(seed * 100 + i as u64, prompt_len + i))
        .collect();
    Burst {
        bodies: prompts.iter().map(|p| greedy(p, TOKENS)).collect(),
        want: prompts
            .iter()
            .map(|p| reference(&mut e, p, TOKENS, SamplingParams::default()))
            .collect(),
    }
}

/// Every stream of the burst came out whole and equal to its reference.
fn all_exact(what: &str, b: &Burst, handles: Vec<JoinHandle<Outcome>>) {
    for (i, h) in handles.into_iter().enumerate() {
        match h.join().unwrap() {
            Outcome::Done(ids, finish, usage) => {
                assert_eq!(
                    ids, b.want[i],
                    "{what}: stream {i} differs from the reference"
                );
                assert_eq!(
                    (finish.as_str(), usage),
                    ("length", TOKENS as u64),
                    "{what}"
                );
            }
            Outcome::Failed(e) => panic!("{what}: stream {i} failed: {e}"),
        }
    }
}

#[test]
fn decode_killed_stopped_and_restarted_under_load_loses_no_stream() {
    // A 2 s token deadline: a stopped decode server's streams move after 2 s.
    let mut pd = Pd::start(1, 2, &["--token-timeout-s", "2"]);

    let b = burst(1, 20);
    let h = in_flight(&pd.addr, b.bodies.clone());
    let victim = pd.busiest_decode();
    pd.decode[victim].kill();
    all_exact("decode SIGKILL", &b, h);
    pd.wait_idle(10);
    let (ok, failed, _) = pd.counters();
    assert!(
        ok >= 1.0 && failed == 0.0,
        "migrations ok {ok}, failed {failed}"
    );

    // Restarted on the same address: back in rotation and serving.
    pd.decode[victim].restart();
    pd.wait_all_healthy(30);
    let b = burst(2, 20);
    let h = in_flight(&pd.addr, b.bodies.clone());
    let victim = pd.busiest_decode();
    let before = pd.counters().0;
    pd.decode[victim].signal("-STOP");
    all_exact("decode SIGSTOP", &b, h);
    assert!(
        pd.counters().0 > before,
        "no stream migrated off the stopped server"
    );
    // Continued, it finds its streams cancelled and frees their pages.
    pd.decode[victim].signal("-CONT");
    pd.wait_idle(10);
    pd.wait_all_healthy(30);
}

#[test]
fn prefill_stopped_killed_and_restarted_under_load_loses_no_request() {
    // Decode servers give up on a silent prefill after 2 s; the router retries elsewhere.
    let mut pd = Pd::start_with(2, 1, &["--transfer-progress-timeout-s", "2"], &[]);

    // Stopped just before a burst: the requests sent to it before the router notices are
    // retried on the other prefill server after the progress deadline.
    let b = burst(3, 40);
    pd.prefill[0].signal("-STOP");
    let h = in_flight(&pd.addr, b.bodies.clone());
    all_exact("prefill SIGSTOP", &b, h);
    pd.prefill[0].signal("-CONT");
    pd.wait_all_healthy(30);

    // Killed while a burst of long prompts is being prefilled: retried on the other one.
    let b = burst(4, 600);
    let handles: Vec<_> = b
        .bodies
        .iter()
        .map(|body| {
            let (addr, body) = (pd.addr.clone(), body.clone());
            std::thread::spawn(move || stream_to_end(&addr, &body, &mut None))
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(30));
    pd.prefill[1].kill();
    all_exact("prefill SIGKILL", &b, handles);

    pd.prefill[1].restart();
    pd.wait_all_healthy(30);
    let b = burst(5, 20);
    let h = in_flight(&pd.addr, b.bodies.clone());
    all_exact("after the prefill restart", &b, h);
    pd.wait_idle(10);
}

/// A killed router cannot save its own clients' streams (they are its connections), but
/// they end at once instead of hanging, the workers cancel the orphaned generations and
/// free their pages, and a router restarted on the same address serves exactly.
#[test]
fn router_killed_with_streams_in_flight_frees_the_workers_and_restarts() {
    let mut pd = Pd::start(1, 1, &[]);
    let b = burst(6, 20);
    let h = in_flight(&pd.addr, b.bodies.clone());
    pd.kill_router();
    for h in h {
        match h.join().unwrap() {
            Outcome::Failed(e) => {
                assert!(e.contains("without [DONE]") || e.contains("cut"), "{e}")
            }
            other => panic!("a stream of the killed router finished: {other:?}"),
        }
    }
    pd.wait_idle(10);
    pd.restart_router();
    let b = burst(7, 20);
    let h = in_flight(&pd.addr, b.bodies.clone());
    all_exact("after the router restart", &b, h);
    pd.wait_idle(10);
}
