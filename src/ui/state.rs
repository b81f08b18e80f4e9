//! The control room's state: everything the screen shows, derived from the trainer's
//! telemetry snapshot plus the operator's view settings. Rendering reads it; `update` changes
//! it.

use crate::telemetry::records::Snapshot;

/// Chart windows (last N steps; `None` = whole run), cycled with `z` / `x`.
pub const ZOOM_LEVELS: [Option<usize>; 4] = [None, Some(2000), Some(500), Some(100)];

/// What has the keyboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Normal,
    /// `?` help overlay.
    Help,
    /// `:` command line with what was typed so far.
    CommandLine(String),
    /// `q`: 0 = checkpoint and stop, 1 = stop, 2 = cancel.
    QuitDialog {
        selected: usize,
    },
    /// The run has ended; any key leaves.
    Ended,
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
        }
    }

    /// The steps the charts show.
    pub fn chart_window(&self) -> &[crate::telemetry::records::StepRecord] {
        let h = &self.snapshot.history;
        match ZOOM_LEVELS[self.zoom.min(ZOOM_LEVELS.len() - 1)] {
            Some(n) if h.len() > n => &h[h.len() - n..],
            _ => h,
        }
    }
}
