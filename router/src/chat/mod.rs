//! Chat prompts: which renderer a model uses and how a request's chat fields become its
//! input. A Jinja template (`--chat-template FILE`, `chat_template.jinja` beside the
//! model, or `tokenizer_config.json`'s `chat_template`), or the built-in DeepSeek-V4
//! renderer (`--chat-template deepseek-v4`, and the default for a checkpoint that ships
//! `encoding/encoding_dsv4.py` and no Jinja template). A model with neither has no chat
//! format, and chat requests to it are refused.

pub mod dsv4;
pub mod jinja;
pub mod messages;
pub mod pyjson;
mod request;
pub mod tool_grammar;

pub use jinja::{ChatTemplate, TemplateError};
pub use messages::{Message, Role, ToolCall};
pub use request::{ChatInput, Rendered, ToolChoice};

use std::path::Path;

/// `--chat-template` value naming the built-in DeepSeek-V4 renderer.
pub const DEEPSEEK_V4: &str = "deepseek-v4";

/// How chat messages become a prompt.
#[derive(Debug)]
pub enum Renderer {
    Jinja(Box<ChatTemplate>),
    DeepSeekV4,
}

impl Renderer {
    /// The renderer for the model in `dir`: `choice` (the `--chat-template` value: the
    /// built-in's name or a Jinja file) wins; then the model folder's own Jinja
    /// template; then the DeepSeek-V4 encoder if the folder ships it. `Ok(None)`: the
    /// model has no chat format.
    pub fn resolve(dir: &Path, choice: Option<&str>) -> Result<Option<Self>, TemplateError> {
        match choice {
            Some(DEEPSEEK_V4) => return Ok(Some(Renderer::DeepSeekV4)),
            Some(file) => {
                return ChatTemplate::from_file(Path::new(file), dir)
                    .map(|t| Some(Renderer::Jinja(Box::new(t))))
            }
            None => {}
        }
        if let Some(t) = ChatTemplate::from_model_dir(dir)? {
            return Ok(Some(Renderer::Jinja(Box::new(t))));
        }
        if dir.join("encoding").join("encoding_dsv4.py").is_file() {
            return Ok(Some(Renderer::DeepSeekV4));
        }
        Ok(None)
    }

    /// What `GET /config` and the startup log call it.
    pub fn describe(&self) -> &'static str {
        match self {
            Renderer::Jinja(_) => "jinja",
            Renderer::DeepSeekV4 => DEEPSEEK_V4,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn resolution_order_flag_then_jinja_then_the_shipped_encoder() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Renderer::resolve(dir.path(), None).unwrap().is_none());
        std::fs::create_dir(dir.path().join("encoding")).unwrap();
        std::fs::write(dir.path().join("encoding/encoding_dsv4.py"), "").unwrap();
        let r = Renderer::resolve(dir.path(), None).unwrap().unwrap();
        assert_eq!(r.describe(), DEEPSEEK_V4);
        std::fs::write(dir.path().join("chat_template.jinja"), "x").unwrap();
        let r = Renderer::resolve(dir.path(), None).unwrap().unwrap();
        assert_eq!(r.describe(), "jinja");
        let r = Renderer::resolve(dir.path(), Some(DEEPSEEK_V4))
            .unwrap()
            .unwrap();
        assert_eq!(r.describe(), DEEPSEEK_V4);
        let e = Renderer::resolve(dir.path(), Some("/no/such.jinja")).unwrap_err();
        assert!(e.to_string().contains("/no/such.jinja"), "{e}");
    }
}
