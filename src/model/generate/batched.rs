//! Batched generation with the target for `regenerate`: prompts of similar length decoded
//! together, left-padded, with a preallocated KV cache; greedy, or temperature / top-p sampling
//! seeded per prompt so that the tokens do not depend on how prompts are batched.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use tch::{Kind, Tensor};

use super::sampling::{pick, Sampling};
use super::Answer;
use crate::model::{ForwardRequest, KvCache, TargetModel};

/// One prompt to answer.
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    pub ids: &'a [u32],
    /// At most this many new tokens.
    pub max_new: usize,
    /// Seed of this prompt's sampling stream (unused when greedy).
    pub seed: u64,
}

/// Batching limits.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Prompts decoded together.
    pub batch_size: usize,
    /// Padded prompt tokens per prefill forward (longer batches are prefilled in pieces).
    pub prefill_tokens: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            batch_size: 128,
            prefill_tokens: 16_384,
        }
    }
}

/// Padded prompt lengths on CUDA are multiples of this.
const PAD_ALIGN: i64 = 64;

/// Answers one batch of prompts together: left-padded to the longest, prefilled (in pieces of
/// about `prefill_tokens` padded tokens), then decoded one token per step for every row.
/// Rows that finished are dropped from the batch once a quarter of it has. The answers come
/// back in the order of `prompts`.
pub fn generate_batch(
    model: &TargetModel,
    prompts: &[Prompt<'_>],
    eos: &[u32],
    sampling: &Sampling,
    prefill_tokens: usize,
) -> Result<Vec<Answer>> {
    let mut answers: Vec<Answer> = prompts
        .iter()
        .map(|_| Answer {
            tokens: Vec::new(),
            eos: false,
        })
        .collect();
    // Rows that take part: a prompt and room for at least one token.
    let active: Vec<usize> = (0..prompts.len())
        .filter(|&i| prompts[i].max_new > 0)
        .collect();
    if let Some(&i) = active.iter().find(|&&i| prompts[i].ids.is_empty()) {
        bail!("prompt {i} is empty: generation needs at least one token to start from");
    }
    if active.is_empty() {
        return Ok(answers);
    }
    let vocab = model.config.vocab_size;
    for &i in &active {
        if let Some(&bad) = prompts[i].ids.iter().find(|&&t| t as i64 >= vocab) {
            bail!("prompt {i}: token id {bad} is outside the model's vocabulary of {vocab}");
        }
    }
    let started = Instant::now();
    let dev = model.device;
    let rows = active.len() as i64;
    // On CUDA the padded length and the prefill pieces are multiples of PAD_ALIGN, so that
    // batches repeat a few attention shapes (the fused kernels plan each new shape, which
    // takes far longer than running it).
    let align = if dev.is_cuda() { PAD_ALIGN } else { 1 };
    let longest = active
        .iter()
        .map(|&i| prompts[i].ids.len())
        .max()
        .unwrap_or(0) as i64;
    let longest = (longest + align - 1) / align * align;
    let most_new = active
        .iter()
        .map(|&i| prompts[i].max_new)
        .max()
        .unwrap_or(0) as i64;
    let (ids, key_mask) = left_pad(prompts, &active, longest, dev);
    let mut cache = KvCache::with_capacity(longest + most_new);
    let piece = ((prefill_tokens as i64 / rows) / align * align).max(align);
    let hidden = prefill(model, &ids, &key_mask, &mut cache, piece)?;

    let batch = Batch {
        active,
        key_mask,
        cache,
        hidden,
    };
    let times = decode(model, prompts, eos, sampling, batch, &mut answers, started)?;
    let (prefill_s, steps) = (times.prefill_s, times.steps);
    log::debug!(
        "batch of {rows} prompts padded to {longest} tokens: prefill {prefill_s:.3} s, {steps} decode steps in {:.3} s ({:.2} ms per step: {:.2} issuing, {:.2} waiting)",
        started.elapsed().as_secs_f64() - prefill_s,
        1e3 * (started.elapsed().as_secs_f64() - prefill_s) / steps.max(1) as f64,
        1e3 * times.issue_s / steps.max(1) as f64,
        1e3 * times.wait_s / steps.max(1) as f64,
    );
    Ok(answers)
}

/// The prompts of the `active` rows left-padded to `longest` tokens: ids [rows, longest] and
/// the mask of real (not padding) positions, on `dev`.
fn left_pad(
    prompts: &[Prompt<'_>],
    active: &[usize],
    longest: i64,
    dev: tch::Device,
) -> (Tensor, Tensor) {
    let rows = active.len() as i64;
    let mut ids = vec![0i64; (rows * longest) as usize];
    let mut real = vec![0u8; (rows * longest) as usize];
    for (r, &i) in active.iter().enumerate() {
        let p = prompts[i].ids;
        let start = r * longest as usize + (longest as usize - p.len());
        for (k, &t) in p.iter().enumerate() {
            ids[start + k] = t as i64;
            real[start + k] = 1;
        }
    }
    let ids = Tensor::from_slice(&ids)
        .view([rows, longest])
        .to_device(dev);
    let key_mask = Tensor::from_slice(&real)
        .view([rows, longest])
        .to_device(dev)
        .to_kind(Kind::Bool);
    (ids, key_mask)
}

/// Prefills `cache` with the padded prompts `ids`, `piece` positions per forward; returns the
/// final hidden state of each row's last position.
fn prefill(
    model: &TargetModel,
    ids: &Tensor,
    key_mask: &Tensor,
    cache: &mut KvCache,
    piece: i64,
) -> Result<Tensor> {
    let longest = ids.size()[1];
    let hidden_req = ForwardRequest {
        final_hidden: true,
        ..Default::default()
    };
    let mut start = 0;
    let mut last_hidden = None;
    while start < longest {
        let end = (start + piece).min(longest);
        let is_last = end == longest;
        let req = if is_last {
            hidden_req.clone()
        } else {
            ForwardRequest::default()
        };
        let out = model.run_padded(
            &ids.narrow(1, start, end - start),
            Some(&mut *cache),
            &req,
            Some(&key_mask.narrow(1, 0, end)),
        );
        if is_last {
            last_hidden = out.final_hidden.map(|h| h.select(1, -1));
        }
        start = end;
    }
    last_hidden.context("the prefill returned no hidden states")
}

/// The rows still decoding: their prompt indices, key mask, cache and last hidden states.
struct Batch {
    active: Vec<usize>,
    key_mask: Tensor,
    cache: KvCache,
    hidden: Tensor,
}

/// Where the time of a batch went (debug log): the prefill (until the first pick), issuing the
/// decoding forwards, and waiting for their results.
struct DecodeTimes {
    prefill_s: f64,
    issue_s: f64,
    wait_s: f64,
    steps: usize,
}

/// Decodes one token per step for every row of `batch` into `answers` until each ended (at an
/// EOS token or `max_new`); finished rows leave the batch once a quarter of it has finished.
fn decode(
    model: &TargetModel,
    prompts: &[Prompt<'_>],
    eos: &[u32],
    sampling: &Sampling,
    batch: Batch,
    answers: &mut [Answer],
    started: Instant,
) -> Result<DecodeTimes> {
    let dev = model.device;
    let Batch {
        mut active,
        mut key_mask,
        mut cache,
        mut hidden,
    } = batch;
    let hidden_req = ForwardRequest {
        final_hidden: true,
        ..Default::default()
    };
    let mut rngs: Vec<rand_chacha::ChaCha8Rng> = prompts
        .iter()
        .map(|p| rand_chacha::ChaCha8Rng::seed_from_u64(p.seed))
        .collect();
    let mut done = vec![false; prompts.len()];
    let (mut issue_s, mut wait_s, mut steps) = (0.0, 0.0, 0usize);
    let mut prefill_s = None;
    loop {
        let t = Instant::now();
        let logits = model.logits(&hidden);
        let uniforms: Vec<f64> = active
            .iter()
            .map(|&i| {
                if sampling.is_greedy() || done[i] {
                    0.0
                } else {
                    rngs[i].random::<f64>()
                }
            })
            .collect();
        let next = pick(&logits, sampling, &uniforms)?;
        wait_s += t.elapsed().as_secs_f64();
        prefill_s.get_or_insert_with(|| started.elapsed().as_secs_f64());
        for (&i, &t) in active.iter().zip(&next) {
            if done[i] {
                continue;
            }
            let a = &mut answers[i];
            a.tokens.push(t);
            if eos.contains(&t) {
                a.eos = true;
                done[i] = true;
            } else if a.tokens.len() >= prompts[i].max_new {
                done[i] = true;
            }
        }
        let finished = active.iter().filter(|&&i| done[i]).count();
        if finished == active.len() {
            break;
        }
        let mut next = next;
        if finished * 4 >= active.len() {
            let keep: Vec<i64> = (0..active.len() as i64)
                .filter(|&r| !done[active[r as usize]])
                .collect();
            let keep_t = Tensor::from_slice(&keep).to_device(dev);
            cache.select_rows(&keep_t);
            key_mask = key_mask.index_select(0, &keep_t);
            active = keep.iter().map(|&r| active[r as usize]).collect();
            next = keep.iter().map(|&r| next[r as usize]).collect();
        }
        let t = Instant::now();
        let n = active.len() as i64;
        let input: Vec<i64> = next.iter().map(|&t| t as i64).collect();
        let input = Tensor::from_slice(&input).view([n, 1]).to_device(dev);
        key_mask = Tensor::cat(&[key_mask, Tensor::ones([n, 1], (Kind::Bool, dev))], 1);
        let out = model.run_padded(&input, Some(&mut cache), &hidden_req, Some(&key_mask));
        hidden = out
            .final_hidden
            .context("the decode step returned no hidden states")?
            .select(1, 0);
        issue_s += t.elapsed().as_secs_f64();
        steps += 1;
    }
    Ok(DecodeTimes {
        prefill_s: prefill_s.unwrap_or(0.0),
        issue_s,
        wait_s,
        steps,
    })
}

/// Answers many prompts: sorted by length (longest first), decoded in batches of
/// `limits.batch_size`; `on_batch(prompts, new_tokens)` is called after each batch. The answers
/// come back in the order of `prompts`.
pub fn generate_all(
    model: &TargetModel,
    prompts: &[Prompt<'_>],
    eos: &[u32],
    sampling: &Sampling,
    limits: &BatchLimits,
    mut on_batch: impl FnMut(usize, usize),
) -> Result<Vec<Answer>> {
    let mut order: Vec<usize> = (0..prompts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(prompts[i].ids.len()));
    let mut answers: Vec<Option<Answer>> = vec![None; prompts.len()];
    for group in order.chunks(limits.batch_size.max(1)) {
        let batch: Vec<Prompt<'_>> = group.iter().map(|&i| prompts[i]).collect();
        let out = generate_batch(model, &batch, eos, sampling, limits.prefill_tokens)?;
        on_batch(group.len(), out.iter().map(|a| a.tokens.len()).sum());
        for (&i, a) in group.iter().zip(out) {
            answers[i] = Some(a);
        }
    }
    answers
        .into_iter()
        .map(|a| a.context("a prompt was not answered"))
        .collect()
}
