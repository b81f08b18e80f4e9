//! What a target's weights take in memory, from its config alone (before loading), and the
//! refusal of a target that cannot fit a GPU: a mixture of experts such as Qwen3-235B-A22B
//! (470 GB in bf16) would otherwise fail deep inside libtorch after minutes of loading.

use anyhow::{bail, Result};
use tch::Kind;

use super::config::TargetConfig;
use super::hybrid_config::LayerKind;

/// The part of a GPU's memory kept for everything besides the weights (activations, caches,
/// the drafter and its optimizer): a tenth, and at least 2 GiB.
const MARGIN_FRACTION: f64 = 0.1;
const MIN_MARGIN: u64 = 2 << 30;

/// The parameters of the target `config` describes (text model only; every expert counted).
pub fn parameter_estimate(c: &TargetConfig) -> u64 {
    let (h, d) = (c.hidden_size as u64, c.head_dim() as u64);
    let (heads, kv) = (c.num_attention_heads as u64, c.kv_heads() as u64);
    let embed = c.vocab_size as u64 * h * if c.tie_word_embeddings { 1 } else { 2 };
    let layers: u64 = (0..c.num_hidden_layers)
        .map(|l| mixer_params(c, l as usize, h, d, heads, kv) + mlp_params(c, l, h) + 2 * h)
        .sum();
    embed + layers + h
}

fn mixer_params(c: &TargetConfig, l: usize, h: u64, d: u64, heads: u64, kv: u64) -> u64 {
    let kind = c.hybrid.as_ref().and_then(|s| s.layers.get(l).copied());
    match (kind, &c.hybrid) {
        (Some(LayerKind::LinearAttention), Some(s)) => {
            let g = s.gdn;
            let value_width = (g.value_heads * g.value_dim) as u64;
            let conv = g.conv_dim() as u64;
            // in_proj (q, k, v, z, b, a), conv, out_proj, A_log and dt_bias, the gated norm
            (conv + value_width + 2 * g.value_heads as u64) * h
                + conv * g.conv_kernel as u64
                + value_width * h
                + 2 * g.value_heads as u64
                + g.value_dim as u64
        }
        // a hybrid's gated attention: the query projection also emits the gate
        (_, Some(_)) => 2 * heads * d * h + 2 * kv * d * h + heads * d * h + 2 * d,
        _ => 2 * heads * d * h + 2 * kv * d * h + 2 * d,
    }
}

fn mlp_params(c: &TargetConfig, l: i64, h: u64) -> u64 {
    match &c.moe {
        Some(m) if m.is_sparse(l) => {
            let experts = (m.num_experts * 3 * m.moe_intermediate_size) as u64 * h;
            let shared = m
                .shared_expert_intermediate_size
                .map_or(0, |s| 3 * s as u64 * h + h);
            m.num_experts as u64 * h + experts + shared
        }
        _ => 3 * c.intermediate_size.unwrap_or(0) as u64 * h,
    }
}

/// The parameters one token runs through: [`parameter_estimate`] less, in each sparse layer, the
/// experts it is not routed to (the router and the shared expert count).
pub fn active_parameter_estimate(c: &TargetConfig) -> u64 {
    let h = c.hidden_size as u64;
    let idle: u64 = match &c.moe {
        Some(m) => (0..c.num_hidden_layers)
            .filter(|&l| m.is_sparse(l))
            .map(|_| {
                (m.num_experts - m.num_experts_per_tok) as u64
                    * 3
                    * m.moe_intermediate_size as u64
                    * h
            })
            .sum(),
        None => 0,
    };
    parameter_estimate(c) - idle
}

/// The bytes of the target's weights held as `kind`.
pub fn weight_bytes(c: &TargetConfig, kind: Kind) -> u64 {
    parameter_estimate(c) * kind.elt_size_in_bytes() as u64
}

/// `doctor`'s line on a target's weights: `34.7 B parameters (3.5 B active per token), 69.3 GB
/// (64.6 GiB) in bf16` (the active count only for a mixture of experts).
pub fn describe_weights(c: &TargetConfig) -> String {
    let bytes = weight_bytes(c, Kind::BFloat16);
    let active = match c.moe {
        Some(_) => format!(
            " ({:.1} B active per token)",
            active_parameter_estimate(c) as f64 / 1e9
        ),
        None => String::new(),
    };
    format!(
        "{:.1} B parameters{active}, {:.1} GB ({:.1} GiB) in bf16",
        parameter_estimate(c) as f64 / 1e9,
        bytes as f64 / 1e9,
        gib(bytes)
    )
}

