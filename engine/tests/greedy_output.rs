//! `Logits::Greedy`: an item that asks for its greedy token alone gets
//! `sampling::argmax` of the logits a `Logits::Last` item of the same sequence gets, and
//! no logits rows, in decode steps (mixed with logits rows in one batch) and in prefill
//! forwards; and a greedy `generate` through it gives the tokens of the host argmax.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use pdserve_engine::generate::{generate, prefill, GenerateRequest};
use pdserve_engine::kv::EntryDtype;
use pdserve_engine::sampling::{argmax, SamplingParams};
use pdserve_engine::{ForwardItem, Logits};

#[test]
fn greedy_items_get_the_host_argmax_of_their_logits_and_no_rows() {
    let fx = load_fixture("mixed");
    let mut eng = engine(&fx.dir, EntryDtype::F32, None);
    let prompt = &fx.tokens[..6];
    // Two copies of one sequence: one asks for logits, the other for its greedy token.
    let (mut a, mut b) = (eng.new_sequence().unwrap(), eng.new_sequence().unwrap());
    // A prefill forward asking for the greedy token only.
    let out = eng
        .forward_each(&mut [
            ForwardItem {
                seq: &mut a,
                tokens: prompt,
                logits: Logits::Last,
            },
            ForwardItem {
                seq: &mut b,
                tokens: prompt,
                logits: Logits::Greedy,
            },
        ])
        .unwrap();
    let (la, gb) = (out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
    assert_eq!((la.logits.rows, la.greedy), (1, None));
    assert_eq!(gb.logits.rows, 0, "a greedy item gets no logits rows");
    let mut next = argmax(&la.logits.data).unwrap();
    assert_eq!(gb.greedy.unwrap().token, Some(next));
    assert!(gb.greedy.unwrap().finite);
    // Decode steps mixing both kinds in one batch, over several positions.
    for _ in 0..5 {
        let tok = [next];
        let out = eng
            .forward_each(&mut [
                ForwardItem {
                    seq: &mut b,
                    tokens: &tok,
                    logits: Logits::Greedy,
                },
                ForwardItem {
                    seq: &mut a,
                    tokens: &tok,
                    logits: Logits::Last,
                },
            ])
            .unwrap();
        let (gb, la) = (out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
        assert_eq!((gb.logits.rows, la.logits.rows), (0, 1));
        next = argmax(&la.logits.data).unwrap();
        assert_eq!(gb.greedy.unwrap().token, Some(next));
    }
    // forward() gives a greedy item no rows (its token is forward_each's).
    let rows = eng
        .forward(&mut [ForwardItem {
            seq: &mut b,
            tokens: &[next],
            logits: Logits::Greedy,
        }])
        .unwrap();
    assert_eq!(rows[0].rows, 0);
    eng.release(a).unwrap();
    eng.release(b).unwrap();
}

#[test]
fn greedy_generate_follows_the_host_argmax() {
    let fx = load_fixture("mixed");
    let mut eng = engine(&fx.dir, EntryDtype::F32, None);
    let prompt = fx.tokens[..5].to_vec();
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_new_tokens: 6,
        sampling: SamplingParams::default(),
        stop_tokens: Vec::new(),
        chunk_size: 0,
    };
    let got = generate(&mut eng, &req, |_| {}).unwrap().tokens;
    // The same tokens by hand: logits rows and the host argmax.
    let mut seq = eng.new_sequence().unwrap();
    let mut logits = prefill(&mut eng, &mut seq, &prompt, 0, Logits::Last)
        .unwrap()
        .pop()
        .unwrap();
    let mut want = Vec::new();
    for _ in 0..6 {
        let t = argmax(&logits).unwrap();
        want.push(t);
        logits = eng
            .forward(&mut [ForwardItem {
                seq: &mut seq,
                tokens: &[t],
                logits: Logits::Last,
            }])
            .unwrap()
            .remove(0)
            .data;
    }
    eng.release(seq).unwrap();
    assert_eq!(got, want);
}
