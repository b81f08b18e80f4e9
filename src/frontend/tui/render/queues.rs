//! The queue panel: each queue's level as a gauge; the selected one is the one +/- resize.

use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, LineGauge, Paragraph};
use ratatui::Frame;

use super::{dim, BAR_EMPTY, BAR_FULL};
use crate::pipeline::queue::QueueLevel;
use crate::telemetry::queues::queue_state;

pub(super) fn render_queues(frame: &mut Frame, area: Rect, queues: &[QueueLevel], selected: usize) {
    let block = Block::bordered()
        .title(" Queues ")
        .title_bottom(Line::from(" Tab/[ ] select  +/- depth ").right_aligned());
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if queues.is_empty() {
        frame.render_widget(Paragraph::new(Span::styled("no queues yet", dim())), inner);
        return;
    }
    let name_w = queues
        .iter()
        .map(|q| q.name.as_str().chars().count())
        .max()
        .unwrap_or(0);
    let num_w = queues
        .iter()
        .map(|q| q.capacity.max(q.len).to_string().len())
        .max()
        .unwrap_or(1);
    let selected = selected.min(queues.len() - 1);
    // Keep the selected queue visible when not all fit.
    let rows = inner.height as usize;
    let first = if selected >= rows {
        selected + 1 - rows
    } else {
        0
    };
    for (row, (i, q)) in queues.iter().enumerate().skip(first).take(rows).enumerate() {
        // A queue's level says something once data flows through it.
        let (word, color) = match queue_state(q) {
            None => ("no data", Color::DarkGray),
            Some("empty") => ("empty", Color::Yellow),
            Some("full") => ("full", Color::Magenta),
            Some(other) => (other, Color::Green),
        };
        let is_sel = i == selected;
        let line_area = Rect::new(inner.x, inner.y + row as u16, inner.width, 1);
        let label_style = if is_sel {
            Style::new().add_modifier(Modifier::BOLD | Modifier::REVERSED)
        } else {
            Style::new()
        };
        let label = Line::from(vec![
            Span::styled(if is_sel { ">" } else { " " }, Style::new().bold()),
            Span::styled(format!("{:<name_w$}", q.name), label_style),
            Span::raw(format!(" {:>num_w$}/{:<num_w$}", q.len, q.capacity)),
        ]);
        let label_w = label.width() as u16;
        let word_w: u16 = if inner.width >= label_w + 1 + 6 + 9 {
            9
        } else {
            0
        };
        let [gauge_area, word_area] =
            Layout::horizontal([Constraint::Min(0), Constraint::Length(word_w)]).areas(line_area);
        frame.render_widget(
            LineGauge::default()
                .ratio(q.fill().clamp(0.0, 1.0))
                .label(label)
                .filled_symbol(BAR_FULL)
                .unfilled_symbol(BAR_EMPTY)
                .filled_style(Style::new().fg(color))
                .unfilled_style(dim()),
            gauge_area,
        );
        if word_w > 0 {
            frame.render_widget(
                Paragraph::new(Span::styled(word, Style::new().fg(color)))
                    .alignment(Alignment::Right),
                word_area,
            );
        }
    }
}
