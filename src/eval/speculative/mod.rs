//! Greedy DFlash speculative decoding (dflash spec §5), with target and drafter KV caches that
//! roll back, and plain greedy decoding timed the same way, so that acceptance length and
//! speed-up are measured on real decoding and the output can be checked for losslessness.

use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use indicatif::ProgressBar;
use tch::{Kind, Tensor};

use crate::aten_ext::graph::GraphLibrary;
use crate::model::decode::{DrafterDecoder, TargetDecoder};
use crate::model::{Drafter, FrozenHead, TargetModel};
use crate::pipeline::device_event::{DeviceEvents, TimingEvent};

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
    /// Where the decoding steps' time went.
    #[serde(skip)]
    pub times: StepTimes,
}

fn sync(device: tch::Device) {
    if let tch::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Integer ids of a tensor, read to the host (one wait for the device).
fn read_ids(ids: &Tensor) -> Result<Vec<u32>> {
    let ids = ids.to_kind(Kind::Int64).to_device(tch::Device::Cpu);
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

/// The greedy pick of one row of logits [1, V] (left on the device, [1]) and, read to the
/// host with one wait, its id and its margin over the runner-up.
fn top2(logits: &Tensor) -> Result<(Tensor, u32, f32)> {
    top2_of(logits.topk(2.min(logits.size()[1]), -1, true, true))
}

/// Where the time of decoding steps goes, summed over steps (seconds). The device parts come
/// from CUDA timing events when the model runs on a GPU; on the CPU every operation finishes
/// before it returns, so the host times are the whole story there.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepTimes {
    /// Decoding steps timed.
    pub steps: u64,
    /// Wall time of the steps.
    pub total_s: f64,
    /// Device time of the drafter's proposals (GPU only).
    pub draft_device_s: f64,
    /// Device time of the target's verify (or greedy) forwards (GPU only).
    pub verify_device_s: f64,
    /// Host time issuing the proposal (launching its graph or kernels; all of it on the CPU).
    pub draft_host_s: f64,
    /// Host time issuing the verify forward.
    pub verify_host_s: f64,
    /// Host time blocked reading the step's picks (waiting for the device to finish).
    pub host_wait_s: f64,
    /// Host time comparing drafts with the target's picks and emitting tokens.
    pub accept_s: f64,
    /// Host time setting up the roll-back: the target cache forgets the rejected rows by
    /// position (nothing is copied), the accepted tokens' features become the next context.
    pub rollback_s: f64,
}

impl StepTimes {
    pub fn add(&mut self, o: &StepTimes) {
        self.steps += o.steps;
        self.total_s += o.total_s;
        self.draft_device_s += o.draft_device_s;
        self.verify_device_s += o.verify_device_s;
        self.draft_host_s += o.draft_host_s;
        self.verify_host_s += o.verify_host_s;
        self.host_wait_s += o.host_wait_s;
        self.accept_s += o.accept_s;
        self.rollback_s += o.rollback_s;
    }

    /// Mean milliseconds per step of each part.
    pub fn per_step_ms(&self) -> StepTimesMs {
        let per = |s: f64| 1e3 * s / self.steps.max(1) as f64;
        StepTimesMs {
            steps: self.steps,
            total: per(self.total_s),
            draft_device: per(self.draft_device_s),
            verify_device: per(self.verify_device_s),
            draft_host: per(self.draft_host_s),
            verify_host: per(self.verify_host_s),
            host_wait: per(self.host_wait_s),
            accept: per(self.accept_s),
            rollback: per(self.rollback_s),
        }
    }
}

/// [`StepTimes`] as mean milliseconds per step (the `eval --json` breakdown).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepTimesMs {
    pub steps: u64,
    pub total: f64,
    pub draft_device: f64,
    pub verify_device: f64,
    pub draft_host: f64,
    pub verify_host: f64,
    pub host_wait: f64,
    pub accept: f64,
    pub rollback: f64,
}

