//! What the coordinator does at step boundaries besides the step itself: evaluation and
//! validation on the held-out data, the best drafter and early stopping, checkpoints (periodic,
//! retried, final), and the checkpoint and stop requests of the command API.

use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::coordinator::Coordinator;
use super::shared::{injected_failure, StopState, EVAL_HISTORY};
use crate::config::{FailMode, FailStage, TrainConfig};
use crate::data::packer::PackerState;
use crate::telemetry::profile::ProfileEvent;
use crate::telemetry::records::{EvalRecord, EventKind, MetricsRecord, Phase, ValidationRecord};
use crate::train::checkpoint::{
    save_checkpoint, BestEval, BestRule, CheckpointFault, HoldPoint, TrainerState,
};

impl Coordinator {
    /// The work due after the step just taken: evaluation, validation and early stopping,
    /// periodic and retried checkpoints, an injected fault. True when the run ended here.
    pub(super) fn at_step_boundary(&mut self, cfg: &TrainConfig) -> Result<bool> {
        let eval_due = cfg.eval.every_steps > 0 && self.step.is_multiple_of(cfg.eval.every_steps);
        let validation_due = cfg.validation.every_steps > 0
            && (eval_due || self.step.is_multiple_of(cfg.validation.every_steps));
        let periodic_steps = cfg.checkpoint.save_every_steps > 0
            && self.step.is_multiple_of(cfg.checkpoint.save_every_steps);
        // (a checkpoint that failed is retried on its own schedule)
        let periodic_time = cfg.checkpoint.save_every_minutes > 0.0
            && self.retry.is_none()
            && self.last_save.elapsed().as_secs_f64() >= cfg.checkpoint.save_every_minutes * 60.0;
        let fault_due = cfg.debug.fail_stage == FailStage::Drafter
            && cfg.debug.fail_at_step > 0
            && self.step == cfg.debug.fail_at_step;
        if eval_due || validation_due || periodic_steps || periodic_time || fault_due {
            self.finish_queued()?;
        }
        if fault_due {
            return Err(injected_failure(cfg, format!("step {}", self.step)));
        }
        if eval_due {
            self.evaluate()?;
        }
        if validation_due {
            self.validate()?;
            if let Some(reason) = self.patience_exhausted() {
                self.stop_early(reason)?;
                return Ok(true);
            }
        }
        let retry_due = self.retry.is_some_and(|(at, _)| self.step >= at);
        if periodic_steps || periodic_time || retry_due {
            self.finish_queued()?;
            self.checkpoint(if retry_due && !(periodic_steps || periodic_time) {
                "retry"
            } else {
                "periodic"
            });
        }
        Ok(false)
    }

    /// At the end of a run, the last weights are evaluated and validated too (unless this
    /// step already was), so that `best/` never misses them.
    pub(super) fn final_measurements(&mut self) -> Result<()> {
        let Some(h) = &self.held_out else {
            return Ok(());
        };
        let step = Some(self.step);
        let evaluate = h.evaluates() && h.last_eval != step;
        let validate = h.validates() && h.last_validation != step;
        if self.step > 0 && evaluate {
            self.evaluate()?;
        }
        if self.step > 0 && validate {
            self.validate()?;
        }
        Ok(())
    }

