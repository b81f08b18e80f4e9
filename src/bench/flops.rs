//! The model FLOPs a benchmark divides by its time (benchmarks spec): 2 FLOPs per parameter and
//! token for the target's forward, 6 per parameter and drafted position for the drafter's forward
//! and backward, 4 H V per drafted position for the frozen LM head's forward and backward. What
//! is counted of a target layer: its projections and MLP (and a Gated DeltaNet layer's
//! convolution, a product with its own weights too), and a Gated DeltaNet layer's state products;
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
    // a mixture of experts counts the experts a token is routed to (active parameters)
    let width = config.active_mlp_width(layer as i64) as f64;
    let mlp = 3.0 * h * width;
    let Some(hybrid) = &config.hybrid else {
        return (layer_params(h, q, kv, width), 0.0);
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

    #[test]
    fn every_profile_loads_and_is_counted() {
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
