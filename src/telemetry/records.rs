//! Typed telemetry: the snapshot front ends render, and the `metrics.jsonl` records of a run
//! (control-room spec §6).

use std::fs::File;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

pub use super::event_kind::EventKind;
use super::gpu::GpuReading;
use super::host::HostReading;
use super::metrics_tail::{self, BadLines};
use super::profile::ProfileReport;
use super::queues::queue_state;
pub use super::queues::{QueueLevel, QueueName, UnknownQueue};
pub(crate) use super::status::RunStatus;
use super::tensorboard::TensorBoardWriter;

/// What the run is doing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    LoadingModel,
    WarmingUp,
    Training,
    Paused,
    Checkpointing,
    /// Measuring tau by real speculative decoding on held-out prompts.
    Evaluating,
    /// Measuring the drafter teacher-forced on held-out sequences.
    Validating,
    Stopping,
    /// Ended before its last step (a stop command, a signal, early stopping).
    Stopped,
    /// Ended after its last step.
    Finished,
    Failed,
}

impl Phase {
    /// The run has ended (stopped, finished or failed): nothing more will happen in it.
    pub fn is_ended(self) -> bool {
        matches!(self, Phase::Stopped | Phase::Finished | Phase::Failed)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Phase::LoadingModel => "loading model",
            Phase::WarmingUp => "warming up",
            Phase::Training => "training",
            Phase::Paused => "paused",
            Phase::Checkpointing => "checkpointing",
            Phase::Evaluating => "evaluating",
            Phase::Validating => "validating",
            Phase::Stopping => "stopping",
            Phase::Stopped => "stopped",
            Phase::Finished => "finished",
            Phase::Failed => "failed",
        };
        f.write_str(s)
    }
}

/// Step records kept for the charts, the newest ones: by the trainer and by a screen showing a
/// recorded run alike.
pub const STEP_HISTORY: usize = 20_000;

/// One optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    pub loss: f64,
    pub accuracy: f64,
    /// Anchor-mean acceptance of the step's training blocks,
    /// `1 + mean_j sum_k prod_{i<=k} [argmax == label]` (read from older runs' `tau_train`):
    /// not a tau, it overstates what decoding gets and hides overfitting.
    #[serde(alias = "tau_train")]
    pub accept_mean: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Target tokens (non-padding) in this step.
    pub tokens: u64,
    pub samples: u64,
    /// Valid anchor blocks trained in this step (block positions = blocks * block size).
    #[serde(default)]
    pub blocks: u64,
    pub step_s: f64,
    /// Smoothed throughput.
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub elapsed_s: f64,
}

/// One periodic evaluation during training: acceptance length by real speculative decoding
/// (dflash spec §5) on held-out prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: u64,
    /// Mean accepted tokens per decoding step over all prompts.
    pub tau: f64,
    pub prompts: usize,
    /// Decoding steps (drafter + verify forwards) over all prompts.
    pub decode_steps: u64,
    pub generated_tokens: u64,
    /// Per block slot: how often it was accepted (index 0 = the steps).
    pub accepted_by_slot: Vec<u64>,
    pub eval_s: f64,
    /// This evaluation set a new best tau (its drafter was saved as the best checkpoint).
    pub best: bool,
    pub elapsed_s: f64,
}

/// One validation pass during training: the drafter teacher-forced on held-out sequences (see
/// [`crate::train::validation`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationRecord {
    pub step: u64,
    /// Weighted cross-entropy of the held-out blocks (the training loss's weights).
    pub loss: f64,
    /// Weighted accuracy of the same blocks.
    pub accuracy: f64,
    /// Anchor-mean acceptance of the same blocks (what `accept_mean` is on training batches).
    pub accept_mean: f64,
    /// Walk tau: mean tokens per decoding step, walking the held-out answers as greedy
    /// decoding would.
    pub tau: f64,
    pub sequences: usize,
    /// Answers walked, the decoding steps the walk took over them and the tokens those steps
    /// produced (tau = tokens / answer_steps).
    pub answers: u64,
    pub answer_steps: u64,
    pub tokens: u64,
    /// Blocks behind loss, accuracy and accept_mean.
    pub blocks: u64,
    pub validation_s: f64,
    /// This pass set a new best walk tau (its drafter was saved as the best checkpoint).
    pub best: bool,
    pub elapsed_s: f64,
}

