//! Chat `messages` of a request validated into [`Message`]s: the roles `system`,
//! `developer`, `user`, `assistant` and `tool`; content a string, text parts (joined) or
//! null; assistant `tool_calls` and `reasoning_content`; a tool message's
//! `tool_call_id`. Every refusal names the field (`messages[2].tool_calls[0].function`).

use crate::error::ApiError;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub const NAMES: [&'static str; 5] = ["system", "developer", "user", "assistant", "tool"];

    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "system" => Role::System,
            "developer" => Role::Developer,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            _ => return None,
        })
    }
}

/// One function call of an assistant message; `arguments` is JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: Option<String>,
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// An assistant turn's thinking (the `reasoning_content` a client sends back).
    pub reasoning_content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    /// A tool message: the call it answers.
    pub tool_call_id: Option<String>,
    /// Request-level `tools` (OpenAI objects) attached to this message by the DeepSeek-V4
    /// request mapping; never set from a client's message.
    pub tools: Vec<Value>,
    /// Request-level `response_format`, attached likewise.
    pub response_format: Option<Value>,
}

impl Message {
    pub fn new(role: Role, content: &str) -> Self {
        Message {
            role,
            content: content.to_string(),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            tools: Vec::new(),
            response_format: None,
        }
    }

    /// The OpenAI shape of this message, as Jinja chat templates read it.
    pub fn to_template_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), self.role.name().into());
        m.insert("content".into(), self.content.clone().into());
        if let Some(r) = &self.reasoning_content {
            m.insert("reasoning_content".into(), r.clone().into());
        }
        if !self.tool_calls.is_empty() {
            let calls = self
                .tool_calls
                .iter()
                .map(|c| {
                    serde_json::json!({
                        "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    })
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), id.clone().into());
        }
        Value::Object(m)
    }
}

/// Message fields accepted; `name` (a participant name) is accepted and ignored.
const FIELDS: [&str; 6] = [
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
];

fn bad(param: &str, code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, code, msg)
}

fn text(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            parts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                _ => Err(bad(
                    &format!("{param}[{i}]"),
                    "invalid_value",
                    "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                )),
            }
                })
                .collect()
        }
        Some(x) => Err(bad(
            param,
            "invalid_type",
            format!("content must be a string or a list of text parts, got {x}"),
        )),
    }
}

fn opt_string(v: Option<&Value>, param: &str) -> Result<Option<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(x) => Err(bad(
            param,
            "invalid_type",
            format!("`{param}` must be a string, got {x}"),
        )),
    }
}

fn tool_call(v: &Value, param: &str) -> Result<ToolCall, ApiError> {
    let o = v
        .as_object()
        .ok_or_else(|| bad(param, "invalid_type", "a tool call must be an object"))?;
    if let Some(t) = o.get("type") {
        if t != "function" {
            return Err(bad(
                &format!("{param}.type"),
                "invalid_value",
                format!("only tool calls of type `function`, got {t}"),
            ));
        }
    }
    let fparam = format!("{param}.function");
    let f = o
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            bad(
                &fparam,
                "missing_required_parameter",
                "a tool call needs `function` with `name` and `arguments`",
            )
        })?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
        bad(
            &format!("{fparam}.name"),
            "missing_required_parameter",
            "a tool call's function needs a `name` string",
        )
    })?;
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        // Some clients send the arguments object itself; it is the same JSON.
        Some(a @ Value::Object(_)) => super::pyjson::dumps(a),
        None | Some(Value::Null) => "{}".into(),
        Some(x) => {
            return Err(bad(
                &format!("{fparam}.arguments"),
                "invalid_type",
                format!("`arguments` must be a JSON string, got {x}"),
            ))
        }
    };
    Ok(ToolCall {
        id: opt_string(o.get("id"), &format!("{param}.id"))?,
        name: name.to_string(),
        arguments,
    })
}

