//! Held-out validation: the drafter measured, teacher-forced, on sequences it never trains on.
//!
//! One target forward over each sequence (the tapped features, as the target stage computes
//! them) and the drafter's training forward with an anchor at EVERY loss-masked position give,
//! in one pass over the device:
//!
//! - the training objective on held-out data: the weighted cross-entropy, the weighted
//!   accuracy (dflash spec §3 weights) and the anchor-mean acceptance, over the anchors training
//!   draws from (`p + block <= len`), so that they compare with the training curves and the
//!   curves part when the drafter memorises its data;
//! - the **walk tau**: for each answer (a maximal run of loss-masked positions) the steps greedy
//!   decoding would take, read from the acceptance length at each position ([`walk`]). The
//!   anchor mean is not what decoding gets: decoding crosses easy stretches in a few long steps
//!   and hard ones in many short ones, so it spends more of its steps where the drafter is weak.
//!   On data the target itself wrote, the walk is exact (the tests check it against
//!   [`crate::eval::speculative::speculative_decode`]); on other data it is the acceptance
//!   against that data's answers.
//!
//! Nothing here draws random numbers, so a pass changes neither the data order nor the anchors
//! of training.

use std::ops::Range;
use std::sync::atomic::AtomicBool;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::loss::{block_targets, cross_entropy_f32, AnchorPlan, LossOptions};
use crate::data::store::Sample;
use crate::eval::cancel::check;
use crate::model::layers::upload;
use crate::model::{AnchorBatch, Drafter, ForwardRequest, FrozenHead, TargetModel};

/// The decoding steps over one answer: their lengths (accepted drafts + the bonus token).
///
/// `accept[i]` is the acceptance length at position i of the answer: how many leading slots
/// k = 1.. of the block anchored there (`[x[i], MASK, ...]`) predict `tokens[i + k]`. The walk
/// starts at the answer's first token (what the target's prefill gives in decoding) and from
/// position n takes a step of `acc + 1`, with `acc = accept[n]` capped so that no accepted
/// token lies past the answer or past the first `max_new` tokens. It steps while the answer so
/// far (n + 1 tokens) is shorter than `max_new` and n is inside the answer, and stops at an EOS
/// as decoding does: no step from an EOS, none after a step that accepted one. An answer that
/// does not end with an EOS takes a last step from its last token (decoding would go on).
pub fn walk(accept: &[usize], tokens: &[u32], eos: &[u32], max_new: usize) -> Vec<usize> {
    let len = accept.len().min(tokens.len());
    let limit = len.min(max_new);
    let mut steps = Vec::new();
    let mut n = 0;
    while n < len && n + 1 < max_new && !eos.contains(&tokens[n]) {
        let acc = accept[n].min(limit - 1 - n);
        steps.push(acc + 1);
        if tokens[n + 1..=n + acc].iter().any(|t| eos.contains(t)) {
            break;
        }
        n += acc + 1;
    }
    steps
}

