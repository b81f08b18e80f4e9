//! Sliding-window drafter layers (Qwen3.6-27B's drafter: sliding layers and a full last one):
//! the training forward in every formulation against a reference written plainly (an explicit
//! mask over [context; block], matmul and softmax), in values and gradients; decoding against
//! the training forward; the layout through a checkpoint.

use std::collections::HashMap;

use super::*;
use dflash_tui::model::LayerType;

/// The fixture's drafter (same seed, so the same weights) with sliding layers of `window`
/// except the layers `full`.
fn sliding_fixture(window: i64, full: &[usize]) -> Fixture {
    let mut f = fixture();
    let config = f.drafter.config.with_sliding_window(window, full).unwrap();
    f.drafter = Drafter::init(config, Device::Cpu, Kind::Float, 12).unwrap();
    f
}

/// Whether the query in slot `k` of the block anchored at `a` sees key `key` of
/// [context (0..s); its block (s..s+BLOCK)], for a layer with `window` (None: full attention).
/// A sliding layer sees the positions p with q - window < p <= q, q = a + k its own position.
fn visible(a: i64, k: i64, key: i64, s: i64, window: Option<i64>) -> bool {
    let q = a + k;
    let p = if key < s { key } else { a + key - s };
    let in_window = window.is_none_or(|w| p > q - w && p <= q);
    let allowed = if key < s { key < a } else { true };
    allowed && in_window
}

/// Hugging Face's rotate-half rotary embedding of `x` [n, heads, d] at `positions`.
fn rotate(x: &Tensor, positions: &[i64], theta: f64) -> Tensor {
    let d = x.size()[2];
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| (1.0 / theta.powf(2.0 * i as f64 / d as f64)) as f32)
        .collect();
    let pos: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
    let angles = Tensor::from_slice(&pos).unsqueeze(1) * Tensor::from_slice(&inv).unsqueeze(0);
    let angles = Tensor::cat(&[&angles, &angles], -1).unsqueeze(1); // [n, 1, d]
    let half = x.narrow(2, d / 2, d / 2).neg();
    let rotated = Tensor::cat(&[half, x.narrow(2, 0, d / 2)], 2);
    x * angles.cos() + rotated * angles.sin()
}

fn norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    x * (var + eps).rsqrt() * w
}

/// The drafter's logits [N, BLOCK, vocab] for the blocks at `anchors` of one sequence, written
/// plainly from its named weights: each block on its own against the whole context, with the
/// mask of [`visible`] per layer.
fn reference_logits(f: &Fixture, toks: &[i64], feats: &Tensor, anchors: &[i64]) -> Tensor {
    let c = &f.drafter.config;
    let w: HashMap<String, Tensor> = f
        .drafter
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.shallow_clone()))
        .collect();
    let (heads, kv, d, eps) = (
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.rms_norm_eps,
    );
    let s = feats.size()[1];
    let ctx = norm(
        &feats.squeeze_dim(0).matmul(&w["fc.weight"].tr()),
        &w["hidden_norm.weight"],
        eps,
    );
    let ctx_pos: Vec<i64> = (0..s).collect();
    let mut out = Vec::new();
    for &a in anchors {
        let mut ids = vec![MASK; BLOCK as usize];
        ids[0] = toks[a as usize];
        let mut h = f
            .head
            .embed_tokens
            .index_select(0, &Tensor::from_slice(&ids));
        let q_pos: Vec<i64> = (a..a + BLOCK).collect();
        for l in 0..c.num_hidden_layers as usize {
            let p = |name: &str| &w[&format!("layers.{l}.{name}")];
            let x = norm(&h, p("input_layernorm.weight"), eps);
            let proj = |t: &Tensor, m: &str, n: i64| t.matmul(&p(m).tr()).view([-1, n, d]);
            let keys = |t: &Tensor, pos: &[i64]| {
                let k = norm(
                    &proj(t, "self_attn.k_proj.weight", kv),
                    p("self_attn.k_norm.weight"),
                    eps,
                );
                rotate(&k, pos, c.rope_theta)
            };
            let q = norm(
                &proj(&x, "self_attn.q_proj.weight", heads),
                p("self_attn.q_norm.weight"),
                eps,
            );
            let q = rotate(&q, &q_pos, c.rope_theta);
            let k = Tensor::cat(&[keys(&ctx, &ctx_pos), keys(&x, &q_pos)], 0);
            let v = Tensor::cat(
                &[
                    proj(&ctx, "self_attn.v_proj.weight", kv),
                    proj(&x, "self_attn.v_proj.weight", kv),
                ],
                0,
            );
            let group = heads / kv;
            let (k, v) = (
                k.repeat_interleave_self_int(group, 1, None).transpose(0, 1),
                v.repeat_interleave_self_int(group, 1, None).transpose(0, 1),
            ); // [heads, S + B, d]
            let window = c.layer_window(l);
            let mask: Vec<bool> = (0..BLOCK)
                .flat_map(|k| (0..s + BLOCK).map(move |key| visible(a, k, key, s, window)))
                .collect();
            let mask = Tensor::from_slice(&mask).view([1, BLOCK, s + BLOCK]);
            let scores = q.transpose(0, 1).matmul(&k.transpose(1, 2)) / (d as f64).sqrt();
            let probs = scores
                .masked_fill(&mask.logical_not(), f64::NEG_INFINITY)
                .softmax(-1, Kind::Float);
            let attn = probs.matmul(&v).transpose(0, 1).reshape([BLOCK, heads * d]);
            h = &h + attn.matmul(&p("self_attn.o_proj.weight").tr());
            let x = norm(&h, p("post_attention_layernorm.weight"), eps);
            let gate = x.matmul(&p("mlp.gate_proj.weight").tr()).silu();
            let up = x.matmul(&p("mlp.up_proj.weight").tr());
            h = &h + (gate * up).matmul(&p("mlp.down_proj.weight").tr());
        }
        let h = norm(&h, &w["norm.weight"], eps);
        out.push(h.matmul(&f.head.lm_head.tr()));
    }
    Tensor::stack(&out, 0)
}