/// A GPU reading with the time it was taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuRecord {
    pub elapsed_s: f64,
    pub index: u32,
    pub name: String,
    pub utilization_pct: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub temperature_c: Option<u32>,
}

impl GpuRecord {
    pub(crate) fn from_reading(elapsed_s: f64, g: &GpuReading) -> Self {
        GpuRecord {
            elapsed_s,
            index: g.index,
            name: g.name.clone(),
            utilization_pct: g.utilization_pct,
            memory_used_bytes: g.memory_used_bytes,
            memory_total_bytes: g.memory_total_bytes,
            power_watts: g.power_watts,
            temperature_c: g.temperature_c,
        }
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MetricsRecord {
    Step(StepRecord),
    Eval(EvalRecord),
    Validation(ValidationRecord),
    Gpu(GpuRecord),
    Queues {
        elapsed_s: f64,
        queues: Vec<QueueLevel>,
    },
    Profile(ProfileReport),
    Event {
        elapsed_s: f64,
        kind: EventKind,
        message: String,
    },
    Summary {
        phase: Phase,
        steps: u64,
        elapsed_s: f64,
        tokens_seen: u64,
        samples_seen: u64,
        final_loss: Option<f64>,
        final_accuracy: Option<f64>,
        #[serde(alias = "final_tau_train")]
        final_accept_mean: Option<f64>,
        last_checkpoint: Option<String>,
        error: Option<String>,
        /// Why the run stopped before its last step (a command, early stopping), if it did.
        #[serde(default)]
        stop_reason: Option<String>,
    },
}

impl MetricsRecord {
    /// The clock when the record was written (a profile report's is the profiler's).
    pub(crate) fn elapsed_s(&self) -> f64 {
        match self {
            MetricsRecord::Step(r) => r.elapsed_s,
            MetricsRecord::Eval(r) => r.elapsed_s,
            MetricsRecord::Validation(r) => r.elapsed_s,
            MetricsRecord::Gpu(r) => r.elapsed_s,
            MetricsRecord::Queues { elapsed_s, .. }
            | MetricsRecord::Event { elapsed_s, .. }
            | MetricsRecord::Summary { elapsed_s, .. } => *elapsed_s,
            MetricsRecord::Profile(p) => p.elapsed_s,
        }
    }
}

/// Appends records to `metrics.jsonl`, one JSON object a line, each written with one append.
/// Telemetry never stops training: a write that fails (a full disk) is cut back off the file, so
/// no half line stays behind, and counted; the log says so at the first failure and at each
/// doubling of the count, not at every record, and once more when writes succeed again.
pub(crate) struct MetricsWriter {
    inner: Mutex<MetricsFile>,
    /// The same scalars as TensorBoard event files, once [`MetricsWriter::with_tensorboard`].
    tensorboard: Option<TensorBoardWriter>,
}

struct MetricsFile {
    file: File,
    failures: u64,
}

impl MetricsWriter {
    pub(crate) fn open(path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| anyhow::anyhow!("{}: cannot write: {e}", path.display()))?;
        Ok(MetricsWriter {
            inner: Mutex::new(MetricsFile { file, failures: 0 }),
            tensorboard: None,
        })
    }

    /// Also writes the scalars as TensorBoard event files into `run_dir/tensorboard/`, going on
    /// after step `last_step`; without them (the folder cannot be written) when it cannot.
    pub(crate) fn with_tensorboard(mut self, run_dir: &Path, last_step: u64) -> Self {
        match TensorBoardWriter::open(run_dir, last_step) {
            Ok(tb) => self.tensorboard = Some(tb),
            Err(e) => log::warn!("no TensorBoard event files for this run: {e:#}"),
        }
        self
    }

    /// Opens the metrics of a run resumed at step `step`: the records of the steps after it
    /// (written before a crash, and about to be written again), a half-written last line and
    /// the earlier run's summary are dropped first (the file is rewritten beside and renamed),
    /// so a reader sees each step once.
    pub(crate) fn open_resumed(path: &Path, step: u64) -> anyhow::Result<Self> {
        let cannot_read = |e| anyhow::anyhow!("{}: cannot read: {e}", path.display());
        let len = std::fs::metadata(path).map_or(0, |m| m.len());
        let (kept, bad) = records_up_to_step(path, step).map_err(cannot_read)?;
        if let Some(bad) = bad.describe() {
            log::warn!("{}: {bad}; the run goes on without them", path.display());
        }
        if kept.len() as u64 != len {
            let tmp = path.with_extension("jsonl.resume-tmp");
            std::fs::write(&tmp, &kept)
                .and_then(|_| std::fs::rename(&tmp, path))
                .map_err(|e| anyhow::anyhow!("{}: cannot rewrite: {e}", path.display()))?;
        }
        Self::open(path)
    }

    pub(crate) fn write(&self, record: &MetricsRecord) {
        if let Some(tb) = &self.tensorboard {
            tb.write(record);
        }
        let Ok(mut line) = serde_json::to_string(record) else {
            return;
        };
        line.push('\n');
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match crate::fsutil::append_whole(&mut m.file, line.as_bytes()) {
            Ok(()) => {
                if m.failures > 0 {
                    log::info!(
                        "metrics.jsonl: writing again ({} records were lost)",
                        m.failures
                    );
                    m.failures = 0;
                }
            }
            Err(e) => {
                m.failures += 1;
                if m.failures.is_power_of_two() {
                    log::warn!(
                        "metrics.jsonl: {} record(s) lost so far ({e}); writes go on when there is room",
                        m.failures
                    );
                }
            }
        }
    }

    /// Records lost since the last write that succeeded.
    #[cfg(test)]
    fn failures(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failures
    }
}

/// The lines of `metrics.jsonl` that a run resumed at `step` keeps: everything before the
/// first record of a later step, without unreadable (half-written, not UTF-8) lines, which are
/// counted, or summaries.
fn records_up_to_step(path: &Path, step: u64) -> std::io::Result<(Vec<u8>, BadLines)> {
    let mut out = Vec::new();
    let mut past = false;
    let read = metrics_tail::read_all(path, |record, line| {
        past = past || matches!(record, MetricsRecord::Step(r) if r.step > step);
        if !past && !matches!(record, MetricsRecord::Summary { .. }) {
            out.extend_from_slice(line);
            out.push(b'\n');
        }
    })?;
    Ok((out, read.bad))
}

/// What a resumed run continues from: the records kept in `metrics.jsonl` (see
/// [`MetricsWriter::open_resumed`]), so that its charts, evaluations and clock go on instead of
/// starting again.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RunHistory {
    pub steps: Vec<StepRecord>,
    pub evals: Vec<EvalRecord>,
    pub validations: Vec<ValidationRecord>,
    /// The run's clock at its last record.
    pub elapsed_s: f64,
}

