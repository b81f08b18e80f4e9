//! `prepare-data`: chat records -> token ids and loss masks, rendered with the tokenizer's chat
//! template exactly as Hugging Face `apply_chat_template` renders and tokenises them.
//!
//! The loss mask is 1 on the tokens the assistant produced: each assistant turn's content as the
//! template renders it, and the end-of-turn token right after it (e.g. `<|im_end|>`). Everything
//! else is template text: the role headers, the newline after the end-of-turn token, and text a
//! template inserts between the header and the content, such as the empty
//! `<think>\n\n</think>\n\n` block that Qwen3's template puts before the last assistant turn
//! after the last user turn. That block is what Qwen3's generation prompt holds with
//! `enable_thinking=False`, i.e. prompt text, so it is not trained. This is the mask that
//! transformers' `return_assistant_tokens_mask=True` gives for a template whose
//! `{% generation %}` block encloses the (rendered) content and the end-of-turn token.
//!
//! The spans are found by rendering the conversation a second time with every assistant content
//! replaced by a unique marker: the text between the markers is template text, and aligning it
//! with the real rendering gives where each rendered content starts and ends, whatever the
//! template does around it (no rendering of prefixes, which fails for templates that read
//! `messages[0]` when a conversation starts with an assistant turn). A token is trained when
//! its first byte lies inside a span. Templates whose output depends on the content itself
//! (so that the marker rendering does not line up) fall back to finding each content, in
//! order, in the rendered text.

use std::ops::Range;

use anyhow::Result;

use super::chat::{ChatRecord, RecordBody, SkipReason};
use crate::text::{ChatTemplate, Message, TextTokenizer};

/// One tokenised conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreparedSample {
    pub id: String,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    /// The rendering was longer than the maximum length and was cut.
    pub was_cut: bool,
    /// Turns rendered with empty (or blank) content, but assistant turns that call tools.
    pub empty_turns: usize,
}

/// An assistant turn that calls tools: its span is found by [`tool_call_span`].
fn calls_tools(m: &Message) -> bool {
    m.role == "assistant" && m.tool_calls().is_some()
}

/// The messages with every assistant content (but those of turns that call tools) replaced by
/// a numbered marker, and the indices of those assistant messages.
fn with_markers(messages: &[Message]) -> (Vec<Message>, Vec<usize>) {
    let mut marked = messages.to_vec();
    let mut turns = Vec::new();
    for (i, m) in marked.iter_mut().enumerate() {
        if m.role == "assistant" && !calls_tools(m) {
            m.content = marker(turns.len());
            turns.push(i);
        }
    }
    (marked, turns)
}

/// The marker that stands in for assistant turn `k`'s content: private-use characters that no
/// template writes, and no leading or trailing whitespace for a template to strip.
fn marker(k: usize) -> String {
    format!("\u{E000}dflash-assistant-{k}\u{E001}")
}

/// What a conversation is rendered with: its template, the tokenizer's end-of-turn token, and
/// the conversation's tools.
#[derive(Clone, Copy)]
struct Rendering<'a> {
    template: &'a ChatTemplate,
    eos: Option<&'a str>,
    tools: Option<&'a [serde_json::Value]>,
}

impl Rendering<'_> {
    fn render(&self, messages: &[Message]) -> Result<String> {
        self.template.render(messages, self.tools, false)
    }
}

/// Byte spans of the assistant turns (rendered content + end-of-turn token) in `full`, the
/// rendered text of `messages`.
fn template_spans(
    r: Rendering<'_>,
    messages: &[Message],
    full: &str,
) -> std::result::Result<Vec<Range<usize>>, String> {
    let eos = r.eos;
    let (marked, turns) = with_markers(messages);
    let aligned = r
        .render(&marked)
        .ok()
        .and_then(|skeleton| align_with_markers(&skeleton, full, messages, &turns, eos));
    let mut spans = match aligned {
        Some(spans) => spans,
        None => find_contents(messages, full, eos)?,
    };
    for (i, m) in messages.iter().enumerate() {
        if calls_tools(m) {
            spans.push(tool_call_span(r, messages, i, full)?);
        }
    }
    spans.sort_by_key(|s| s.start);
    Ok(spans)
}

