//! What a screen shows of a run, from outside the trainer: its state through the control
//! socket (the step records arrive once each: a poll asks for those after the newest it has),
//! its log from `train.log`, and, when no trainer serves the run (finished, killed, not started
//! yet), what `metrics.jsonl` recorded. The trainer's own screen and `attach` both read a run
//! this way.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::frontend::socket::ControlClient;
use crate::pipeline::command::Command;
use crate::telemetry::profile::ProfileReport;
use crate::telemetry::records::{MetricsRecord, Phase, Snapshot, StepRecord};
use crate::train::run_lock::RunLock;

/// Step records a screen keeps (the trainer keeps as many).
const HISTORY: usize = 20_000;
/// How often a screen without a trainer tries to reach one again.
const RECONNECT: Duration = Duration::from_secs(1);
/// The most of train.log read when a screen opens.
const LOG_BACKLOG_BYTES: u64 = 64 * 1024;

/// New lines of a growing log file.
pub(crate) struct LogTail {
    path: PathBuf,
    pos: u64,
    /// A line not yet ended by a newline.
    partial: String,
    /// Whether the text read next may begin inside a line (the backlog starts mid-file),
    /// whose fragment up to the first newline is dropped.
    in_fragment: bool,
}

impl LogTail {
    /// Starts at the last [`LOG_BACKLOG_BYTES`] of `path` (or its beginning when shorter).
    pub(crate) fn open(path: &Path) -> Self {
        let len = std::fs::metadata(path).map_or(0, |m| m.len());
        let pos = len.saturating_sub(LOG_BACKLOG_BYTES);
        LogTail {
            path: path.to_path_buf(),
            pos,
            partial: String::new(),
            in_fragment: pos > 0,
        }
    }

    /// The complete lines written since the last call.
    pub(crate) fn poll(&mut self) -> Vec<String> {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        let len = file.metadata().map_or(0, |m| m.len());
        if len < self.pos {
            // Cut back or replaced: read it again from its start.
            self.pos = 0;
            self.partial.clear();
            self.in_fragment = false;
        }
        if len == self.pos || file.seek(SeekFrom::Start(self.pos)).is_err() {
            return Vec::new();
        }
        let mut bytes = Vec::new();
        if file.take(len - self.pos).read_to_end(&mut bytes).is_err() {
            return Vec::new();
        }
        self.pos += bytes.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&bytes));
        let mut lines: Vec<String> = self.partial.split('\n').map(str::to_string).collect();
        self.partial = lines.pop().unwrap_or_default();
        if self.in_fragment && !lines.is_empty() {
            // The backlog began inside a line: drop that fragment (only that: every later
            // read starts where a complete line ended).
            lines.remove(0);
            self.in_fragment = false;
        }
        lines
    }
}

/// A run as a screen sees it.
pub(crate) struct RunFeed {
    run_dir: PathBuf,
    client: Option<ControlClient>,
    last_try: Option<Instant>,
    history: Vec<StepRecord>,
    log: LogTail,
}

/// One look at the run.
pub(crate) struct FeedUpdate {
    pub snapshot: Option<Snapshot>,
    /// Why the snapshot is not live (None when it is).
    pub offline: Option<String>,
    pub log: Vec<String>,
}

impl RunFeed {
    pub(crate) fn new(run_dir: &Path) -> Self {
        RunFeed {
            run_dir: run_dir.to_path_buf(),
            client: None,
            last_try: None,
            history: Vec::new(),
            log: LogTail::open(&run_dir.join("train.log")),
        }
    }

    fn connected(&mut self) -> Option<&mut ControlClient> {
        if self.client.is_none() && self.last_try.is_none_or(|t| t.elapsed() >= RECONNECT) {
            self.last_try = Some(Instant::now());
            self.client = ControlClient::connect(&self.run_dir).ok();
        }
        self.client.as_mut()
    }

