//! Greedy DFlash speculative decoding (dflash spec §5), with target and drafter KV caches that
//! roll back, and plain greedy decoding timed the same way, so that acceptance length and
//! speed-up are measured on real decoding and the output can be checked for losslessness.

use std::time::Instant;

use anyhow::{anyhow, Result};
use tch::{Kind, Tensor};

use crate::model::{Drafter, ForwardRequest, FrozenHead, KvCache, TargetModel};

/// What one prompt produced.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Decoded {
    /// Exactly the generated tokens (cut at the limit, stopping after EOS).
    pub output_ids: Vec<u32>,
    /// DFlash only: accepted tokens per step (a + 1 per step, spec §5).
    pub accept_lengths: Vec<usize>,
    /// Plain greedy only: per output token, the target's top-1 minus top-2 logit (how close the
    /// choice was; a bf16 mismatch at a small margin is rounding, not a bug).
    #[serde(skip)]
    pub margins: Vec<f32>,
    /// DFlash only: each step's drafted tokens d_1 .. d_{B-1}.
    pub drafts: Vec<Vec<u32>>,
    /// Seconds spent after the prefill.
    pub decode_s: f64,
}

fn sync(device: tch::Device) {
    if let tch::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn argmax_ids(logits: &Tensor) -> Result<Vec<u32>> {
    // logits [L, V] -> L ids
    let ids = logits
        .argmax(-1, false)
        .to_kind(Kind::Int64)
        .to_device(tch::Device::Cpu);
    Ok(Vec::<i64>::try_from(&ids)
        .map_err(|e| anyhow!("{e}"))?
        .into_iter()
        .map(|t| t as u32)
        .collect())
}

/// Cuts generated tokens at `max_new` and just after the first EOS.
fn cut(mut out: Vec<u32>, max_new: usize, eos: &[u32]) -> Vec<u32> {
    out.truncate(max_new);
    if let Some(p) = out.iter().position(|t| eos.contains(t)) {
        out.truncate(p + 1);
    }
    out
}

/// The greedy pick of one row of logits [V] and its margin over the runner-up.
fn top2(logits: &Tensor) -> Result<(u32, f32)> {
    let (values, indices) = logits.to_kind(Kind::Float).topk(2, -1, true, true);
    let v =
        Vec::<f32>::try_from(&values.to_device(tch::Device::Cpu)).map_err(|e| anyhow!("{e}"))?;
    let i =
        Vec::<i64>::try_from(&indices.to_device(tch::Device::Cpu)).map_err(|e| anyhow!("{e}"))?;
    match (i.first(), v.first(), v.get(1)) {
        (Some(&id), Some(&a), Some(&b)) => Ok((id as u32, a - b)),
        (Some(&id), _, _) => Ok((id as u32, f32::INFINITY)),
        _ => Err(anyhow!("empty logits")),
    }
}

/// Plain greedy decoding with a KV cache, timed after the prefill.
pub fn greedy(
    target: &TargetModel,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let mut cache = KvCache::new();
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let logits = target.forward(&Tensor::from_slice(&ids).unsqueeze(0), Some(&mut cache));
    let (mut next, margin) = top2(&logits.select(0, 0).select(0, ids.len() as i64 - 1))?;
    sync(target.device);
    let started = Instant::now();
    let mut out = vec![next];
    let mut margins = vec![margin];
    while out.len() < max_new && !eos.contains(&next) {
        let logits = target.forward(
            &Tensor::from_slice(&[next as i64]).unsqueeze(0),
            Some(&mut cache),
        );
        let (id, margin) = top2(&logits.select(0, 0).select(0, 0))?;
        next = id;
        out.push(next);
        margins.push(margin);
    }
    sync(target.device);
    let output_ids = cut(out, max_new, eos);
    margins.truncate(output_ids.len());
    Ok(Decoded {
        output_ids,
        accept_lengths: vec![],
        margins,
        drafts: vec![],
        decode_s: started.elapsed().as_secs_f64(),
    })
}

/// What proposes a block during speculative decoding. The real one is [`DFlashProposer`]; tests
/// build others (an oracle that knows the target's answer, one that is always wrong) to check
/// the decoding loop's accounting and roll-back.
pub trait BlockDrafter {
    fn block_size(&self) -> usize;
    /// Proposes a block `[x, d_1 .. d_{B-1}]` for positions `pos .. pos + B - 1` (`x` sits at
    /// `pos`). `new_context` [1, n, K*H] holds the target features of the tokens accepted since
    /// the previous call (on the first call: of the whole prompt); together with the earlier
    /// ones they are the context of every token before `pos`.
    fn propose(&mut self, new_context: &Tensor, x: u32, pos: i64) -> Result<Vec<u32>>;
}

/// The DFlash drafter as a [`BlockDrafter`]: its context KV cache holds the fused features of
/// all accepted tokens, so each step only adds the newly accepted ones.
pub struct DFlashProposer<'a> {
    pub drafter: &'a Drafter,
    pub head: &'a FrozenHead,
    cache: KvCache,
}

