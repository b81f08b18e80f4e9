//! Text: the model folder's tokenizer and its chat template, used the way Hugging Face
//! `transformers` uses them (`apply_chat_template` renders Jinja, then tokenises the text
//! without adding special tokens).

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};

pub(crate) mod chat_template;
mod template_files;

pub use chat_template::ChatTemplate;
use template_files::ChatTemplates;

/// One chat message, as a chat template sees it: like Hugging Face, which hands the message
/// dicts to the template as they are, every field is passed through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    /// The text. An OpenAI-style list of content parts is read as its text parts joined by
    /// newlines; a message with other parts (images, audio, files) is refused.
    pub content: String,
    /// The content was `null` or missing (an assistant turn with only tool calls). The template
    /// sees "": transformers drops the key, and templates such as Qwen3's then fail on
    /// `'</think>' in message.content`, so that such turns can only be rendered as "".
    pub content_is_null: bool,
    /// The other fields (`tool_calls`, `tool_call_id`, `name`, ...), as they were, but those
    /// that are `null`, which transformers drops (OpenAI exports write `"refusal": null`, ...).
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.to_string(),
            content: content.to_string(),
            ..Message::default()
        }
    }

    /// The message's tool calls, when it has any.
    pub fn tool_calls(&self) -> Option<&[serde_json::Value]> {
        self.extra
            .get("tool_calls")
            .and_then(|t| t.as_array())
            .map(Vec::as_slice)
            .filter(|t| !t.is_empty())
    }

    /// A tool call or a tool's answer: only templates that know tools can render it.
    pub(crate) fn uses_tools(&self) -> bool {
        self.role == "tool" || self.tool_calls().is_some()
    }

    /// Reads one message of a `messages` list; `Err` says what is wrong with it.
    pub(crate) fn from_json(value: &serde_json::Value) -> std::result::Result<Self, String> {
        use serde_json::Value;
        let Value::Object(fields) = value else {
            return Err(format!(
                "is {}, expected an object with \"role\" and \"content\"",
                json_kind(value)
            ));
        };
        let mut extra = fields.clone();
        let role = match extra.shift_remove("role") {
            Some(Value::String(r)) => r,
            Some(other) => {
                return Err(format!(
                    "\"role\" is {}, expected a string",
                    json_kind(&other)
                ))
            }
            None => return Err("has no \"role\"".into()),
        };
        let (content, content_is_null) = match extra.shift_remove("content") {
            None | Some(Value::Null) => (String::new(), true),
            Some(Value::String(c)) => (c, false),
            Some(Value::Array(parts)) => (text_of_parts(&parts)?, false),
            Some(other) => {
                return Err(format!(
                    "\"content\" is {}, expected a string, null or a list of parts",
                    json_kind(&other)
                ))
            }
        };
        // OpenAI exports write `"tool_calls": null` on every plain turn.
        extra.retain(|_, v| !v.is_null());
        match extra.get("tool_calls") {
            Some(Value::Array(_)) | None => {}
            Some(other) => {
                return Err(format!(
                    "\"tool_calls\" is {}, expected a list",
                    json_kind(other)
                ))
            }
        }
        Ok(Message {
            role,
            content,
            content_is_null,
            extra,
        })
    }
}

/// Reads a `messages` list; `Err` names the message and what is wrong with it.
pub(crate) fn messages_from_json(
    value: &serde_json::Value,
) -> std::result::Result<Vec<Message>, String> {
    let list = value
        .as_array()
        .ok_or_else(|| format!("\"messages\" is {}, expected a list", json_kind(value)))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| Message::from_json(m).map_err(|e| format!("messages[{i}] {e}")))
        .collect()
}

