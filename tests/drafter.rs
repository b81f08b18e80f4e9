//! The DFlash drafter: visibility rules of the training forward as properties, padding blocks,
//! the inference forward against the training forward, checkpoints and their exact format.

mod common;

use std::collections::BTreeSet;

use common::tiny_target_dir;
use dflash_tui::model::drafter::tensor_names;
use dflash_tui::model::{
    AnchorBatch, Drafter, DrafterConfig, DrafterShape, FrozenHead, KvCache, TargetModel,
};
use tch::{Device, Kind, Tensor};

const BLOCK: i64 = 4;
const MASK: i64 = 49;

struct Fixture {
    _tmp: tempfile::TempDir,
    target: TargetModel,
    drafter: Drafter,
    head: FrozenHead,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 11);
    let target = TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let config = DrafterConfig::for_target(
        &target.config,
        &DrafterShape {
            layers: 2,
            block_size: BLOCK,
            mask_token_id: MASK,
            target_layer_ids: None,
            num_taps: 2,
        },
    )
    .unwrap();
    let drafter = Drafter::init(config, Device::Cpu, Kind::Float, 12).unwrap();
    let head = FrozenHead::from_target(&target, Device::Cpu, Kind::Float);
    Fixture {
        _tmp: tmp,
        target,
        drafter,
        head,
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

const S: i64 = 14;
const ANCHORS: [i64; 3] = [2, 6, 7]; // blocks 6..9 and 7..10 overlap

fn tokens() -> Vec<i64> {
    (0..S).map(|i| (i * 5 + 1) % 40).collect()
}

fn batch(tokens: &[i64], anchors: &[i64], valid: &[bool]) -> AnchorBatch {
    AnchorBatch {
        input_ids: Tensor::from_slice(tokens).unsqueeze(0),
        anchors: Tensor::from_slice(anchors).unsqueeze(0),
        valid: Tensor::from_slice(valid).unsqueeze(0),
    }
}

fn features(seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn([1, S, 64], (Kind::Float, Device::Cpu))
}

fn run(f: &Fixture, tokens: &[i64], feats: &Tensor) -> Tensor {
    let out = f
        .drafter
        .forward_train(&f.head, feats, &batch(tokens, &ANCHORS, &[true; 3]));
    f.drafter.logits(&f.head, &out)
}

/// Logits of block j: [block, vocab].
fn block(logits: &Tensor, j: i64) -> Tensor {
    logits.select(1, j).squeeze_dim(0)
}

#[test]
fn context_at_or_after_the_anchor_is_invisible_before_it_visible() {
    let f = fixture();
    let toks = tokens();
    let base_feats = features(1);
    let base = run(&f, &toks, &base_feats);
    for (j, &a) in ANCHORS.iter().enumerate() {
        for p in 0..S {
            let feats = base_feats.copy();
            let _ = feats.narrow(1, p, 1).fill_(3.0);
            let changed = run(&f, &toks, &feats);
            let d = max_diff(&block(&changed, j as i64), &block(&base, j as i64));
            if p >= a {
                assert!(
                    d < 1e-6,
                    "block {j} (anchor {a}) saw context position {p}: {d}"
                );
            } else {
                assert!(
                    d > 1e-5,
                    "block {j} (anchor {a}) ignored context position {p}"
                );
            }
        }
    }
}

#[test]
fn other_blocks_are_invisible_even_when_overlapping() {
    let f = fixture();
    let feats = features(2);
    let base = run(&f, &tokens(), &feats);
    for (k, &a) in ANCHORS.iter().enumerate() {
        // The only token of block k is its anchor token x[a_k].
        let mut toks = tokens();
        toks[a as usize] = (toks[a as usize] + 17) % 40;
        let changed = run(&f, &toks, &feats);
        for j in 0..ANCHORS.len() {
            let d = max_diff(&block(&changed, j as i64), &block(&base, j as i64));
            if j == k {
                assert!(d > 1e-5, "block {j} ignored its own anchor token");
            } else {
                assert!(d < 1e-6, "block {j} saw block {k}'s token: {d}");
            }
        }
    }
}

#[test]
fn every_slot_of_a_block_sees_the_whole_block() {
    // Bidirectional inside the block: the anchor token changes every slot's output.
    let f = fixture();
    let feats = features(3);
    let base = run(&f, &tokens(), &feats);
    let mut toks = tokens();
    toks[2] = (toks[2] + 9) % 40;
    let changed = run(&f, &toks, &feats);
    for slot in 0..BLOCK {
        let d = max_diff(
            &block(&changed, 0).select(0, slot),
            &block(&base, 0).select(0, slot),
        );
        assert!(d > 1e-5, "slot {slot} does not see the anchor token");
    }
}

#[test]
fn padding_blocks_and_anchor_zero_give_no_nan() {
    let f = fixture();
    let feats = features(4);
    let out = f.drafter.forward_train(
        &f.head,
        &feats,
        &batch(&tokens(), &[0, 5, 0, 0], &[true, true, false, false]),
    );
    let logits = f.drafter.logits(&f.head, &out);
    assert_eq!(logits.size(), vec![1, 4, BLOCK, 50]);
    assert!(bool::try_from(logits.isfinite().all()).unwrap());
    // and gradients through them stay finite
    let loss = logits.sum(Kind::Float);
    loss.backward();
    for (name, p) in f.drafter.named_parameters() {
        let g = p.grad();
        assert!(bool::try_from(g.isfinite().all()).unwrap(), "{name}");
    }
}

#[test]
fn inference_forward_matches_the_training_forward() {
    let f = fixture();
    let toks = tokens();
    let feats = features(5);
    let train = run(&f, &toks, &feats);
    for (j, &a) in ANCHORS.iter().enumerate() {
        let mut cache = KvCache::new();
        // context features in two pieces, as accepted tokens arrive during decoding
        let first = a / 2;
        let ids = |x: i64| {
            let mut b = vec![MASK; BLOCK as usize];
            b[0] = x;
            Tensor::from_slice(&b).unsqueeze(0)
        };
        if first > 0 {
            let _ = f.drafter.forward_block(
                &f.head,
                Some(&feats.narrow(1, 0, first)),
                &mut cache,
                &ids(toks[first as usize]),
                first,
            );
        }
        let hidden = f.drafter.forward_block(
            &f.head,
            Some(&feats.narrow(1, first, a - first)),
            &mut cache,
            &ids(toks[a as usize]),
            a,
        );
        assert_eq!(cache.len(), a);
        let logits = f.drafter.logits(&f.head, &hidden).squeeze_dim(0);
        let d = max_diff(&logits, &block(&train, j as i64));
        assert!(
            d < 1e-4,
            "block {j}: inference differs from training by {d}"
        );
        // roll back and run again without new features: same result
        cache.truncate(a);
        let again = f
            .drafter
            .forward_block(&f.head, None, &mut cache, &ids(toks[a as usize]), a);
        assert!(max_diff(&again, &hidden) < 1e-6);
    }
    // features of the target feed the drafter directly
    let out = f.target.run(
        &Tensor::from_slice(&toks).unsqueeze(0),
        None,
        &dflash_tui::model::ForwardRequest {
            tap_layers: f.drafter.config.target_layer_ids().to_vec(),
            ..Default::default()
        },
    );
    assert_eq!(out.features.unwrap().size(), vec![1, S, 64]);
}

#[test]
fn checkpoint_round_trip_and_exact_public_format() {
    let f = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let first = f.drafter.save(&tmp.path().join("ckpt1")).unwrap();
    let loaded =
        Drafter::load_for_target(&first, &f.target.config, Device::Cpu, Kind::Float).unwrap();
    let second = loaded.save(&tmp.path().join("ckpt2")).unwrap();
    let reloaded = Drafter::load(&second, Device::Cpu, Kind::Float).unwrap();
    // bf16 on disk: saving what was loaded gives the same bytes, and identical logits
    assert_eq!(
        std::fs::read(first.join("model.safetensors")).unwrap(),
        std::fs::read(second.join("model.safetensors")).unwrap()
    );
    let feats = features(6);
    let b = batch(&tokens(), &ANCHORS, &[true; 3]);
    let l1 = loaded.logits(&f.head, &loaded.forward_train(&f.head, &feats, &b));
    let l2 = reloaded.logits(&f.head, &reloaded.forward_train(&f.head, &feats, &b));
    assert_eq!(max_diff(&l1, &l2), 0.0);
    let l0 = f
        .drafter
        .logits(&f.head, &f.drafter.forward_train(&f.head, &feats, &b));
    assert!(
        max_diff(&l0, &l1) < 0.05,
        "bf16 rounding moved logits by {}",
        max_diff(&l0, &l1)
    );

    // config.json: exactly the keys of spec §6
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(first.join("config.json")).unwrap()).unwrap();
    let keys: BTreeSet<&str> = config
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let spec: BTreeSet<&str> = [
        "architectures",
        "model_type",
        "block_size",
        "dflash_config",
        "num_target_layers",
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "attention_bias",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "torch_dtype",
    ]
    .into();
    assert_eq!(keys, spec);
    let dflash: BTreeSet<&str> = config["dflash_config"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(dflash, ["mask_token_id", "target_layer_ids"].into());
    assert_eq!(config["architectures"][0], "DFlashDraftModel");
    assert_eq!(config["model_type"], "qwen3");
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(config["dflash_config"]["mask_token_id"], MASK);

    // model.safetensors: exactly the public tensor names, all bf16
    let data = std::fs::read(first.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let names: BTreeSet<String> = st.names().into_iter().map(str::to_string).collect();
    let mut want = BTreeSet::new();
    for i in 0..2 {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"] {
            want.insert(format!("layers.{i}.self_attn.{p}.weight"));
        }
        for p in ["gate_proj", "up_proj", "down_proj"] {
            want.insert(format!("layers.{i}.mlp.{p}.weight"));
        }
        want.insert(format!("layers.{i}.input_layernorm.weight"));
        want.insert(format!("layers.{i}.post_attention_layernorm.weight"));
    }
    for n in ["fc.weight", "hidden_norm.weight", "norm.weight"] {
        want.insert(n.to_string());
    }
    assert_eq!(names, want);
    assert_eq!(tensor_names(2).into_iter().collect::<BTreeSet<_>>(), want);
    for (_, view) in st.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::BF16);
    }
    assert_eq!(st.tensor("fc.weight").unwrap().shape(), &[32, 64]);
}

