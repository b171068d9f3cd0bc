//! The DeepSeek-V4 prompt format, rendered as the model repository's reference encoder
//! `encoding/encoding_dsv4.py` `encode_messages` renders it (vendored by SGLang as
//! `python/sglang/srt/entrypoints/openai/encoding_dsv4.py`): BOS, then each message with
//! `<｜User｜>` / `<｜Assistant｜>` markers, `</think>` (chat) or `<think>` (thinking) after
//! the turn that prompts a reply, tools and `response_format` in the system prompt, tool
//! calls as DSML blocks, tool results merged into user turns as `<tool_result>` blocks.
//! `tests/fixtures/dsv4_encoding.json` (made by `scripts/dsv4_golden.py` from the
//! reference) pins the output byte for byte.

use super::messages::{Message, Role, ToolCall};
use super::pyjson;
use serde_json::Value;

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
pub const DSML: &str = "｜DSML｜";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";

const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// `reasoning_effort` values the encoder knows (`None` is the default effort).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effort {
    High,
    Max,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Thinking mode (`<think>` opens the reply) instead of chat mode (`</think>`).
    pub thinking: bool,
    /// Drop the reasoning of assistant turns before the last user turn (the reference's
    /// default; never done when any message carries tools).
    pub drop_thinking: bool,
    pub effort: Option<Effort>,
}

/// A message the encoder refuses: its index, the field (`.content`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeError {
    pub index: usize,
    pub field: String,
    pub message: String,
}

/// A piece of a user turn after tool messages are merged into it.
#[derive(Debug, Clone)]
enum Block {
    Text(String),
    ToolResult { call_id: String, content: String },
}

/// A message as the encoder renders it: tool messages become user turns of blocks.
#[derive(Debug, Clone)]
struct Turn {
    role: Role,
    content: String,
    blocks: Vec<Block>,
    reasoning: Option<String>,
    /// Each call's name and its arguments as DSML parameters.
    calls: Vec<(String, String)>,
    call_ids: Vec<Option<String>>,
    tools: Vec<Value>,
    response_format: Option<Value>,
}

