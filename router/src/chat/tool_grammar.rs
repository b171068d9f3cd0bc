//! `tool_choice: required` / a named function enforced by a grammar: after the forced
//! start of the DSML block (see `ChatInput::forced_start`), the reply must be invokes of
//! the request's tools whose parameters follow each function's JSON schema, written as
//! the DeepSeek-V4 encoder writes them (`encode_arguments_to_dsml`: strings as they are
//! with `string="true"`, other values as JSON with `string="false"`), then the block's
//! end. The reply parser reads the result as `tool_calls`.

use super::dsv4::DSML;
use super::request::ToolChoice;
use crate::structured::lark_literal as lit;
use pdserve_grammar::Grammar;
use serde_json::{Map, Value};

/// Schema keywords beyond `type` that a raw (unquoted) string value could not honour: such
/// string parameters are written as JSON strings instead.
const STRING_CONSTRAINTS: [&str; 7] = [
    "enum",
    "const",
    "pattern",
    "format",
    "minLength",
    "maxLength",
    "$ref",
];

fn function(tool: &Value) -> (&str, Map<String, Value>) {
    let f = &tool["function"];
    let params = f["parameters"].as_object().cloned().unwrap_or_default();
    (f["name"].as_str().unwrap_or_default(), params)
}

/// One function's `">\n" parameters "</invoke>"` (without the `">\n"` when the prompt
/// already holds it: `named`), as rules named from `i`; the rule `body_{i}` is what
/// follows the invoke's name.
fn invoke_rules(i: usize, params: &Map<String, Value>, named: bool, rules: &mut Vec<String>) {
    let props = params
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    // Definitions a property's `$ref` may point at go with every property's schema.
    let defs: Map<String, Value> = ["$defs", "definitions"]
        .iter()
        .filter_map(|k| params.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect();
    let open = if named { String::new() } else { lit("\">\n") };
    let close = lit(&format!("</{DSML}invoke>"));
    if props.is_empty() {
        // The encoder writes an empty argument list as an empty line.
        rules.push(format!("body_{i}: {open} \"\\n\" {close}"));
        return;
    }
    let mut items = Vec::new();
    for (j, (name, schema)) in props.iter().enumerate() {
        let plain_string = schema.get("type").and_then(Value::as_str) == Some("string")
            && !STRING_CONSTRAINTS.iter().any(|k| schema.get(*k).is_some());
        let head = |is_str: &str| {
            lit(&format!(
                "<{DSML}parameter name=\"{name}\" string=\"{is_str}\">"
            ))
        };
        let end = lit(&format!("</{DSML}parameter>"));
        let value = if plain_string {
            rules.push(format!("v_{i}_{j}: /[^<]*/"));
            format!("{} v_{i}_{j} {end}", head("true"))
        } else {
            let mut s = schema.as_object().cloned().unwrap_or_default();
            s.extend(defs.clone());
            rules.push(format!(
                "v_{i}_{j}: %json {}",
                pdserve_grammar::compact_json(Value::Object(s))
            ));
            format!("{} v_{i}_{j} {end}", head("false"))
        };
        rules.push(format!("p_{i}_{j}: {value} \"\\n\""));
        items.push(if required.contains(&name.as_str()) {
            format!("p_{i}_{j}")
        } else {
            format!("p_{i}_{j}?")
        });
    }
    rules.push(format!("body_{i}: {open} {} {close}", items.join(" ")));
}

/// The grammar of the reply after the forced start, or None when the choice forces no
/// call (`auto`, `none`). `single` (`parallel_tool_calls: false`): one call only.
pub fn tool_call_grammar(tools: &[Value], choice: &ToolChoice, single: bool) -> Option<Grammar> {
    let end_block = lit(&format!("\n</{DSML}tool_calls>"));
    let mut rules = Vec::new();
    let start = match choice {
        ToolChoice::Auto | ToolChoice::None => return None,
        ToolChoice::Function(name) => {
            let (i, (_, params)) = tools
                .iter()
                .map(function)
                .enumerate()
                .find(|(_, (n, _))| n == name)?;
            // The forced start already holds `name="NAME">\n`: parameters come next.
            invoke_rules(i, &params, true, &mut rules);
            format!("start: body_{i} {end_block}")
        }
        ToolChoice::Required => {
            let mut alts = Vec::new();
            for (i, (name, params)) in tools.iter().map(function).enumerate() {
                invoke_rules(i, &params, false, &mut rules);
                alts.push(format!("{} body_{i}", lit(name)));
            }
            rules.push(format!("call: {}", alts.join(" | ")));
            // The forced start holds the first call's `<invoke name="`; later calls
            // write their own.
            let next = lit(&format!("\n<{DSML}invoke name=\""));
            if single {
                format!("start: call {end_block}")
            } else {
                format!("start: call ({next} call)* {end_block}")
            }
        }
    };
    rules.insert(0, start);
    Some(Grammar::lark(rules.join("\n")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;
    use std::path::Path;

    /// Whether `reply` (the text after the forced start) is a whole reply of `g`.
    fn accepts(g: &Grammar, reply: &str) -> bool {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/embedded");
        let env = pdserve_grammar::GrammarEnv::from_model_dir(&dir, 512, &[1])
            .unwrap()
            .unwrap();
        let tok = pdserve_tokenizer::Tokenizer::from_model_dir(&dir)
            .unwrap()
            .unwrap();
        let mut c = env.constraint(g).unwrap();
        tok.encode(reply)
            .unwrap()
            .into_iter()
            .all(|t| c.commit(t).is_ok())
            && c.is_finished()
    }

    #[test]
    fn forced_calls_must_follow_the_functions_schemas() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ];
        assert!(tool_call_grammar(&tools, &ToolChoice::Auto, false).is_none());
        let d = DSML;
        let city = format!("<{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n");
        let days = format!("<{d}parameter name=\"days\" string=\"false\">3</{d}parameter>\n");
        let end = format!("</{d}invoke>\n</{d}tool_calls>");
        let required = tool_call_grammar(&tools, &ToolChoice::Required, false).unwrap();
        let one = tool_call_grammar(&tools, &ToolChoice::Required, true).unwrap();
        // What the encoder writes for get(city="Paris", days=3), then now().
        let two = format!("get\">\n{city}{days}</{d}invoke>\n<{d}invoke name=\"now\">\n\n{end}");
        assert!(accepts(&required, &two), "{two}");
        assert!(accepts(&required, &format!("get\">\n{city}{end}")));
        assert!(accepts(&one, &format!("get\">\n{city}{end}")) && !accepts(&one, &two));
        // A required parameter missing, a value of the wrong type, an unknown function.
        assert!(!accepts(&required, &format!("get\">\n{days}{end}")));
        let bad_days = days.replace(">3<", ">\"x\"<");
        assert!(!accepts(
            &required,
            &format!("get\">\n{city}{bad_days}{end}")
        ));
        assert!(!accepts(&required, &format!("put\">\n{city}{end}")));
        // Named: the prompt holds the invoke's header; one call of that function.
        let named = tool_call_grammar(&tools, &ToolChoice::Function("get".into()), false).unwrap();
        assert!(accepts(&named, &format!("{city}{days}{end}")));
        assert!(!accepts(&named, &format!("get\">\n{city}{end}")));
    }
}