/// Three CUDA timing events around a step's parts (none on the CPU).
struct StepClock {
    events: Option<[TimingEvent; 3]>,
}

impl StepClock {
    fn new(device: tch::Device) -> Self {
        let events = DeviceEvents::load()
            .and_then(|e| Some([e.timing(device)?, e.timing(device)?, e.timing(device)?]));
        StepClock { events }
    }

    fn mark(&self, i: usize) {
        if let Some(e) = &self.events {
            e[i].record();
        }
    }

    /// Device seconds between marks 0-1 and 1-2 (after the device passed mark 2).
    fn device_parts(&self) -> (f64, f64) {
        match &self.events {
            Some(e) => (e[0].seconds_until(&e[1]), e[1].seconds_until(&e[2])),
            None => (0.0, 0.0),
        }
    }
}

/// Plain greedy decoding with a [`TargetDecoder`] (the decoding steps of one token are CUDA
/// graphs where it has them), timed after the prefill.
pub fn greedy_decode(
    engine: &mut TargetDecoder<'_>,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let (logits, _) = engine.prefill(prompt)?;
    let (mut next_dev, mut next, margin) = top2(&logits)?;
    let device = logits.device();
    sync(device);
    let clock = StepClock::new(device);
    let mut times = StepTimes::default();
    let started = Instant::now();
    let mut out = vec![next];
    let mut margins = vec![margin];
    let mut pos = prompt.len() as i64;
    while out.len() < max_new && !eos.contains(&next) {
        let t = Instant::now();
        clock.mark(1);
        let (logits, _) = engine.step(&next_dev, pos)?;
        let picked = logits.topk(2.min(logits.size()[1]), -1, true, true);
        clock.mark(2);
        times.verify_host_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (id_dev, id, margin) = top2_of(picked)?;
        times.host_wait_s += t.elapsed().as_secs_f64();
        times.verify_device_s += clock.device_parts().1;
        next_dev = id_dev;
        next = id;
        pos += 1;
        out.push(next);
        margins.push(margin);
        times.steps += 1;
    }
    sync(device);
    let decode_s = started.elapsed().as_secs_f64();
    times.total_s = decode_s;
    let output_ids = cut(out, max_new, eos);
    margins.truncate(output_ids.len());
    Ok(Decoded {
        output_ids,
        accept_lengths: vec![],
        margins,
        drafts: vec![],
        decode_s,
        times,
    })
}

/// [`top2`] of an already computed topk (values, indices) [1, k].
fn top2_of((values, indices): (Tensor, Tensor)) -> Result<(Tensor, u32, f32)> {
    let pick = indices.select(1, 0);
    let both = Tensor::cat(
        &[values.to_kind(Kind::Double), indices.to_kind(Kind::Double)],
        1,
    )
    .to_device(tch::Device::Cpu);
    let v = Vec::<f64>::try_from(&both.view([-1])).map_err(|e| anyhow!("{e}"))?;
    match v.len() / 2 {
        2 => Ok((pick, v[2] as u32, (v[0] - v[1]) as f32)),
        1 => Ok((pick, v[1] as u32, f32::INFINITY)),
        _ => Err(anyhow!("empty logits")),
    }
}

/// Plain greedy decoding with an eager engine of its own (tests, small runs).
pub fn greedy(
    target: &TargetModel,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let mut engine = TargetDecoder::new(target, (prompt.len() + max_new + 1) as i64, &[], None)?;
    greedy_decode(&mut engine, prompt, max_new, eos)
}

/// What proposes a block during speculative decoding. The real one is [`DrafterDecoder`]; tests
/// build others (an oracle that knows the target's answer, one that is always wrong) to check
/// the decoding loop's accounting and roll-back.
pub trait BlockDrafter {
    fn block_size(&self) -> usize;
    /// Proposes a block `[x, d_1 .. d_{B-1}]` for positions `pos .. pos + B - 1` (`x` sits at
    /// `pos`; `x_on_device` is the same token as an int64 [1] on the target's device).
    /// `new_context` [n, K*H] holds the target features of the tokens accepted since the
    /// previous call (on the first call: of the whole prompt); together with the earlier ones
    /// they are the context of every token before `pos`. Returns the block as int64 [B] on any
    /// device (the real drafter leaves it on its device, so that nothing waits for it).
    fn propose(
        &mut self,
        new_context: &Tensor,
        x: u32,
        x_on_device: &Tensor,
        pos: i64,
    ) -> Result<Tensor>;
}

