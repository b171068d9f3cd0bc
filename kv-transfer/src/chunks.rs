//! A sequence snapshot as a stream of messages (header, page chunks, state) and its
//! reassembly with every chunk's checksum verified before its bytes are used.

use crate::{check_peer, layout_info, TransferError};
use pdserve_engine::kv::KvLayout;
use pdserve_engine::SeqSnapshot;
use pdserve_proto::pb;
use pdserve_proto::pb::prefill_message::Kind;

/// What a decode server receives: the KV state, the prefill's last logits and the token
/// the prefill server sampled from them.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefilled {
    pub snapshot: SeqSnapshot,
    pub last_logits: Vec<f32>,
    pub first_token: u32,
}

impl Prefilled {
    /// Bytes of KV pages, state slot and logits: what a transfer counts as moved.
    pub fn payload_bytes(&self) -> usize {
        self.snapshot.pages.iter().map(Vec::len).sum::<usize>()
            + self.snapshot.state.len()
            + 4 * self.last_logits.len()
    }
}

fn crc(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

fn f32s_to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The largest page chunk a sender builds (whatever it is asked for), so that the
/// receiver can bound every message it accepts: see [`max_message_bytes`].
pub const MAX_CHUNK_BYTES: usize = 4 << 20;

/// Room for a message's framing and the header's layout fields.
const MESSAGE_SLACK: usize = 64 << 10;

/// The largest prefill message a receiver with `layout` and `vocab_size` accepts: a page
/// chunk (at most [`MAX_CHUNK_BYTES`], or one page when a page is larger), the state slot,
/// or the header with one f32 logit per vocabulary entry. gRPC refuses anything bigger
/// before buffering it.
pub fn max_message_bytes(layout: &KvLayout, vocab_size: usize) -> usize {
    MAX_CHUNK_BYTES
        .max(layout.page_bytes)
        .max(layout.state_bytes)
        .max(4 * vocab_size)
        + MESSAGE_SLACK
}

/// The heartbeat a prefill server sends while it is queued or computing.
pub fn progress_message() -> pb::PrefillMessage {
    pb::PrefillMessage {
        kind: Some(Kind::Progress(pb::PrefillProgress {})),
    }
}

/// The sampled token, sent ahead of the header when the receiver asked for it early.
pub fn first_token_message(token: u32) -> pb::PrefillMessage {
    pb::PrefillMessage {
        kind: Some(Kind::FirstToken(pb::FirstToken { token })),
    }
}

/// Split a prefilled sequence into messages; page chunks hold at most `chunk_bytes`
/// (capped at [`MAX_CHUNK_BYTES`], at least one page each).
pub fn encode_prefill(
    layout: &KvLayout,
    p: &Prefilled,
    chunk_bytes: usize,
) -> Vec<pb::PrefillMessage> {
    prefill_messages(layout, p, chunk_bytes).collect()
}

/// The messages of [`encode_prefill`], each built (copied and checksummed) only when it is
/// asked for: a sender hands the header to the connection while the page chunks behind
/// it are still being built, so the receiver's side runs alongside.
pub fn prefill_messages<'a>(
    layout: &KvLayout,
    p: &'a Prefilled,
    chunk_bytes: usize,
) -> impl Iterator<Item = pb::PrefillMessage> + 'a {
    let chunk_bytes = chunk_bytes.min(MAX_CHUNK_BYTES);
    let info = layout_info(layout);
    let header = std::iter::once_with(move || {
        let logits = f32s_to_bytes(&p.last_logits);
        pb::PrefillMessage {
            kind: Some(Kind::Header(pb::PrefillHeader {
                layout: Some(info),
                len: p.snapshot.len as u64,
                num_pages: p.snapshot.pages.len() as u32,
                first_token: p.first_token,
                last_logits_crc32: crc(&logits),
                last_logits: logits,
            })),
        }
    });
    let per_chunk = (chunk_bytes / layout.page_bytes.max(1)).max(1);
    let pages = p
        .snapshot
        .pages
        .chunks(per_chunk)
        .enumerate()
        .map(move |(i, group)| {
            let data: Vec<u8> = group.concat();
            pb::PrefillMessage {
                kind: Some(Kind::Pages(pb::PageChunk {
                    first_page: (i * per_chunk) as u32,
                    num_pages: group.len() as u32,
                    crc32: crc(&data),
                    data,
                })),
            }
        });
    let state = std::iter::once_with(move || pb::PrefillMessage {
        kind: Some(Kind::State(pb::StateChunk {
            crc32: crc(&p.snapshot.state),
            data: p.snapshot.state.clone(),
        })),
    });
    header.chain(pages).chain(state)
}

