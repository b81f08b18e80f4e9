//! The coordinator's part in a multi-process run (see docs/distributed.md): rank 0 decides at
//! each step boundary and tells every rank ([`Control`]); the other ranks follow its word
//! (train the step, hold while paused, stop) and mirror its queue depths and profile
//! interval, so that a command given to rank 0 acts on every rank at the same step boundary.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::coordinator::Coordinator;
use crate::pipeline::distributed::step::{Control, Decision};
use crate::pipeline::queue::QueueName;
use crate::telemetry::records::{EventKind, Phase};

/// How often rank 0 tells the others that the run is still paused (well inside any timeout).
const PAUSED_KEEPALIVE: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Rank 0 tells every other rank `decision` with its current settings (nothing in a
    /// single process).
    pub(super) fn tell_followers(&self, decision: Decision) -> Result<()> {
        let Some(d) = &self.shared.dist else {
            return Ok(());
        };
        let (batch, feature) = (self.shared.batch_q.level(), self.shared.feature_q.level());
        let word = Control {
            decision,
            batch_depth: batch.capacity,
            feature_depth: feature.capacity,
            profile_interval_s: *self
                .shared
                .profile_interval_s
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        };
        Control::exchange(&d.group, Some(word))
            .map(|_| ())
            .map_err(|e| super::failure::lost_rank(&self.shared, d, self.step, e))
    }

    /// Rank 0 after its training loop: a run that ended before its last step tells the
    /// others to stop (one that trained every step ends on every rank by itself; one that
    /// failed leaves them to find it gone).
    pub(super) fn release_followers(&self, trained: &Result<()>) {
        if trained.is_ok() && self.step < self.total_steps {
            if let Err(e) = self.tell_followers(Decision::Stop) {
                log::warn!("could not tell the other ranks to stop: {e:#}");
            }
        }
    }

    /// Waits out a pause (true: going on, false: stopping). In a multi-process run rank 0
    /// tells the others every second that the run is still paused, which keeps their wait
    /// inside the collective timeout however long the pause lasts.
    pub(super) fn wait_paused(&self) -> Result<bool> {
        if self.shared.dist.is_none() {
            return Ok(self.shared.wait_if_paused());
        }
        while self.shared.paused.load(Ordering::Relaxed) && !self.shared.stopping() {
            self.tell_followers(Decision::Paused)?;
            self.shared.wait_while_paused_for(PAUSED_KEEPALIVE);
        }
        Ok(!self.shared.stopping())
    }

    /// A rank other than 0: trains each step rank 0 says to train, holds while it says the
    /// run is paused, ends when it says stop (or after the last step, as rank 0 does).
    pub(super) fn follow(&mut self) -> Result<()> {
        let Some(d) = self.shared.dist.clone() else {
            return Ok(());
        };
        let cfg = self.config.clone();
        let warmup = (cfg.train.warmup_ratio * self.total_steps as f64).round() as u64;
        let mut paused_at: Option<Instant> = None;
        while self.step < self.total_steps {
            if self.shared.stopping() {
                return self.finish_queued();
            }
            let word = Control::exchange(&d.group, None)
                .map_err(|e| super::failure::lost_rank(&self.shared, &d, self.step, e))?;
            self.mirror(&word);
            match word.decision {
                Decision::Paused => {
                    if paused_at.is_none() {
                        self.finish_queued()?;
                        paused_at = Some(Instant::now());
                        self.shared.paused.store(true, Ordering::SeqCst);
                        self.shared.set_phase(Phase::Paused);
                        self.shared.event(
                            EventKind::Paused,
                            format!("paused at step {} by rank 0", self.step),
                        );
                    }
                }
                Decision::Stop => {
                    self.finish_queued()?;
                    self.shared.status().stop_reason = Some("stopped by rank 0".into());
                    self.shared.set_phase(Phase::Stopped);
                    self.shared.event(
                        EventKind::Stopped,
                        format!("stopped at step {} by rank 0", self.step),
                    );
                    return Ok(());
                }
                Decision::Train => {
                    if let Some(at) = paused_at.take() {
                        self.shared.paused.store(false, Ordering::SeqCst);
                        self.shared.pause_cv.notify_all();
                        self.last_step_end += at.elapsed();
                        self.shared.set_phase(Phase::Training);
                    }
                    if !self.train_step(&cfg, warmup, Duration::ZERO)? {
                        return self.finish_queued();
                    }
                }
            }
        }
        self.finish_queued()?;
        self.shared.set_phase(Phase::Finished);
        self.shared.event(
            EventKind::Finished,
            format!("finished after {} steps", self.step),
        );
        Ok(())
    }

    /// Takes rank 0's queue depths and profile interval.
    fn mirror(&self, word: &Control) {
        let s = &self.shared;
        for (q, depth) in [
            (s.batch_q.level(), word.batch_depth),
            (s.feature_q.level(), word.feature_depth),
        ] {
            if q.capacity == depth {
                continue;
            }
            let set = match q.name {
                QueueName::Batch => s.batch_q.set_capacity(depth),
                QueueName::Feature => s.feature_q.set_capacity(depth),
            };
            if let Err(e) = set {
                log::warn!("rank 0's {} depth {depth}: {e}", q.name);
            }
        }
        *s.profile_interval_s
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = word.profile_interval_s;
    }
}
