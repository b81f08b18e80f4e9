//! Progress of `regenerate`: a bar of the answers done with the rows and the token rate, or,
//! when the bar is hidden (stderr is not a terminal), a log line every 5 s.
//!
//! The bar counts answers, not rows: a row is done with its last turn, and with a batch as
//! large as the input every row is in flight at once and ends near the end (55 rows read 0/55
//! with no ETA until the last seconds). Each answer counts as it is generated; the answers a
//! row will not generate (it was skipped, or ended before its last turn) count when it closes,
//! so the bar reaches its length exactly.

use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use super::input::SplitInput;
use crate::telemetry::format::fmt_duration_clock;

/// The answers the rows `rows` of a split ask for (see [`answers_in`]).
pub(super) fn planned_answers(
    split: &SplitInput,
    rows: Range<usize>,
    max_turns: Option<usize>,
) -> usize {
    rows.map(|r| answers_in(split.row(r).1, max_turns)).sum()
}

/// The answers a row asks for: its assistant answers (runs of loss_mask 1), at most
/// `max_turns`.
fn answers_in(mask: &[u8], max_turns: Option<usize>) -> usize {
    let starts = mask
        .iter()
        .enumerate()
        .filter(|&(i, &m)| m == 1 && (i == 0 || mask[i - 1] != 1))
        .count();
    max_turns.map_or(starts, |m| starts.min(m))
}

/// What is done, of this run or before it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    rows: usize,
    answers: usize,
    tokens: u64,
}

/// The whole work and the part earlier runs did.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Totals {
    rows: usize,
    answers: usize,
    before: Counts,
}

impl Totals {
    /// Seconds left at this run's pace of answers; None before its first answer.
    fn eta_s(&self, run: &Counts, elapsed_s: f64) -> Option<f64> {
        (run.answers > 0).then(|| {
            let left = self
                .answers
                .saturating_sub(self.before.answers + run.answers);
            left as f64 * elapsed_s / run.answers as f64
        })
    }

    /// The log line of the hidden bar.
    fn line(&self, run: &Counts, elapsed_s: f64) -> String {
        let eta = self
            .eta_s(run, elapsed_s)
            .map_or_else(|| "?".into(), fmt_duration_clock);
        format!(
            "regenerate: {}/{} answers, {}/{} rows, {} tokens generated ({:.0} tokens/s), ETA {eta}",
            self.before.answers + run.answers,
            self.answers,
            self.before.rows + run.rows,
            self.rows,
            run.tokens,
            run.tokens as f64 / elapsed_s.max(1e-9)
        )
    }

    /// The bar's message: the rows and the token rate.
    fn message(&self, run: &Counts, elapsed_s: f64) -> String {
        format!(
            "{}/{} rows, {} tokens, {:.0} tokens/s",
            self.before.rows + run.rows,
            self.rows,
            run.tokens,
            run.tokens as f64 / elapsed_s.max(1e-9)
        )
    }
}

/// Progress lines on stderr.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    totals: Totals,
    started: Instant,
    state: Mutex<ProgressState>,
}

struct ProgressState {
    run: Counts,
    last: Instant,
}

impl Progress {
    /// Starts counting: `rows_before` rows with `answers_before` answers of `total_rows` and
    /// `total_answers` were done by earlier runs.
    pub(super) fn start(
        bar: Option<ProgressBar>,
        (total_rows, total_answers): (usize, usize),
        (rows_before, answers_before): (usize, usize),
    ) -> Self {
        if let Some(bar) = &bar {
            bar.set_length(total_answers as u64);
            bar.set_position(answers_before as u64);
            // The rate and ETA are of this run's answers, not of the resumed ones.
            bar.reset_eta();
        }
        Progress {
            bar,
            totals: Totals {
                rows: total_rows,
                answers: total_answers,
                before: Counts {
                    rows: rows_before,
                    answers: answers_before,
                    tokens: 0,
                },
            },
            started: Instant::now(),
            state: Mutex::new(ProgressState {
                run: Counts::default(),
                last: Instant::now(),
            }),
        }
    }