impl<'a> DFlashProposer<'a> {
    pub fn new(drafter: &'a Drafter, head: &'a FrozenHead) -> Self {
        DFlashProposer {
            drafter,
            head,
            cache: KvCache::new(),
        }
    }
}

impl BlockDrafter for DFlashProposer<'_> {
    fn block_size(&self) -> usize {
        self.drafter.config.block_size as usize
    }

    fn propose(&mut self, new_context: &Tensor, x: u32, pos: i64) -> Result<Vec<u32>> {
        let mut block = vec![self.drafter.config.mask_token_id(); self.block_size()];
        block[0] = x as i64;
        let block_ids = Tensor::from_slice(&block).unsqueeze(0);
        let hidden = self.drafter.forward_block(
            self.head,
            Some(new_context),
            &mut self.cache,
            &block_ids,
            pos,
        );
        let mut ids = argmax_ids(&self.drafter.logits(self.head, &hidden).select(0, 0))?;
        ids[0] = x;
        Ok(ids)
    }
}

/// DFlash speculative decoding with the real drafter (see [`speculative_decode`]).
pub fn dflash(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let mut proposer = DFlashProposer::new(drafter, head);
    speculative_decode(
        target,
        &mut proposer,
        drafter.config.target_layer_ids(),
        prompt,
        max_new,
        eos,
    )
}

/// Greedy speculative decoding (dflash spec §5): the drafter proposes block_size - 1 tokens,
/// the target verifies them in one forward; the accepted prefix plus the target's bonus token
/// are emitted, the target cache rolls back to the accepted tokens and their features become
/// the drafter's new context.
pub fn speculative_decode(
    target: &TargetModel,
    proposer: &mut dyn BlockDrafter,
    tap_layers: &[usize],
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let bs = proposer.block_size();
    if bs < 2 {
        return Err(anyhow!("block size {bs}: must be at least 2"));
    }
    let req = ForwardRequest {
        tap_layers: tap_layers.to_vec(),
        final_hidden: false,
        logits: true,
    };
    let mut tcache = KvCache::new();
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let pre = target.run(
        &Tensor::from_slice(&ids).unsqueeze(0),
        Some(&mut tcache),
        &req,
    );
    let (Some(logits), Some(mut pending)) = (pre.logits, pre.features) else {
        return Err(anyhow!("the target returned no logits or features"));
    };
    let mut x = argmax_ids(&logits.select(0, 0).narrow(0, ids.len() as i64 - 1, 1))?[0];
    let mut n = ids.len() as i64; // position of x
    sync(target.device);
    let started = Instant::now();
    let mut out = vec![x];
    let mut accept_lengths = Vec::new();
    let mut drafts = Vec::new();
    while out.len() < max_new && !eos.contains(&x) {
        let draft = proposer.propose(&pending, x, n)?;
        if draft.len() != bs {
            return Err(anyhow!(
                "the drafter proposed {} tokens for a block of {bs}",
                draft.len()
            ));
        }
        // verify [x, d_1 .. d_{B-1}]
        let mut verify: Vec<i64> = vec![x as i64];
        verify.extend(draft[1..].iter().map(|&t| t as i64));
        let out_t = target.run(
            &Tensor::from_slice(&verify).unsqueeze(0),
            Some(&mut tcache),
            &req,
        );
        let (Some(vlogits), Some(vfeats)) = (out_t.logits, out_t.features) else {
            return Err(anyhow!("the target returned no logits or features"));
        };
        let y = argmax_ids(&vlogits.select(0, 0))?;
        drafts.push(draft[1..].to_vec());
        let mut a = 0;
        while a + 1 < bs && draft[a + 1] == y[a] {
            a += 1;
        }
        out.extend_from_slice(&draft[1..=a]);
        out.push(y[a]);
        accept_lengths.push(a + 1);
        // keep x, d_1..d_a in the target cache; their features join the drafter context
        tcache.truncate(n + a as i64 + 1);
        pending = vfeats.narrow(1, 0, a as i64 + 1);
        n += a as i64 + 1;
        x = y[a];
        if draft[1..=a].iter().any(|t| eos.contains(t)) {
            break;
        }
    }
    sync(target.device);
    Ok(Decoded {
        output_ids: cut(out, max_new, eos),
        accept_lengths,
        margins: vec![],
        drafts,
        decode_s: started.elapsed().as_secs_f64(),
    })
}

