//! Generation with the target: plain greedy decoding (the reference), batched generation with
//! left-padded batches, and continuous batching over cache slots (both for `regenerate`); the
//! token choice they share, and the tokens that end an answer.

mod batched;
mod continuous;
mod greedy;
mod sampling;

pub use batched::{generate_all, generate_batch, BatchLimits, Prompt};
pub use continuous::{
    ContinuousGenerator, ContinuousLimits, ContinuousStats, Next, Request, TraceWindow,
};
pub use greedy::greedy_generate;
pub use sampling::Sampling;

use std::path::Path;

use anyhow::{Context, Result};

use super::config::TargetConfig;

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

/// What one prompt produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The new tokens, ending with the EOS token when `eos` is true.
    pub tokens: Vec<u32>,
    /// Stopped at an EOS token (otherwise at `max_new`).
    pub eos: bool,
}
