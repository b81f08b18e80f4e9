//! The target's fused norms on a GPU against the libtorch operations they replace, and target
//! forwards with and without the fused kernels (ignored here: they need a CUDA device).

use super::fused::assert_close;
use super::*;
use dflash_tui::model::ForwardRequest;

/// The zero-centred RMSNorm and the gated output norm of the fused kernels against the chains
/// of libtorch operations they replace (`ZeroCentredNorm::forward`, `GatedDeltaNet::output`):
/// rows of 5,120 (a block per row) dense and as an offset 2-D slice, heads of 256 and of 128
/// read in place from a projection (a warp per row), the gate a view of a projection whose rows
/// are 16-byte aligned and one whose rows are not; SwiGLU's product (its launch by rows and
/// column blocks); the Gated DeltaNet's gates from a projection's columns (99 % of g bit for
/// bit); float32 to 1e-6, bf16 up to a rounding.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fused_norms_equal_the_libtorch_operations() {
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    let eps = 1e-6;
    for kind in [Kind::BFloat16, Kind::Float] {
        let (rel, exact) = if kind == Kind::Float {
            (1e-6, 0.0)
        } else {
            (1e-2, 0.99)
        };
        let rand = |shape: &[i64], spread: f64| {
            (Tensor::randn(shape, (Kind::Float, dev)) * spread).to_kind(kind)
        };
        // ZeroCentredNorm::forward with scale = 1 + w in float32
        let residual = rand(&[2, 7, 5120], 3.0);
        let q_proj = rand(&[1, 9, 4 * 512 + 2 * 256], 1.0);
        let k_proj = rand(&[3, 5, 2 * 128 + 40], 1.0);
        let inputs = [
            ("the residual stream", residual.shallow_clone()),
            (
                "rows of an offset slice",
                residual.view([14, 5120]).narrow(0, 3, 5),
            ),
            (
                "q heads of 256 in a projection",
                q_proj
                    .narrow(-1, 0, 4 * 512)
                    .view([1, 9, 4, 512])
                    .narrow(-1, 0, 256),
            ),
            (
                "k heads of 128 in a projection",
                k_proj.narrow(-1, 0, 256).view([3, 5, 2, 128]),
            ),
        ];
        for (what, x) in inputs {
            let width = x.size()[x.dim() - 1];
            let scale = Tensor::randn([width], (Kind::Float, dev)) * 0.1 + 1.0;
            let got = kernels.scaled_rms_norm(&x, &scale, eps).unwrap();
            let want = x
                .to_kind(Kind::Float)
                .rms_norm([width], Some(&scale), eps)
                .to_kind(kind);
            assert!(got.is_contiguous(), "{kind:?} {what}: not dense");
            assert_close(&format!("{kind:?} {what}"), &got, &want, rel, exact);
        }
        // GatedDeltaNet::output's norm: core [B, T, Hv, dv], z a view of the projection
        let core = rand(&[2, 9, 3, 128], 0.5);
        let w = (Tensor::randn([128], (Kind::Float, dev)) * 0.1 + 1.0).to_kind(kind);
        for pad in [8i64, 7] {
            let what = format!("{kind:?} gated norm, projection rows of {}", 6 * 128 + pad);
            let y = rand(&[2, 9, 6 * 128 + pad], 2.0);
            let z = y.narrow(-1, 3 * 128, 3 * 128).view([2, 9, 3, 128]);
            let got = kernels.gated_rms_norm(&core, &z, &w, eps).unwrap();
            let normed = core
                .to_kind(Kind::Float)
                .rms_norm([128], None::<&Tensor>, eps)
                .to_kind(kind)
                * &w;
            let want = (normed.to_kind(Kind::Float) * z.to_kind(Kind::Float).silu()).to_kind(kind);
            assert_close(&what, &got, &want, rel, exact);
        }
        // SwiGLU's product over rows it reads one element at a time (300) and as vectors, two
        // blocks a row (2,056)
        for width in [300i64, 2056] {
            let both = rand(&[3, 2 * width], 2.0);
            let got = kernels.silu_mul(&both).unwrap();
            let want = both.narrow(-1, 0, width).silu() * both.narrow(-1, width, width);
            assert_close(
                &format!("{kind:?} silu(gate) * up, rows of {width}"),
                &got,
                &want,
                rel,
                exact,
            );
        }
        // the Gated DeltaNet's gates of 2 x 300 tokens x 32 heads, a and b columns of a
        // projection (rows 140 apart), against GatedDeltaNet's libtorch operations
        let proj = rand(&[2, 300, 140], 6.0);
        let (a, b) = (proj.narrow(-1, 70, 32), proj.narrow(-1, 102, 32));
        let dt_bias = rand(&[32], 1.0);
        let neg_a = -Tensor::randn([32], (Kind::Float, dev)).exp();
        let (g, beta) = kernels.gdn_gates(&a, &b, &dt_bias, &neg_a).unwrap();
        let want_g = (a.to_kind(Kind::Float) + &dt_bias).softplus() * &neg_a;
        assert!(g.is_contiguous() && beta.is_contiguous());
        assert_close(&format!("{kind:?} gates' g"), &g, &want_g, 1e-6, 0.99);
        assert_close(
            &format!("{kind:?} gates' beta"),
            &beta,
            &b.sigmoid(),
            rel,
            exact,
        );
        assert!(kernels
            .gdn_gates(&a, &b.narrow(1, 0, 10), &dt_bias, &neg_a)
            .is_err());
        // argument checks: a scale of another width, a gate of another shape
        let x = rand(&[4, 64], 1.0);
        let short = Tensor::ones([32], (Kind::Float, dev));
        assert!(kernels.scaled_rms_norm(&x, &short, eps).is_err());
        let w64 = Tensor::ones([64], (kind, dev));
        assert!(kernels
            .gated_rms_norm(&x, &x.narrow(0, 0, 2), &w64, eps)
            .is_err());
    }
}

