//! Snapshot -> messages -> snapshot, with corruption and layout mismatches caught.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{EntryDtype, KvLayout, KvLayoutSpec};
use pdserve_engine::SeqSnapshot;
use pdserve_kv_transfer::{encode_prefill, Assembler, Prefilled, TransferError};
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
        last_logits: vec![0.5, -1.25, 3.0],
        first_token: 2,
    }
}

fn assemble(
    l: &KvLayout,
    msgs: Vec<pdserve_proto::pb::PrefillMessage>,
) -> Result<Prefilled, TransferError> {
    let mut a = Assembler::new(l);
    for m in msgs {
        a.push(m)?;
    }
    a.finish()
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
