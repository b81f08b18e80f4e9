//! The DFlash drafter: visibility rules of the training forward as properties, padding blocks,
//! the inference forward against the training forward, checkpoints and their exact format.

use crate::common;
mod sliding;

use std::collections::BTreeSet;

use common::tiny_target_dir;
use dflash_tui::model::drafter::{context_bucket, tensor_names, TrainAttention};
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

/// Random batch: `lengths` per row (padded to the longest), loss on every position, up to
/// `num_anchors` anchors per row drawn as the trainer draws them (sorted; rows with fewer
/// candidates padded with invalid blocks at anchor 0). Optionally forces anchor 0 into row 0.
fn random_batch(
    lengths: &[usize],
    block: usize,
    num_anchors: usize,
    seed: u64,
    anchor_zero: bool,
) -> (
    AnchorBatch,
    Vec<i64>,
    Vec<i64>,
    dflash_tui::train::loss::AnchorPlan,
) {
    let stride = *lengths.iter().max().unwrap();
    let mut ids = vec![0i64; lengths.len() * stride];
    let mut mask = vec![0i64; lengths.len() * stride];
    for (r, &len) in lengths.iter().enumerate() {
        for p in 0..len {
            ids[r * stride + p] = ((p * 7 + r * 13 + seed as usize) % 45) as i64;
            mask[r * stride + p] = 1;
        }
    }
    let mut plan = sample_anchors(&mask, lengths, stride, block, num_anchors, seed);
    if anchor_zero {
        plan.anchors[0] = 0;
        plan.valid[0] = true;
    }
    let rows = lengths.len() as i64;
    let n = plan.per_row as i64;
    let batch = AnchorBatch {
        input_ids: Tensor::from_slice(&ids).view([rows, stride as i64]),
        anchors: Tensor::from_slice(&plan.anchors).view([rows, n]),
        valid: Tensor::from_slice(&plan.valid).view([rows, n]),
    };
    (batch, ids, mask, plan)
}

