//! A chat reply read as DeepSeek-V4 writes it: reasoning up to `</think>` (in thinking
//! mode), then content, then optionally a DSML tool-call block
//! (`\n\n<｜DSML｜tool_calls>` … `</｜DSML｜tool_calls>`) whose invokes become OpenAI
//! `tool_calls` (arguments decoded as the reference `decode_dsml_to_arguments` does).
//! Text arrives in pieces; a piece that may be the start of a marker is held back until
//! the next one decides, so a stream never shows part of a marker as content.

use crate::chat::dsv4::{DSML, THINK_END};
use crate::chat::pyjson;
use serde_json::Value;

/// How a reply is read, from the rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    /// The reply opens inside a reasoning block.
    pub thinking: bool,
    /// Tool-call blocks are parsed (the request has tools and did not say `none`).
    pub parse_tools: bool,
    /// Text the prompt already holds at the reply's start (a forced tool call).
    pub forced: String,
}

/// One parsed function call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// JSON object text.
    pub arguments: String,
}

/// What a piece of text added.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<Call>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    Calls,
    /// After the block: the reference allows nothing more.
    Over,
}

pub struct ReplyParser {
    state: State,
    parse_tools: bool,
    buf: String,
    /// Calls parsed so far (for `finish_reason: tool_calls`).
    pub calls: usize,
}

fn block_start() -> String {
    format!("\n\n<{DSML}tool_calls>")
}

/// The longest suffix of `s` that is a proper prefix of `marker` (a marker may be split
/// across pieces), as a byte position in `s`.
fn held_from(s: &str, marker: &str) -> usize {
    let mut start = s.len();
    for (i, _) in s.char_indices().rev() {
        if s.len() - i >= marker.len() {
            break;
        }
        if marker.starts_with(&s[i..]) {
            start = i;
        }
    }
    start
}

/// One `<｜DSML｜invoke name="...">\n<params>\n</｜DSML｜invoke>` (without the end tag).
fn parse_invoke(body: &str) -> Option<Call> {
    let rest = body.trim_start().strip_prefix("name=\"")?;
    let (name, mut rest) = rest.split_once("\">\n")?;
    let open = format!("<{DSML}parameter name=\"");
    let close = format!("</{DSML}parameter>");
    let mut fields = Vec::new();
    loop {
        rest = rest.trim_start_matches('\n');
        if rest.is_empty() {
            break;
        }
        let p = rest.strip_prefix(open.as_str())?;
        let (key, p) = p.split_once("\" string=\"")?;
        let (flag, p) = p.split_once("\">")?;
        let (value, p) = p.split_once(close.as_str())?;
        let value = match flag {
            "true" => pyjson::dumps(&Value::String(value.to_string())),
            "false" => value.to_string(),
            _ => return None,
        };
        fields.push(format!(
            "{}: {value}",
            pyjson::dumps(&Value::String(key.to_string()))
        ));
        rest = p;
    }
    Some(Call {
        name: name.to_string(),
        arguments: format!("{{{}}}", fields.join(", ")),
    })
}

impl ReplyParser {
    pub fn new(f: &Format) -> Self {
        let mut p = ReplyParser {
            state: if f.thinking {
                State::Reasoning
            } else {
                State::Content
            },
            parse_tools: f.parse_tools,
            buf: String::new(),
            calls: 0,
        };
        // The forced start is the prompt's, not the reply's: read it, show nothing.
        let _ = p.push(&f.forced);
        p
    }

    /// Read `text`; what it added that is certain.
    pub fn push(&mut self, text: &str) -> Delta {
        self.buf.push_str(text);
        let mut d = Delta::default();
        loop {
            match self.state {
                State::Reasoning => match self.buf.find(THINK_END) {
                    Some(i) => {
                        d.reasoning.push_str(&self.buf[..i]);
                        self.buf.drain(..i + THINK_END.len());
                        self.state = State::Content;
                    }
                    None => {
                        let h = held_from(&self.buf, THINK_END);
                        d.reasoning.push_str(&self.buf[..h]);
                        self.buf.drain(..h);
                        return d;
                    }
                },
                State::Content if self.parse_tools => {
                    let start = block_start();
                    match self.buf.find(&start) {
                        Some(i) => {
                            d.content.push_str(&self.buf[..i]);
                            self.buf.drain(..i + start.len());
                            self.state = State::Calls;
                        }
                        None => {
                            let h = held_from(&self.buf, &start);
                            d.content.push_str(&self.buf[..h]);
                            self.buf.drain(..h);
                            return d;
                        }
                    }
                }
                State::Content => {
                    d.content.push_str(&self.buf);
                    self.buf.clear();
                    return d;
                }
                State::Calls => {
                    let invoke = format!("<{DSML}invoke");
                    let end_invoke = format!("</{DSML}invoke>");
                    let end_block = format!("</{DSML}tool_calls>");
                    let body = self.buf.trim_start_matches('\n');
                    if body.starts_with(&end_block) {
                        self.buf.clear();
                        self.state = State::Over;
                        continue;
                    }
                    let Some(after) = body.strip_prefix(invoke.as_str()) else {
                        // Not (yet) an invoke: wait while it can still become one.
                        if invoke.starts_with(body) || end_block.starts_with(body) {
                            return d;
                        }
                        // Malformed: what is left is content.
                        d.content.push_str(&self.unparsed());
                        self.malformed();
                        return d;
                    };
                    let Some(end) = after.find(&end_invoke) else {
                        return d;
                    };
                    match parse_invoke(&after[..end]) {
                        Some(c) => {
                            d.calls.push(c);
                            self.calls += 1;
                            let consumed = self.buf.len() - after.len() + end + end_invoke.len();
                            self.buf.drain(..consumed);
                        }
                        None => {
                            d.content.push_str(&self.unparsed());
                            self.malformed();
                            return d;
                        }
                    }
                }
                State::Over => {
                    self.buf.clear();
                    return d;
                }
            }
        }
    }

