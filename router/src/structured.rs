//! Structured output requested by a body: OpenAI's `response_format` (`json_object`,
//! `json_schema`) and vLLM's `structured_outputs` extension (`json`, `regex`, `choice`,
//! `grammar`, `json_object`), turned into one llguidance [`Grammar`] and compiled here
//! once so that a bad schema or grammar is a 400 naming the problem before any worker
//! sees it. The decode server enforces it with token masks.

use crate::error::ApiError;
use crate::AppState;
use axum::http::StatusCode;
use pdserve_grammar::{Grammar, GrammarError};
use serde_json::Value;

/// A grammar and the request field it came from (named by errors).
#[derive(Debug, Clone)]
pub struct Requested {
    pub grammar: Grammar,
    pub param: String,
}

/// `structured_outputs` keys pdserve enforces; exactly one per request.
const STRUCTURED_KEYS: [&str; 5] = ["json", "regex", "choice", "grammar", "json_object"];

fn bad(param: &str, code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, code, msg)
}

/// `response_format` as a grammar (None for `text` or absent). Its shape was checked by
/// the chat reader; completions check it here.
pub fn from_response_format(rf: Option<&Value>) -> Result<Option<Requested>, ApiError> {
    let Some(rf) = rf.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let at = |p: &str| format!("response_format.{p}");
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Requested {
            grammar: Grammar::json_object(),
            param: "response_format".into(),
        })),
        Some("json_schema") => {
            let Some(js) = rf.get("json_schema").filter(|v| v.is_object()) else {
                return Err(bad(
                    &at("json_schema"),
                    "missing_required_parameter",
                    "a json_schema response format needs `json_schema` (with `name` and `schema`)",
                ));
            };
            if js
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(bad(
                    &at("json_schema.strict"),
                    "invalid_type",
                    "`strict` must be a boolean",
                ));
            }
            let schema =
                match js.get("schema") {
                    Some(s @ Value::Object(_)) => s.clone(),
                    None | Some(Value::Null) => return Err(bad(
                        &at("json_schema.schema"),
                        "missing_required_parameter",
                        "a json_schema response format needs `json_schema.schema`, the JSON schema",
                    )),
                    Some(x) => {
                        return Err(bad(
                            &at("json_schema.schema"),
                            "invalid_type",
                            format!("`schema` must be a JSON schema object, got {x}"),
                        ))
                    }
                };
            Ok(Some(Requested {
                grammar: Grammar::json_schema(schema),
                param: at("json_schema.schema"),
            }))
        }
        _ => Err(bad(
            &at("type"),
            "invalid_value",
            "response_format type must be text, json_object or json_schema",
        )),
    }
}

/// A JSON string literal of llguidance's Lark dialect.
pub fn lark_literal(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// vLLM's `structured_outputs` (None when absent or null).
pub fn from_structured_outputs(v: Option<&Value>) -> Result<Option<Requested>, ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(x) => {
            return Err(bad(
                "structured_outputs",
                "invalid_type",
                format!("`structured_outputs` must be an object, got {x}"),
            ))
        }
    };
    if let Some(k) = o.keys().find(|k| !STRUCTURED_KEYS.contains(&k.as_str())) {
        return Err(bad(
            &format!("structured_outputs.{k}"),
            "unsupported_parameter",
            format!("`structured_outputs.{k}` is not supported; one of {STRUCTURED_KEYS:?} is"),
        ));
    }
    let set: Vec<(&String, &Value)> = o
        .iter()
        .filter(|(k, v)| {
            !matches!(
                (k.as_str(), v),
                (_, Value::Null) | ("json_object", Value::Bool(false))
            )
        })
        .collect();
    let [(key, v)] = set[..] else {
        return Err(bad(
            "structured_outputs",
            "invalid_value",
            format!(
                "`structured_outputs` takes exactly one of {STRUCTURED_KEYS:?}, got {}",
                set.len()
            ),
        ));
    };
    let param = format!("structured_outputs.{key}");
    let wrong = |what: &str| bad(&param, "invalid_type", format!("`{param}` must be {what}"));
    let grammar = match key.as_str() {
        "json" => match v {
            Value::Object(_) => Grammar::json_schema(v.clone()),
            // vLLM also takes the schema as JSON text.
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(schema @ Value::Object(_)) => Grammar::json_schema(schema),
                _ => return Err(wrong("a JSON schema (an object, or its JSON text)")),
            },
            _ => return Err(wrong("a JSON schema (an object, or its JSON text)")),
        },
        "regex" => Grammar::regex(v.as_str().ok_or_else(|| wrong("a string"))?),
        "grammar" => Grammar::lark(v.as_str().ok_or_else(|| wrong("a string"))?.to_string()),
        "json_object" if *v == true => Grammar::json_object(),
        "json_object" => return Err(wrong("a boolean")),
        _ => {
            let choices: Vec<&str> = v
                .as_array()
                .filter(|a| !a.is_empty())
                .and_then(|a| a.iter().map(Value::as_str).collect())
                .ok_or_else(|| wrong("a non-empty list of strings"))?;
            let alts: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
            Grammar::lark(format!("start: {}", alts.join(" | ")))
        }
    };
    Ok(Some(Requested { grammar, param }))
}

/// At most one source of a grammar per request.
pub fn one_of(sources: Vec<Option<Requested>>) -> Result<Option<Requested>, ApiError> {
    let mut set: Vec<Requested> = sources.into_iter().flatten().collect();
    match set.len() {
        0 | 1 => Ok(set.pop()),
        _ => Err(bad(
            &set[1].param,
            "invalid_value",
            format!(
                "`{}` and `{}` both constrain the reply; send one",
                set[0].param, set[1].param
            ),
        )),
    }
}

/// Compile `r` for this model: its wire form, or a 400 naming what does not compile.
pub fn checked(state: &AppState, r: &Requested) -> Result<String, ApiError> {
    let Some(env) = state.settings.grammar.as_deref() else {
        return Err(bad(
            &r.param,
            "unsupported_parameter",
            "structured output needs the model's tokenizer.json, which this model folder lacks",
        ));
    };
    match env.constraint(&r.grammar) {
        Ok(_) => r
            .grammar
            .to_wire()
            .map_err(|e| ApiError::with_status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
        Err(GrammarError::Invalid(e)) => Err(bad(
            &r.param,
            "invalid_value",
            format!("`{}` does not compile: {e}", r.param),
        )),
        Err(e) => Err(ApiError::with_status(
            StatusCode::INTERNAL_SERVER_ERROR,
            e.to_string(),
        )),
    }
}