/// The answers of a sequence: maximal runs of `loss_mask == 1`.
pub(crate) fn answer_segments(loss_mask: &[u8]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = None;
    for (p, &m) in loss_mask.iter().chain(std::iter::once(&0)).enumerate() {
        match (m == 1, start) {
            (true, None) => start = Some(p),
            (false, Some(s)) => {
                out.push(s..p);
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// Settings of a validation pass.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationOptions {
    /// How far into each answer the walk goes (as `eval --max-new-tokens`).
    pub max_new_tokens: usize,
    /// The loss decay along the block (spec §3).
    pub gamma: f64,
    /// The target's end-of-sequence / end-of-turn tokens.
    pub eos: Vec<u32>,
    /// Anchor blocks per drafter forward (bounds the memory of one forward).
    pub anchors_per_forward: usize,
}

/// What a pass measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Validation {
    /// Weighted cross-entropy of the blocks training draws from.
    pub loss: f64,
    /// Weighted accuracy of the same blocks.
    pub accuracy: f64,
    /// `1 + ` the mean acceptance length of the same blocks (training's `accept_mean`).
    pub accept_mean: f64,
    /// Mean step length of the walks over all answers: the tokens per decoding step.
    pub tau: f64,
    /// Sequences measured.
    pub sequences: usize,
    /// Blocks behind loss, accuracy and `accept_mean`.
    pub blocks: u64,
    /// Each answer's walk ([`walk`]), sequence by sequence.
    pub walks: Vec<Vec<usize>>,
}

impl Validation {
    /// Decoding steps over all answers.
    pub fn walk_steps(&self) -> u64 {
        self.walks.iter().map(|w| w.len() as u64).sum()
    }

    /// Tokens those steps produce.
    pub fn walk_tokens(&self) -> u64 {
        self.walks.iter().flatten().map(|&s| s as u64).sum()
    }
}

/// One sequence's numbers, still on the device.
struct Measured {
    /// float64 [4]: sum of w * CE, sum of w, sum of w * correct, sum of the acceptance lengths
    /// (over the blocks training draws from).
    sums: Tensor,
    /// int64 [anchors]: the acceptance length at each loss-masked position.
    accept: Tensor,
    blocks: u64,
}

/// Measures `drafter` on `sequences` (see the module documentation). The device's numbers are
/// read to the host once, at the end. Ends with [`Cancelled`](crate::eval::cancel::Cancelled)
/// between sequences once `cancel` is set.
pub fn validate(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    sequences: &[Sample<'_>],
    opts: &ValidationOptions,
    cancel: &AtomicBool,
) -> Result<Validation> {
    if target.device != drafter.device {
        bail!(
            "validation: the target is on {:?}, the drafter on {:?}",
            target.device,
            drafter.device
        );
    }
    let measured = tch::no_grad(|| {
        let mut measured = Vec::with_capacity(sequences.len());
        for (done, s) in sequences.iter().enumerate() {
            check(cancel)
                .with_context(|| format!("after {done} of {} sequences", sequences.len()))?;
            measured.push(measure(target, drafter, head, s, opts)?);
        }
        anyhow::Ok(measured)
    })?;
    let dev = drafter.device;
    let mut sums = Tensor::zeros([4], (Kind::Double, dev));
    let mut accepts = Vec::with_capacity(measured.len());
    let mut blocks = 0;
    for m in measured.iter().flatten() {
        sums += &m.sums;
        accepts.push(m.accept.shallow_clone());
        blocks += m.blocks;
    }
    let sums = Vec::<f64>::try_from(sums.to_device(Device::Cpu))?;
    let accept: Vec<i64> = if accepts.is_empty() {
        Vec::new()
    } else {
        Vec::<i64>::try_from(Tensor::cat(&accepts, 0).to_device(Device::Cpu))?
    };
    let mut walks = Vec::new();
    let mut at = 0;
    for (s, m) in sequences.iter().zip(&measured) {
        if m.is_none() {
            continue;
        }
        let segments = answer_segments(s.loss_mask);
        for seg in segments {
            let acc: Vec<usize> = accept[at..at + seg.len()]
                .iter()
                .map(|&a| a as usize)
                .collect();
            at += seg.len();
            walks.push(walk(
                &acc,
                &s.input_ids[seg],
                &opts.eos,
                opts.max_new_tokens,
            ));
        }
    }
    let steps: u64 = walks.iter().map(|w| w.len() as u64).sum();
    let tokens: u64 = walks.iter().flatten().map(|&s| s as u64).sum();
    let weight = sums[1].max(1e-12);
    Ok(Validation {
        loss: sums[0] / weight,
        accuracy: sums[2] / weight,
        accept_mean: 1.0 + sums[3] / (blocks.max(1) as f64),
        tau: tokens as f64 / steps.max(1) as f64,
        sequences: sequences.len(),
        blocks,
        walks,
    })
}

/// The target forward and the drafter forwards of one sequence; `None` without a loss-masked
/// position.
fn measure(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    sample: &Sample<'_>,
    opts: &ValidationOptions,
) -> Result<Option<Measured>> {
    let block = drafter.config.block_size as usize;
    let len = sample.input_ids.len();
    let ids: Vec<i64> = sample.input_ids.iter().map(|&t| t as i64).collect();
    let mask: Vec<i64> = sample.loss_mask.iter().map(|&m| m as i64).collect();
    let positions: Vec<i64> = (0..len as i64).filter(|&p| mask[p as usize] == 1).collect();
    if positions.is_empty() {
        return Ok(None);
    }
    let dev = drafter.device;
    let input_ids = Tensor::from_slice(&ids).view([1, len as i64]);
    let req = ForwardRequest {
        tap_layers: drafter.config.target_layer_ids().to_vec(),
        final_hidden: false,
        logits: false,
    };
    let features = target
        .run(&upload(&input_ids, target.device), None, &req)
        .features
        .ok_or_else(|| anyhow::anyhow!("the target returned no features"))?;
    let mut sums = Tensor::zeros([4], (Kind::Double, dev));
    let mut accept = Vec::new();
    let mut blocks = 0;
    for anchors in positions.chunks(opts.anchors_per_forward.max(1)) {
        // the blocks training draws from: the whole block inside the sequence
        let full: Vec<bool> = anchors.iter().map(|&a| a as usize + block <= len).collect();
        blocks += full.iter().filter(|&&f| f).count() as u64;
        let plan = AnchorPlan {
            rows: 1,
            per_row: anchors.len(),
            anchors: anchors.to_vec(),
            valid: full.clone(),
        };
        // every block is scored (the walk reads the acceptance of those reaching past the
        // end too), so every block is computed: none is padding to the forward
        let batch = AnchorBatch {
            input_ids: input_ids.shallow_clone(),
            anchors: Tensor::from_slice(anchors).view([1, -1]),
            valid: Tensor::ones([1, anchors.len() as i64], (Kind::Bool, Device::Cpu)),
        };
        let hidden = drafter.forward_train(head, &features, &batch);
        let (chunk_sums, chunk_accept) =
            score_blocks(&hidden, head, &ids, &mask, &plan, block, opts.gamma);
        sums += chunk_sums;
        accept.push(chunk_accept);
    }
    Ok(Some(Measured {
        sums,
        accept: Tensor::cat(&accept, 0),
        blocks,
    }))
}

/// Scores the drafter's blocks against the sequence: the float64 sums of [`Measured`] and the
/// acceptance length of every block (int64 [N]). Slots past the sequence count as wrong.
fn score_blocks(
    hidden: &Tensor,
    head: &FrozenHead,
    ids: &[i64],
    mask: &[i64],
    plan: &AnchorPlan,
    block: usize,
    gamma: f64,
) -> (Tensor, Tensor) {
    let len = ids.len();
    let n = plan.per_row;
    let slots = block - 1;
    let targets = block_targets(ids, mask, &[len], len, plan, block, gamma);
    // slots 1.. of every block (slot 0, the anchor, has no label)
    let pick = |v: &[i64]| -> Vec<i64> {
        (0..n)
            .flat_map(|j| v[j * block + 1..(j + 1) * block].iter().copied())
            .collect()
    };
    let labels = pick(&targets.labels);
    let weights: Vec<f32> = (0..n)
        .flat_map(|j| {
            targets.weights[j * block + 1..(j + 1) * block]
                .iter()
                .copied()
        })
        .collect();
    let inside: Vec<bool> = plan
        .anchors
        .iter()
        .flat_map(|&a| (1..block).map(move |k| a as usize + k < len))
        .collect();
    let dev = hidden.device();
    let labels = upload(&Tensor::from_slice(&labels), dev);
    let weights = upload(&Tensor::from_slice(&weights), dev);
    let inside = upload(&Tensor::from_slice(&inside), dev);
    let h = hidden.size()[3];
    let rows = hidden.narrow(2, 1, slots as i64).reshape([-1, h]);
    let m = rows.size()[0];
    let chunk = LossOptions::chunk_rows_for_vocab(head.lm_head.size()[0]);
    let mut weighted_ce = Tensor::zeros([], (Kind::Float, dev));
    let mut correct = Vec::new();
    let mut s = 0;
    while s < m {
        let take = chunk.min(m - s);
        let logits = rows
            .narrow(0, s, take)
            .linear::<&Tensor>(&head.lm_head, None);
        let lab = labels.narrow(0, s, take);
        let ce = cross_entropy_f32(&logits, &lab);
        weighted_ce += (ce * weights.narrow(0, s, take)).sum(Kind::Float);
        correct.push(
            logits
                .argmax(-1, false)
                .eq_tensor(&lab)
                .logical_and(&inside.narrow(0, s, take)),
        );
        s += take;
    }
    let correct = Tensor::cat(&correct, 0).to_kind(Kind::Float);
    let weighted_correct = (&correct * &weights).sum(Kind::Float);
    let accept = correct
        .view([n as i64, slots as i64])
        .cumprod(1, Kind::Float)
        .sum_dim_intlist(1, false, Kind::Float);
    let full = upload(&Tensor::from_slice(&plan.valid), dev).to_kind(Kind::Float);
    let accepted = (&accept * full).sum(Kind::Float);
    let sums = Tensor::stack(
        &[
            weighted_ce.to_kind(Kind::Double),
            weights.sum(Kind::Double),
            weighted_correct.to_kind(Kind::Double),
            accepted.to_kind(Kind::Double),
        ],
        0,
    );
    (sums, accept.round().to_kind(Kind::Int64))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 2;

    #[test]
    fn a_walk_takes_steps_of_acceptance_plus_one() {
        // acceptance 3 everywhere, block 4: steps of 4 until the answer runs out
        let tokens = [10u32; 12];
        assert_eq!(walk(&[3; 12], &tokens, &[EOS], 100), vec![4, 4, 4]);
        // always wrong: one token a step, a last step from the last token
        assert_eq!(walk(&[0; 5], &tokens[..5], &[EOS], 100), vec![1; 5]);
        // the position decides: 2 at 0 -> 3; at 3 -> 0 -> 1; at 4 -> 3 -> 4; at 8 -> capped
        let accept = [2, 9, 9, 0, 3, 9, 9, 9, 5, 9];
        assert_eq!(walk(&accept, &tokens[..10], &[EOS], 100), vec![3, 1, 4, 2]);
    }

    #[test]
    fn a_walk_never_accepts_past_the_answer() {
        let tokens = [10u32; 6];
        // from 4: 1 token of the answer left after x, so acc 1 although 5 were right
        assert_eq!(walk(&[3, 9, 9, 9, 5, 5], &tokens, &[EOS], 100), vec![4, 2]);
        assert_eq!(walk(&[15; 1], &tokens[..1], &[EOS], 100), vec![1]);
        assert!(walk(&[], &[], &[EOS], 100).is_empty());
    }

    #[test]
    fn an_eos_ends_the_walk() {
        // the answer ends with EOS: no step from it
        let tokens = [10, 11, 12, EOS];
        assert_eq!(walk(&[0; 4], &tokens, &[EOS], 100), vec![1, 1, 1]);
        // EOS accepted as a draft: the step counts, then the walk ends
        assert_eq!(walk(&[1, 9, 9, 9], &tokens, &[EOS], 100), vec![2, 2]);
        // an EOS in the middle of an answer ends it there, as it ends decoding
        let tokens = [10, EOS, 12, 13, 14];
        assert_eq!(walk(&[0; 5], &tokens, &[EOS], 100), vec![1]);
        assert_eq!(walk(&[3, 0, 0, 0, 0], &tokens, &[EOS], 100), vec![4]);
        // several EOS ids
        assert_eq!(walk(&[0; 3], &[10, 7, 12], &[EOS, 7], 100), vec![1]);
    }

    #[test]
    fn max_new_tokens_bounds_the_walk_like_decoding() {
        // decoding steps while it has produced fewer than max_new tokens (the prefill's first
        // one included), and accepts no draft past them
        let tokens = [10u32; 40];
        assert_eq!(walk(&[3; 40], &tokens, &[EOS], 9), vec![4, 4]);
        assert_eq!(walk(&[3; 40], &tokens, &[EOS], 8), vec![4, 4]);
        assert_eq!(walk(&[3; 40], &tokens, &[EOS], 7), vec![4, 3]);
        assert_eq!(walk(&[0; 40], &tokens, &[EOS], 5), vec![1; 4]);
        assert!(walk(&[3; 40], &tokens, &[EOS], 1).is_empty());
        // the answer's end and the budget: whichever comes first
        assert_eq!(walk(&[3; 6], &tokens[..6], &[EOS], 8), vec![4, 2]);
    }

    #[test]
    fn answers_are_maximal_runs_of_the_loss_mask() {
        assert_eq!(
            answer_segments(&[0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]),
            vec![2..4, 5..6, 8..11]
        );
        assert_eq!(answer_segments(&[1, 1]), vec![0..2]);
        assert!(answer_segments(&[0, 0]).is_empty());
        assert!(answer_segments(&[]).is_empty());
    }
}