impl RunHistory {
    /// Adds one record of the run.
    fn push(&mut self, record: &MetricsRecord) {
        if !matches!(record, MetricsRecord::Profile(_)) {
            // (a profile report's clock is the profiler's, restarted by a resume)
            self.elapsed_s = self.elapsed_s.max(record.elapsed_s());
        }
        match record {
            MetricsRecord::Step(r) => self.steps.push(r.clone()),
            MetricsRecord::Eval(r) => self.evals.push(r.clone()),
            MetricsRecord::Validation(r) => self.validations.push(r.clone()),
            _ => {}
        }
    }

    /// The history of the run whose metrics are at `path` (empty when there are none); lines
    /// that are not records are left out (and logged).
    pub(crate) fn read(path: &Path) -> anyhow::Result<Self> {
        let mut h = RunHistory::default();
        let read = metrics_tail::read_all(path, |record, _| h.push(record))
            .map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", path.display()))?;
        if let Some(bad) = read.bad.describe() {
            log::warn!("{}: {bad}", path.display());
        }
        Ok(h)
    }
}

/// Reads `metrics.jsonl` back into records; a line that is not one is an error naming it.
pub fn read_metrics(path: &Path) -> anyhow::Result<Vec<MetricsRecord>> {
    let mut records = Vec::new();
    let read = metrics_tail::read_all(path, |record, _| records.push(record.clone()))
        .map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", path.display()))?;
    if !read.exists {
        anyhow::bail!("{}: cannot read: no such file", path.display());
    }
    if let Some((line, why)) = read.bad.first {
        anyhow::bail!("{}: line {line}: {why}", path.display());
    }
    Ok(records)
}

