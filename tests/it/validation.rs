//! Held-out validation: the walk tau against real speculative decoding, and the teacher-forced
//! pass on a tiny random model (the training objective's numbers, deterministic, in range).

use crate::common;

use std::sync::atomic::AtomicBool;

use common::proposers::{AlwaysProposes, Oracle};
use common::tiny_models;
use dflash_tui::data::store::Sample;
use dflash_tui::eval::speculative::{dflash, greedy, speculative_decode, BlockDrafter};
use dflash_tui::model::{AnchorBatch, Drafter, ForwardRequest, FrozenHead, TargetModel};
use dflash_tui::train::loss::{
    block_targets, loss_and_backward, AnchorPlan, BlockTargets, LossOptions,
};
use dflash_tui::train::optim::{AdamW, AdamWConfig};
use dflash_tui::train::validation::{validate, walk, Validation, ValidationOptions};
use tch::{Device, Tensor};

/// The acceptance length at each position of `answer` of a drafter whose block at position i
/// is `draft(i)`: its leading slots k >= 1 equal to `answer[i + k]`.
fn acceptance(answer: &[u32], block: usize, draft: impl Fn(usize) -> Vec<u32>) -> Vec<usize> {
    (0..answer.len() - block)
        .map(|i| {
            let d = draft(i);
            (1..block).take_while(|&k| d[k] == answer[i + k]).count()
        })
        .collect()
}

/// Decodes with `proposer` and walks the decoded output with `accept`: (decoding's steps, the
/// walk's steps).
fn decode_and_walk(
    target: &TargetModel,
    taps: &[usize],
    proposer: &mut dyn BlockDrafter,
    prompt: &[u32],
    accept: &[usize],
    max_new: usize,
    eos: &[u32],
) -> (Vec<usize>, Vec<usize>) {
    let d =
        tch::no_grad(|| speculative_decode(target, proposer, taps, prompt, max_new, eos)).unwrap();
    let out = &d.output_ids;
    (
        d.accept_lengths,
        walk(&accept[..out.len()], out, eos, max_new),
    )
}

fn tau(steps: &[usize]) -> f64 {
    steps.iter().sum::<usize>() as f64 / steps.len().max(1) as f64
}

#[test]
fn the_walk_gives_the_steps_of_real_decoding_for_a_drafter_always_right_or_always_wrong() {
    let (_tmp, target, drafter, _head) = tiny_models(4);
    let taps = drafter.config.target_layer_ids().to_vec();
    for block in [4usize, 6] {
        for prompt in [vec![5u32, 9, 13], vec![2, 4, 8, 16, 32, 11, 7]] {
            let answer = tch::no_grad(|| greedy(&target, &prompt, 80, &[]))
                .unwrap()
                .output_ids;
            let never = (3..50u32).find(|t| !answer.contains(t)).unwrap();
            let right = acceptance(&answer, block, |i| answer[i..i + block].to_vec());
            let wrong = acceptance(&answer, block, |i| {
                let mut b = vec![never; block];
                b[0] = answer[i];
                b
            });
            assert!(right.iter().all(|&a| a == block - 1));
            assert!(wrong.iter().all(|&a| a == 0));
            let oracle = || Oracle::new(block, prompt.len(), answer.clone());
            let mut always_wrong = AlwaysProposes {
                block,
                token: never,
            };

            // no EOS: the budget ends both (for the oracle at a step boundary: decoding's
            // last step may run past max_new, its tokens cut from the output but counted in
            // its tau; the walk never counts what lies past the budget)
            let max_new = 1 + 7 * block;
            let (dec, wlk) =
                decode_and_walk(&target, &taps, &mut oracle(), &prompt, &right, max_new, &[]);
            assert_eq!(dec, vec![block; 7]);
            assert_eq!((wlk.clone(), tau(&wlk)), (dec.clone(), tau(&dec)));
            for max_new in [40, 17] {
                let (dec, wlk) = decode_and_walk(
                    &target,
                    &taps,
                    &mut always_wrong,
                    &prompt,
                    &wrong,
                    max_new,
                    &[],
                );
                assert_eq!(dec, vec![1; max_new - 1]);
                assert_eq!((wlk.clone(), tau(&wlk)), (dec.clone(), tau(&dec)));
            }
            // off a step boundary the walk caps the last step at the budget
            let max_new = 3 + 4 * block;
            let (dec, wlk) =
                decode_and_walk(&target, &taps, &mut oracle(), &prompt, &right, max_new, &[]);
            assert_eq!(dec, vec![block; 5]);
            assert_eq!(wlk[..4], dec[..4]);
            assert_eq!(wlk[4], 3);

            // an EOS ends both: the always-wrong drafter anywhere, the oracle where decoding
            // lands on it (where it drafts it, decoding's step also counts the tokens drafted
            // after it)
            let first = |t: u32| answer.iter().position(|&a| a == t).unwrap();
            let eos = answer[9];
            let (dec, wlk) = decode_and_walk(
                &target,
                &taps,
                &mut always_wrong,
                &prompt,
                &wrong,
                60,
                &[eos],
            );
            assert_eq!(dec.len(), first(eos));
            assert_eq!((wlk.clone(), tau(&wlk)), (dec.clone(), tau(&dec)));
            let landing = (1..8)
                .map(|k| k * block)
                .find(|&p| first(answer[p]) == p)
                .expect("a token first said at a multiple of the block size");
            let eos = answer[landing];
            let (dec, wlk) =
                decode_and_walk(&target, &taps, &mut oracle(), &prompt, &right, 60, &[eos]);
            assert_eq!(dec, vec![block; landing / block]);
            assert_eq!((wlk.clone(), tau(&wlk)), (dec.clone(), tau(&dec)));
        }
    }
}

