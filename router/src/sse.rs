//! Streamed responses: each choice's chunks as server-sent events (reasoning, content
//! and tool-call deltas for chat, with the token ids and log-probabilities of the text
//! they carry), the choices interleaved as their tokens come, then the usage chunk and
//! `[DONE]`.

use crate::driver::{Driver, Step};
use crate::reply::ReplyParser;
use crate::shape::{finish_reason, tool_calls, Api, Shape};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use futures::StreamExt;
use pdserve_proto::pb::ScoredToken;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tracing::Instrument;

/// Token counts of a stream's choices, for its usage chunk.
#[derive(Default)]
struct Totals {
    prompt: AtomicUsize,
    completion: AtomicUsize,
    /// A choice ended with an error event: the stream ends there (no `[DONE]`).
    failed: AtomicBool,
}

struct StreamState {
    driver: Driver,
    shape: Shape,
    index: usize,
    totals: Arc<Totals>,
    include_usage: bool,
    /// The chat role chunk went out.
    role_sent: bool,
    /// Chat: the reply's reader; tool calls streamed so far are `parser.calls`.
    parser: Option<ReplyParser>,
    /// Token ids and log-probabilities not yet sent (their text is held back); they go
    /// out on the next chunk.
    pending_ids: Vec<u32>,
    pending_logprobs: Vec<ScoredToken>,
    /// Completions: text offset of the next token (logprobs' `text_offset`).
    offset: usize,
    over: bool,
    span: tracing::Span,
}

impl StreamState {
    /// A chunk's choice fields that carry the pending ids and log-probabilities.
    fn take_pending(&mut self) -> (Vec<u32>, Value) {
        let ids = std::mem::take(&mut self.pending_ids);
        let lp = std::mem::take(&mut self.pending_logprobs);
        let mut offset = self.offset;
        let logprobs = self.shape.logprobs(&lp, &mut offset);
        self.offset = offset;
        (ids, logprobs)
    }

    /// The chat chunks of `text` read through the reply parser (reasoning, content and
    /// tool-call deltas), the pending ids on the first.
    fn chat_chunks(&mut self, text: &str, last: bool) -> Vec<Event> {
        let Some(p) = self.parser.as_mut() else {
            return self.chunk(text, None).into_iter().collect();
        };
        let mut d = p.push(text);
        if last {
            let tail = p.finish();
            d.reasoning.push_str(&tail.reasoning);
            d.content.push_str(&tail.content);
        }
        let first_call = p.calls - d.calls.len();
        let mut deltas = Vec::new();
        if !d.reasoning.is_empty() {
            deltas.push(json!({ "reasoning_content": d.reasoning }));
        }
        if !d.content.is_empty() {
            deltas.push(json!({ "content": d.content }));
        }
        if !d.calls.is_empty() {
            deltas
                .push(json!({ "tool_calls": tool_calls(&self.shape, first_call, &d.calls, true) }));
        }
        deltas
            .into_iter()
            .map(|delta| {
                let (ids, logprobs) = self.take_pending();
                let choice = json!({
                    "index": self.index, "delta": delta, "token_ids": ids,
                    "logprobs": logprobs, "finish_reason": null,
                });
                self.event(choice)
            })
            .collect()
    }

    fn event(&self, choice: Value) -> Event {
        let mut c = self.shape.envelope(true, json!([choice]));
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        Event::default().data(c.to_string())
    }

    fn chunk(&mut self, text: &str, finish: Option<&str>) -> Option<Event> {
        if self.shape.api == Api::Chat && text.is_empty() && finish.is_none() {
            return None;
        }
        let (ids, logprobs) = self.take_pending();
        let choice = match self.shape.api {
            Api::Completion => json!({
                "index": self.index, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
            }),
            Api::Chat => {
                let delta = if text.is_empty() {
                    json!({})
                } else {
                    json!({ "content": text })
                };
                json!({
                    "index": self.index, "delta": delta, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
                })
            }
        };
        Some(self.event(choice))
    }

