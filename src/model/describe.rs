//! One line naming a target's family and its layers, as `doctor`, `inspect-data`, the trainer's
//! start-up line, the control room and `ctl status` show it: `qwen3_5_text (Qwen3.5 hybrid): 48
//! Gated DeltaNet + 16 gated attention layers`.

use super::config::{Family, TargetConfig};

/// The family's name for people, by the config's `model_type` where a family has several.
fn family_name(config: &TargetConfig) -> &'static str {
    let Ok(family) = config.family() else {
        return "unsupported";
    };
    let experts = config.moe.is_some();
    match family {
        Family::Llama if config.model_type == "mistral" => "Mistral, Llama family",
        Family::Llama => "Llama",
        Family::Qwen2 => "Qwen2",
        Family::Qwen3 if experts => "Qwen3-MoE",
        Family::Qwen3 => "Qwen3",
        Family::Qwen35 if config.model_type == "qwen3_next" && experts => "Qwen3-Next hybrid",
        Family::Qwen35 if config.model_type == "qwen3_next" => "Qwen3-Next dense hybrid",
        Family::Qwen35 if experts => "Qwen3.5-MoE hybrid",
        Family::Qwen35 => "Qwen3.5 hybrid",
    }
}

/// `, N experts (K per token)` for a mixture of experts, else nothing.
fn experts(config: &TargetConfig) -> String {
    match &config.moe {
        Some(m) => format!(
            ", {} experts ({} per token)",
            m.num_experts, m.num_experts_per_tok
        ),
        None => String::new(),
    }
}

/// `MODEL_TYPE (FAMILY): LAYERS`, the layers as a hybrid's mix or a decoder's count.
pub fn describe_target(config: &TargetConfig) -> String {
    let layers = match &config.hybrid {
        Some(h) => h.layer_mix(),
        None => format!("{} decoder layers", config.num_hidden_layers),
    };
    format!(
        "{} ({}): {layers}{}",
        config.model_type,
        family_name(config),
        experts(config)
    )
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
        // Qwen3-Next routes through 512 experts unless num_experts says otherwise
        let mut next = decoder("qwen3_next");
        next["num_hidden_layers"] = json!(8);
        next["moe_intermediate_size"] = json!(16);
        assert_eq!(
            described(next.clone()),
            "qwen3_next (Qwen3-Next hybrid): 6 Gated DeltaNet + 2 gated attention layers, 512 experts (10 per token)"
        );
        next["num_experts"] = json!(0);
        assert_eq!(
            described(next),
            "qwen3_next (Qwen3-Next dense hybrid): 6 Gated DeltaNet + 2 gated attention layers"
        );
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let moe = |dir: &str| {
            let dir = root.join("tests/fixtures/moe_targets").join(dir);
            describe_target(&TargetConfig::from_model_dir(&dir).unwrap())
        };
        let (q3, q35) = (moe("qwen3_moe_norm"), moe("qwen3_5_moe"));
        assert!(q3.starts_with("qwen3_moe (Qwen3-MoE): "), "{q3}");
        assert!(
            q3.contains(" decoder layers, ") && q3.ends_with(" per token)"),
            "{q3}"
        );
        assert!(q35.contains("(Qwen3.5-MoE hybrid): "), "{q35}");
        assert!(
            q35.contains(" Gated DeltaNet + ") && q35.contains(" experts ("),
            "{q35}"
        );
        let c = TargetConfig::from_model_dir(&root.join("configs/shapes/qwen3.5-27b")).unwrap();
        assert_eq!(
            describe_target(&c),
            "qwen3_5_text (Qwen3.5 hybrid): 48 Gated DeltaNet + 16 gated attention layers"
        );
    }
}
