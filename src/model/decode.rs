//! Decoding engines over a [`SlotCache`]: the target's steps (one token for greedy decoding, a
//! block for DFlash's verify) and the drafter's block proposals. Every step of a given size
//! runs the same kernels on buffers of fixed shape whose values change (token ids, start
//! positions), so on a GPU it is captured once as a CUDA graph and then replayed: a step of a
//! small model costs its arithmetic, not hundreds of kernel launches from the host. Without a
//! graph library (CPU, or a build without CUDA headers) the same code runs eagerly.

use anyhow::{bail, Context, Result};
use tch::{Kind, Tensor};

use super::drafter::{Drafter, FrozenHead};
use super::slots::{SlotBatch, SlotCache};
use super::target::{SlotLogits, TargetModel};
use crate::aten_ext::fused::FusedKernels;
use crate::aten_ext::graph::{CudaGraph, GraphLibrary};

/// Eager runs before a capture (libtorch sets up per-stream state such as cuBLAS workspaces).
const WARMUP_RUNS: usize = 2;

/// Graphs are tried until one fails; then the engine stays eager (and says so once).
#[derive(Debug)]
struct GraphPolicy {
    library: Option<GraphLibrary>,
    what: &'static str,
}

impl GraphPolicy {
    fn capture<T>(
        &mut self,
        device: tch::Device,
        body: impl FnMut() -> T,
    ) -> Option<(CudaGraph, T)> {
        let library = self.library?;
        match CudaGraph::capture(library, device, WARMUP_RUNS, body) {
            Ok(done) => Some(done),
            Err(e) => {
                log::warn!(
                    "{}: CUDA graph capture failed, decoding eagerly: {e:#}",
                    self.what
                );
                self.library = None;
                None
            }
        }
    }
}

/// One captured target step of a fixed number of tokens: its input buffers and outputs.
struct TargetStep {
    tokens: i64,
    // Outputs before the graph: they live in its memory pool.
    logits: Tensor,
    features: Option<Tensor>,
    ids: Tensor,
    start: Tensor,
    graph: CudaGraph,
}

/// The target's side of decoding one sequence (slot 0 of a one-slot cache).
pub struct TargetDecoder<'a> {
    target: &'a TargetModel,
    cache: SlotCache,
    taps: Vec<usize>,
    graphs: GraphPolicy,
    steps: Vec<TargetStep>,
    /// A hybrid target's recurrent states (see [`TargetDecoder::roll_states_to`]).
    states: StatesAt,
}

/// Where a hybrid target's Gated DeltaNet states stand: the position after the last token
/// they took in, and the latest multi-token step whose per-token states the cache kept
/// (start, tokens), to which [`TargetDecoder::step`] can roll back.
#[derive(Debug, Default)]
struct StatesAt {
    position: i64,
    kept_step: Option<(i64, i64)>,
    /// [1] int64 device buffers of the commit: slot 0, the accepted tokens.
    slot: Option<Tensor>,
    accepted: Option<Tensor>,
}

impl<'a> TargetDecoder<'a> {
    /// An engine for sequences of up to `capacity` positions that returns the features of the
    /// `taps` layers with every step (none when empty) and captures CUDA graphs with `graphs`.
    pub fn new(
        target: &'a TargetModel,
        capacity: i64,
        taps: &[usize],
        graphs: Option<GraphLibrary>,
        kernels: Option<FusedKernels>,
    ) -> Result<Self> {
        let cache = target
            .slot_cache(1, capacity)
            .context("allocating the target's key/value cache")?
            .with_kernels(kernels);
        Ok(TargetDecoder {
            target,
            cache,
            taps: taps.to_vec(),
            graphs: GraphPolicy {
                library: graphs.filter(|_| target.device.is_cuda()),
                what: "target",
            },
            steps: Vec::new(),
            states: StatesAt::default(),
        })
    }

