//! Continuous batching for `regenerate`: a fixed number of slots of a [`SlotCache`] decode one
//! token each per step, and a slot whose answer ended takes the next request (or the same
//! conversation's next turn, whose earlier tokens are still in its rows) at once, so the batch
//! stays full and nothing is computed twice. Each decoding step is the same kernels over
//! buffers of fixed shape, captured once as a CUDA graph on a GPU. New requests are prefilled
//! together, in packed forwards of variable-length sequences.
//!
//! The tokens are those of [`super::generate_batch`] (the plain, rounds-based path,
//! kept as the reference): the same picks from the same logits, sampling with one uniform draw
//! per token from a generator seeded per answer.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use tch::Tensor;

use super::sampling::{pick, Sampling};
use super::Answer;
use crate::aten_ext::fused::FusedKernels;
use crate::aten_ext::graph::{CudaGraph, GraphLibrary};
use crate::aten_ext::{ProfilerRange, ProfilerTrace};
use crate::model::layers::upload;
use crate::model::{SeqSpan, SlotBatch, SlotCache, SlotLogits, TargetModel};

/// A sequence to answer: the tokens to add to its slot (a new request: the whole prompt; a
/// continuation: the tokens after what the slot already holds), how many tokens the answer may
/// have, and the seed of its sampling.
#[derive(Debug, Clone)]
pub struct Request {
    pub tokens: Vec<u32>,
    pub max_new: usize,
    pub seed: u64,
}

/// What the caller says when an answer ended: continue the same sequence (its earlier tokens
/// stay cached) or release the slot.
pub enum Next {
    Continue(Request),
    Done,
}

/// Sizes of the engine.
#[derive(Debug, Clone, Copy)]
pub struct ContinuousLimits {
    /// Sequences decoded together.
    pub slots: usize,
    /// Longest sequence (prompt, answers and later turns together).
    pub max_len: usize,
    /// Tokens per prefill forward (one longer sequence still goes alone).
    pub prefill_tokens: usize,
}

enum SlotState<K> {
    Free,
    /// Waiting for its tokens to be prefilled; `len` rows are cached already.
    Waiting {
        key: K,
        len: i64,
        request: Request,
    },
    Decoding(Box<Decoding<K>>),
}

struct Decoding<K> {
    key: K,
    /// Cached rows (the position of `next`).
    len: i64,
    /// The last picked token, fed at the next step.
    next: u32,
    tokens: Vec<u32>,
    max_new: usize,
    rng: rand_chacha::ChaCha8Rng,
}

/// The decoding step's input buffers and captured graph (outputs first: they live in its pool).
struct StepGraph {
    logits: Tensor,
    ids: Tensor,
    start: Tensor,
    live: Tensor,
    graph: CudaGraph,
}

/// Where the time went (seconds) and how much was done.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ContinuousStats {
    pub decode_steps: u64,
    pub decode_s: f64,
    pub prefills: u64,
    pub prefill_tokens: u64,
    pub prefill_s: f64,
    /// Slot-steps that decoded a token (the rest were idle slots).
    pub busy_slot_steps: u64,
    pub generated_tokens: u64,
    pub cuda_graph: bool,
}

/// Decoding steps to record with libtorch's profiler ([`ProfilerTrace`]): `steps` steps from
/// step `first` (counted from 0; the first one captures the CUDA graph), prefills between them
/// included, written to `path` (Chrome trace JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceWindow {
    pub path: std::path::PathBuf,
    pub first: u64,
    pub steps: u64,
}

/// The engine: a target model, its slots and (on a GPU) the captured decoding step.
pub struct ContinuousGenerator<'a> {
    model: &'a TargetModel,
    cache: SlotCache,
    limits: ContinuousLimits,
    graphs: Option<GraphLibrary>,
    step: Option<StepGraph>,
    trace: Option<(TraceWindow, Option<ProfilerTrace>)>,
    pub stats: ContinuousStats,
}

impl<'a> ContinuousGenerator<'a> {
    pub fn new(
        model: &'a TargetModel,
        limits: ContinuousLimits,
        graphs: Option<GraphLibrary>,
        kernels: Option<FusedKernels>,
    ) -> Result<Self> {
        if limits.slots == 0 || limits.max_len < 2 {
            bail!("continuous batching needs at least one slot and a length of 2");
        }
        // one spare row: an idle step of a full slot writes there
        let capacity = limits.max_len as i64 + 1;
        let cache = model
            .slot_cache(limits.slots as i64, capacity)
            .with_context(|| {
                let gib = model.slot_cache_bytes(limits.slots as i64, capacity) as f64
                    / (1u64 << 30) as f64;
                format!(
                    "the decoding cache of {} slots x {capacity} positions ({gib:.1} GiB) cannot be allocated: a smaller --batch-size or --max-len needs less",
                    limits.slots
                )
            })?
            .with_kernels(kernels);
        Ok(ContinuousGenerator {
            model,
            cache,
            limits,
            graphs: graphs.filter(|_| model.device.is_cuda()),
            step: None,
            trace: None,
            stats: ContinuousStats::default(),
        })
    }

