//! The Hugging Face tokenizer of a GGUF model, rebuilt from its `tokenizer.ggml.*` metadata.
//!
//! Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the vocabulary and merges are stored in
//! their byte-level form already. The pre-tokenizer depends on `tokenizer.ggml.pre`; for the
//! SmolLM family it splits digits one at a time, then applies GPT-2 byte-level splitting.

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

use super::reader::GgufFile;

/// llama.cpp token types.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// What the tokenizer files need besides the tokenizer itself.
#[derive(Debug, Clone)]
pub(crate) struct VocabInfo {
    pub tokens: Vec<String>,
    pub special_ids: Vec<u32>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

impl VocabInfo {
    pub(crate) fn token(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }
}

/// Reads the vocabulary metadata and builds the tokenizer.
pub(crate) fn build_tokenizer(gguf: &GgufFile) -> Result<(Tokenizer, VocabInfo)> {
    let path = gguf.path.display();
    let model = gguf.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!(
            "{path}: tokenizer.ggml.model is {model:?}; only byte-level BPE (\"gpt2\") tokenizers can be converted"
        );
    }
    let pre = gguf
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let tokens = gguf.string_array("tokenizer.ggml.tokens")?;
    let merges = gguf.string_array("tokenizer.ggml.merges")?;
    let types = gguf
        .i64_array("tokenizer.ggml.token_type")?
        .unwrap_or_else(|| vec![1; tokens.len()]);
    if types.len() != tokens.len() {
        bail!(
            "{path}: tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
            types.len(),
            tokens.len()
        );
    }

    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        if vocab.insert(token.clone(), id as u32).is_some() {
            bail!("{path}: token {token:?} appears twice in tokenizer.ggml.tokens");
        }
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    anyhow!("{path}: tokenizer.ggml.merges[{i}] = {m:?} is not \"left right\"")
                })
        })
        .collect::<Result<Vec<_>>>()?;

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| anyhow!("{path}: cannot build the BPE model: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(pre)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    let mut special_ids = Vec::new();
    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (id, (token, &ty)) in tokens.iter().zip(&types).enumerate() {
        match ty {
            TOKEN_TYPE_CONTROL => {
                special_ids.push(id as u32);
                special.push(AddedToken::from(token.clone(), true).normalized(false));
            }
            TOKEN_TYPE_USER_DEFINED => {
                user_defined.push(AddedToken::from(token.clone(), false).normalized(false))
            }
            _ => {}
        }
    }
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&user_defined);

    let id = |key: &str| -> Result<Option<u32>> {
        let v = gguf.optional_u64(key)?;
        match v {
            Some(i) if i as usize >= tokens.len() => {
                bail!(
                    "{path}: {key} = {i} is outside the vocabulary of {}",
                    tokens.len()
                )
            }
            _ => Ok(v.map(|i| i as u32)),
        }
    };
    let info = VocabInfo {
        bos_id: id("tokenizer.ggml.bos_token_id")?,
        eos_id: id("tokenizer.ggml.eos_token_id")?,
        pad_id: id("tokenizer.ggml.padding_token_id")?,
        unk_id: id("tokenizer.ggml.unknown_token_id")?,
        add_bos: gguf
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        chat_template: gguf
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        special_ids,
        tokens,
    };
    Ok((tokenizer, info))
}

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` name.
fn pre_tokenizer(pre: &str) -> PreTokenizerWrapper {
    let byte_level = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    match pre {
        // SmolLM / StarCoder style: every digit is its own piece before byte-level splitting.
        "smollm" | "starcoder" | "refact" | "default" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![Digits::new(true).into(), byte_level]))
        }
        _ => byte_level,
    }
}

/// `tokenizer_config.json` in the form `transformers` writes it.
pub(crate) fn tokenizer_config(info: &VocabInfo, model_max_length: u64) -> serde_json::Value {
    let mut added = serde_json::Map::new();
    for &id in &info.special_ids {
        added.insert(
            id.to_string(),
            serde_json::json!({
                "content": info.tokens[id as usize],
                "lstrip": false, "normalized": false, "rstrip": false,
                "single_word": false, "special": true
            }),
        );
    }
    let additional: Vec<&str> = info
        .special_ids
        .iter()
        .map(|&i| info.tokens[i as usize].as_str())
        .filter(|t| {
            Some(*t) != info.token(info.bos_id)
                && Some(*t) != info.token(info.eos_id)
                && Some(*t) != info.token(info.unk_id)
        })
        .collect();
    serde_json::json!({
        "add_bos_token": info.add_bos,
        "add_eos_token": false,
        "added_tokens_decoder": added,
        "additional_special_tokens": additional,
        "bos_token": info.token(info.bos_id),
        "eos_token": info.token(info.eos_id),
        "pad_token": info.token(info.pad_id),
        "unk_token": info.token(info.unk_id),
        "chat_template": info.chat_template,
        "clean_up_tokenization_spaces": false,
        "model_max_length": model_max_length,
        // Not "GPT2Tokenizer": transformers 5 rebuilds that class with GPT-2's own
        // pre-tokenizer and drops the digit splitting of tokenizer.json; the generic fast
        // class loads tokenizer.json as it is, in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": info.tokens.len(),
    })
}

/// Saves the tokenizer as `tokenizer.json`.
pub(crate) fn save_tokenizer(tokenizer: &Tokenizer, path: &std::path::Path) -> Result<()> {
    tokenizer
        .save(path, false)
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("{}: cannot write", path.display()))
}