/// Acceptance length only (no greedy baseline, no timing): what training measures periodically.
#[derive(Debug, Clone, PartialEq)]
pub struct TauSummary {
    pub tau: f64,
    pub decode_steps: u64,
    pub generated_tokens: u64,
    pub accepted_by_slot: Vec<u64>,
}

/// Mean acceptance length of `drafter` over `prompts`.
pub fn measure_tau(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
) -> Result<TauSummary> {
    let bs = drafter.config.block_size as usize;
    let mut by_slot = vec![0u64; bs];
    let (mut steps, mut accepted, mut generated) = (0u64, 0u64, 0u64);
    for prompt in prompts.iter().filter(|p| !p.is_empty()) {
        let d = tch::no_grad(|| dflash(target, drafter, head, prompt, max_new, eos))?;
        steps += d.accept_lengths.len() as u64;
        accepted += d.accept_lengths.iter().sum::<usize>() as u64;
        generated += d.output_ids.len() as u64;
        count_slots(&mut by_slot, &d.accept_lengths);
    }
    Ok(TauSummary {
        tau: accepted as f64 / steps.max(1) as f64,
        decode_steps: steps,
        generated_tokens: generated,
        accepted_by_slot: by_slot,
    })
}

fn count_slots(by_slot: &mut [u64], accept_lengths: &[usize]) {
    let bs = by_slot.len();
    for &len in accept_lengths {
        for slot in by_slot.iter_mut().take(len.min(bs)) {
            *slot += 1;
        }
    }
}

/// Results over a set of prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Mean accepted tokens per DFlash step over all steps of all prompts.
    pub tau: f64,
    /// Time per output token, plain greedy / DFlash (prefill excluded).
    pub speedup: f64,
    pub greedy_s_per_token: f64,
    pub dflash_s_per_token: f64,
    /// Decoding seconds and output tokens (after the first) of each decoder, summed.
    pub greedy_s: f64,
    pub greedy_tokens: usize,
    pub dflash_s: f64,
    pub dflash_tokens: usize,
    /// Prompts whose DFlash output differs from plain greedy decoding.
    pub mismatches: usize,
    /// Per block slot: index 0 counts the steps (the bonus token is always taken), index k >= 1
    /// how often the drafted token of slot k was accepted.
    pub accepted_by_slot: Vec<u64>,
    pub prompts: Vec<PromptResult>,
}

