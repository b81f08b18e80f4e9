//! A run as its `metrics.jsonl` recorded it, read as the file grows (only the new bytes are
//! parsed: see [`MetricsTail`]) and kept bounded: the screens' step history, evaluations and
//! validations, the last queues and profile, the summary. What a screen or `ctl status` shows
//! when no trainer answers.

use std::path::{Path, PathBuf};

use crate::telemetry::metrics_tail::{BadLines, MetricsTail, Seen};
use crate::telemetry::profile::ProfileReport;
use crate::telemetry::records::{
    EvalRecord, MetricsRecord, Phase, QueueLevel, Snapshot, StepRecord, ValidationRecord,
};

pub(crate) use crate::telemetry::records::STEP_HISTORY as HISTORY;

/// The end of a run, as its summary record says.
#[derive(Debug, Clone)]
struct Summary {
    phase: Phase,
    steps: u64,
    elapsed_s: f64,
    tokens_seen: u64,
    samples_seen: u64,
    last_checkpoint: Option<String>,
    error: Option<String>,
}

/// What the records said so far.
#[derive(Debug, Clone, Default)]
struct Recorded {
    history: Vec<StepRecord>,
    evals: Vec<EvalRecord>,
    validations: Vec<ValidationRecord>,
    queues: Vec<QueueLevel>,
    profile: Option<ProfileReport>,
    elapsed_s: f64,
    summary: Option<Summary>,
}

/// Keeps the newest [`HISTORY`] of `v`, cutting only when it holds twice as many (so that a
/// long file costs one cut per [`HISTORY`] records, not one per record).
fn bound<T>(v: &mut Vec<T>) {
    if v.len() >= 2 * HISTORY {
        v.drain(..v.len() - HISTORY);
    }
}

impl Recorded {
    fn push(&mut self, record: MetricsRecord) {
        match record {
            MetricsRecord::Step(r) => {
                self.elapsed_s = self.elapsed_s.max(r.elapsed_s);
                self.history.push(r);
                bound(&mut self.history);
            }
            MetricsRecord::Eval(r) => {
                self.evals.push(r);
                bound(&mut self.evals);
            }
            MetricsRecord::Validation(r) => {
                self.validations.push(r);
                bound(&mut self.validations);
            }
            MetricsRecord::Queues { queues, .. } => self.queues = queues,
            MetricsRecord::Profile(p) => self.profile = Some(p),
            MetricsRecord::Summary {
                phase,
                steps,
                elapsed_s,
                tokens_seen,
                samples_seen,
                last_checkpoint,
                error,
                ..
            } => {
                self.summary = Some(Summary {
                    phase,
                    steps,
                    elapsed_s,
                    tokens_seen,
                    samples_seen,
                    last_checkpoint,
                    error,
                })
            }
            MetricsRecord::Gpu(_) | MetricsRecord::Event { .. } => {}
        }
    }
}

/// The records of one run, followed.
pub(crate) struct RecordedRun {
    run_dir: PathBuf,
    tail: MetricsTail,
    recorded: Recorded,
    exists: bool,
}

impl RecordedRun {
    pub(crate) fn new(run_dir: &Path) -> Self {
        RecordedRun {
            run_dir: run_dir.to_path_buf(),
            tail: MetricsTail::new(&run_dir.join("metrics.jsonl")),
            recorded: Recorded::default(),
            exists: false,
        }
    }

    /// Reads what was written since the last call; whether anything changed (a file that
    /// cannot be read counts as none).
    pub(crate) fn read_new(&mut self) -> bool {
        let mut changed = false;
        let recorded = &mut self.recorded;
        let read = self.tail.read_new(|seen| {
            changed = true;
            match seen {
                Seen::Restart => *recorded = Recorded::default(),
                Seen::Record { record, .. } => recorded.push(record),
            }
        });
        let exists = read.unwrap_or(false);
        changed |= exists != self.exists;
        self.exists = exists;
        changed
    }

    /// Lines of the file that were not records.
    pub(crate) fn bad_lines(&self) -> &BadLines {
        self.tail.bad_lines()
    }

