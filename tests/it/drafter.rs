//! The DFlash drafter: visibility rules of the training forward as properties, padding blocks,
//! the inference forward against the training forward, checkpoints and their exact format.

use crate::common;
mod formulations;
mod sliding;

use std::collections::BTreeSet;

use common::tiny_target_dir;
use dflash_tui::model::drafter::{
    context_bucket, tensor_names, TrainAttention, DEFAULT_GROUP_BLOCKS,
};
use dflash_tui::model::{
    AnchorBatch, Drafter, DrafterConfig, DrafterShape, FrozenHead, SlotAttention, SlotBatch,
    TargetModel,
};
use dflash_tui::train::loss::{
    block_targets, loss_and_backward, loss_and_backward_deferred, sample_anchors, BlockTargets,
    LossOptions, LossSums,
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
    fixture_with(BLOCK)
}

fn fixture_with(block_size: i64) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 11);
    let target = TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let config = DrafterConfig::for_target(
        &target.config,
        &DrafterShape {
            layers: 2,
            block_size,
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
    common::randn(&[1, S, 64], seed as u64)
}

/// Every formulation of the training attention: the dense reference, one block per chunk,
/// two blocks per chunk (3 blocks: the last chunk is padded), the automatic size.
const FORMULATIONS: [TrainAttention; 4] = [
    TrainAttention::Dense,
    TrainAttention::Chunked {
        blocks_per_chunk: 1,
    },
    TrainAttention::Chunked {
        blocks_per_chunk: 2,
    },
    TrainAttention::AUTO,
];

fn run(f: &Fixture, tokens: &[i64], feats: &Tensor, attn: TrainAttention) -> Tensor {
    let out =
        f.drafter
            .forward_train_with(&f.head, feats, &batch(tokens, &ANCHORS, &[true; 3]), attn);
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
    for attn in FORMULATIONS {
        let base = run(&f, &toks, &base_feats, attn);
        for (j, &a) in ANCHORS.iter().enumerate() {
            for p in 0..S {
                let feats = base_feats.copy();
                let _ = feats.narrow(1, p, 1).fill_(3.0);
                let changed = run(&f, &toks, &feats, attn);
                let d = max_diff(&block(&changed, j as i64), &block(&base, j as i64));
                if p >= a {
                    assert!(
                        d < 1e-6,
                        "{attn}: block {j} (anchor {a}) saw context position {p}: {d}"
                    );
                } else {
                    assert!(
                        d > 1e-5,
                        "{attn}: block {j} (anchor {a}) ignored context position {p}"
                    );
                }
            }
        }
    }
}

#[test]
fn other_blocks_are_invisible_even_when_overlapping() {
    let f = fixture();
    let feats = features(2);
    for attn in FORMULATIONS {
        let base = run(&f, &tokens(), &feats, attn);
        for (k, &a) in ANCHORS.iter().enumerate() {
            // The only token of block k is its anchor token x[a_k].
            let mut toks = tokens();
            toks[a as usize] = (toks[a as usize] + 17) % 40;
            let changed = run(&f, &toks, &feats, attn);
            for j in 0..ANCHORS.len() {
                let d = max_diff(&block(&changed, j as i64), &block(&base, j as i64));
                if j == k {
                    assert!(d > 1e-5, "{attn}: block {j} ignored its own anchor token");
                } else {
                    assert!(d < 1e-6, "{attn}: block {j} saw block {k}'s token: {d}");
                }
            }
        }
    }
}

#[test]
fn every_slot_of_a_block_sees_the_whole_block() {
    // Bidirectional inside the block: the anchor token changes every slot's output.
    let f = fixture();
    let feats = features(3);
    for attn in FORMULATIONS {
        let base = run(&f, &tokens(), &feats, attn);
        for (j, &a) in ANCHORS.iter().enumerate() {
            let mut toks = tokens();
            toks[a as usize] = (toks[a as usize] + 9) % 40;
            let changed = run(&f, &toks, &feats, attn);
            for slot in 0..BLOCK {
                let d = max_diff(
                    &block(&changed, j as i64).select(0, slot),
                    &block(&base, j as i64).select(0, slot),
                );
                assert!(
                    d > 1e-5,
                    "{attn}: slot {slot} of block {j} does not see the anchor token"
                );
            }
        }
    }
}

#[test]
fn padding_blocks_and_anchor_zero_give_no_nan() {
    let f = fixture();
    let feats = features(4);
    for attn in FORMULATIONS.into_iter().chain([TrainAttention::Chunked {
        blocks_per_chunk: 3,
    }]) {
        zero_grads(&f.drafter);
        let out = f.drafter.forward_train_with(
            &f.head,
            &feats,
            &batch(&tokens(), &[0, 5, 0, 0], &[true, true, false, false]),
            attn,
        );
        let logits = f.drafter.logits(&f.head, &out);
        assert_eq!(logits.size(), vec![1, 4, BLOCK, 50]);
        assert!(bool::try_from(logits.isfinite().all()).unwrap(), "{attn}");
        // and gradients through them stay finite
        let loss = logits.sum(Kind::Float);
        loss.backward();
        for (name, p) in f.drafter.named_parameters() {
            let g = p.grad();
            assert!(
                bool::try_from(g.isfinite().all()).unwrap(),
                "{attn}: {name}"
            );
        }
    }
}

#[test]
fn inference_forward_matches_the_training_forward() {
    let f = fixture();
    let toks = tokens();
    let feats = features(5);
    let train = run(&f, &toks, &feats, f.drafter.train_attention());
    let dense = run(&f, &toks, &feats, TrainAttention::Dense);
    assert!(max_diff(&train, &dense) < 1e-5);
    // The decoding path (a decoding copy with fused projections, over a slot cache) gives the
    // training forward's logits for each anchor's block.
    let copy = f.drafter.decode_copy().unwrap();
    let capacity = S + BLOCK + 1;
    for (j, &a) in ANCHORS.iter().enumerate() {
        let mut cache = copy.slot_cache(capacity).unwrap();
        assert_eq!(cache.attention, SlotAttention::Dense);
        let at = |p: i64| Tensor::from_slice(&[p]);
        // context features in two pieces, as accepted tokens arrive during decoding
        let first = a / 2;
        for (from, len) in [(0, first), (first, a - first)] {
            if len > 0 {
                let batch = SlotBatch::uniform(&cache, &at(from), len);
                copy.append_context_slots(
                    &feats.narrow(1, from, len).squeeze_dim(0),
                    &batch,
                    &mut cache,
                )
                .unwrap();
            }
        }
        let mut ids = vec![MASK; BLOCK as usize];
        ids[0] = toks[a as usize];
        let ids = Tensor::from_slice(&ids);
        let batch = SlotBatch::uniform(&cache, &at(a), BLOCK);
        let hidden = copy.block_slots(&f.head, &ids, &batch, &mut cache).unwrap();
        let logits = copy.logits(&f.head, &hidden);
        let d = max_diff(&logits, &block(&train, j as i64));
        assert!(
            d < 1e-4,
            "block {j}: inference differs from training by {d}"
        );
        // the block's rows sit where the next context goes: running it again gives the same
        let again = copy.block_slots(&f.head, &ids, &batch, &mut cache).unwrap();
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

/// Layers appended to a drafter start as the identity: the grown drafter's training logits
/// equal the original's exactly, in both formulations of the attention; the new layers learn
/// (their zero output projections get gradients); the grown drafter saves and loads with the
/// new depth; a total over 64 layers is refused.
#[test]
fn added_layers_start_as_the_identity_and_learn() {
    let f = fixture();
    let grown = Drafter::init(f.drafter.config.clone(), Device::Cpu, Kind::Float, 12)
        .unwrap()
        .with_added_layers(2, 5)
        .unwrap();
    assert_eq!(grown.config.num_hidden_layers, 4);
    let names: Vec<String> = grown
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, tensor_names(4));
    let feats = features(3);
    let probe = {
        let hidden = f.drafter.config.hidden_size;
        common::randn(&[1, 3, BLOCK, hidden], 4)
    };
    for attn in [TrainAttention::Dense, TrainAttention::AUTO] {
        let want = run(&f, &tokens(), &feats, attn);
        let b = batch(&tokens(), &ANCHORS, &[true; 3]);
        zero_grads(&grown);
        let hidden = grown.forward_train_with(&f.head, &feats, &b, attn);
        let got = grown.logits(&f.head, &hidden);
        assert_eq!(max_diff(&want, &got), 0.0, "{attn}");
        // a functional of the hidden states: every new layer's output projections get a
        // gradient (the layers before them are unchanged, their inputs not zero)
        (&hidden * &probe).sum(Kind::Float).backward();
        for (name, g) in grads(&grown) {
            let new_output = (name.starts_with("layers.2.") || name.starts_with("layers.3."))
                && (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight"));
            if new_output {
                assert!(g.abs().max().double_value(&[]) > 0.0, "{attn}: {name}");
            }
        }
    }
    // the new layers' other weights are drawn as a fresh drafter's, by seed
    let again = Drafter::init(f.drafter.config.clone(), Device::Cpu, Kind::Float, 12)
        .unwrap()
        .with_added_layers(2, 5)
        .unwrap();
    for ((name, a), (_, b)) in grown
        .named_parameters()
        .into_iter()
        .zip(again.named_parameters())
    {
        assert_eq!(max_diff(a, b), 0.0, "{name}");
        if name.starts_with("layers.3.") && name.ends_with("q_proj.weight") {
            let std = a.std(true).double_value(&[]);
            assert!((0.015..0.025).contains(&std), "{name}: std {std}");
        }
    }

    let tmp = tempfile::tempdir().unwrap();
    let dir = grown.save(&tmp.path().join("grown")).unwrap();
    let loaded = Drafter::load(&dir, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(loaded.config.num_hidden_layers, 4);
    // saved as bf16, as every checkpoint
    for ((name, a), (_, b)) in grown
        .named_parameters()
        .into_iter()
        .zip(loaded.named_parameters())
    {
        let rounded = a.to_kind(Kind::BFloat16).to_kind(Kind::Float);
        assert_eq!(max_diff(&rounded, b), 0.0, "{name}");
    }

    let err = Drafter::init(f.drafter.config.clone(), Device::Cpu, Kind::Float, 12)
        .unwrap()
        .with_added_layers(63, 5)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.drafter_added_layers = 63") && err.contains("has 2 layers"),
        "{err}"
    );
}

fn zero_grads(d: &Drafter) {
    for (_, p) in d.named_parameters() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// Copies of every parameter's gradient, by name (zeros where none was computed).
fn grads(d: &Drafter) -> Vec<(String, Tensor)> {
    d.named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let g = p.grad();
            let g = if g.defined() {
                g.copy()
            } else {
                p.zeros_like()
            };
            (name, g)
        })
        .collect()
}

/// max |a - b| relative to the size of a (with a floor, for gradients near zero).
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let scale = a.abs().max().double_value(&[]).max(1e-3);
    max_diff(a, b) / scale
}

fn assert_same(
    what: &str,
    (la, ga): &(Tensor, Vec<(String, Tensor)>),
    (lb, gb): &(Tensor, Vec<(String, Tensor)>),
) {
    assert_eq!(la.size(), lb.size(), "{what}");
    let d = rel_diff(la, lb);
    assert!(d < 1e-5, "{what}: logits differ by {d} (relative)");
    for ((name, a), (_, b)) in ga.iter().zip(gb) {
        let d = rel_diff(a, b);
        assert!(
            d < 1e-4,
            "{what}: gradient of {name} differs by {d} (relative)"
        );
        assert!(
            bool::try_from(b.isfinite().all()).unwrap(),
            "{what}: {name}"
        );
    }
}

/// Logits and every parameter's gradient of a fixed random functional of the logits.
fn logits_and_grads(
    f: &Fixture,
    feats: &Tensor,
    b: &AnchorBatch,
    attn: TrainAttention,
    probe: &Tensor,
) -> (Tensor, Vec<(String, Tensor)>) {
    zero_grads(&f.drafter);
    let logits = f.drafter.logits(
        &f.head,
        &f.drafter.forward_train_with(&f.head, feats, b, attn),
    );
    (&logits * probe).sum(Kind::Float).backward();
    (logits.detach(), grads(&f.drafter))
}
