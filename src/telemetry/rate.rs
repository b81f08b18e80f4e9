//! Throughput from the work completed over a time window, never from the gap between two
//! steps: two steps that finish 2 ms apart made a per-step rate 100x the real one, and a pause
//! or a checkpoint made another spike. The window's rate drops while nothing completes (a
//! pause reads as a pause), and the whole-run average is the summary's rate.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The window the live rates and the ETA are measured over.
pub(crate) const RATE_WINDOW: Duration = Duration::from_secs(30);

/// Completed steps with their work, over a sliding window and since the start.
#[derive(Debug, Clone)]
pub(crate) struct RateWindow {
    window: Duration,
    /// When the measurement began (training started or resumed).
    origin: Instant,
    /// (completed at, tokens, samples) of the steps in the window.
    recent: VecDeque<(Instant, u64, u64)>,
    total_steps: u64,
    total_tokens: u64,
    total_samples: u64,
    last_at: Option<Instant>,
}

impl Default for RateWindow {
    /// Over [`RATE_WINDOW`], from now.
    fn default() -> Self {
        RateWindow::new(RATE_WINDOW, Instant::now())
    }
}

/// Rates at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Rates {
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub steps_per_s: f64,
}

impl RateWindow {
    pub(crate) fn new(window: Duration, origin: Instant) -> Self {
        RateWindow {
            window,
            origin,
            recent: VecDeque::new(),
            total_steps: 0,
            total_tokens: 0,
            total_samples: 0,
            last_at: None,
        }
    }

    /// A step completed at `at` with this much work.
    pub(crate) fn complete(&mut self, at: Instant, tokens: u64, samples: u64) {
        self.recent.push_back((at, tokens, samples));
        self.total_steps += 1;
        self.total_tokens += tokens;
        self.total_samples += samples;
        self.last_at = Some(at);
        self.forget_before(at);
    }

    fn forget_before(&mut self, now: Instant) {
        while let Some(&(t, _, _)) = self.recent.front() {
            if now.saturating_duration_since(t) > self.window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }

    /// The work completed in the window ending at `now`, over the window's length (or the time
    /// since the origin, while that is shorter).
    pub(crate) fn windowed(&self, now: Instant) -> Rates {
        let span = now.saturating_duration_since(self.origin).min(self.window);
        let from = now.checked_sub(span).unwrap_or(self.origin);
        let (mut steps, mut tokens, mut samples) = (0u64, 0u64, 0u64);
        for &(t, tok, sam) in &self.recent {
            if t > from && t <= now {
                steps += 1;
                tokens += tok;
                samples += sam;
            }
        }
        per_second(steps, tokens, samples, span)
    }

    /// The work completed since the origin, over the time since the origin.
    pub(crate) fn whole_run(&self, now: Instant) -> Rates {
        per_second(
            self.total_steps,
            self.total_tokens,
            self.total_samples,
            now.saturating_duration_since(self.origin),
        )
    }

    /// The whole-run average up to the last completed step (a finished run's rates, which
    /// do not decay while its screen stays open).
    pub(crate) fn final_rates(&self) -> Rates {
        self.last_at
            .map_or(Rates::default(), |last| self.whole_run(last))
    }

    /// Seconds for `remaining` steps at the window's step rate; None while no step completed in
    /// the window.
    pub(crate) fn eta_s(&self, now: Instant, remaining: u64) -> Option<f64> {
        let rates = self.windowed(now);
        (rates.steps_per_s > 0.0).then(|| remaining as f64 / rates.steps_per_s)
    }
}

fn per_second(steps: u64, tokens: u64, samples: u64, span: Duration) -> Rates {
    let s = span.as_secs_f64();
    if s <= 0.0 {
        return Rates::default();
    }
    Rates {
        tokens_per_s: tokens as f64 / s,
        samples_per_s: samples as f64 / s,
        steps_per_s: steps as f64 / s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_that_finish_2_ms_apart_do_not_make_a_spike() {
        let t0 = Instant::now();
        let mut w = RateWindow::new(Duration::from_secs(30), t0);
        // 300 tokens a second in pairs: a step, then another 2 ms later, every 2 s.
        let mut at = t0;
        for pair in 0..20 {
            at = t0 + Duration::from_secs(2 * (pair + 1));
            w.complete(at, 300, 1);
            w.complete(at + Duration::from_millis(2), 300, 1);
        }
        let now = at + Duration::from_millis(2);
        let r = w.windowed(now);
        // The window holds the last 30 s: the completions after now - 30 s.
        let in_window = (0..20u64)
            .flat_map(|p| {
                let a = t0 + Duration::from_secs(2 * (p + 1));
                [a, a + Duration::from_millis(2)]
            })
            .filter(|&t| t > now - Duration::from_secs(30))
            .count() as f64;
        assert!(
            (r.tokens_per_s - in_window * 300.0 / 30.0).abs() < 1e-9,
            "{r:?}"
        );
        assert!((r.samples_per_s - in_window / 30.0).abs() < 1e-9, "{r:?}");
        // About 300 tokens/s, not the 150,000 of a 2 ms gap.
        assert!((r.tokens_per_s - 300.0).abs() < 30.0, "{r:?}");
        let whole = w.whole_run(now);
        assert!(
            (whole.tokens_per_s - 40.0 * 300.0 / now.duration_since(t0).as_secs_f64()).abs() < 1e-9
        );
    }

    #[test]
    fn a_pause_reads_as_a_pause_and_the_eta_waits_for_work() {
        let t0 = Instant::now();
        let mut w = RateWindow::new(Duration::from_secs(10), t0);
        assert_eq!(w.eta_s(t0 + Duration::from_secs(1), 100), None);
        for i in 1..=10 {
            w.complete(t0 + Duration::from_secs(i), 100, 2);
        }
        let now = t0 + Duration::from_secs(10);
        assert!((w.windowed(now).steps_per_s - 1.0).abs() < 1e-9);
        assert!((w.eta_s(now, 50).unwrap() - 50.0).abs() < 1e-9);
        // Paused 8 s: the two steps left in the window over 10 s.
        let later = now + Duration::from_secs(8);
        assert!((w.windowed(later).tokens_per_s - 20.0).abs() < 1e-9);
        // Paused longer than the window: nothing completed, no ETA.
        let much_later = now + Duration::from_secs(11);
        assert_eq!(w.windowed(much_later).tokens_per_s, 0.0);
        assert_eq!(w.eta_s(much_later, 50), None);
        // The window is shorter than the run at first: the rate is over the time so far.
        let mut young = RateWindow::new(Duration::from_secs(30), t0);
        young.complete(t0 + Duration::from_secs(2), 400, 4);
        assert!((young.windowed(t0 + Duration::from_secs(4)).tokens_per_s - 100.0).abs() < 1e-9);
    }
}
