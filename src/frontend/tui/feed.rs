//! What a screen shows of a run, from outside the trainer: its state through the control
//! socket (the step records arrive once each: a poll asks for those after the newest it has),
//! its log from `train.log`, and, when no trainer serves the run (finished, killed, not started
//! yet), what `metrics.jsonl` recorded. The trainer's own screen and `attach` both read a run
//! this way.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::recorded::{RecordedRun, HISTORY};
use crate::frontend::socket::{ControlClient, NoAnswer, SOCKET_NAME};
use crate::pipeline::command::Command;
use crate::telemetry::records::{Phase, Snapshot, StepRecord};
use crate::train::run_lock::RunLock;
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
    recorded: RecordedRun,
    /// Whether the screen shows the records as they are now (and whether a trainer held the
    /// run then): a poll sends a recorded snapshot only when it would differ.
    recorded_shown: Option<bool>,
    /// The phase of the records as last shown (None: there are none).
    recorded_phase: Option<Phase>,
    /// The trainer took a request and did not answer it in time (the last time it was asked).
    silent: Option<NoAnswer>,
    /// Bad lines of the records already reported to the log pane.
    bad_reported: u64,
}

/// One look at the run.
pub(crate) struct FeedUpdate {
    /// None: nothing new since the last look.
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
            recorded: RecordedRun::new(run_dir),
            recorded_shown: None,
            recorded_phase: None,
            silent: None,
            bad_reported: 0,
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
        let mut log = self.log.poll();
        let since = self.history.last().map(|r| r.step);
        let query = Command::Snapshot { since }.to_string();
        let live = self.connected().map(|c| c.request(&query));
        match live {
            Some(Ok(reply)) if reply.ok => {
                self.silent = None;
                let parsed = reply
                    .data
                    .map(serde_json::from_value::<Snapshot>)
                    .and_then(Result::ok);
                if let Some(mut snap) = parsed {
                    self.merge(&mut snap);
                    self.recorded_shown = None;
                    return FeedUpdate {
                        snapshot: Some(snap),
                        offline: None,
                        log,
                    };
                }
            }
            Some(Err(e)) => {
                self.silent = e.downcast::<NoAnswer>().ok();
                self.client = None;
            }
            Some(Ok(_)) => self.client = None,
            // (a trainer that is gone is no longer silent)
            None if !self.run_dir.join(SOCKET_NAME).exists() => self.silent = None,
            None => {}
        }
        let (snapshot, why) = self.recorded();
        log.extend(self.bad_lines_news());
        FeedUpdate {
            snapshot,
            offline: Some(why),
            log,
        }
    }

    /// A line for the log pane when more lines of the records were found unreadable.
    fn bad_lines_news(&mut self) -> Option<String> {
        let bad = self.recorded.bad_lines();
        if bad.count <= self.bad_reported {
            return None;
        }
        self.bad_reported = bad.count;
        Some(format!("attach: metrics.jsonl: {}", bad.describe()?))
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

    /// The run as `metrics.jsonl` recorded it (None when the screen shows that already), and
    /// why that is what is shown.
    fn recorded(&mut self) -> (Option<Snapshot>, String) {
        let holder = RunLock::holder(&self.run_dir);
        let running = holder.is_some();
        let changed = self.recorded.read_new();
        let mut snap = None;
        if changed || self.recorded_shown != Some(running) {
            snap = self.recorded.snapshot(running);
            self.recorded_phase = snap.as_ref().map(|s| s.phase);
            self.recorded_shown = Some(running);
            if let Some(s) = &snap {
                self.history = s.history.clone();
            }
        }
        let mut why = match (holder, self.recorded_phase) {
            (Some(pid), _) => match &self.silent {
                Some(silent) => format!("trainer PID {pid}: {silent}"),
                None => format!(
                    "trainer PID {pid} is starting or busy: its control socket does not answer yet"
                ),
            },
            (None, _) if self.silent.is_some() => self
                .silent
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            (None, Some(Phase::Finished)) => "the run has finished: its recorded history".into(),
            (None, Some(Phase::Stopped)) => "the run was stopped: its recorded history".into(),
            (None, Some(_)) => "no trainer runs: the run's recorded history".into(),
            (None, None) => format!(
                "{}: no trainer runs and nothing is recorded yet",
                self.run_dir.display()
            ),
        };
        if let Some(bad) = self.recorded.bad_lines().describe() {
            why = format!("{why} (metrics.jsonl: {bad})");
        }
        (snap, why)
    }
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
}