/// A mixture of experts' combination of its routed products (`moe_combine`) against the
/// libtorch operations it replaces (`SparseMoe::experts`: the products scaled by their weights,
/// scattered back to token order and summed over each token's choices): 3,072 tokens x 8
/// choices of 2,048 (16-byte vectors) and 5 x 3 of 100 (one element at a time), float32 to
/// 1e-5, bf16 up to a rounding; and its argument checks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_moe_combine_equals_the_libtorch_operations() {
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    for kind in [Kind::BFloat16, Kind::Float] {
        let (rel, exact) = if kind == Kind::Float {
            (1e-5, 0.0)
        } else {
            (1e-2, 0.99)
        };
        for (tokens, k, hidden) in [(3072i64, 8i64, 2048i64), (5, 3, 100)] {
            let pairs = tokens * k;
            let opts = (Kind::Float, dev);
            // the products in the order of a sort by expert: a random permutation of the pairs
            let order = Tensor::randperm(pairs, (Kind::Int64, dev));
            let y = Tensor::randn([pairs, hidden], opts).to_kind(kind);
            let weights = (Tensor::rand([pairs], opts) / k as f64).to_kind(kind);
            let sorted_weights = weights.index_select(0, &order);
            let scaled = &y * sorted_weights.unsqueeze(-1);
            let mut scattered = scaled.empty_like();
            let _ = scattered.index_copy_(0, &order, &scaled);
            let want = scattered
                .view([tokens, k, hidden])
                .sum_dim_intlist(1, false, None::<Kind>);
            let mut positions = order.empty_like();
            let _ = positions.index_copy_(0, &order, &Tensor::arange(pairs, (Kind::Int64, dev)));
            let got = kernels.moe_combine(&y, &positions, &weights, k).unwrap();
            assert_close(
                &format!("{kind:?} moe_combine {tokens} x {k} of {hidden}"),
                &got,
                &want,
                rel,
                exact,
            );
        }
        let y = Tensor::zeros([12, 64], (kind, dev));
        let pos = Tensor::arange(12, (Kind::Int64, dev));
        let w = Tensor::ones([12], (kind, dev));
        assert!(
            kernels.moe_combine(&y, &pos, &w, 5).is_err(),
            "12 pairs as 5 choices"
        );
        assert!(
            kernels.moe_combine(&y, &pos, &w, 33).is_err(),
            "more choices than it takes"
        );
        assert!(kernels
            .moe_combine(&y, &pos.narrow(0, 0, 6), &w, 4)
            .is_err());
    }
}