    /// Acceptance length on the held-out prompts by real speculative decoding; without
    /// validation, a new best drafter is saved to `RUN_DIR/best/`.
    fn evaluate(&mut self) -> Result<()> {
        let Some(h) = self.held_out.as_mut() else {
            return Ok(());
        };
        let previous = self.shared.status().phase;
        self.shared.set_phase(Phase::Evaluating);
        let t = Instant::now();
        let max_new_tokens = self.config.eval.max_new_tokens;
        let summary = h
            .evaluate(
                &self.drafter,
                &self.head,
                self.step,
                max_new_tokens,
                &self.shared.stop,
            )
            .with_context(|| format!("evaluation at step {}", self.step))?;
        // the drafter worker's time, so that its stage's shares add up with its busy share
        self.shared
            .profile
            .record(ProfileEvent::EvalPass, t.elapsed());
        let eval_s = t.elapsed().as_secs_f64();
        let candidate = BestEval {
            step: self.step,
            tau: summary.tau,
            rule: BestRule::EvalDecodedTau,
            prompts: h.prompts(),
            sequences: 0,
            max_new_tokens,
        };
        let best = h.offer_best(&self.shared.run_dir, &self.drafter, candidate)?;
        let record = EvalRecord {
            step: self.step,
            tau: summary.tau,
            prompts: h.prompts(),
            decode_steps: summary.decode_steps,
            generated_tokens: summary.generated_tokens,
            accepted_by_slot: summary.accepted_by_slot,
            eval_s,
            best,
            elapsed_s: self.shared.elapsed_s(),
        };
        self.shared
            .metrics
            .write(&MetricsRecord::Eval(record.clone()));
        let note = self.best_note(best, BestRule::EvalDecodedTau);
        {
            let mut st = self.shared.status();
            if st.evals.len() >= EVAL_HISTORY {
                st.evals.remove(0);
            }
            st.evals.push(record.clone());
        }
        self.shared.event(
            EventKind::Eval,
            format!(
                "eval at step {}: tau {:.3} over {} prompts ({} tokens, {:.1} s){note}",
                self.step, record.tau, record.prompts, record.generated_tokens, eval_s
            ),
        );
        if let Some(p) = previous {
            self.shared.set_phase(p);
        }
        Ok(())
    }

    /// A validation pass on the held-out sequences (see [`crate::train::validation`]); a new
    /// best walk tau saves the drafter to `RUN_DIR/best/`.
    fn validate(&mut self) -> Result<()> {
        let Some(h) = self.held_out.as_mut() else {
            return Ok(());
        };
        let previous = self.shared.status().phase;
        self.shared.set_phase(Phase::Validating);
        let t = Instant::now();
        let v = h
            .validate(&self.drafter, &self.head, self.step, &self.shared.stop)
            .with_context(|| format!("validation at step {}", self.step))?;
        self.shared
            .profile
            .record(ProfileEvent::ValidationPass, t.elapsed());
        let validation_s = t.elapsed().as_secs_f64();
        if !v.loss.is_finite() {
            bail!(
                "validation at step {}: the loss is {} (diverged)",
                self.step,
                v.loss
            );
        }
        let candidate = BestEval {
            step: self.step,
            tau: v.tau,
            rule: BestRule::ValidationWalkTau,
            prompts: 0,
            sequences: v.sequences,
            max_new_tokens: self.config.validation.max_new_tokens,
        };
        let best = h.offer_best(&self.shared.run_dir, &self.drafter, candidate)?;
        let record = ValidationRecord {
            step: self.step,
            loss: v.loss,
            accuracy: v.accuracy,
            accept_mean: v.accept_mean,
            tau: v.tau,
            sequences: v.sequences,
            answers: v.walks.len() as u64,
            answer_steps: v.walk_steps(),
            tokens: v.walk_tokens(),
            blocks: v.blocks,
            validation_s,
            best,
            elapsed_s: self.shared.elapsed_s(),
        };
        self.shared
            .metrics
            .write(&MetricsRecord::Validation(record.clone()));
        let note = self.best_note(best, BestRule::ValidationWalkTau);
        {
            let mut st = self.shared.status();
            if st.validations.len() >= EVAL_HISTORY {
                st.validations.remove(0);
            }
            st.validations.push(record.clone());
        }
        self.shared.event(
            EventKind::Validation,
            format!(
                "validation at step {}: loss {:.4} acc {:.3} tau(walk) {:.3} (anchor mean {:.3}) over {} sequences ({} answers, {} steps, {:.1} s){note}",
                self.step,
                record.loss,
                record.accuracy,
                record.tau,
                record.accept_mean,
                record.sequences,
                record.answers,
                record.answer_steps,
                validation_s
            ),
        );
        if let Some(p) = previous {
            self.shared.set_phase(p);
        }
        Ok(())
    }

