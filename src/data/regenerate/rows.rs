//! The rows of `regenerate`: a row's runs of context and answers, and its way through the
//! turns (each generated answer appended, the next context after it, until the row closes).

use std::ops::Range;

use super::chunks::ChunkOutput;
use super::input::SplitInput;
use super::summary::RegenerateStats;
use super::RegenerateOptions;
use crate::model::generate::{Answer, Request};
use crate::seed::splitmix64;

/// Maximal runs of equal mask value.
fn segments(mask: &[u8]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=mask.len() {
        if i == mask.len() || mask[i] != mask[start] {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// FNV-1a of a row id, so that the sampling seed of a row is the same in every run.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The sampling seed of one answer: from the run's seed, the row id and the turn.
pub(crate) fn answer_seed(seed: u64, row_id: &str, turn: usize) -> u64 {
    splitmix64(seed ^ splitmix64(fnv1a(row_id.as_bytes()) ^ splitmix64(turn as u64)))
}

/// One row on its way through the rounds.
pub(super) struct RowJob<'a> {
    pub(super) row: usize,
    pub(super) id: &'a str,
    pub(super) src: &'a [u32],
    /// Alternating runs: even = context, odd = answer.
    pub(super) segs: Vec<Range<usize>>,
    /// The next segment to handle (an answer while the row is open).
    pub(super) next: usize,
    pub(super) tokens: Vec<u32>,
    pub(super) loss: Vec<u8>,
    pub(super) answers: usize,
    pub(super) open: bool,
}

impl RowJob<'_> {
    /// Takes a generated answer and moves to the next answer, or closes the row.
    pub(super) fn advance(
        &mut self,
        answer: Answer,
        opts: &RegenerateOptions,
        stats: &mut RegenerateStats,
    ) {
        let max_new = opts.max_new_tokens.min(opts.max_len - self.tokens.len());
        let n = answer.tokens.len();
        self.tokens.extend_from_slice(&answer.tokens);
        self.loss.extend(std::iter::repeat_n(1u8, n));
        self.answers += 1;
        self.next += 1;
        stats.turns_regenerated += 1;
        stats.generated_tokens += n as u64;
        let more = self.next < self.segs.len();
        let cut = |stats: &mut RegenerateStats, reason: &str| {
            if more {
                *stats.rows_cut.entry(reason.to_string()).or_insert(0) += 1;
            }
        };
        if !answer.eos {
            if n >= opts.max_new_tokens {
                stats.answers_at_max_new_tokens += 1;
                cut(stats, "answer hit --max-new-tokens");
            } else {
                debug_assert!(n >= max_new);
                stats.answers_at_max_len += 1;
                cut(stats, "answer reached --max-len");
            }
            self.open = false;
            return;
        }
        if opts.max_turns.is_some_and(|m| self.answers >= m) {
            cut(stats, "--max-turns");
            self.open = false;
            return;
        }
        if !more {
            self.open = false;
            return;
        }
        let ctx = self.segs[self.next].clone();
        let answer_follows = self.next + 1 < self.segs.len();
        let room = opts.max_len - self.tokens.len();
        if answer_follows && ctx.len() >= room {
            // The next turn's context leaves no room for its answer.
            cut(stats, "next turn would exceed --max-len");
            self.open = false;
            return;
        }
        if ctx.len() <= room {
            self.tokens.extend_from_slice(&self.src[ctx.clone()]);
            self.loss.extend(std::iter::repeat_n(0u8, ctx.len()));
        }
        self.next += 1;
        self.open = answer_follows;
    }
}

/// The rows of a chunk that can be regenerated, as jobs (each with its first prompt), and the
/// counts of the rows skipped.
pub(super) fn prepare_jobs<'a>(
    split: &'a SplitInput,
    rows: Range<usize>,
    opts: &RegenerateOptions,
) -> (Vec<RowJob<'a>>, RegenerateStats, usize) {
    let mut stats = RegenerateStats {
        rows_in: rows.len(),
        ..Default::default()
    };
    let mut jobs: Vec<RowJob<'_>> = Vec::new();
    let mut skipped_rows = 0;
    for r in rows {
        let (src, mask) = split.row(r);
        let origin = format!("{}:{r}", split.name);
        let segs = segments(mask);
        let answers = segs.iter().filter(|s| mask[s.start] == 1).count();
        if answers == 0 {
            stats.skip(
                origin,
                "no assistant answer",
                "no assistant answer (loss_mask has no 1)".into(),
            );
            skipped_rows += 1;
            continue;
        }
        if mask[0] == 1 {
            stats.skip(
                origin,
                "no context before the first answer",
                "the row starts with an assistant answer (loss_mask 1 at token 0): nothing to prompt with".into(),
            );
            skipped_rows += 1;
            continue;
        }
        let first = segs[0].len();
        if first >= opts.max_len {
            stats.skip(
                origin,
                "prompt longer than --max-len",
                format!(
                    "the context before the first answer has {first} tokens, no room within --max-len {}",
                    opts.max_len
                ),
            );
            skipped_rows += 1;
            continue;
        }
        jobs.push(RowJob {
            row: r,
            id: &split.ids[r],
            src,
            tokens: src[segs[0].clone()].to_vec(),
            loss: vec![0; first],
            segs,
            next: 1,
            answers: 0,
            open: true,
        });
    }
    (jobs, stats, skipped_rows)
}

/// A chunk's output from its finished jobs.
pub(super) fn finish_jobs(
    split: &SplitInput,
    jobs: Vec<RowJob<'_>>,
    stats: RegenerateStats,
    seconds: f64,
) -> ChunkOutput {
    let mut out = ChunkOutput {
        ids: Vec::with_capacity(jobs.len()),
        tokens: Vec::with_capacity(jobs.len()),
        masks: Vec::with_capacity(jobs.len()),
        stats,
    };
    for job in jobs {
        debug_assert!(job.row < split.rows);
        out.stats.rows_out += 1;
        out.stats.tokens_out += job.tokens.len() as u64;
        out.stats.loss_tokens_out += job.loss.iter().map(|&m| m as u64).sum::<u64>();
        out.ids.push(job.id.to_string());
        out.tokens.push(job.tokens);
        out.masks.push(job.loss);
    }
    out.stats.seconds = seconds;
    out
}

impl RowJob<'_> {
    /// The answers this row asks for (see [`super::progress::planned_answers`]) that it has
    /// not generated: once it is closed, those it left out.
    pub(super) fn answers_left(&self, max_turns: Option<usize>) -> usize {
        let planned = self.segs.len() / 2;
        max_turns
            .map_or(planned, |m| planned.min(m))
            .saturating_sub(self.answers)
    }

    /// The next answer's request: the tokens after the `cached` ones the model holds.
    pub(super) fn request(&self, cached: usize, opts: &RegenerateOptions) -> Request {
        Request {
            tokens: self.tokens[cached..].to_vec(),
            max_new: opts.max_new_tokens.min(opts.max_len - self.tokens.len()),
            seed: answer_seed(opts.seed, self.id, self.answers),
        }
    }
}
