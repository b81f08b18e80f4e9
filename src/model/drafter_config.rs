//! The DFlash drafter's `config.json` (dflash spec §6), as the public implementations read it.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::config::TargetConfig;
use super::rope_scaling::RopeScaling;

/// `dflash_config` inside config.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DFlashSection {
    pub mask_token_id: i64,
    pub target_layer_ids: Vec<usize>,
}

/// A drafter's configuration. Dimensions are the target's (spec §1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterConfig {
    pub architectures: Vec<String>,
    pub model_type: String,
    pub block_size: i64,
    pub dflash_config: DFlashSection,
    pub num_target_layers: i64,
    pub num_hidden_layers: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub hidden_act: String,
    pub attention_bias: bool,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default, skip_serializing_if = "RopeScaling::is_default")]
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: i64,
    pub vocab_size: i64,
    pub tie_word_embeddings: bool,
    pub torch_dtype: String,
}

/// The spec's default tapped layers: K == 1 -> [T / 2]; else
/// `round(1 + i * (T - 4) / (K - 1))` with round-half-to-even, as Python's `round`.
pub fn default_target_layer_ids(num_target_layers: i64, k: usize) -> Vec<usize> {
    if k == 1 {
        return vec![(num_target_layers / 2) as usize];
    }
    (0..k)
        .map(|i| {
            let x = 1.0 + i as f64 * (num_target_layers - 4) as f64 / (k - 1) as f64;
            x.round_ties_even().max(0.0) as usize
        })
        .collect()
}

/// Choices for a new drafter.
#[derive(Debug, Clone)]
pub struct DrafterShape {
    pub layers: i64,
    pub block_size: i64,
    pub mask_token_id: i64,
    /// Explicit tapped layers; `None` takes the spec's default for `num_taps` layers.
    pub target_layer_ids: Option<Vec<usize>>,
    pub num_taps: usize,
}

impl Default for DrafterShape {
    fn default() -> Self {
        DrafterShape {
            layers: 5,
            block_size: 16,
            mask_token_id: 0,
            target_layer_ids: None,
            num_taps: 5,
        }
    }
}

impl DrafterConfig {
    /// This configuration with `added` decoder layers more (`model.drafter_added_layers`);
    /// refused where the total leaves 1..=64.
    pub(crate) fn with_added_layers(&self, added: i64) -> Result<Self> {
        let layers = self.num_hidden_layers;
        if added < 0 || layers + added > 64 {
            bail!(
                "model.drafter_added_layers = {added}: the drafter has {layers} layers, and a drafter has 1 to 64"
            );
        }
        Ok(DrafterConfig {
            num_hidden_layers: layers + added,
            ..self.clone()
        })
    }

    /// A drafter for `target` with the target's dimensions.
    pub fn for_target(target: &TargetConfig, shape: &DrafterShape) -> Result<Self> {
        let ids = shape
            .target_layer_ids
            .clone()
            .unwrap_or_else(|| default_target_layer_ids(target.num_hidden_layers, shape.num_taps));
        let config = DrafterConfig {
            architectures: vec!["DFlashDraftModel".into()],
            model_type: "qwen3".into(),
            block_size: shape.block_size,
            dflash_config: DFlashSection {
                mask_token_id: shape.mask_token_id,
                target_layer_ids: ids,
            },
            num_target_layers: target.num_hidden_layers,
            num_hidden_layers: shape.layers,
            hidden_size: target.hidden_size,
            intermediate_size: target.intermediate_size,
            num_attention_heads: target.num_attention_heads,
            num_key_value_heads: target.kv_heads(),
            head_dim: target.head_dim(),
            hidden_act: "silu".into(),
            attention_bias: false,
            rms_norm_eps: target.rms_norm_eps,
            rope_theta: target.rope_theta,
            rope_scaling: target.rope_scaling,
            max_position_embeddings: target.max_position_embeddings,
            vocab_size: target.vocab_size,
            tie_word_embeddings: false,
            torch_dtype: "bfloat16".into(),
        };
        config.validate()?;
        config.check_against(target)?;
        Ok(config)
    }

