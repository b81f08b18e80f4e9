//! The header: run name, phase, epoch and step; the clock, rates and chart zoom.

use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::dim;
use super::format::{fmt_duration, fmt_si};
use crate::frontend::tui::state::{AppState, ZOOM_LEVELS};
use crate::telemetry::records::Phase;

fn phase_style(phase: Phase) -> Style {
    match phase {
        Phase::Paused => Style::new().fg(Color::Black).bg(Color::Yellow).bold(),
        Phase::Failed => Style::new().fg(Color::White).bg(Color::Red).bold(),
        Phase::Finished => Style::new().fg(Color::Black).bg(Color::Green).bold(),
        Phase::Stopped => Style::new().fg(Color::Black).bg(Color::Cyan).bold(),
        Phase::Training => Style::new().fg(Color::Green).bold(),
        Phase::Checkpointing | Phase::Stopping => Style::new().fg(Color::Magenta).bold(),
        Phase::Evaluating | Phase::Validating => Style::new().fg(Color::Yellow).bold(),
        Phase::LoadingModel | Phase::WarmingUp => Style::new().fg(Color::Cyan).bold(),
    }
}

/// The ETA as the header shows it: while paused it waits (the time still to train, which
/// does not grow during the pause).
fn eta_text(phase: Phase, eta_s: Option<f64>) -> String {
    match (phase, eta_s) {
        (Phase::Paused, Some(eta)) => format!("{} (paused)", fmt_duration(eta)),
        (Phase::Paused, None) => "paused".into(),
        (_, Some(eta)) => fmt_duration(eta),
        (_, None) => "-".into(),
    }
}

pub(super) fn render_header(frame: &mut Frame, area: Rect, state: &AppState) {
    let snap = &state.snapshot;
    let sep = || Span::styled(" │ ", dim());
    let pct = if snap.total_steps > 0 {
        format!(
            " ({:.0}%)",
            100.0 * snap.step as f64 / snap.total_steps as f64
        )
    } else {
        String::new()
    };
    let line1 = Line::from(vec![
        Span::styled(format!(" {} ", snap.run_name), Style::new().bold()),
        Span::styled(format!(" {} ", snap.phase), phase_style(snap.phase)),
        sep(),
        Span::raw(format!("epoch {}", snap.epoch)),
        sep(),
        Span::raw(format!("step {} / {}{pct}", snap.step, snap.total_steps)),
    ]);
    let zoom = match ZOOM_LEVELS[state.zoom.min(ZOOM_LEVELS.len() - 1)] {
        None => "all steps".to_string(),
        Some(n) => format!("last {n} steps"),
    };
    // Live: rates over the last 30 s and the ETA at that pace; ended: the run's averages.
    let (clock, rate_label) = if snap.phase.is_ended() {
        (format!(" took {}", fmt_duration(snap.elapsed_s)), "avg ")
    } else {
        let eta = eta_text(snap.phase, snap.eta_s);
        (
            format!(" elapsed {} │ ETA {eta}", fmt_duration(snap.elapsed_s)),
            "",
        )
    };
    let mut spans = vec![
        Span::raw(clock),
        sep(),
        Span::styled(
            format!("{rate_label}{} tok/s", fmt_si(snap.tokens_per_s)),
            Style::new().fg(Color::Cyan).bold(),
        ),
        sep(),
        Span::raw(format!("{} samples/s", fmt_si(snap.samples_per_s))),
    ];
    let used: usize = spans.iter().map(|s| s.width()).sum();
    let charts = format!("charts: {zoom}");
    if used + 3 + charts.len() <= area.width as usize {
        spans.push(sep());
        spans.push(Span::styled(charts, dim()));
    }
    frame.render_widget(Paragraph::new(vec![line1, Line::from(spans)]), area);
}