/// The plain reference's logits and gradients for [`logits_and_grads`]'s functional.
fn reference_and_grads(
    f: &Fixture,
    toks: &[i64],
    feats: &Tensor,
    probe: &Tensor,
) -> (Tensor, Vec<(String, Tensor)>) {
    zero_grads(&f.drafter);
    let logits = reference_logits(f, toks, feats, &ANCHORS).unsqueeze(0);
    (&logits * probe).sum(Kind::Float).backward();
    (logits.detach(), grads(&f.drafter))
}

fn probe() -> Tensor {
    crate::common::randn(&[1, ANCHORS.len() as i64, BLOCK, 50], 31)
}

#[test]
fn the_plain_reference_is_the_full_attention_forward() {
    // the reference itself against today's full-attention drafter
    let f = fixture();
    let feats = features(21);
    let b = batch(&tokens(), &ANCHORS, &[true; 3]);
    let want = reference_and_grads(&f, &tokens(), &feats, &probe());
    for attn in FORMULATIONS {
        assert_same(
            &format!("full, {attn}"),
            &want,
            &logits_and_grads(&f, &feats, &b, attn, &probe()),
        );
    }
}

#[test]
fn sliding_layers_match_the_plain_reference_in_values_and_gradients() {
    let feats = features(22);
    let b = batch(&tokens(), &ANCHORS, &[true; 3]);
    // windows shorter than the block (3), a little longer (6), one token (1), and longer than
    // the sequence (64: the context up to the anchor, the block causally); the second layer
    // full, or both sliding
    for (window, full) in [(3, &[1usize][..]), (6, &[1]), (64, &[1]), (1, &[])] {
        let f = sliding_fixture(window, full);
        let want = reference_and_grads(&f, &tokens(), &feats, &probe());
        for attn in FORMULATIONS {
            let what = format!("window {window}, full {full:?}, {attn}");
            let got = logits_and_grads(&f, &feats, &b, attn, &probe());
            if window > 1 {
                assert_same(&what, &want, &got);
                continue;
            }
            // a window of 1 attends to one key with weight 1: the queries get no gradient at
            // all, so rounding noise is compared in absolute terms
            assert!(rel_diff(&want.0, &got.0) < 1e-5, "{what}");
            for ((name, a), (_, b)) in want.1.iter().zip(&got.1) {
                assert!(max_diff(a, b) < 1e-5, "{what}: gradient of {name}");
            }
        }
    }
}

