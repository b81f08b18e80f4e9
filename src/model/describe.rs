//! One line naming a target's family and its layers, as `doctor`, `inspect-data`, the trainer's
//! start-up line, the control room and `ctl status` show it: `qwen3_5_text (Qwen3.5 hybrid): 48
//! Gated DeltaNet + 16 gated attention layers`.

use super::config::{Family, TargetConfig};

/// The family's name for people, by the config's `model_type` where a family has several.
fn family_name(config: &TargetConfig) -> &'static str {
    let Ok(family) = config.family() else {
        return "unsupported";
    };
    match family {
        Family::Llama if config.model_type == "mistral" => "Mistral, Llama family",
        Family::Llama => "Llama",
        Family::Qwen2 => "Qwen2",
        Family::Qwen3 => "Qwen3",
        Family::Qwen35 if config.model_type == "qwen3_next" => "Qwen3-Next dense hybrid",
        Family::Qwen35 => "Qwen3.5 hybrid",
    }
}

/// `MODEL_TYPE (FAMILY): LAYERS`, the layers as a hybrid's mix or a decoder's count.
pub fn describe_target(config: &TargetConfig) -> String {
    let layers = match &config.hybrid {
        Some(h) => h.layer_mix(),
        None => format!("{} decoder layers", config.num_hidden_layers),
    };
    format!("{} ({}): {layers}", config.model_type, family_name(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn described(v: serde_json::Value) -> String {
        describe_target(&TargetConfig::from_json(&v).unwrap())
    }

    #[test]
    fn families_and_their_layers_are_named() {
        let decoder = |t: &str| {
            json!({"model_type": t, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 64})
        };
        assert_eq!(
            described(decoder("qwen3")),
            "qwen3 (Qwen3): 3 decoder layers"
        );
        assert_eq!(
            described(decoder("mistral")),
            "mistral (Mistral, Llama family): 3 decoder layers"
        );
        let mut next = decoder("qwen3_next");
        next["num_hidden_layers"] = json!(8);
        assert_eq!(
            described(next),
            "qwen3_next (Qwen3-Next dense hybrid): 6 Gated DeltaNet + 2 gated attention layers"
        );
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let c = TargetConfig::from_model_dir(&root.join("configs/shapes/qwen3.5-27b")).unwrap();
        assert_eq!(
            describe_target(&c),
            "qwen3_5_text (Qwen3.5 hybrid): 48 Gated DeltaNet + 16 gated attention layers"
        );
    }
}
