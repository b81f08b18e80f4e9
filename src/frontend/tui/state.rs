//! The control room's state: everything the screen shows, derived from the trainer's
//! telemetry snapshot plus the operator's view settings. Rendering reads it; `update` changes
//! it.

use crate::telemetry::profile::TABLE_TITLE as PROFILE_TABLE_TITLE;
use crate::telemetry::records::{Snapshot, VERDICT_PREFIX};

/// Chart windows (last N steps; `None` = whole run), cycled with `z` / `x`.
pub(crate) const ZOOM_LEVELS: [Option<usize>; 4] = [None, Some(2000), Some(500), Some(100)];

/// What has the keyboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Normal,
    /// `?` help overlay.
    Help,
    /// `:` command line with what was typed so far.
    CommandLine(String),
    /// `:status`: the run's status (what `ctl status` answers) over the screen, kept up to
    /// date; any key closes it.
    Status,
    /// `q`: the choice under the cursor (a read-only viewer leaves at once instead).
    QuitDialog {
        selected: QuitChoice,
    },
    /// The run has ended; any key leaves.
    Ended,
}

/// A choice of the quit dialog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuitChoice {
    CheckpointAndStop,
    StopNow,
    /// Close the screen; the run goes on.
    Leave,
    Cancel,
}

impl QuitChoice {
    /// The choices in the order the dialog lists them.
    pub const ALL: [QuitChoice; 4] = [
        QuitChoice::CheckpointAndStop,
        QuitChoice::StopNow,
        QuitChoice::Leave,
        QuitChoice::Cancel,
    ];

    pub fn label(self) -> &'static str {
        match self {
            QuitChoice::CheckpointAndStop => "checkpoint and stop",
            QuitChoice::StopNow => "stop now",
            QuitChoice::Leave => "leave (the run goes on)",
            QuitChoice::Cancel => "cancel",
        }
    }

    /// The choice below, wrapping around.
    pub fn next(self) -> QuitChoice {
        QuitChoice::ALL[(self as usize + 1) % QuitChoice::ALL.len()]
    }

    /// The choice above, wrapping around.
    pub fn previous(self) -> QuitChoice {
        let n = QuitChoice::ALL.len();
        QuitChoice::ALL[(self as usize + n - 1) % n]
    }
}

/// Log lines the logs pane keeps.
pub(crate) const LOG_LINES: usize = 300;

/// Whose screen this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Viewer {
    /// The screen of `train` itself.
    Trainer,
    /// `attach`: another process's screen on the run; leaving it never stops the run.
    Attached { read_only: bool },
}

/// The control room's state.
#[derive(Debug, Clone, PartialEq)]
pub struct AppState {
    pub snapshot: Snapshot,
    /// Index into `snapshot.queues` of the queue `+` / `-` resize.
    pub selected_queue: usize,
    /// Index into [`ZOOM_LEVELS`].
    pub zoom: usize,
    pub mode: Mode,
    /// The last command reply shown in the status bar, and whether it was an error.
    pub status: Option<(String, bool)>,
    /// Set when the front end should exit.
    pub quit: bool,
    pub viewer: Viewer,
    /// The newest lines of the run's log (train.log), oldest first.
    pub log: Vec<String>,
    /// Whether the newest log lines are the rows of a ProfileStats table (see [`Self::push_log`]).
    log_in_profile_table: bool,
    /// Why the run's live state is not shown, when it is not (e.g. the trainer is gone and
    /// the screen shows what metrics.jsonl recorded).
    pub offline: Option<String>,
}

impl AppState {
    pub fn new(snapshot: Snapshot) -> Self {
        AppState {
            snapshot,
            selected_queue: 0,
            zoom: 0,
            mode: Mode::Normal,
            status: None,
            quit: false,
            viewer: Viewer::Trainer,
            log: Vec::new(),
            log_in_profile_table: false,
            offline: None,
        }
    }

    /// Appends log lines, keeping the newest [`LOG_LINES`]. A ProfileStats table in the log
    /// keeps its title and its bottleneck verdict only: its rows are what the ProfileStats
    /// panel shows, and a table every profile interval would push the run's events out of the
    /// pane within seconds. Lines may come in any batches (a table cut between two polls).
    pub(crate) fn push_log(&mut self, lines: impl IntoIterator<Item = String>) {
        for line in lines {
            if let Some(message) = log_record_message(&line) {
                self.log_in_profile_table = message.starts_with(PROFILE_TABLE_TITLE);
                self.log.push(line);
            } else if line.starts_with(PROFILE_TABLE_TITLE) {
                // logged as "\n" + table: the title joins its record's empty first line
                self.log_in_profile_table = true;
                match self.log.last_mut() {
                    Some(last) if log_record_message(last) == Some("") => last.push_str(&line),
                    _ => self.log.push(line),
                }
            } else if !self.log_in_profile_table || line.starts_with(VERDICT_PREFIX) {
                self.log.push(line);
            }
        }
        let cut = self.log.len().saturating_sub(LOG_LINES);
        self.log.drain(..cut);
    }

    pub(crate) fn read_only(&self) -> bool {
        matches!(self.viewer, Viewer::Attached { read_only: true })
    }

    /// The steps the charts show.
    pub(crate) fn chart_window(&self) -> &[crate::telemetry::records::StepRecord] {
        let h = &self.snapshot.history;
        match ZOOM_LEVELS[self.zoom.min(ZOOM_LEVELS.len() - 1)] {
            Some(n) if h.len() > n => &h[h.len() - n..],
            _ => h,
        }
    }
}

/// The message of a log record's first line ("HH:MM:SS L message"); `None` for the further
/// lines of a record of several lines.
fn log_record_message(line: &str) -> Option<&str> {
    let b = line.as_bytes();
    let stamped = b.len() >= 11
        && b[..8].iter().enumerate().all(|(i, c)| {
            if i % 3 == 2 {
                *c == b':'
            } else {
                c.is_ascii_digit()
            }
        })
        && b[8] == b' '
        && b[9].is_ascii_uppercase()
        && b[10] == b' ';
    stamped.then(|| &line[11..])
}
