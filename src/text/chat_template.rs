//! Chat templates are Jinja; `transformers` renders them with `trim_blocks` and
//! `lstrip_blocks`, a `raise_exception` function and Python string methods. minijinja with its
//! Python-compatibility callbacks renders the same text.

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use super::Message;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    supports_tools: bool,
    reads_tools: bool,
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it for chat templates: Python's `json.dumps` (", " and
/// ": " between items, non-ASCII text as it is, no HTML escaping, `indent`, `ensure_ascii`,
/// `sort_keys`), where minijinja's own writes compact, HTML-escaped JSON. Object keys come in
/// the order the value has them: for data read from JSON, the input's order, as Python's
/// dicts keep it (serde_json's and minijinja's `preserve_order`).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: cannot convert: {e}"),
        )
    })?;
    let mut out = String::new();
    let style = PyJson {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    Ok(out)
}

struct PyJson {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Array(items) => {
                let items: Vec<_> = items.iter().map(|i| (None, i)).collect();
                self.write_seq('[', ']', &items, level, out);
            }
            J::Object(map) => {
                let mut items: Vec<_> = map.iter().map(|(k, v)| (Some(k.as_str()), v)).collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_seq('{', '}', &items, level, out);
            }
            J::String(s) => self.write_str(s, out),
            other => out.push_str(&other.to_string()),
        }
    }

    fn write_seq(
        &self,
        open: char,
        close: char,
        items: &[(Option<&str>, &serde_json::Value)],
        level: usize,
        out: &mut String,
    ) {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return;
        }
        for (n, (key, value)) in items.iter().enumerate() {
            match self.indent {
                // Python: "," between items when indenting, ", " otherwise.
                Some(w) => {
                    out.push_str(if n == 0 { "\n" } else { ",\n" });
                    out.push_str(&" ".repeat(w * (level + 1)));
                }
                None if n > 0 => out.push_str(", "),
                None => {}
            }
            if let Some(k) = key {
                self.write_str(k, out);
                out.push_str(": ");
            }
            self.write(value, level + 1, out);
        }
        if let Some(w) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(w * level));
        }
        out.push(close);
    }

    fn write_str(&self, s: &str, out: &mut String) {
        // serde_json escapes what json.dumps escapes (quote, backslash, control characters).
        let escaped = serde_json::Value::from(s).to_string();
        if !self.ensure_ascii {
            out.push_str(&escaped);
            return;
        }
        for c in escaped.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("the chat template does not compile: {e}"))?;
        let reads_tools = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("{e}"))?
            .undeclared_variables(false)
            .contains("tools");
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            // Templates written for tools read the assistant's `tool_calls` (Qwen, Llama 3.1,
            // Mistral, Hermes); one that never does would drop them without a word.
            supports_tools: source.contains("tool_calls"),
            reads_tools,
        })
    }

    /// Whether the template reads the `tools` variable (the definitions of the tools the
    /// assistant may call).
    pub(crate) fn reads_tools(&self) -> bool {
        self.reads_tools
    }

    /// Whether the template renders tool calls (and so tool answers).
    pub(crate) fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// The prompt text for `messages`, with the definitions of the `tools` the assistant may call
    /// (OpenAI's `{"type": "function", "function": {...}}` objects, handed to the template as they
    /// are, as transformers does); with `add_generation_prompt` it ends where the assistant's
    /// answer begins.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("{e}"))?;
        template
            .render(minijinja::context! {
                messages => messages,
                // None, not undefined, when there are none: as transformers passes them.
                tools => tools,
                documents => Value::from(()),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            })
            .map_err(|e| anyhow!("cannot render the chat template: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_template_renders_like_transformers() {
        let source = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::new(source, None, Some("<|im_end|>".into())).unwrap();
        let text = t.render(&[Message::new("user", "Hi")], None, true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = t
            .render(&[Message::new("user", "Hi")], None, false)
            .unwrap();
        assert!(!no_prompt.ends_with("assistant\n"));
    }

    #[test]
    fn block_tags_are_trimmed_and_python_methods_work() {
        let source = "{% for m in messages %}\n  {{ m.content.strip() }}|\n{% endfor %}";
        let t = ChatTemplate::new(source, None, None).unwrap();
        let text = t
            .render(
                &[Message::new("user", "  a "), Message::new("assistant", "b")],
                None,
                false,
            )
            .unwrap();
        assert_eq!(text, "  a|\n  b|\n");
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.tool_calls | tojson }}|{{ m.tool_calls[0].function | tojson(indent=2) }}|{{ m.tool_calls | tojson(sort_keys=true) }}|{{ m.content | tojson }}|{{ m.name | tojson(ensure_ascii=true) }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let m: Message = serde_json::from_str(
            r#"{"role": "assistant", "content": null, "name": "caf\u00e9 <b>", "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Z\u00fcrich & <x>", "days": [1, 2.5], "x": {}}}}]}"#,
        )
        .unwrap();
        let text = t.render(&[m], None, false).unwrap();
        assert_eq!(
            text,
            concat!(
                // Keys in the order the input has them, as Python's dicts keep them.
                r#"[{"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich & <x>", "days": [1, 2.5], "x": {}}}}]"#,
                "|{\n  \"name\": \"get\",\n  \"arguments\": {\n    \"city\": \"Zürich & <x>\",\n    \"days\": [\n      1,\n      2.5\n    ],\n    \"x\": {}\n  }\n}",
                r#"|[{"function": {"arguments": {"city": "Zürich & <x>", "days": [1, 2.5], "x": {}}, "name": "get"}, "type": "function"}]"#,
                // Null content is rendered as "" (see `Message`).
                r#"|""|"caf\u00e9 <b>""#
            )
        );
        let err = ChatTemplate::new("{{ 1 | tojson(foo=1) }}", None, None)
            .unwrap()
            .render(&[], None, false)
            .unwrap_err();
        assert!(format!("{err:#}").contains("foo"), "{err:#}");
    }

    #[test]
    fn templates_that_read_tool_calls_support_tools() {
        let with = ChatTemplate::new(
            "{% for m in messages %}{{ m.tool_calls }}{% endfor %}",
            None,
            None,
        );
        assert!(with.unwrap().supports_tools());
        let without = ChatTemplate::new(
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            None,
            None,
        );
        assert!(!without.unwrap().supports_tools());
    }

    #[test]
    fn tools_are_handed_to_the_template_as_they_are() {
        let t = ChatTemplate::new(
            "{% if tools is none %}none{% else %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}",
            None,
            None,
        )
        .unwrap();
        assert!(t.reads_tools());
        assert_eq!(t.render(&[], None, false).unwrap(), "none");
        let tools: Vec<serde_json::Value> = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]"#,
        )
        .unwrap();
        assert_eq!(
            t.render(&[], Some(&tools), false).unwrap(),
            r#"{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}"#
        );
        let plain = ChatTemplate::new("{% set tools = 1 %}{{ messages }}", None, None).unwrap();
        assert!(!plain.reads_tools());
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        let err = t.render(&[], None, false).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
    }
}