    /// Asks the trainer for its state (the step records after the newest already here); reads
    /// the recorded run when no trainer answers.
    pub(crate) fn poll(&mut self) -> FeedUpdate {
        let log = self.log.poll();
        let since = self.history.last().map(|r| r.step);
        let query = Command::Snapshot { since }.to_string();
        let live = self.connected().map(|c| c.request(&query));
        match live {
            Some(Ok(reply)) if reply.ok => {
                let parsed = reply
                    .data
                    .map(serde_json::from_value::<Snapshot>)
                    .and_then(Result::ok);
                if let Some(mut snap) = parsed {
                    self.merge(&mut snap);
                    return FeedUpdate {
                        snapshot: Some(snap),
                        offline: None,
                        log,
                    };
                }
            }
            Some(_) => self.client = None,
            None => {}
        }
        let (snapshot, why) = self.recorded();
        FeedUpdate {
            snapshot,
            offline: Some(why),
            log,
        }
    }

    /// Adds the new step records to those kept and gives the snapshot the whole history.
    fn merge(&mut self, snap: &mut Snapshot) {
        let new = std::mem::take(&mut snap.history);
        if let Some(first) = new.first() {
            // A run resumed from an earlier step replays steps: keep what it kept.
            self.history.retain(|r| r.step < first.step);
        }
        self.history.extend(new);
        let cut = self.history.len().saturating_sub(HISTORY);
        self.history.drain(..cut);
        snap.history = self.history.clone();
    }

    /// Sends a command to the trainer.
    pub(crate) fn send(&mut self, command: &Command) -> Result<String, String> {
        let words = command.to_string();
        // An operator's command tries the socket at once: the polls' back-off between
        // reconnections (a trainer starting, or a reply lost under load) must not turn a key
        // press into "no trainer runs".
        if self.client.is_none() {
            self.last_try = None;
        }
        let Some(client) = self.connected() else {
            return Err(format!("{command}: no trainer runs in this run directory"));
        };
        match client.request(&words) {
            Ok(reply) if reply.ok => Ok(reply.message),
            Ok(reply) => Err(reply.message),
            Err(e) => {
                self.client = None;
                Err(format!("{command}: {e:#}"))
            }
        }
    }

    /// The run as `metrics.jsonl` recorded it, and why that is what is shown.
    fn recorded(&mut self) -> (Option<Snapshot>, String) {
        let holder = RunLock::holder(&self.run_dir);
        let snap = recorded_snapshot(&self.run_dir, holder.is_some());
        if let Some(s) = &snap {
            self.history = s.history.clone();
        }
        let why = match (holder, snap.as_ref().map(|s| s.phase)) {
            (Some(pid), _) => format!(
                "trainer PID {pid} is starting or busy: its control socket does not answer yet"
            ),
            (None, Some(Phase::Finished)) => "the run has finished: its recorded history".into(),
            (None, Some(Phase::Stopped)) => "the run was stopped: its recorded history".into(),
            (None, Some(_)) => "no trainer runs: the run's recorded history".into(),
            (None, None) => format!(
                "{}: no trainer runs and nothing is recorded yet",
                self.run_dir.display()
            ),
        };
        (snap, why)
    }
}

