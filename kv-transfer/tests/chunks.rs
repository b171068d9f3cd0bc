//! Snapshot -> messages -> snapshot, with corruption and layout mismatches caught.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{EntryDtype, KvLayout, KvLayoutSpec};
use pdserve_engine::SeqSnapshot;
use pdserve_kv_transfer::{
    encode_prefill, first_token_message, Assembler, Expected, Prefilled, TransferError,
};
use pdserve_proto::pb::prefill_message::Kind;

fn layout(index_k: EntryDtype, page_tokens: usize) -> KvLayout {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let mut spec = KvLayoutSpec::default_for(&cfg);
    spec.index_k_dtype = index_k;
    spec.page_tokens = page_tokens;
    KvLayout::new(&cfg, spec).unwrap()
}

fn sample(l: &KvLayout, len: usize) -> Prefilled {
    let n = l.pages_for(len);
    Prefilled {
        snapshot: SeqSnapshot {
            layout_fingerprint: l.fingerprint(),
            len,
            pages: (0..n)
                .map(|p| (0..l.page_bytes).map(|i| (i * 7 + p * 13) as u8).collect())
                .collect(),
            state: (0..l.state_bytes).map(|i| (i % 251) as u8).collect(),
        },
        last_logits: vec![0.5, -1.25, 3.0, 0.0],
        first_token: 2,
    }
}

/// The sample's vocabulary (one logit each).
const VOCAB: usize = 4;

/// What a receiver expects of `sample(l, len)`: its positions, a reservation of 2 more
/// pages than the prompt needs, the sample's vocabulary.
fn expected(l: &KvLayout, len: usize) -> Expected {
    Expected {
        positions: len,
        reserved_pages: l.pages_for(len) + 2,
        vocab_size: VOCAB,
    }
}

fn assemble(
    l: &KvLayout,
    msgs: Vec<pdserve_proto::pb::PrefillMessage>,
) -> Result<Prefilled, TransferError> {
    let len = msgs
        .iter()
        .find_map(|m| match &m.kind {
            Some(Kind::Header(h)) => Some(h.len as usize),
            _ => None,
        })
        .unwrap_or(0);
    assemble_against(l, expected(l, len), msgs)
}

fn assemble_against(
    l: &KvLayout,
    want: Expected,
    msgs: Vec<pdserve_proto::pb::PrefillMessage>,
) -> Result<Prefilled, TransferError> {
    push_all(l, want, msgs).map(|(_, p)| p)
}

#[test]
fn roundtrip_in_several_chunks() {
    let l = layout(EntryDtype::F32, 32);
    let p = sample(&l, 32 * 5 + 3);
    let msgs = encode_prefill(&l, &p, 2 * l.page_bytes);
    // header + 3 page chunks (2 + 2 + 2 pages) + state
    assert_eq!(msgs.len(), 5);
    assert_eq!(assemble(&l, msgs).unwrap(), p);
}

#[test]
fn corrupted_page_chunk_is_refused() {
    let l = layout(EntryDtype::F32, 32);
    let p = sample(&l, 100);
    let mut msgs = encode_prefill(&l, &p, l.page_bytes);
    if let Some(Kind::Pages(c)) = msgs[2].kind.as_mut() {
        c.data[17] ^= 1;
    } else {
        panic!("expected a page chunk");
    }
    let e = assemble(&l, msgs).unwrap_err();
    assert!(
        matches!(e, TransferError::Checksum { ref what, .. } if what == "pages [1, 2)"),
        "{e}"
    );
}

#[test]
fn corrupted_state_and_truncated_stream_are_refused() {
    let l = layout(EntryDtype::F32, 32);
    let p = sample(&l, 40);
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    if let Some(Kind::State(s)) = msgs.last_mut().unwrap().kind.as_mut() {
        s.data[0] ^= 0x80;
    }
    assert!(matches!(
        assemble(&l, msgs).unwrap_err(),
        TransferError::Checksum { .. }
    ));
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    msgs.pop();
    let e = assemble(&l, msgs).unwrap_err();
    assert!(e.to_string().contains("before the state slot"), "{e}");
}

#[test]
fn mismatched_index_k_dtype_is_named() {
    let ours = layout(EntryDtype::F32, 32);
    let theirs = layout(EntryDtype::Bf16, 32);
    let msgs = encode_prefill(&theirs, &sample(&theirs, 10), 1 << 20);
    let e = assemble(&ours, msgs).unwrap_err();
    assert!(matches!(e, TransferError::Layout(_)));
    assert!(e.to_string().contains("index_k_dtype"), "{e}");
    let pdserve_engine::kv::LayoutError::Mismatch { field, .. } = (match e {
        TransferError::Layout(l) => l,
        _ => unreachable!(),
    }) else {
        panic!()
    };
    assert_eq!(field, "index_k_dtype");
}

fn header_mut(
    msgs: &mut [pdserve_proto::pb::PrefillMessage],
) -> &mut pdserve_proto::pb::PrefillHeader {
    match msgs[0].kind.as_mut() {
        Some(Kind::Header(h)) => h,
        _ => panic!("the first message is the header"),
    }
}

fn protocol_error(e: TransferError) -> String {
    match e {
        TransferError::Protocol(m) => m,
        other => panic!("expected a protocol error, got {other}"),
    }
}

