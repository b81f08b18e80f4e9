//! The two ways `regenerate` decodes the rows of its chunks: the plain path (rounds of
//! left-padded batches, the reference) and the continuous engine (rows stream through cache
//! slots across chunks).

use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

use anyhow::{Context, Result};

use super::chunks::{ChunkId, ChunkOutput};
use super::input::SplitInput;
use super::progress::{planned_answers, Progress};
use super::rows::{answer_seed, finish_jobs, prepare_jobs, RowJob};
use super::summary::RegenerateStats;
use super::RegenerateOptions;
use crate::aten_ext::fused::FusedKernels;
use crate::aten_ext::graph::GraphLibrary;
use crate::model::generate::{
    generate_all, Answer, BatchLimits, ContinuousGenerator, ContinuousLimits, ContinuousStats,
    Next, Prompt, Request, TraceWindow,
};
use crate::model::TargetModel;

/// Regenerates the rows `rows` of a split with a loaded target, by the plain path: in rounds
/// (every open row's next answer), each round's prompts decoded in left-padded batches.
pub(super) fn run_chunk(
    model: &TargetModel,
    eos: &[u32],
    split: &SplitInput,
    rows: Range<usize>,
    opts: &RegenerateOptions,
    progress: &Progress,
) -> Result<ChunkOutput> {
    let started = Instant::now();
    let (mut jobs, mut stats, skipped_rows) = prepare_jobs(split, rows.clone(), opts);
    count_skipped(progress, split, rows, &jobs, skipped_rows, opts);
    let limits = BatchLimits {
        batch_size: opts.batch_size,
        prefill_tokens: opts.prefill_tokens,
    };
    loop {
        let pending: Vec<usize> = (0..jobs.len()).filter(|&j| jobs[j].open).collect();
        if pending.is_empty() {
            break;
        }
        let answers = {
            let prompts: Vec<Prompt<'_>> = pending
                .iter()
                .map(|&j| {
                    let job = &jobs[j];
                    Prompt {
                        ids: &job.tokens,
                        max_new: opts.max_new_tokens.min(opts.max_len - job.tokens.len()),
                        seed: answer_seed(opts.seed, job.id, job.answers),
                    }
                })
                .collect();
            generate_all(
                model,
                &prompts,
                eos,
                &opts.sampling,
                &limits,
                |answers, tokens| progress.add(0, answers, tokens as u64),
            )
            .with_context(|| format!("split {}: generation failed", split.name))?
        };
        let (mut closed, mut left_out) = (0, 0);
        for (&j, answer) in pending.iter().zip(answers) {
            jobs[j].advance(answer, opts, &mut stats);
            if !jobs[j].open {
                closed += 1;
                left_out += jobs[j].answers_left(opts.max_turns);
            }
        }
        progress.add(closed, left_out, 0);
    }
    Ok(finish_jobs(
        split,
        jobs,
        stats,
        started.elapsed().as_secs_f64(),
    ))
}

/// Counts the rows of a chunk that were skipped, with the answers they asked for (those the
/// chunk's jobs do not).
fn count_skipped(
    progress: &Progress,
    split: &SplitInput,
    rows: Range<usize>,
    jobs: &[RowJob<'_>],
    skipped_rows: usize,
    opts: &RegenerateOptions,
) {
    let in_jobs: usize = jobs.iter().map(|j| j.answers_left(opts.max_turns)).sum();
    let planned = planned_answers(split, rows, opts.max_turns);
    progress.add(skipped_rows, planned.saturating_sub(in_jobs), 0);
}

/// A chunk in the continuous engine: its jobs, how many were handed out and how many are open.
struct ChunkWork<'a> {
    id: ChunkId,
    jobs: Vec<RowJob<'a>>,
    stats: RegenerateStats,
    fed: usize,
    open: usize,
    started: Instant,
}

/// Regenerates chunks with the continuous engine until `take_chunk` has none left: rows stream
/// through the engine's slots across chunk boundaries (so the batch stays full), each
/// conversation's turns follow each other in its slot, and each chunk is handed to `save` once
/// its last row is done.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_continuous(
    model: &TargetModel,
    eos: &[u32],
    splits: &[SplitInput],
    chunk_rows: &dyn Fn(&ChunkId) -> Range<usize>,
    take_chunk: &dyn Fn() -> Option<ChunkId>,
    save: &dyn Fn(ChunkId, ChunkOutput) -> Result<()>,
    opts: &RegenerateOptions,
    progress: &Progress,
    graphs: Option<GraphLibrary>,
    kernels: Option<FusedKernels>,
    trace: Option<TraceWindow>,
) -> Result<ContinuousStats> {
    let limits = ContinuousLimits {
        slots: opts.batch_size,
        max_len: opts.max_len,
        prefill_tokens: opts.prefill_tokens,
    };
    let mut engine = ContinuousGenerator::new(model, limits, graphs, kernels)?;
    if let Some(window) = trace {
        engine.trace_steps(window);
    }
    let chunks: RefCell<Vec<Option<ChunkWork<'_>>>> = RefCell::new(Vec::new());
    let failure: RefCell<Option<anyhow::Error>> = RefCell::new(None);
    let fail = |e: anyhow::Error| {
        failure.borrow_mut().get_or_insert(e);
    };
    // Saves a chunk whose rows are all done.
    let complete = |work: ChunkWork<'_>| {
        let split = &splits[work.id.0];
        let out = finish_jobs(
            split,
            work.jobs,
            work.stats,
            work.started.elapsed().as_secs_f64(),
        );
        if let Err(e) = save(work.id, out) {
            fail(e);
        }
    };
    let next_request =
        || -> Option<((usize, usize), Request)> {
            if failure.borrow().is_some() {
                return None;
            }
            let mut chunks = chunks.borrow_mut();
            loop {
                if let Some((ci, work)) = chunks.iter_mut().enumerate().find_map(|(ci, w)| {
                    w.as_mut().filter(|w| w.fed < w.jobs.len()).map(|w| (ci, w))
                }) {
                    let ji = work.fed;
                    work.fed += 1;
                    return Some(((ci, ji), work.jobs[ji].request(0, opts)));
                }
                let id = take_chunk()?;
                let (split, rows) = (&splits[id.0], chunk_rows(&id));
                let (jobs, stats, skipped) = prepare_jobs(split, rows.clone(), opts);
                count_skipped(progress, split, rows, &jobs, skipped, opts);
                let work = ChunkWork {
                    id,
                    open: jobs.len(),
                    jobs,
                    stats,
                    fed: 0,
                    started: Instant::now(),
                };
                if work.open == 0 {
                    complete(work);
                } else {
                    chunks.push(Some(work));
                }
            }
        };
    let on_answer = |(ci, ji): (usize, usize), answer: Answer| -> Next {
        let mut chunks = chunks.borrow_mut();
        let Some(work) = chunks[ci].as_mut() else {
            return Next::Done;
        };
        let job = &mut work.jobs[ji];
        let cached = job.tokens.len() + answer.tokens.len() - 1;
        job.advance(answer, opts, &mut work.stats);
        if job.open {
            progress.add(0, 1, 0);
            return Next::Continue(job.request(cached, opts));
        }
        progress.add(1, 1 + job.answers_left(opts.max_turns), 0);
        work.open -= 1;
        if work.open == 0 && work.fed == work.jobs.len() {
            if let Some(done) = chunks[ci].take() {
                complete(done);
            }
        }
        Next::Done
    };
    let ran = engine.run(&opts.sampling, eos, next_request, on_answer, |tokens| {
        progress.add(0, 0, tokens)
    });
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    ran?;
    Ok(engine.stats)
}
