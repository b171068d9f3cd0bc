//! What the batch loop tells a request's stream, in engine terms, and THE conversion of
//! those events to the wire (`pb::TokenEvent` or a gRPC status) at the service edge.

use pdserve_engine::generate::FinishReason;
use pdserve_engine::sampling::TokenLogprobs;
use pdserve_proto::pb;
use pdserve_proto::pb::token_event::Kind;
use pdserve_worker::Failure;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tonic::Status;

/// One step of a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(u32),
    /// A token with the log-probabilities it was sampled with (requests that ask).
    Scored(u32, TokenLogprobs),
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    /// The request failed; nothing follows.
    Failed(Failure),
    /// The decode engine is stopping; nothing follows.
    ShuttingDown,
}

/// A request's stream as the gRPC service returns it.
pub type WireSender = mpsc::UnboundedSender<WireItem>;
type WireItem = Result<pb::TokenEvent, Status>;
type Parcel = Vec<(WireSender, WireItem)>;

/// The batch loop's end of a request's stream: takes [`Event`]s and queues their wire form
/// in the loop's [`Courier`], which delivers them when the loop flushes it.
#[derive(Debug, Clone)]
pub struct Events {
    wire: WireSender,
    outbox: Arc<Mutex<Parcel>>,
}

/// The request's stream is gone (the client went away).
#[derive(Debug)]
pub struct Closed;

impl Events {
    /// Queue `e` for the request's stream (delivered at the courier's next flush).
    pub fn send(&self, e: Event) -> Result<(), Closed> {
        if self.wire.is_closed() {
            return Err(Closed);
        }
        let item = (self.wire.clone(), to_wire(e));
        match self.outbox.lock() {
            Ok(mut q) => q.push(item),
            // The lock is only ever held to push or to take the queue: never poisoned
            // in practice, and a poisoned queue still holds plain data.
            Err(poisoned) => poisoned.into_inner().push(item),
        }
        Ok(())
    }

    pub fn is_closed(&self) -> bool {
        self.wire.is_closed()
    }
}

/// Delivers the batch loop's events from a thread of its own, a step's worth at a time.
///
/// Handing an event to a request's stream wakes that stream's task on another thread, a
/// few microseconds each; done row by row on the loop's thread that cost lands between
/// decode steps, while the GPU idles, and grows with the batch. The loop queues its
/// events ([`Events::send`]) and [`Courier::flush`]es once per step: one wake of the
/// courier thread, which does the per-request ones while the next step runs. A request's
/// events keep their order (one queue, one thread).
pub struct Courier {
    outbox: Arc<Mutex<Parcel>>,
    tx: std::sync::mpsc::Sender<Parcel>,
}

impl Courier {
    /// Start the courier thread; it ends once the courier is dropped and everything
    /// flushed is delivered.
    pub fn spawn() -> std::io::Result<Courier> {
        let (tx, rx) = std::sync::mpsc::channel::<Parcel>();
        std::thread::Builder::new()
            .name("decode-stream".into())
            .spawn(move || {
                for parcel in rx {
                    deliver(parcel);
                }
            })?;
        Ok(Courier {
            outbox: Arc::default(),
            tx,
        })
    }

    /// The events of a request whose stream is `wire`.
    pub fn events(&self, wire: WireSender) -> Events {
        Events {
            wire,
            outbox: self.outbox.clone(),
        }
    }

