//! One streamed completion through the router (`POST /v1/completions`, `stream: true`,
//! prompt as token ids), timed per token: when its first token arrived and the gap before
//! every later one. Failures are classified here, once, into an [`ErrorClass`].

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Why a request did not complete, as the report counts it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum ErrorClass {
    /// The router answered with a non-200 status; `kind` is the OpenAI error `type`
    /// (and `code` when it has one).
    Http { status: u16, kind: String },
    /// An `event: error` in the stream after a 200.
    Stream { kind: String },
    /// The stream ended without `data: [DONE]`.
    Incomplete,
    /// A chunk that is not the completions API's shape.
    Malformed,
    /// No connection, or it broke.
    Transport,
    /// The whole request took longer than `--timeout-s`.
    Timeout,
}

impl std::fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorClass::Http { status, kind } => write!(f, "http {status} {kind}"),
            ErrorClass::Stream { kind } => write!(f, "stream {kind}"),
            ErrorClass::Incomplete => write!(f, "stream ended without [DONE]"),
            ErrorClass::Malformed => write!(f, "malformed chunk"),
            ErrorClass::Transport => write!(f, "transport"),
            ErrorClass::Timeout => write!(f, "timeout"),
        }
    }
}

/// A failure: its class and the first message seen for it.
#[derive(Debug, Clone)]
pub struct Failure {
    pub class: ErrorClass,
    pub message: String,
}

/// A completed request as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Completed {
    pub tokens: Vec<u32>,
    pub finish: String,
    /// Seconds from sending the request to the first token.
    pub ttft_s: f64,
    /// Seconds from sending the request to `[DONE]`.
    pub e2e_s: f64,
    /// Seconds between consecutive tokens (a chunk of k tokens after a gap g counts as k
    /// gaps of g/k: the router sends one token per chunk, so this is rarely used).
    pub itl_s: Vec<f64>,
}

/// What one request asks for.
pub struct Ask<'a> {
    pub prompt: &'a [u32],
    pub max_tokens: usize,
    pub temperature: f64,
    pub ignore_eos: bool,
    pub seed: u64,
}

#[derive(Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    completions: Uri,
    models: Uri,
    api_key: Option<String>,
    timeout: Duration,
}

/// `/v1/completions` under `base` (`http://host:port`, an optional path prefix kept).
pub fn completions_uri(base: &str) -> anyhow::Result<Uri> {
    endpoint(base, "completions")
}

fn endpoint(base: &str, path: &str) -> anyhow::Result<Uri> {
    let u = format!("{}/v1/{path}", base.trim_end_matches('/'));
    let uri: Uri = u
        .parse()
        .map_err(|e| anyhow::anyhow!("--url `{base}`: {e}"))?;
    match uri.scheme_str() {
        Some("http") => Ok(uri),
        Some(s) => anyhow::bail!("--url `{base}`: scheme `{s}` is not supported (http only)"),
        None => anyhow::bail!("--url `{base}`: give the scheme, e.g. http://127.0.0.1:8000"),
    }
}

fn fail(class: ErrorClass, message: impl Into<String>) -> Failure {
    Failure {
        class,
        message: message.into(),
    }
}

/// The `type` (and `code`) of an OpenAI-shaped error body, or `unknown`.
fn error_kind(body: &str) -> (String, String) {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let e = &v["error"];
    let kind = e["type"].as_str().unwrap_or("unknown");
    let kind = match e["code"].as_str() {
        Some(c) if c != kind => format!("{kind}/{c}"),
        _ => kind.to_string(),
    };
    let msg = e["message"].as_str().unwrap_or(body).to_string();
    (kind, msg)
}

/// Server-sent events split from the byte stream: (event name, data) pairs.
#[derive(Default)]
struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    fn push(&mut self, bytes: &[u8]) -> Vec<(String, String)> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = find_blank_line(&self.buf) {
            let block: Vec<u8> = self.buf.drain(..end.0 + end.1).collect();
            let text = String::from_utf8_lossy(&block[..end.0]);
            let mut event = "message".to_string();
            let mut data: Vec<&str> = Vec::new();
            for line in text.lines() {
                if let Some(e) = line.strip_prefix("event:") {
                    event = e.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push(d.strip_prefix(' ').unwrap_or(d));
                }
            }
            if !data.is_empty() {
                out.push((event, data.join("\n")));
            }
        }
        out
    }
}