    /// Before a step from `start` with a hybrid target: its Gated DeltaNet states must stand
    /// at `start`. Where `start` lies within the latest multi-token step (a verify whose first
    /// `start - step start` tokens were accepted), the states after that prefix are committed
    /// from the ones the step kept (a device gather); a sequence from 0 starts afresh; any
    /// other position cannot be returned to (an error).
    fn roll_states_to(&mut self, start: i64) -> Result<()> {
        let at = &mut self.states;
        if start == 0 || start == at.position {
            return Ok(());
        }
        let Some((first, _)) = at.kept_step.filter(|(s, n)| start > *s && start < s + n) else {
            bail!(
                "cannot roll a hybrid target's recurrent states to position {start}: they stand at {}, and only a position within the latest multi-token step can be returned to",
                at.position
            );
        };
        let dev = self.target.device;
        let slot = at
            .slot
            .get_or_insert_with(|| Tensor::zeros([1], (Kind::Int64, dev)));
        let accepted = at
            .accepted
            .get_or_insert_with(|| Tensor::zeros([1], (Kind::Int64, dev)));
        let _ = accepted.fill_(start - first);
        if let Some(states) = self.cache.states() {
            states.commit_accepted(slot, accepted)?;
        }
        at.position = start;
        at.kept_step = None;
        Ok(())
    }

    /// After a forward of `tokens` tokens from `start`: where the states stand now.
    fn states_moved(&mut self, start: i64, tokens: i64) {
        let kept = self.cache.states().is_some_and(|s| s.keeps(tokens)) && tokens > 1;
        self.states.position = start + tokens;
        self.states.kept_step = kept.then_some((start, tokens));
    }

    pub fn capacity(&self) -> i64 {
        self.cache.capacity
    }

    /// Whether steps run as CUDA graphs (so far).
    pub fn uses_graphs(&self) -> bool {
        self.graphs.library.is_some()
    }

    /// Whether steps run the fused kernels.
    pub fn uses_fused_kernels(&self) -> bool {
        self.cache.kernels().is_some()
    }

    /// The prompt from position 0 (eagerly): the float32 logits of its last token [1, vocab]
    /// and the features of all its tokens [len, K * H].
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<(Tensor, Option<Tensor>)> {
        let len = prompt.len() as i64;
        if len == 0 || len > self.cache.capacity {
            bail!(
                "a prompt of {len} tokens does not fit a cache of {} positions",
                self.cache.capacity
            );
        }
        let dev = self.target.device;
        let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
        let ids = Tensor::from_slice(&ids).to_device(dev);
        let start = Tensor::zeros([1], (Kind::Int64, dev));
        let batch = SlotBatch::uniform(&self.cache, &start, len);
        let out = self.target.forward_slots(
            &ids,
            &batch,
            &mut self.cache,
            &self.taps,
            SlotLogits::Last,
        )?;
        self.states_moved(0, len);
        Ok((out.logits.context("no logits")?, out.features))
    }

    /// `ids` [q] (int64, on the target's device) at positions `start .. start + q`, seeing the
    /// cache's rows before `start` (earlier rows past it are forgotten: that is the roll-back).
    /// Returns the float32 logits [q, vocab] and the features [q, K * H]. On a GPU the step
    /// runs as a CUDA graph captured on the first step of this size: the returned tensors are
    /// that graph's outputs and hold their values until the next step of the same size.
    ///
    /// A hybrid target's recurrent states cannot forget: a step of several tokens keeps the
    /// states after each, and the next step, from within it, commits the accepted prefix's
    /// (see [`TargetDecoder::roll_states_to`]); stepping back any further is an error.
    pub fn step(&mut self, ids: &Tensor, start: i64) -> Result<(Tensor, Option<Tensor>)> {
        let q = ids.size()[0];
        if start < 0 || start + q > self.cache.capacity {
            bail!(
                "{q} tokens from position {start} do not fit a cache of {} positions",
                self.cache.capacity
            );
        }
        let out = self.step_from(ids, start, q)?;
        self.states_moved(start, q);
        Ok(out)
    }