/// Everything a front end shows, at one moment. `Default` is a run before anything is known:
/// loading, step 0, nothing recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub run_name: String,
    pub run_dir: String,
    /// The target's family and layers ([`crate::model::describe_target`]); None where its
    /// config cannot be read (or from a trainer before it was sent).
    #[serde(default)]
    pub target: Option<String>,
    pub phase: Phase,
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub elapsed_s: f64,
    pub eta_s: Option<f64>,
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub last: Option<StepRecord>,
    /// Recent steps for the charts (bounded).
    pub history: Vec<StepRecord>,
    /// Periodic evaluations so far (bounded).
    #[serde(default)]
    pub evals: Vec<EvalRecord>,
    /// Validation passes so far (bounded).
    #[serde(default)]
    pub validations: Vec<ValidationRecord>,
    pub queues: Vec<QueueLevel>,
    pub profile: Option<ProfileReport>,
    pub profile_interval_s: f64,
    pub gpus: Option<Vec<GpuReading>>,
    pub gpu_error: Option<String>,
    /// The trainer process's CPU and memory use (shown where NVML is unavailable).
    #[serde(default)]
    pub host: Option<HostReading>,
    /// Devices each stage runs on, e.g. ("target", "cuda:0").
    pub stage_devices: Vec<(String, String)>,
    pub last_checkpoint: Option<String>,
    pub error: Option<String>,
    /// Every rank of a multi-process run, rank 0 first (as rank 0 last heard from each; see
    /// docs/distributed.md); empty in a single process.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<super::ranks::RankReport>,
}

/// How [`Snapshot::verdict`]'s line begins (screens keep it when they fold a profile table).
pub(crate) const VERDICT_PREFIX: &str = "bottleneck:";