    /// A block that does not parse: the rest of the reply is plain content.
    fn malformed(&mut self) {
        self.parse_tools = false;
        self.state = State::Content;
    }

    /// The held text of a block that did not parse, shown as content (with the block's
    /// opening when no call of it came out).
    fn unparsed(&mut self) -> String {
        let rest = std::mem::take(&mut self.buf);
        if self.calls == 0 {
            format!("{}{rest}", block_start())
        } else {
            rest
        }
    }

    /// The end of the reply: whatever was held back is text of the current part (an
    /// unfinished tool-call block is shown as content rather than lost).
    pub fn finish(&mut self) -> Delta {
        let rest = std::mem::take(&mut self.buf);
        let mut d = Delta::default();
        match self.state {
            State::Reasoning => d.reasoning = rest,
            State::Content => d.content = rest,
            State::Calls => {
                if !rest.trim().is_empty() {
                    self.buf = rest;
                    d.content = self.unparsed();
                }
            }
            State::Over => {}
        }
        d
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn fmt(thinking: bool, tools: bool) -> Format {
        Format {
            thinking,
            parse_tools: tools,
            forced: String::new(),
        }
    }

    /// Feed `text` in pieces of `n` chars; the sum of the deltas.
    fn run(f: &Format, text: &str, n: usize) -> Delta {
        let mut p = ReplyParser::new(f);
        let chars: Vec<char> = text.chars().collect();
        let mut all = Delta::default();
        for piece in chars.chunks(n) {
            let d = p.push(&piece.iter().collect::<String>());
            all.reasoning += &d.reasoning;
            all.content += &d.content;
            all.calls.extend(d.calls);
        }
        let d = p.finish();
        all.reasoning += &d.reasoning;
        all.content += &d.content;
        all
    }

    const CALLS: &str = "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris \"FR\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"calc\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

    #[test]
    fn reasoning_content_and_calls_are_split_whatever_the_piece_size() {
        let text = format!("Let me think.</think>{CALLS}");
        for n in [1, 2, 3, 7, 1000] {
            let d = run(&fmt(true, true), &text, n);
            assert_eq!(d.reasoning, "Let me think.", "n={n}");
            assert_eq!(d.content, "Checking.", "n={n}");
            assert_eq!(
                d.calls,
                vec![
                    Call {
                        name: "get_weather".into(),
                        arguments: "{\"city\": \"Paris \\\"FR\\\"\", \"days\": 3}".into()
                    },
                    Call {
                        name: "calc".into(),
                        arguments: "{}".into()
                    },
                ],
                "n={n}"
            );
        }
    }

    #[test]
    fn without_tools_or_thinking_everything_is_content() {
        let d = run(&fmt(false, false), CALLS, 3);
        assert_eq!(d.content, CALLS);
        assert!(d.calls.is_empty() && d.reasoning.is_empty());
        // Thinking never closed: all reasoning; a lone "<" at the end is not lost.
        let d = run(&fmt(true, false), "hmm <", 1);
        assert_eq!(d.reasoning, "hmm <");
    }

    #[test]
    fn a_forced_start_is_not_shown_and_the_call_completes_it() {
        let f = Format {
            thinking: false,
            parse_tools: true,
            forced: "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"".into(),
        };
        let d = run(&f, "calc\">\n<｜DSML｜parameter name=\"x\" string=\"false\">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>", 2);
        assert_eq!(d.content, "");
        assert_eq!(d.calls.len(), 1);
        assert_eq!(d.calls[0].arguments, "{\"x\": [1, 2]}");
    }

    #[test]
    fn malformed_or_unfinished_blocks_come_out_as_content() {
        let d = run(&fmt(false, true), "a\n\n<｜DSML｜tool_calls>\ngarbage", 4);
        assert_eq!(d.content, "a\n\n<｜DSML｜tool_calls>\ngarbage");
        assert!(d.calls.is_empty());
        let d = run(
            &fmt(false, true),
            "a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n",
            4,
        );
        assert_eq!(
            d.content,
            "a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        );
    }
}