/// The start-up line's `X GiB in memory` for the target's weights held as `kind` on `device`,
/// refused ([`check_fits`]) where the device has `gpu_total` bytes (None: no limit known, as on
/// the CPU) and they cannot fit.
pub fn weights_on_device(
    c: &TargetConfig,
    kind: Kind,
    device: &str,
    gpu_total: Option<u64>,
) -> Result<String> {
    let bytes = weight_bytes(c, kind);
    if let Some(total) = gpu_total {
        check_fits(bytes, total, device)?;
    }
    Ok(format!("{:.1} GiB in memory", gib(bytes)))
}

/// Refuses, naming both sizes, weights of `bytes` that with the margin exceed a GPU of `total`
/// bytes (`device` names it).
pub fn check_fits(bytes: u64, total: u64, device: &str) -> Result<()> {
    let margin = ((total as f64 * MARGIN_FRACTION) as u64).max(MIN_MARGIN);
    if bytes.saturating_add(margin) > total {
        bail!(
            "the target's weights take {:.1} GiB, more than {device} can hold ({:.1} GiB, of which {:.1} GiB are kept for activations and caches): use a smaller target or fewer bits (sharding a target over several GPUs is not supported yet)",
            gib(bytes),
            gib(total),
            gib(margin)
        );
    }
    Ok(())
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen3-30B-A3B's published config: 30.5 B parameters (the model card's count).
    #[test]
    fn qwen3_30b_a3b_counts_as_published() {
        let c = TargetConfig::from_json(&json!({"model_type": "qwen3_moe",
            "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "norm_topk_prob": true, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "tie_word_embeddings": false}))
        .unwrap();
        let n = parameter_estimate(&c) as f64 / 1e9;
        assert!((30.4..30.6).contains(&n), "{n} B");
        assert!((56.0..57.5).contains(&gib(weight_bytes(&c, Kind::BFloat16))));
    }

    fn shape(name: &str) -> TargetConfig {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        TargetConfig::from_model_dir(&root.join("configs/shapes").join(name)).unwrap()
    }

    /// The Qwen3.5-35B-A3B shape with every expert: 34.7 B parameters, 69.3 GB in bf16 (the
    /// issue's 69 GB); 3.5 B of them active per token. A 40 GB GPU refuses it before loading,
    /// naming both sizes; an H200 (NVML: 150,754,820,096 bytes) takes it; the CPU has no limit.
    #[test]
    fn the_35b_a3b_shape_counts_every_expert_and_is_refused_by_a_small_gpu() {
        let c = shape("qwen3.5-35b-a3b");
        let n = parameter_estimate(&c) as f64 / 1e9;
        assert!((34.5..35.0).contains(&n), "{n} B");
        let gb = weight_bytes(&c, Kind::BFloat16) as f64 / 1e9;
        assert!((69.0..70.0).contains(&gb), "{gb} GB");
        let active = active_parameter_estimate(&c) as f64 / 1e9;
        assert!((3.4..3.6).contains(&active), "{active} B active");
        let line = describe_weights(&c);
        assert!(line.starts_with("34."), "{line}");
        assert!(line.contains(" B active per token), 69."), "{line}");
        assert!(line.ends_with(" GiB) in bf16"), "{line}");

        let e = weights_on_device(&c, Kind::BFloat16, "cuda:0", Some(40_000_000_000)).unwrap_err();
        let e = format!("{e:#}");
        let want = format!(
            "the target's weights take {:.1} GiB, more than cuda:0 can hold (37.3 GiB",
            gib(weight_bytes(&c, Kind::BFloat16))
        );
        assert!(e.starts_with(&want), "{e}");
        let h200 = Some(150_754_820_096);
        let ok = weights_on_device(&c, Kind::BFloat16, "cuda:0", h200).unwrap();
        assert_eq!(
            ok,
            format!("{:.1} GiB in memory", gib(weight_bytes(&c, Kind::BFloat16)))
        );
        assert!(weights_on_device(&c, Kind::Float, "cpu", None).is_ok());
        // a dense target has no active count
        assert!(!describe_weights(&shape("qwen3-8b")).contains("active"));
    }

    #[test]
    fn a_target_larger_than_the_gpu_is_refused_by_size() {
        let h200 = 150_000_000_000u64;
        assert!(check_fits(60 << 30, h200, "cuda:0").is_ok());
        let e = format!("{:#}", check_fits(470 << 30, h200, "cuda:0").unwrap_err());
        assert!(
            e.starts_with("the target's weights take 470.0 GiB, more than cuda:0 can hold (139.7 GiB, of which 14.0 GiB"),
            "{e}"
        );
        // the margin counts: weights alone fit, with the margin they do not
        assert!(check_fits(130 << 30, h200, "cuda:0").is_err());
    }
}
