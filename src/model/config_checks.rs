//! What a target's `config.json` may hold beyond the fields [`TargetConfig`] reads: a
//! multimodal model's `text_config`, and fields that change the forward. A field that changes
//! the computation and is not implemented is refused by name, never ignored.
//!
//! Checked against transformers 5's Llama, Mistral, Qwen2, Qwen3, Qwen3.5 and Qwen3-Next
//! configurations and models (the hybrids' own fields: [`super::hybrid_config`]; a multimodal
//! Qwen3.5's `vision_config` and image token ids are never read: text only).
//! Implemented: the dimensions, `rms_norm_eps`, `head_dim`, `tie_word_embeddings`,
//! `hidden_act` silu, Qwen2's q/k/v biases, the rotary settings of
//! [`super::rope_scaling::RopeSettings`] (default, linear, llama3). Harmless at inference:
//! `attention_dropout`, `pretraining_tp` (transformers 5 no longer reads it; transformers 4
//! split the same products into slices and summed them), `initializer_range`, `use_cache`,
//! `dtype` / `torch_dtype` (the caller picks the compute dtype), a sliding window that covers
//! `max_position_embeddings`. Refused: see [`check_computation_fields`].
//!
//! [`TargetConfig`]: super::config::TargetConfig

use anyhow::{bail, Result};
use serde_json::{Map, Value};

use super::config::SUPPORTED;
use super::hybrid_config::HYBRID_TYPES;

/// The text model's settings: the config itself, or, for a multimodal model whose
/// `text_config` is of a supported family, that section (with the top level's weight tying, and
/// its token ids where the section has none). Any other `text_config` is refused in one line
/// naming the architecture.
pub(crate) fn text_settings(top: &Map<String, Value>) -> Result<Map<String, Value>> {
    let Some(text) = top.get("text_config").filter(|v| !v.is_null()) else {
        let model_type = top.get("model_type").and_then(Value::as_str);
        if let Some(t @ ("qwen3_5" | "qwen3_5_moe")) = model_type {
            // a multimodal Qwen3.5 (transformers would fill in a default text model)
            bail!("field text_config is missing: model_type {t:?} keeps its text model's settings there (a text-only checkpoint is model_type \"{t}_text\")");
        }
        return Ok(top.clone());
    };
    let name = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("?").to_string();
    let arch = name(top.get("architectures").and_then(|a| a.get(0)));
    let model_type = name(top.get("model_type"));
    let text_type = name(text.get("model_type"));
    let supported = SUPPORTED.split(", ").any(|t| t == text_type);
    let Some(section) = text.as_object().filter(|_| supported) else {
        bail!(
            "architectures[0] = {arch:?} (model_type {model_type:?}, text_config.model_type {text_type:?}) is not supported: the text model must be one of {SUPPORTED}"
        );
    };
    if let Some(q) = top.get("quantization_config").filter(|v| !v.is_null()) {
        bail!("{}", quantized(q));
    }
    let mut merged = section.clone();
    // transformers 5 ties a composite model's LM head by the top-level flag (older checkpoints
    // kept it in the text section); token ids often live only at the top.
    if let Some(tie) = top.get("tie_word_embeddings").filter(|v| !v.is_null()) {
        merged.insert("tie_word_embeddings".into(), tie.clone());
    }
    for key in ["bos_token_id", "eos_token_id"] {
        if let Some(v) = top.get(key).filter(|_| !merged.contains_key(key)) {
            merged.insert(key.to_string(), v.clone());
        }
    }
    Ok(merged)
}

/// Fields of other architectures that would change the forward if honoured (transformers'
/// Llama / Mistral / Qwen models ignore them too; their presence means the checkpoint was made
/// for something else).
const FOREIGN: [&str; 7] = [
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
];

fn quantized(q: &Value) -> String {
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
    format!(
        "field quantization_config (quant_method {method:?}): quantized checkpoints are not supported (weights must be f32, f16 or bf16)"
    )
}

