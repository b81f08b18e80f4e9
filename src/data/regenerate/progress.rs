//! Progress of `regenerate`: a bar of the rows done with the token rate, or, when the bar is
//! hidden (stderr is not a terminal), a log line every 5 s.

use crate::telemetry::format::fmt_duration_clock;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

/// Progress lines on stderr.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    total_rows: usize,
    rows_before: usize,
    started: Instant,
    state: Mutex<ProgressState>,
}

struct ProgressState {
    rows: usize,
    tokens: u64,
    last: Instant,
}

impl Progress {
    /// Starts counting: `rows_before` of `total_rows` were done by earlier runs.
    pub(super) fn start(bar: Option<ProgressBar>, total_rows: usize, rows_before: usize) -> Self {
        if let Some(bar) = &bar {
            bar.set_length(total_rows as u64);
            bar.set_position(rows_before as u64);
            // The rate and ETA are of this run's rows, not of the resumed ones.
            bar.reset_eta();
        }
        Progress {
            bar,
            total_rows,
            rows_before,
            started: Instant::now(),
            state: Mutex::new(ProgressState {
                rows: 0,
                tokens: 0,
                last: Instant::now(),
            }),
        }
    }

    /// Tokens generated so far by this run.
    pub(super) fn tokens(&self) -> u64 {
        self.state.lock().map(|s| s.tokens).unwrap_or(0)
    }

    pub(super) fn add(&self, rows: usize, tokens: u64) {
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        st.rows += rows;
        st.tokens += tokens;
        let Some(bar) = &self.bar else {
            return;
        };
        if rows > 0 {
            bar.inc(rows as u64);
        }
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        if !bar.is_hidden() {
            // Tokens change at every decoding step: the message is renewed a few times a second.
            if st.last.elapsed() >= Duration::from_millis(200) {
                st.last = Instant::now();
                bar.set_message(format!(
                    "{} tokens, {:.0} tokens/s",
                    st.tokens,
                    st.tokens as f64 / elapsed
                ));
            }
            return;
        }
        if st.last.elapsed() < Duration::from_secs(5) {
            return;
        }
        st.last = Instant::now();
        let done = self.rows_before + st.rows;
        let remaining = self.total_rows.saturating_sub(done);
        let eta = if st.rows > 0 {
            fmt_duration_clock(remaining as f64 * elapsed / st.rows as f64)
        } else {
            "?".into()
        };
        log::info!(
            "regenerate: {done}/{} rows, {} tokens generated ({:.0} tokens/s), ETA {eta}",
            self.total_rows,
            st.tokens,
            st.tokens as f64 / elapsed
        );
    }
}
