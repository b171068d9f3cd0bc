//! What the batch loop tells a request's stream, in engine terms, and THE conversion of
//! those events to the wire (`pb::TokenEvent` or a gRPC status) at the service edge.

use pdserve_engine::generate::FinishReason;
use pdserve_engine::sampling::TokenLogprobs;
use pdserve_proto::pb;
use pdserve_proto::pb::token_event::Kind;
use pdserve_worker::Failure;
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
pub type WireSender = mpsc::UnboundedSender<Result<pb::TokenEvent, Status>>;

/// The batch loop's end of a request's stream: takes [`Event`]s, sends their wire form.
#[derive(Debug, Clone)]
pub struct Events(WireSender);

/// The request's stream is gone (the client went away).
#[derive(Debug)]
pub struct Closed;

impl Events {
    pub fn new(wire: WireSender) -> Self {
        Events(wire)
    }

    pub fn send(&self, e: Event) -> Result<(), Closed> {
        self.0.send(to_wire(e)).map_err(|_| Closed)
    }

    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
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
        let ev = Events::new(tx);
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
        let token = rx.try_recv().unwrap().unwrap();
        assert_eq!(token.kind, Some(Kind::Token(7)));
        let scored = rx.try_recv().unwrap().unwrap();
        assert_eq!(
            scored.kind,
            Some(Kind::Scored(pb::ScoredToken {
                token: 9,
                logprob: -0.5,
                top_ids: vec![9, 2],
                top_logprobs: vec![-0.5, -1.25],
            }))
        );
        let done = rx.try_recv().unwrap().unwrap();
        assert_eq!(
            done.kind,
            Some(Kind::Finished(pb::Finished {
                reason: "length".into(),
                prompt_tokens: 3,
                completion_tokens: 1,
            }))
        );
        assert_eq!(
            rx.try_recv().unwrap().unwrap_err().code(),
            tonic::Code::Internal
        );
        assert_eq!(
            rx.try_recv().unwrap().unwrap_err().code(),
            tonic::Code::Unavailable
        );
        drop(rx);
        assert!(ev.is_closed());
        assert!(ev.send(Event::Token(1)).is_err());
    }
}