fn options(max_new: usize, eos: &[u32], anchors_per_forward: usize) -> ValidationOptions {
    ValidationOptions {
        max_new_tokens: max_new,
        gamma: 7.0,
        eos: eos.to_vec(),
        anchors_per_forward,
    }
}

/// Training's inputs for one sequence with every candidate anchor (p <= len - block,
/// loss-masked) in one row.
struct EveryAnchor {
    input: Tensor,
    plan: AnchorPlan,
    targets: BlockTargets,
    /// The target's hidden states at the drafter's taps.
    features: Tensor,
}

impl EveryAnchor {
    fn new(target: &TargetModel, drafter: &Drafter, ids: &[u32], mask: &[u8]) -> EveryAnchor {
        let block = drafter.config.block_size as usize;
        let len = ids.len();
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let mask: Vec<i64> = mask.iter().map(|&m| m as i64).collect();
        let anchors: Vec<i64> = (0..=(len - block) as i64)
            .filter(|&p| mask[p as usize] == 1)
            .collect();
        let plan = AnchorPlan {
            rows: 1,
            per_row: anchors.len(),
            valid: vec![true; anchors.len()],
            anchors,
        };
        let targets = block_targets(&ids, &mask, &[len], len, &plan, block, 7.0);
        let input = Tensor::from_slice(&ids).view([1, -1]);
        let req = ForwardRequest {
            tap_layers: drafter.config.target_layer_ids().to_vec(),
            final_hidden: false,
            logits: false,
        };
        let features = target.run(&input, None, &req).features.unwrap();
        EveryAnchor {
            input,
            plan,
            targets,
            features,
        }
    }

    fn batch(&self) -> AnchorBatch {
        AnchorBatch {
            input_ids: self.input.shallow_clone(),
            anchors: Tensor::from_slice(&self.plan.anchors).view([1, -1]),
            valid: Tensor::from_slice(&self.plan.valid).view([1, -1]),
        }
    }
}