/// The DFlash drafter's engine as a [`BlockDrafter`]: its context cache holds the fused
/// features of all accepted tokens, so each step only adds the newly accepted ones.
impl BlockDrafter for DrafterDecoder<'_> {
    fn block_size(&self) -> usize {
        DrafterDecoder::block_size(self)
    }

    fn propose(
        &mut self,
        new_context: &Tensor,
        _x: u32,
        x_on_device: &Tensor,
        pos: i64,
    ) -> Result<Tensor> {
        self.draft(new_context, x_on_device, pos)
    }
}

/// Positions an engine needs for `prompt_len` + `max_new` tokens with blocks of `block`: the
/// last verify may reach a block past the last emitted token, and the drafter's context rows
/// of a step sit before its block.
pub fn capacity_for(prompt_len: usize, max_new: usize, block: usize) -> i64 {
    (prompt_len + max_new + 2 * block + 1) as i64
}

/// DFlash speculative decoding with the real drafter and eager engines of its own (tests,
/// the trainer's periodic evaluation).
pub fn dflash(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let bs = drafter.config.block_size as usize;
    let capacity = capacity_for(prompt.len(), max_new, bs);
    let mut proposer = DrafterDecoder::new(drafter, head, capacity, None)?;
    speculative_decode(
        target,
        &mut proposer,
        drafter.config.target_layer_ids(),
        prompt,
        max_new,
        eos,
    )
}

/// [`speculative_decode_with`] on an eager target engine of its own.
pub fn speculative_decode(
    target: &TargetModel,
    proposer: &mut dyn BlockDrafter,
    tap_layers: &[usize],
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let capacity = capacity_for(prompt.len(), max_new, proposer.block_size());
    let mut engine = TargetDecoder::new(target, capacity, tap_layers, None)?;
    speculative_decode_with(&mut engine, proposer, prompt, max_new, eos)
}