/// Position and length of the first `\n\n` or `\r\n\r\n` (an event's end).
fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

/// The growing record of one streamed answer.
struct Timing {
    sent: Instant,
    last: Option<Instant>,
    done: Completed,
}

impl Timing {
    fn chunk(&mut self, data: &str) -> Result<bool, Failure> {
        if data == "[DONE]" {
            return Ok(true);
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| fail(ErrorClass::Malformed, format!("{e}: {data}")))?;
        let c = &v["choices"][0];
        let ids = c["token_ids"].as_array().ok_or_else(|| {
            fail(
                ErrorClass::Malformed,
                format!("no choices[0].token_ids: {data}"),
            )
        })?;
        let ids: Vec<u32> = ids
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| fail(ErrorClass::Malformed, format!("token ids: {data}")))?;
        if !ids.is_empty() {
            let now = Instant::now();
            match self.last {
                None => {
                    // Tokens arriving together with the first one come 0 s after it.
                    self.done.ttft_s = (now - self.sent).as_secs_f64();
                    self.done
                        .itl_s
                        .extend(std::iter::repeat_n(0.0, ids.len() - 1));
                }
                Some(prev) => {
                    let per = (now - prev).as_secs_f64() / ids.len() as f64;
                    self.done.itl_s.extend(std::iter::repeat_n(per, ids.len()));
                }
            }
            self.last = Some(now);
            self.done.tokens.extend(ids);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            self.done.finish = f.to_string();
        }
        Ok(false)
    }
}

impl Client {
    pub fn new(base: &str, api_key: Option<String>, timeout: Duration) -> anyhow::Result<Self> {
        let mut builder = HyperClient::builder(TokioExecutor::new());
        builder.pool_idle_timeout(Duration::from_secs(30));
        Ok(Client {
            http: builder.build_http(),
            completions: completions_uri(base)?,
            models: endpoint(base, "models")?,
            api_key,
            timeout,
        })
    }

