//! A chat request's rendering fields (`messages`, `tools`, `tool_choice`,
//! `response_format`, `chat_template_kwargs`, `reasoning_effort`,
//! `add_generation_prompt`) validated into a [`ChatInput`], and its rendering into the
//! prompt text. For DeepSeek-V4 the mapping is SGLang's (`serving_chat.py`, the `dsv4`
//! encoding spec): an empty system message is inserted first when the first message is
//! not a system one, the request's `tools` (and a JSON `response_format`) are attached
//! to it, thinking comes from `chat_template_kwargs.thinking`, and `reasoning_effort`
//! from the top level or the kwargs, `max`/`high` kept and the other OpenAI levels
//! meaning the default effort.

use super::dsv4::{self, Effort};
use super::messages::{self, Message, Role};
use super::{Renderer, DEEPSEEK_V4};
use crate::error::ApiError;
use serde_json::{Map, Value};

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function(String),
}

#[derive(Debug, Clone)]
pub struct ChatInput {
    pub messages: Vec<Message>,
    /// OpenAI tool objects (`{"type": "function", "function": {...}}`).
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// A `json_object` / `json_schema` response format (`text` is no format).
    pub response_format: Option<Value>,
    pub reasoning_effort: Option<String>,
    /// The router's `--chat-template-kwargs` overlaid with the request's.
    pub kwargs: Map<String, Value>,
    pub add_generation_prompt: bool,
    /// The reply follows a grammar (a JSON `response_format` or `structured_outputs`):
    /// in thinking mode the prompt closes the reasoning block, so the grammar governs
    /// the whole reply.
    pub constrained: bool,
}

/// A rendered chat prompt and how the reply is to be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// The reply opens inside a reasoning block (thinking mode).
    pub thinking: bool,
    /// Tool calls in the reply are parsed into `tool_calls`.
    pub parse_tools: bool,
    /// Text appended to the prompt that starts the reply with a tool call (tool_choice
    /// `required` or a named function); the reply parser reads it as the reply's start.
    pub forced: String,
}

/// `reasoning_effort` values accepted (OpenAI's and DeepSeek's `max`).
pub const EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "max"];

/// `chat_template_kwargs` the DeepSeek-V4 renderer reads.
const V4_KWARGS: [&str; 4] = [
    "thinking",
    "enable_thinking",
    "drop_thinking",
    "reasoning_effort",
];

fn bad(param: &str, code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, code, msg)
}

fn is_null(v: Option<&Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

fn tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(x) => {
            return Err(bad(
                "tools",
                "invalid_type",
                format!("`tools` must be a list, got {x}"),
            ))
        }
    };
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                &format!("{p}.type"),
                "invalid_value",
                "only tools of type `function`",
            ));
        }
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str);
        if name.is_none_or(str::is_empty) {
            return Err(bad(
                &format!("{p}.function.name"),
                "missing_required_parameter",
                "a tool needs `function.name`",
            ));
        }
    }
    Ok(list.clone())
}

fn tool_name(t: &Value) -> &str {
    t.get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    "invalid_value",
                    format!("tool_choice `{other}` is not auto, none, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                ))
            }
        },
        Some(o) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if o.get("type").and_then(Value::as_str) == Some("function") => {
                if !tools.iter().any(|t| tool_name(t) == name) {
                    return Err(bad(
                        "tool_choice",
                        "invalid_value",
                        format!("tool_choice names `{name}`, which is not in `tools`"),
                    ));
                }
                ToolChoice::Function(name.to_string())
            }
            _ => {
                return Err(bad(
                    "tool_choice",
                    "invalid_value",
                    "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(bad(
            "tool_choice",
            "invalid_value",
            "tool_choice requires a tool call but the request has no `tools`",
        ));
    }
    Ok(choice)
}

fn response_format(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    if is_null(v) {
        return Ok(None);
    }
    let rf = v.cloned().unwrap_or(Value::Null);
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(rf)),
        Some("json_schema") => {
            if !rf.get("json_schema").is_some_and(Value::is_object) {
                return Err(bad(
                    "response_format.json_schema",
                    "missing_required_parameter",
                    "a json_schema response format needs `json_schema` (with `name` and `schema`)",
                ));
            }
            Ok(Some(rf))
        }
        _ => Err(bad(
            "response_format.type",
            "invalid_value",
            "response_format type must be text, json_object or json_schema",
        )),
    }
}