    /// Tokens generated so far by this run.
    pub(super) fn tokens(&self) -> u64 {
        self.state.lock().map(|s| s.run.tokens).unwrap_or(0)
    }

    /// Counts `rows` closed (or skipped), `answers` generated or left out by rows that
    /// closed, and `tokens` generated.
    pub(super) fn add(&self, rows: usize, answers: usize, tokens: u64) {
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        st.run.rows += rows;
        st.run.answers += answers;
        st.run.tokens += tokens;
        let Some(bar) = &self.bar else {
            return;
        };
        if answers > 0 {
            bar.inc(answers as u64);
        }
        let elapsed = self.started.elapsed().as_secs_f64();
        if !bar.is_hidden() {
            // Tokens change at every decoding step: the message is renewed a few times a second.
            if rows > 0 || st.last.elapsed() >= Duration::from_millis(200) {
                st.last = Instant::now();
                bar.set_message(self.totals.message(&st.run, elapsed));
            }
            return;
        }
        if st.last.elapsed() < Duration::from_secs(5) {
            return;
        }
        st.last = Instant::now();
        log::info!("{}", self.totals.line(&st.run, elapsed));
    }

    /// Logs the counts the run ended with, when the bar is hidden (the lines every 5 s miss
    /// the end).
    pub(super) fn finish(&self) {
        let Ok(st) = self.state.lock() else {
            return;
        };
        if self.bar.as_ref().is_some_and(ProgressBar::is_hidden) {
            let elapsed = self.started.elapsed().as_secs_f64();
            log::info!("{}", self.totals.line(&st.run, elapsed));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_move_the_count_and_the_eta_before_any_row_ends() {
        // 55 rows of 3 turns, all in flight at once: 10 answers in 20 s, no row done yet.
        let totals = Totals {
            rows: 55,
            answers: 165,
            before: Counts::default(),
        };
        let run = Counts {
            rows: 0,
            answers: 10,
            tokens: 4000,
        };
        assert_eq!(totals.eta_s(&run, 20.0), Some(155.0 * 2.0));
        let line = totals.line(&run, 20.0);
        assert!(
            line.starts_with(
                "regenerate: 10/165 answers, 0/55 rows, 4000 tokens generated (200 tokens/s), ETA "
            ),
            "{line}"
        );
        assert!(!line.ends_with("ETA ?"), "{line}");
        // before the first answer there is no pace to go by
        assert_eq!(totals.eta_s(&Counts::default(), 20.0), None);
        assert!(totals.line(&Counts::default(), 1.0).ends_with("ETA ?"));
        // a resumed run: earlier answers count in the position, not in the pace
        let resumed = Totals {
            before: Counts {
                rows: 20,
                answers: 60,
                tokens: 0,
            },
            ..totals
        };
        assert_eq!(resumed.eta_s(&run, 20.0), Some(95.0 * 2.0));
        assert!(resumed
            .line(&run, 20.0)
            .contains("70/165 answers, 20/55 rows"));
    }

    #[test]
    fn a_row_asks_for_its_runs_of_loss_mask_one() {
        assert_eq!(answers_in(&[0, 0, 1, 1, 0, 1, 0, 1, 1], None), 3);
        assert_eq!(answers_in(&[0, 0, 1, 1, 0, 1, 0, 1, 1], Some(2)), 2);
        assert_eq!(answers_in(&[1, 1, 0], None), 1);
        assert_eq!(answers_in(&[0, 0], None), 0);
    }

    #[test]
    fn the_bar_moves_per_answer_and_ends_at_its_length() {
        let bar = ProgressBar::hidden();
        let p = Progress::start(Some(bar.clone()), (3, 9), (1, 3));
        assert_eq!((bar.length(), bar.position()), (Some(9), 3));
        p.add(1, 2, 0); // a skipped row of 2 answers
        p.add(0, 1, 17); // an answer of 17 tokens
        p.add(0, 1, 5);
        assert_eq!(bar.position(), 7);
        // the last row closes after its first answer: its other answer is left out
        p.add(1, 1 + 1, 9);
        assert_eq!(bar.position(), 9);
        assert_eq!(p.tokens(), 31);
    }
}