    /// "; new best, saved to ..." or "; best X at step N" for a measurement of `rule`; nothing
    /// when another rule chooses the best drafter.
    fn best_note(&self, best: bool, rule: BestRule) -> String {
        let Some(h) = self.held_out.as_ref().filter(|h| h.rule() == rule) else {
            return String::new();
        };
        match h.best() {
            Some(_) if best => format!(
                "; new best, saved to {}",
                self.shared.run_dir.join("best").display()
            ),
            Some(b) => format!("; best {:.3} at step {}", b.tau, b.step),
            None => String::new(),
        }
    }

    /// Why the run stops here, when `validation.patience` passes went by without a new best.
    fn patience_exhausted(&self) -> Option<String> {
        let patience = self.config.validation.patience;
        let h = self.held_out.as_ref()?;
        if patience == 0 || h.since_best < patience {
            return None;
        }
        let best = h
            .best()
            .map(|b| format!(" (best {:.3} at step {})", b.tau, b.step))
            .unwrap_or_default();
        Some(format!(
            "early stop at step {}: no new best validation tau in {} passes{best} (validation.patience = {patience})",
            self.step, h.since_best
        ))
    }

    /// Ends the run before its last step: the last weights measured (as at the end of a run)
    /// and checkpointed, and `reason` in the log and the summary.
    fn stop_early(&mut self, reason: String) -> Result<()> {
        self.shared.set_phase(Phase::Stopping);
        self.final_measurements()?;
        self.final_checkpoint("early stop")?;
        self.shared.status().stop_reason = Some(reason.clone());
        self.shared.set_phase(self.ended_phase());
        self.shared.event(EventKind::EarlyStop, reason);
        Ok(())
    }

    /// How a run that ends here is named: finished after its last step, stopped before it.
    fn ended_phase(&self) -> Phase {
        if self.step >= self.total_steps {
            Phase::Finished
        } else {
            Phase::Stopped
        }
    }

    /// Checkpoint and stop requests at a step boundary; true when the run should end. Once the
    /// run stops at once (a second stop signal, a stage that failed) nothing more is measured
    /// or saved, whatever was asked before.
    pub(super) fn handle_requests(&mut self) -> Result<bool> {
        if self.shared.stopping() {
            // (the last step's record still goes out)
            return self.finish_queued().map(|()| true);
        }
        let checkpoint = self.shared.checkpoint_requested.load(Ordering::SeqCst);
        if checkpoint || self.shared.stop_requested.load() != StopState::Running {
            self.finish_queued()?;
        }
        if self
            .shared
            .checkpoint_requested
            .swap(false, Ordering::SeqCst)
        {
            self.checkpoint("command");
        }
        match self.shared.stop_requested.load() {
            StopState::AfterCheckpoint => {
                self.shared.set_phase(Phase::Stopping);
                self.final_measurements()?;
                self.final_checkpoint("stop")?;
                self.shared.status().stop_reason = Some("stop command".into());
                self.shared.set_phase(self.ended_phase());
                self.shared.event(
                    EventKind::Stopped,
                    format!("stopped at step {} by command", self.step),
                );
                Ok(true)
            }
            StopState::WithoutCheckpoint => {
                self.shared.status().stop_reason = Some("stop command, no checkpoint".into());
                self.shared.set_phase(self.ended_phase());
                self.shared.event(
                    EventKind::Stopped,
                    format!("stopped at step {} without checkpoint", self.step),
                );
                Ok(true)
            }
            StopState::Running => Ok(false),
        }
    }

    /// A checkpoint during the run. A failure (a full disk, permissions) does not end the run:
    /// it is reported (log, screen, `metrics.jsonl`), the previous checkpoint stays, and the
    /// checkpoint is tried again after 1, 2, 4, ... up to 64 steps.
    fn checkpoint(&mut self, why: &str) {
        match self.write_checkpoint(why) {
            Ok(()) => {
                if self.retry.take().is_some() {
                    self.shared.event(
                        EventKind::Checkpoint,
                        format!("checkpoints work again at step {}", self.step),
                    );
                }
            }
            Err(e) => {
                let gap = self.retry.map_or(1, |(_, gap)| (gap * 2).min(64));
                self.retry = Some((self.step + gap, gap));
                let message = format!(
                    "{e:#}; training goes on, the checkpoint is tried again at step {}",
                    self.step + gap
                );
                log::warn!("{message}");
                self.shared.metrics.write(&MetricsRecord::Event {
                    elapsed_s: self.shared.elapsed_s(),
                    kind: EventKind::CheckpointFailed,
                    message,
                });
            }
        }
    }