/// A snapshot of the run from `metrics.jsonl` and `config.toml`: its charts, evaluations,
/// last profile and queues, and its summary when it has one. `running`: a trainer holds the
/// run (starting up), so no summary means it is still to come.
pub(crate) fn recorded_snapshot(run_dir: &Path, running: bool) -> Option<Snapshot> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).ok()?;
    let config = crate::config::load(&run_dir.join("config.toml"), &[]).ok();
    let mut snap = Snapshot {
        run_name: config
            .as_ref()
            .map_or_else(|| run_dir.display().to_string(), |c| c.run.name.clone()),
        run_dir: run_dir.display().to_string(),
        phase: if running {
            Phase::LoadingModel
        } else {
            Phase::Failed
        },
        step: 0,
        total_steps: config.as_ref().map_or(0, |c| c.train.total_steps),
        epoch: 0,
        elapsed_s: 0.0,
        eta_s: None,
        tokens_per_s: 0.0,
        samples_per_s: 0.0,
        last: None,
        history: Vec::new(),
        evals: Vec::new(),
        validations: Vec::new(),
        queues: Vec::new(),
        profile: None::<ProfileReport>,
        profile_interval_s: config
            .as_ref()
            .map_or(0.0, |c| c.telemetry.profile_interval_s),
        gpus: None,
        gpu_error: Some("not measured: no trainer runs".into()),
        host: None,
        stage_devices: Vec::new(),
        last_checkpoint: None,
        error: None,
    };
    let mut summary = false;
    for record in text
        .lines()
        .filter_map(|l| serde_json::from_str::<MetricsRecord>(l).ok())
    {
        match record {
            MetricsRecord::Step(r) => {
                snap.elapsed_s = snap.elapsed_s.max(r.elapsed_s);
                snap.history.push(r);
            }
            MetricsRecord::Eval(r) => snap.evals.push(r),
            MetricsRecord::Validation(r) => snap.validations.push(r),
            MetricsRecord::Queues { queues, .. } => snap.queues = queues,
            MetricsRecord::Profile(p) => snap.profile = Some(p),
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
                summary = true;
                snap.phase = phase;
                snap.step = steps;
                snap.elapsed_s = elapsed_s;
                snap.tokens_per_s = tokens_seen as f64 / elapsed_s.max(1e-9);
                snap.samples_per_s = samples_seen as f64 / elapsed_s.max(1e-9);
                snap.last_checkpoint = last_checkpoint;
                snap.error = error;
            }
            _ => {}
        }
    }
    let cut = snap.history.len().saturating_sub(HISTORY);
    snap.history.drain(..cut);
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
    Some(snap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_log_tail_gives_each_complete_line_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.log");
        let mut f = std::fs::File::create(&path).unwrap();
        writeln!(f, "10:00:00 I one").unwrap();
        let mut tail = LogTail::open(&path);
        assert_eq!(tail.poll(), vec!["10:00:00 I one".to_string()]);
        write!(f, "10:00:01 W tw").unwrap();
        assert!(tail.poll().is_empty(), "half a line waits");
        writeln!(f, "o\n10:00:02 I three").unwrap();
        assert_eq!(tail.poll(), vec!["10:00:01 W two", "10:00:02 I three"]);
        assert!(tail.poll().is_empty());
        // several lines after a read that ended at a line's end: none is lost
        writeln!(f, "10:00:03 I paused at step 6\n10:00:04 I \nProfileStats").unwrap();
        assert_eq!(
            tail.poll(),
            vec!["10:00:03 I paused at step 6", "10:00:04 I ", "ProfileStats"]
        );
    }

    #[test]
    fn a_long_log_is_read_from_its_last_complete_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.log");
        let mut f = std::fs::File::create(&path).unwrap();
        let line = |i: usize| format!("10:00:00 I line {i} {}", "x".repeat(i % 97));
        let n = 3000;
        for i in 0..n {
            writeln!(f, "{}", line(i)).unwrap();
        }
        assert!(std::fs::metadata(&path).unwrap().len() > LOG_BACKLOG_BYTES);
        let mut tail = LogTail::open(&path);
        let lines = tail.poll();
        assert!(lines.len() > 100 && lines.len() < n, "{}", lines.len());
        // the first line read is a whole one (the fragment before it is dropped), the rest follow
        let first = n - lines.len();
        let expected: Vec<String> = (first..n).map(line).collect();
        assert_eq!(lines, expected);
        writeln!(f, "10:00:01 I after\n10:00:02 I and after").unwrap();
        assert_eq!(
            tail.poll(),
            vec!["10:00:01 I after", "10:00:02 I and after"]
        );
    }

    #[test]
    fn a_finished_run_is_read_from_its_records() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        assert_eq!(
            recorded_snapshot(dir.path(), true).unwrap().phase,
            Phase::LoadingModel
        );
        let step = |s: u64| {
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
        };
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