/// The span of assistant turn `i`, which calls tools, in `full`: from where its content starts
/// (where rendering a marker as its content makes the text differ; with no content, that is
/// where its tool calls start) through the first end-of-turn token after it, so that the
/// content and the tool calls, all of it written by the assistant, are trained.
fn tool_call_span(
    r: Rendering<'_>,
    messages: &[Message],
    i: usize,
    full: &str,
) -> std::result::Result<Range<usize>, String> {
    let mut marked = messages.to_vec();
    marked[i].content = marker(0);
    marked[i].content_is_null = false;
    let other = r
        .render(&marked)
        .map_err(|e| format!("assistant turn {i} (tool calls): {e:#}"))?;
    if other == full {
        return Err(format!(
            "assistant turn {i} (tool calls): the template does not show its content, so where the turn starts cannot be found"
        ));
    }
    let mut start = full
        .bytes()
        .zip(other.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    while !full.is_char_boundary(start) {
        start -= 1;
    }
    let eos = r.eos.ok_or_else(|| {
        format!(
            "assistant turn {i} (tool calls): the tokenizer names no end-of-turn token to end it"
        )
    })?;
    let end = full[start..]
        .find(eos)
        .map(|p| start + p + eos.len())
        .ok_or_else(|| {
            format!("assistant turn {i} (tool calls): no end-of-turn token {eos:?} after it")
        })?;
    Ok(start..end)
}

/// Where the template text between the markers of `skeleton` lies in `full`: the spans of the
/// rendered contents, each extended by the end-of-turn token after it. `None` when the two do
/// not line up.
fn align_with_markers(
    skeleton: &str,
    full: &str,
    messages: &[Message],
    turns: &[usize],
    eos: Option<&str>,
) -> Option<Vec<Range<usize>>> {
    // Template pieces: before the first marker, between markers, after the last.
    let mut pieces = Vec::with_capacity(turns.len() + 1);
    let mut rest = skeleton;
    for k in 0..turns.len() {
        let m = marker(k);
        let at = rest.find(&m)?;
        pieces.push(&rest[..at]);
        rest = &rest[at + m.len()..];
    }
    if (0..turns.len()).any(|k| rest.contains(&marker(k))) {
        return None;
    }
    pieces.push(rest);
    let last = *pieces.last()?;
    if !full.starts_with(pieces[0]) || !full.ends_with(last) {
        return None;
    }
    let mut pos = pieces[0].len();
    let mut spans = Vec::with_capacity(turns.len());
    for (k, &turn) in turns.iter().enumerate() {
        let next = pieces[k + 1];
        let content_end = if k + 1 == turns.len() {
            full.len().checked_sub(last.len()).filter(|&e| e >= pos)?
        } else {
            if next.is_empty() {
                return None;
            }
            // The content as it is, when it is followed by the template text; else the first
            // place the template text follows.
            let content = &messages[turn].content;
            let rest = &full[pos..];
            if rest.starts_with(content.as_str()) && rest[content.len()..].starts_with(next) {
                pos + content.len()
            } else {
                pos + rest.find(next)?
            }
        };
        spans.push(pos..content_end + end_of_turn(next, eos, k + 1 == turns.len()));
        pos = content_end + next.len();
    }
    Some(spans)
}

/// How much of the template text after an assistant content belongs to the turn: through the
/// end-of-turn token when it comes before the next line break, else the rest of that line
/// (trailing whitespace excluded) when the line ends (or the text does).
fn end_of_turn(after: &str, eos: Option<&str>, is_last: bool) -> usize {
    let newline = after.find('\n');
    let line = &after[..newline.unwrap_or(after.len())];
    match eos.and_then(|e| line.find(e).map(|p| p + e.len())) {
        Some(end) => end,
        None if newline.is_some() || is_last => line.trim_end().len(),
        None => 0,
    }
}

/// Fallback: each assistant content (as it is, or without surrounding whitespace), found in
/// order in the rendered text, plus an end-of-turn token right after it.
fn find_contents(
    messages: &[Message],
    full: &str,
    eos: Option<&str>,
) -> std::result::Result<Vec<Range<usize>>, String> {
    let mut spans = Vec::new();
    let mut cursor = 0;
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" || calls_tools(m) {
            continue;
        }
        let (at, len) = [m.content.as_str(), m.content.trim()]
            .iter()
            .find_map(|c| full[cursor..].find(c).map(|p| (cursor + p, c.len())))
            .ok_or_else(|| format!("assistant turn {i} is not found in the rendered text"))?;
        let mut end = at + len;
        if let Some(e) = eos {
            let gap = full[end..].len() - full[end..].trim_start_matches([' ', '\n']).len();
            if full[end + gap..].starts_with(e) {
                end += gap + e.len();
            }
        }
        cursor = end;
        spans.push(at..end);
    }
    Ok(spans)
}

