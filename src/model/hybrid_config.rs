//! The settings of the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid targets beyond a decoder's: which
//! layers are Gated DeltaNet (linear attention) and which gated full attention, the Gated
//! DeltaNet shape, the partial rotary embedding. Read from transformers 5.23's
//! `Qwen3_5TextConfig` and `Qwen3NextConfig` fields.

use anyhow::{bail, Result};
use serde_json::{Map, Value};

/// What mixes the tokens of one hybrid layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// `full_attention`: gated softmax attention over the KV cache.
    FullAttention,
    /// `linear_attention`: a Gated DeltaNet layer with a conv and a recurrent state.
    LinearAttention,
}

/// How a checkpoint stores a Gated DeltaNet layer's input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdnLayout {
    /// Qwen3.5 / 3.6: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key head.
    PerKeyHead,
}

/// The shape of the Gated DeltaNet layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    pub key_heads: i64,
    pub value_heads: i64,
    pub key_dim: i64,
    pub value_dim: i64,
    /// Width of the depthwise causal convolution over q, k, v.
    pub conv_kernel: i64,
}

impl GdnShape {
    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> i64 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// The hybrid-specific settings of a target config.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridSettings {
    pub layers: Vec<LayerKind>,
    pub gdn: GdnShape,
    pub layout: GdnLayout,
    /// The fraction of each attention head the rotary embedding covers.
    pub partial_rotary_factor: f64,
}

/// The `model_type`s of the hybrid family.
pub(crate) const HYBRID_TYPES: [&str; 5] = [
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
];

impl HybridSettings {
    /// From the text settings of a hybrid config (`partial_rotary_factor` as the rotary
    /// settings read it). Refuses, in one line naming the field, what is not implemented:
    /// unknown layer types, key heads that do not divide the value heads. (The MLPs, dense or
    /// experts, are read by [`super::moe::MoeSettings`].)
    pub(crate) fn from_config(c: &Map<String, Value>, partial_rotary_factor: f64) -> Result<Self> {
        let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
        let int = |key: &str, default: i64| -> Result<i64> {
            match c.get(key).filter(|v| !v.is_null()) {
                None => Ok(default),
                Some(v) => match v.as_i64() {
                    Some(n) if n > 0 => Ok(n),
                    _ => bail!("field {key} must be a positive integer, found {v}"),
                },
            }
        };
        let layers = int("num_hidden_layers", 0)?;
        let gdn = GdnShape {
            key_heads: int("linear_num_key_heads", 16)?,
            value_heads: int("linear_num_value_heads", 32)?,
            key_dim: int("linear_key_head_dim", 128)?,
            value_dim: int("linear_value_head_dim", 128)?,
            conv_kernel: int("linear_conv_kernel_dim", 4)?,
        };
        if gdn.value_heads % gdn.key_heads != 0 {
            bail!(
                "field linear_num_key_heads = {} must divide linear_num_value_heads = {}",
                gdn.key_heads,
                gdn.value_heads
            );
        }
        let layout = if model_type == "qwen3_next" {
            GdnLayout::PerKeyHead
        } else {
            GdnLayout::Split
        };
        Ok(HybridSettings {
            layers: layer_kinds(c, layers, int("full_attention_interval", 4)?)?,
            gdn,
            layout,
            partial_rotary_factor,
        })
    }

    /// The number of rotary dimensions of a head of `head_dim` (transformers truncates).
    pub fn rotary_dim(&self, head_dim: i64) -> i64 {
        (head_dim as f64 * self.partial_rotary_factor) as i64
    }

    /// "3 linear_attention + 1 full_attention" style summary, for messages and the control room.
    pub fn layer_mix(&self) -> String {
        let linear = self
            .layers
            .iter()
            .filter(|k| **k == LayerKind::LinearAttention)
            .count();
        format!(
            "{linear} Gated DeltaNet + {} gated attention layers",
            self.layers.len() - linear
        )
    }
}

/// `layer_types`, or every `interval`-th layer full attention and the others linear (as
/// transformers fills it in).
fn layer_kinds(c: &Map<String, Value>, layers: i64, interval: i64) -> Result<Vec<LayerKind>> {
    let Some(types) = c.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok((0..layers)
            .map(|i| match (i + 1) % interval {
                0 => LayerKind::FullAttention,
                _ => LayerKind::LinearAttention,
            })
            .collect());
    };
    let Some(types) = types.as_array() else {
        bail!("field layer_types must be a list, found {types}");
    };
    if types.len() as i64 != layers {
        bail!(
            "field layer_types has {} entries but num_hidden_layers = {layers}",
            types.len()
        );
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("full_attention") => Ok(LayerKind::FullAttention),
            Some("linear_attention") => Ok(LayerKind::LinearAttention),
            _ => bail!(
                "field layer_types[{i}] = {t} is not supported (full_attention or linear_attention)"
            ),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn settings(v: Value) -> Result<HybridSettings> {
        HybridSettings::from_config(v.as_object().unwrap(), 0.25)
    }

    #[test]
    fn layer_types_or_the_interval_give_the_mix() {
        let s = settings(json!({"model_type": "qwen3_5_text", "num_hidden_layers": 8})).unwrap();
        use LayerKind::*;
        let pattern = [
            LinearAttention,
            LinearAttention,
            LinearAttention,
            FullAttention,
        ];
        assert_eq!(s.layers, [pattern, pattern].concat());
        assert_eq!(s.layer_mix(), "6 Gated DeltaNet + 2 gated attention layers");
        assert_eq!(
            (s.gdn.conv_dim(), s.layout),
            (2 * 16 * 128 + 32 * 128, GdnLayout::Split)
        );
        assert_eq!(s.rotary_dim(256), 64);
        let s = settings(json!({"model_type": "qwen3_next", "num_hidden_layers": 2,
            "full_attention_interval": 2}))
        .unwrap();
        assert_eq!(
            (s.layers[1], s.layout),
            (FullAttention, GdnLayout::PerKeyHead)
        );
        let listed = json!({"model_type": "qwen3_5_text", "num_hidden_layers": 2,
            "layer_types": ["full_attention", "linear_attention"]});
        assert_eq!(
            settings(listed).unwrap().layers,
            [FullAttention, LinearAttention]
        );
    }

    #[test]
    fn what_is_not_implemented_is_refused_in_one_line() {
        for (config, says) in [
            (
                json!({"model_type": "qwen3_5_text", "num_hidden_layers": 2,
                    "layer_types": ["full_attention", "sliding_attention"]}),
                "field layer_types[1] = \"sliding_attention\" is not supported",
            ),
            (
                json!({"model_type": "qwen3_5_text", "num_hidden_layers": 3,
                    "layer_types": ["full_attention"]}),
                "field layer_types has 1 entries but num_hidden_layers = 3",
            ),
            (
                json!({"model_type": "qwen3_5_text", "num_hidden_layers": 2,
                    "linear_num_key_heads": 3, "linear_num_value_heads": 4}),
                "field linear_num_key_heads = 3 must divide linear_num_value_heads = 4",
            ),
        ] {
            let e = format!("{:#}", settings(config.clone()).unwrap_err());
            assert!(e.contains(says) && !e.contains('\n'), "{config}: {e}");
        }
    }
}