fn verify(what: impl FnOnce() -> String, data: &[u8], sent: u32) -> Result<(), TransferError> {
    let got = crc(data);
    if got != sent {
        return Err(TransferError::Checksum {
            what: what(),
            sent,
            got,
        });
    }
    Ok(())
}

fn protocol(msg: impl Into<String>) -> TransferError {
    TransferError::Protocol(msg.into())
}

struct Header {
    len: usize,
    num_pages: usize,
    first_token: u32,
    logits: Vec<f32>,
}

/// What the receiver's own request says the transfer must be: a header that disagrees
/// in any field is refused before anything it announces is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// The prompt's length: the positions the KV state must cover.
    pub positions: usize,
    /// Pages reserved for the request (prompt + every token it may generate).
    pub reserved_pages: usize,
    /// One logit per vocabulary entry.
    pub vocab_size: usize,
}

/// Reassembles one prefill stream against the receiver's own layout and request.
pub struct Assembler<'a> {
    layout: &'a KvLayout,
    expected: Expected,
    header: Option<Header>,
    /// The token a [`Kind::FirstToken`] message announced ahead of the header.
    early_token: Option<u32>,
    pages: Vec<Vec<u8>>,
    state: Option<Vec<u8>>,
}

impl<'a> Assembler<'a> {
    pub fn new(layout: &'a KvLayout, expected: Expected) -> Self {
        Assembler {
            layout,
            expected,
            header: None,
            early_token: None,
            pages: Vec::new(),
            state: None,
        }
    }

    /// Whether the header has arrived (from then on the data must flow).
    pub fn has_header(&self) -> bool {
        self.header.is_some()
    }

    /// Take one message; errors on a layout mismatch, a bad checksum or an out-of-order part.
    /// Returns the first token when `msg` announced it ahead of the header.
    pub fn push(&mut self, msg: pb::PrefillMessage) -> Result<Option<u32>, TransferError> {
        if let Some(Kind::FirstToken(f)) = &msg.kind {
            return self.on_first_token(f.token).map(Some);
        }
        self.push_data(msg).map(|()| None)
    }

    fn push_data(&mut self, msg: pb::PrefillMessage) -> Result<(), TransferError> {
        match msg.kind {
            None => Err(protocol("empty prefill message")),
            Some(Kind::FirstToken(_)) => Err(protocol("first token handled by push")),
            Some(Kind::Header(h)) => self.on_header(h),
            Some(Kind::Pages(c)) => self.on_pages(c),
            Some(Kind::State(s)) => self.on_state(s),
            Some(Kind::Progress(_)) if self.header.is_none() => Ok(()),
            Some(Kind::Progress(_)) => Err(protocol("progress message after the header")),
        }
    }

    fn on_first_token(&mut self, token: u32) -> Result<u32, TransferError> {
        if self.header.is_some() || self.early_token.is_some() {
            return Err(protocol("first token message after the header or twice"));
        }
        if token as usize >= self.expected.vocab_size {
            return Err(protocol(format!(
                "first token {token} is outside the vocabulary of {}",
                self.expected.vocab_size
            )));
        }
        self.early_token = Some(token);
        Ok(token)
    }

