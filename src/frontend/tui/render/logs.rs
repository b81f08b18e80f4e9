//! The log pane: the newest lines of the run log.

use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::dim;
use super::format::truncate;

/// The newest log lines that fit, each cut to the pane's width (a long line would wrap over
/// several rows and push the rest out), coloured by level.
pub(super) fn render_logs(frame: &mut Frame, area: Rect, log: &[String]) {
    let block = Block::bordered().title(" Logs ");
    let inner = block.inner(area);
    let width = inner.width as usize;
    let rows = inner.height as usize;
    let lines: Vec<Line> = log[log.len().saturating_sub(rows)..]
        .iter()
        .map(|l| {
            let style = match l.split(' ').nth(1) {
                Some("E") => Style::new().fg(Color::Red),
                Some("W") => Style::new().fg(Color::Yellow),
                Some("D" | "T") => dim(),
                _ => Style::new(),
            };
            Line::from(Span::styled(truncate(l, width), style))
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(block), area);
}
