//! Hugging Face `config.json` of a target model.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

use super::config_checks::{check_computation_fields, text_settings};
use super::hybrid_config::{HybridSettings, HYBRID_TYPES};
use super::moe::{MoeFamily, MoeSettings};
use super::rope_scaling::{RopeScaling, RopeSettings, DEFAULT_THETA};

/// The architecture families the target implementation covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral-style and SmolLM models (`model_type` "llama" or "mistral").
    Llama,
    /// Qwen2 / Qwen2.5: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3 and Qwen3-MoE: per-head RMSNorm on queries and keys ("QK-norm") before RoPE.
    Qwen3,
    /// Qwen3.5 / Qwen3.6, Qwen3.5-MoE and Qwen3-Next: Gated DeltaNet layers between gated
    /// attention layers, zero-centred norms, partial rotary ([`HybridSettings`]).
    Qwen35,
}

impl Family {
    /// Whether q/k/v projections carry biases.
    pub(crate) fn qkv_bias(self, config_attention_bias: bool) -> bool {
        match self {
            Family::Qwen2 => true,
            Family::Llama | Family::Qwen3 | Family::Qwen35 => config_attention_bias,
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
    DEFAULT_THETA
}

fn default_rms_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> i64 {
    2048
}

/// The `model_type`s of the supported families, as messages name them.
pub(crate) const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next";

/// The fields of `config.json` the target needs. Fields that would change the computation and
/// are not implemented are refused by name ([`super::config_checks`]); the others are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct TargetConfig {
    pub model_type: String,
    pub hidden_size: i64,
    /// The dense MLPs' width; a mixture of experts whose every layer is sparse has none
    /// (Qwen3.5-MoE's text config).
    #[serde(default)]
    pub intermediate_size: Option<i64>,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    #[serde(default)]
    pub head_dim: Option<i64>,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// From `rope_parameters.rope_theta` or the older `rope_theta` ([`RopeSettings`]).
    #[serde(skip_deserializing, default = "default_rope_theta")]
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
    /// From `rope_parameters` or the older `rope_scaling` ([`RopeSettings`]).
    #[serde(skip_deserializing)]
    pub rope_scaling: RopeScaling,
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// The hybrid family's layer mix and Gated DeltaNet shape (None for the other families).
    #[serde(skip)]
    pub hybrid: Option<HybridSettings>,
    /// The routed experts of a mixture of experts (None: every MLP dense).
    #[serde(skip)]
    pub(crate) moe: Option<MoeSettings>,
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
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        Self::from_json(&value).map_err(|e| anyhow!("{}: {e:#}", path.display()))
    }

    /// From the JSON of a config.json: a causal LM's, or a multimodal model's whose
    /// `text_config` is of a supported family (its text settings are read from there).
    pub fn from_json(value: &Value) -> Result<Self> {
        let top = value.as_object().context("not a JSON object")?;
        let text = text_settings(top)?;
        check_computation_fields(&text)?;
        let mut config: TargetConfig = serde_json::from_value(Value::Object(text.clone()))
            .context("not a usable model config")?;
        let rope = if HYBRID_TYPES.contains(&config.model_type.as_str()) {
            let (rope, partial) =
                RopeSettings::from_config_partial(&text).map_err(|e| anyhow!(e))?;
            config.hybrid = Some(HybridSettings::from_config(&text, partial)?);
            rope
        } else {
            RopeSettings::from_config(&text).map_err(|e| anyhow!(e))?
        };
        config.moe = moe_settings(&text, config.num_hidden_layers)?;
        config.rope_theta = rope.theta;
        config.rope_scaling = rope.scaling;
        if config.model_type == "mistral" {
            // transformers' Mistral has no attention biases and ignores the field
            config.attention_bias = false;
        }
        config.validate().context("invalid model config")?;
        Ok(config)
    }

