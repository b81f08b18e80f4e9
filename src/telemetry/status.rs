//! `ctl status` and the `:status` overlay: the run's state as one object, from a snapshot.

use serde::{Deserialize, Serialize};

use super::format::fmt_duration_clock;
use super::queues::{queue_state, QueueLevel};
use super::ranks::{self, RankReport};
use super::records::{EvalRecord, Phase, Snapshot, ValidationRecord};

/// `ctl status`: the run's state as one JSON object, for people and scripts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunStatus {
    pub run_name: String,
    pub run_dir: String,
    /// The target's family and layers, e.g. `qwen3_5_text (Qwen3.5 hybrid): 48 Gated DeltaNet
    /// + 16 gated attention layers`.
    #[serde(default)]
    pub target: Option<String>,
    /// The trainer's; none once the run has ended.
    pub pid: Option<u32>,
    pub phase: Phase,
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub elapsed_s: f64,
    pub eta_s: Option<f64>,
    /// Over the last 30 s (the whole run once it has finished).
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub queues: Vec<QueueLevel>,
    pub last_checkpoint: Option<String>,
    pub last_eval: Option<EvalRecord>,
    pub last_validation: Option<ValidationRecord>,
    pub verdict: Option<String>,
    pub error: Option<String>,
    /// How the run ended (`stopped at step 45 of 60`), read from its records when no trainer
    /// answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
    /// Every rank of a multi-process run (rank 0 first), and the one the others wait for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest_rank: Option<usize>,
}

impl RunStatus {
    pub(crate) fn new(s: &Snapshot, pid: Option<u32>) -> Self {
        RunStatus {
            run_name: s.run_name.clone(),
            run_dir: s.run_dir.clone(),
            target: s.target.clone(),
            pid,
            phase: s.phase,
            step: s.step,
            total_steps: s.total_steps,
            epoch: s.epoch,
            elapsed_s: s.elapsed_s,
            eta_s: s.eta_s,
            tokens_per_s: s.tokens_per_s,
            samples_per_s: s.samples_per_s,
            loss: s.last.as_ref().map(|l| l.loss),
            accuracy: s.last.as_ref().map(|l| l.accuracy),
            queues: s.queues.clone(),
            last_checkpoint: s.last_checkpoint.clone(),
            last_eval: s.evals.last().cloned(),
            last_validation: s.validations.last().cloned(),
            verdict: s.verdict(),
            error: s.error.clone(),
            ended: None,
            ranks: s.ranks.clone(),
            slowest_rank: ranks::slowest(&s.ranks),
        }
    }

    /// The status as labelled lines for people (the `:status` overlay).
    pub(crate) fn summary(&self) -> Vec<(&'static str, String)> {
        let pct = match self.total_steps {
            0 => String::new(),
            t => format!(" ({:.0} %)", 100.0 * self.step as f64 / t as f64),
        };
        let eta = match (self.phase, self.eta_s) {
            (p, _) if p.is_ended() => String::new(),
            (Phase::Paused, Some(e)) => format!(", ETA {} (paused)", fmt_duration_clock(e)),
            (_, Some(e)) => format!(", ETA {}", fmt_duration_clock(e)),
            (_, None) => ", ETA -".into(),
        };
        let over = if self.phase.is_ended() {
            "run average"
        } else {
            "last 30 s"
        };
        let queues: Vec<String> = self
            .queues
            .iter()
            .map(|q| match queue_state(q) {
                Some(state) => format!("{} {}/{} {state}", q.name, q.len, q.capacity),
                None => format!("{} {}/{}", q.name, q.len, q.capacity),
            })
            .collect();
        let mut lines = vec![
            ("run", format!("{} ({})", self.run_name, self.run_dir)),
            ("target", self.target.clone().unwrap_or_else(|| "-".into())),
            ("phase", self.phase.to_string()),
            (
                "step",
                format!(
                    "{} / {}{pct}, epoch {}",
                    self.step, self.total_steps, self.epoch
                ),
            ),
            (
                "time",
                format!("elapsed {}{eta}", fmt_duration_clock(self.elapsed_s)),
            ),
            (
                "rates",
                format!(
                    "{:.0} tok/s, {:.2} samples/s ({over})",
                    self.tokens_per_s, self.samples_per_s
                ),
            ),
        ];
        if let (Some(loss), Some(acc)) = (self.loss, self.accuracy) {
            lines.push(("loss", format!("{loss:.4}, accuracy {acc:.3}")));
        }
        if !queues.is_empty() {
            lines.push(("queues", queues.join(", ")));
        }
        let checkpoint = self.last_checkpoint.as_deref().unwrap_or("none");
        lines.push(("checkpoint", checkpoint.to_string()));
        if let Some(v) = &self.last_validation {
            let text = format!("step {}: tau {:.3}, loss {:.4}", v.step, v.tau, v.loss);
            lines.push(("validation", text));
        }
        if let Some(e) = &self.last_eval {
            lines.push(("eval", format!("step {}: tau {:.3}", e.step, e.tau)));
        }
        lines.extend(self.verdict.clone().map(|v| ("verdict", v)));
        lines.extend(
            self.ranks
                .iter()
                .map(|r| ("rank", ranks::describe(r, self.slowest_rank))),
        );
        lines.extend(self.ended.clone().map(|e| ("ended", e)));
        lines.extend(self.error.clone().map(|e| ("error", e)));
        lines
    }
}
