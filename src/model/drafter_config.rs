//! The DFlash drafter's `config.json` (dflash spec §6), as the public implementations read it.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::config::TargetConfig;
use super::drafter_layout::{self, LayerType};
use super::rope_scaling::{RopeScaling, RopeSettings};

/// The most decoder layers a drafter has (`model.drafter_layers`, a drafter's config.json).
pub(crate) const MAX_DRAFTER_LAYERS: i64 = 64;
/// The longest drafted block (`model.block_size`, a drafter's config.json).
pub(crate) const MAX_BLOCK_SIZE: i64 = 64;

/// `dflash_config` inside config.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DFlashSection {
    pub mask_token_id: i64,
    pub target_layer_ids: Vec<usize>,
}

/// A drafter's configuration. Dimensions are the target's (spec §1). Written with the keys of
/// spec §6 (`rope_theta`, `rope_scaling` where not default, `torch_dtype`), which transformers 4
/// and 5 both read alike; read from either version's keys ([`DrafterConfig::from_json`]).
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
    /// Per layer, full or sliding-window attention (see [`drafter_layout`]); absent: all full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<LayerType>>,
    /// Whether `sliding_window` counts (transformers drops it otherwise).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub use_sliding_window: bool,
    /// The window of the sliding layers, set exactly where `use_sliding_window` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<i64>,
}

