//! Overlays drawn over the screen: help, the quit dialog and the end of the run.

use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::{Line, Span, Text};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};
use ratatui::Frame;

use super::dim;
use super::format::fmt_duration;
use crate::frontend::tui::state::QuitChoice;
use crate::telemetry::records::{Phase, RunStatus, Snapshot};

/// A rectangle of at most `width` x `height`, centred in `area`.
fn centered(area: Rect, width: u16, height: u16) -> Rect {
    let w = width.min(area.width);
    let h = height.min(area.height);
    Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    )
}

fn popup(frame: &mut Frame, area: Rect, width: u16, height: u16, title: Line<'static>) -> Rect {
    let rect = centered(area, width, height);
    frame.render_widget(Clear, rect);
    let block = Block::bordered()
        .title(title)
        .border_style(Style::new().fg(Color::Cyan))
        .style(Style::new());
    let inner = block.inner(rect);
    frame.render_widget(block, rect);
    inner
}

pub(super) fn render_help(frame: &mut Frame, area: Rect) {
    let key = |k: &'static str, what: &'static str| {
        Line::from(vec![
            Span::raw("  "),
            Span::styled(format!("{k:<9}"), Style::new().fg(Color::Yellow).bold()),
            Span::raw(" "),
            Span::raw(what),
        ])
    };
    let cmd = |c: &'static str, what: &'static str| {
        Line::from(vec![
            Span::raw("  :"),
            Span::styled(format!("{c:<17}"), Style::new().fg(Color::Yellow).bold()),
            Span::raw(" "),
            Span::raw(what),
        ])
    };
    let heading = |s: &'static str| Line::from(Span::styled(s, Style::new().bold().underlined()));
    let lines = vec![
        heading("Keys"),
        key("p", "pause / resume the run"),
        key("c", "write a checkpoint at the next step"),
        key("Tab ]", "select the next queue"),
        key("[", "select the previous queue"),
        key("+ -", "grow / shrink the selected queue"),
        key("i", "change the profile report interval"),
        key(":", "open the command line"),
        key("z x", "zoom the charts in / out"),
        key("?", "this help"),
        key("q", "quit (checkpoint and stop / stop / cancel)"),
        Line::raw(""),
        heading("Commands (type : first)"),
        cmd("pause", "stop taking new work"),
        cmd("resume", "continue"),
        cmd("queue NAME DEPTH", "set a queue's capacity (>= 1)"),
        cmd("checkpoint", "checkpoint at the next step"),
        cmd("profile SECONDS", "report interval (0 = off)"),
        cmd("stop", "checkpoint, drain and exit"),
        cmd("status", "the run's status (as ctl status)"),
        Line::raw(""),
        Line::from(Span::styled("Esc or ? closes this help", dim())),
    ];
    let width = lines.iter().map(|l| l.width()).max().unwrap_or(40) as u16 + 4;
    let inner = popup(
        frame,
        area,
        width,
        lines.len() as u16 + 2,
        Line::from(" Help ").bold(),
    );
    frame.render_widget(
        Paragraph::new(lines).block(Block::new().padding(ratatui::widgets::Padding::horizontal(1))),
        inner,
    );
}

pub(super) fn render_quit_dialog(frame: &mut Frame, area: Rect, selected: QuitChoice) {
    let mut lines = vec![Line::raw("")];
    for choice in QuitChoice::ALL {
        let choice_label = choice.label();
        if choice == selected {
            lines.push(
                Line::from(Span::styled(
                    format!("> {choice_label} <"),
                    Style::new().add_modifier(Modifier::REVERSED | Modifier::BOLD),
                ))
                .centered(),
            );
        } else {
            lines.push(Line::from(format!("  {choice_label}  ")).centered());
        }
    }
    lines.push(Line::raw(""));
    lines.push(Line::from(Span::styled("↑/↓ choose  Enter confirm  Esc cancel", dim())).centered());
    let inner = popup(
        frame,
        area,
        44,
        lines.len() as u16 + 2,
        Line::from(" Quit? ").bold(),
    );
    frame.render_widget(Paragraph::new(lines), inner);
}

pub(super) fn render_ended(frame: &mut Frame, area: Rect, snap: &Snapshot) {
    let failed = snap.error.is_some() || snap.phase == Phase::Failed;
    let (headline, style) = if failed {
        let what = match &snap.error {
            Some(e) => format!("run failed: {e}"),
            None => "run failed".to_string(),
        };
        (what, Style::new().fg(Color::Red).bold())
    } else if snap.phase == Phase::Stopped {
        (
            format!("run stopped at step {} of {}", snap.step, snap.total_steps),
            Style::new().fg(Color::Cyan).bold(),
        )
    } else {
        (
            "run finished".to_string(),
            Style::new().fg(Color::Green).bold(),
        )
    };
    let lines = vec![
        Line::from(Span::styled(headline, style)),
        Line::raw(""),
        Line::from(format!(
            "step {} / {}, elapsed {}",
            snap.step,
            snap.total_steps,
            fmt_duration(snap.elapsed_s)
        )),
        Line::from(format!(
            "last checkpoint: {}",
            snap.last_checkpoint.as_deref().unwrap_or("none")
        )),
        Line::raw(""),
        Line::from(Span::styled("press any key", Style::new().bold())),
    ];
    let width = (area.width.saturating_sub(4)).min(72);
    let text = Text::from(lines);
    let inner_w = width.saturating_sub(4).max(1) as usize;
    let height: usize = text
        .lines
        .iter()
        .map(|l| l.width().div_ceil(inner_w).max(1))
        .sum();
    let title = if failed {
        " Run failed "
    } else {
        " Run ended "
    };
    let inner = popup(
        frame,
        area,
        width,
        height as u16 + 2,
        Line::from(title).bold(),
    );
    frame.render_widget(
        Paragraph::new(text)
            .wrap(Wrap { trim: false })
            .block(Block::new().padding(ratatui::widgets::Padding::horizontal(1))),
        inner,
    );
}

/// `:status`: what `ctl status` answers, as labelled lines (long values wrap).
pub(super) fn render_status(frame: &mut Frame, area: Rect, snap: &Snapshot) {
    let summary = RunStatus::new(snap, None).summary();
    let label_w = summary.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let mut lines: Vec<Line> = summary
        .into_iter()
        .map(|(label, value)| {
            Line::from(vec![
                Span::styled(format!("{label:<label_w$}  "), Style::new().bold()),
                Span::raw(value),
            ])
        })
        .collect();
    lines.push(Line::raw(""));
    lines.push(Line::from(Span::styled("any key closes", dim())));
    let width = area.width.saturating_sub(4).min(100);
    let inner_w = width.saturating_sub(4).max(1) as usize;
    let height: usize = lines
        .iter()
        .map(|l| l.width().div_ceil(inner_w).max(1))
        .sum();
    let inner = popup(
        frame,
        area,
        width,
        height as u16 + 2,
        Line::from(" Status ").bold(),
    );
    frame.render_widget(
        Paragraph::new(Text::from(lines))
            .wrap(Wrap { trim: false })
            .block(Block::new().padding(ratatui::widgets::Padding::horizontal(1))),
        inner,
    );
}