/// One prompt's result.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PromptResult {
    pub prompt_ids: Vec<u32>,
    pub tau: f64,
    pub output_ids: Vec<u32>,
    pub accept_lengths: Vec<usize>,
    /// Each step's drafted tokens d_1 .. d_{B-1} (for comparisons with other implementations).
    pub drafts: Vec<Vec<u32>>,
    pub matches_greedy: bool,
    /// Index of the first differing token, when it does not match.
    pub first_mismatch: Option<usize>,
    /// The target's top-1 minus top-2 logit at that token in plain greedy decoding.
    pub mismatch_margin: Option<f32>,
}

/// Runs both decoders on every prompt.
pub fn evaluate(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
) -> Result<EvalReport> {
    let mut results = Vec::new();
    let (mut g_s, mut g_tok, mut d_s, mut d_tok) = (0.0, 0usize, 0.0, 0usize);
    for prompt in prompts.iter().filter(|p| !p.is_empty()) {
        let plain = tch::no_grad(|| greedy(target, prompt, max_new, eos))?;
        let fast = tch::no_grad(|| dflash(target, drafter, head, prompt, max_new, eos))?;
        g_s += plain.decode_s;
        g_tok += plain.output_ids.len().saturating_sub(1).max(1);
        d_s += fast.decode_s;
        d_tok += fast.output_ids.len().saturating_sub(1).max(1);
        let first_mismatch = plain
            .output_ids
            .iter()
            .zip(&fast.output_ids)
            .position(|(a, b)| a != b)
            .or_else(|| {
                (plain.output_ids.len() != fast.output_ids.len())
                    .then(|| plain.output_ids.len().min(fast.output_ids.len()))
            });
        let tau = fast.accept_lengths.iter().sum::<usize>() as f64
            / fast.accept_lengths.len().max(1) as f64;
        results.push(PromptResult {
            prompt_ids: prompt.clone(),
            tau,
            output_ids: fast.output_ids,
            accept_lengths: fast.accept_lengths,
            drafts: fast.drafts,
            matches_greedy: first_mismatch.is_none(),
            first_mismatch,
            mismatch_margin: first_mismatch.and_then(|i| plain.margins.get(i).copied()),
        });
    }
    Ok(EvalReport::from_parts(
        drafter.config.block_size as usize,
        results,
        (g_s, g_tok),
        (d_s, d_tok),
    ))
}

impl EvalReport {
    /// The totals over per-prompt results and summed decode times (seconds, tokens).
    pub fn from_parts(
        block_size: usize,
        prompts: Vec<PromptResult>,
        greedy: (f64, usize),
        dflash: (f64, usize),
    ) -> Self {
        let mut by_slot = vec![0u64; block_size];
        let (mut steps, mut accepted) = (0usize, 0usize);
        for p in &prompts {
            steps += p.accept_lengths.len();
            accepted += p.accept_lengths.iter().sum::<usize>();
            count_slots(&mut by_slot, &p.accept_lengths);
        }
        let greedy_spt = greedy.0 / greedy.1.max(1) as f64;
        let dflash_spt = dflash.0 / dflash.1.max(1) as f64;
        EvalReport {
            tau: accepted as f64 / steps.max(1) as f64,
            speedup: greedy_spt / dflash_spt.max(1e-12),
            greedy_s_per_token: greedy_spt,
            dflash_s_per_token: dflash_spt,
            greedy_s: greedy.0,
            greedy_tokens: greedy.1,
            dflash_s: dflash.0,
            dflash_tokens: dflash.1,
            mismatches: prompts.iter().filter(|r| !r.matches_greedy).count(),
            accepted_by_slot: by_slot,
            prompts,
        }
    }

    /// Reports of disjoint prompt shards (e.g. one per device) as one, prompts in the given
    /// order of shards.
    pub fn merge(block_size: usize, shards: Vec<EvalReport>) -> Self {
        let (mut g, mut d) = ((0.0, 0usize), (0.0, 0usize));
        let mut prompts = Vec::new();
        for r in shards {
            g.0 += r.greedy_s;
            g.1 += r.greedy_tokens;
            d.0 += r.dflash_s;
            d.1 += r.dflash_tokens;
            prompts.extend(r.prompts);
        }
        Self::from_parts(block_size, prompts, g, d)
    }
}