/// Validate `messages` (already known to be present).
pub fn parse(msgs: &Value) -> Result<Vec<Message>, ApiError> {
    let list = msgs.as_array().ok_or_else(|| {
        bad(
            "messages",
            "invalid_type",
            "`messages` must be a list of message objects",
        )
    })?;
    if list.is_empty() {
        return Err(bad(
            "messages",
            "invalid_value",
            "`messages` must hold at least one message",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| one(m, &format!("messages[{i}]")))
        .collect()
}

fn one(m: &Value, param: &str) -> Result<Message, ApiError> {
    let o = m
        .as_object()
        .ok_or_else(|| bad(param, "invalid_type", "a message must be an object"))?;
    if let Some(k) = o.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(
            &format!("{param}.{k}"),
            "unsupported_parameter",
            format!("message field `{k}` is not supported (accepted: {FIELDS:?})"),
        ));
    }
    let role = match o.get("role") {
        Some(Value::String(r)) => Role::parse(r).ok_or_else(|| {
            bad(
                &format!("{param}.role"),
                "invalid_value",
                format!("role `{r}` is not one of {:?}", Role::NAMES),
            )
        })?,
        None => {
            return Err(bad(
                &format!("{param}.role"),
                "missing_required_parameter",
                format!("missing required parameter `{param}.role`"),
            ))
        }
        Some(x) => {
            return Err(bad(
                &format!("{param}.role"),
                "invalid_type",
                format!("role must be a string, got {x}"),
            ))
        }
    };
    let mut msg = Message::new(role, &text(o.get("content"), &format!("{param}.content"))?);
    msg.reasoning_content = opt_string(
        o.get("reasoning_content"),
        &format!("{param}.reasoning_content"),
    )?;
    msg.tool_call_id = opt_string(o.get("tool_call_id"), &format!("{param}.tool_call_id"))?;
    match o.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            msg.tool_calls = calls
                .iter()
                .enumerate()
                .map(|(j, c)| tool_call(c, &format!("{param}.tool_calls[{j}]")))
                .collect::<Result<_, _>>()?;
        }
        Some(x) => {
            return Err(bad(
                &format!("{param}.tool_calls"),
                "invalid_type",
                format!("`tool_calls` must be a list, got {x}"),
            ))
        }
    }
    let only = |field: &str, present: bool, owner: Role| -> Result<(), ApiError> {
        if present && role != owner {
            return Err(bad(
                &format!("{param}.{field}"),
                "invalid_value",
                format!("`{field}` belongs on a `{}` message", owner.name()),
            ));
        }
        Ok(())
    };
    only("tool_calls", !msg.tool_calls.is_empty(), Role::Assistant)?;
    only(
        "reasoning_content",
        msg.reasoning_content.is_some(),
        Role::Assistant,
    )?;
    only("tool_call_id", msg.tool_call_id.is_some(), Role::Tool)?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn full_openai_messages_parse_and_bad_ones_name_the_field() {
        let m = parse(&json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning_content": "hm",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"},
        ]))
        .unwrap();
        assert_eq!(m[0].content, "ab");
        assert_eq!(m[1].tool_calls[0].arguments, "{\"x\": 1}");
        assert_eq!(m[1].reasoning_content.as_deref(), Some("hm"));
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        for (msgs, param) in [
            (
                json!([{"role": "robot", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"content": "x"}]), "messages[0].role"),
            (
                json!([{"role": "user", "content": 3}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": "x", "audio": {}}]),
                "messages[0].audio",
            ),
            (
                json!([{"role": "user", "tool_calls": [{"function": {"name": "f"}}]}]),
                "messages[0].tool_calls",
            ),
            (
                json!([{"role": "assistant", "tool_calls": [{"type": "x"}]}]),
                "messages[0].tool_calls[0].type",
            ),
            (
                json!([{"role": "assistant", "tool_calls": [{}]}]),
                "messages[0].tool_calls[0].function",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image_url"}]}]),
                "messages[0].content[0]",
            ),
            (json!([]), "messages"),
        ] {
            let e = parse(&msgs).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{msgs}: {}", e.message);
        }
    }
}
