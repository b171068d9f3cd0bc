//! Chat prompts: messages rendered with the model's Jinja chat template
//! (`tokenizer_config.json` `chat_template`, through minijinja with Python-compatible
//! string methods), or with the documented default when the model has none:
//!
//! ```text
//! system: You are terse.
//! user: Hello
//! assistant:
//! ```
//! one `role: content` line per message, then `assistant:` to prompt the reply.

use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

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

    /// `dir/tokenizer_config.json`'s `chat_template` (a string, or a list of named
    /// templates of which `default` is used); `Ok(None)` when there is none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, TemplateError> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(None);
        }
        let err = |reason: String| TemplateError::Config {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let source = match cfg.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .ok_or_else(|| err("chat_template list has no `default` entry".into()))?
                .to_string(),
            Some(_) => return Err(err("chat_template must be a string or a list".into())),
        };
        let bos = token_text(cfg.get("bos_token"));
        let eos = token_text(cfg.get("eos_token"));
        Self::new(&source, &bos, &eos).map(Some)
    }

    pub fn render(&self, messages: &[Message]) -> Result<String, minijinja::Error> {
        self.env.get_template("chat")?.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
    }
}

/// The prompt text for `messages`: the model's template, or the default one.
pub fn render(template: Option<&ChatTemplate>, messages: &[Message]) -> Result<String, String> {
    match template {
        Some(t) => t.render(messages).map_err(|e| {
            let mut msg = e.to_string();
            if let Some(d) = e.detail() {
                msg = format!("{msg}: {d}");
            }
            msg
        }),
        None => Ok(default_render(messages)),
    }
}

/// The default template: `role: content` lines, then `assistant:`.
pub fn default_render(messages: &[Message]) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(&m.role);
        s.push_str(": ");
        s.push_str(&m.content);
        s.push('\n');
    }
    s.push_str("assistant:");
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn msgs() -> Vec<Message> {
        vec![
            Message {
                role: "system".into(),
                content: "  Be brief. ".into(),
            },
            Message {
                role: "user".into(),
                content: "Hi".into(),
            },
        ]
    }

    #[test]
    fn default_template_is_role_lines_then_assistant() {
        assert_eq!(
            default_render(&msgs()),
            "system:   Be brief. \nuser: Hi\nassistant:"
        );
    }

    #[test]
    fn model_template_from_tokenizer_config_with_python_methods() {
        let dir = tempfile::tempdir().unwrap();
        let tpl = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS]{{ m['content'].strip() }}{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            serde_json::json!({
                "chat_template": tpl,
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
            })
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            render(Some(&t), &msgs()).unwrap(),
            "<s>[SYS]Be brief.<|user|>Hi<|assistant|>"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error_and_absent_config_is_none() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let e = render(Some(&t), &msgs()).unwrap_err();
        assert!(e.contains("first message must be user"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
