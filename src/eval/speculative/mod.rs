//! Greedy DFlash speculative decoding (dflash spec §5), with target and drafter KV caches that
//! roll back, and plain greedy decoding timed the same way, so that acceptance length and
//! speed-up are measured on real decoding and the output can be checked for losslessness.

mod report;

pub use report::{
    EvalReport, Interval, PromptResult, Spread, MAX_TRUSTED_SPREAD, MIN_TRUSTED_PROMPTS,
    MIN_TRUSTED_TOKENS,
};

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use indicatif::ProgressBar;
use tch::{Kind, Tensor};

use crate::aten_ext::fused::FusedKernels;
use crate::aten_ext::graph::GraphLibrary;
use crate::aten_ext::ProfilerRange;
use crate::device_event::{DeviceEvents, TimingEvent};
use crate::eval::cancel::check;
use crate::model::decode::{DrafterDecoder, TargetDecoder};
use crate::model::{Drafter, FrozenHead, TargetModel};

/// Why a drafter's tau says nothing of it: its weights hold NaN or infinite values (a diverged
/// run, a corrupt file), so that every draft is rejected and tau is 1 whatever it learnt.
/// Empty when every weight is finite.
pub fn drafter_warnings(drafter: &Drafter) -> Vec<String> {
    let params = drafter.named_parameters();
    let bad: Vec<&str> = params
        .iter()
        .filter(|(_, t)| t.isfinite().all().int64_value(&[]) == 0)
        .map(|(name, _)| name.as_str())
        .collect();
    if bad.is_empty() {
        return Vec::new();
    }
    let shown = bad.iter().take(3).copied().collect::<Vec<_>>().join(", ");
    let more = if bad.len() > 3 { ", ..." } else { "" };
    vec![format!(
        "the drafter's weights are not finite: {} of its {} tensors hold NaN or infinite values ({shown}{more}); its drafts mean nothing, and neither does tau (a diverged training run or a damaged file: evaluate an earlier checkpoint)",
        bad.len(),
        params.len()
    )]
}

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
    pub(crate) fn per_step_ms(&self) -> StepTimesMs {
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
pub(crate) fn greedy_decode(
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
        let range = ProfilerRange::new(c"greedy step");
        let (logits, _) = engine.step(&next_dev, pos)?;
        let picked = logits.topk(2.min(logits.size()[1]), -1, true, true);
        drop(range);
        clock.mark(2);
        times.verify_host_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let range = ProfilerRange::new(c"greedy read");
        let (id_dev, id, margin) = top2_of(picked)?;
        drop(range);
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
    let mut engine =
        TargetDecoder::new(target, (prompt.len() + max_new + 1) as i64, &[], None, None)?;
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
    dflash_until(
        target,
        drafter,
        head,
        prompt,
        max_new,
        eos,
        &AtomicBool::new(false),
    )
}

/// [`dflash`] that ends with [`Cancelled`](crate::eval::cancel::Cancelled) between decoding
/// steps once `cancel` is set.
fn dflash_until(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
    cancel: &AtomicBool,
) -> Result<Decoded> {
    let bs = drafter.config.block_size as usize;
    let capacity = capacity_for(prompt.len(), max_new, bs);
    let mut proposer = DrafterDecoder::new(drafter, head, capacity, None, None)?;
    let taps = drafter.config.target_layer_ids();
    let mut engine = TargetDecoder::new(target, capacity, taps, None, None)?;
    decode(&mut engine, &mut proposer, prompt, max_new, eos, cancel)
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
    let mut engine = TargetDecoder::new(target, capacity, tap_layers, None, None)?;
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
    decode(
        engine,
        proposer,
        prompt,
        max_new,
        eos,
        &AtomicBool::new(false),
    )
}

/// [`speculative_decode_with`], looking at `cancel` before each decoding step.
fn decode(
    engine: &mut TargetDecoder<'_>,
    proposer: &mut dyn BlockDrafter,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
    cancel: &AtomicBool,
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
        check(cancel)?;
        let t = Instant::now();
        clock.mark(0);
        let range = ProfilerRange::new(c"dflash draft");
        let draft = proposer.propose(&pending, x, &x_dev, n)?;
        if draft.size() != [bs as i64] {
            return Err(anyhow!(
                "the drafter proposed {:?} tokens for a block of {bs}",
                draft.size()
            ));
        }
        let draft = draft.to_device(device).to_kind(Kind::Int64);
        drop(range);
        times.draft_host_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        clock.mark(1);
        let range = ProfilerRange::new(c"dflash verify");
        // verify [x, d_1 .. d_{B-1}] (the proposal carries x in slot 0)
        let (vlogits, vfeats) = engine.step(&draft, n)?;
        let vfeats = vfeats.context("the target engine returned no features")?;
        let y_dev = vlogits.argmax(-1, false);
        let both = Tensor::cat(&[&draft, &y_dev], 0);
        drop(range);
        clock.mark(2);
        times.verify_host_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let range = ProfilerRange::new(c"dflash read");
        let ids = read_ids(&both)?;
        drop(range);
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
pub(crate) struct TauSummary {
    pub tau: f64,
    pub decode_steps: u64,
    pub generated_tokens: u64,
    pub accepted_by_slot: Vec<u64>,
}

/// Mean acceptance length of `drafter` over `prompts` (eager engines, no graphs: the trainer's
/// other stages share the device). Ends with [`Cancelled`](crate::eval::cancel::Cancelled)
/// between decoding steps once `cancel` is set.
pub(crate) fn measure_tau(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
    cancel: &AtomicBool,
) -> Result<TauSummary> {
    let bs = drafter.config.block_size as usize;
    let mut by_slot = vec![0u64; bs];
    let (mut steps, mut accepted, mut generated) = (0u64, 0u64, 0u64);
    let prompts: Vec<&Vec<u32>> = prompts.iter().filter(|p| !p.is_empty()).collect();
    for (done, prompt) in prompts.iter().enumerate() {
        let d = tch::no_grad(|| dflash_until(target, drafter, head, prompt, max_new, eos, cancel))
            .with_context(|| format!("after {done} of {} prompts", prompts.len()))?;
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
    /// Fused kernels for the drafter's steps (GPU, half precision; see
    /// [`crate::aten_ext::fused`]).
    pub kernels: Option<FusedKernels>,
    /// The first this many prompts are decoded once, untimed, before the measured pass
    /// (graph capture, libtorch's lazy set-up, caches): the timing then shows steady decoding.
    pub warmup_prompts: usize,
    /// Advanced by one for each measured prompt, between prompts (outside the timing).
    pub progress: Option<ProgressBar>,
    /// Writes a profiler trace ([`crate::aten_ext::ProfilerTrace`]) of one more decoding of the
    /// first prompt, greedy then DFlash, after the warm-up and outside the measurement.
    pub trace: Option<std::path::PathBuf>,
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
    let mut plain_engine = TargetDecoder::new(target, capacity, &[], opts.graphs, opts.kernels)?;
    let mut fast_engine = TargetDecoder::new(
        target,
        capacity,
        drafter.config.target_layer_ids(),
        opts.graphs,
        opts.kernels,
    )?;
    let mut proposer = DrafterDecoder::new(drafter, head, capacity, opts.graphs, opts.kernels)?;
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
    if let (Some(path), Some(prompt)) = (&opts.trace, prompts.first()) {
        let trace = crate::aten_ext::ProfilerTrace::start(target.device.is_cuda())?;
        run(prompt)?;
        trace.save(path)?;
        log::info!(
            "eval: profiler trace of the first prompt's decoding (greedy, then DFlash) written to {}",
            path.display()
        );
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
    report.fused_kernels = proposer.uses_fused_kernels()
        && plain_engine.uses_fused_kernels()
        && fast_engine.uses_fused_kernels();
    Ok(report)
}