    fn on_header(&mut self, h: pb::PrefillHeader) -> Result<(), TransferError> {
        if self.header.is_some() {
            return Err(protocol("second header in one prefill stream"));
        }
        let theirs = h
            .layout
            .ok_or_else(|| protocol("prefill header without a layout"))?;
        check_peer(self.layout, &theirs)?;
        let want = self.expected;
        if h.len != want.positions as u64 {
            return Err(protocol(format!(
                "header announces {} positions for a prompt of {}",
                h.len, want.positions
            )));
        }
        let len = want.positions;
        let num_pages = h.num_pages as usize;
        if num_pages != self.layout.pages_for(len) {
            return Err(protocol(format!(
                "{num_pages} pages announced for {len} positions; the layout needs {}",
                self.layout.pages_for(len)
            )));
        }
        if num_pages > want.reserved_pages {
            return Err(protocol(format!(
                "{num_pages} pages announced; the request reserved {}",
                want.reserved_pages
            )));
        }
        if h.last_logits.len() != 4 * want.vocab_size {
            return Err(protocol(format!(
                "last logits of {} bytes; the vocabulary needs {} f32 ({} bytes)",
                h.last_logits.len(),
                want.vocab_size,
                4 * want.vocab_size
            )));
        }
        if h.first_token as usize >= want.vocab_size {
            return Err(protocol(format!(
                "first token {} is outside the vocabulary of {}",
                h.first_token, want.vocab_size
            )));
        }
        if let Some(t) = self.early_token.filter(|&t| t != h.first_token) {
            return Err(protocol(format!(
                "header's first token {} differs from the {t} announced before it",
                h.first_token
            )));
        }
        verify(|| "last logits".into(), &h.last_logits, h.last_logits_crc32)?;
        let logits = h
            .last_logits
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        self.pages = Vec::with_capacity(num_pages);
        self.header = Some(Header {
            len,
            num_pages,
            first_token: h.first_token,
            logits,
        });
        Ok(())
    }

    fn on_pages(&mut self, c: pb::PageChunk) -> Result<(), TransferError> {
        let h = self
            .header
            .as_ref()
            .ok_or_else(|| protocol("page chunk before the header"))?;
        if self.state.is_some() {
            return Err(protocol("page chunk after the state"));
        }
        let first = c.first_page as usize;
        let n = c.num_pages as usize;
        if first != self.pages.len() || first + n > h.num_pages || n == 0 {
            return Err(protocol(format!(
                "page chunk [{first}, {}) out of order: expected page {} of {}",
                first + n,
                self.pages.len(),
                h.num_pages
            )));
        }
        let pb_ = self.layout.page_bytes;
        if c.data.len() != n * pb_ {
            return Err(protocol(format!(
                "page chunk of {n} pages has {} bytes; the layout's page is {pb_} bytes",
                c.data.len()
            )));
        }
        verify(
            || format!("pages [{first}, {})", first + n),
            &c.data,
            c.crc32,
        )?;
        self.pages
            .extend(c.data.chunks_exact(pb_).map(<[u8]>::to_vec));
        Ok(())
    }

    fn on_state(&mut self, s: pb::StateChunk) -> Result<(), TransferError> {
        if self.header.is_none() || self.state.is_some() {
            return Err(protocol("state chunk out of order"));
        }
        if s.data.len() != self.layout.state_bytes {
            return Err(protocol(format!(
                "state of {} bytes; the layout's state slot is {} bytes",
                s.data.len(),
                self.layout.state_bytes
            )));
        }
        verify(|| "state slot".into(), &s.data, s.crc32)?;
        self.state = Some(s.data);
        Ok(())
    }

    /// The complete, verified sequence; errors if any part is missing.
    pub fn finish(self) -> Result<Prefilled, TransferError> {
        let h = self
            .header
            .ok_or_else(|| protocol("prefill stream ended before its header"))?;
        if self.pages.len() != h.num_pages {
            return Err(protocol(format!(
                "prefill stream ended after {} of {} pages",
                self.pages.len(),
                h.num_pages
            )));
        }
        let state = self
            .state
            .ok_or_else(|| protocol("prefill stream ended before the state slot"))?;
        Ok(Prefilled {
            snapshot: SeqSnapshot {
                layout_fingerprint: self.layout.fingerprint(),
                len: h.len,
                pages: self.pages,
                state,
            },
            last_logits: h.logits,
            first_token: h.first_token,
        })
    }
}
