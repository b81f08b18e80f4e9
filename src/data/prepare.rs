//! `prepare-data`: chat records -> token ids and loss masks, rendered with the tokenizer's chat
//! template exactly as Hugging Face `apply_chat_template` renders and tokenises them.
//!
//! The loss mask is 1 on the tokens the assistant produced: each assistant turn's content and
//! its end-of-turn token. The character span of assistant turn i is found by rendering the
//! conversation up to turn i with the generation prompt (where the answer starts) and up to and
//! including turn i (where it ends, cut after the end-of-turn token); a token belongs to the
//! turn when its first byte lies inside the span.

use std::ops::Range;

use anyhow::{anyhow, Result};

use super::chat::{ChatRecord, RecordBody};
use crate::text::{Message, TextTokenizer};

/// One tokenised conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedSample {
    pub id: String,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    /// The rendering was longer than the maximum length and was cut.
    pub was_cut: bool,
}

/// Byte spans of the assistant turns in the rendered text of `messages`.
pub fn assistant_spans(
    tokenizer: &TextTokenizer,
    messages: &[Message],
    full: &str,
) -> std::result::Result<Vec<Range<usize>>, String> {
    let template = tokenizer
        .chat_template
        .as_ref()
        .ok_or_else(|| "the tokenizer has no chat template".to_string())?;
    let eos = tokenizer.eos_token.as_deref().filter(|e| !e.is_empty());
    let mut spans = Vec::new();
    let mut cursor = 0;
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let before = template
            .render(&messages[..i], true)
            .map_err(|e| e.to_string())?;
        let through = template
            .render(&messages[..=i], false)
            .map_err(|e| e.to_string())?;
        let span = if full.starts_with(&before)
            && full.starts_with(&through)
            && through.len() >= before.len()
        {
            let turn = &through[before.len()..];
            // Cut after the end-of-turn token: what follows it (a newline) is template text.
            let end = match eos.and_then(|e| turn.rfind(e).map(|p| p + e.len())) {
                Some(end) => end,
                None => turn.trim_end().len(),
            };
            before.len()..before.len() + end
        } else {
            // A template whose renderings of prefixes are not prefixes of the whole: find the
            // content itself, in order, plus an end-of-turn token right after it.
            let at = full[cursor..]
                .find(&m.content)
                .map(|p| cursor + p)
                .ok_or_else(|| format!("assistant turn {i} is not found in the rendered text"))?;
            let mut end = at + m.content.len();
            if let Some(e) = eos {
                if full[end..].starts_with(e) {
                    end += e.len();
                }
            }
            at..end
        };
        cursor = span.end;
        spans.push(span);
    }
    Ok(spans)
}

/// Renders and tokenises one record. `Err` carries the reason the record is skipped.
pub fn prepare_record(
    tokenizer: &TextTokenizer,
    record: &ChatRecord,
    max_len: usize,
) -> std::result::Result<PreparedSample, String> {
    let (ids, offsets, spans) = match &record.body {
        RecordBody::Text(text) => {
            let (ids, offsets) = tokenizer
                .encode_with_offsets(text)
                .map_err(|e| e.to_string())?;
            // Plain text: every token is trained.
            let all = std::iter::once(0..text.len()).collect::<Vec<_>>();
            (ids, offsets, all)
        }
        RecordBody::Chat(messages) => {
            if !messages.iter().any(|m| m.role == "assistant") {
                return Err("no assistant turn".into());
            }
            if let Some(m) = messages
                .iter()
                .find(|m| !matches!(m.role.as_str(), "user" | "assistant" | "system" | "tool"))
            {
                return Err(format!("unknown role {:?}", m.role));
            }
            let template = tokenizer
                .chat_template
                .as_ref()
                .ok_or_else(|| "the tokenizer has no chat template".to_string())?;
            let full = template
                .render(messages, false)
                .map_err(|e| e.to_string())?;
            let spans = assistant_spans(tokenizer, messages, &full)?;
            let (ids, offsets) = tokenizer
                .encode_with_offsets(&full)
                .map_err(|e| e.to_string())?;
            (ids, offsets, spans)
        }
    };
    if ids.is_empty() {
        return Err("no tokens".into());
    }
    let mut loss_mask: Vec<u8> = offsets
        .iter()
        .map(|o| spans.iter().any(|s| s.contains(&o.0)) as u8)
        .collect();
    let mut input_ids = ids;
    let was_cut = input_ids.len() > max_len;
    input_ids.truncate(max_len);
    loss_mask.truncate(max_len);
    if loss_mask.iter().all(|&m| m == 0) {
        return Err(format!(
            "no assistant token within the first {max_len} tokens"
        ));
    }
    Ok(PreparedSample {
        id: record.id.clone(),
        input_ids,
        loss_mask,
        was_cut,
    })
}

/// Byte offsets `(start, end)` of a token in the text.
pub type ByteSpan = (usize, usize);

impl TextTokenizer {
    /// Token ids and their byte offsets `(start, end)` in `text`.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<ByteSpan>)> {
        let enc = self
            .inner()
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenise: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }
}