/// The conversation without assistant turns that come before the first user turn (as
/// FastChat-style preprocessing does): an answer to no question teaches nothing about
/// answering, and every such turn would follow the same bare prompt (in ShareGPT about a third
/// of the conversations start with a `gpt` turn, continued from an earlier chat).
fn without_leading_answers(messages: &[Message]) -> Vec<Message> {
    let first_user = messages.iter().position(|m| m.role == "user");
    messages
        .iter()
        .enumerate()
        .filter(|(i, m)| m.role != "assistant" || first_user.is_some_and(|u| *i > u))
        .map(|(_, m)| m.clone())
        .collect()
}

/// Tool definitions, tool calls and tool answers need a template that renders them; only an
/// assistant turn that calls tools may have no content (OpenAI's rule). `Err` names the message.
fn check_tool_use(
    messages: &[Message],
    tools: Option<&[serde_json::Value]>,
    template: &ChatTemplate,
) -> std::result::Result<(), String> {
    let defined = tools.map_or(0, <[_]>::len);
    if defined > 0 && !template.reads_tools() {
        return Err(format!(
            "the chat template does not show tool definitions: the record defines {defined} tool(s)"
        ));
    }
    let template_supports_tools = template.supports_tools();
    for (i, m) in messages.iter().enumerate() {
        if m.uses_tools() && !template_supports_tools {
            let what = if m.role == "tool" {
                "is a tool's answer"
            } else {
                "calls tools"
            };
            return Err(format!(
                "the chat template does not support tool calls: messages[{i}] {what}"
            ));
        }
        if m.content_is_null && !calls_tools(m) {
            return Err(format!(
                "no content: messages[{i}] ({}) has null content and calls no tool",
                m.role
            ));
        }
    }
    Ok(())
}

/// Turns with empty or blank content, but assistant turns that call tools (whose content is
/// often empty).
fn count_empty_turns(messages: &[Message]) -> usize {
    messages
        .iter()
        .filter(|m| m.content.trim().is_empty() && !calls_tools(m))
        .count()
}