    /// The run as recorded so far (None without a `metrics.jsonl`), with its `config.toml`:
    /// its charts, evaluations, last profile and queues, and its summary when it has one.
    /// `running`: a trainer holds the run (starting up), so no summary means it is still to
    /// come.
    pub(crate) fn snapshot(&self, running: bool) -> Option<Snapshot> {
        if !self.exists {
            return None;
        }
        let mut snap = base_snapshot(&self.run_dir, running);
        let r = &self.recorded;
        let from = r.history.len().saturating_sub(HISTORY);
        snap.history = r.history[from..].to_vec();
        snap.evals = r.evals.clone();
        snap.validations = r.validations.clone();
        snap.queues = r.queues.clone();
        snap.profile = r.profile.clone();
        snap.elapsed_s = r.elapsed_s;
        if let Some(s) = &r.summary {
            snap.phase = s.phase;
            snap.step = s.steps;
            snap.elapsed_s = s.elapsed_s;
            snap.tokens_per_s = s.tokens_seen as f64 / s.elapsed_s.max(1e-9);
            snap.samples_per_s = s.samples_seen as f64 / s.elapsed_s.max(1e-9);
            snap.last_checkpoint = s.last_checkpoint.clone();
            snap.error = s.error.clone();
        }
        finish(&self.run_dir, &mut snap, running, r.summary.is_some());
        Some(snap)
    }
}

/// A snapshot of the run from `metrics.jsonl` and `config.toml`, read once (see
/// [`RecordedRun::snapshot`]).
pub(crate) fn recorded_snapshot(run_dir: &Path, running: bool) -> Option<Snapshot> {
    let mut run = RecordedRun::new(run_dir);
    run.read_new();
    run.snapshot(running)
}

/// The run's name, schedule and settings from its `config.toml`, nothing recorded yet.
pub(crate) fn base_snapshot(run_dir: &Path, running: bool) -> Snapshot {
    let config = crate::config::load(&run_dir.join("config.toml"), &[]).ok();
    Snapshot {
        run_name: config
            .as_ref()
            .map_or_else(|| run_dir.display().to_string(), |c| c.run.name.clone()),
        run_dir: run_dir.display().to_string(),
        target: config.as_ref().and_then(|c| {
            let target = crate::model::TargetConfig::from_model_dir(Path::new(&c.model.target));
            target.ok().map(|t| crate::model::describe_target(&t))
        }),
        phase: if running {
            Phase::LoadingModel
        } else {
            Phase::Failed
        },
        total_steps: config.as_ref().map_or(0, |c| c.train.total_steps),
        profile_interval_s: config
            .as_ref()
            .map_or(0.0, |c| c.telemetry.profile_interval_s),
        gpu_error: Some("not measured: no trainer runs".into()),
        ..Snapshot::default()
    }
}

