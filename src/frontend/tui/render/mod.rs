//! The pure render of the control room (control-room spec §4): draws the whole screen from an
//! [`AppState`] only: no I/O, no clocks, no global state (the logs pane shows the run log's
//! lines the state holds).
//!
//! Layout, top to bottom: header (2 lines), a red error line when the run failed, GPUs, the
//! ranks of a multi-process run (with two or more), queues beside the ProfileStats table, charts beside the logs, and the status bar. Overlays
//! (help, quit dialog, end of run) are drawn on top. Below [`MIN_WIDTH`] x [`MIN_HEIGHT`] only a
//! "terminal too small" message is drawn.

mod charts;
mod format;
mod gpus;
mod header;
mod logs;
mod overlays;
mod profile;
mod queues;
mod ranks;
mod status_bar;

use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;

use crate::frontend::tui::state::{AppState, Mode};

pub use charts::{downsample, EMPTY_CHARTS, NO_TAU};
pub use format::{fmt_duration, fmt_si, fmt_value};
pub use gpus::COMPACT_GPUS;

use charts::render_charts;
use gpus::{gpu_panel_height, render_gpus};
use header::render_header;
use logs::render_logs;
use overlays::{render_ended, render_help, render_quit_dialog, render_status};
use profile::render_profile;
use queues::render_queues;
use ranks::{ranks_panel_height, render_ranks};
use status_bar::render_status_bar;

/// The smallest terminal the layout is drawn in.
pub(crate) const MIN_WIDTH: u16 = 80;
/// The smallest terminal the layout is drawn in.
pub(crate) const MIN_HEIGHT: u16 = 24;

// Bars drawn in text (GPUs) and in gauges (process, queues) look the same.
const BAR_FULL: &str = "█";
const BAR_EMPTY: &str = "░";

/// Draws the whole control room from `state`.
pub fn render(frame: &mut Frame, state: &AppState) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        render_too_small(frame, area);
        return;
    }
    let snap = &state.snapshot;
    let error_h = u16::from(snap.error.is_some());
    let [header, error, body, status] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(error_h),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(area);

    render_header(frame, header, state);
    if let Some(e) = &snap.error {
        let line = Line::from(vec![
            Span::styled(
                " ERROR ",
                Style::new().fg(Color::White).bg(Color::Red).bold(),
            ),
            Span::styled(format!(" {e}"), Style::new().fg(Color::Red).bold()),
        ]);
        frame.render_widget(Paragraph::new(line), error);
    }
    render_body(frame, body, state);
    render_status_bar(frame, status, state);

    match &state.mode {
        Mode::Normal | Mode::CommandLine(_) => {}
        Mode::Help => render_help(frame, area),
        Mode::Status => render_status(frame, area, snap),
        Mode::QuitDialog { selected } => render_quit_dialog(frame, area, *selected),
        Mode::Ended => render_ended(frame, area, snap),
    }
}

/// Secondary text: hints, empty panels, axes.
fn dim() -> Style {
    Style::new().fg(Color::DarkGray)
}

fn render_too_small(frame: &mut Frame, area: Rect) {
    let msg = format!(
        "terminal too small: {}x{}, need at least {MIN_WIDTH}x{MIN_HEIGHT}",
        area.width, area.height
    );
    let width = area.width.max(1) as usize;
    let lines = msg.chars().count().div_ceil(width).max(1) as u16;
    let y = area.y + area.height.saturating_sub(lines) / 2;
    let rect = Rect::new(area.x, y, area.width, lines.min(area.height));
    frame.render_widget(
        Paragraph::new(msg)
            .style(Style::new().fg(Color::Yellow).bold())
            .alignment(Alignment::Center)
            .wrap(Wrap { trim: true }),
        rect,
    );
}

fn render_body(frame: &mut Frame, area: Rect, state: &AppState) {
    let snap = &state.snapshot;
    let gpu_h = gpu_panel_height(snap, area);
    let ranks_h = ranks_panel_height(snap, area);
    let rest = area.height.saturating_sub(gpu_h + ranks_h);
    let queue_h = snap.queues.len().max(1) as u16 + 2;
    let profile_h = match &snap.profile {
        // the rows, the waits' label, the verdict, the column titles and the border
        Some(p) if !p.rows.is_empty() => p.rows.len() as u16 + 5,
        _ => 3,
    };
    let mid_h = queue_h.max(profile_h).min((rest * 2 / 5).max(4));
    let [gpus, ranks, mid, bottom] = Layout::vertical([
        Constraint::Length(gpu_h),
        Constraint::Length(ranks_h),
        Constraint::Length(mid_h),
        Constraint::Min(0),
    ])
    .areas(area);

    render_gpus(frame, gpus, snap);
    render_ranks(frame, ranks, snap);

    let queue_w = if mid.width >= 110 {
        44
    } else {
        (mid.width * 2 / 5).max(30)
    };
    let [queues, profile] =
        Layout::horizontal([Constraint::Length(queue_w), Constraint::Min(0)]).areas(mid);
    render_queues(frame, queues, &snap.queues, state.selected_queue);
    let verdict = snap.verdict();
    render_profile(
        frame,
        profile,
        snap.profile.as_ref(),
        snap.profile_interval_s,
        verdict.as_deref(),
    );

    let [charts, logs] =
        Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(bottom);
    render_charts(
        frame,
        charts,
        state.chart_window(),
        &snap.evals,
        &snap.validations,
    );
    render_logs(frame, logs, &state.log);
}