/// Refuses, by name and with what is supported, each field that changes the computation and
/// is not implemented: `quantization_config`, `mlp_bias: true`, `attention_bias: true` on a
/// Llama or Qwen3 model (o_proj would need a bias), sliding-window attention narrower than
/// `max_position_embeddings`, `layer_types` other than full / sliding attention, the
/// [`FOREIGN`] fields. Rotary settings are checked where they are read.
pub(crate) fn check_computation_fields(c: &Map<String, Value>) -> Result<()> {
    let get = |key: &str| c.get(key).filter(|v| !v.is_null());
    let model_type = get("model_type").and_then(Value::as_str).unwrap_or("");
    if let Some(q) = get("quantization_config") {
        bail!("{}", quantized(q));
    }
    if get("mlp_bias") == Some(&Value::Bool(true)) {
        bail!("field mlp_bias = true is not supported (MLPs without biases)");
    }
    let mut biasless = ["llama", "qwen3", "qwen3_moe"]
        .iter()
        .chain(HYBRID_TYPES.iter());
    if get("attention_bias") == Some(&Value::Bool(true)) && biasless.any(|t| *t == model_type) {
        bail!(
            "field attention_bias = true (biases on q, k, v and o_proj) is not supported for model_type {model_type:?} (attention without biases; qwen2's q/k/v biases are)"
        );
    }
    if let Some(field) = FOREIGN.iter().find(|f| get(f).is_some()) {
        bail!(
            "field {field} is not part of a {model_type} model (transformers' {model_type} ignores it too): the checkpoint was made for another architecture"
        );
    }
    check_layer_types(c)?;
    check_sliding_window(c, model_type)
}

/// The hybrids' layer types are read by [`super::hybrid_config`].
fn check_layer_types(c: &Map<String, Value>) -> Result<()> {
    let Some(types) = c.get("layer_types").and_then(Value::as_array) else {
        return Ok(());
    };
    let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
    if HYBRID_TYPES.contains(&model_type) {
        return Ok(());
    }
    for (i, t) in types.iter().enumerate() {
        let t = t.as_str().unwrap_or("?");
        if t != "full_attention" && t != "sliding_attention" {
            bail!(
                "field layer_types[{i}] = {t:?} is not supported (full_attention, or sliding_attention with a window of at least max_position_embeddings)"
            );
        }
    }
    Ok(())
}