/// Trains `drafter` on `sequences` (every anchor, full batch, AdamW) until it knows them in
/// part: a drafter whose acceptance varies along the answers.
fn memorise(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    sequences: &[(Vec<u32>, Vec<u8>)],
    steps: usize,
) {
    let params = drafter.named_parameters();
    let mut optimizer = AdamW::new(
        &params,
        Device::Cpu,
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    );
    let opts = LossOptions {
        kl_weight: 0.0,
        kl_temperature: 1.0,
        streak_alpha: 0.0,
        streak_tau_power: 0.0,
        chunk_rows: 256,
        kernels: None,
    };
    let prepared: Vec<_> = sequences
        .iter()
        .map(|(ids, mask)| EveryAnchor::new(target, drafter, ids, mask))
        .collect();
    for _ in 0..steps {
        for x in &prepared {
            let hidden = drafter.forward_train(head, &x.features, &x.batch());
            let scale = 1.0 / sequences.len() as f64;
            let (_, pending) = loss_and_backward(
                &hidden,
                &head.lm_head,
                &x.targets,
                &x.plan.valid,
                None,
                &opts,
                scale,
            );
            if let Some(p) = pending {
                p.run();
            }
        }
        let mut grad = AdamW::flatten_grads(&params);
        let _norm = optimizer.update_clipped(&mut grad, 2e-2, 1.0).unwrap();
        optimizer.write_params(&params).unwrap();
    }
}

#[test]
fn on_the_targets_own_answers_the_pass_walks_as_the_real_drafter_decodes() {
    // The sequences are prompts and the target's greedy answers: the teacher-forced pass sees
    // exactly what decoding sees, so its walk takes decoding's steps (the last one capped at
    // the budget, see above). The drafter first learns those answers in part, so that its
    // steps vary.
    let (_tmp, target, drafter, head) = tiny_models(4);
    let max_new = 30;
    let prompts = [vec![5u32, 9, 13], vec![2, 4, 8, 16, 32, 11, 7], vec![40]];
    let sequences: Vec<(Vec<u32>, Vec<u8>)> = prompts
        .iter()
        .map(|prompt| {
            let answer = tch::no_grad(|| greedy(&target, prompt, max_new + 4, &[]))
                .unwrap()
                .output_ids;
            let ids: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
            let mask: Vec<u8> = (0..ids.len())
                .map(|i| u8::from(i >= prompt.len()))
                .collect();
            (ids, mask)
        })
        .collect();
    memorise(&target, &drafter, &head, &sequences, 15);
    let mut lengths = std::collections::BTreeSet::new();
    for (prompt, (ids, mask)) in prompts.iter().zip(&sequences) {
        let sample = Sample {
            input_ids: ids,
            loss_mask: mask,
        };
        let v = validate(
            &target,
            &drafter,
            &head,
            &[sample],
            &options(max_new, &[], 5),
            &AtomicBool::new(false),
        )
        .unwrap();
        let d = tch::no_grad(|| dflash(&target, &drafter, &head, prompt, max_new, &[])).unwrap();
        let mut expected = d.accept_lengths.clone();
        let before: usize = expected[..expected.len() - 1].iter().sum();
        let last = expected.last_mut().unwrap();
        *last = (*last).min(max_new - before);
        lengths.extend(expected.iter().copied());
        assert_eq!(v.walks, vec![expected], "prompt {prompt:?}");
    }
    assert!(lengths.len() >= 3, "steps of several lengths: {lengths:?}");
}

/// Rows of the tiny data set (tests/common `tiny_run`): a learnable rule, loss from token 4 on,
/// the last rows with two answers.
fn rows() -> Vec<(Vec<u32>, Vec<u8>)> {
    (0..6)
        .map(|r| {
            let len = 24 + (r * 7) % 40;
            let mut t = (r * 11 % 45 + 3) as u32;
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    let x = t;
                    t = (t * 7 + 3) % 45 + 3;
                    x
                })
                .collect();
            let mask = (0..len)
                .map(|k| u8::from(k >= 4 && !(r >= 4 && (12..16).contains(&k))))
                .collect();
            (ids, mask)
        })
        .collect()
}

fn run_pass(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    rows: &[(Vec<u32>, Vec<u8>)],
    opts: &ValidationOptions,
) -> Validation {
    let samples: Vec<Sample<'_>> = rows
        .iter()
        .map(|(i, m)| Sample {
            input_ids: i,
            loss_mask: m,
        })
        .collect();
    validate(
        target,
        drafter,
        head,
        &samples,
        opts,
        &AtomicBool::new(false),
    )
    .unwrap()
}