/// Greedy speculative decoding (dflash spec §5): the drafter proposes block_size - 1 tokens,
/// the target verifies them in one forward; the accepted prefix plus the target's bonus token
/// are emitted, the target cache rolls back to the accepted tokens (its rows past them are
/// overwritten by the next verify) and their features become the drafter's new context. Each
/// step waits for the device once: the drafts and the target's picks are read together.
pub fn speculative_decode_with(
    engine: &mut TargetDecoder<'_>,
    proposer: &mut dyn BlockDrafter,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Decoded> {
    let bs = proposer.block_size();
    if bs < 2 {
        return Err(anyhow!("block size {bs}: must be at least 2"));
    }
    let (logits, features) = engine.prefill(prompt)?;
    let mut pending = features.context("the target engine returned no features")?;
    let device = logits.device();
    let (mut x_dev, mut x, _) = top2(&logits)?;
    let mut n = prompt.len() as i64; // position of x
    sync(device);
    let clock = StepClock::new(device);
    let mut times = StepTimes::default();
    let started = Instant::now();
    let mut out = vec![x];
    let mut accept_lengths = Vec::new();
    let mut drafts = Vec::new();
    while out.len() < max_new && !eos.contains(&x) {
        let t = Instant::now();
        clock.mark(0);
        let draft = proposer.propose(&pending, x, &x_dev, n)?;
        if draft.size() != [bs as i64] {
            return Err(anyhow!(
                "the drafter proposed {:?} tokens for a block of {bs}",
                draft.size()
            ));
        }
        let draft = draft.to_device(device).to_kind(Kind::Int64);
        times.draft_host_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        clock.mark(1);
        // verify [x, d_1 .. d_{B-1}] (the proposal carries x in slot 0)
        let (vlogits, vfeats) = engine.step(&draft, n)?;
        let vfeats = vfeats.context("the target engine returned no features")?;
        let y_dev = vlogits.argmax(-1, false);
        let both = Tensor::cat(&[&draft, &y_dev], 0);
        clock.mark(2);
        times.verify_host_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let ids = read_ids(&both)?;
        times.host_wait_s += t.elapsed().as_secs_f64();
        let (draft_ids, y) = ids.split_at(bs);
        let (draft_dev_s, verify_dev_s) = clock.device_parts();
        times.draft_device_s += draft_dev_s;
        times.verify_device_s += verify_dev_s;
        let t = Instant::now();
        if draft_ids[0] != x {
            return Err(anyhow!(
                "the drafter's block starts with {} instead of x = {x}",
                draft_ids[0]
            ));
        }
        drafts.push(draft_ids[1..].to_vec());
        let mut a = 0;
        while a + 1 < bs && draft_ids[a + 1] == y[a] {
            a += 1;
        }
        out.extend_from_slice(&draft_ids[1..=a]);
        out.push(y[a]);
        accept_lengths.push(a + 1);
        times.accept_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        // keep x, d_1..d_a (the next verify writes from n + a + 1 on); their features join the
        // drafter context
        pending = vfeats.narrow(0, 0, a as i64 + 1);
        x_dev = y_dev.narrow(0, a as i64, 1);
        n += a as i64 + 1;
        x = y[a];
        times.rollback_s += t.elapsed().as_secs_f64();
        times.steps += 1;
        if draft_ids[1..=a].iter().any(|t| eos.contains(t)) {
            break;
        }
    }
    sync(device);
    let decode_s = started.elapsed().as_secs_f64();
    times.total_s = decode_s;
    Ok(Decoded {
        output_ids: cut(out, max_new, eos),
        accept_lengths,
        margins: vec![],
        drafts,
        decode_s,
        times,
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

/// Mean acceptance length of `drafter` over `prompts` (eager engines, no graphs: the trainer's
/// other stages share the device).
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

/// How [`evaluate`] runs.
#[derive(Debug, Clone, Default)]
pub struct EvalOptions {
    /// CUDA graphs for the decoding steps (GPU only).
    pub graphs: Option<GraphLibrary>,
    /// The first this many prompts are decoded once, untimed, before the measured pass
    /// (graph capture, libtorch's lazy set-up, caches): the timing then shows steady decoding.
    pub warmup_prompts: usize,
    /// Advanced by one for each measured prompt, between prompts (outside the timing).
    pub progress: Option<ProgressBar>,
}

/// Spread of a per-prompt number.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub p10: f64,
    pub median: f64,
    pub p90: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Spread::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| {
            let i = q * (v.len() - 1) as f64;
            let (lo, hi) = (i.floor() as usize, i.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (i - lo as f64)
        };
        Spread {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            p10: at(0.1),
            median: at(0.5),
            p90: at(0.9),
            max: v[v.len() - 1],
        }
    }
}

/// Results over a set of prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Mean accepted tokens per DFlash step over all steps of all prompts.
    pub tau: f64,
    /// Time per output token, plain greedy / DFlash (prefill and warm-up excluded).
    pub speedup: f64,
    /// The per-prompt speed-ups (each prompt's greedy / DFlash time per token).
    pub speedup_spread: Spread,
    pub greedy_s_per_token: f64,
    pub dflash_s_per_token: f64,
    /// Milliseconds of one plain greedy step (one token).
    pub greedy_ms_per_token: f64,
    /// Milliseconds of one DFlash step (draft + verify of a block), and that in greedy steps.
    pub dflash_ms_per_step: f64,
    pub step_cost_in_greedy_steps: f64,
    /// Where a DFlash step's time goes (mean ms per step).
    pub dflash_step_ms: StepTimesMs,
    /// Where a greedy step's time goes (mean ms per step; verify = its forward).
    pub greedy_step_ms: StepTimesMs,
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
    /// Prompts decoded untimed before the measured pass.
    pub warmup_prompts: usize,
    /// Whether the decoding steps ran as CUDA graphs.
    pub cuda_graphs: bool,
    /// Why `speedup` should not be trusted, each reason with what to do; empty when nothing
    /// stands out (see [`EvalReport::speedup_warnings`]; `eval` fills it in).
    pub speedup_warnings: Vec<String>,
    pub prompts: Vec<PromptResult>,
}

/// Fewer timed prompts than this: the speed-up is one of a few samples.
pub const MIN_TRUSTED_PROMPTS: usize = 10;
/// Fewer timed output tokens (per decoder) than this: a few milliseconds of noise move it.
pub const MIN_TRUSTED_TOKENS: usize = 500;
/// Per-prompt speed-ups whose p10..p90 range is wider than this share of their median
/// disagree too much for one number to stand for them.
pub const MAX_TRUSTED_SPREAD: f64 = 0.5;

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
    /// Decoding seconds and timed tokens (after the first) of each decoder on this prompt.
    pub greedy_s: f64,
    pub dflash_s: f64,
    pub greedy_tokens: usize,
    pub dflash_tokens: usize,
    #[serde(skip)]
    pub greedy_times: StepTimes,
    #[serde(skip)]
    pub dflash_times: StepTimes,
}

impl PromptResult {
    /// This prompt's speed-up (greedy / DFlash time per output token).
    pub fn speedup(&self) -> f64 {
        let g = self.greedy_s / self.greedy_tokens.max(1) as f64;
        let d = self.dflash_s / self.dflash_tokens.max(1) as f64;
        g / d.max(1e-12)
    }
}

/// Runs both decoders on every prompt: one engine each, with room for the longest prompt, CUDA
/// graphs where `opts` has them.
pub fn evaluate(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
    opts: &EvalOptions,
) -> Result<EvalReport> {
    let bs = drafter.config.block_size as usize;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = capacity_for(longest, max_new, bs);
    let mut plain_engine = TargetDecoder::new(target, capacity, &[], opts.graphs)?;
    let mut fast_engine = TargetDecoder::new(
        target,
        capacity,
        drafter.config.target_layer_ids(),
        opts.graphs,
    )?;
    let mut proposer = DrafterDecoder::new(drafter, head, capacity, opts.graphs)?;
    let prompts: Vec<&Vec<u32>> = prompts.iter().filter(|p| !p.is_empty()).collect();
    let mut run = |prompt: &[u32]| -> Result<(Decoded, Decoded)> {
        tch::no_grad(|| {
            let plain = greedy_decode(&mut plain_engine, prompt, max_new, eos)?;
            let fast =
                speculative_decode_with(&mut fast_engine, &mut proposer, prompt, max_new, eos)?;
            Ok((plain, fast))
        })
    };
    let bar = opts.progress.as_ref();
    if opts.warmup_prompts > 0 {
        if let Some(bar) = bar {
            bar.set_message("warming up");
        }
    }
    for prompt in prompts.iter().take(opts.warmup_prompts) {
        run(prompt)?;
    }
    if let Some(bar) = bar {
        bar.set_message("");
    }
    let mut results = Vec::new();
    for prompt in &prompts {
        let (plain, fast) = run(prompt)?;
        if let Some(bar) = bar {
            bar.inc(1);
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
            prompt_ids: prompt.to_vec(),
            tau,
            greedy_s: plain.decode_s,
            dflash_s: fast.decode_s,
            greedy_tokens: plain.output_ids.len().saturating_sub(1).max(1),
            dflash_tokens: fast.output_ids.len().saturating_sub(1).max(1),
            greedy_times: plain.times,
            dflash_times: fast.times,
            output_ids: fast.output_ids,
            accept_lengths: fast.accept_lengths,
            drafts: fast.drafts,
            matches_greedy: first_mismatch.is_none(),
            first_mismatch,
            mismatch_margin: first_mismatch.and_then(|i| plain.margins.get(i).copied()),
        });
    }
    let graphs = plain_engine.uses_graphs() && fast_engine.uses_graphs();
    let mut report = EvalReport::from_prompts(bs, results);
    report.warmup_prompts = opts.warmup_prompts.min(prompts.len());
    report.cuda_graphs = graphs;
    Ok(report)
}

