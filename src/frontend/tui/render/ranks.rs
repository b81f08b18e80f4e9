//! The ranks panel of a multi-process run (drawn only with two ranks or more): one compact row
//! per rank (its machine, step, step time, wait in the gradient exchange, busiest stage, queue
//! fill levels, GPUs), the slowest one marked. When not all fit, rank 0 and the slowest come
//! first and a last line counts the rest (`ctl status` lists every rank).

use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::dim;
use super::format::truncate;
use crate::telemetry::ranks::{gpu_summary, queue_summary, slowest, RankReport};
use crate::telemetry::records::Snapshot;

/// A report older than this is shown as stale (a rank is expected every second or step).
const STALE_S: f64 = 10.0;

/// The panel's height for `snap` in a body of `body` (0: no panel, fewer than two ranks).
pub(super) fn ranks_panel_height(snap: &Snapshot, body: Rect) -> u16 {
    if snap.ranks.len() < 2 {
        return 0;
    }
    // the rows, the column titles and the border, within a third of the body
    (snap.ranks.len() as u16 + 3).min((body.height / 3).max(4))
}

fn fmt_s(s: Option<f64>) -> String {
    s.map_or("-".into(), |s| format!("{s:.2}"))
}

/// The ranks in the order they are listed: rank 0, the slowest, then the others by rank.
fn listed(ranks: &[RankReport], slow: Option<usize>) -> Vec<&RankReport> {
    let mut out: Vec<&RankReport> = Vec::with_capacity(ranks.len());
    out.extend(ranks.iter().filter(|r| r.rank == 0));
    out.extend(ranks.iter().filter(|r| r.rank != 0 && Some(r.rank) == slow));
    out.extend(ranks.iter().filter(|r| r.rank != 0 && Some(r.rank) != slow));
    out
}

pub(super) fn render_ranks(frame: &mut Frame, area: Rect, snap: &Snapshot) {
    if area.height == 0 {
        return;
    }
    let slow = slowest(&snap.ranks);
    let title = match slow {
        Some(r) => format!(" Ranks ({}) · slowest: rank {r} ", snap.ranks.len()),
        None => format!(" Ranks ({}) ", snap.ranks.len()),
    };
    let block = Block::bordered().title(title);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let width = inner.width as usize;
    // the host column takes what the others and the note ("silent 14s") leave, 6..16
    let host_w = width.saturating_sub(57 + 10).clamp(6, 16);
    let row = |rank: &str, host: &str, cols: [String; 7]| {
        format!(
            "{rank:>4} {:<host_w$} {:>6} {:>6} {:>5} {:<11} {:<8} {:<9} {}",
            truncate(host, host_w),
            cols[0],
            cols[1],
            cols[2],
            cols[3],
            cols[4],
            cols[5],
            cols[6],
        )
    };
    let header = row(
        "rank",
        "host",
        [
            "step".into(),
            "s/step".into(),
            "sync".into(),
            "busiest".into(),
            "queues".into(),
            "GPUs".into(),
            String::new(),
        ],
    );
    let mut lines = vec![Line::from(Span::styled(truncate(&header, width), dim()))];
    let room = (inner.height as usize).saturating_sub(1);
    let all = listed(&snap.ranks, slow);
    let shown = if all.len() > room {
        room.saturating_sub(1)
    } else {
        all.len()
    };
    for r in all.iter().take(shown) {
        let stale = r.age_s.is_some_and(|a| a >= STALE_S);
        let note = match (stale, Some(r.rank) == slow) {
            (true, _) => format!("silent {:.0}s", r.age_s.unwrap_or(0.0)),
            (false, true) => "slowest".into(),
            (false, false) => String::new(),
        };
        let busiest = r.bottleneck.as_ref().map_or("-".into(), |(stage, busy)| {
            format!("{} {:.0}%", truncate(stage, 8), busy * 100.0)
        });
        let text = row(
            &r.rank.to_string(),
            &r.host,
            [
                r.step.to_string(),
                fmt_s(r.step_s),
                fmt_s(r.sync_s),
                busiest,
                queue_summary(r),
                gpu_summary(r),
                note,
            ],
        );
        let style = if stale {
            Style::new().fg(Color::Red)
        } else if Some(r.rank) == slow {
            Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD)
        } else {
            Style::new()
        };
        lines.push(Line::from(Span::styled(truncate(&text, width), style)));
    }
    if shown < all.len() {
        let more = format!(
            "     +{} more ranks (ctl status lists every rank)",
            all.len() - shown
        );
        lines.push(Line::from(Span::styled(truncate(&more, width), dim())));
    }
    frame.render_widget(Paragraph::new(lines), inner);
}
