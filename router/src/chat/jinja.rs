//! Jinja chat templates (Hugging Face style) through minijinja with Python-compatible
//! string methods: `chat_template.jinja` beside the model, `chat_template` in
//! `tokenizer_config.json`, or a file named by `--chat-template`. The template sees
//! `messages` (OpenAI shape), `tools`, `add_generation_prompt`, `bos_token`, `eos_token`
//! and every `chat_template_kwargs` entry.

use serde_json::{Map, Value};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{path}: {reason}")]
    Config { path: String, reason: String },
    #[error("chat template: {0}")]
    Syntax(String),
}

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

/// A special token as tokenizer_config.json writes it: a string or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// `dir/chat_template.jinja`, else `dir/tokenizer_config.json`'s `chat_template` (a
    /// string, or a list of named templates of which `default` is used); `Ok(None)` when
    /// there is neither.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, TemplateError> {
        let (cfg, source) = tokenizer_config(dir)?;
        let file = dir.join("chat_template.jinja");
        let source = if file.exists() {
            read(&file)?
        } else {
            match source {
                Some(s) => s,
                None => return Ok(None),
            }
        };
        Self::with_config(&source, &cfg).map(Some)
    }

    /// The template in `file`, with the special tokens of `dir/tokenizer_config.json`.
    pub fn from_file(file: &Path, dir: &Path) -> Result<Self, TemplateError> {
        let (cfg, _) = tokenizer_config(dir)?;
        Self::with_config(&read(file)?, &cfg)
    }

    fn with_config(source: &str, cfg: &Value) -> Result<Self, TemplateError> {
        let bos = token_text(cfg.get("bos_token"));
        let eos = token_text(cfg.get("eos_token"));
        Self::new(source, &bos, &eos)
    }

    /// Render; `extra` (the chat template kwargs) is merged into the context last.
    pub fn render(
        &self,
        messages: &[Value],
        tools: &[Value],
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, String> {
        let mut ctx = Map::new();
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert(
            "tools".into(),
            if tools.is_empty() {
                Value::Null
            } else {
                Value::Array(tools.to_vec())
            },
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        let ctx = minijinja::Value::from_serialize(&ctx);
        self.env
            .get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| {
                let mut msg = e.to_string();
                if let Some(d) = e.detail() {
                    msg = format!("{msg}: {d}");
                }
                msg
            })
    }
}

fn read(path: &Path) -> Result<String, TemplateError> {
    std::fs::read_to_string(path).map_err(|e| TemplateError::Config {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// `dir/tokenizer_config.json` (an empty object when absent) and its `chat_template`.
pub fn tokenizer_config(dir: &Path) -> Result<(Value, Option<String>), TemplateError> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok((Value::Object(Map::new()), None));
    }
    let err = |reason: String| TemplateError::Config {
        path: path.display().to_string(),
        reason,
    };
    let cfg: Value = serde_json::from_str(&read(&path)?).map_err(|e| err(e.to_string()))?;
    let source = match cfg.get("chat_template") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => Some(
            list.iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .ok_or_else(|| err("chat_template list has no `default` entry".into()))?
                .to_string(),
        ),
        Some(_) => return Err(err("chat_template must be a string or a list".into())),
    };
    Ok((cfg, source))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    fn msgs() -> Vec<Value> {
        vec![
            json!({"role": "system", "content": "  Be brief. "}),
            json!({"role": "user", "content": "Hi"}),
        ]
    }

    #[test]
    fn model_template_from_tokenizer_config_with_python_methods() {
        let dir = tempfile::tempdir().unwrap();
        let tpl = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS]{{ m['content'].strip() }}{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({
                "chat_template": tpl,
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
            })
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            t.render(&msgs(), &[], true, &Map::new()).unwrap(),
            "<s>[SYS]Be brief.<|user|>Hi<|assistant|>"
        );
        assert_eq!(
            t.render(&msgs(), &[], false, &Map::new()).unwrap(),
            "<s>[SYS]Be brief.<|user|>Hi"
        );
        // chat_template.jinja beside the model wins over tokenizer_config.json.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{{ bos_token }}{{ messages | length }}{% if tools %}T{{ tools[0].function.name }}{% endif %}{% if thinking %}!{% endif %}",
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let mut kw = Map::new();
        kw.insert("thinking".into(), true.into());
        assert_eq!(t.render(&msgs(), &tools, true, &kw).unwrap(), "<s>2Tf!");
        let file = dir.path().join("other.jinja");
        std::fs::write(&file, "{{ eos_token }}").unwrap();
        let t = ChatTemplate::from_file(&file, dir.path()).unwrap();
        assert_eq!(t.render(&msgs(), &[], true, &Map::new()).unwrap(), "</s>");
    }

    #[test]
    fn raise_exception_becomes_an_error_and_absent_config_is_none() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let e = t.render(&msgs(), &[], true, &Map::new()).unwrap_err();
        assert!(e.contains("first message must be user"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