/// Python truthiness of an optional JSON value (what `if response_format:` tests).
fn truthy(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// `encode_arguments_to_dsml`: one DSML parameter per argument (strings as they are,
/// other values as JSON); arguments that are not a JSON object are refused, as the
/// reference refuses them.
fn dsml_arguments(call: &ToolCall, index: usize, field: String) -> Result<String, EncodeError> {
    let args = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(Value::Object(o)) => o,
        _ => {
            return Err(EncodeError {
                index,
                field,
                message: format!(
                    "tool call arguments must be a JSON object, got {:?}",
                    call.arguments
                ),
            })
        }
    };
    Ok(args
        .iter()
        .map(|(k, v)| {
            let (is_str, value) = match v {
                Value::String(s) => ("true", s.clone()),
                other => ("false", pyjson::dumps(other)),
            };
            format!("<{DSML}parameter name=\"{k}\" string=\"{is_str}\">{value}</{DSML}parameter>")
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

fn render_tools(tools: &[Value]) -> String {
    let schemas: Vec<String> = tools
        .iter()
        .map(|t| pyjson::dumps(t.get("function").unwrap_or(t)))
        .collect();
    format!(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<{DSML}tool_calls>\" block like the following:\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"$TOOL_NAME\">\n<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n...\n</{DSML}invoke>\n<{DSML}invoke name=\"$TOOL_NAME2\">\n...\n</{DSML}invoke>\n</{DSML}tool_calls>\n\nString parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\nOtherwise, output directly after {THINK_END} with tool calls or final response.\n\n### Available Tool Schemas\n\n{}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n",
        schemas.join("\n")
    )
}

fn response_format_section(rf: &Value) -> String {
    format!(
        "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{}",
        pyjson::dumps(rf)
    )
}

/// Validate what the reference would refuse, then build the turns and merge tool
/// messages into user turns (`merge_tool_messages`).
fn turns(messages: &[Message]) -> Result<Vec<Turn>, EncodeError> {
    let mut merged: Vec<Turn> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role == Role::Developer && m.content.is_empty() {
            return Err(EncodeError {
                index: i,
                field: ".content".into(),
                message: "a developer message must have content".into(),
            });
        }
        let calls = m
            .tool_calls
            .iter()
            .enumerate()
            .map(|(j, c)| {
                let field = format!(".tool_calls[{j}].function.arguments");
                Ok((c.name.clone(), dsml_arguments(c, i, field)?))
            })
            .collect::<Result<Vec<_>, EncodeError>>()?;
        let merges = |merged: &[Turn]| merged.last().is_some_and(|t| t.role == Role::User);
        match m.role {
            Role::Tool => {
                let block = Block::ToolResult {
                    call_id: m.tool_call_id.clone().unwrap_or_default(),
                    content: m.content.clone(),
                };
                if merges(&merged) {
                    if let Some(last) = merged.last_mut() {
                        last.blocks.push(block);
                    }
                    continue;
                }
                merged.push(Turn {
                    role: Role::User,
                    content: String::new(),
                    blocks: vec![block],
                    reasoning: None,
                    calls: Vec::new(),
                    call_ids: Vec::new(),
                    tools: Vec::new(),
                    response_format: None,
                });
            }
            Role::User if merges(&merged) => {
                if let Some(last) = merged.last_mut() {
                    last.blocks.push(Block::Text(m.content.clone()));
                }
            }
            role => merged.push(Turn {
                role,
                content: m.content.clone(),
                blocks: if role == Role::User {
                    vec![Block::Text(m.content.clone())]
                } else {
                    Vec::new()
                },
                reasoning: m.reasoning_content.clone(),
                calls,
                call_ids: m.tool_calls.iter().map(|c| c.id.clone()).collect(),
                tools: m.tools.clone(),
                response_format: m.response_format.clone(),
            }),
        }
    }
    sort_tool_results(&mut merged);
    Ok(merged)
}

/// `sort_tool_results_by_call_order`: tool results of a user turn follow the order of
/// the calls in the assistant turn before it (unknown ids sort as position 0).
fn sort_tool_results(turns: &mut [Turn]) {
    let mut order: Vec<(String, usize)> = Vec::new();
    for t in turns.iter_mut() {
        if t.role == Role::Assistant && !t.calls.is_empty() {
            order = t
                .call_ids
                .iter()
                .enumerate()
                .filter_map(|(i, id)| id.clone().filter(|s| !s.is_empty()).map(|s| (s, i)))
                .collect();
        } else if t.role == Role::User {
            let results: Vec<Block> = t
                .blocks
                .iter()
                .filter(|b| matches!(b, Block::ToolResult { .. }))
                .cloned()
                .collect();
            if results.len() < 2 || order.is_empty() {
                continue;
            }
            let pos = |b: &Block| match b {
                // The last insertion wins, as in a Python dict built in call order.
                Block::ToolResult { call_id, .. } => order
                    .iter()
                    .rev()
                    .find(|(id, _)| id == call_id)
                    .map_or(0, |(_, i)| *i),
                Block::Text(_) => 0,
            };
            let mut sorted = results;
            sorted.sort_by_key(pos);
            let mut next = sorted.into_iter();
            for b in t.blocks.iter_mut() {
                if matches!(b, Block::ToolResult { .. }) {
                    if let Some(s) = next.next() {
                        *b = s;
                    }
                }
            }
        }
    }
}

fn last_user(turns: &[Turn]) -> Option<usize> {
    turns
        .iter()
        .rposition(|t| matches!(t.role, Role::User | Role::Developer))
}

/// `_drop_thinking_messages`: before the last user turn, assistant turns lose their
/// reasoning and developer turns go.
fn drop_thinking(turns: Vec<Turn>) -> Vec<Turn> {
    let last = last_user(&turns);
    turns
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut t)| {
            if last.is_none_or(|l| i >= l) || matches!(t.role, Role::User | Role::System) {
                return Some(t);
            }
            match t.role {
                Role::Assistant => {
                    t.reasoning = None;
                    Some(t)
                }
                _ => None,
            }
        })
        .collect()
}

fn render_turn(i: usize, turns: &[Turn], o: &Options, drop: bool) -> String {
    let t = &turns[i];
    let last = last_user(turns);
    let mut p = String::new();
    if i == 0 && o.thinking && o.effort == Some(Effort::Max) {
        p.push_str(REASONING_EFFORT_MAX);
    }
    let extras = |p: &mut String| {
        if !t.tools.is_empty() {
            p.push_str("\n\n");
            p.push_str(&render_tools(&t.tools));
        }
        if truthy(&t.response_format) {
            if let Some(rf) = &t.response_format {
                p.push_str("\n\n");
                p.push_str(&response_format_section(rf));
            }
        }
    };
    match t.role {
        Role::System => {
            p.push_str(&t.content);
            extras(&mut p);
        }
        Role::Developer => {
            p.push_str(USER);
            p.push_str(&t.content);
            extras(&mut p);
        }
        Role::User => {
            p.push_str(USER);
            let parts: Vec<String> = t
                .blocks
                .iter()
                .map(|b| match b {
                    Block::Text(s) => s.clone(),
                    Block::ToolResult { content, .. } => {
                        format!("<tool_result>{content}</tool_result>")
                    }
                })
                .collect();
            p.push_str(&parts.join("\n\n"));
        }
        // Merged into user turns by `turns`.
        Role::Tool => {}
        Role::Assistant => {
            if o.thinking && (!drop || last.is_none_or(|l| i > l)) {
                p.push_str(t.reasoning.as_deref().unwrap_or_default());
                p.push_str(THINK_END);
            }
            p.push_str(&t.content);
            if !t.calls.is_empty() {
                let invokes: Vec<String> = t
                    .calls
                    .iter()
                    .map(|(name, args)| {
                        format!("<{DSML}invoke name=\"{name}\">\n{args}\n</{DSML}invoke>")
                    })
                    .collect();
                p.push_str(&format!(
                    "\n\n<{DSML}tool_calls>\n{}\n</{DSML}tool_calls>",
                    invokes.join("\n")
                ));
            }
            p.push_str(EOS);
        }
    }
    let followed_by_reply = turns.get(i + 1).is_none_or(|n| n.role == Role::Assistant);
    if followed_by_reply && matches!(t.role, Role::User | Role::Developer) {
        p.push_str(ASSISTANT);
        let opens_thinking = o.thinking && (!drop || last.is_some_and(|l| i >= l));
        p.push_str(if opens_thinking {
            THINK_START
        } else {
            THINK_END
        });
    }
    p
}

/// The prompt for `messages`, BOS first (`encode_messages` with no context).
pub fn encode(messages: &[Message], o: &Options) -> Result<String, EncodeError> {
    let mut turns = turns(messages)?;
    let drop = o.drop_thinking && turns.iter().all(|t| t.tools.is_empty());
    if o.thinking && drop {
        turns = drop_thinking(turns);
    }
    let mut p = BOS.to_string();
    for i in 0..turns.len() {
        p.push_str(&render_turn(i, &turns, o, drop));
    }
    Ok(p)
}
