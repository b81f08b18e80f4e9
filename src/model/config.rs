//! Hugging Face `config.json` of a target model.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use super::rope_scaling::RopeScaling;

/// The architecture families the target implementation covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral-style and SmolLM models (`model_type` "llama" or "mistral").
    Llama,
    /// Qwen2 / Qwen2.5: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on queries and keys ("QK-norm") before RoPE.
    Qwen3,
}

impl Family {
    /// Whether q/k/v projections carry biases.
    pub(crate) fn qkv_bias(self, config_attention_bias: bool) -> bool {
        match self {
            Family::Qwen2 => true,
            Family::Llama | Family::Qwen3 => config_attention_bias,
        }
    }

    pub(crate) fn qk_norm(self) -> bool {
        self == Family::Qwen3
    }
}

/// A token id or a list of them, as `eos_token_id` may be either.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_rms_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> i64 {
    2048
}

/// The fields of `config.json` the target needs; unknown fields are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct TargetConfig {
    pub model_type: String,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    #[serde(default)]
    pub head_dim: Option<i64>,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    pub vocab_size: i64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: i64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub rope_scaling: RopeScaling,
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
}

impl TargetConfig {
    /// Reads `DIR/config.json`, naming the file and field on every error.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("{}: model folder not found", dir.display());
        }
        let path = dir.join("config.json");
        if !path.is_file() {
            bail!(
                "{}: not found; a model folder needs a Hugging Face config.json",
                path.display()
            );
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read", path.display()))?;
        let config: TargetConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a usable model config", path.display()))?;
        config
            .validate()
            .with_context(|| format!("{}: invalid model config", path.display()))?;
        Ok(config)
    }

    pub fn family(&self) -> Result<Family> {
        match self.model_type.as_str() {
            "llama" | "mistral" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            other => bail!(
                "field model_type = {other:?} is not a supported architecture (supported: llama, mistral, qwen2, qwen3)"
            ),
        }
    }

    pub fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    fn validate(&self) -> Result<()> {
        self.family()?;
        for (name, value) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
        ] {
            if value <= 0 {
                bail!("field {name} must be positive, found {value}");
            }
        }
        let kv = self.kv_heads();
        if kv <= 0 || self.num_attention_heads % kv != 0 {
            bail!(
                "field num_key_value_heads = {kv} must divide num_attention_heads = {}",
                self.num_attention_heads
            );
        }
        if self.head_dim() <= 0 || self.head_dim() % 2 != 0 {
            bail!(
                "head_dim must be a positive even number, found {}",
                self.head_dim()
            );
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                bail!("field hidden_act = {act:?} is not supported (only \"silu\")");
            }
        }
        Ok(())
    }
}
