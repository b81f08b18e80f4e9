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
    let mut next = *argmax_ids(&logits.select(0, 0).narrow(0, ids.len() as i64 - 1, 1))?
        .first()
        .ok_or_else(|| anyhow!("empty logits"))?;
    sync(target.device);
    let started = Instant::now();
    let mut out = vec![next];
    while out.len() < max_new && !eos.contains(&next) {
        let logits = target.forward(
            &Tensor::from_slice(&[next as i64]).unsqueeze(0),
            Some(&mut cache),
        );
        next = argmax_ids(&logits.select(0, 0))?[0];
        out.push(next);
    }
    sync(target.device);
    Ok(Decoded {
        output_ids: cut(out, max_new, eos),
        accept_lengths: vec![],
        decode_s: started.elapsed().as_secs_f64(),
    })
}

/// DFlash speculative decoding: the drafter proposes block_size - 1 tokens in one forward, the
/// target verifies them in one forward; the accepted prefix plus the target's bonus token are
/// emitted, both caches roll back to the accepted tokens.
pub fn dflash(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let bs = drafter.config.block_size as usize;
    let mask = drafter.config.mask_token_id();
    let req = ForwardRequest {
        tap_layers: drafter.config.target_layer_ids().to_vec(),
        final_hidden: false,
        logits: true,
    };
    let mut tcache = KvCache::new();
    let mut dcache = KvCache::new();
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
    while out.len() < max_new && !eos.contains(&x) {
        let mut block = vec![mask; bs];
        block[0] = x as i64;
        let block_ids = Tensor::from_slice(&block).unsqueeze(0);
        let hidden = drafter.forward_block(head, Some(&pending), &mut dcache, &block_ids, n);
        let draft = argmax_ids(&drafter.logits(head, &hidden).select(0, 0))?;
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
        decode_s: started.elapsed().as_secs_f64(),
    })
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
    pub tau: f64,
    pub output_ids: Vec<u32>,
    pub accept_lengths: Vec<usize>,
    pub matches_greedy: bool,
    /// Index of the first differing token, when it does not match.
    pub first_mismatch: Option<usize>,
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
    let bs = drafter.config.block_size as usize;
    let mut results = Vec::new();
    let (mut g_s, mut g_tok, mut d_s, mut d_tok) = (0.0, 0usize, 0.0, 0usize);
    let mut steps = 0usize;
    let mut accepted = 0usize;
    let mut by_slot = vec![0u64; bs];
    for prompt in prompts.iter().filter(|p| !p.is_empty()) {
        let plain = tch::no_grad(|| greedy(target, prompt, max_new, eos))?;
        let fast = tch::no_grad(|| dflash(target, drafter, head, prompt, max_new, eos))?;
        g_s += plain.decode_s;
        g_tok += plain.output_ids.len().saturating_sub(1).max(1);
        d_s += fast.decode_s;
        d_tok += fast.output_ids.len().saturating_sub(1).max(1);
        steps += fast.accept_lengths.len();
        accepted += fast.accept_lengths.iter().sum::<usize>();
        for &len in &fast.accept_lengths {
            for slot in by_slot.iter_mut().take(len.min(bs)) {
                *slot += 1;
            }
        }
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
            tau,
            output_ids: fast.output_ids,
            accept_lengths: fast.accept_lengths,
            matches_greedy: first_mismatch.is_none(),
            first_mismatch,
        });
    }
    let greedy_spt = g_s / g_tok.max(1) as f64;
    let dflash_spt = d_s / d_tok.max(1) as f64;
    Ok(EvalReport {
        tau: accepted as f64 / steps.max(1) as f64,
        speedup: greedy_spt / dflash_spt.max(1e-12),
        greedy_s_per_token: greedy_spt,
        dflash_s_per_token: dflash_spt,
        mismatches: results.iter().filter(|r| !r.matches_greedy).count(),
        accepted_by_slot: by_slot,
        prompts: results,
    })
}
