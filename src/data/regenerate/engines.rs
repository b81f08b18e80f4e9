//! The two ways `regenerate` decodes the rows of its chunks: the plain path (rounds of
//! left-padded batches, the reference) and the continuous engine (rows stream through cache
//! slots across chunks).

use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

use anyhow::{Context, Result};

use super::chunks::{ChunkId, ChunkOutput};
use super::input::SplitInput;
use super::progress::Progress;
use super::rows::{answer_seed, finish_jobs, prepare_jobs, RowJob};
use super::summary::RegenerateStats;
use super::RegenerateOptions;
use crate::aten_ext::graph::GraphLibrary;
use crate::model::generate::{
    generate_all, Answer, BatchLimits, ContinuousGenerator, ContinuousLimits, ContinuousStats,
    Next, Prompt, Request,
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
    let (mut jobs, mut stats, skipped_rows) = prepare_jobs(split, rows, opts);
    progress.add(skipped_rows, 0);
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
                |_, tokens| progress.add(0, tokens as u64),
            )
            .with_context(|| format!("split {}: generation failed", split.name))?
        };
        let mut closed = 0;
        for (&j, answer) in pending.iter().zip(answers) {
            jobs[j].advance(answer, opts, &mut stats);
            closed += !jobs[j].open as usize;
        }
        progress.add(closed, 0);
    }
    Ok(finish_jobs(
        split,
        jobs,
        stats,
        started.elapsed().as_secs_f64(),
    ))
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

/// Rows read ahead of the engine's slots, as a multiple of the slots: the rows of the chunks
/// read so far go to the slots longest expected work first, so that the long multi-turn
/// conversations start early instead of finishing alone at the end of the run with most
/// slots idle (the tail). Four batches' worth of rows is enough for the longest rows
/// (a whole --max-len of answers) to finish within the rows after them; the chunks in
/// flight (saved once all their rows are done) are the price.
const LOOKAHEAD_BATCHES: usize = 4;

/// The rows waiting for a slot, across the chunks read so far: handed out longest expected
/// work first (ties in input order).
#[derive(Debug, Default)]
pub(super) struct FeedQueue {
    /// (expected work, reversed chunk index, reversed job index): a max-heap pops the longest
    /// row, the earliest one among equals.
    heap: std::collections::BinaryHeap<(usize, std::cmp::Reverse<usize>, std::cmp::Reverse<usize>)>,
}

impl FeedQueue {
    pub(super) fn len(&self) -> usize {
        self.heap.len()
    }

    /// Adds the jobs of chunk `chunk` by their expected work.
    pub(super) fn push_chunk(&mut self, chunk: usize, work: impl IntoIterator<Item = usize>) {
        use std::cmp::Reverse;
        for (job, w) in work.into_iter().enumerate() {
            self.heap.push((w, Reverse(chunk), Reverse(job)));
        }
    }

    /// The (chunk, job) with the longest expected work.
    pub(super) fn pop(&mut self) -> Option<(usize, usize)> {
        self.heap.pop().map(|(_, c, j)| (c.0, j.0))
    }
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
) -> Result<ContinuousStats> {
    let limits = ContinuousLimits {
        slots: opts.batch_size,
        max_len: opts.max_len,
        prefill_tokens: opts.prefill_tokens,
    };
    let mut engine = ContinuousGenerator::new(model, limits, graphs)?;
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
    let queue = RefCell::new(FeedQueue::default());
    let lookahead = LOOKAHEAD_BATCHES * opts.batch_size;
    let next_request = || -> Option<((usize, usize), Request)> {
        if failure.borrow().is_some() {
            return None;
        }
        let mut chunks = chunks.borrow_mut();
        let mut queue = queue.borrow_mut();
        // Read chunks until the lookahead is full (or the input is used up).
        while queue.len() < lookahead {
            let Some(id) = take_chunk() else { break };
            let (jobs, stats, skipped) = prepare_jobs(&splits[id.0], chunk_rows(&id), opts);
            progress.add(skipped, 0);
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
                queue.push_chunk(
                    chunks.len(),
                    work.jobs.iter().map(|j| j.expected_work(opts)),
                );
                chunks.push(Some(work));
            }
        }
        let (ci, ji) = queue.pop()?;
        let work = chunks[ci].as_mut()?;
        work.fed += 1;
        Some(((ci, ji), work.jobs[ji].request(0, opts)))
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
            return Next::Continue(job.request(cached, opts));
        }
        progress.add(1, 0);
        work.open -= 1;
        if work.open == 0 && work.fed == work.jobs.len() {
            if let Some(done) = chunks[ci].take() {
                complete(done);
            }
        }
        Next::Done
    };
    let ran = engine.run(&opts.sampling, eos, next_request, on_answer, |tokens| {
        progress.add(0, tokens)
    });
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    ran?;
    Ok(engine.stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_feed_queue_hands_out_the_longest_rows_first_ties_in_input_order() {
        let mut q = FeedQueue::default();
        q.push_chunk(0, [5, 40, 5]);
        q.push_chunk(1, [40, 7]);
        assert_eq!(q.len(), 5);
        let order: Vec<(usize, usize)> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, [(0, 1), (1, 0), (1, 1), (0, 0), (0, 2)]);
        assert_eq!(q.len(), 0);
    }
}
