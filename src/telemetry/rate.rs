//! Throughput from the work completed over a time window, never from the gap between two
//! steps: two steps that finish 2 ms apart made a per-step rate 100x the real one, and a pause
//! or a checkpoint made another spike. The window's rate drops while nothing completes (a
//! pause reads as a pause), and the whole-run average is the summary's rate.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::records::Phase;

/// The window the live rates and the ETA are measured over.
pub(crate) const RATE_WINDOW: Duration = Duration::from_secs(30);

/// Completed steps with their work, over a sliding window and since the start, on a clock that
/// stops while the run is paused: a pause of 10 minutes made the 30 s window after a resume
/// read as 2 slow steps (`ETA 0:39:45` with 4 minutes left), and the whole-run average fell
/// with every pause.
#[derive(Debug, Clone)]
pub struct RateWindow {
    window: Duration,
    /// When the measurement began (training started or resumed).
    origin: Instant,
    /// (completed at, on the active clock; tokens; samples) of the steps in the window.
    recent: VecDeque<(Duration, u64, u64)>,
    total_steps: u64,
    total_tokens: u64,
    total_samples: u64,
    /// The active clock at the last completion.
    last_at: Option<Duration>,
    /// Paused time of the pauses that have ended.
    paused: Duration,
    /// When the pause in progress began, if the run is paused.
    paused_since: Option<Instant>,
}

impl Default for RateWindow {
    /// Over [`RATE_WINDOW`], from now.
    fn default() -> Self {
        RateWindow::new(RATE_WINDOW, Instant::now())
    }
}

/// Rates at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rates {
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub steps_per_s: f64,
}

impl RateWindow {
    pub fn new(window: Duration, origin: Instant) -> Self {
        RateWindow {
            window,
            origin,
            recent: VecDeque::new(),
            total_steps: 0,
            total_tokens: 0,
            total_samples: 0,
            last_at: None,
            paused: Duration::ZERO,
            paused_since: None,
        }
    }

    /// The time since the origin that was not paused, at `at`.
    fn active(&self, at: Instant) -> Duration {
        let pausing = self
            .paused_since
            .map_or(Duration::ZERO, |p| at.saturating_duration_since(p));
        at.saturating_duration_since(self.origin)
            .saturating_sub(self.paused + pausing)
    }

    /// The run stopped taking work at `at` (a second call while paused changes nothing).
    pub fn pause(&mut self, at: Instant) {
        self.paused_since.get_or_insert(at);
    }

    /// The run took work again at `at`.
    pub fn resume(&mut self, at: Instant) {
        if let Some(p) = self.paused_since.take() {
            self.paused += at.saturating_duration_since(p);
        }
    }

    pub fn is_paused(&self) -> bool {
        self.paused_since.is_some()
    }

    /// A step completed at `at` with this much work.
    pub fn complete(&mut self, at: Instant, tokens: u64, samples: u64) {
        let t = self.active(at);
        self.recent.push_back((t, tokens, samples));
        self.total_steps += 1;
        self.total_tokens += tokens;
        self.total_samples += samples;
        self.last_at = Some(t);
        while let Some(&(first, _, _)) = self.recent.front() {
            if t.saturating_sub(first) > self.window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }

    /// The work completed in the window ending at `now`, over the window's length (or the
    /// active time since the origin, while that is shorter); paused time is left out.
    pub fn windowed(&self, now: Instant) -> Rates {
        let end = self.active(now);
        let span = end.min(self.window);
        let from = end - span;
        let (mut steps, mut tokens, mut samples) = (0u64, 0u64, 0u64);
        for &(t, tok, sam) in &self.recent {
            if t > from && t <= end {
                steps += 1;
                tokens += tok;
                samples += sam;
            }
        }
        per_second(steps, tokens, samples, span)
    }

    /// The work completed since the origin, over the active time since the origin.
    pub fn whole_run(&self, now: Instant) -> Rates {
        self.whole_run_until(self.active(now))
    }

    fn whole_run_until(&self, active: Duration) -> Rates {
        per_second(
            self.total_steps,
            self.total_tokens,
            self.total_samples,
            active,
        )
    }

    /// The whole-run average up to the last completed step (a finished run's rates, which
    /// do not decay while its screen stays open).
    pub fn final_rates(&self) -> Rates {
        self.last_at
            .map_or(Rates::default(), |last| self.whole_run_until(last))
    }

    /// Seconds for `remaining` steps at the window's step rate; None while no step completed in
    /// the window. While paused it holds still (the clock it is measured on stands).
    pub fn eta_s(&self, now: Instant, remaining: u64) -> Option<f64> {
        let rates = self.windowed(now);
        (rates.steps_per_s > 0.0).then(|| remaining as f64 / rates.steps_per_s)
    }

    /// What screens show of a run in `phase` at `now` with `remaining` steps: an ended run its
    /// averages and no ETA; a paused one no rate (nothing is done) and the ETA it will have
    /// when it resumes, which holds still; otherwise the window's rates and the ETA at that
    /// pace, which after a resume are at once what they were before the pause.
    pub fn live(&self, now: Instant, remaining: u64, phase: Phase) -> (Rates, Option<f64>) {
        match phase {
            p if p.is_ended() => (self.final_rates(), None),
            Phase::Paused => (Rates::default(), self.eta_s(now, remaining)),
            _ => (self.windowed(now), self.eta_s(now, remaining)),
        }
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

    #[test]
    fn a_pause_is_left_out_of_the_rates_and_the_eta() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = RateWindow::new(s(30), t0);
        // one step a second for 60 s, then a pause of 10 minutes
        for i in 1..=60 {
            w.complete(t0 + s(i), 100, 2);
        }
        let before = w.eta_s(t0 + s(60), 240).unwrap();
        assert!((before - 240.0).abs() < 1e-9, "{before}");
        w.pause(t0 + s(60));
        w.pause(t0 + s(61)); // a second pause changes nothing
                             // while paused the window's rates and the ETA hold still; screens show no rate
        for later in [61, 300, 659] {
            let rates = w.windowed(t0 + s(later));
            assert!((rates.steps_per_s - 1.0).abs() < 1e-9, "{later}: {rates:?}");
            let (shown, eta) = w.live(t0 + s(later), 240, Phase::Paused);
            assert_eq!(shown, Rates::default());
            assert!((eta.unwrap() - 240.0).abs() < 1e-9, "{later}: {eta:?}");
        }
        w.resume(t0 + s(660));
        // at once after the resume, and after 2 more steps: the pace from before the pause
        let (rates, eta) = w.live(t0 + s(660), 240, Phase::Training);
        assert!((rates.tokens_per_s - 100.0).abs() < 1e-9, "{rates:?}");
        assert!((eta.unwrap() - 240.0).abs() < 1e-9);
        w.complete(t0 + s(661), 100, 2);
        w.complete(t0 + s(662), 100, 2);
        let eta = w.eta_s(t0 + s(662), 238).unwrap();
        assert!((eta - 238.0).abs() < 1e-9, "{eta}");
        // the whole-run average is over the 62 s of work, not the 662 s of wall time
        let whole = w.whole_run(t0 + s(662));
        assert!((whole.steps_per_s - 1.0).abs() < 1e-9, "{whole:?}");
        assert!((w.final_rates().tokens_per_s - 100.0).abs() < 1e-9);
        let (avg, eta) = w.live(t0 + s(700), 238, Phase::Stopped);
        assert_eq!((avg, eta), (w.final_rates(), None));
    }
}