fn random_features(rows: i64, s: i64, seed: i64) -> Tensor {
    common::randn(&[rows, s, 64], seed as u64)
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

/// (block size, row lengths, anchors per row, chunk sizes to try, anchor 0 forced)
type Case<'a> = (i64, &'a [usize], usize, &'a [usize], bool);

#[test]
fn chunked_attention_matches_dense_logits_and_gradients() {
    let cases: &[Case] = &[
        // one row, overlapping blocks, N = 9 not divisible by 2 or 4
        (4, &[14], 9, &[1, 2, 4, 9, 0], true),
        // two rows, the second with 5 candidates: 2 padding blocks; N = 7, C = 3 pads 2 slots
        (3, &[23, 7], 7, &[3, 5, 0], false),
        // block 5, longer context, N = 12 with C = 5 -> 3 chunks of 4
        (5, &[31, 31], 12, &[5, 12, 0], true),
        // block 2 (the smallest), N = 16
        (2, &[20, 17, 6], 16, &[3, 16, 0], true),
        // C larger than N: one chunk
        (4, &[10], 3, &[8], true),
        // a long context (bucketed to 640): the calls of early chunks read only its start
        (4, &[600, 420], 40, &[2, 4, 0], false),
    ];
    for (i, &(block, lengths, num_anchors, sizes, zero)) in cases.iter().enumerate() {
        let f = fixture_with(block);
        let (b, _, _, plan) =
            random_batch(lengths, block as usize, num_anchors, 100 + i as u64, zero);
        let rows = lengths.len() as i64;
        let s = *lengths.iter().max().unwrap() as i64;
        let feats = random_features(rows, s, 7 + i as i64);
        let n = plan.per_row as i64;
        let probe = common::randn(&[rows, n, block, 50], 50 + i as u64);
        let dense = logits_and_grads(&f, &feats, &b, TrainAttention::Dense, &probe);
        for &c in sizes {
            let attn = TrainAttention::Chunked {
                blocks_per_chunk: c,
            };
            let chunked = logits_and_grads(&f, &feats, &b, attn, &probe);
            assert_same(
                &format!("case {i} (block {block}, S {s}, N {n}), {attn}"),
                &dense,
                &chunked,
            );
        }
    }
}

type NamedGrads = Vec<(String, Tensor)>;

/// A batch of two rows (26 and 15 tokens, block 4, loss on random spans) for the loss tests,
/// with drafter features and teacher states drawn from `seed`.
struct LossCase {
    f: Fixture,
    b: AnchorBatch,
    targets: BlockTargets,
    valid: Vec<bool>,
    feats: Tensor,
    teacher: Tensor,
}

impl LossCase {
    fn new(seed: i64) -> Self {
        let block = 4usize;
        let lengths = [26usize, 15];
        let f = fixture_with(block as i64);
        let (b, ids, mask, plan) = random_batch(&lengths, block, 10, 9, true);
        let targets = block_targets(&ids, &mask, &lengths, 26, &plan, block, 7.0);
        let feats = random_features(2, 26, seed);
        let teacher = common::randn(&[2, 26, 32], seed as u64 + 1);
        LossCase {
            f,
            b,
            targets,
            valid: plan.valid,
            feats,
            teacher,
        }
    }

    /// One training loss pass (forward with `attn`, loss, backward) from zeroed gradients:
    /// the loss sums and every parameter's gradient.
    fn pass(
        &self,
        attn: TrainAttention,
        soft: bool,
        opts: &LossOptions,
        scale: f64,
    ) -> (LossSums, NamedGrads) {
        let f = &self.f;
        zero_grads(&f.drafter);
        let hidden = f
            .drafter
            .forward_train_with(&f.head, &self.feats, &self.b, attn);
        let teacher = soft.then_some(&self.teacher);
        let (sums, pending) = loss_and_backward(
            &hidden,
            &f.head.lm_head,
            &self.targets,
            &self.valid,
            teacher,
            opts,
            scale,
        );
        pending.expect("a backward pass").run();
        assert!(sums.weight > 0.0 && sums.blocks > 0.0);
        assert!(sums.loss().is_finite(), "{attn}");
        (sums, grads(&f.drafter))
    }
}

/// The same loss sums (within 1e-5 relative) and gradients (within 1e-4 relative).
fn assert_same_loss_and_grads(
    what: &str,
    reference: &(LossSums, NamedGrads),
    other: &(LossSums, NamedGrads),
) {
    let ((ref_sums, ref_grads), (sums, g)) = (reference, other);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * (1.0 + a.abs());
    assert!(
        close(ref_sums.weighted_loss, sums.weighted_loss),
        "{what}: {ref_sums:?} vs {sums:?}"
    );
    assert!(close(ref_sums.weight, sums.weight), "{what}");
    assert!(
        close(ref_sums.weighted_correct, sums.weighted_correct),
        "{what}"
    );
    assert!(close(ref_sums.accepted, sums.accepted), "{what}");
    assert_eq!(ref_sums.blocks, sums.blocks, "{what}");
    for ((name, a), (_, b)) in ref_grads.iter().zip(g) {
        let d = rel_diff(a, b);
        assert!(
            d < 1e-4,
            "{what}: gradient of {name} differs by {d} (relative)"
        );
    }
}

#[test]
fn loss_and_gradients_are_the_same_with_both_formulations() {
    let case = LossCase::new(21);
    let plain = LossOptions {
        kl_weight: 0.0,
        kl_temperature: 1.0,
        streak_alpha: 0.0,
        streak_tau_power: 0.0,
        chunk_rows: 7,
        kernels: None,
    };
    let soft_streak = LossOptions {
        kl_weight: 0.4,
        kl_temperature: 2.0,
        streak_alpha: 0.3,
        streak_tau_power: 1.0,
        chunk_rows: 5,
        kernels: None,
    };
    for (opts, soft) in [(&plain, false), (&soft_streak, true)] {
        let reference = case.pass(TrainAttention::Dense, soft, opts, 0.5);
        for attn in [
            TrainAttention::AUTO,
            TrainAttention::Chunked {
                blocks_per_chunk: 3,
            },
        ] {
            let other = case.pass(attn, soft, opts, 0.5);
            assert_same_loss_and_grads(&attn.to_string(), &reference, &other);
        }
    }
}

#[test]
fn loss_and_gradients_do_not_depend_on_the_loss_chunk_size() {
    let case = LossCase::new(23);
    for (kl_weight, streak_alpha, streak_tau_power, soft) in
        [(0.0, 0.0, 0.0, false), (0.4, 0.3, 2.0, true)]
    {
        let pass = |chunk_rows| {
            let opts = LossOptions {
                kl_weight,
                kl_temperature: 2.0,
                streak_alpha,
                streak_tau_power,
                chunk_rows,
                kernels: None,
            };
            case.pass(TrainAttention::AUTO, soft, &opts, 1.0)
        };
        // everything in one chunk against one row per chunk and uneven chunks
        let reference = pass(100_000);
        for rows in [1, 4, 7] {
            assert_same_loss_and_grads(&format!("chunks of {rows}"), &reference, &pass(rows));
        }
    }
}

#[test]
fn deferred_loss_gives_the_same_sums_and_gradients() {
    let block = 4usize;
    let lengths = [20usize, 11];
    let f = fixture_with(block as i64);
    let (b, ids, mask, plan) = random_batch(&lengths, block, 6, 3, false);
    let targets = block_targets(&ids, &mask, &lengths, 20, &plan, block, 7.0);
    let feats = random_features(2, 20, 31);
    let opts = LossOptions {
        kl_weight: 0.0,
        kl_temperature: 1.0,
        streak_alpha: 0.2,
        streak_tau_power: 2.0,
        chunk_rows: 6,
        kernels: None,
    };
    let run_once = |deferred: bool| {
        zero_grads(&f.drafter);
        let hidden = f.drafter.forward_train(&f.head, &feats, &b);
        let args = (
            &hidden,
            &f.head.lm_head,
            &targets,
            &plan.valid[..],
            None,
            &opts,
            1.0,
        );
        let (sums, pending) = if deferred {
            let (t, p) =
                loss_and_backward_deferred(args.0, args.1, args.2, args.3, args.4, args.5, args.6);
            // sums add up on the device
            let mut total = dflash_tui::train::loss::LossTensors::zeros(Device::Cpu);
            total.add(&t);
            total.add(&t);
            let two = total.to_host();
            let one = t.to_host();
            assert!((two.weight - 2.0 * one.weight).abs() < 1e-9);
            (one, p)
        } else {
            loss_and_backward(args.0, args.1, args.2, args.3, args.4, args.5, args.6)
        };
        pending.unwrap().run();
        (sums, grads(&f.drafter))
    };
    let (a, ga) = run_once(false);
    let (b2, gb) = run_once(true);
    assert_eq!(a, b2);
    for ((name, x), (_, y)) in ga.iter().zip(&gb) {
        assert_eq!(max_diff(x, y), 0.0, "{name}");
    }
    // no valid block: zero sums, nothing to run
    let none = vec![false; plan.valid.len()];
    let hidden = f.drafter.forward_train(&f.head, &feats, &b);
    let (sums, pending) =
        loss_and_backward_deferred(&hidden, &f.head.lm_head, &targets, &none, None, &opts, 1.0);
    assert_eq!(sums.to_host(), LossSums::default());
    assert!(pending.is_none());
}

#[test]
fn train_attention_text_form_and_chunk_size() {
    for (text, want) in [
        ("dense", TrainAttention::Dense),
        ("chunked", TrainAttention::AUTO),
        (
            " Chunked:16 ",
            TrainAttention::Chunked {
                blocks_per_chunk: 16,
            },
        ),
    ] {
        assert_eq!(text.parse::<TrainAttention>().unwrap(), want);
        assert_eq!(want.to_string().parse::<TrainAttention>().unwrap(), want);
    }
    for bad in ["", "sparse", "chunked:", "chunked:-1", "chunked:x"] {
        assert!(bad.parse::<TrainAttention>().is_err(), "{bad}");
    }
    assert_eq!(TrainAttention::default(), TrainAttention::AUTO);
    let json = serde_json::to_string(&TrainAttention::Chunked {
        blocks_per_chunk: 8,
    })
    .unwrap();
    assert_eq!(json, "\"chunked:8\"");
    assert_eq!(
        serde_json::from_str::<TrainAttention>("\"dense\"").unwrap(),
        TrainAttention::Dense
    );
    // automatic size: power of two near sqrt(640 * kv/heads * S) / B, GQA 32/8, B = 16;
    // it depends on the context only, never on the number of blocks (the calls' shapes
    // must repeat)
    let auto = |s| TrainAttention::AUTO.blocks_per_chunk(16, s, 32, 8);
    assert_eq!(auto(256), Some(16));
    assert_eq!(auto(1024), Some(32));
    assert_eq!(auto(3072), Some(32));
    assert_eq!(auto(8192), Some(64));
    let c16 = TrainAttention::Chunked {
        blocks_per_chunk: 16,
    };
    assert_eq!(c16.blocks_per_chunk(16, 3072, 32, 8), Some(16));
    assert_eq!(c16.blocks_per_chunk(16, 128, 32, 8), Some(16));
    assert_eq!(
        TrainAttention::Dense.blocks_per_chunk(16, 3072, 32, 8),
        None
    );
    // context lengths in buckets: few distinct lengths, little padding
    let mut buckets = std::collections::BTreeSet::new();
    for s in 1..=3072i64 {
        let b = context_bucket(s);
        assert!(b >= s, "{s} -> {b}");
        assert!(
            b - s < 128.max((s + 15) / 16),
            "{s} -> {b}: too much padding"
        );
        assert_eq!(context_bucket(b), b, "a bucket is its own bucket");
        buckets.insert(b);
    }
    assert_eq!(buckets.len(), 24, "{buckets:?}");
    assert_eq!(context_bucket(5000), 5120, "256 apart above 4096");
    // the drafter's own choice
    let mut f = fixture();
    assert_eq!(f.drafter.train_attention(), TrainAttention::AUTO);
    f.drafter.set_train_attention(TrainAttention::Dense);
    assert_eq!(f.drafter.train_attention(), TrainAttention::Dense);
}
