//! Chat dataset inputs: ShareGPT JSON arrays or JSON lines (`{"conversations": [{"from",
//! "value"}]}`), chat-message JSON lines (`{"messages": [{"role", "content"}]}`, with OpenAI's
//! tool definitions in `"tools"` beside them) and plain text JSON lines (`{"text"}`). Every
//! record is named by file and row, and keeps the start of its text, so that skips and errors
//! can say where they come from.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::sharegpt::{self, Conversation};
use crate::text::Message;

/// What one input record holds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RecordBody {
    Chat {
        messages: Vec<Message>,
        /// The record's `tools` (OpenAI tool definitions), for the template's `tools`.
        tools: Option<Vec<serde_json::Value>>,
    },
    Text(String),
}

/// One input record.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChatRecord {
    /// The record's own id when it has one, else `file:row`.
    pub id: String,
    /// `file:row` (row counted from 0 in JSON arrays, from 1 as a line number in JSONL).
    pub origin: String,
    /// The start of the record's text, for showing it when it is skipped.
    pub excerpt: String,
    pub body: RecordBody,
}

/// A record that could not be used, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Skip {
    pub origin: String,
    /// The start of the record's text (see [`excerpt`]).
    pub excerpt: String,
    pub reason: SkipReason,
}

/// How many characters of a record [`excerpt`] keeps.
const EXCERPT_CHARS: usize = 80;

/// The start of a record's text on one line: whitespace runs as one space, at most
/// [`EXCERPT_CHARS`] characters, "..." where it was cut.
pub(crate) fn excerpt(text: &str) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(EXCERPT_CHARS) {
        Some((cut, _)) => format!("{}...", &flat[..cut]),
        None => flat,
    }
}

/// Why a record is skipped. The summary of `prepare-data` counts skips by
/// [`SkipReason::category`]; the kinds it groups apart from their text are variants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkipReason {
    /// A ShareGPT turn from a speaker that is no role.
    #[error("turn {turn} is from unknown speaker {speaker:?}")]
    UnknownSpeaker { turn: usize, speaker: String },
    /// Cutting the sample at the longest length left no token to train.
    #[error("no assistant token within the first {max_len} tokens")]
    NoAssistantToken { max_len: usize },
    /// Any other reason, as `category: detail` or a category alone.
    #[error("{0}")]
    Other(String),
}

impl SkipReason {
    /// The group the summary counts the skip in: the variant's, or for
    /// [`SkipReason::Other`] its text up to the first ':'.
    pub(crate) fn category(&self) -> String {
        match self {
            SkipReason::UnknownSpeaker { .. } => "unknown speaker".into(),
            SkipReason::NoAssistantToken { .. } => "no assistant token within max length".into(),
            SkipReason::Other(text) => text.split(':').next().unwrap_or_default().to_string(),
        }
    }
}

impl From<String> for SkipReason {
    fn from(text: String) -> Self {
        SkipReason::Other(text)
    }
}

impl From<&str> for SkipReason {
    fn from(text: &str) -> Self {
        SkipReason::Other(text.to_string())
    }
}

/// Records read from the inputs, and the ones skipped on the way.
#[derive(Debug, Default)]
pub(crate) struct ReadOutcome {
    pub records: Vec<ChatRecord>,
    pub skipped: Vec<Skip>,
    /// For each entry of `skipped`: how many records were read before it, so that records and
    /// skips can be put back into input order (`prepare-data --limit`).
    pub skipped_after: Vec<usize>,
    /// Inputs that ended inside a record (e.g. the cut-off ShareGPT dump).
    pub truncated: Vec<String>,
}

impl ReadOutcome {
    fn skip(&mut self, origin: String, excerpt: String, reason: SkipReason) {
        self.skipped_after.push(self.records.len());
        self.skipped.push(Skip {
            origin,
            excerpt,
            reason,
        });
    }

    fn add(
        &mut self,
        parsed: std::result::Result<ChatRecord, SkipReason>,
        origin: String,
        excerpt: String,
    ) {
        match parsed {
            Ok(r) => self.records.push(ChatRecord { excerpt, ..r }),
            Err(reason) => self.skip(origin, excerpt, reason),
        }
    }
}

