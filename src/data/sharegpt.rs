//! ShareGPT conversations (`[{"id", "conversations": [{"from", "value"}, ...]}, ...]`).
//!
//! Real ShareGPT dumps are large JSON arrays that are sometimes cut off in the middle of a
//! record. The reader walks the array one element at a time and keeps every complete record,
//! reporting where the input ended, instead of failing on the whole file.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::chat::SkipReason;

/// One turn of a ShareGPT conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    pub from: String,
    pub value: String,
}

/// One ShareGPT record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    #[serde(default)]
    pub id: Option<String>,
    pub conversations: Vec<Turn>,
}

impl Conversation {
    /// The turns as chat messages: `human` -> user, `gpt` (and the other assistant names
    /// found in ShareGPT dumps: `chatgpt`, `bing`, `bard`, `assistant`) -> assistant,
    /// `system` -> system. Turns from any other speaker make the record unusable.
    pub fn to_messages(&self) -> std::result::Result<Vec<crate::text::Message>, SkipReason> {
        self.conversations
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let role = match t.from.as_str() {
                    "human" | "user" => "user",
                    "gpt" | "chatgpt" | "bing" | "bard" | "assistant" => "assistant",
                    "system" => "system",
                    other => {
                        return Err(SkipReason::UnknownSpeaker {
                            turn: i,
                            speaker: other.to_string(),
                        })
                    }
                };
                Ok(crate::text::Message::new(role, &t.value))
            })
            .collect()
    }
}

/// How reading a ShareGPT array went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RecoveryReport {
    /// Complete elements seen (kept + skipped).
    pub records_seen: usize,
    /// Elements that are valid JSON but not ShareGPT records, with the reason (first few).
    pub skipped: Vec<(usize, String)>,
    /// Number of skipped elements in all.
    pub skipped_count: usize,
    /// Where the input ended early: byte offset of the incomplete element.
    pub truncated_at: Option<usize>,
    /// Where each complete element starts (byte offset).
    pub element_starts: Vec<usize>,
}

const SKIP_EXAMPLES: usize = 5;

fn skip_ws(bytes: &[u8], mut pos: usize) -> usize {
    while pos < bytes.len() && bytes[pos].is_ascii_whitespace() {
        pos += 1;
    }
    pos
}

/// Reads every complete element of the JSON array in `bytes`, stopping cleanly where the input
/// is cut off. `source` names the input in messages.
pub(crate) fn parse_values(
    bytes: &[u8],
    source: &str,
) -> Result<(Vec<serde_json::Value>, RecoveryReport)> {
    let mut report = RecoveryReport::default();
    let mut out = Vec::new();
    let mut pos = skip_ws(bytes, 0);
    if bytes.get(pos) != Some(&b'[') {
        bail!("{source}: expected a JSON array ('[') at byte {pos}");
    }
    pos += 1;
    loop {
        pos = skip_ws(bytes, pos);
        match bytes.get(pos) {
            None => {
                report.truncated_at = Some(pos);
                break;
            }
            Some(b']') => break,
            Some(_) => {}
        }
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<serde_json::Value>();
        match stream.next() {
            Some(Ok(value)) => {
                report.records_seen += 1;
                report.element_starts.push(pos);
                out.push(value);
                pos += stream.byte_offset();
            }
            Some(Err(e)) if e.is_eof() => {
                report.truncated_at = Some(pos);
                break;
            }
            Some(Err(e)) => bail!(
                "{source}: invalid JSON in array element {} (starting at byte {pos}): {e}",
                report.records_seen
            ),
            None => {
                report.truncated_at = Some(pos);
                break;
            }
        }
        pos = skip_ws(bytes, pos);
        match bytes.get(pos) {
            Some(b',') => pos += 1,
            Some(b']') => break,
            None => {
                report.truncated_at = Some(pos);
                break;
            }
            Some(&other) => bail!(
                "{source}: expected ',' or ']' after array element {} at byte {pos}, found {:?}",
                report.records_seen - 1,
                other as char
            ),
        }
    }
    Ok((out, report))
}

/// Reads every complete conversation from the JSON array in `bytes`; elements that are not
/// ShareGPT records are skipped and counted.
pub(crate) fn parse_conversations(
    bytes: &[u8],
    source: &str,
) -> Result<(Vec<Conversation>, RecoveryReport)> {
    let (values, mut report) =
        parse_values(bytes, source).map_err(|e| anyhow::anyhow!("not a ShareGPT file: {e}"))?;
    let mut out = Vec::with_capacity(values.len());
    for (index, value) in values.into_iter().enumerate() {
        match serde_json::from_value::<Conversation>(value) {
            Ok(c) => out.push(c),
            Err(e) => {
                report.skipped_count += 1;
                if report.skipped.len() < SKIP_EXAMPLES {
                    report.skipped.push((index, e.to_string()));
                }
            }
        }
    }
    Ok((out, report))
}

/// Reads a ShareGPT JSON file (see [`parse_conversations`]).
pub(crate) fn read_conversations(path: &Path) -> Result<(Vec<Conversation>, RecoveryReport)> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    parse_conversations(&bytes, &path.display().to_string())
}

/// Writes conversations as JSON lines (one ShareGPT record per line), atomically.
pub(crate) fn write_jsonl(conversations: &[Conversation], path: &Path) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("{}: cannot create folder", parent.display()))?;
    crate::fsutil::write_atomic(path, |tmp| {
        let file = std::fs::File::create(tmp)
            .with_context(|| format!("{}: cannot write into this folder", parent.display()))?;
        let mut w = std::io::BufWriter::new(file);
        for c in conversations {
            serde_json::to_writer(&mut w, c)?;
            w.write_all(b"\n")?;
        }
        w.flush()?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
 {"id": "b", "conversations": [{"from": "human", "value": "x"}]}"#;

    #[test]
    fn complete_array_reads_whole() {
        let text = format!("{TWO}]");
        let (convs, report) = parse_conversations(text.as_bytes(), "t").unwrap();
        assert_eq!(convs.len(), 2);
        assert_eq!(convs[0].conversations[1].value, "hello");
        assert_eq!(report.truncated_at, None);
    }

    #[test]
    fn cut_off_record_is_dropped_and_reported() {
        let text = format!("{TWO}, {{\"id\": \"c\", \"conversations\": [{{\"from\": \"hu");
        let (convs, report) = parse_conversations(text.as_bytes(), "t").unwrap();
        assert_eq!(convs.len(), 2);
        assert_eq!(report.records_seen, 2);
        assert_eq!(report.truncated_at, Some(TWO.len() + 2));
        // cut right after a comma, too
        let (convs, report) = parse_conversations(format!("{TWO},").as_bytes(), "t").unwrap();
        assert_eq!(convs.len(), 2);
        assert!(report.truncated_at.is_some());
    }

    #[test]
    fn records_of_the_wrong_shape_are_skipped_and_bad_json_fails() {
        let text = r#"[{"id": "a", "conversations": []}, {"id": 3}, 7]"#;
        let (convs, report) = parse_conversations(text.as_bytes(), "t").unwrap();
        assert_eq!(convs.len(), 1);
        assert_eq!(report.skipped_count, 2);
        let err = parse_conversations(br#"[{"id": "a",, }]"#, "f.json").unwrap_err();
        assert!(err.to_string().contains("f.json"), "{err}");
        assert!(parse_conversations(b"{}", "f.json").is_err());
    }
}