/// Targets' forwards with the fused kernels (a hybrid's norms, gated output norms and SwiGLU
/// products; a dense target's SwiGLU products and q/k norms and rotation in `run`, of one row
/// and of two) equal those with libtorch's
/// operations up to rounding: the transformers hybrid fixture (rows of 32, a warp per row), a
/// random hybrid of its layers with rows of 1,536 (a block per row) and value heads of 128, a
/// dense Qwen3, and the Qwen3.5-MoE (shared expert) and Qwen3-MoE fixtures (the experts'
/// SwiGLU and `moe_combine`); f32 and bf16; through `run` (logits and tapped features) and the
/// slot engine's prefill and steps.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_target_forwards_with_fused_kernels_equal_the_plain_ones() {
    let (_rt, dev, _turn) = gpu();
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let conditional = fixtures.join("qwen35_targets/conditional");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(conditional.join("config.json")).unwrap())
            .unwrap();
    let text = &mut config["text_config"];
    text["hidden_size"] = 1536.into();
    text["intermediate_size"] = 512.into();
    text["linear_key_head_dim"] = 32.into();
    text["linear_value_head_dim"] = 128.into();
    let wide = tmp.path().join("wide");
    std::fs::create_dir_all(&wide).unwrap();
    std::fs::write(wide.join("config.json"), config.to_string()).unwrap();
    let dense = tiny_target_dir(&tmp.path().join("qwen3"), "qwen3", false, None, 5);
    let ids = Tensor::from_slice(&[5i64, 9, 13, 2, 7, 11, 3, 40, 1, 17]).unsqueeze(0);
    let req = ForwardRequest {
        tap_layers: vec![0, 1],
        final_hidden: false,
        logits: true,
    };
    for kind in [Kind::Float, Kind::BFloat16] {
        let tol = if kind == Kind::Float { 1e-4 } else { 0.05 };
        for family in ["fixture", "wide", "qwen3", "qwen3_5_moe", "qwen3_moe_norm"] {
            let mut target = match family {
                "fixture" => TargetModel::load(&conditional, dev, kind),
                "wide" => TargetModel::random(&wide, dev, kind, 3),
                "qwen3" => TargetModel::load(&dense, dev, kind),
                moe => TargetModel::load(&fixtures.join("moe_targets").join(moe), dev, kind),
            }
            .unwrap();
            assert!(
                target.fused_kernels().is_some(),
                "{family}: the target did not load the fused kernels"
            );
            let outputs = |target: &TargetModel| -> Vec<Tensor> {
                let out = target.run(&ids.to_device(dev), None, &req);
                let mut all = vec![out.logits.unwrap(), out.features.unwrap()];
                // two rows at once (the rows share the rotary angles of their positions)
                let two = Tensor::cat(&[&ids, &ids.flip([1])], 0).to_device(dev);
                let out = target.run(&two, None, &req);
                all.extend([out.logits.unwrap(), out.features.unwrap()]);
                tch::no_grad(|| {
                    let mut engine = TargetDecoder::new(target, 64, &[0, 1], None, None).unwrap();
                    let (logits, features) = engine.prefill(&[5, 9, 13, 2, 7]).unwrap();
                    all.extend([logits, features.unwrap()]);
                    for (q, start) in [(1i64, 5i64), (4, 6)] {
                        let step = Tensor::arange_start(20, 20 + q, (Kind::Int64, dev));
                        let (logits, features) = engine.step(&step, start).unwrap();
                        all.extend([logits, features.unwrap()]);
                    }
                });
                all
            };
            let fused = outputs(&target);
            target.set_fused_kernels(None);
            assert!(target.fused_kernels().is_none());
            let plain = outputs(&target);
            for (i, (a, b)) in plain.iter().zip(&fused).enumerate() {
                let scale = a.abs().max().double_value(&[]);
                let diff = max_diff(a, b);
                assert!(
                    diff <= tol * scale,
                    "{family} {kind:?} output {i}: {diff} off a scale of {scale}"
                );
            }
        }
    }
}

