//! The model FLOPs a benchmark divides by its time (benchmarks spec): 2 FLOPs per parameter and
//! token for the target's forward, 6 per parameter and drafted position for the drafter's forward
//! and backward, 4 H V per drafted position for the frozen LM head's forward and backward. What
//! is counted of a target layer: its projections and MLP (of a mixture of experts the active
//! parameters only: router, chosen experts, shared expert), a Gated DeltaNet layer's convolution
//! (a product with its own weights too) and its state products;
//! not the attention scores of any family (the spec's count never had them), not norms, rotary
//! embedding or activations.

use std::path::Path;

use anyhow::Result;

use crate::config::TrainConfig;
use crate::model::hybrid_config::{GdnShape, LayerKind};
use crate::model::{DrafterConfig, TargetConfig};

/// Parameters of one pre-norm decoder layer (attention projections and SwiGLU MLP).
fn layer_params(h: f64, q_dim: f64, kv_dim: f64, inter: f64) -> f64 {
    h * q_dim * 2.0 + h * kv_dim * 2.0 + 3.0 * h * inter
}

/// Parameters of layer `l`'s MLP one token runs through: the dense SwiGLU, or of a sparse block
/// its active parameters: the router (every expert's logit is computed), the `k` experts it is
/// routed to, the shared expert and its gate; the other experts cost it nothing.
fn active_mlp_params(config: &TargetConfig, l: usize) -> f64 {
    let h = config.hidden_size as f64;
    let swiglu = 3.0 * h * config.active_mlp_width(l as i64) as f64;
    match &config.moe {
        Some(m) if m.is_sparse(l as i64) => {
            let shared_gate = if m.shared_expert_intermediate_size.is_some() {
                h
            } else {
                0.0
            };
            swiglu + m.num_experts as f64 * h + shared_gate
        }
        _ => swiglu,
    }
}

/// Parameters of a Gated DeltaNet layer's token mixer: `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
/// `in_proj_a`, the depthwise convolution and `out_proj` (Qwen3-Next's `in_proj_qkvz` and
/// `in_proj_ba` hold the same weights, interleaved).
fn gdn_mixer_params(h: f64, g: &GdnShape) -> f64 {
    let conv = g.conv_dim() as f64;
    let value = (g.value_heads * g.value_dim) as f64;
    let heads = g.value_heads as f64;
    h * conv + h * value + 2.0 * h * heads + conv * g.conv_kernel as f64 + value * h
}

/// FLOPs per token of one Gated DeltaNet layer's rule beyond its parameters: per value head
/// three products with the Dk x Dv state (the key's read of it, the rank-one write, the query's
/// read), a multiply-add per element each. The chunked form's extra intra-chunk products are
/// not counted, as attention's scores are not.
fn gdn_rule_flops_per_token(g: &GdnShape) -> f64 {
    6.0 * (g.value_heads * g.key_dim * g.value_dim) as f64
}

/// What one target layer costs per token: parameters used, and FLOPs beyond 2 per parameter.
fn target_layer(config: &TargetConfig, layer: usize) -> (f64, f64) {
    let h = config.hidden_size as f64;
    let d = config.head_dim() as f64;
    let (q, kv) = (
        config.num_attention_heads as f64 * d,
        config.kv_heads() as f64 * d,
    );
    // a mixture of experts counts what a token runs through (active parameters)
    let mlp = active_mlp_params(config, layer);
    let Some(hybrid) = &config.hybrid else {
        return (layer_params(h, q, kv, 0.0) + mlp, 0.0);
    };
    match hybrid.layers.get(layer) {
        // q_proj emits the query and its gate: twice as wide as o_proj's input
        Some(LayerKind::FullAttention) | None => (h * q * 3.0 + h * kv * 2.0 + mlp, 0.0),
        Some(LayerKind::LinearAttention) => (
            gdn_mixer_params(h, &hybrid.gdn) + mlp,
            gdn_rule_flops_per_token(&hybrid.gdn),
        ),
    }
}