    /// Reads `DIR/config.json`.
    pub(crate) fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.is_file() {
            bail!(
                "{}: not found; a drafter folder needs config.json",
                path.display()
            );
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read", path.display()))?;
        let config: DrafterConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a DFlash drafter config", path.display()))?;
        config
            .validate()
            .with_context(|| format!("{}: invalid drafter config", path.display()))?;
        Ok(config)
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let value = serde_json::to_value(self)?;
        crate::fsutil::write_json(path, &value)
    }

    pub fn num_taps(&self) -> usize {
        self.dflash_config.target_layer_ids.len()
    }

    pub fn mask_token_id(&self) -> i64 {
        self.dflash_config.mask_token_id
    }

    pub fn target_layer_ids(&self) -> &[usize] {
        &self.dflash_config.target_layer_ids
    }

    /// The rotary / norm settings in target-config form (the layers module builds from it).
    pub(crate) fn as_rope_config(&self) -> TargetConfig {
        TargetConfig {
            model_type: "qwen3".into(),
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: Some(self.num_key_value_heads),
            head_dim: Some(self.head_dim),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            vocab_size: self.vocab_size,
            tie_word_embeddings: false,
            max_position_embeddings: self.max_position_embeddings,
            attention_bias: false,
            hidden_act: Some(self.hidden_act.clone()),
            rope_scaling: self.rope_scaling,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    fn validate(&self) -> Result<()> {
        if !self.architectures.iter().any(|a| a == "DFlashDraftModel") {
            bail!(
                "field architectures = {:?} does not name DFlashDraftModel",
                self.architectures
            );
        }
        for (name, value) in [
            ("block_size", self.block_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("num_target_layers", self.num_target_layers),
        ] {
            if value <= 0 {
                bail!("field {name} must be positive, found {value}");
            }
        }
        if self.block_size < 2 {
            bail!(
                "field block_size must be at least 2, found {}",
                self.block_size
            );
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!(
                "field num_key_value_heads = {} must divide num_attention_heads = {}",
                self.num_key_value_heads,
                self.num_attention_heads
            );
        }
        if self.head_dim % 2 != 0 {
            bail!("field head_dim must be even, found {}", self.head_dim);
        }
        if self.hidden_act != "silu" {
            bail!(
                "field hidden_act = {:?} is not supported (only \"silu\")",
                self.hidden_act
            );
        }
        let mask = self.dflash_config.mask_token_id;
        if mask < 0 || mask >= self.vocab_size {
            bail!(
                "field dflash_config.mask_token_id = {mask} is outside the vocabulary (0..{})",
                self.vocab_size
            );
        }
        let ids = &self.dflash_config.target_layer_ids;
        if ids.is_empty() {
            bail!("field dflash_config.target_layer_ids is empty");
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as i64 >= self.num_target_layers) {
            bail!(
                "field dflash_config.target_layer_ids contains {bad}, but the target has {} layers (num_target_layers)",
                self.num_target_layers
            );
        }
        Ok(())
    }

    /// The drafter must have the target's dimensions and vocabulary.
    pub(crate) fn check_against(&self, target: &TargetConfig) -> Result<()> {
        for (name, drafter, target) in [
            ("hidden_size", self.hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
            (
                "num_target_layers",
                self.num_target_layers,
                target.num_hidden_layers,
            ),
        ] {
            if drafter != target {
                bail!("field {name} = {drafter} differs from the target's {target}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_layer_ids_follow_the_spec_examples() {
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(32, 5), vec![1, 8, 15, 22, 29]);
        // 7.5 -> 8 and 20.5 -> 20: round half to even
        assert_eq!(default_target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
        assert_eq!(default_target_layer_ids(30, 1), vec![15]);
    }
}