/// A Qwen3.5 gated attention layer's two kernels against the operations they replace
/// (`GatedAttention::project` and `add_output` without them): the queries and keys of a
/// projection of 4 query heads (each with its gate) and 2 key/value heads of 256, the first 64
/// of each head rotated, angles per position shared by two rows and per token, are the fused
/// norm's heads rotated by libtorch's product and addcmul (bf16 bit for bit: the same norm
/// sum; float32 to 1e-6); the output gate is `attn * gate.sigmoid()` bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gated_attention_kernels_equal_the_libtorch_operations() {
    use dflash_tui::aten_ext::fused::{rotate_half, GatedHeads};
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    let shape = GatedHeads {
        heads: 4,
        kv_heads: 2,
        head_dim: 256,
        rotary_dim: 64,
    };
    let (h, kv, d, r) = (4, 2, 256, 64);
    let (b, l, eps) = (2i64, 7i64, 1e-6);
    for kind in [Kind::BFloat16, Kind::Float] {
        let y =
            (Tensor::randn([b, l, (2 * h + 2 * kv) * d], (Kind::Float, dev)) * 2.0).to_kind(kind);
        let q_scale = Tensor::randn([d], (Kind::Float, dev)) * 0.1 + 1.0;
        let k_scale = Tensor::randn([d], (Kind::Float, dev)) * 0.1 + 1.0;
        let angles = Tensor::rand([b * l, r / 2], (Kind::Float, dev)) * 50.0;
        let cos_all = Tensor::cat(&[angles.cos(), angles.cos()], -1).to_kind(kind);
        let sin_all = Tensor::cat(&[angles.sin().neg(), angles.sin()], -1).to_kind(kind);
        for per_token in [false, true] {
            // [l, r] shared by the rows, or [b, l, r]
            let (cos, sin) = if per_token {
                (cos_all.view([b, l, r]), sin_all.view([b, l, r]))
            } else {
                (cos_all.narrow(0, 0, l), sin_all.narrow(0, 0, l))
            };
            let (q, k) = kernels
                .gated_attention_prep(&y, shape, &q_scale, &k_scale, eps, &cos, &sin)
                .unwrap();
            let rows_cos = cos.view([-1, l, 1, r]);
            let rows_sin = sin.view([-1, l, 1, r]);
            let want = |heads: Tensor, scale: &Tensor| {
                let normed = kernels.scaled_rms_norm(&heads, scale, eps).unwrap();
                let turned = rotate_half(&normed.narrow(-1, 0, r), &rows_cos, &rows_sin);
                Tensor::cat(&[turned, normed.narrow(-1, r, d - r)], -1)
            };
            let q_heads = y
                .narrow(-1, 0, 2 * h * d)
                .view([b, l, h, 2 * d])
                .narrow(-1, 0, d);
            let k_heads = y.narrow(-1, 2 * h * d, kv * d).view([b, l, kv, d]);
            for (what, got, want) in [
                ("queries", q.view([b, l, h, d]), want(q_heads, &q_scale)),
                ("keys", k.view([b, l, kv, d]), want(k_heads, &k_scale)),
            ] {
                let diff = max_diff(&got, &want);
                let bound = if kind == Kind::Float { 1e-6 } else { 0.0 };
                assert!(
                    diff <= bound * want.abs().max().double_value(&[]),
                    "{kind:?} {what} (angles per token: {per_token}): {diff} off"
                );
            }
        }
        let attn = Tensor::randn([b * l, h, d], (Kind::Float, dev)).to_kind(kind);
        let got = kernels.sigmoid_gate_mul(&attn, &y, shape).unwrap();
        let gate = y
            .narrow(-1, 0, 2 * h * d)
            .view([b, l, h, 2 * d])
            .narrow(-1, d, d)
            .reshape([b * l, h * d]);
        let want = attn.view([b * l, h * d]) * gate.sigmoid();
        assert_eq!(max_diff(&got, &want), 0.0, "{kind:?} output gate");
    }
}
