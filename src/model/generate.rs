//! Plain greedy decoding with a KV cache, and the tokens that end an answer.

use std::path::Path;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::config::TargetConfig;
use super::target::{KvCache, TargetModel};

/// The EOS token ids of a model folder: `eos_token_id` (an id or a list) of `config.json` and of
/// `generation_config.json`, and the tokenizer's `eos_token` when the folder has a tokenizer.
pub fn model_eos_ids(dir: &Path, config: &TargetConfig) -> Result<Vec<u32>> {
    let mut ids = config.eos_ids();
    let gen = dir.join("generation_config.json");
    if gen.is_file() {
        let text = std::fs::read_to_string(&gen)
            .with_context(|| format!("{}: cannot read", gen.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", gen.display()))?;
        match value.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => {}
            Some(v) => {
                let list: Vec<u32> = match v {
                    serde_json::Value::Array(_) => serde_json::from_value(v.clone()).ok(),
                    other => serde_json::from_value::<u32>(other.clone())
                        .ok()
                        .map(|i| vec![i]),
                }
                .with_context(|| {
                    format!(
                        "{}: field eos_token_id must be a token id or a list of them, found {v}",
                        gen.display()
                    )
                })?;
                ids.extend(list);
            }
        }
    }
    if dir.join("tokenizer.json").is_file() {
        if let Ok(tok) = crate::text::TextTokenizer::from_model_dir(dir) {
            if let Some(id) = tok.eos_token.as_deref().and_then(|t| tok.token_to_id(t)) {
                ids.push(id);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// The tokens greedy decoding produces after `prompt` (stopping after an `eos_ids` token, which
/// is included, or after `max_new_tokens`).
pub fn greedy_generate(
    model: &TargetModel,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_ids: &[u32],
) -> Vec<u32> {
    let mut out = Vec::with_capacity(max_new_tokens);
    if prompt.is_empty() || max_new_tokens == 0 {
        return out;
    }
    let mut cache = KvCache::new();
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let mut input = Tensor::from_slice(&ids).unsqueeze(0);
    while out.len() < max_new_tokens {
        let logits = model.forward(&input, Some(&mut cache));
        let next = logits
            .select(1, -1)
            .argmax(-1, false)
            .to_kind(Kind::Int64)
            .int64_value(&[0]) as u32;
        out.push(next);
        if eos_ids.contains(&next) {
            break;
        }
        input = Tensor::from_slice(&[next as i64]).unsqueeze(0);
    }
    out
}