impl EvalReport {
    /// The totals over per-prompt results.
    pub fn from_prompts(block_size: usize, prompts: Vec<PromptResult>) -> Self {
        let mut by_slot = vec![0u64; block_size];
        let (mut steps, mut accepted) = (0usize, 0usize);
        let (mut g_s, mut g_tok, mut d_s, mut d_tok) = (0.0, 0usize, 0.0, 0usize);
        let (mut g_times, mut d_times) = (StepTimes::default(), StepTimes::default());
        for p in &prompts {
            steps += p.accept_lengths.len();
            accepted += p.accept_lengths.iter().sum::<usize>();
            count_slots(&mut by_slot, &p.accept_lengths);
            g_s += p.greedy_s;
            g_tok += p.greedy_tokens;
            d_s += p.dflash_s;
            d_tok += p.dflash_tokens;
            g_times.add(&p.greedy_times);
            d_times.add(&p.dflash_times);
        }
        let greedy_spt = g_s / g_tok.max(1) as f64;
        let dflash_spt = d_s / d_tok.max(1) as f64;
        let greedy_step_ms = g_times.per_step_ms();
        let dflash_step_ms = d_times.per_step_ms();
        let speedups: Vec<f64> = prompts.iter().map(PromptResult::speedup).collect();
        EvalReport {
            tau: accepted as f64 / steps.max(1) as f64,
            speedup: greedy_spt / dflash_spt.max(1e-12),
            speedup_spread: Spread::of(&speedups),
            greedy_s_per_token: greedy_spt,
            dflash_s_per_token: dflash_spt,
            greedy_ms_per_token: greedy_step_ms.total,
            dflash_ms_per_step: dflash_step_ms.total,
            step_cost_in_greedy_steps: dflash_step_ms.total / greedy_step_ms.total.max(1e-12),
            dflash_step_ms,
            greedy_step_ms,
            greedy_s: g_s,
            greedy_tokens: g_tok,
            dflash_s: d_s,
            dflash_tokens: d_tok,
            mismatches: prompts.iter().filter(|r| !r.matches_greedy).count(),
            accepted_by_slot: by_slot,
            warmup_prompts: 0,
            cuda_graphs: false,
            speedup_warnings: Vec::new(),
            prompts,
        }
    }