    pub fn family(&self) -> Result<Family> {
        match self.model_type.as_str() {
            "llama" | "mistral" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" | "qwen3_moe" => Ok(Family::Qwen3),
            "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen3_next" => {
                Ok(Family::Qwen35)
            }
            other => bail!(
                "field model_type = {other:?} is not a supported architecture (supported: {SUPPORTED})"
            ),
        }
    }

    /// Whether layer `l`'s MLP is a sparse block of experts.
    pub fn is_sparse(&self, l: i64) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(l))
    }

    /// The width of layer `l`'s dense MLP (an error naming the field where the config has none).
    pub(crate) fn dense_intermediate_size(&self, l: i64) -> Result<i64> {
        self.intermediate_size.with_context(|| {
            format!("field intermediate_size is missing: layer {l} has a dense MLP")
        })
    }

    /// The SwiGLU width one token runs through in layer `l`: the dense MLP's, or its chosen
    /// experts' and the shared expert's (for counts of active parameters).
    pub fn active_mlp_width(&self, l: i64) -> i64 {
        match &self.moe {
            Some(m) if m.is_sparse(l) => m.active_width(),
            _ => self.intermediate_size.unwrap_or(0),
        }
    }

    /// The MLP width of a drafter for this target: the dense MLPs', or, for a mixture of experts
    /// without one (Qwen3.5-MoE's text config), three times the hidden size: 6144 for 2048, the
    /// width of the published Qwen3.5-35B-A3B DFlash drafter (z-lab's config: hidden 2048,
    /// intermediate 6144, 8 layers; its 905 MiB bf16 file is that shape's 0.47 B parameters),
    /// and the `intermediate_size` Qwen3-30B-A3B / Qwen3-Coder-30B-A3B configs carry.
    pub fn drafter_intermediate_size(&self) -> i64 {
        self.intermediate_size.unwrap_or(3 * self.hidden_size)
    }

    pub fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The dimensions of a head the rotary embedding turns: all of it, or a hybrid's first
    /// `partial_rotary_factor`.
    pub fn rotary_dim(&self) -> i64 {
        match &self.hybrid {
            Some(h) => h.rotary_dim(self.head_dim()),
            None => self.head_dim(),
        }
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    fn validate(&self) -> Result<()> {
        self.family()?;
        if let Some(dense) = (0..self.num_hidden_layers).find(|&l| !self.is_sparse(l)) {
            self.dense_intermediate_size(dense)?;
        }
        for (name, value) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size.unwrap_or(1)),
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
        let rotary = self.rotary_dim();
        if rotary <= 0 || rotary % 2 != 0 {
            bail!(
                "the rotary dimensions (head_dim {} times partial_rotary_factor) must be a positive even number, found {rotary}",
                self.head_dim()
            );
        }
        if let Some(h) = &self.hybrid {
            if h.layers.len() as i64 != self.num_hidden_layers {
                bail!(
                    "field layer_types has {} entries but num_hidden_layers = {}",
                    h.layers.len(),
                    self.num_hidden_layers
                );
            }
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                bail!("field hidden_act = {act:?} is not supported (only \"silu\")");
            }
        }
        Ok(())
    }
}

