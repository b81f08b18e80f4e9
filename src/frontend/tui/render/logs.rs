//! The log pane: the newest lines of the run log, wrapped to the pane's width.

use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::dim;
use super::format::truncate;

/// Rows after a log line's first are indented by this much (a 46-column pane cut every line).
const CONTINUATION: &str = "  ";

/// The newest log lines that fit, each wrapped over as many rows as it needs (continuation rows
/// indented), coloured by level; the newest line is always whole at the bottom, the oldest one
/// shown may lose its first rows.
pub(super) fn render_logs(frame: &mut Frame, area: Rect, log: &[String]) {
    let block = Block::bordered().title(" Logs ");
    let inner = block.inner(area);
    let width = inner.width as usize;
    let rows = inner.height as usize;
    // Newest first, then turned around.
    let mut lines: Vec<Line> = Vec::new();
    for l in log.iter().rev() {
        if lines.len() >= rows {
            break;
        }
        let style = match l.split(' ').nth(1) {
            Some("E") => Style::new().fg(Color::Red),
            Some("W") => Style::new().fg(Color::Yellow),
            Some("D" | "T") => dim(),
            _ => Style::new(),
        };
        for row in wrap(l, width).into_iter().rev() {
            lines.push(Line::from(Span::styled(row, style)));
        }
    }
    lines.truncate(rows);
    lines.reverse();
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

/// `line` in rows of at most `width` characters: broken at the last space that keeps at least
/// half a row, else inside the word; rows after the first indented by [`CONTINUATION`].
pub(super) fn wrap(line: &str, width: usize) -> Vec<String> {
    let indent = CONTINUATION.len();
    if width <= 2 * indent {
        return vec![truncate(line, width)];
    }
    let mut rows = Vec::new();
    let mut rest: Vec<char> = line.chars().collect();
    loop {
        let (prefix, room) = if rows.is_empty() {
            ("", width)
        } else {
            (CONTINUATION, width - indent)
        };
        if rest.len() <= room {
            rows.push(format!("{prefix}{}", rest.iter().collect::<String>()));
            return rows;
        }
        let space = rest[..=room]
            .iter()
            .rposition(|c| *c == ' ')
            .filter(|&i| i >= room / 2);
        let (head, skip) = match space {
            Some(i) => (i, i + 1),
            None => (room, room),
        };
        rows.push(format!(
            "{prefix}{}",
            rest[..head].iter().collect::<String>()
        ));
        rest.drain(..skip);
        if rest.is_empty() {
            return rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_wrap_at_spaces_and_keep_every_character() {
        let line = "14:09:52 I command pause: paused: stages stop at the next item boundary";
        let rows = wrap(line, 30);
        assert!(rows.iter().all(|r| r.chars().count() <= 30), "{rows:?}");
        assert!(rows[1..].iter().all(|r| r.starts_with(CONTINUATION)));
        let joined: Vec<&str> = rows.iter().map(|r| r.trim_start()).collect();
        assert_eq!(joined.join(" "), line);
        // a word longer than a row is cut inside
        let word = "x".repeat(70);
        let rows = wrap(&word, 30);
        assert_eq!(rows.concat().replace(' ', ""), word);
        assert_eq!(wrap("short", 30), vec!["short".to_string()]);
        assert_eq!(wrap("", 30), vec![String::new()]);
    }
}
