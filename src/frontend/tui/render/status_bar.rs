//! The status bar: the keys, a command's reply, the `:` line, or why the run is out of reach.

use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::dim;
use super::format::truncate;
use crate::frontend::tui::state::{AppState, Mode, Viewer};

fn key_style() -> Style {
    Style::new().fg(Color::Black).bg(Color::Gray).bold()
}

const KEYS_LONG: [(&str, &str); 10] = [
    ("p", "pause/resume"),
    ("c", "checkpoint"),
    ("Tab/[ ]", "queue"),
    ("+/-", "depth"),
    ("i", "profile"),
    (":", "command"),
    ("z/x", "zoom"),
    ("?", "help"),
    ("q", "quit"),
    ("", ""),
];

const KEYS_SHORT: [(&str, &str); 10] = [
    ("p", "pause"),
    ("c", "ckpt"),
    ("Tab/[]", "queue"),
    ("+/-", "depth"),
    ("i", "prof"),
    (":", "cmd"),
    ("z/x", "zoom"),
    ("?", "help"),
    ("q", "quit"),
    ("", ""),
];

fn key_spans(keys: &[(&'static str, &'static str)], gap: &'static str) -> Vec<Span<'static>> {
    let mut spans = Vec::new();
    for (i, (k, what)) in keys.iter().filter(|(k, _)| !k.is_empty()).enumerate() {
        if i > 0 {
            spans.push(Span::raw(gap));
        }
        spans.push(Span::styled(*k, key_style()));
        spans.push(Span::raw(format!(" {what}")));
    }
    spans
}

fn spans_width(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.width()).sum()
}

pub(super) fn render_status_bar(frame: &mut Frame, area: Rect, state: &AppState) {
    if let Mode::CommandLine(text) = &state.mode {
        let hint = Span::styled("Enter run  Esc cancel", dim());
        let line = Line::from(vec![Span::raw(":"), Span::raw(text.clone())]);
        let [left, right] = Layout::horizontal([
            Constraint::Min(0),
            Constraint::Length(hint.width() as u16 + 1),
        ])
        .areas(area);
        frame.render_widget(Paragraph::new(line), left);
        frame.render_widget(Paragraph::new(hint).alignment(Alignment::Right), right);
        let x = area.x + (1 + text.chars().count() as u16).min(area.width.saturating_sub(1));
        frame.set_cursor_position((x, area.y));
        return;
    }
    let width = area.width as usize;
    if state.mode == Mode::Ended {
        let line = Line::from(vec![
            Span::styled("run ended", Style::new().bold()),
            Span::raw(" - press any key to leave"),
        ]);
        frame.render_widget(Paragraph::new(line), area);
        return;
    }
    if let (Some(why), None) = (&state.offline, &state.status) {
        let line = Span::styled(truncate(why, width), Style::new().fg(Color::Yellow).bold());
        frame.render_widget(Paragraph::new(line), area);
        return;
    }
    if state.viewer == (Viewer::Attached { read_only: true }) && state.status.is_none() {
        let mut spans = vec![Span::styled("read-only  ", Style::new().bold())];
        spans.extend(key_spans(
            &[("z/x", "zoom"), ("?", "help"), ("q", "leave")],
            "  ",
        ));
        frame.render_widget(Paragraph::new(Line::from(spans)), area);
        return;
    }
    if let Some((msg, is_error)) = &state.status {
        let style = if *is_error {
            Style::new().fg(Color::Red).bold()
        } else {
            Style::new().fg(Color::Green)
        };
        let tail = key_spans(&[("?", "help"), ("q", "quit")], "  ");
        let tail_w = spans_width(&tail);
        let msg_w = width.saturating_sub(tail_w + 2).max(1);
        let mut spans = vec![Span::styled(truncate(msg, msg_w), style)];
        let used = spans_width(&spans);
        if used + 2 + tail_w <= width {
            spans.push(Span::raw(" ".repeat(width - used - tail_w)));
            spans.extend(tail);
        }
        frame.render_widget(Paragraph::new(Line::from(spans)), area);
        return;
    }
    let mut spans = key_spans(&KEYS_LONG, "  ");
    if spans_width(&spans) > width {
        spans = key_spans(&KEYS_SHORT, " ");
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}