/// The spec's default tapped layers: K == 1 -> [T / 2]; else
/// `round(1 + i * (T - 4) / (K - 1))` with round-half-to-even, as Python's `round`. Where that
/// repeats a layer (T < K + 3), the K taps are spread as evenly over layers 1..=T-2, or failing
/// that over every layer; a target with fewer layers than taps is refused.
pub fn default_target_layer_ids(num_target_layers: i64, k: usize) -> Result<Vec<usize>> {
    let t = num_target_layers;
    if k == 0 || t < k as i64 {
        bail!(
            "the target has {t} layers and {k} taps were asked for: a drafter taps 1 to {t} distinct layers; set fewer taps (--num-taps / model.num_taps) or list them (--target-layer-ids / model.target_layer_ids)"
        );
    }
    if k == 1 {
        return Ok(vec![(t / 2) as usize]);
    }
    let spread = |first: i64, last: i64| -> Vec<usize> {
        (0..k)
            .map(|i| {
                let x = first as f64 + i as f64 * (last - first) as f64 / (k - 1) as f64;
                x.round_ties_even().max(0.0) as usize
            })
            .collect()
    };
    let distinct = |ids: &Vec<usize>| ids.windows(2).all(|w| w[0] < w[1]);
    // the spec's span is 1..=T-3; narrower targets fall back to 1..=T-2, then 0..=T-1
    [spread(1, t - 3), spread(1, t - 2), spread(0, t - 1)]
        .into_iter()
        .find(distinct)
        .with_context(|| format!("no {k} distinct layers of {t} found"))
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
        if added < 0 || layers + added > MAX_DRAFTER_LAYERS {
            bail!(
                "model.drafter_added_layers = {added}: the drafter has {layers} layers, and a drafter has 1 to {MAX_DRAFTER_LAYERS}"
            );
        }
        // the new layers attend as the last one does
        let layer_types = self.layer_types.as_ref().map(|types| {
            let last = types.last().copied().unwrap_or(LayerType::FullAttention);
            let mut grown = types.clone();
            grown.resize((layers + added) as usize, last);
            grown
        });
        Ok(DrafterConfig {
            num_hidden_layers: layers + added,
            layer_types,
            ..self.clone()
        })
    }

    /// This configuration with sliding-window layers of `window` positions, except the layers
    /// `full` (indices), which keep full attention: the Qwen3.6-27B drafter's mix is window
    /// 2048 with the last of 5 layers full.
    pub fn with_sliding_window(&self, window: i64, full: &[usize]) -> Result<Self> {
        let layers = self.num_hidden_layers;
        if window < 1 {
            bail!("a sliding window of {window} positions: it must be at least 1");
        }
        if let Some(&bad) = full.iter().find(|&&i| i as i64 >= layers) {
            bail!(
                "full-attention layer {bad}: the drafter has layers 0 to {}",
                layers - 1
            );
        }
        let types = (0..layers as usize)
            .map(|i| match full.contains(&i) {
                true => LayerType::FullAttention,
                false => LayerType::SlidingAttention,
            })
            .collect();
        let config = DrafterConfig {
            layer_types: Some(types),
            use_sliding_window: true,
            sliding_window: Some(window),
            ..self.clone()
        };
        config.validate()?;
        Ok(config)
    }

    /// The window of layer `layer`'s attention, `None` for full attention.
    pub fn layer_window(&self, layer: usize) -> Option<i64> {
        let types = self.layer_types.as_ref()?;
        match types.get(layer)? {
            LayerType::SlidingAttention => self.sliding_window,
            LayerType::FullAttention => None,
        }
    }

    /// Every layer's window ([`DrafterConfig::layer_window`]).
    pub fn layer_windows(&self) -> Vec<Option<i64>> {
        (0..self.num_hidden_layers as usize)
            .map(|l| self.layer_window(l))
            .collect()
    }

    /// The layer mix in words where some layer slides (`4 sliding (window 2048), 1 full`).
    pub fn describe_layers(&self) -> Option<String> {
        drafter_layout::describe(self.layer_types.as_deref(), self.sliding_window)
    }

    /// A drafter for `target` with the target's dimensions.
    pub fn for_target(target: &TargetConfig, shape: &DrafterShape) -> Result<Self> {
        let ids = match &shape.target_layer_ids {
            Some(ids) => ids.clone(),
            None => default_target_layer_ids(target.num_hidden_layers, shape.num_taps)?,
        };
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
            intermediate_size: target.drafter_intermediate_size(),
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
            layer_types: None,
            use_sliding_window: false,
            sliding_window: None,
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
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        let config = Self::from_json(value)
            .with_context(|| format!("{}: not a DFlash drafter config", path.display()))?;
        config
            .validate()
            .with_context(|| format!("{}: invalid drafter config", path.display()))?;
        Ok(config)
    }

    /// From the JSON of a config.json as transformers 4 (`rope_theta`, `rope_scaling`,
    /// `torch_dtype`) or 5 (`rope_parameters`, `dtype`) writes it; where both forms are present
    /// they must agree.
    pub(crate) fn from_json(value: Value) -> Result<Self> {
        let Value::Object(mut map) = value else {
            bail!("not a JSON object");
        };
        let rope = RopeSettings::from_config(&map).map_err(|e| anyhow!(e))?;
        drafter_layout::normalise(&mut map)?;
        map.remove("rope_parameters");
        map.insert("rope_theta".into(), json!(rope.theta));
        map.insert("rope_scaling".into(), rope.scaling.to_json());
        if let Some(dtype) = map.remove("dtype").filter(|v| !v.is_null()) {
            match map.get("torch_dtype").filter(|v| !v.is_null()) {
                Some(old) if *old != dtype => {
                    bail!("fields dtype = {dtype} and torch_dtype = {old} disagree: keep one")
                }
                _ => {
                    map.insert("torch_dtype".into(), dtype);
                }
            }
        }
        Ok(serde_json::from_value(Value::Object(map))?)
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
            intermediate_size: Some(self.intermediate_size),
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
            hybrid: None,
            moe: None,
        }
    }

    fn validate(&self) -> Result<()> {
        if !self.architectures.iter().any(|a| a == "DFlashDraftModel") {
            bail!(
                "field architectures = {:?} does not name DFlashDraftModel",
                self.architectures
            );
        }
        for (name, value, lo, hi) in self.sizes() {
            if !(lo..=hi).contains(&value) {
                bail!("field {name} = {value} is out of range (must be between {lo} and {hi})");
            }
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
        if ids.is_empty() || ids.len() as i64 > self.num_target_layers {
            bail!(
                "field dflash_config.target_layer_ids lists {} layers (must list 1 to num_target_layers = {})",
                ids.len(),
                self.num_target_layers
            );
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as i64 >= self.num_target_layers) {
            bail!(
                "field dflash_config.target_layer_ids contains {bad}, but the target has {} layers (num_target_layers)",
                self.num_target_layers
            );
        }
        drafter_layout::validate(
            self.layer_types.as_deref(),
            self.use_sliding_window,
            self.sliding_window,
            self.num_hidden_layers,
        )
    }

    /// The sizes with their bounds (field, value, least, most): far beyond any published model
    /// (hidden 16384, vocabularies of 262144, 128 target layers) but finite, so that a
    /// config.json asking for 10^9 layers is refused by name, not read until memory runs out.
    fn sizes(&self) -> [(&'static str, i64, i64, i64); 9] {
        [
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                1,
                MAX_DRAFTER_LAYERS,
            ),
            ("block_size", self.block_size, 2, MAX_BLOCK_SIZE),
            ("hidden_size", self.hidden_size, 1, 65_536),
            ("intermediate_size", self.intermediate_size, 1, 262_144),
            ("num_attention_heads", self.num_attention_heads, 1, 1024),
            ("num_key_value_heads", self.num_key_value_heads, 1, 1024),
            ("head_dim", self.head_dim, 2, 1024),
            ("vocab_size", self.vocab_size, 1, 4_194_304),
            ("num_target_layers", self.num_target_layers, 1, 1024),
        ]
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
        let ids = |t, k| default_target_layer_ids(t, k).unwrap();
        assert_eq!(ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(ids(32, 5), vec![1, 8, 15, 22, 29]);
        // 7.5 -> 8 and 20.5 -> 20: round half to even
        assert_eq!(ids(30, 5), vec![1, 8, 14, 20, 27]);
        assert_eq!(ids(30, 1), vec![15]);
    }

    #[test]
    fn default_layer_ids_spread_over_deep_hybrid_targets() {
        let ids = |t, k| default_target_layer_ids(t, k).unwrap();
        // Qwen3.5 / 3.6-27B (64 layers): SpecForge's and z-lab's drafters tap these
        assert_eq!(ids(64, 5), vec![1, 16, 31, 46, 61]);
        // Qwen3.5-4B / 9B (32 layers), Qwen3.5-35B-A3B (40), Qwen3.5-122B-A10B (48)
        assert_eq!(ids(32, 5), vec![1, 8, 15, 22, 29]);
        assert_eq!(ids(40, 5), vec![1, 10, 19, 28, 37]);
        assert_eq!(ids(48, 5), vec![1, 12, 23, 34, 45]);
        assert_eq!(ids(64, 1), vec![32]);
        assert_eq!(ids(64, 2), vec![1, 61]);
    }

    #[test]
    fn a_drafter_takes_the_targets_rope_theta() {
        // a Qwen3.5-shaped text config (rope_theta 1e7); the hybrid layers are the target's own
        let target = TargetConfig::from_json(&json!({"model_type": "qwen3", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_theta": 10_000_000.0, "vocab_size": 300, "max_position_embeddings": 262144,
            "tie_word_embeddings": false}))
        .unwrap();
        let shape = DrafterShape {
            mask_token_id: 270,
            ..DrafterShape::default()
        };
        let config = DrafterConfig::for_target(&target, &shape).unwrap();
        assert_eq!(config.rope_theta, 1e7);
        assert_eq!(config.target_layer_ids(), &[1, 2, 3, 4, 5]);
        let mixed = config.with_sliding_window(2048, &[4]).unwrap();
        assert_eq!(
            mixed.layer_windows(),
            vec![Some(2048), Some(2048), Some(2048), Some(2048), None]
        );
        let written = serde_json::to_value(&mixed).unwrap();
        assert_eq!(written["rope_theta"], 1e7);
        assert_eq!(DrafterConfig::from_json(written).unwrap(), mixed);
    }

    #[test]
    fn default_layer_ids_are_distinct_for_shallow_targets_or_refused() {
        let ids = |t, k| default_target_layer_ids(t, k).unwrap();
        // the spec's formula where it gives distinct layers
        assert_eq!(ids(8, 5), vec![1, 2, 3, 4, 5]);
        // 4 layers, 3 taps: the formula gives [1, 1, 1]
        assert_eq!(ids(4, 3), vec![0, 2, 3]);
        assert_eq!(ids(4, 2), vec![1, 2]);
        assert_eq!(ids(5, 5), vec![0, 1, 2, 3, 4]);
        assert_eq!(ids(6, 5), vec![0, 1, 2, 4, 5]);
        for t in 1..=40 {
            for k in 1..=t.min(16) as usize {
                let got = ids(t, k);
                assert_eq!(got.len(), k, "{t} {k}");
                assert!(got.windows(2).all(|w| w[0] < w[1]), "{t} {k}: {got:?}");
                assert!(*got.last().unwrap() < t as usize, "{t} {k}: {got:?}");
            }
        }
        let e = format!("{:#}", default_target_layer_ids(4, 5).unwrap_err());
        assert!(
            e.contains("the target has 4 layers and 5 taps were asked for")
                && e.contains("--num-taps / model.num_taps")
                && e.contains("model.target_layer_ids"),
            "{e}"
        );
        assert!(default_target_layer_ids(4, 0).is_err());
    }

    fn public_config() -> Value {
        json!({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
            "num_target_layers": 36, "num_hidden_layers": 5, "hidden_size": 4096,
            "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "attention_bias": false, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000, "max_position_embeddings": 40960, "vocab_size": 151936,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16"})
    }

    #[test]
    fn sizes_beyond_their_bounds_are_refused_by_name() {
        assert!(DrafterConfig::from_json(public_config())
            .unwrap()
            .validate()
            .is_ok());
        for (field, value, range) in [
            ("num_hidden_layers", 1_000_000_000i64, "between 1 and 64"),
            ("num_hidden_layers", 0, "between 1 and 64"),
            ("block_size", 65, "between 2 and 64"),
            ("hidden_size", 1 << 20, "between 1 and 65536"),
            ("intermediate_size", 1 << 30, "between 1 and 262144"),
            ("num_attention_heads", 4096, "between 1 and 1024"),
            ("head_dim", 1 << 16, "between 2 and 1024"),
            ("vocab_size", 1 << 40, "between 1 and 4194304"),
            ("num_target_layers", 1 << 20, "between 1 and 1024"),
        ] {
            let mut json = public_config();
            json[field] = value.into();
            let e = format!(
                "{:#}",
                DrafterConfig::from_json(json)
                    .unwrap()
                    .validate()
                    .unwrap_err()
            );
            assert_eq!(
                e,
                format!("field {field} = {value} is out of range (must be {range})")
            );
        }
        let mut json = public_config();
        json["dflash_config"]["target_layer_ids"] = json!(vec![1; 40]);
        let e = format!(
            "{:#}",
            DrafterConfig::from_json(json)
                .unwrap()
                .validate()
                .unwrap_err()
        );
        assert!(e.contains("lists 40 layers"), "{e}");
    }

    #[test]
    fn transformers_5_drafter_configs_read_as_the_spec_writes_them() {
        let v4 = DrafterConfig::from_json(public_config()).unwrap();
        assert_eq!(v4.rope_theta, 1e6);
        let mut v5 = public_config();
        let map = v5.as_object_mut().unwrap();
        map.remove("rope_theta");
        map.remove("torch_dtype");
        map.insert(
            "rope_parameters".into(),
            json!({"rope_type": "default", "rope_theta": 1e6}),
        );
        map.insert("dtype".into(), json!("bfloat16"));
        assert_eq!(DrafterConfig::from_json(v5).unwrap(), v4);
        // written back with the spec's keys only
        let written = serde_json::to_value(&v4).unwrap();
        let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&written), keys(&public_config()));
        assert_eq!(written["rope_theta"], 1e6);
        let mut both = public_config();
        both["dtype"] = json!("float32");
        let e = format!("{:#}", DrafterConfig::from_json(both).unwrap_err());
        assert!(
            e.contains("dtype = \"float32\" and torch_dtype = \"bfloat16\" disagree"),
            "{e}"
        );
        let mut both = public_config();
        both["rope_parameters"] = json!({"rope_theta": 10000.0});
        let e = format!("{:#}", DrafterConfig::from_json(both).unwrap_err());
        assert!(
            e.contains("rope_parameters.rope_theta = 10000 and rope_theta = 1000000 disagree"),
            "{e}"
        );
    }
}