    /// Records the decoding steps of `window` with the profiler (see [`TraceWindow`]).
    pub fn trace_steps(&mut self, window: TraceWindow) {
        self.trace = Some((window, None));
    }

    /// Starts or ends the profiler's window around the next decoding step, or at the end of
    /// the run (`finished`: what was recorded is written; a window the run never reached is
    /// reported).
    fn trace_at_step(&mut self, finished: bool) -> Result<()> {
        let steps = self.stats.decode_steps;
        let cuda = self.model.device.is_cuda();
        let Some((window, running)) = &mut self.trace else {
            return Ok(());
        };
        if running.is_none() && !finished && steps == window.first {
            *running = Some(ProfilerTrace::start(cuda)?);
            return Ok(());
        }
        let done = finished || steps >= window.first + window.steps;
        if !done {
            return Ok(());
        }
        match running.take() {
            Some(trace) => {
                trace.save(&window.path)?;
                log::info!(
                    "profiler trace of decoding steps {}..{} written to {}",
                    window.first,
                    steps,
                    window.path.display()
                );
            }
            None if finished => log::warn!(
                "{}: no profiler trace: the run took {steps} decoding steps, the window starts at step {}",
                window.path.display(),
                window.first
            ),
            None => return Ok(()),
        }
        self.trace = None;
        Ok(())
    }

