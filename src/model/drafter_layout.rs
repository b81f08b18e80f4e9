//! The attention layout of a drafter's layers, as its config.json states it with the keys of
//! transformers' `Qwen3Config`: `layer_types` (`full_attention` or `sliding_attention` per
//! layer), `use_sliding_window` and `sliding_window`. SpecForge's Qwen3.6-27B drafter has four
//! sliding layers of window 2048 and a full last one.
//!
//! A sliding layer is what the public implementations compute (z-lab's `dflash` 0.1.0 and
//! SpecForge's trainer): the query of a block slot at position p sees the keys at positions k
//! with `p - window < k <= p`, its context keys as well as its block's keys. So a sliding layer
//! is causal inside the block, where a full layer sees the whole block. (SpecForge's trainer
//! differs only for a window shorter than the block: it keeps every earlier slot of the block.)

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// transformers' `Qwen3Config` defaults where `use_sliding_window` is true and a key is absent.
const DEFAULT_SLIDING_WINDOW: i64 = 4096;
const DEFAULT_MAX_WINDOW_LAYERS: i64 = 28;

/// The attention of one drafter layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Sees its context and its whole block.
    FullAttention,
    /// Sees the keys of the last `sliding_window` positions up to its own (causal).
    SlidingAttention,
}

impl LayerType {
    fn parse(index: usize, value: &Value) -> Result<Self> {
        match value.as_str() {
            Some("full_attention") => Ok(LayerType::FullAttention),
            Some("sliding_attention") => Ok(LayerType::SlidingAttention),
            _ => bail!(
                "field layer_types[{index}] = {value} is not a drafter layer type (expected \"full_attention\" or \"sliding_attention\")"
            ),
        }
    }
}

/// Rewrites the layout keys of a drafter config.json `map` as [`super::DrafterConfig`] holds
/// them, reading them as transformers does: `sliding_window` counts only where
/// `use_sliding_window` is true (4096 where absent); without `layer_types` the layers from
/// `max_window_layers` on (28 where absent) slide when `use_sliding_window` is true.
/// Afterwards `layer_types` is a list or absent, `use_sliding_window` true or absent, and
/// `sliding_window` is present exactly where `use_sliding_window` is.
pub(crate) fn normalise(map: &mut Map<String, Value>) -> Result<()> {
    let use_window = match map.remove("use_sliding_window") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => bail!("field use_sliding_window = {other} is not true or false"),
    };
    let raw_window = map.remove("sliding_window").filter(|v| !v.is_null());
    let window = match (use_window, raw_window) {
        (false, _) => None,
        (true, None) => Some(DEFAULT_SLIDING_WINDOW),
        (true, Some(v)) => match v.as_i64() {
            Some(w) if w >= 1 => Some(w),
            _ => bail!("field sliding_window = {v} must be a whole number of at least 1"),
        },
    };
    let max_window_layers = map.remove("max_window_layers");
    let types = match map.remove("layer_types").filter(|v| !v.is_null()) {
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .enumerate()
                .map(|(i, v)| LayerType::parse(i, v))
                .collect::<Result<Vec<_>>>()?,
        ),
        Some(other) => bail!("field layer_types = {other} is not a list of layer types"),
        None if use_window => {
            let first = max_window_layers
                .and_then(|v| v.as_i64())
                .unwrap_or(DEFAULT_MAX_WINDOW_LAYERS);
            let layers = map.get("num_hidden_layers").and_then(Value::as_i64);
            layers
                .filter(|n| (1..=super::MAX_DRAFTER_LAYERS).contains(n))
                .map(|n| {
                    (0..n)
                        .map(|i| match i >= first {
                            true => LayerType::SlidingAttention,
                            false => LayerType::FullAttention,
                        })
                        .collect()
                })
        }
        None => None,
    };
    let slides = types
        .iter()
        .flatten()
        .any(|t| *t == LayerType::SlidingAttention);
    if slides && !use_window {
        bail!(
            "field layer_types names sliding_attention layers but use_sliding_window is not true (transformers then drops sliding_window): set \"use_sliding_window\": true and \"sliding_window\""
        );
    }
    if let Some(types) = types {
        map.insert("layer_types".into(), json!(types));
    }
    if let Some(w) = window {
        map.insert("use_sliding_window".into(), json!(true));
        map.insert("sliding_window".into(), json!(w));
    }
    Ok(())
}

