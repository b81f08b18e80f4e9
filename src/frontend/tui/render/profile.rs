//! The ProfileStats panel: the bottleneck verdict over a table of each event's timings.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::Frame;

use super::dim;
use super::format::{fmt_duration, fmt_ms, fmt_secs, truncate};
use crate::telemetry::profile::{fmt_max_ms, fmt_share, ProfileReport, ProfileRow, TimingKind};

pub(super) fn render_profile(
    frame: &mut Frame,
    area: Rect,
    report: Option<&ProfileReport>,
    interval: f64,
    verdict: Option<&str>,
) {
    let report = match report {
        Some(r) if !r.rows.is_empty() => r,
        other => return render_no_profile(frame, area, other.is_some(), interval),
    };
    let block = Block::bordered().title(format!(
        " ProfileStats: last {} s, {} since start ",
        fmt_secs(report.interval_s),
        fmt_duration(report.elapsed_s)
    ));
    let inner = block.inner(area);
    frame.render_widget(block, area);
    // The verdict first: which stage limits the run, and how the queues stand.
    let [verdict_area, table_area] = match verdict {
        Some(_) => Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(inner),
        None => Layout::vertical([Constraint::Length(0), Constraint::Min(0)]).areas(inner),
    };
    if let Some(v) = verdict {
        frame.render_widget(
            Paragraph::new(Span::styled(
                truncate(v, verdict_area.width as usize),
                Style::new().fg(Color::Cyan).bold(),
            )),
            verdict_area,
        );
    }
    render_table(frame, table_area, report);
}

/// Why there is no table: reports are off, the last one saw no events, or none came yet.
fn render_no_profile(frame: &mut Frame, area: Rect, had_report: bool, interval: f64) {
    let msg = if interval <= 0.0 {
        "profile reports off".to_string()
    } else if had_report {
        format!(
            "no events in the last report (interval {} s)",
            fmt_secs(interval)
        )
    } else {
        format!("no profile yet (interval {} s)", fmt_secs(interval))
    };
    frame.render_widget(
        Paragraph::new(Span::styled(msg, dim())).block(Block::bordered().title(" ProfileStats ")),
        area,
    );
}

/// A column of the table: (title, width, priority: lower = kept longer).
type Column = (&'static str, usize, u8);

/// The columns in order of importance, and which of them fit `width`: the least important
/// are dropped when narrow.
fn fitting_columns(event_w: usize, width: usize) -> ([Column; 6], [bool; 6]) {
    let cols: [Column; 6] = [
        ("event", event_w, 0),
        ("count", 7, 4),
        ("mean ms", 9, 2),
        ("max ms", 9, 3),
        ("share", 6, 1),
        ("all-time", 8, 5),
    ];
    let mut keep = [true; 6];
    let width_of = |keep: &[bool; 6]| -> usize {
        let (w, n) = cols
            .iter()
            .zip(keep)
            .filter(|(_, k)| **k)
            .fold((0usize, 0usize), |(w, n), (c, _)| (w + c.1, n + 1));
        w + n.saturating_sub(1)
    };
    for prio in (2..=5).rev() {
        if width_of(&keep) <= width {
            break;
        }
        for (i, c) in cols.iter().enumerate() {
            if c.2 == prio {
                keep[i] = false;
            }
        }
    }
    (cols, keep)
}

/// The rows that fit `max_rows` (None: the waits' label): where they do not all fit, the work
/// of the smallest shares gives way first, so that the waits stay in view.
fn shown_rows(report: &ProfileReport, max_rows: usize) -> Vec<Option<&ProfileRow>> {
    let (mut work, waits): (Vec<&ProfileRow>, Vec<&ProfileRow>) = report
        .rows
        .iter()
        .partition(|r| r.event.kind() != TimingKind::Wait);
    let waits_rows = if waits.is_empty() { 0 } else { waits.len() + 1 };
    work.truncate(max_rows.saturating_sub(waits_rows).max(2));
    let label = (!waits.is_empty()).then_some(None);
    let mut rows: Vec<Option<&ProfileRow>> = work.into_iter().map(Some).collect();
    rows.extend(label);
    rows.extend(waits.into_iter().map(Some));
    rows.truncate(max_rows);
    if rows.last() == Some(&None) {
        rows.pop(); // a label with no wait under it
    }
    rows
}

/// The label between the rows of work and those of waits (a stage idle on a queue).
pub(super) const WAITS_LABEL: &str = "-- waits --";

/// Each event's count, mean and max time, its share of the interval and of the whole run;
/// `step.total`, the work, then (under [`WAITS_LABEL`]) the waits. A max marked `>`
/// began before the interval (only its time inside it is counted).
fn render_table(frame: &mut Frame, area: Rect, report: &ProfileReport) {
    let inner_w = area.width as usize;
    let inner_h = area.height as usize;
    let event_w = report
        .rows
        .iter()
        .map(|r| r.event.name().chars().count())
        .max()
        .unwrap_or(5)
        .clamp(5, 18);
    let (cols, keep) = fitting_columns(event_w, inner_w);
    let right = |s: String| Cell::from(Line::from(s).right_aligned());
    let header = Row::new(cols.iter().zip(keep).filter(|(_, k)| *k).enumerate().map(
        |(i, (c, _))| {
            if i == 0 {
                Cell::from(c.0)
            } else {
                Cell::from(Line::from(c.0).right_aligned())
            }
        },
    ))
    .style(Style::new().bold().underlined());
    let mut rows = Vec::new();
    for r in shown_rows(report, inner_h.saturating_sub(1)) {
        let Some(r) = r else {
            rows.push(Row::new([Cell::from(WAITS_LABEL)]).style(dim()));
            continue;
        };
        let values = [
            Cell::from(truncate(r.event.name(), event_w)),
            right(r.interval.count.to_string()),
            right(fmt_ms(r.interval.mean_s)),
            right(fmt_max_ms(&r.interval, |ms| fmt_ms(ms * 1e-3))),
            right(fmt_share(r.share)),
            right(fmt_share(r.all_time_share)),
        ];
        let wait = r.event.kind() == TimingKind::Wait;
        let style = match r.share {
            Some(s) if wait && s >= 0.2 => Style::new().fg(Color::Yellow),
            _ if wait => dim(),
            _ => Style::new(),
        };
        rows.push(
            Row::new(
                values
                    .into_iter()
                    .zip(keep)
                    .filter(|(_, k)| *k)
                    .map(|(v, _)| v),
            )
            .style(style),
        );
    }
    let widths: Vec<Constraint> = cols
        .iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(c, _)| Constraint::Length(c.1 as u16))
        .collect();
    frame.render_widget(
        Table::new(rows, widths).header(header).column_spacing(1),
        area,
    );
}