    /// [`TargetDecoder::step`] after the checks.
    fn step_from(&mut self, ids: &Tensor, start: i64, q: i64) -> Result<(Tensor, Option<Tensor>)> {
        if self.cache.states().is_some() {
            self.roll_states_to(start)?;
            let grown = match self.cache.states_mut() {
                Some(states) if q > 1 => states.keep_steps(q)?,
                _ => false,
            };
            if grown {
                // graphs captured before wrote the old per-token buffers
                self.steps.clear();
            }
        }
        if let Some(step) = self.steps.iter().find(|s| s.tokens == q) {
            step.ids.shallow_clone().copy_(ids);
            let _ = step.start.shallow_clone().fill_(start);
            step.graph.replay()?;
            return Ok((
                step.logits.shallow_clone(),
                step.features.as_ref().map(Tensor::shallow_clone),
            ));
        }
        let dev = self.target.device;
        let ids_buf = ids.to_device(dev).to_kind(Kind::Int64).copy();
        let start_buf = Tensor::full([1], start, (Kind::Int64, dev));
        let (target, taps, graphs) = (self.target, &self.taps, &mut self.graphs);
        let run = |cache: &mut SlotCache| {
            let batch = SlotBatch::uniform(cache, &start_buf, q);
            target.forward_slots(&ids_buf, &batch, cache, taps, SlotLogits::All)
        };
        // The warm-up runs (and a capture that failed after them) must leave a hybrid target's
        // states where this step starts: the replay, or the eager run, takes the step.
        let captured = match graphs.library {
            Some(_) => {
                match self
                    .cache
                    .keeping_states(|cache| graphs.capture(dev, || run(cache)))
                {
                    Ok(captured) => captured,
                    // no memory for the copy (nothing ran yet): decode eagerly from here on
                    Err(e) => {
                        log::warn!(
                            "{}: cannot set the recurrent states aside for a CUDA graph \
                             capture, decoding eagerly: {e:#}",
                            graphs.what
                        );
                        graphs.library = None;
                        None
                    }
                }
            }
            None => None,
        };
        let Some((graph, out)) = captured else {
            let out = run(&mut self.cache)?;
            return Ok((out.logits.context("no logits")?, out.features));
        };
        let out = out?;
        graph.replay()?;
        let step = TargetStep {
            tokens: q,
            logits: out.logits.context("no logits")?,
            features: out.features,
            ids: ids_buf,
            start: start_buf,
            graph,
        };
        let result = (
            step.logits.shallow_clone(),
            step.features.as_ref().map(Tensor::shallow_clone),
        );
        self.steps.push(step);
        Ok(result)
    }
}

/// The drafter's input buffers of one block proposal.
struct DraftInputs {
    /// [block, K * H] features of the newly accepted tokens (the first `c` rows are used).
    context: Tensor,
    /// [1] position of the first of them.
    context_start: Tensor,
    /// [block] the block's ids: x, then mask tokens.
    block_ids: Tensor,
    /// [1] the block's first position.
    block_start: Tensor,
}

/// The drafter's side of decoding one sequence: its context (the fused target features of
/// every accepted token) in a one-slot cache, and block proposals.
pub struct DrafterDecoder<'a> {
    /// A decoding copy (fused projections) of the drafter.
    drafter: Drafter,
    head: &'a FrozenHead,
    cache: SlotCache,
    block: i64,
    inputs: DraftInputs,
    graphs: GraphPolicy,
    /// The captured proposal: its output [block] and graph (output first: it lives in the
    /// graph's pool).
    captured: Option<(Tensor, CudaGraph)>,
}