#[test]
fn fresh_drafter_follows_the_initialisation_recipe() {
    let f = fixture();
    for (name, p) in f.drafter.named_parameters() {
        if name.ends_with("norm.weight") {
            assert_eq!(p.min().double_value(&[]), 1.0, "{name}");
            assert_eq!(p.max().double_value(&[]), 1.0, "{name}");
        } else {
            let std = p.std(true).double_value(&[]);
            assert!((0.015..0.025).contains(&std), "{name}: std {std}");
            assert!(
                p.mean(Kind::Float).double_value(&[]).abs() < 0.005,
                "{name}"
            );
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_drafter() {
    let f = fixture();
    let again = Drafter::init(f.drafter.config.clone(), Device::Cpu, Kind::Float, 12).unwrap();
    let other = Drafter::init(f.drafter.config.clone(), Device::Cpu, Kind::Float, 13).unwrap();
    for ((name, a), ((_, b), (_, c))) in f.drafter.named_parameters().into_iter().zip(
        again
            .named_parameters()
            .into_iter()
            .zip(other.named_parameters()),
    ) {
        assert_eq!(max_diff(a, b), 0.0, "{name}");
        if !name.ends_with("norm.weight") {
            assert!(max_diff(a, c) > 0.0, "{name}");
        }
    }
}