    /// Why this report's speed-up is not a trustworthy measurement, each reason with what to
    /// do; empty when nothing stands out. `on_cpu`: some of the decoding ran on the CPU. tau and
    /// the mismatches do not depend on timing and are not concerned.
    pub fn speedup_warnings(&self, on_cpu: bool) -> Vec<String> {
        let mut out = Vec::new();
        if on_cpu {
            // Identical CPU runs of the same model measured 2.78x, 0.42x and 1.83x.
            out.push(
                "decoding ran on the CPU, where the time per token swings with other processes, thread scheduling and clock speed (identical CPU runs have measured anywhere from 0.4x to 2.8x): measure the speed-up on a GPU (--device cuda)".to_string(),
            );
        }
        let n = self.prompts.len();
        if n < MIN_TRUSTED_PROMPTS {
            out.push(format!(
                "only {n} prompt(s) were timed: time at least {MIN_TRUSTED_PROMPTS} (--limit 20 or more, and as many prompts in the data)"
            ));
        }
        let tokens = self.greedy_tokens.min(self.dflash_tokens);
        if tokens < MIN_TRUSTED_TOKENS {
            out.push(format!(
                "only {tokens} output tokens were timed: time at least {MIN_TRUSTED_TOKENS} (a larger --max-new-tokens or --limit)"
            ));
        }
        let sp = &self.speedup_spread;
        if n >= 2 && sp.median > 0.0 && (sp.p90 - sp.p10) / sp.median > MAX_TRUSTED_SPREAD {
            out.push(format!(
                "the per-prompt speed-ups range from {:.2}x (p10) to {:.2}x (p90) around a median of {:.2}x: time more prompts, on an otherwise idle machine or a GPU",
                sp.p10, sp.p90, sp.median
            ));
        }
        if self.warmup_prompts == 0 {
            out.push(
                "no prompt was decoded untimed first (--warmup 0): the first prompt's time includes the set-up (libtorch's lazy initialisation, CUDA graph capture); use --warmup 1".to_string(),
            );
        }
        out
    }

