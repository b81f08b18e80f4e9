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
        Phase::Training => Style::new().fg(Color::Green).bold(),
        Phase::Checkpointing | Phase::Stopping => Style::new().fg(Color::Magenta).bold(),
        Phase::Evaluating | Phase::Validating => Style::new().fg(Color::Yellow).bold(),
        Phase::LoadingModel | Phase::WarmingUp => Style::new().fg(Color::Cyan).bold(),
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
    let ended = matches!(snap.phase, Phase::Finished | Phase::Failed);
    let (clock, rate_label) = if ended {
        (format!(" took {}", fmt_duration(snap.elapsed_s)), "avg ")
    } else {
        let eta = snap.eta_s.map(fmt_duration).unwrap_or_else(|| "-".into());
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