/// A window at least `max_position_embeddings` wide masks nothing; a narrower one is refused.
/// Mistral slides every layer when `sliding_window` is set; Qwen2 / Qwen3 only with
/// `use_sliding_window: true`, on the layers `layer_types` marks (by default those from
/// `max_window_layers` on).
fn check_sliding_window(c: &Map<String, Value>, model_type: &str) -> Result<()> {
    let Some(window) = c.get("sliding_window").and_then(Value::as_i64) else {
        return Ok(());
    };
    let max_positions = c
        .get("max_position_embeddings")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    if window >= max_positions {
        return Ok(());
    }
    let slides = match model_type {
        "mistral" => true,
        "qwen2" | "qwen3" => {
            let on = c.get("use_sliding_window") == Some(&Value::Bool(true));
            let layers = c.get("num_hidden_layers").and_then(Value::as_i64);
            let sliding_layers = match c.get("layer_types").and_then(Value::as_array) {
                Some(types) => types.iter().any(|t| t == "sliding_attention"),
                None => {
                    let from = c.get("max_window_layers").and_then(Value::as_i64);
                    from.unwrap_or(28) < layers.unwrap_or(0)
                }
            };
            on && sliding_layers
        }
        // transformers' Qwen3-MoE slides every layer when use_sliding_window is on
        "qwen3_moe" => c.get("use_sliding_window") == Some(&Value::Bool(true)),
        _ => false,
    };
    if slides {
        bail!(
            "field sliding_window = {window} is narrower than max_position_embeddings = {max_positions}: sliding-window attention is not supported (full attention only; with every sequence within {window} tokens the two agree, and sliding_window: null says so)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    fn refusal(v: Value) -> String {
        format!("{:#}", check_computation_fields(&map(v)).unwrap_err())
    }

    #[test]
    fn computation_fields_are_refused_by_name() {
        let base = json!({"model_type": "llama", "max_position_embeddings": 4096,
            "num_hidden_layers": 4});
        let with = |key: &str, value: Value| {
            let mut m = map(base.clone());
            m.insert(key.into(), value);
            Value::Object(m)
        };
        assert!(check_computation_fields(&map(base.clone())).is_ok());
        for (key, value, says) in [
            ("mlp_bias", json!(true), "field mlp_bias = true is not supported"),
            ("attention_bias", json!(true), "field attention_bias = true"),
            (
                "quantization_config",
                json!({"quant_method": "awq", "bits": 4}),
                "quantization_config (quant_method \"awq\"): quantized checkpoints are not supported",
            ),
            ("final_logit_softcapping", json!(30.0), "field final_logit_softcapping"),
            (
                "layer_types",
                json!(["full_attention", "linear_attention"]),
                "field layer_types[1] = \"linear_attention\" is not supported",
            ),
        ] {
            let e = refusal(with(key, value));
            assert!(e.contains(says), "{key}: {e}");
        }
        // harmless: falses, nulls, dropout, tensor-parallel slicing
        for (key, value) in [
            ("mlp_bias", json!(false)),
            ("attention_dropout", json!(0.1)),
            ("pretraining_tp", json!(2)),
            ("quantization_config", Value::Null),
        ] {
            assert!(
                check_computation_fields(&map(with(key, value))).is_ok(),
                "{key}"
            );
        }
    }

    #[test]
    fn sliding_windows_narrower_than_the_context_are_refused() {
        let mistral = json!({"model_type": "mistral", "max_position_embeddings": 32768,
            "sliding_window": 4096});
        let e = refusal(mistral);
        assert!(
            e.contains("sliding_window = 4096 is narrower than max_position_embeddings = 32768"),
            "{e}"
        );
        let wide = json!({"model_type": "mistral", "max_position_embeddings": 32768,
            "sliding_window": 32768});
        assert!(check_computation_fields(&map(wide)).is_ok());
        // qwen: only with use_sliding_window, on the layers from max_window_layers on
        let qwen = |on: bool, from: i64| {
            json!({"model_type": "qwen3", "max_position_embeddings": 40960,
                "sliding_window": 4096, "use_sliding_window": on, "max_window_layers": from,
                "num_hidden_layers": 36})
        };
        assert!(check_computation_fields(&map(qwen(false, 0))).is_ok());
        assert!(check_computation_fields(&map(qwen(true, 36))).is_ok());
        assert!(refusal(qwen(true, 28)).contains("sliding_window = 4096"));
        let listed = json!({"model_type": "qwen2", "max_position_embeddings": 40960,
            "sliding_window": 4096, "use_sliding_window": true,
            "layer_types": ["full_attention", "sliding_attention"]});
        assert!(refusal(listed).contains("sliding-window attention is not supported"));
    }

    #[test]
    fn text_config_of_a_supported_family_is_read_and_others_refused() {
        let top = json!({"architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3", "tie_word_embeddings": false, "eos_token_id": 2,
            "text_config": {"model_type": "mistral", "hidden_size": 64}});
        let text = text_settings(&map(top)).unwrap();
        assert_eq!(text["hidden_size"], 64);
        assert_eq!(text["model_type"], "mistral");
        assert_eq!(text["tie_word_embeddings"], false);
        assert_eq!(text["eos_token_id"], 2);
        let gemma = json!({"architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}});
        let e = format!("{:#}", text_settings(&map(gemma)).unwrap_err());
        assert_eq!(
            e,
            "architectures[0] = \"Gemma3ForConditionalGeneration\" (model_type \"gemma3\", text_config.model_type \"gemma3_text\") is not supported: the text model must be one of llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next"
        );
        let qwen35 = json!({"architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5", "vision_config": {"depth": 27},
            "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64}});
        assert_eq!(text_settings(&map(qwen35)).unwrap()["hidden_size"], 64);
        let bare = json!({"model_type": "qwen3_5", "vision_config": {"depth": 27}});
        let e = format!("{:#}", text_settings(&map(bare)).unwrap_err());
        assert!(
            e.starts_with("field text_config is missing: model_type \"qwen3_5\""),
            "{e}"
        );
        let plain = json!({"model_type": "llama", "hidden_size": 32});
        assert_eq!(text_settings(&map(plain.clone())).unwrap(), map(plain));
    }
}