impl Snapshot {
    /// The one-line verdict on where the time goes: the busiest stage of the last ProfileStats
    /// interval and the state of each queue, e.g. `bottleneck: drafter (busy 99 %); batch_q
    /// full, feature_q full`. None before a profile report with timed work.
    pub fn verdict(&self) -> Option<String> {
        let (stage, busy) = self.profile.as_ref()?.bottleneck()?;
        let queues: Vec<String> = self
            .queues
            .iter()
            .filter_map(|q| queue_state(q).map(|state| format!("{} {state}", q.name)))
            .collect();
        let mut line = format!("{VERDICT_PREFIX} {stage} (busy {:.0} %)", busy * 100.0);
        if !queues.is_empty() {
            line.push_str("; ");
            line.push_str(&queues.join(", "));
        }
        Some(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_names_are_the_same_words_everywhere() {
        for q in QueueName::ALL {
            let json = serde_json::to_string(&q).unwrap();
            assert_eq!(json, format!("\"{q}\""));
            assert_eq!(serde_json::from_str::<QueueName>(&json).unwrap(), q);
            assert_eq!(q.as_str().parse::<QueueName>(), Ok(q));
        }
        assert_eq!(QueueName::Batch.to_string(), "batch_q");
        assert_eq!(format!("{:<10}|", QueueName::Feature), "feature_q |");
        let listed: Vec<&str> = QueueName::ALL.iter().map(|q| q.as_str()).collect();
        assert_eq!(
            "nowhere".parse::<QueueName>().unwrap_err().to_string(),
            format!("unknown queue \"nowhere\" (queues: {})", listed.join(", "))
        );
    }

    #[test]
    fn every_record_type_parses_back() {
        let step = StepRecord {
            step: 3,
            epoch: 0,
            loss: 2.5,
            accuracy: 0.25,
            accept_mean: 1.5,
            lr: 1e-4,
            grad_norm: 0.7,
            tokens: 1000,
            samples: 4,
            blocks: 100,
            step_s: 0.2,
            tokens_per_s: 5000.0,
            samples_per_s: 20.0,
            elapsed_s: 1.0,
        };
        let records = vec![
            MetricsRecord::Step(step),
            MetricsRecord::Eval(EvalRecord {
                step: 3,
                tau: 2.25,
                prompts: 8,
                decode_steps: 40,
                generated_tokens: 98,
                accepted_by_slot: vec![40, 30, 20, 0],
                eval_s: 1.5,
                best: true,
                elapsed_s: 2.0,
            }),
            MetricsRecord::Validation(ValidationRecord {
                step: 3,
                loss: 2.75,
                accuracy: 0.2,
                accept_mean: 1.75,
                tau: 1.5,
                sequences: 4,
                answers: 5,
                answer_steps: 60,
                tokens: 90,
                blocks: 300,
                validation_s: 0.5,
                best: true,
                elapsed_s: 2.5,
            }),
            MetricsRecord::Gpu(GpuRecord {
                elapsed_s: 1.0,
                index: 0,
                name: "H200".into(),
                utilization_pct: Some(90),
                memory_used_bytes: Some(1 << 30),
                memory_total_bytes: None,
                power_watts: Some(500.0),
                temperature_c: None,
            }),
            MetricsRecord::Queues {
                elapsed_s: 2.0,
                queues: vec![QueueLevel {
                    name: QueueName::Batch,
                    len: 1,
                    capacity: 4,
                    pushed: 9,
                    popped: 8,
                }],
            },
            MetricsRecord::Profile(crate::telemetry::profile::ProfileStats::new().report()),
            MetricsRecord::Event {
                elapsed_s: 3.0,
                kind: EventKind::Checkpoint,
                message: "saved".into(),
            },
            MetricsRecord::Summary {
                phase: Phase::Finished,
                steps: 3,
                elapsed_s: 4.0,
                tokens_seen: 3000,
                samples_seen: 12,
                final_loss: Some(2.5),
                final_accuracy: None,
                final_accept_mean: Some(1.5),
                last_checkpoint: Some("/r/checkpoints/step-000003".into()),
                error: None,
                stop_reason: Some("early stop".into()),
            },
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let w = MetricsWriter::open(&path).unwrap();
        for r in &records {
            w.write(r);
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text
            .lines()
            .next()
            .unwrap()
            .starts_with("{\"type\":\"step\""));
        assert_eq!(read_metrics(&path).unwrap(), records);
        std::fs::write(&path, "{\"type\":\"nope\"}\n").unwrap();
        assert!(read_metrics(&path)
            .unwrap_err()
            .to_string()
            .contains("line 1"));
    }

    #[test]
    fn runs_written_with_tau_train_still_load() {
        let step = r#"{"type":"step","step":1,"epoch":0,"loss":2.0,"accuracy":0.1,"tau_train":1.25,"lr":0.001,"grad_norm":1.0,"tokens":10,"samples":1,"step_s":0.1,"tokens_per_s":100.0,"samples_per_s":10.0,"elapsed_s":0.1}"#;
        let summary = r#"{"type":"summary","phase":"finished","steps":1,"elapsed_s":1.0,"tokens_seen":10,"samples_seen":1,"final_loss":2.0,"final_accuracy":0.1,"final_tau_train":1.25,"last_checkpoint":null,"error":null}"#;
        match serde_json::from_str::<MetricsRecord>(step).unwrap() {
            MetricsRecord::Step(s) => assert_eq!(s.accept_mean, 1.25),
            other => panic!("{other:?}"),
        }
        match serde_json::from_str::<MetricsRecord>(summary).unwrap() {
            MetricsRecord::Summary {
                final_accept_mean, ..
            } => assert_eq!(final_accept_mean, Some(1.25)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_resumed_run_keeps_the_records_up_to_its_checkpoint_step() {
        let step = |n: u64| {
            format!(
                r#"{{"type":"step","step":{n},"epoch":0,"loss":2.0,"accuracy":0.1,"accept_mean":1.0,"lr":0.001,"grad_norm":1.0,"tokens":10,"samples":1,"step_s":0.1,"tokens_per_s":100.0,"samples_per_s":10.0,"elapsed_s":0.1}}"#
            )
        };
        let event = r#"{"type":"event","elapsed_s":1.0,"kind":"checkpoint","message":"at step 3"}"#;
        let summary = r#"{"type":"summary","phase":"finished","steps":5,"elapsed_s":1.0,"tokens_seen":10,"samples_seen":1,"final_loss":2.0,"final_accuracy":0.1,"final_accept_mean":1.0,"last_checkpoint":null,"error":null}"#;
        let lines = [
            step(1),
            step(2),
            step(3),
            event.to_string(),
            step(4),
            step(5),
            summary.to_string(),
        ];
        let mut text = lines.join("\n").into_bytes();
        // a line with a byte that is not UTF-8 (a disk error, a foreign writer)
        text.extend_from_slice(b"\n{\"type\":\"event\",\"elapsed_s\":1.0,\"kind\":\"\xff\"}\n");
        text.extend_from_slice(b"{\"type\":\"step\",\"st"); // a half line left by a kill
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(&path, &text).unwrap();
        let (kept, bad) = records_up_to_step(&path, 3).unwrap();
        assert_eq!(kept, format!("{}\n", lines[..4].join("\n")).into_bytes());
        // nothing past the step: the bad line, the half line and a summary still go; the bad
        // line is counted (the half one is what a kill leaves, not an error)
        let (kept, bad_too) = records_up_to_step(&path, 9).unwrap();
        assert_eq!(kept, format!("{}\n", lines[..6].join("\n")).into_bytes());
        assert_eq!((bad.count, bad_too.count), (1, 1));
        assert_eq!(bad.first.as_ref().map(|b| b.0), Some(8));
        // a resumed run: the file is rewritten to the kept lines, and its history read back
        drop(MetricsWriter::open_resumed(&path, 3).unwrap());
        let history = RunHistory::read(&path).unwrap();
        assert_eq!(history.steps.len(), 3);
        assert_eq!(history.elapsed_s, 1.0);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            format!("{}\n", lines[..4].join("\n")).into_bytes()
        );
    }

    #[test]
    fn failed_metrics_writes_are_counted_and_leave_no_half_line() {
        // /dev/full answers every write with "no space left on device"
        let full = std::path::Path::new("/dev/full");
        if !full.exists() {
            return;
        }
        let w = MetricsWriter::open(full).unwrap();
        for _ in 0..5 {
            w.write(&MetricsRecord::Event {
                elapsed_s: 0.0,
                kind: EventKind::Other("x".into()),
                message: "y".into(),
            });
        }
        assert_eq!(w.failures(), 5);
    }
}
