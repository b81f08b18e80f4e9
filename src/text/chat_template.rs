//! Chat templates are Jinja; `transformers` renders them with `trim_blocks` and
//! `lstrip_blocks`, a `raise_exception` function and Python string methods. minijinja with its
//! Python-compatibility callbacks renders the same text.

use anyhow::{anyhow, Result};
use minijinja::{Environment, Error, ErrorKind};

use super::Message;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("the chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's
    /// answer begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("{e}"))?;
        template
            .render(minijinja::context! {
                messages => messages,
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
        let text = t.render(&[Message::new("user", "Hi")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = t.render(&[Message::new("user", "Hi")], false).unwrap();
        assert!(!no_prompt.ends_with("assistant\n"));
    }

    #[test]
    fn block_tags_are_trimmed_and_python_methods_work() {
        let source = "{% for m in messages %}\n  {{ m.content.strip() }}|\n{% endfor %}";
        let t = ChatTemplate::new(source, None, None).unwrap();
        let text = t
            .render(
                &[Message::new("user", "  a "), Message::new("assistant", "b")],
                false,
            )
            .unwrap();
        assert_eq!(text, "  a|\n  b|\n");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
    }
}