#[test]
fn a_set_cancel_flag_stops_the_pass_before_its_first_sequence() {
    let (_tmp, target, drafter, head) = tiny_models(4);
    let rows = rows();
    let samples: Vec<Sample<'_>> = rows
        .iter()
        .map(|(i, m)| Sample {
            input_ids: i,
            loss_mask: m,
        })
        .collect();
    let opts = options(16, &[2], 7);
    let e = validate(
        &target,
        &drafter,
        &head,
        &samples,
        &opts,
        &AtomicBool::new(true),
    )
    .unwrap_err();
    assert!(dflash_tui::eval::cancel::is_cancelled(&e), "{e:#}");
    assert_eq!(
        format!("{e:#}"),
        format!(
            "after 0 of {} sequences: cancelled: the run is stopping at once",
            rows.len()
        )
    );
}

#[test]
fn the_pass_is_finite_deterministic_and_in_range() {
    let (_tmp, target, drafter, head) = tiny_models(4);
    let rows = rows();
    let opts = options(16, &[2], 7);
    let a = run_pass(&target, &drafter, &head, &rows, &opts);
    let b = run_pass(&target, &drafter, &head, &rows, &opts);
    assert_eq!(a, b, "the same numbers twice");
    assert!(a.loss.is_finite() && a.loss > 0.0, "{a:?}");
    assert!((0.0..=1.0).contains(&a.accuracy), "{a:?}");
    assert!((1.0..=4.0).contains(&a.accept_mean), "{a:?}");
    assert!((1.0..=4.0).contains(&a.tau), "{a:?}");
    assert_eq!(a.sequences, 6);
    // one walk per answer; no walk longer than the budget
    assert_eq!(a.walks.len(), 8);
    assert!(a.walks.iter().all(|w| w.iter().sum::<usize>() <= 16));
    assert_eq!(a.walk_tokens() as f64 / a.walk_steps() as f64, a.tau);
    // the anchors of one forward only bound the memory
    let c = run_pass(&target, &drafter, &head, &rows, &options(16, &[2], 1000));
    assert_eq!(c.walks, a.walks);
    assert_eq!(c.blocks, a.blocks);
    assert!(
        (c.loss - a.loss).abs() < 1e-5 * a.loss,
        "{} vs {}",
        c.loss,
        a.loss
    );
}

#[test]
fn loss_accuracy_and_acceptance_are_trainings_over_every_anchor() {
    // Training's loss sums over every candidate anchor (p <= len - block, loss-masked) equal
    // the pass's numbers.
    let (_tmp, target, drafter, head) = tiny_models(4);
    let rows = rows();
    let (ids, mask) = &rows[5];
    let v = run_pass(
        &target,
        &drafter,
        &head,
        &rows[5..],
        &options(16, &[], 1000),
    );
    let x = EveryAnchor::new(&target, &drafter, ids, mask);
    let hidden = drafter.forward_train(&head, &x.features, &x.batch());
    let opts = LossOptions {
        kl_weight: 0.0,
        kl_temperature: 1.0,
        streak_alpha: 0.0,
        streak_tau_power: 0.0,
        chunk_rows: 64,
        kernels: None,
    };
    let (sums, _) = loss_and_backward(
        &hidden,
        &head.lm_head,
        &x.targets,
        &x.plan.valid,
        None,
        &opts,
        1.0,
    );
    assert_eq!(v.blocks, x.plan.anchors.len() as u64);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    assert!(close(v.loss, sums.loss()), "{} vs {}", v.loss, sums.loss());
    assert!(
        close(v.accuracy, sums.accuracy()),
        "{} vs {}",
        v.accuracy,
        sums.accuracy()
    );
    assert!(
        close(v.accept_mean, sums.accept_mean()),
        "{} vs {}",
        v.accept_mean,
        sums.accept_mean()
    );
}