/// Reads a record's `tools` (OpenAI's tool definitions, `[{"type": "function", "function":
/// {"name", "description", "parameters"}}]`); `null` is none. `Err` says what is wrong: the
/// template gets them as they are, so only their shape is checked.
pub(crate) fn tools_from_json(
    value: &serde_json::Value,
) -> std::result::Result<Option<Vec<serde_json::Value>>, String> {
    use serde_json::Value;
    let list = match value {
        Value::Null => return Ok(None),
        Value::Array(list) => list,
        Value::String(_) => {
            return Err("\"tools\" is a string, expected a list of tool definitions (a string of JSON must be decoded first)".into())
        }
        other => {
            return Err(format!(
                "\"tools\" is {}, expected a list of tool definitions",
                json_kind(other)
            ))
        }
    };
    for (i, tool) in list.iter().enumerate() {
        let Value::Object(fields) = tool else {
            return Err(format!(
                "\"tools\"[{i}] is {}, expected an object like {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                json_kind(tool)
            ));
        };
        if fields.get("type").and_then(Value::as_str) == Some("function") {
            let name = fields
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            if name.is_none() {
                return Err(format!(
                    "\"tools\"[{i}] is a function without a \"function\": {{\"name\": ...}} string"
                ));
            }
        }
    }
    Ok(Some(list.clone()))
}