#[test]
fn header_fields_are_checked_against_the_request() {
    let l = layout(EntryDtype::F32, 32);
    let p = sample(&l, 3);
    let want = expected(&l, 3);
    // A header claiming 4090 positions (pages consistent with that claim) for 3 tokens.
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    let h = header_mut(&mut msgs);
    h.len = 4090;
    h.num_pages = l.pages_for(4090) as u32;
    let e = protocol_error(assemble_against(&l, want, msgs).unwrap_err());
    assert_eq!(e, "header announces 4090 positions for a prompt of 3");
    // 10^9 positions.
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    header_mut(&mut msgs).len = 1_000_000_000;
    let e = protocol_error(assemble_against(&l, want, msgs).unwrap_err());
    assert!(e.contains("1000000000 positions for a prompt of 3"), "{e}");
    // Pages that do not match the positions.
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    header_mut(&mut msgs).num_pages = 16;
    let e = protocol_error(assemble_against(&l, want, msgs).unwrap_err());
    assert_eq!(e, "16 pages announced for 3 positions; the layout needs 1");
    // A reservation smaller than the prompt's pages.
    let tight = Expected {
        reserved_pages: 0,
        ..want
    };
    let e =
        protocol_error(assemble_against(&l, tight, encode_prefill(&l, &p, 1 << 20)).unwrap_err());
    assert_eq!(e, "1 pages announced; the request reserved 0");
    // Short logits (with a valid checksum over them).
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    let h = header_mut(&mut msgs);
    h.last_logits.truncate(3 * 4);
    h.last_logits_crc32 = crc32fast::hash(&h.last_logits);
    let e = protocol_error(assemble_against(&l, want, msgs).unwrap_err());
    assert_eq!(
        e,
        "last logits of 12 bytes; the vocabulary needs 4 f32 (16 bytes)"
    );
    // A first token outside the vocabulary.
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    header_mut(&mut msgs).first_token = VOCAB as u32;
    let e = protocol_error(assemble_against(&l, want, msgs).unwrap_err());
    assert_eq!(e, "first token 4 is outside the vocabulary of 4");
    // The honest stream passes.
    assert_eq!(
        assemble_against(&l, want, encode_prefill(&l, &p, 1 << 20)).unwrap(),
        p
    );
}

#[test]
fn progress_messages_come_only_before_the_header() {
    let l = layout(EntryDtype::F32, 32);
    let p = sample(&l, 40);
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    msgs.insert(0, pdserve_kv_transfer::progress_message());
    msgs.insert(0, pdserve_kv_transfer::progress_message());
    assert_eq!(assemble(&l, msgs).unwrap(), p);
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    msgs.insert(1, pdserve_kv_transfer::progress_message());
    let e = protocol_error(assemble(&l, msgs).unwrap_err());
    assert_eq!(e, "progress message after the header");
}

/// Every message of `msgs` into one assembler; the tokens announced ahead of the header
/// and the sequence.
fn push_all(
    l: &KvLayout,
    want: Expected,
    msgs: Vec<pdserve_proto::pb::PrefillMessage>,
) -> Result<(Vec<u32>, Prefilled), TransferError> {
    let mut a = Assembler::new(l, want);
    let mut early = Vec::new();
    for m in msgs {
        early.extend(a.push(m)?);
    }
    Ok((early, a.finish()?))
}

#[test]
fn a_first_token_ahead_of_the_header_is_announced_and_must_agree_with_it() {
    let l = layout(EntryDtype::F32, 32);
    let p = sample(&l, 40);
    // Announced once, before the header (heartbeats may come before and after it).
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    msgs.insert(0, pdserve_kv_transfer::progress_message());
    msgs.insert(0, first_token_message(p.first_token));
    msgs.insert(0, pdserve_kv_transfer::progress_message());
    let (early, got) = push_all(&l, expected(&l, 40), msgs).unwrap();
    assert_eq!((early, got), (vec![2], p.clone()));
    // Without it, the header alone carries the token.
    let (early, got) = push_all(&l, expected(&l, 40), encode_prefill(&l, &p, 1 << 20)).unwrap();
    assert_eq!((early, got), (vec![], p.clone()));
    // A header that disagrees with the announced token.
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    msgs.insert(0, first_token_message(1));
    let e = protocol_error(push_all(&l, expected(&l, 40), msgs).unwrap_err());
    assert_eq!(
        e,
        "header's first token 2 differs from the 1 announced before it"
    );
    // Twice, or after the header.
    for at in [0, 1] {
        let mut msgs = encode_prefill(&l, &p, 1 << 20);
        msgs.insert(0, first_token_message(2));
        msgs.insert(at + 1, first_token_message(2));
        let e = protocol_error(push_all(&l, expected(&l, 40), msgs).unwrap_err());
        assert_eq!(
            e, "first token message after the header or twice",
            "at {at}"
        );
    }
    // Outside the vocabulary.
    let mut msgs = encode_prefill(&l, &p, 1 << 20);
    msgs.insert(0, first_token_message(VOCAB as u32));
    let e = protocol_error(push_all(&l, expected(&l, 40), msgs).unwrap_err());
    assert_eq!(e, "first token 4 is outside the vocabulary of 4");
}

#[test]
fn message_bound_covers_every_message_a_sender_builds() {
    use pdserve_kv_transfer::MAX_CHUNK_BYTES;
    use prost::Message;
    let l = layout(EntryDtype::F32, 32);
    // Pages for a little over two capped chunks.
    let pages = 2 * MAX_CHUNK_BYTES / l.page_bytes + 1;
    let p = sample(&l, 32 * pages);
    let bound = pdserve_kv_transfer::max_message_bytes(&l, VOCAB);
    // Asked for 1 GiB chunks, the sender still stays under the receiver's bound.
    let msgs = encode_prefill(&l, &p, 1 << 30);
    assert_eq!(
        msgs.len(),
        1 + 3 + 1,
        "header, three capped page chunks, state"
    );
    for m in &msgs {
        assert!(m.encoded_len() <= bound, "{} > {bound}", m.encoded_len());
    }
}