impl<'a> DrafterDecoder<'a> {
    /// An engine for sequences of up to `capacity` positions (room for the last block
    /// included), with CUDA graphs from `graphs` and the fused kernels `kernels` where they
    /// apply (flash attention on their device).
    pub fn new(
        drafter: &'a Drafter,
        head: &'a FrozenHead,
        capacity: i64,
        graphs: Option<GraphLibrary>,
        kernels: Option<FusedKernels>,
    ) -> Result<Self> {
        let drafter = drafter.decode_copy()?;
        let c = &drafter.config;
        let (dev, kind) = (drafter.device, drafter.kind);
        let cache = drafter
            .slot_cache(capacity)
            .context("allocating the drafter's key/value cache")?
            .with_kernels(kernels);
        let block = c.block_size;
        let features = head.embed_tokens.size()[1] * c.num_taps() as i64;
        let inputs = DraftInputs {
            context: Tensor::zeros([block, features], (kind, dev)),
            context_start: Tensor::zeros([1], (Kind::Int64, dev)),
            block_ids: Tensor::full([block], c.mask_token_id(), (Kind::Int64, dev)),
            block_start: Tensor::zeros([1], (Kind::Int64, dev)),
        };
        Ok(DrafterDecoder {
            drafter,
            head,
            cache,
            block,
            inputs,
            graphs: GraphPolicy {
                library: graphs.filter(|_| dev.is_cuda()),
                what: "drafter",
            },
            captured: None,
        })
    }

    /// Whether the drafter's steps run the fused kernels.
    pub fn uses_fused_kernels(&self) -> bool {
        self.cache.kernels().is_some()
    }

    /// Tokens a block proposes (the block size).
    pub fn block_size(&self) -> usize {
        self.block as usize
    }

    /// Proposes the block `[x, d_1 .. d_{B-1}]` for positions `pos .. pos + B` (int64 [B] on
    /// the drafter's device; on a GPU the captured graph's output, valid until the next call).
    /// `new_context` [c, K * H] holds the target features of the tokens accepted since the
    /// previous call (on the first call: the whole prompt), i.e. of positions `pos - c .. pos`;
    /// `x` [1] is the token at `pos`, on the device.
    pub fn draft(&mut self, new_context: &Tensor, x: &Tensor, pos: i64) -> Result<Tensor> {
        let c = new_context.size()[0];
        if pos - c < 0 || pos + self.block > self.cache.capacity {
            bail!(
                "a block at position {pos} after {c} new context tokens does not fit a cache of {} positions",
                self.cache.capacity
            );
        }
        let dev = self.drafter.device;
        let inputs = &self.inputs;
        if c > self.block {
            // The prompt: written eagerly; the step's own context rows are then empty (they sit
            // where the block's rows go).
            let start = Tensor::full([1], pos - c, (Kind::Int64, dev));
            let batch = SlotBatch::uniform(&self.cache, &start, c);
            self.drafter
                .append_context_slots(new_context, &batch, &mut self.cache)?;
            let _ = inputs.context_start.shallow_clone().fill_(pos);
        } else {
            if c > 0 {
                inputs.context.narrow(0, 0, c).copy_(new_context);
            }
            let _ = inputs.context_start.shallow_clone().fill_(pos - c);
        }
        inputs.block_ids.narrow(0, 0, 1).copy_(&x.view([1]));
        let _ = inputs.block_start.shallow_clone().fill_(pos);
        if let Some((out, graph)) = &self.captured {
            graph.replay()?;
            return Ok(out.shallow_clone());
        }
        let (drafter, head, block) = (&self.drafter, self.head, self.block);
        let cache = &mut self.cache;
        let mut body = || -> Result<Tensor> {
            // Context rows first: the ones past the c new tokens are then overwritten by the
            // block's (which start at pos = context start + c).
            let ctx = SlotBatch::uniform(cache, &inputs.context_start, block);
            drafter.append_context_slots(&inputs.context, &ctx, cache)?;
            let blk = SlotBatch::uniform(cache, &inputs.block_start, block);
            let hidden = drafter.block_slots(head, &inputs.block_ids, &blk, cache)?;
            // the argmax of the compute-dtype logits is that of their float32 copy (the cast
            // keeps the order and the ties): one kernel fewer
            let ids = hidden
                .linear::<&Tensor>(&head.lm_head, None)
                .argmax(-1, false);
            ids.narrow(0, 0, 1).copy_(&inputs.block_ids.narrow(0, 0, 1));
            Ok(ids)
        };
        match self.graphs.capture(dev, &mut body) {
            Some((graph, out)) => {
                let out = out?;
                graph.replay()?;
                let result = out.shallow_clone();
                self.captured = Some((out, graph));
                Ok(result)
            }
            None => body(),
        }
    }
}