/// The MoE settings of a config's text settings: for the families of [`MoeFamily`] with
/// experts (`num_experts` > 0, transformers' default where absent); None otherwise.
fn moe_settings(text: &serde_json::Map<String, Value>, layers: i64) -> Result<Option<MoeSettings>> {
    let model_type = text.get("model_type").and_then(Value::as_str).unwrap_or("");
    let Some(family) = MoeFamily::of_model_type(model_type) else {
        return Ok(None);
    };
    if family.num_experts(text)? == 0 {
        return Ok(None);
    }
    MoeSettings::from_text_config(family, text, layers).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama() -> Value {
        json!({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64})
    }

    #[test]
    fn transformers_5_configs_read_like_transformers_4_ones() {
        let mut v5 = llama();
        v5["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6});
        v5["dtype"] = json!("bfloat16");
        let mut v4 = llama();
        v4["rope_theta"] = json!(1e6);
        v4["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        v4["torch_dtype"] = json!("bfloat16");
        for v in [v5, v4] {
            let c = TargetConfig::from_json(&v).unwrap();
            assert_eq!(c.rope_theta, 1e6);
            assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        }
        // a Mistral model has no attention biases, whatever the field says (as in transformers)
        let mut mistral = llama();
        mistral["model_type"] = json!("mistral");
        mistral["attention_bias"] = json!(true);
        assert!(!TargetConfig::from_json(&mistral).unwrap().attention_bias);
    }

    #[test]
    fn refusals_are_one_line_naming_the_field() {
        let mut v = llama();
        v["rope_parameters"] = json!({"rope_type": "longrope", "rope_theta": 1e4});
        let e = format!("{:#}", TargetConfig::from_json(&v).unwrap_err());
        assert_eq!(
            e,
            "rope_parameters.rope_type = \"longrope\" is not supported (default, linear, llama3)"
        );
        let mut v = llama();
        v["mlp_bias"] = json!(true);
        let e = format!("{:#}", TargetConfig::from_json(&v).unwrap_err());
        assert!(
            e.contains("mlp_bias = true is not supported") && !e.contains('\n'),
            "{e}"
        );
        let mut v = llama();
        v["hidden_act"] = json!("gelu");
        let e = format!("{:#}", TargetConfig::from_json(&v).unwrap_err());
        assert!(e.contains("hidden_act = \"gelu\" is not supported"), "{e}");
        let e = format!(
            "{:#}",
            TargetConfig::from_json(&json!({"model_type": "llama"})).unwrap_err()
        );
        assert!(e.contains("missing field"), "{e}");
    }

    #[test]
    fn mixtures_of_experts_are_read_and_dense_layers_need_a_width() {
        let mut v = llama();
        v["model_type"] = json!("qwen3_moe");
        v["num_local_experts"] = json!(8);
        v["num_experts_per_tok"] = json!(2);
        v["moe_intermediate_size"] = json!(16);
        v["mlp_only_layers"] = json!([1]);
        v["output_router_logits"] = json!(false);
        v["router_aux_loss_coef"] = json!(0.001);
        let c = TargetConfig::from_json(&v).unwrap();
        assert_eq!(c.family().unwrap(), Family::Qwen3);
        assert_eq!((c.is_sparse(0), c.is_sparse(1)), (true, false));
        assert_eq!((c.active_mlp_width(0), c.active_mlp_width(1)), (32, 64));
        v.as_object_mut().unwrap().remove("intermediate_size");
        let e = format!("{:#}", TargetConfig::from_json(&v).unwrap_err());
        assert!(
            e.contains("field intermediate_size is missing: layer 1 has a dense MLP"),
            "{e}"
        );
        // every layer sparse: no dense width needed; the drafter takes 3 x hidden
        v["mlp_only_layers"] = json!([]);
        let c = TargetConfig::from_json(&v).unwrap();
        assert_eq!(
            (c.intermediate_size, c.drafter_intermediate_size()),
            (None, 96)
        );
        // Qwen3-Next with experts: the shared expert, transformers' defaults where absent
        let next = json!({"model_type": "qwen3_next", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 64, "head_dim": 8});
        let c = TargetConfig::from_json(&next).unwrap();
        let moe = c.moe.as_ref().expect("512 experts by default");
        assert_eq!(
            (
                moe.num_experts,
                moe.num_experts_per_tok,
                moe.shared_expert_intermediate_size
            ),
            (512, 10, Some(512))
        );
        assert!(moe.norm_topk_prob);
        let mut dense = next.clone();
        dense["num_experts"] = json!(0);
        assert!(TargetConfig::from_json(&dense).unwrap().moe.is_none());
    }
}