    fn role_chunk(&self) -> Event {
        self.event(json!({
            "index": self.index, "delta": { "role": "assistant", "content": "" },
            "logprobs": null, "finish_reason": null,
        }))
    }

    /// The events of the next step.
    async fn step(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        if let Some(echo) = self.shape.echo.take() {
            out.extend(self.chunk(&echo, None));
        }
        if self.shape.api == Api::Chat && !self.role_sent {
            self.role_sent = true;
            out.push(self.role_chunk());
        }
        match self.driver.next().await {
            Ok(Some(Step::Delta {
                text,
                ids,
                logprobs,
            })) => {
                self.pending_ids.extend(ids);
                self.pending_logprobs.extend(logprobs);
                if self.shape.api == Api::Chat {
                    out.extend(self.chat_chunks(&text, false));
                } else {
                    out.extend(self.chunk(&text, None));
                }
            }
            Ok(Some(Step::Done {
                text,
                ids,
                logprobs,
                finish,
            })) => {
                self.pending_ids.extend(ids);
                self.pending_logprobs.extend(logprobs);
                if self.shape.api == Api::Chat {
                    out.extend(self.chat_chunks(&text, true));
                    let finish = finish_reason(finish, self.parser.as_ref());
                    out.extend(self.chunk("", Some(&finish)));
                } else {
                    out.extend(self.chunk(&text, Some(&finish)));
                }
                self.totals
                    .prompt
                    .store(self.driver.prompt_tokens, Ordering::Relaxed);
                self.totals
                    .completion
                    .fetch_add(self.driver.completion_tokens, Ordering::Relaxed);
                self.over = true;
            }
            Ok(None) => self.over = true,
            Err(e) => {
                tracing::warn!(error = %e.message, "stream failed mid-generation");
                crate::metrics::stream_error();
                if !self.totals.failed.swap(true, Ordering::Relaxed) {
                    out.push(Event::default().event("error").data(e.body().to_string()));
                }
                self.over = true;
            }
        }
        out
    }
}

/// The SSE stream of every choice (interleaved as their tokens come), then the usage
/// chunk (when asked) and `[DONE]`; after an error event, nothing more.
pub fn stream(
    drivers: Vec<Driver>,
    shape: Shape,
    include_usage: bool,
    reply: Option<&crate::reply::Format>,
) -> impl IntoResponse {
    let totals = Arc::new(Totals::default());
    let envelope = shape.clone();
    let choices = drivers.into_iter().enumerate().map(|(index, driver)| {
        let st = StreamState {
            driver,
            shape: shape.clone(),
            index,
            totals: totals.clone(),
            include_usage,
            role_sent: false,
            parser: reply.map(ReplyParser::new),
            pending_ids: Vec::new(),
            pending_logprobs: Vec::new(),
            offset: 0,
            over: false,
            span: tracing::Span::current(),
        };
        Box::pin(futures::stream::unfold(st, |mut st| async move {
            if st.over || st.totals.failed.load(Ordering::Relaxed) {
                return None;
            }
            let span = st.span.clone();
            let out = st.step().instrument(span).await;
            Some((out, st))
        }))
    });
    let choices: Vec<_> = choices.collect();
    let tail = futures::stream::once(async move {
        if totals.failed.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let mut out = Vec::new();
        if include_usage {
            let (p, c) = (
                totals.prompt.load(Ordering::Relaxed),
                totals.completion.load(Ordering::Relaxed),
            );
            let mut u = envelope.envelope(true, json!([]));
            u["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
            out.push(Event::default().data(u.to_string()));
        }
        out.push(Event::default().data("[DONE]"));
        out
    });
    let events = futures::stream::select_all(choices)
        .chain(tail)
        .flat_map(|v| futures::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>)));
    Sse::new(events).keep_alive(KeepAlive::default())
}