    /// The served model's context length from `GET /v1/models` (`max_model_len`); this
    /// is also the check that the router answers at all, before any load is sent.
    /// `GET uri` (with the API key), its body as text; anything but 200 within 10 s is an
    /// error naming the URL.
    async fn get(&self, uri: &Uri) -> anyhow::Result<String> {
        let mut req = Request::get(uri.clone());
        if let Some(k) = &self.api_key {
            req = req.header(AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = req.body(Full::new(Bytes::new()))?;
        let ask = async {
            let resp = self.http.request(req).await?;
            let status = resp.status();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(Duration::from_secs(10), ask)
            .await
            .map_err(|_| anyhow::anyhow!("GET {uri} did not answer within 10 s"))?
            .map_err(|e| anyhow::anyhow!("GET {uri}: {e:#}"))?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if status != StatusCode::OK {
            anyhow::bail!("GET {uri}: {status} {text}");
        }
        Ok(text)
    }

    /// The body of `GET url` (a worker's `/metrics`).
    pub async fn get_text(&self, url: &str) -> anyhow::Result<String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| anyhow::anyhow!("bad URL {url:?}: {e}"))?;
        self.get(&uri).await
    }

    pub async fn max_model_len(&self) -> anyhow::Result<usize> {
        let text = self.get(&self.models).await?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("GET {}: {e}: {text}", self.models))?;
        v["data"][0]["max_model_len"]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| {
                anyhow::anyhow!("GET {}: no data[0].max_model_len in {text}", self.models)
            })
    }

    /// Send `ask` and read its stream to the end, within the request deadline.
    pub async fn complete(&self, ask: &Ask<'_>) -> Result<Completed, Failure> {
        let sent = Instant::now();
        match tokio::time::timeout(self.timeout, self.exchange(ask, sent)).await {
            Ok(r) => r,
            Err(_) => Err(fail(
                ErrorClass::Timeout,
                format!("no [DONE] within {:?}", self.timeout),
            )),
        }
    }

    async fn exchange(&self, ask: &Ask<'_>, sent: Instant) -> Result<Completed, Failure> {
        let body = json!({
            "prompt": ask.prompt,
            "max_tokens": ask.max_tokens,
            "temperature": ask.temperature,
            "seed": ask.seed,
            "ignore_eos": ask.ignore_eos,
            "stream": true,
        });
        let mut req =
            Request::post(self.completions.clone()).header(CONTENT_TYPE, "application/json");
        if let Some(k) = &self.api_key {
            req = req.header(AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| fail(ErrorClass::Transport, e.to_string()))?;
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|e| fail(ErrorClass::Transport, format!("{e:#}")))?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status != StatusCode::OK {
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let (kind, msg) = error_kind(&String::from_utf8_lossy(&bytes));
            return Err(fail(
                ErrorClass::Http {
                    status: status.as_u16(),
                    kind,
                },
                msg,
            ));
        }
        let mut sse = SseParser::default();
        let mut t = Timing {
            sent,
            last: None,
            done: Completed::default(),
        };
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| fail(ErrorClass::Transport, e.to_string()))?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            for (event, data) in sse.push(data) {
                if event == "error" {
                    let (kind, msg) = error_kind(&data);
                    return Err(fail(ErrorClass::Stream { kind }, msg));
                }
                if t.chunk(&data)? {
                    t.done.e2e_s = sent.elapsed().as_secs_f64();
                    return Ok(t.done);
                }
            }
        }
        Err(fail(
            ErrorClass::Incomplete,
            format!("after {} tokens", t.done.tokens.len()),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn events_split_across_reads_and_line_endings() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        let got = p.push(b":1}\n\nevent: error\r\ndata: x\r\n\r\ndata: [DO");
        assert_eq!(
            got,
            vec![
                ("message".to_string(), "{\"a\":1}".to_string()),
                ("error".to_string(), "x".to_string())
            ]
        );
        assert_eq!(
            p.push(b"NE]\n\n"),
            vec![("message".into(), "[DONE]".into())]
        );
        // keep-alive comments carry no data
        assert!(p.push(b":\n\n").is_empty());
    }

    #[test]
    fn chunks_record_tokens_gaps_and_finish() {
        let mut t = Timing {
            sent: Instant::now(),
            last: None,
            done: Completed::default(),
        };
        let chunk = |ids: &str, finish: &str| {
            format!(
                r#"{{"choices":[{{"index":0,"text":"","token_ids":{ids},"finish_reason":{finish}}}]}}"#
            )
        };
        assert!(!t.chunk(&chunk("[5]", "null")).unwrap());
        assert!(!t.chunk(&chunk("[6,7]", "null")).unwrap());
        assert!(!t.chunk(&chunk("[]", "\"length\"")).unwrap());
        assert!(t.chunk("[DONE]").unwrap());
        assert_eq!(t.done.tokens, [5, 6, 7]);
        assert_eq!(t.done.finish, "length");
        assert_eq!(t.done.itl_s.len(), 2, "one gap per token after the first");
        assert!(t.done.ttft_s >= 0.0);
        let e = t.chunk(r#"{"choices":[{"text":"x"}]}"#).unwrap_err();
        assert_eq!(e.class, ErrorClass::Malformed);
    }

    #[test]
    fn errors_are_classified_by_type_and_code() {
        let body = r#"{"error":{"message":"too long","type":"invalid_request_error","param":"prompt","code":"context_length_exceeded"}}"#;
        assert_eq!(
            error_kind(body),
            (
                "invalid_request_error/context_length_exceeded".into(),
                "too long".into()
            )
        );
        assert_eq!(error_kind("<html>").0, "unknown");
        let c = ErrorClass::Http {
            status: 503,
            kind: "unavailable".into(),
        };
        assert_eq!(c.to_string(), "http 503 unavailable");
        assert!(completions_uri("https://x").is_err());
        assert!(completions_uri("127.0.0.1:8000").is_err());
        assert_eq!(
            completions_uri("http://127.0.0.1:8000/")
                .unwrap()
                .to_string(),
            "http://127.0.0.1:8000/v1/completions"
        );
    }
}