/// Checks the layout against the layer count: a type per layer, a window of at least 1 where
/// `use_sliding_window` is set, and set where a layer slides.
pub(crate) fn validate(
    types: Option<&[LayerType]>,
    use_window: bool,
    window: Option<i64>,
    layers: i64,
) -> Result<()> {
    if let Some(types) = types {
        if types.len() as i64 != layers {
            bail!(
                "field layer_types lists {} layers, but num_hidden_layers = {layers}",
                types.len()
            );
        }
    }
    match (use_window, window) {
        (true, Some(w)) if w < 1 => bail!("field sliding_window = {w} must be at least 1"),
        (true, None) => bail!("field use_sliding_window is true but sliding_window is not set"),
        (false, Some(_)) => {
            bail!("field sliding_window is set but use_sliding_window is not true")
        }
        _ => {}
    }
    let slides = types
        .into_iter()
        .flatten()
        .any(|t| *t == LayerType::SlidingAttention);
    if slides && !use_window {
        bail!(
            "field layer_types names sliding_attention layers but use_sliding_window is not true"
        );
    }
    Ok(())
}

/// One line naming the layer mix, e.g. `layers: 4 sliding (window 2048), 1 full`; `None` where
/// every layer is full.
pub(crate) fn describe(types: Option<&[LayerType]>, window: Option<i64>) -> Option<String> {
    let types = types?;
    let sliding = types
        .iter()
        .filter(|t| **t == LayerType::SlidingAttention)
        .count();
    (sliding > 0).then(|| {
        format!(
            "{sliding} sliding (window {}), {} full",
            window.unwrap_or(0),
            types.len() - sliding
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalised(v: Value) -> Result<Value> {
        let Value::Object(mut map) = v else {
            unreachable!()
        };
        normalise(&mut map)?;
        Ok(Value::Object(map))
    }

    #[test]
    fn specforge_layouts_read_as_transformers_reads_them() {
        // Qwen3.6-27B: four sliding layers and a full one
        let qwen36 = json!({"num_hidden_layers": 5, "max_window_layers": 5,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                            "sliding_attention", "full_attention"],
            "use_sliding_window": true, "sliding_window": 2048});
        let got = normalised(qwen36).unwrap();
        assert_eq!(got["sliding_window"], 2048);
        assert_eq!(got["use_sliding_window"], true);
        assert_eq!(got["layer_types"][4], "full_attention");
        assert!(got.get("max_window_layers").is_none());
        // full-only layouts: the window is dropped
        let full = json!({"num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention"],
            "use_sliding_window": false, "sliding_window": null, "max_window_layers": 28});
        let got = normalised(full).unwrap();
        assert_eq!(
            got,
            json!({"num_hidden_layers": 2,
            "layer_types": ["full_attention", "full_attention"]})
        );
        // transformers ignores sliding_window without use_sliding_window
        let ignored = json!({"num_hidden_layers": 2, "sliding_window": 0});
        assert_eq!(
            normalised(ignored).unwrap(),
            json!({"num_hidden_layers": 2})
        );
        // no layer_types: the layers from max_window_layers on slide, 4096 by default
        let derived =
            json!({"num_hidden_layers": 3, "use_sliding_window": true, "max_window_layers": 1});
        let got = normalised(derived).unwrap();
        assert_eq!(
            got["layer_types"],
            json!(["full_attention", "sliding_attention", "sliding_attention"])
        );
        assert_eq!(got["sliding_window"], DEFAULT_SLIDING_WINDOW);
    }

    #[test]
    fn bad_layouts_are_refused_by_field() {
        let cases = [
            (
                json!({"layer_types": ["full_attention", "linear_attention"]}),
                "field layer_types[1] = \"linear_attention\" is not a drafter layer type (expected \"full_attention\" or \"sliding_attention\")",
            ),
            (
                json!({"layer_types": "full_attention"}),
                "field layer_types = \"full_attention\" is not a list of layer types",
            ),
            (
                json!({"use_sliding_window": true, "sliding_window": 0}),
                "field sliding_window = 0 must be a whole number of at least 1",
            ),
            (
                json!({"use_sliding_window": true, "sliding_window": -3}),
                "field sliding_window = -3 must be a whole number of at least 1",
            ),
            (
                json!({"use_sliding_window": "yes"}),
                "field use_sliding_window = \"yes\" is not true or false",
            ),
        ];
        for (json, message) in cases {
            assert_eq!(normalised(json).unwrap_err().to_string(), message);
        }
        let e = normalised(json!({"layer_types": ["sliding_attention"], "sliding_window": 8}))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("field layer_types names sliding_attention layers but use_sliding_window is not true"), "{e}");
        let full = [LayerType::FullAttention; 2];
        let e = validate(Some(&full), false, None, 3)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "field layer_types lists 2 layers, but num_hidden_layers = 3"
        );
        let e = validate(None, true, Some(0), 3).unwrap_err().to_string();
        assert_eq!(e, "field sliding_window = 0 must be at least 1");
        assert!(validate(Some(&full), false, None, 2).is_ok());
    }
}