fn parse_value(
    value: serde_json::Value,
    origin: &str,
) -> std::result::Result<ChatRecord, SkipReason> {
    let id_of = |v: &serde_json::Value| match v.get("id") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    let id = id_of(&value).unwrap_or_else(|| origin.to_string());
    let body = if value.get("conversations").is_some() {
        let conv: Conversation =
            serde_json::from_value(value).map_err(|e| format!("not a ShareGPT record: {e}"))?;
        RecordBody::Chat {
            messages: conv.to_messages()?,
            tools: None,
        }
    } else if let Some(messages) = value.get("messages") {
        let messages =
            crate::text::messages_from_json(messages).map_err(|e| format!("bad message: {e}"))?;
        let tools = value.get("tools").unwrap_or(&serde_json::Value::Null);
        let tools = crate::text::tools_from_json(tools).map_err(|e| format!("bad tools: {e}"))?;
        RecordBody::Chat { messages, tools }
    } else if let Some(text) = value.get("text") {
        RecordBody::Text(text.as_str().ok_or("\"text\" is not a string")?.to_string())
    } else {
        return Err("has none of \"conversations\", \"messages\", \"text\"".into());
    };
    Ok(ChatRecord {
        id,
        origin: origin.to_string(),
        excerpt: String::new(),
        body,
    })
}

/// Reads one input file (JSON array or JSON lines), appending to `out`.
pub(crate) fn read_input(path: &Path, out: &mut ReadOutcome) -> Result<()> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let name = path.display().to_string();
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        None => bail!("{name}: the file is empty"),
        Some(b'[') => {
            let (values, report) = sharegpt::parse_values(&bytes, &name)?;
            for (row, value) in values.into_iter().enumerate() {
                let origin = format!("{name}:{row}");
                let start = report.element_starts[row];
                let head = &bytes[start..bytes.len().min(start + 4 * EXCERPT_CHARS)];
                let parsed = parse_value(value, &origin);
                out.add(parsed, origin, excerpt(&String::from_utf8_lossy(head)));
            }
            if let Some(at) = report.truncated_at {
                out.truncated.push(format!(
                    "{name}: cut off at byte {at}; the incomplete last record was dropped"
                ));
            }
        }
        Some(_) => {
            let text = String::from_utf8_lossy(&bytes);
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let origin = format!("{name}:{}", i + 1);
                let parsed = serde_json::from_str::<serde_json::Value>(line)
                    .map_err(|e| SkipReason::from(format!("malformed JSON line: {e}")))
                    .and_then(|v| parse_value(v, &origin));
                let head: String = line.chars().take(4 * EXCERPT_CHARS).collect();
                out.add(parsed, origin, excerpt(&head));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_formats_and_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(
            &path,
            concat!(
                "{\"id\": \"s1\", \"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, {\"from\": \"gpt\", \"value\": \"yo\"}]}\n",
                "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n",
                "\n",
                "{\"text\": \"plain\"}\n",
                "{\"text\": \n",
                "{\"other\": 1}\n",
                "{\"conversations\": [{\"from\": \"alien\", \"value\": \"x\"}]}\n",
            ),
        )
        .unwrap();
        let mut out = ReadOutcome::default();
        read_input(&path, &mut out).unwrap();
        assert_eq!(out.records.len(), 3);
        assert_eq!(out.records[0].id, "s1");
        assert_eq!(
            out.records[0].body,
            RecordBody::Chat {
                messages: vec![Message::new("user", "hi"), Message::new("assistant", "yo")],
                tools: None
            }
        );
        assert!(out.records[1].id.ends_with("in.jsonl:2"));
        assert_eq!(out.records[2].body, RecordBody::Text("plain".into()));
        assert_eq!(out.skipped.len(), 3);
        assert!(
            out.skipped[0].origin.ends_with(":5")
                && out.skipped[0].reason.to_string().contains("malformed")
        );
        assert!(out.skipped[2].reason.to_string().contains("alien"));
        assert_eq!(out.skipped[2].reason.category(), "unknown speaker");
        assert_eq!(out.skipped[0].reason.category(), "malformed JSON line");
    }

    #[test]
    fn excerpts_are_one_short_line() {
        assert_eq!(excerpt("{\"a\":\n   1}\n"), "{\"a\": 1}");
        let long = format!("{}é tail", "ü".repeat(79));
        assert_eq!(excerpt(&long), format!("{}é...", "ü".repeat(79)));
    }

    #[test]
    fn tools_are_read_next_to_messages() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(
            &path,
            concat!(
                "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}], \"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n",
                "{\"tools\": {\"name\": \"f\"}, \"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n",
            ),
        )
        .unwrap();
        let mut out = ReadOutcome::default();
        read_input(&path, &mut out).unwrap();
        let RecordBody::Chat { tools, .. } = &out.records[0].body else {
            panic!("not a chat: {:?}", out.records[0]);
        };
        assert_eq!(tools.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            out.skipped[0].reason.to_string(),
            "bad tools: \"tools\" is an object, expected a list of tool definitions"
        );
        assert_eq!(out.skipped[0].reason.category(), "bad tools");
        assert!(out.skipped[0].excerpt.starts_with("{\"tools\": {\"name\""));
    }

    #[test]
    fn empty_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.json");
        std::fs::write(&path, "  \n").unwrap();
        let err = read_input(&path, &mut ReadOutcome::default()).unwrap_err();
        assert!(err.to_string().contains("empty.json: the file is empty"));
    }
}