    /// Answers requests until `next_request` has none left and every slot is free.
    /// `next_request()` gives a new sequence (with a key the caller knows it by) or `None`;
    /// `on_answer(key, answer)` receives each answer and says whether the sequence goes on.
    /// `on_progress(tokens)` is told of newly generated tokens after each step.
    pub fn run<K: Copy>(
        &mut self,
        sampling: &Sampling,
        eos: &[u32],
        mut next_request: impl FnMut() -> Option<(K, Request)>,
        mut on_answer: impl FnMut(K, Answer) -> Next,
        mut on_progress: impl FnMut(u64),
    ) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        let mut slots: Vec<SlotState<K>> =
            (0..self.limits.slots).map(|_| SlotState::Free).collect();
        let mut exhausted = false;
        loop {
            // New requests into free slots.
            if !exhausted {
                for slot in slots.iter_mut().filter(|s| matches!(s, SlotState::Free)) {
                    match next_request() {
                        Some((key, request)) => {
                            check_request(&request, 0, self.limits.max_len, vocab)?;
                            *slot = SlotState::Waiting {
                                key,
                                len: 0,
                                request,
                            };
                        }
                        None => {
                            exhausted = true;
                            break;
                        }
                    }
                }
            }
            let waiting = slots
                .iter()
                .filter(|s| matches!(s, SlotState::Waiting { .. }))
                .count();
            let decoding = slots
                .iter()
                .filter(|s| matches!(s, SlotState::Decoding(_)))
                .count();
            if waiting == 0 && decoding == 0 {
                return self.trace_at_step(true);
            }
            // Prefill once an eighth of the occupied slots wait (or nothing decodes). While the
            // input lasts every slot is occupied, so that is an eighth of the batch; when the
            // batch drains at the end, a conversation's next turn then starts after a few
            // others ended instead of after every other answer.
            if waiting > 0 && (decoding == 0 || waiting * 8 >= waiting + decoding) {
                let finished = self.prefill(&mut slots, sampling, eos)?;
                on_progress(finished.1);
                self.finish(&mut slots, finished.0, &mut on_answer, eos)?;
                continue;
            }
            self.trace_at_step(false)?;
            let finished = self.decode_step(&mut slots, sampling, eos)?;
            on_progress(finished.1);
            self.finish(&mut slots, finished.0, &mut on_answer, eos)?;
        }
    }

    /// Hands ended answers to the caller; continuing sequences wait for their next prefill.
    fn finish<K: Copy>(
        &mut self,
        slots: &mut [SlotState<K>],
        ended: Vec<usize>,
        on_answer: &mut impl FnMut(K, Answer) -> Next,
        eos: &[u32],
    ) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        for s in ended {
            let SlotState::Decoding(d) = std::mem::replace(&mut slots[s], SlotState::Free) else {
                continue;
            };
            let answer = Answer {
                eos: d.tokens.last().is_some_and(|t| eos.contains(t)),
                tokens: d.tokens,
            };
            // The last picked token is not in the cache (it was never fed): a continuation
            // starts with it.
            let len = d.len;
            match on_answer(d.key, answer) {
                Next::Continue(request) => {
                    check_request(&request, len, self.limits.max_len, vocab)?;
                    slots[s] = SlotState::Waiting {
                        key: d.key,
                        len,
                        request,
                    };
                }
                Next::Done => {}
            }
        }
        Ok(())
    }

    /// Prefills waiting slots (up to the token budget, at least one) and picks their first
    /// tokens. Returns the slots whose answer already ended and the tokens generated.
    fn prefill<K: Copy>(
        &mut self,
        slots: &mut [SlotState<K>],
        sampling: &Sampling,
        eos: &[u32],
    ) -> Result<(Vec<usize>, u64)> {
        let t = Instant::now();
        let _range = ProfilerRange::new(c"regenerate prefill");
        let mut chosen = Vec::new();
        let mut tokens = 0usize;
        for (i, s) in slots.iter().enumerate() {
            if let SlotState::Waiting { request, .. } = s {
                if !chosen.is_empty() && tokens + request.tokens.len() > self.limits.prefill_tokens
                {
                    continue;
                }
                tokens += request.tokens.len();
                chosen.push(i);
            }
        }
        let mut spans = Vec::with_capacity(chosen.len());
        let mut ids: Vec<i64> = Vec::with_capacity(tokens);
        for &i in &chosen {
            if let SlotState::Waiting { len, request, .. } = &slots[i] {
                spans.push(SeqSpan {
                    slot: i as i64,
                    start: *len,
                    len: request.tokens.len() as i64,
                });
                ids.extend(request.tokens.iter().map(|&t| t as i64));
            }
        }
        let batch = SlotBatch::packed(&self.cache, &spans)?;
        let ids = upload(&Tensor::from_slice(&ids), self.model.device);
        let out = self
            .model
            .forward_slots(&ids, &batch, &mut self.cache, &[], SlotLogits::Last)?;
        let logits = out.logits.context("the prefill returned no logits")?;
        let mut states = Vec::with_capacity(chosen.len());
        for &i in &chosen {
            let SlotState::Waiting { key, len, request } =
                std::mem::replace(&mut slots[i], SlotState::Free)
            else {
                continue;
            };
            states.push(Decoding {
                key,
                len: len + request.tokens.len() as i64,
                next: 0,
                tokens: Vec::with_capacity(request.max_new),
                max_new: request.max_new,
                rng: rand_chacha::ChaCha8Rng::seed_from_u64(request.seed),
            });
        }
        let uniforms: Vec<f64> = states
            .iter_mut()
            .map(|d| draw(sampling, &mut d.rng))
            .collect();
        let picks = pick(&logits, sampling, &uniforms)?;
        let mut ended = Vec::new();
        for ((&i, mut d), t) in chosen.iter().zip(states).zip(picks) {
            if accept(&mut d, t, eos) {
                ended.push(i);
            }
            slots[i] = SlotState::Decoding(Box::new(d));
        }
        self.stats.prefills += 1;
        self.stats.prefill_tokens += tokens as u64;
        self.stats.prefill_s += t.elapsed().as_secs_f64();
        self.stats.generated_tokens += chosen.len() as u64;
        Ok((ended, chosen.len() as u64))
    }

    /// One token for every decoding slot (idle slots compute along and are ignored).
    fn decode_step<K: Copy>(
        &mut self,
        slots: &mut [SlotState<K>],
        sampling: &Sampling,
        eos: &[u32],
    ) -> Result<(Vec<usize>, u64)> {
        let t = Instant::now();
        let _range = ProfilerRange::new(c"regenerate decode step");
        let n = slots.len();
        let mut ids = vec![0i64; n];
        let mut start = vec![0i64; n];
        // a hybrid target's idle slots keep their recurrent states
        let mut live = vec![false; n];
        for (i, s) in slots.iter().enumerate() {
            match s {
                SlotState::Decoding(d) => {
                    ids[i] = d.next as i64;
                    start[i] = d.len;
                    live[i] = true;
                }
                // Its idle write lands on the row its next tokens overwrite.
                SlotState::Waiting { len, .. } => start[i] = *len,
                SlotState::Free => {}
            }
        }
        let dev = self.model.device;
        let ids = upload(&Tensor::from_slice(&ids), dev);
        let start = upload(&Tensor::from_slice(&start), dev);
        let live = upload(&Tensor::from_slice(&live), dev);
        let logits = self.run_step(&ids, &start, &live)?;
        let mut uniforms = vec![0.0; n];
        for (u, s) in uniforms.iter_mut().zip(slots.iter_mut()) {
            if let SlotState::Decoding(d) = s {
                *u = draw(sampling, &mut d.rng);
            }
        }
        let picks = pick(&logits, sampling, &uniforms)?;
        let mut ended = Vec::new();
        let mut made = 0u64;
        for (i, (s, t)) in slots.iter_mut().zip(picks).enumerate() {
            if let SlotState::Decoding(d) = s {
                d.len += 1; // `next` is cached now
                made += 1;
                if accept(d, t, eos) {
                    ended.push(i);
                }
            }
        }
        self.stats.decode_steps += 1;
        self.stats.busy_slot_steps += made;
        self.stats.generated_tokens += made;
        self.stats.decode_s += t.elapsed().as_secs_f64();
        Ok((ended, made))
    }

    /// The decoding forward: float32 logits [slots, vocab] of tokens `ids` at `start`, the
    /// sequences `live` marks decoding (the others idle).
    fn run_step(&mut self, ids: &Tensor, start: &Tensor, live: &Tensor) -> Result<Tensor> {
        if let Some(step) = &self.step {
            step.ids.shallow_clone().copy_(ids);
            step.start.shallow_clone().copy_(start);
            step.live.shallow_clone().copy_(live);
            step.graph.replay()?;
            return Ok(step.logits.shallow_clone());
        }
        let (model, cache) = (self.model, &mut self.cache);
        let ids_buf = ids.copy();
        let start_buf = start.copy();
        let live_buf = live.copy();
        let body = |cache: &mut SlotCache| -> Result<Tensor> {
            let batch = SlotBatch::uniform(cache, &start_buf, 1).with_live(&live_buf);
            model
                .forward_slots(&ids_buf, &batch, cache, &[], SlotLogits::All)?
                .logits
                .context("the decoding step returned no logits")
        };
        let Some(library) = self.graphs else {
            return body(cache);
        };
        // the capture's warm-up runs would advance a hybrid target's recurrent states: they are
        // put back, so that the replay below (or the eager run after a failed capture) steps once
        let captured = cache
            .keeping_states(|cache| CudaGraph::capture(library, model.device, 2, || body(cache)))
            // no memory for the copy of the states (nothing ran yet): as a failed capture
            .and_then(|captured| captured);
        match captured {
            Ok((graph, logits)) => {
                let logits = logits?;
                graph.replay()?;
                let out = logits.shallow_clone();
                self.stats.cuda_graph = true;
                self.step = Some(StepGraph {
                    logits,
                    ids: ids_buf,
                    start: start_buf,
                    live: live_buf,
                    graph,
                });
                Ok(out)
            }
            Err(e) => {
                log::warn!("regenerate: CUDA graph capture failed, decoding eagerly: {e:#}");
                self.graphs = None;
                body(cache)
            }
        }
    }
}