#[test]
fn a_sliding_layer_sees_its_window_and_its_block_causally() {
    // the visibility as a property: context and block slots outside the window change nothing
    let f = sliding_fixture(2, &[]);
    let toks = tokens();
    let base_feats = features(23);
    let base = run(&f, &toks, &base_feats, TrainAttention::AUTO);
    let (j, a) = (2, ANCHORS[2]);
    for p in 0..S {
        let feats = base_feats.copy();
        let _ = feats.narrow(1, p, 1).fill_(3.0);
        let changed = run(&f, &toks, &feats, TrainAttention::AUTO);
        for slot in 0..BLOCK {
            let d = max_diff(
                &block(&changed, j).select(0, slot),
                &block(&base, j).select(0, slot),
            );
            // two sliding layers of window 2: slot k sees context p > a + k - 2 itself, and
            // through the slots k' >= k - 1 of the first layer p > a + k' - 2
            let first = (slot - 1).max(0);
            let reach = p < a && p > a + first - 2;
            assert_eq!(d > 1e-6, reach, "slot {slot} and context position {p}: {d}");
        }
    }
    // the anchor token (slot 0) reaches every slot, but a later slot reaches no earlier one:
    // change the anchor token, then see the first slot only through slot 0
    let mut other = toks.clone();
    other[a as usize] = (other[a as usize] + 9) % 40;
    let changed = run(&f, &other, &base_feats, TrainAttention::AUTO);
    for slot in 0..BLOCK {
        let d = max_diff(
            &block(&changed, j).select(0, slot),
            &block(&base, j).select(0, slot),
        );
        // two layers of window 2 carry slot 0 up to slot 2, not to slot 3
        assert_eq!(d > 1e-6, slot < 2 * 2 - 1, "slot {slot}: {d}");
    }
}

#[test]
fn decoding_with_a_window_matches_the_training_forward() {
    let toks = tokens();
    let feats = features(24);
    for (window, full) in [(3, &[1usize][..]), (5, &[])] {
        let f = sliding_fixture(window, full);
        let train = run(&f, &toks, &feats, TrainAttention::AUTO);
        let copy = f.drafter.decode_copy().unwrap();
        for (j, &a) in ANCHORS.iter().enumerate() {
            let mut cache = copy.slot_cache(S + BLOCK + 1).unwrap();
            let at = |p: i64| Tensor::from_slice(&[p]);
            if a > 0 {
                let batch = SlotBatch::uniform(&cache, &at(0), a);
                copy.append_context_slots(
                    &feats.narrow(1, 0, a).squeeze_dim(0),
                    &batch,
                    &mut cache,
                )
                .unwrap();
            }
            let mut ids = vec![MASK; BLOCK as usize];
            ids[0] = toks[a as usize];
            let batch = SlotBatch::uniform(&cache, &at(a), BLOCK);
            let hidden = copy
                .block_slots(&f.head, &Tensor::from_slice(&ids), &batch, &mut cache)
                .unwrap();
            let d = max_diff(&copy.logits(&f.head, &hidden), &block(&train, j as i64));
            assert!(
                d < 1e-4,
                "window {window}, block {j}: decoding differs by {d}"
            );
        }
    }
}

#[test]
fn the_layout_survives_a_checkpoint_and_reads_as_the_public_code_writes_it() {
    let f = sliding_fixture(3, &[1]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = f.drafter.save(&tmp.path().join("d")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        json["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention"])
    );
    assert_eq!(json["use_sliding_window"], true);
    assert_eq!(json["sliding_window"], 3);
    let loaded =
        Drafter::load_for_target(&dir, &f.target.config, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(loaded.config, f.drafter.config);
    assert_eq!(loaded.config.layer_windows(), vec![Some(3), None]);
    assert_eq!(
        loaded.config.describe_layers().as_deref(),
        Some("1 sliding (window 3), 1 full")
    );
    // a config.json naming an unknown layer type or a window below 1 is refused by field
    for (key, value, message) in [
        (
            "layer_types",
            serde_json::json!(["sliding_attention", "chunked_attention"]),
            "field layer_types[1] = \"chunked_attention\" is not a drafter layer type",
        ),
        (
            "sliding_window",
            serde_json::json!(0),
            "field sliding_window = 0 must be a whole number of at least 1",
        ),
    ] {
        let mut bad = json.clone();
        bad[key] = value;
        std::fs::write(dir.join("config.json"), bad.to_string()).unwrap();
        let e = format!(
            "{:#}",
            Drafter::load(&dir, Device::Cpu, Kind::Float).unwrap_err()
        );
        assert!(e.contains(message), "{e}");
    }
    // the layer mix grows with added layers: the new ones attend as the last one
    let grown = loaded.with_added_layers(1, 5).unwrap();
    assert_eq!(
        grown.config.layer_types,
        Some(vec![
            LayerType::SlidingAttention,
            LayerType::FullAttention,
            LayerType::FullAttention
        ])
    );
}