/// What follows from the records: the last step, the schedule of a run in epochs, the newest
/// checkpoint, the phase of a run without a summary.
fn finish(run_dir: &Path, snap: &mut Snapshot, running: bool, summary: bool) {
    snap.last = snap.history.last().cloned();
    if let Some(last) = &snap.last {
        snap.step = snap.step.max(last.step);
        snap.epoch = last.epoch;
        // a live trainer that has written steps is past loading (a busy one may not answer its
        // socket for a while: the header must not fall back to "loading model" mid-run)
        if running && !summary {
            snap.phase = Phase::Training;
        }
    }
    let newest = crate::train::checkpoint::newest_checkpoint(run_dir).ok();
    if snap.total_steps == 0 {
        // a schedule in epochs: its steps were counted by the trainer, and saved
        let state = newest.as_deref().map(crate::train::checkpoint::read_state);
        if let Some(Ok(state)) = state {
            snap.total_steps = state.total_steps;
        }
    }
    if snap.last_checkpoint.is_none() {
        snap.last_checkpoint = newest.map(|p| p.display().to_string());
    }
    // (runs recorded before `stopped` was a phase called every end "finished")
    if snap.phase == Phase::Finished && snap.step < snap.total_steps {
        snap.phase = Phase::Stopped;
    }
    if !summary && !running {
        snap.error = Some(
            "the trainer is gone without a summary (killed?); continue it with train --resume"
                .into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn step(s: u64) -> MetricsRecord {
        MetricsRecord::Step(StepRecord {
            step: s,
            epoch: 0,
            loss: 3.0 - s as f64 * 0.1,
            accuracy: 0.1,
            accept_mean: 1.1,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 100,
            samples: 2,
            blocks: 10,
            step_s: 0.5,
            tokens_per_s: 200.0,
            samples_per_s: 4.0,
            elapsed_s: s as f64 * 0.5,
        })
    }

    fn line(r: &MetricsRecord) -> String {
        serde_json::to_string(r).unwrap() + "\n"
    }

    #[test]
    fn a_followed_run_reads_only_what_is_new_and_keeps_its_history_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut run = RecordedRun::new(dir.path());
        assert!(
            !run.read_new() && run.snapshot(false).is_none(),
            "no records yet"
        );
        let mut f = std::fs::File::create(&path).unwrap();
        assert!(run.read_new(), "the file appeared");
        let n = 2 * HISTORY as u64 + 10;
        for s in 1..=n {
            f.write_all(line(&step(s)).as_bytes()).unwrap();
        }
        assert!(run.read_new());
        assert!(
            run.recorded.history.len() < 2 * HISTORY,
            "bounded while read"
        );
        let snap = run.snapshot(false).unwrap();
        assert_eq!(snap.history.len(), HISTORY);
        assert_eq!(snap.history[0].step, n - HISTORY as u64 + 1);
        assert_eq!((snap.step, snap.phase), (n, Phase::Failed));
        assert!(!run.read_new(), "nothing new: nothing read");
        // one bad byte: skipped and counted, the records after it read
        f.write_all(b"{\"type\":\"step\",\xfe}\n").unwrap();
        f.write_all(line(&step(n + 1)).as_bytes()).unwrap();
        assert!(run.read_new());
        assert_eq!(run.bad_lines().count, 1);
        assert_eq!(run.snapshot(false).unwrap().step, n + 1);
    }

    #[test]
    fn a_finished_run_is_read_from_its_records() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        assert_eq!(
            recorded_snapshot(dir.path(), true).unwrap().phase,
            Phase::LoadingModel
        );
        let mut text = String::new();
        for s in 1..=4 {
            text.push_str(&serde_json::to_string(&step(s)).unwrap());
            text.push('\n');
        }
        std::fs::write(dir.path().join("metrics.jsonl"), &text).unwrap();
        // a live trainer with steps on record is training, one without is still loading
        assert_eq!(
            recorded_snapshot(dir.path(), true).unwrap().phase,
            Phase::Training
        );
        let killed = recorded_snapshot(dir.path(), false).unwrap();
        assert_eq!((killed.step, killed.history.len()), (4, 4));
        assert!(killed
            .error
            .as_deref()
            .is_some_and(|e| e.contains("--resume")));
        let summary = MetricsRecord::Summary {
            phase: Phase::Finished,
            steps: 4,
            elapsed_s: 2.5,
            tokens_seen: 400,
            samples_seen: 8,
            final_loss: Some(2.6),
            final_accuracy: Some(0.1),
            final_accept_mean: Some(1.1),
            last_checkpoint: Some("ckpt".into()),
            error: None,
            stop_reason: None,
        };
        text.push_str(&serde_json::to_string(&summary).unwrap());
        text.push('\n');
        std::fs::write(dir.path().join("metrics.jsonl"), &text).unwrap();
        let done = recorded_snapshot(dir.path(), false).unwrap();
        assert_eq!(done.phase, Phase::Finished);
        assert_eq!(done.error, None);
        assert!(
            (done.tokens_per_s - 160.0).abs() < 1e-9,
            "the run's average"
        );
        assert_eq!(done.last_checkpoint.as_deref(), Some("ckpt"));
    }
}