    /// The checkpoint that ends a run (its end, a stop command, early stopping): a failure
    /// fails the run, naming the checkpoint that is kept.
    pub(super) fn final_checkpoint(&mut self, why: &str) -> Result<()> {
        self.write_checkpoint(why).map_err(|e| {
            let kept = self.shared.status().last_checkpoint.clone();
            e.context(format!(
                "the {why} checkpoint failed; the last checkpoint kept is {}",
                kept.map_or("none".into(), |p| p.display().to_string())
            ))
        })
    }

    fn write_checkpoint(&mut self, why: &str) -> Result<()> {
        if !self.shared.is_leader() {
            // rank 0 alone writes checkpoints (the weights are the same on every rank)
            return Ok(());
        }
        if self.step == 0 || self.saved_step == Some(self.step) {
            // nothing trained yet, or this step saved already by this process
            return Ok(());
        }
        let previous = self.shared.status().phase;
        self.shared.set_phase(Phase::Checkpointing);
        let result = self.save(why);
        if let Some(p) = previous {
            self.shared.set_phase(p);
        }
        result
    }

    fn save(&mut self, why: &str) -> Result<()> {
        let cfg = &self.config;
        let injected = cfg.debug.fail_stage == FailStage::Checkpoint
            && cfg.debug.fail_at_step > 0
            && self.step >= cfg.debug.fail_at_step
            && (cfg.debug.fail_count == 0
                || self.injected_checkpoint_failures < cfg.debug.fail_count);
        let fault = if injected {
            self.injected_checkpoint_failures += 1;
            match HoldPoint::from_mode(cfg.debug.fail_mode) {
                Some(point) => CheckpointFault::Hold(point),
                None if cfg.debug.fail_mode == FailMode::Panic => {
                    panic!(
                        "checkpoint at step {}: injected panic (debug.fail_stage = \"checkpoint\")",
                        self.step
                    )
                }
                None => CheckpointFault::DiskFullAfterDrafter,
            }
        } else {
            CheckpointFault::None
        };
        let (packer, epoch) = self
            .last_seen
            .map(|(_, s, e)| (s, e))
            .unwrap_or((PackerState::default(), 0));
        let last = self.shared.status().history.last().cloned();
        let state = TrainerState {
            step: self.step,
            epoch,
            packer,
            total_steps: self.total_steps,
            tokens_seen: self.tokens_seen,
            samples_seen: self.samples_seen,
            seed: cfg.run.seed,
            lr: last.as_ref().map_or(0.0, |l| l.lr),
            loss: last.as_ref().map_or(f64::NAN, |l| l.loss),
            elapsed_s: self.shared.elapsed_s(),
            saved_at_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            validations_since_best: self.held_out.as_ref().map_or(0, |h| h.since_best),
        };
        let t = Instant::now();
        let saved = save_checkpoint(
            &self.shared.run_dir,
            &self.drafter,
            &self.optimizer,
            &state,
            cfg.checkpoint.keep_checkpoints,
            fault,
        );
        self.shared
            .profile
            .record(ProfileEvent::CheckpointSave, t.elapsed());
        let path = saved.with_context(|| {
            format!(
                "checkpoint ({why}) at step {} failed; the previous checkpoint is kept",
                self.step
            )
        })?;
        self.last_save = Instant::now();
        self.saved_step = Some(self.step);
        self.shared.status().last_checkpoint = Some(path.clone());
        self.shared.event(
            EventKind::Checkpoint,
            format!(
                "checkpoint ({why}) at step {}: {} in {:.2} s",
                self.step,
                path.display(),
                t.elapsed().as_secs_f64()
            ),
        );
        Ok(())
    }
}