    /// Reports of disjoint prompt shards (e.g. one per device) as one, prompts in the given
    /// order of shards.
    pub fn merge(block_size: usize, shards: Vec<EvalReport>) -> Self {
        let warmup = shards.iter().map(|r| r.warmup_prompts).sum();
        let graphs = !shards.is_empty() && shards.iter().all(|r| r.cuda_graphs);
        let prompts = shards.into_iter().flat_map(|r| r.prompts).collect();
        let mut report = Self::from_prompts(block_size, prompts);
        report.warmup_prompts = warmup;
        report.cuda_graphs = graphs;
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt timed at `greedy_s` / `dflash_s` seconds for `tokens` tokens each.
    fn timed(greedy_s: f64, dflash_s: f64, tokens: usize) -> PromptResult {
        PromptResult {
            prompt_ids: vec![1],
            tau: 2.0,
            output_ids: vec![2; tokens + 1],
            accept_lengths: vec![2],
            drafts: vec![],
            matches_greedy: true,
            first_mismatch: None,
            mismatch_margin: None,
            greedy_s,
            dflash_s,
            greedy_tokens: tokens,
            dflash_tokens: tokens,
            greedy_times: StepTimes::default(),
            dflash_times: StepTimes::default(),
        }
    }

    fn report(prompts: Vec<PromptResult>, warmup: usize) -> EvalReport {
        let mut r = EvalReport::from_prompts(4, prompts);
        r.warmup_prompts = warmup;
        r
    }

    #[test]
    fn a_steady_gpu_like_measurement_has_no_warning() {
        let prompts = (0..20)
            .map(|i| timed(1.0, 0.5 + 0.001 * i as f64, 100))
            .collect();
        assert!(report(prompts, 1).speedup_warnings(false).is_empty());
    }

    #[test]
    fn each_untrustworthy_measurement_is_named_with_what_to_do() {
        let steady = || (0..20).map(|_| timed(1.0, 0.5, 100)).collect::<Vec<_>>();
        // On the CPU.
        let w = report(steady(), 1).speedup_warnings(true);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("CPU") && w[0].contains("GPU"), "{w:?}");
        // Too few prompts, and so too few tokens.
        let w = report(steady()[..3].to_vec(), 1).speedup_warnings(false);
        assert!(
            w.iter()
                .any(|m| m.contains("only 3 prompt(s)") && m.contains("--limit")),
            "{w:?}"
        );
        assert!(
            w.iter().any(|m| m.contains("only 300 output tokens")),
            "{w:?}"
        );
        // Speed-ups from 0.4x to 2.8x around a median of 1.4x.
        let wide: Vec<_> = (0..20)
            .map(|i| timed(1.0, 1.0 / (0.4 + 0.125 * i as f64), 100))
            .collect();
        let w = report(wide, 1).speedup_warnings(false);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("range from") && w[0].contains("more prompts"),
            "{w:?}"
        );
        // No warm-up.
        let w = report(steady(), 0).speedup_warnings(false);
        assert!(w.len() == 1 && w[0].contains("--warmup 1"), "{w:?}");
    }
}