/// The text parts of an OpenAI-style content list, joined by newlines.
fn text_of_parts(parts: &[serde_json::Value]) -> std::result::Result<String, String> {
    let mut texts = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        match part.get("type").and_then(|t| t.as_str()) {
            Some("text") => match part.get("text").and_then(|t| t.as_str()) {
                Some(t) => texts.push(t),
                None => {
                    return Err(format!(
                        "\"content\"[{j}] is a text part without a \"text\" string"
                    ))
                }
            },
            // Images, audio, files: dropping them would train answers about inputs the model
            // never saw, so the record is refused.
            Some(other) => {
                return Err(format!(
                    "\"content\"[{j}] is an {other:?} part: image, audio and file inputs are not supported (text only)"
                ))
            }
            None => {
                return Err(format!(
                    "\"content\"[{j}] has no \"type\" (a content part is {{\"type\": \"text\", \"text\": ...}})"
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// "a number", "an object", ... for messages about JSON values.
fn json_kind(value: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl Serialize for Message {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(2 + self.extra.len()))?;
        map.serialize_entry("role", &self.role)?;
        // Null content is "" (see `content_is_null`).
        map.serialize_entry("content", &self.content)?;
        for (k, v) in &self.extra {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Message {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        Message::from_json(&value).map_err(serde::de::Error::custom)
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
    chat_template: serde_json::Value,
    #[serde(default)]
    bos_token: Option<NamedToken>,
    #[serde(default)]
    eos_token: Option<NamedToken>,
}

/// The tokenizer of a model folder (`tokenizer.json`, `tokenizer_config.json` and the chat
/// templates: see [`template_files`]).
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    chat_templates: ChatTemplates,
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
        let chat_templates =
            ChatTemplates::read(dir, &config.chat_template, &bos_token, &eos_token)?;
        Ok(TextTokenizer {
            inner,
            bos_token,
            eos_token,
            chat_templates,
        })
    }

    /// The chat template `apply_chat_template` uses for a conversation with or without tools
    /// (a model may have a "tool_use" template beside its "default" one); `Err` says where
    /// templates were looked for.
    pub fn chat_template(&self, with_tools: bool) -> Result<&ChatTemplate> {
        self.chat_templates.pick(with_tools)
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

    pub(crate) fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// `apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// `apply_chat_template(messages, tools=tools, tokenize=True, ...)`: the "tool_use"
    /// template where the tokenizer has one and tools are given.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text =
            self.chat_template(tools.is_some())?
                .render(messages, tools, add_generation_prompt)?;
        self.encode(&text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn openai_message_shapes() {
        // Null content with tool calls: the template sees none, the calls pass through.
        let m = Message::from_json(&json!({"role": "assistant", "content": null,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}))
        .unwrap();
        assert!(m.content_is_null && m.uses_tools());
        assert_eq!(m.tool_calls().map(<[_]>::len), Some(1));
        let seen = serde_json::to_value(&m).unwrap();
        assert_eq!(seen["content"], "");
        assert_eq!(seen["tool_calls"][0]["function"]["name"], "f");
        // A list of parts: the text parts, joined by newlines; an image part is refused by
        // index and type.
        let m = Message::from_json(&json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}))
        .unwrap();
        assert_eq!((m.content.as_str(), m.content_is_null), ("a\nb", false));
        let e = Message::from_json(&json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}))
        .unwrap_err();
        assert_eq!(
            e,
            "\"content\"[1] is an \"image_url\" part: image, audio and file inputs are not supported (text only)"
        );
        // `"tool_calls": null` is no tool call; other fields pass through.
        let m = Message::from_json(&json!({"role": "tool", "content": "42",
            "tool_call_id": "c1", "tool_calls": null}))
        .unwrap();
        assert!(m.tool_calls().is_none() && m.uses_tools());
        assert_eq!(serde_json::to_value(&m).unwrap()["tool_call_id"], "c1");
        assert!(!m.extra.contains_key("tool_calls"));
        // Other null fields are dropped too, as transformers drops them; the rest keep their
        // order.
        let m = Message::from_json(&json!({"role": "assistant", "content": "x",
            "refusal": null, "z": 1, "a": 2}))
        .unwrap();
        assert_eq!(m.extra.keys().collect::<Vec<_>>(), ["z", "a"]);
    }

    #[test]
    fn tools_are_lists_of_objects() {
        let weather = json!({"type": "function", "function": {"name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        assert_eq!(tools_from_json(&json!(null)), Ok(None));
        assert_eq!(tools_from_json(&json!([])), Ok(Some(vec![])));
        assert_eq!(
            tools_from_json(&json!([weather.clone(), {"name": "bare"}])),
            Ok(Some(vec![weather.clone(), json!({"name": "bare"})]))
        );
        let err = |v: serde_json::Value| tools_from_json(&v).unwrap_err();
        assert_eq!(
            err(json!({"a": 1})),
            "\"tools\" is an object, expected a list of tool definitions"
        );
        assert!(err(json!("[]")).starts_with("\"tools\" is a string"));
        assert!(
            err(json!([weather, 3])).starts_with("\"tools\"[1] is a number, expected an object")
        );
        assert_eq!(
            err(json!([{"type": "function", "function": {"description": "x"}}])),
            "\"tools\"[0] is a function without a \"function\": {\"name\": ...} string"
        );
    }

    #[test]
    fn bad_messages_are_named() {
        let err = |v: serde_json::Value| messages_from_json(&v).unwrap_err();
        assert_eq!(
            err(json!({"role": "user"})),
            "\"messages\" is an object, expected a list"
        );
        assert_eq!(
            err(json!([{"content": "x"}])),
            "messages[0] has no \"role\""
        );
        assert_eq!(
            err(json!([{"role": "user", "content": "a"}, {"role": 1, "content": "x"}])),
            "messages[1] \"role\" is a number, expected a string"
        );
        assert_eq!(
            err(json!([{"role": "user", "content": {"text": "x"}}])),
            "messages[0] \"content\" is an object, expected a string, null or a list of parts"
        );
        assert_eq!(
            err(json!([{"role": "user", "content": [{"type": "text", "text": 3}]}])),
            "messages[0] \"content\"[0] is a text part without a \"text\" string"
        );
        assert!(err(json!([{"role": "user", "content": [{"text": "x"}]}]))
            .starts_with("messages[0] \"content\"[0] has no \"type\""));
        assert_eq!(
            err(json!([{"role": "assistant", "content": "x", "tool_calls": {}}])),
            "messages[0] \"tool_calls\" is an object, expected a list"
        );
        assert_eq!(
            err(json!(["hi"])),
            "messages[0] is a string, expected an object with \"role\" and \"content\""
        );
    }
}
