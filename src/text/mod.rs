//! Text: the model folder's tokenizer and its chat template, used the way Hugging Face
//! `transformers` uses them (`apply_chat_template` renders Jinja, then tokenises the text
//! without adding special tokens).

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};

pub mod chat_template;

pub use chat_template::ChatTemplate;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A token that `tokenizer_config.json` names, as a plain string or an `AddedToken` object.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum NamedToken {
    Plain(String),
    Object { content: String },
}

impl NamedToken {
    fn content(self) -> String {
        match self {
            NamedToken::Plain(s) | NamedToken::Object { content: s } => s,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
struct TokenizerConfigFile {
    #[serde(default)]
    chat_template: Option<serde_json::Value>,
    #[serde(default)]
    bos_token: Option<NamedToken>,
    #[serde(default)]
    eos_token: Option<NamedToken>,
}

/// The tokenizer of a model folder (`tokenizer.json` + `tokenizer_config.json`).
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl TextTokenizer {
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            anyhow::bail!(
                "{}: not found; a model folder needs tokenizer.json",
                path.display()
            );
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("{}: not a usable tokenizer: {e}", path.display()))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfigFile = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("{}: cannot read", config_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid", config_path.display()))?
        } else {
            TokenizerConfigFile::default()
        };
        let bos_token = config.bos_token.map(NamedToken::content);
        let eos_token = config.eos_token.map(NamedToken::content);
        let chat_template = match config.chat_template {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(source)) => Some(source),
            // A list of named templates: take "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            Some(other) => anyhow::bail!(
                "{}: field chat_template must be a string, found {other}",
                config_path.display()
            ),
        }
        .map(|source| {
            ChatTemplate::new(&source, bos_token.clone(), eos_token.clone())
                .with_context(|| format!("{}: field chat_template", config_path.display()))
        })
        .transpose()?;
        Ok(TextTokenizer {
            inner,
            bos_token,
            eos_token,
            chat_template,
        })
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenise: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("cannot decode: {e}"))
    }

    /// Text of `ids` without special tokens (for showing answers).
    pub fn decode_skip_special(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("cannot decode: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// `apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_ref()
            .context("the model's tokenizer_config.json has no chat_template")?;
        let text = template.render(messages, add_generation_prompt)?;
        self.encode(&text)
    }
}