fn flag(kwargs: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match kwargs.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(x) => Err(bad(
            &format!("chat_template_kwargs.{key}"),
            "invalid_type",
            format!("`{key}` must be a boolean, got {x}"),
        )),
    }
}

impl ChatInput {
    /// Read the rendering fields of a chat request (or a `/tokenize` body) over the
    /// router's default kwargs.
    pub fn from_body(body: &Value, defaults: &Map<String, Value>) -> Result<Self, ApiError> {
        let messages = match body.get("messages") {
            Some(m) => messages::parse(m)?,
            None => {
                return Err(bad(
                    "messages",
                    "missing_required_parameter",
                    "missing required parameter `messages`",
                ))
            }
        };
        let tools = tools(body.get("tools"))?;
        let tool_choice = tool_choice(body.get("tool_choice"), &tools)?;
        let mut kwargs = defaults.clone();
        match body.get("chat_template_kwargs") {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) => kwargs.extend(o.clone()),
            Some(x) => {
                return Err(bad(
                    "chat_template_kwargs",
                    "invalid_type",
                    format!("`chat_template_kwargs` must be an object, got {x}"),
                ))
            }
        }
        let effort = |v: Option<&Value>, param: &str| -> Result<Option<String>, ApiError> {
            match v {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if EFFORTS.contains(&s.as_str()) => Ok(Some(s.clone())),
                Some(x) => Err(bad(
                    param,
                    "invalid_value",
                    format!("reasoning_effort must be one of {EFFORTS:?}, got {x}"),
                )),
            }
        };
        let top = effort(body.get("reasoning_effort"), "reasoning_effort")?;
        let kw = effort(
            kwargs.get("reasoning_effort"),
            "chat_template_kwargs.reasoning_effort",
        )?;
        let add_generation_prompt = match body.get("add_generation_prompt") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(x) => {
                return Err(bad(
                    "add_generation_prompt",
                    "invalid_type",
                    format!("`add_generation_prompt` must be a boolean, got {x}"),
                ))
            }
        };
        let response_format = response_format(body.get("response_format"))?;
        Ok(ChatInput {
            messages,
            tools,
            tool_choice,
            constrained: response_format.is_some() || !is_null(body.get("structured_outputs")),
            response_format,
            reasoning_effort: top.or(kw),
            kwargs,
            add_generation_prompt,
        })
    }

    /// Thinking as the kwargs ask (`thinking`, or `enable_thinking` as Qwen-style
    /// templates name it); off by default, as in SGLang.
    fn thinking(&self) -> Result<bool, ApiError> {
        Ok(flag(&self.kwargs, "thinking")?
            .or(flag(&self.kwargs, "enable_thinking")?)
            .unwrap_or(false))
    }

    /// Tools the prompt shows: none under `tool_choice: none`.
    fn shown_tools(&self) -> &[Value] {
        match self.tool_choice {
            ToolChoice::None => &[],
            _ => &self.tools,
        }
    }

    /// The prompt text for `renderer`.
    pub fn render(&self, renderer: &Renderer) -> Result<Rendered, ApiError> {
        let thinking = self.thinking()?;
        let text = match renderer {
            Renderer::DeepSeekV4 => self.render_v4(thinking)?,
            Renderer::Jinja(t) => {
                let msgs: Vec<Value> = self
                    .messages
                    .iter()
                    .map(Message::to_template_value)
                    .collect();
                let mut extra = self.kwargs.clone();
                if let Some(e) = &self.reasoning_effort {
                    extra.insert("reasoning_effort".into(), e.clone().into());
                }
                t.render(
                    &msgs,
                    self.shown_tools(),
                    self.add_generation_prompt,
                    &extra,
                )
                .map_err(|e| {
                    bad(
                        "messages",
                        "invalid_value",
                        format!("the model's chat template refused these messages: {e}"),
                    )
                })?
            }
        };
        let forced = self.forced_start(thinking);
        Ok(Rendered {
            text: format!("{text}{forced}"),
            thinking: thinking && forced.is_empty(),
            parse_tools: !self.shown_tools().is_empty(),
            forced,
        })
    }

    /// tool_choice `required` / a named function: the reply is started as a DSML tool
    /// call (after an empty reasoning block in thinking mode); a reply constrained by a
    /// grammar starts after an empty reasoning block.
    fn forced_start(&self, thinking: bool) -> String {
        let close = if thinking { dsv4::THINK_END } else { "" };
        if self.constrained && matches!(self.tool_choice, ToolChoice::Auto | ToolChoice::None) {
            return close.to_string();
        }
        let d = dsv4::DSML;
        match &self.tool_choice {
            ToolChoice::Required => format!("{close}\n\n<{d}tool_calls>\n<{d}invoke name=\""),
            ToolChoice::Function(name) => {
                format!("{close}\n\n<{d}tool_calls>\n<{d}invoke name=\"{name}\">\n")
            }
            ToolChoice::Auto | ToolChoice::None => String::new(),
        }
    }

    fn render_v4(&self, thinking: bool) -> Result<String, ApiError> {
        if let Some(k) = self
            .kwargs
            .keys()
            .find(|k| !V4_KWARGS.contains(&k.as_str()))
        {
            return Err(bad(
                &format!("chat_template_kwargs.{k}"),
                "unsupported_parameter",
                format!("the {DEEPSEEK_V4} renderer reads only {V4_KWARGS:?}, not `{k}`"),
            ));
        }
        if !self.add_generation_prompt {
            return Err(bad(
                "add_generation_prompt",
                "unsupported_parameter",
                "the DeepSeek-V4 format always ends a user turn with the assistant prompt",
            ));
        }
        let mut msgs = self.messages.clone();
        let inserted = msgs.first().is_none_or(|m| m.role != Role::System);
        if inserted {
            msgs.insert(0, Message::new(Role::System, ""));
        }
        msgs[0].tools = self.shown_tools().to_vec();
        msgs[0].response_format = self.response_format.clone();
        let effort = match self.reasoning_effort.as_deref() {
            Some("max") => Some(Effort::Max),
            Some("high") => Some(Effort::High),
            _ => None,
        };
        let opts = dsv4::Options {
            thinking,
            drop_thinking: flag(&self.kwargs, "drop_thinking")?.unwrap_or(true),
            effort,
        };
        dsv4::encode(&msgs, &opts).map_err(|e| {
            let i = e.index - usize::from(inserted);
            bad(
                &format!("messages[{i}]{}", e.field),
                "invalid_value",
                e.message,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    fn v4(body: Value) -> Result<Rendered, ApiError> {
        ChatInput::from_body(&body, &Map::new())?.render(&Renderer::DeepSeekV4)
    }

    #[test]
    fn v4_refusals_name_the_field_in_request_indices() {
        let user = json!({"role": "user", "content": "x"});
        for (body, param) in [
            (
                json!({"messages": [user, {"role": "developer", "content": ""}]}),
                "messages[1].content",
            ),
            (
                json!({"messages": [user, {"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!({"messages": [user], "chat_template_kwargs": {"enable_thinkin": true}}),
                "chat_template_kwargs.enable_thinkin",
            ),
            (
                json!({"messages": [user], "add_generation_prompt": false}),
                "add_generation_prompt",
            ),
            (
                json!({"messages": [user], "chat_template_kwargs": {"reasoning_effort": 3}}),
                "chat_template_kwargs.reasoning_effort",
            ),
        ] {
            let e = v4(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }

    #[test]
    fn forced_tool_choice_starts_the_reply_and_none_hides_the_tools() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let user = json!([{"role": "user", "content": "x"}]);
        let r = v4(json!({"messages": user, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}))
        .unwrap();
        assert!(
            r.text.ends_with(
                "<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
            ),
            "{}",
            r.text
        );
        assert!(r.parse_tools && !r.thinking);
        let r = v4(
            json!({"messages": user, "tools": tools, "tool_choice": "required",
            "chat_template_kwargs": {"thinking": true}}),
        )
        .unwrap();
        assert!(r
            .text
            .ends_with("<think></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\""));
        assert_eq!(
            r.forced,
            "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\""
        );
        let auto = v4(json!({"messages": user, "tools": tools})).unwrap();
        assert!(auto.text.contains("## Tools") && auto.parse_tools && auto.forced.is_empty());
        let none = v4(json!({"messages": user, "tools": tools, "tool_choice": "none"})).unwrap();
        assert!(!none.text.contains("## Tools") && !none.parse_tools);
    }
}