/// Renders and tokenises one record. `Err` carries the reason the record is skipped.
pub(crate) fn prepare_record(
    tokenizer: &TextTokenizer,
    record: &ChatRecord,
    max_len: usize,
) -> std::result::Result<PreparedSample, SkipReason> {
    let mut empty_turns = 0;
    // Only the first `max_len` tokens are tokenised (see [`super::token_prefix`]).
    let (tokens, spans) = match &record.body {
        RecordBody::Text(text) => {
            let tokens = tokenizer
                .encode_prefix(text, max_len)
                .map_err(|e| e.to_string())?;
            // Plain text: every token is trained.
            (tokens, std::iter::once(0..text.len()).collect::<Vec<_>>())
        }
        RecordBody::Chat {
            messages: all_messages,
            tools,
        } => {
            let messages = &without_leading_answers(all_messages);
            if !messages.iter().any(|m| m.role == "assistant") {
                let any_answer = all_messages.iter().any(|m| m.role == "assistant");
                return Err(if any_answer {
                    "no assistant turn after a user turn".into()
                } else {
                    "no assistant turn".into()
                });
            }
            if let Some(m) = messages
                .iter()
                .find(|m| !matches!(m.role.as_str(), "user" | "assistant" | "system" | "tool"))
            {
                return Err(format!("unknown role {:?}", m.role).into());
            }
            let tools = tools.as_deref();
            let template = tokenizer
                .chat_template(tools.is_some())
                .map_err(|e| format!("no chat template: {e:#}"))?;
            check_tool_use(all_messages, tools, template)?;
            let rendering = Rendering {
                template,
                eos: tokenizer.eos_token.as_deref().filter(|e| !e.is_empty()),
                tools,
            };
            let full = rendering.render(messages).map_err(|e| e.to_string())?;
            let spans = template_spans(rendering, messages, &full)?;
            empty_turns = count_empty_turns(messages);
            let tokens = tokenizer
                .encode_prefix(&full, max_len)
                .map_err(|e| e.to_string())?;
            (tokens, spans)
        }
    };
    if tokens.ids.is_empty() && !tokens.more {
        return Err("no tokens".into());
    }
    let loss_mask: Vec<u8> = tokens
        .offsets
        .iter()
        .map(|o| spans.iter().any(|s| s.contains(&o.0)) as u8)
        .collect();
    if loss_mask.iter().all(|&m| m == 0) {
        return Err(SkipReason::NoAssistantToken { max_len });
    }
    Ok(PreparedSample {
        id: record.id.clone(),
        input_ids: tokens.ids,
        loss_mask,
        was_cut: tokens.more,
        empty_turns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_before_the_first_question_are_dropped() {
        let m = |role: &str, content: &str| Message::new(role, content);
        let conv = [
            m("system", "s"),
            m("assistant", "continued"),
            m("assistant", "more"),
            m("user", "q1"),
            m("assistant", "a1"),
            m("user", "q2"),
            m("assistant", "a2"),
        ];
        let kept: Vec<_> = without_leading_answers(&conv)
            .into_iter()
            .map(|m| m.content)
            .collect();
        assert_eq!(kept, ["s", "q1", "a1", "q2", "a2"]);
        assert!(without_leading_answers(&[m("assistant", "x")]).is_empty());
        let plain = [m("user", "q"), m("assistant", "a")];
        assert_eq!(without_leading_answers(&plain), plain.to_vec());
    }

    /// The parts of Qwen3's template that matter here: `messages[0]` read at the top, and an
    /// empty think block before an assistant turn that follows the last user turn.
    const QWEN3_LIKE: &str = "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}\
{%- set ns = namespace(last_query_index=messages|length - 1) %}\
{%- for message in messages[::-1] %}{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}{%- endif %}{%- endfor %}\
{%- for message in messages %}\
{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}\
{%- elif message.role == 'assistant' %}\
{%- if loop.index0 > ns.last_query_index and loop.last %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content.lstrip('\\n') }}\
{%- else %}{{- '<|im_start|>assistant\\n' + message.content }}{%- endif %}\
{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}";

    fn spans_of(messages: &[Message]) -> (String, Vec<String>) {
        let t = ChatTemplate::new(QWEN3_LIKE, None, Some("<|im_end|>".into())).unwrap();
        let full = t.render(messages, None, false).unwrap();
        let (marked, turns) = with_markers(messages);
        let skeleton = t.render(&marked, None, false).unwrap();
        let spans =
            align_with_markers(&skeleton, &full, messages, &turns, Some("<|im_end|>")).unwrap();
        let texts = spans.iter().map(|s| full[s.clone()].to_string()).collect();
        (full, texts)
    }

    #[test]
    fn assistant_first_conversations_and_the_think_block() {
        // Starts with an assistant turn: no rendering of an empty prefix is needed.
        let (full, spans) = spans_of(&[
            Message::new("assistant", "Hello."),
            Message::new("user", "Hi"),
            Message::new("assistant", "\n\nHow can I help?"),
        ]);
        assert!(full.contains("<|im_start|>assistant\n<think>\n\n</think>\n\nHow can I help?"));
        // The think block is template text; the stripped content and <|im_end|> are trained.
        assert_eq!(spans, ["Hello.<|im_end|>", "How can I help?<|im_end|>"]);

        // Ends with a user turn: no think block; an assistant content equal to template text.
        let (full, spans) = spans_of(&[
            Message::new("user", "a"),
            Message::new("assistant", "<|im_start|>user\n"),
            Message::new("user", "b"),
        ]);
        assert!(!full.contains("<think>"));
        assert_eq!(spans, ["<|im_start|>user\n<|im_end|>"]);
    }

    /// The tool parts of Qwen2.5's template: content only when there is some, each tool call
    /// as JSON in `<tool_call>` tags, tool answers in a user turn.
    const QWEN_TOOLS: &str = "{%- for message in messages %}\
{%- if message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\
{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}\
{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}\
{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}\
{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}\
{%- endif %}{%- endfor %}";

    fn tool_conversation(content: serde_json::Value) -> Vec<Message> {
        crate::text::messages_from_json(&serde_json::json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ]},
            {"role": "tool", "tool_call_id": "1", "content": "22 C"},
            {"role": "assistant", "content": "It is 22 C."},
        ]))
        .unwrap()
    }

    #[test]
    fn a_tool_calling_turn_is_trained_from_its_content_or_calls_to_its_end() {
        let t = ChatTemplate::new(QWEN_TOOLS, None, Some("<|im_end|>".into())).unwrap();
        let eos = Some("<|im_end|>");
        let call = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>";
        for (content, trained) in [
            (serde_json::Value::Null, call.to_string()),
            (
                serde_json::json!("Let me look."),
                format!("Let me look.\n{call}"),
            ),
        ] {
            let messages = tool_conversation(content);
            let r = Rendering {
                template: &t,
                eos,
                tools: None,
            };
            let full = r.render(&messages).unwrap();
            let spans = template_spans(r, &messages, &full).unwrap();
            let texts: Vec<&str> = spans.iter().map(|s| &full[s.clone()]).collect();
            assert_eq!(texts, [trained.as_str(), "It is 22 C.<|im_end|>"], "{full}");
        }
    }

    #[test]
    fn tool_use_needs_a_template_that_supports_it() {
        let with = ChatTemplate::new(QWEN_TOOLS, None, None).unwrap();
        let without = ChatTemplate::new(QWEN3_LIKE, None, None).unwrap();
        let messages = tool_conversation(serde_json::Value::Null);
        assert_eq!(check_tool_use(&messages, None, &with), Ok(()));
        let err = check_tool_use(&messages, None, &without).unwrap_err();
        assert_eq!(
            err,
            "the chat template does not support tool calls: messages[1] calls tools"
        );
        let answer_only = [Message::new("user", "q"), Message::new("tool", "x")];
        assert!(check_tool_use(&answer_only, None, &without)
            .unwrap_err()
            .ends_with("messages[1] is a tool's answer"));
        let mut empty = Message::new("user", "");
        empty.content_is_null = true;
        assert_eq!(
            check_tool_use(&[empty], None, &with).unwrap_err(),
            "no content: messages[0] (user) has null content and calls no tool"
        );
        // Tool definitions need a template that reads `tools` (QWEN_TOOLS does not).
        let tools = [serde_json::json!({"type": "function", "function": {"name": "weather"}})];
        assert_eq!(
            check_tool_use(&messages, Some(&tools), &with).unwrap_err(),
            "the chat template does not show tool definitions: the record defines 1 tool(s)"
        );
        assert_eq!(check_tool_use(&messages, Some(&[]), &with), Ok(()));
    }

    #[test]
    fn empty_turns_are_counted_but_tool_calls() {
        let mut messages = tool_conversation(serde_json::Value::Null);
        assert_eq!(count_empty_turns(&messages), 0);
        messages.push(Message::new("user", " \n"));
        messages.push(Message::new("assistant", ""));
        assert_eq!(count_empty_turns(&messages), 2);
    }

    #[test]
    fn end_of_turn_is_cut_after_the_token_or_the_line() {
        assert_eq!(
            end_of_turn("<|im_end|>\n<|im_start|>user", Some("<|im_end|>"), false),
            10
        );
        assert_eq!(end_of_turn("<end_of_turn>\n", Some("<eos>"), true), 13);
        assert_eq!(end_of_turn("[INST] next", None, false), 0);
        assert_eq!(end_of_turn("", Some("</s>"), true), 0);
    }
}