    /// Hand every queued event to the courier thread.
    pub fn flush(&self) {
        let parcel = match self.outbox.lock() {
            Ok(mut q) => std::mem::take(&mut *q),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        if parcel.is_empty() {
            return;
        }
        // A courier thread that is gone (it cannot panic on plain sends) leaves the
        // delivery to this thread.
        if let Err(e) = self.tx.send(parcel) {
            deliver(e.0);
        }
    }
}

impl Drop for Courier {
    /// What is still queued goes out; the thread ends once `tx` is gone with the courier.
    fn drop(&mut self) {
        self.flush();
    }
}

/// Hand `e` to a request's stream at once, outside the batch loop's courier: the service
/// streams the prefill server's first token this way, before the request joins the batch
/// (whose later events then follow it).
pub fn send_now(wire: &WireSender, e: Event) -> Result<(), Closed> {
    wire.send(to_wire(e)).map_err(|_| Closed)
}

fn deliver(parcel: Parcel) {
    for (wire, item) in parcel {
        // A stream that closed meanwhile: its request is dropped at the next step.
        let _ = wire.send(item);
    }
}

fn finish_reason(r: &FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn to_wire(e: Event) -> Result<pb::TokenEvent, Status> {
    let kind = match e {
        Event::Token(t) => Kind::Token(t),
        Event::Scored(token, lp) => Kind::Scored(pb::ScoredToken {
            token,
            logprob: lp.logprob,
            top_ids: lp.top.iter().map(|t| t.0).collect(),
            top_logprobs: lp.top.iter().map(|t| t.1).collect(),
        }),
        Event::Finished {
            reason,
            prompt_tokens,
            completion_tokens,
        } => Kind::Finished(pb::Finished {
            reason: finish_reason(&reason).into(),
            prompt_tokens,
            completion_tokens,
        }),
        Event::Failed(f) => return Err(f.to_status()),
        Event::ShuttingDown => return Err(Status::unavailable("decode server shutting down")),
    };
    Ok(pb::TokenEvent { kind: Some(kind) })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pdserve_engine::ErrorClass;

    #[test]
    fn events_reach_the_wire_in_their_wire_form() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let courier = Courier::spawn().unwrap();
        let ev = courier.events(tx);
        ev.send(Event::Token(7)).unwrap();
        ev.send(Event::Scored(
            9,
            TokenLogprobs {
                logprob: -0.5,
                top: vec![(9, -0.5), (2, -1.25)],
            },
        ))
        .unwrap();
        ev.send(Event::Finished {
            reason: FinishReason::Length,
            prompt_tokens: 3,
            completion_tokens: 1,
        })
        .unwrap();
        ev.send(Event::Failed(Failure::new(ErrorClass::Internal, "bug")))
            .unwrap();
        ev.send(Event::ShuttingDown).unwrap();
        assert!(rx.try_recv().is_err(), "nothing goes out before the flush");
        courier.flush();
        let mut next = || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                match rx.try_recv() {
                    Ok(item) => return item,
                    Err(_) if std::time::Instant::now() < deadline => std::thread::yield_now(),
                    Err(e) => panic!("no event within 10 s: {e}"),
                }
            }
        };
        let token = next().unwrap();
        assert_eq!(token.kind, Some(Kind::Token(7)));
        let scored = next().unwrap();
        assert_eq!(
            scored.kind,
            Some(Kind::Scored(pb::ScoredToken {
                token: 9,
                logprob: -0.5,
                top_ids: vec![9, 2],
                top_logprobs: vec![-0.5, -1.25],
            }))
        );
        let done = next().unwrap();
        assert_eq!(
            done.kind,
            Some(Kind::Finished(pb::Finished {
                reason: "length".into(),
                prompt_tokens: 3,
                completion_tokens: 1,
            }))
        );
        assert_eq!(next().unwrap_err().code(), tonic::Code::Internal);
        assert_eq!(next().unwrap_err().code(), tonic::Code::Unavailable);
        drop(rx);
        assert!(ev.is_closed());
        assert!(ev.send(Event::Token(1)).is_err());
    }

    #[test]
    fn dropping_the_courier_delivers_what_was_queued_in_order() {
        let courier = Courier::spawn().unwrap();
        let (a_tx, mut a_rx) = mpsc::unbounded_channel();
        let (b_tx, mut b_rx) = mpsc::unbounded_channel();
        let (a, b) = (courier.events(a_tx), courier.events(b_tx));
        for t in 0..100 {
            a.send(Event::Token(t)).unwrap();
            b.send(Event::Token(1000 + t)).unwrap();
            if t % 7 == 0 {
                courier.flush();
            }
        }
        drop(courier);
        drop((a, b));
        let tokens = |rx: &mut mpsc::UnboundedReceiver<WireItem>| {
            let mut v = Vec::new();
            // The channel closes once the courier thread has sent everything.
            while let Some(item) = rx.blocking_recv() {
                match item.unwrap().kind {
                    Some(Kind::Token(t)) => v.push(t),
                    k => panic!("{k:?}"),
                }
            }
            v
        };
        assert_eq!(tokens(&mut a_rx), (0..100).collect::<Vec<_>>());
        assert_eq!(tokens(&mut b_rx), (1000..1100).collect::<Vec<_>>());
    }
}