/// The first `layers` layers of a target: parameters used per token, and the FLOPs per token
/// beyond 2 per parameter (the Gated DeltaNet rule's).
pub(crate) fn target_layers_cost(config: &TargetConfig, layers: usize) -> (f64, f64) {
    (0..layers)
        .map(|l| target_layer(config, l))
        .fold((0.0, 0.0), |(p, f), (lp, lf)| (p + lp, f + lf))
}

/// What the FLOP count of a window is computed from: parameters used per target token and
/// per drafted position, and the LM head's size.
pub(crate) struct ModelFlops {
    /// Target layers actually run (up to the last tapped layer, no embedding).
    pub target_params: f64,
    /// FLOPs per target token beyond 2 per parameter (Gated DeltaNet state products).
    pub target_rule_flops: f64,
    /// Drafter trainable parameters.
    pub drafter_params: f64,
    pub hidden: f64,
    pub vocab: f64,
    pub block: i64,
}

impl ModelFlops {
    pub(crate) fn of(cfg: &TrainConfig) -> Result<ModelFlops> {
        let target = TargetConfig::from_model_dir(Path::new(&cfg.model.target))?;
        let drafter = DrafterConfig::for_target(&target, &cfg.drafter_shape())?;
        Ok(Self::for_models(&target, &drafter))
    }

    fn for_models(target: &TargetConfig, drafter: &DrafterConfig) -> ModelFlops {
        let h = target.hidden_size as f64;
        let run_layers = drafter
            .target_layer_ids()
            .iter()
            .map(|&l| l + 1)
            .max()
            .unwrap_or(0);
        let (target_params, target_rule_flops) = target_layers_cost(target, run_layers);
        let d = drafter.head_dim as f64;
        let drafter_layer = layer_params(
            drafter.hidden_size as f64,
            drafter.num_attention_heads as f64 * d,
            drafter.num_key_value_heads as f64 * d,
            drafter.intermediate_size as f64,
        );
        let taps = drafter.target_layer_ids().len() as f64;
        ModelFlops {
            target_params,
            target_rule_flops,
            drafter_params: drafter_layer * drafter.num_hidden_layers as f64 + taps * h * h,
            hidden: h,
            vocab: target.vocab_size as f64,
            block: drafter.block_size,
        }
    }

