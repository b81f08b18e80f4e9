//! The training forward's formulations give the same numbers: chunked against dense attention
//! (logits and gradients), the deferred loss, any loss chunk size; the text form of the setting.

use super::*;

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
        // the chunked forward leaves padding blocks out (zero states): compared on the valid
        // blocks, the functional reading those only
        let valid = b.valid.to_kind(Kind::Float).view([rows, n, 1, 1]);
        let probe = common::randn(&[rows, n, block, 50], 50 + i as u64) * &valid;
        let on_valid = |(logits, grads): (Tensor, NamedGrads)| (logits * &valid, grads);
        let dense = on_valid(logits_and_grads(
            &f,
            &feats,
            &b,
            TrainAttention::Dense,
            &probe,
        ));
        for &c in sizes {
            let attn = TrainAttention::Chunked {
                blocks_per_chunk: c,
            };
            let (logits, grads) = logits_and_grads(&f, &feats, &b, attn, &probe);
            let padding = (&logits * valid.ones_like().g_sub(&valid))
                .abs()
                .max()
                .double_value(&[]);
            assert_eq!(padding, 0.0, "case {i}, {attn}: padding blocks computed");
            let chunked = on_valid((logits, grads));
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
        ("grouped", TrainAttention::GROUPED),
        (
            "grouped:128",
            TrainAttention::Grouped {
                blocks_per_group: 128,
            },
        ),
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
    for bad in [
        "",
        "sparse",
        "chunked:",
        "chunked:-1",
        "chunked:x",
        "grouped:",
        "grouped:48",
        "grouped:2048",
        "grouped:-2",
    ] {
        assert!(bad.parse::<TrainAttention>().is_err(), "{bad}");
    }
    assert_eq!(TrainAttention::default(), TrainAttention::GROUPED);
    assert_eq!(
        "grouped:0".parse::<TrainAttention>().unwrap(),
        TrainAttention::GROUPED
    );
    // the group size: the default where none is given, none for the other forms
    assert_eq!(
        TrainAttention::GROUPED.blocks_per_group(),
        Some(DEFAULT_GROUP_BLOCKS)
    );
    assert_eq!(
        "grouped:32"
            .parse::<TrainAttention>()
            .unwrap()
            .blocks_per_group(),
        Some(32)
    );
    assert_eq!(TrainAttention::AUTO.blocks_per_group(), None);
    // the grouped form falls back to the automatic chunked one: its chunk size
    assert_eq!(
        TrainAttention::GROUPED.blocks_per_chunk(16, 1522, 32, 8),
        TrainAttention::AUTO.blocks_per_chunk(16, 1522, 32, 8)
    );
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
    assert_eq!(f.drafter.train_attention(), TrainAttention::GROUPED);
    f.drafter.set_train_attention(TrainAttention::Dense);
    assert_eq!(f.drafter.train_attention(), TrainAttention::Dense);
}