/// One uniform draw per generated token when sampling (none when greedy).
fn draw(sampling: &Sampling, rng: &mut rand_chacha::ChaCha8Rng) -> f64 {
    if sampling.is_greedy() {
        0.0
    } else {
        rng.random::<f64>()
    }
}

/// Takes a picked token; true when the answer ended (EOS, or its limit).
fn accept<K>(d: &mut Decoding<K>, t: u32, eos: &[u32]) -> bool {
    d.tokens.push(t);
    d.next = t;
    eos.contains(&t) || d.tokens.len() >= d.max_new
}

fn check_request(r: &Request, cached: i64, max_len: usize, vocab: i64) -> Result<()> {
    if r.tokens.is_empty() {
        bail!("a request has no tokens to start from");
    }
    if r.max_new == 0 {
        bail!("a request asks for no new tokens");
    }
    if let Some(&bad) = r.tokens.iter().find(|&&t| t as i64 >= vocab) {
        bail!("token id {bad} is outside the model's vocabulary of {vocab}");
    }
    let end = cached as usize + r.tokens.len() + r.max_new;
    if end > max_len {
        bail!(
            "a sequence of {} cached + {} new tokens with up to {} answer tokens exceeds the length limit {max_len}",
            cached,
            r.tokens.len(),
            r.max_new
        );
    }
    Ok(())
}