    /// Model FLOPs of `tokens` target tokens and `positions` drafted positions: the target's
    /// forward, the drafter's forward and backward, the LM head's forward and backward.
    pub(crate) fn flops(&self, tokens: u64, positions: f64) -> f64 {
        (2.0 * self.target_params + self.target_rule_flops) * tokens as f64
            + 6.0 * self.drafter_params * positions
            + 4.0 * self.hidden * self.vocab * positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DrafterShape;

    fn shape(dir: &str) -> TargetConfig {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        TargetConfig::from_model_dir(&root.join("configs/shapes").join(dir)).unwrap()
    }

    fn drafter(target: &TargetConfig) -> DrafterConfig {
        let shape = DrafterShape {
            layers: 5,
            block_size: 16,
            mask_token_id: 1,
            target_layer_ids: None,
            num_taps: 5,
        };
        DrafterConfig::for_target(target, &shape).unwrap()
    }

    /// Qwen3.5-27B, by hand (h 5120, ffn 17408, 24 heads / 4 kv of 256, GDN 48 value / 16 key
    /// heads of 128, conv 4):
    /// - MLP 3 * 5120 * 17408 = 267,386,880 in every layer.
    /// - gated attention: q_proj 5120 * 12288 = 62,914,560; k_proj + v_proj 2 * 5120 * 1024 =
    ///   10,485,760; o_proj 6144 * 5120 = 31,457,280; layer 372,244,480.
    /// - Gated DeltaNet: in_proj_qkv 5120 * (2 * 2048 + 6144) = 52,428,800; in_proj_z
    ///   5120 * 6144 = 31,457,280; in_proj_b + in_proj_a 2 * 5120 * 48 = 491,520; conv 10240 * 4 =
    ///   40,960; out_proj 31,457,280; layer 383,262,720; rule 6 * 48 * 128 * 128 = 4,718,592 FLOPs
    ///   per token.
    /// - All 64 layers (48 + 16): 18,396,610,560 + 5,955,911,680 = 24,352,522,240 parameters,
    ///   with the embedding and the untied head (2 * 248320 * 5120 = 2,542,796,800) 26.9 B, the
    ///   published size. One forward of 3072 tokens: (2 * 24,352,522,240 + 48 * 4,718,592) *
    ///   3072 = 150.32 TFLOP. The issue's ~165 TFLOP is 2 * 26.9 B * 3072 = 165.2: it also counts
    ///   the embedding (a lookup) and the LM head (not run by a forward that returns hidden
    ///   states); attention's scores (not counted, as for every family) would add 16 layers *
    ///   2 * 3072^2 * 6144 = 1.86 TFLOP with the causal half.
    #[test]
    fn the_27b_hybrid_forward_is_counted_by_layer_kind() {
        let t = shape("qwen3.5-27b");
        let (params, rule) = target_layers_cost(&t, 64);
        assert_eq!(params, 24_352_522_240.0);
        assert_eq!(rule, 48.0 * 4_718_592.0);
        let tflop = (2.0 * params + rule) * 3072.0 / 1e12;
        assert!((tflop - 150.32).abs() < 0.01, "{tflop}");
        let embed_and_head = 2.0 * 248_320.0 * 5120.0;
        let issue = 2.0 * (params + embed_and_head) * 3072.0 / 1e12;
        assert!((issue - 165.2).abs() < 0.1, "{issue}");

        // the bench's drafter reads [1, 16, 31, 46, 61]: 62 layers run, the last two not
        let d = drafter(&t);
        assert_eq!(d.target_layer_ids(), [1, 16, 31, 46, 61]);
        let m = ModelFlops::for_models(&t, &d);
        // layers 62 and 63 are linear attention and full attention
        assert_eq!(m.target_params, params - 383_262_720.0 - 372_244_480.0);
        assert_eq!(m.target_rule_flops, rule - 4_718_592.0);
        // a plain Qwen3 decoder layer of the target's width: q 6144, kv 1024, ffn 17408
        let drafter_layer = 2.0 * 5120.0 * 6144.0 + 2.0 * 5120.0 * 1024.0 + 267_386_880.0;
        assert_eq!(
            m.drafter_params,
            5.0 * drafter_layer + 5.0 * 5120.0 * 5120.0
        );
    }

    #[test]
    fn plain_decoders_keep_two_flops_per_parameter() {
        // Qwen3-8B: q 4096, kv 1024, ffn 12288, 36 layers
        let t = shape("qwen3-8b");
        let (params, rule) = target_layers_cost(&t, 36);
        let layer = 2.0 * 4096.0 * 4096.0 + 2.0 * 4096.0 * 1024.0 + 3.0 * 4096.0 * 12288.0;
        assert_eq!((params, rule), (36.0 * layer, 0.0));
        let m = ModelFlops::for_models(&t, &drafter(&t));
        assert_eq!(m.flops(10, 0.0), 20.0 * m.target_params);
    }

    #[test]
    fn the_4b_shape_ties_its_embeddings_and_mixes_three_to_one() {
        let t = shape("qwen3.5-4b");
        assert!(t.tie_word_embeddings);
        let h = t.hybrid.as_ref().unwrap();
        assert_eq!(
            h.layer_mix(),
            "24 Gated DeltaNet + 8 gated attention layers"
        );
        let (params, _) = target_layers_cost(&t, 32);
        // with the tied embedding, about the published 4 B
        let total = params + 248_320.0 * 2560.0;
        assert!((3.5e9..4.5e9).contains(&total), "{total}");
    }

    fn moe_target(v: serde_json::Value) -> TargetConfig {
        TargetConfig::from_json(&v).unwrap()
    }

    /// A Qwen3-MoE of 3 layers, layer 1 dense (`mlp_only_layers`), by hand: hidden 32, 4 heads /
    /// 2 kv of 8, dense ffn 64, 8 experts of width 16, 2 per token.
    /// - attention: q_proj + o_proj 2 * 32 * 32 = 2048, k_proj + v_proj 2 * 32 * 16 = 1024.
    /// - sparse MLP: 2 experts 3 * 32 * (2 * 16) = 3072, router 8 * 32 = 256 (the 6 other
    ///   experts, 6 * 3 * 32 * 16 = 9216, not counted).
    /// - dense MLP: 3 * 32 * 64 = 6144.
    #[test]
    fn a_mixture_of_experts_counts_its_active_parameters() {
        let t = moe_target(
            serde_json::json!({"model_type": "qwen3_moe", "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true,
            "mlp_only_layers": [1]}),
        );
        let attention = 2048.0 + 1024.0;
        let sparse = attention + 3072.0 + 256.0;
        let dense = attention + 6144.0;
        assert_eq!(target_layers_cost(&t, 1), (sparse, 0.0));
        assert_eq!(target_layers_cost(&t, 2), (sparse + dense, 0.0));
        assert_eq!(target_layers_cost(&t, 3), (22_016.0, 0.0));
        // all experts would count 2 * 9216 more
        let all = crate::model::memory::parameter_estimate(&t) as f64;
        let embed_head_norms = 2.0 * 64.0 * 32.0 + 3.0 * (2.0 * 32.0 + 2.0 * 8.0) + 32.0;
        assert_eq!(all - embed_head_norms, 22_016.0 + 2.0 * 9216.0);
    }

    /// A Qwen3.5-MoE of 2 layers (Gated DeltaNet, gated attention), by hand: hidden 32, 4 heads /
    /// 2 kv of 8, GDN 4 value heads / 2 key heads of 8 (conv dim 2 * 16 + 32 = 64, kernel 4),
    /// 8 experts of width 8, 2 per token, shared expert of 24.
    /// - MoE: 2 experts 3 * 32 * 16 = 1536, shared expert 3 * 32 * 24 = 2304, router 8 * 32 =
    ///   256, shared expert gate 32: 4128.
    /// - Gated DeltaNet: in_proj_qkv 32 * 64 = 2048, in_proj_z 32 * 32 = 1024, in_proj_b + a
    ///   2 * 32 * 4 = 256, conv 64 * 4 = 256, out_proj 1024: 4608; rule 6 * 4 * 8 * 8 = 1536.
    /// - gated attention: q_proj 32 * 64 = 2048, k + v 2 * 32 * 16 = 1024, o_proj 1024: 4096.
    #[test]
    fn a_hybrid_mixture_of_experts_counts_the_shared_expert_and_router() {
        let t = moe_target(serde_json::json!({"model_type": "qwen3_5_moe_text",
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
            "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "shared_expert_intermediate_size": 24,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25}}));
        assert_eq!(target_layers_cost(&t, 1), (4608.0 + 4128.0, 1536.0));
        assert_eq!(
            target_layers_cost(&t, 2),
            (4608.0 + 4128.0 + 4096.0 + 4128.0, 1536.0)
        );
    }

    /// Qwen3.5-35B-A3B, by hand (h 2048, 256 experts of 512, 8 active, shared expert of 512,
    /// 16 heads / 2 kv of 256, GDN 32 value / 16 key heads of 128, conv 4):
    /// - MoE: 3 * 2048 * (8 * 512 + 512) = 28,311,552, router 256 * 2048 = 524,288, shared gate
    ///   2048: 28,837,888 in every layer.
    /// - Gated DeltaNet: 2048 * 8192 + 2 * 2048 * 4096 + 2 * 2048 * 32 + 8192 * 4 = 33,718,272;
    ///   rule 6 * 32 * 128 * 128 = 3,145,728 FLOPs per token.
    /// - gated attention: 2048 * 4096 * 3 + 2048 * 512 * 2 = 27,262,976.
    /// - 30 + 10 layers: 2,437,693,440 active parameters (with the embedding and the LM head,
    ///   2 * 248320 * 2048, 3.45 B: the "A3B"); one forward of 3072 tokens (2 * 2,437,693,440 +
    ///   30 * 3,145,728) * 3072 = 15.27 TFLOP. The issue's ~18 TFLOP is 2 * 3 B * 3072.
    #[test]
    fn the_35b_a3b_forward_counts_active_parameters() {
        let t = shape("qwen3.5-35b-a3b");
        let (params, rule) = target_layers_cost(&t, 40);
        let moe = 28_311_552.0 + 524_288.0 + 2048.0;
        assert_eq!(
            params,
            30.0 * (33_718_272.0 + moe) + 10.0 * (27_262_976.0 + moe)
        );
        assert_eq!(params, 2_437_693_440.0);
        assert_eq!(rule, 30.0 * 3_145_728.0);
        let tflop = (2.0 * params + rule) * 3072.0 / 1e12;
        assert!((tflop - 15.27).abs() < 0.01, "{tflop}");
        // the bench's drafter reads [1, 10, 19, 28, 37]: 38 layers run
        let d = drafter(&t);
        assert_eq!(d.target_layer_ids(), [1, 10, 19, 28, 37]);
        let m = ModelFlops::for_models(&t, &d);
        // layers 38 and 39: linear attention, full attention
        let unrun = 33_718_272.0 + moe + 27_262_976.0 + moe;
        assert_eq!(m.target_params, params - unrun);
    }

    /// Qwen3-30B-A3B: 48 layers of attention (q 4096, kv 512 at h 2048) and 8 of 128 experts of
    /// 768: 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 3 * 2048 * 8 * 768 + 128 * 2048).
    #[test]
    fn the_30b_a3b_forward_counts_active_parameters() {
        let t = shape("qwen3-30b-a3b");
        let (params, rule) = target_layers_cost(&t, 48);
        let layer = 16_777_216.0 + 2_097_152.0 + 37_748_736.0 + 262_144.0;
        assert_eq!((params, rule), (48.0 * layer, 0.0));
        // with the embedding and the untied head about the published 3.3 B active
        let active = params + 2.0 * 151_936.0 * 2048.0;
        assert!((3.2e9..3.4e9).contains(&active), "{active}");
        assert_eq!(drafter(&t).target_layer_ids(), [1, 12, 23, 34, 45]);
    }

    #[test]
    fn every_profile_loads_and_is_counted() {
        // every configs/bench-NAME.toml is a listed profile
        let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for entry in std::fs::read_dir(configs).unwrap() {
            let file = entry.unwrap().file_name().to_string_lossy().into_owned();
            if let Some(name) = file
                .strip_prefix("bench-")
                .and_then(|f| f.strip_suffix(".toml"))
            {
                assert!(
                    crate::bench::PROFILES.contains(&name),
                    "{file} is not in PROFILES"
                );
            }
        }
        for name in crate::bench::PROFILES {
            let path = crate::bench::profile_path(name);
            let cfg = crate::config::load(&path, &[]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            let m = ModelFlops::of(&cfg).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(m.target_params > 0.0 && m.drafter_params > 0.0, "{name}");
            let hybrid = name.starts_with("qwen3.5");
            assert_eq!(m.target_rule_flops > 0.0, hybrid, "{name}");
            if hybrid {
                assert_eq!(cfg.model.mask_token_id, 248070, "{name}");
            }
        }
    }
}
