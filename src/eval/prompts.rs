//! Evaluation prompts: from a tokenised dataset's held-out split (each conversation up to its
//! first assistant token) or from a JSONL file of chat messages or token ids; and the checks
//! that make a bad prompt set fail with a clear message before any decoding starts.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::data::arrow_io::{read_token_data, resolve_split};
use crate::model::TargetConfig;
use crate::text::{Message, TextTokenizer};

/// A prompt and where it came from (for messages).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Prompt {
    pub ids: Vec<u32>,
    /// "file: line N" or "split path: row N".
    pub source: String,
}

/// Prompts from a JSONL file: `{"messages": [...]}` (chat template + generation prompt, with a
/// line's `tools` passed to the template as `apply_chat_template(tools=...)` does, and
/// the tokenizer of `model_dir`), `{"prompt_ids": [...]}`, or an MT-Bench question
/// (`{"question_id", "category", "turns": [...]}`, FastChat's `question.jsonl`: its first turn
/// as the user's message). At most `limit`.
pub(crate) fn prompts_from_file(
    path: &Path,
    model_dir: &Path,
    limit: usize,
) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let mut tokenizer: Option<TextTokenizer> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || out.len() >= limit {
            continue;
        }
        let source = format!("{}: line {}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{source}: not JSON"))?;
        let ids = if let Some(ids) = v.get("prompt_ids") {
            serde_json::from_value::<Vec<u32>>(ids.clone())
                .with_context(|| format!("{source}: prompt_ids must be a list of token ids"))?
        } else if v.get("messages").is_some() || v.get("turns").is_some() {
            let messages: Vec<Message> = if let Some(m) = v.get("messages") {
                crate::text::messages_from_json(m).map_err(|e| anyhow::anyhow!("{source}: {e}"))?
            } else {
                let first = v
                    .get("turns")
                    .and_then(|t| t.as_array())
                    .and_then(|t| t.first())
                    .and_then(|t| t.as_str())
                    .with_context(|| {
                        format!("{source}: turns must be a list of strings (MT-Bench questions)")
                    })?;
                vec![Message::new("user", first)]
            };
            if tokenizer.is_none() {
                tokenizer = Some(TextTokenizer::from_model_dir(model_dir)?);
            }
            let tools = v.get("tools").unwrap_or(&serde_json::Value::Null);
            let tools = crate::text::tools_from_json(tools)
                .map_err(|e| anyhow::anyhow!("{source}: bad tools: {e}"))?;
            let tok = tokenizer.as_ref().context("no tokenizer")?;
            tok.apply_chat_template_with_tools(&messages, tools.as_deref(), true)
                .with_context(|| source.clone())?
        } else {
            bail!("{source}: needs \"messages\", \"prompt_ids\" or MT-Bench \"turns\"");
        };
        out.push(Prompt { ids, source });
    }
    Ok(out)
}

/// Prompts from a tokenised dataset (`prepare-data` output, a split folder or a file): each
/// sample up to its first trained (assistant) token. `split` applies to a dataset folder.
pub(crate) fn prompts_from_data(path: &Path, split: &str, limit: usize) -> Result<Vec<Prompt>> {
    let split_path = if path.join("dataset_dict.json").is_file() {
        resolve_split(path, Some(split))?
    } else {
        path.to_path_buf()
    };
    let data = read_token_data(&split_path, "input_ids", Some("loss_mask"))?;
    let masks = data
        .masks
        .as_ref()
        .with_context(|| format!("{}: no loss_mask column", split_path.display()))?;
    let mut out = Vec::new();
    for i in 0..data.ids.len() {
        if out.len() >= limit {
            break;
        }
        let (s, e) = (data.ids.offsets[i], data.ids.offsets[i + 1]);
        if let Some(first) = masks[s..e].iter().position(|&m| m == 1) {
            if first > 0 {
                out.push(Prompt {
                    ids: data.ids.get(i)[..first].to_vec(),
                    source: data.locate(i),
                });
            }
        }
    }
    Ok(out)
}

/// Checks a prompt set against the target before decoding: not empty, no empty prompt, every
/// token in the vocabulary, and prompt + `max_new` + one block within the target's context.
pub(crate) fn check_prompts(
    prompts: &[Prompt],
    target: &TargetConfig,
    max_new: usize,
    block_size: usize,
    what: &str,
) -> Result<()> {
    if prompts.is_empty() {
        bail!("{what}: no prompts (nothing to evaluate)");
    }
    let context = target.max_position_embeddings.max(0) as usize;
    for p in prompts {
        if p.ids.is_empty() {
            bail!("{}: the prompt is empty", p.source);
        }
        if let Some(&t) = p.ids.iter().find(|&&t| t as i64 >= target.vocab_size) {
            bail!(
                "{}: token id {t} is outside the target's vocabulary ({} tokens)",
                p.source,
                target.vocab_size
            );
        }
        let need = p.ids.len() + max_new + block_size;
        if context > 0 && need > context {
            bail!(
                "{}: the prompt has {} tokens; with {max_new} new tokens and one block of {block_size} that is {need} positions, more than the target's context of {context} (max_position_embeddings)",
                p.source,
                p.ids.len()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's tokenizer as the set-up fetches it (`make setup`).
    const QWEN3: &str = "assets/bench/qwen3-tokenizer";

    #[test]
    fn a_lines_tools_reach_the_template() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prompts.jsonl");
        let tool = r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}"#;
        let user = r#"[{"role": "user", "content": "Weather in Paris?"}]"#;
        let lines = [
            format!(r#"{{"tools": [{tool}], "messages": {user}}}"#),
            format!(r#"{{"messages": {user}}}"#),
            format!(r#"{{"tools": {tool}, "messages": {user}}}"#),
        ];
        std::fs::write(&path, lines[..2].join("\n")).unwrap();
        let prompts = prompts_from_file(&path, Path::new(QWEN3), 10).unwrap();
        let tok = TextTokenizer::from_model_dir(Path::new(QWEN3)).unwrap();
        let text: Vec<String> = prompts
            .iter()
            .map(|p| tok.decode(&p.ids).unwrap())
            .collect();
        assert!(text[0].contains("# Tools") && text[0].contains("get_weather"));
        assert!(!text[1].contains("# Tools"));
        // The same conversation after the tools block.
        assert!(text[0].ends_with(&text[1][text[1].find("<|im_start|>user").unwrap()..]));

        std::fs::write(&path, lines.join("\n")).unwrap();
        let err = prompts_from_file(&path, Path::new(QWEN3), 10).unwrap_err();
        assert!(format!("{err:#}").contains("line 3: bad tools"), "{err:#}");
    }
}
