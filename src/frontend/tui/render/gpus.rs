//! The GPU panel (one row per GPU, in columns that line up however wide the fields are) and,
//! without NVML, the process panel in its place.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, LineGauge, Paragraph};
use ratatui::Frame;

use super::format::{chars, truncate};
use super::{dim, BAR_EMPTY, BAR_FULL};
use crate::telemetry::gpu::GpuReading;
use crate::telemetry::host::HostReading;
use crate::telemetry::records::Snapshot;

/// From this many GPUs on, the GPU panel uses the compact (multi-column) form.
pub const COMPACT_GPUS: usize = 8;

/// GPU rows wanted: (rows, columns per row).
fn gpu_grid(n: usize, inner_width: u16) -> (usize, usize) {
    if n >= COMPACT_GPUS {
        let cols = if inner_width >= 2 * 36 + 2 { 2 } else { 1 };
        (n.div_ceil(cols), cols)
    } else {
        (n.max(1), 1)
    }
}

pub(super) fn gpu_panel_height(snap: &Snapshot, body: Rect) -> u16 {
    let rows = match &snap.gpus {
        Some(g) => gpu_grid(g.len(), body.width.saturating_sub(2)).0,
        None => 1,
    } as u16;
    (rows + 2).min((body.height / 3).max(3))
}

/// The stages served by GPU `index`: every stage whose device is `cuda:index` (`cuda` alone
/// counts as `cuda:0`).
fn stages_on(stage_devices: &[(String, String)], index: u32) -> String {
    let names: Vec<&str> = stage_devices
        .iter()
        .filter(|(_, dev)| {
            let dev = dev.trim();
            if dev == "cuda" {
                index == 0
            } else {
                dev.strip_prefix("cuda:")
                    .and_then(|i| i.trim().parse::<u32>().ok())
                    == Some(index)
            }
        })
        .map(|(stage, _)| stage.as_str())
        .collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join("+")
    }
}

fn short_gpu_name(name: &str) -> &str {
    name.strip_prefix("NVIDIA ").unwrap_or(name)
}

fn util_color(pct: Option<u32>) -> Color {
    match pct {
        None => Color::DarkGray,
        Some(p) if p >= 70 => Color::Green,
        Some(p) if p >= 30 => Color::Yellow,
        Some(_) => Color::Red,
    }
}

fn text_bar(ratio: f64, width: usize) -> (String, String) {
    let r = if ratio.is_finite() {
        ratio.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let filled = (r * width as f64).round() as usize;
    (
        BAR_FULL.repeat(filled.min(width)),
        BAR_EMPTY.repeat(width - filled.min(width)),
    )
}

/// The text fields of one GPU row, before padding.
struct GpuFields {
    idx: String,
    name: String,
    util: String,
    mem_long: String,
    mem_short: String,
    power_long: String,
    power_short: String,
    temp_long: String,
    temp_short: String,
    stages: String,
    util_pct: Option<u32>,
}

impl GpuFields {
    fn new(g: &GpuReading, stage_devices: &[(String, String)]) -> Self {
        const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
        let opt = |v: Option<String>| v.unwrap_or_else(|| "?".into());
        let gib =
            |b: Option<u64>, prec: usize| opt(b.map(|b| format!("{:.prec$}", b as f64 / GIB)));
        GpuFields {
            idx: g.index.to_string(),
            name: short_gpu_name(&g.name).to_string(),
            util: opt(g.utilization_pct.map(|p| format!("{p}%"))),
            mem_long: format!(
                "{}/{} GiB",
                gib(g.memory_used_bytes, 1),
                gib(g.memory_total_bytes, 1)
            ),
            mem_short: format!(
                "{}/{}G",
                gib(g.memory_used_bytes, 0),
                gib(g.memory_total_bytes, 0)
            ),
            power_long: format!(
                "{}/{} W",
                opt(g.power_watts.map(|w| format!("{w:.0}"))),
                opt(g.power_limit_watts.map(|w| format!("{w:.0}")))
            ),
            power_short: opt(g.power_watts.map(|w| format!("{w:.0}W"))),
            temp_long: opt(g.temperature_c.map(|t| format!("{t}°C"))),
            temp_short: opt(g.temperature_c.map(|t| format!("{t}°"))),
            stages: stages_on(stage_devices, g.index),
            util_pct: g.utilization_pct,
        }
    }
}

/// Column widths shared by every GPU row, so that bars and numbers line up.
struct GpuColumns {
    long: bool,
    bar: usize,
    idx: usize,
    name: usize,
    util: usize,
    mem: usize,
    power: usize,
    temp: usize,
}

impl GpuColumns {
    /// The long form when it fits `cell_w` with a bar of 10 or more, else the short form.
    fn fit(rows: &[GpuFields], cell_w: usize) -> Self {
        let w = |f: fn(&GpuFields) -> &String| rows.iter().map(|r| chars(f(r))).max().unwrap_or(0);
        let idx = w(|r| &r.idx);
        let name = w(|r| &r.name).min(16);
        let util = w(|r| &r.util).max(4);
        let stages = w(|r| &r.stages);
        let (mem_l, power_l, temp_l) = (
            w(|r| &r.mem_long),
            w(|r| &r.power_long),
            w(|r| &r.temp_long),
        );
        // idx name bar util  mem  power  temp  stages
        let long_fixed =
            idx + 1 + name + 1 + 1 + util + 2 + mem_l + 2 + power_l + 2 + temp_l + 2 + stages;
        if long_fixed + 10 <= cell_w {
            return GpuColumns {
                long: true,
                bar: (cell_w - long_fixed).min(30),
                idx,
                name,
                util,
                mem: mem_l,
                power: power_l,
                temp: temp_l,
            };
        }
        let (mem_s, power_s, temp_s) = (
            w(|r| &r.mem_short),
            w(|r| &r.power_short),
            w(|r| &r.temp_short),
        );
        // idx bar util mem power temp stages
        let short_fixed = idx + 1 + 1 + util + 1 + mem_s + 1 + power_s + 1 + temp_s + 1 + stages;
        GpuColumns {
            long: false,
            bar: cell_w.saturating_sub(short_fixed).clamp(3, 20),
            idx,
            name: 0,
            util,
            mem: mem_s,
            power: power_s,
            temp: temp_s,
        }
    }
}

/// One GPU as a line of at most `width` columns.
fn gpu_line(f: &GpuFields, c: &GpuColumns, width: usize) -> Line<'static> {
    let head = if c.long {
        format!(
            "{:>iw$} {:<nw$} ",
            f.idx,
            truncate(&f.name, c.name),
            iw = c.idx,
            nw = c.name
        )
    } else {
        format!("{:>iw$} ", f.idx, iw = c.idx)
    };
    let (sep, mem, power, temp) = if c.long {
        ("  ", &f.mem_long, &f.power_long, &f.temp_long)
    } else {
        (" ", &f.mem_short, &f.power_short, &f.temp_short)
    };
    let tail = format!(
        " {:>uw$}{sep}{:>mw$}{sep}{:>pw$}{sep}{:>tw$}{sep}",
        f.util,
        mem,
        power,
        temp,
        uw = c.util,
        mw = c.mem,
        pw = c.power,
        tw = c.temp
    );
    let ratio = f.util_pct.map(|p| p as f64 / 100.0).unwrap_or(0.0);
    let (full, empty) = text_bar(ratio, c.bar);
    let mut spans = vec![
        Span::styled(head, Style::new().bold()),
        Span::styled(full, Style::new().fg(util_color(f.util_pct))),
        Span::styled(empty, dim()),
        Span::raw(tail),
        Span::styled(f.stages.clone(), Style::new().fg(Color::Cyan)),
    ];
    // Cut to width (the short form may still be too long in a very narrow cell).
    let mut left = width;
    for s in spans.iter_mut() {
        let w = chars(&s.content);
        if w > left {
            s.content = truncate(&s.content, left).into();
            left = 0;
        } else {
            left -= w;
        }
    }
    Line::from(spans)
}

pub(super) fn render_gpus(frame: &mut Frame, area: Rect, snap: &Snapshot) {
    let gpus = match &snap.gpus {
        None => return render_host(frame, area, snap.host.as_ref()),
        Some(g) => g,
    };
    let block = Block::bordered().title(format!(" GPUs ({}) ", gpus.len()));
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if gpus.is_empty() {
        frame.render_widget(Paragraph::new("no GPUs found"), inner);
        return;
    }
    let (rows, cols) = gpu_grid(gpus.len(), inner.width);
    let visible_rows = (inner.height as usize).min(rows);
    let mut shown = visible_rows * cols;
    let hidden = gpus.len().saturating_sub(shown);
    if hidden > 0 {
        shown = shown.saturating_sub(1); // the last cell says how many are left out
    }
    let gap = 2usize;
    let cell_w = (inner.width as usize + gap) / cols - gap;
    let fields: Vec<GpuFields> = gpus
        .iter()
        .map(|g| GpuFields::new(g, &snap.stage_devices))
        .collect();
    let columns = GpuColumns::fit(&fields, cell_w);
    let mut lines = Vec::with_capacity(visible_rows);
    for r in 0..visible_rows {
        let mut spans: Vec<Span> = Vec::new();
        for c in 0..cols {
            // Column-major order: GPU 0..rows down the first column.
            let i = c * visible_rows + r;
            if i >= gpus.len() {
                break;
            }
            let text_w = spans.iter().map(|s| s.width()).sum::<usize>();
            if c > 0 {
                let pad = (c * (cell_w + gap)).saturating_sub(text_w);
                spans.push(Span::raw(" ".repeat(pad)));
            }
            if i >= shown {
                if hidden > 0 && i == shown {
                    spans.push(Span::styled(format!("… {} more GPUs", hidden + 1), dim()));
                }
                break;
            }
            spans.extend(gpu_line(&fields[i], &columns, cell_w).spans);
        }
        lines.push(Line::from(spans));
    }
    frame.render_widget(Paragraph::new(lines), inner);
}

/// Without NVML (a CPU run): the trainer process's CPU and memory use.
fn render_host(frame: &mut Frame, area: Rect, host: Option<&HostReading>) {
    let block = Block::bordered().title(" Process (no GPUs: NVML unavailable) ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let Some(h) = host else {
        frame.render_widget(Paragraph::new(Span::styled("no reading yet", dim())), inner);
        return;
    };
    let cpu = h.cpu_cores / h.cores.max(1) as f64;
    let mem = h.memory_bytes as f64 / h.memory_total_bytes.max(1) as f64;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let text = format!(
        "CPU {:.1} of {} cores │ memory {:.2} of {:.1} GiB",
        h.cpu_cores,
        h.cores,
        gib(h.memory_bytes),
        gib(h.memory_total_bytes)
    );
    let [label, bars] = Layout::horizontal([
        Constraint::Length(chars(&text) as u16 + 2),
        Constraint::Min(0),
    ])
    .areas(Rect::new(
        inner.x,
        inner.y,
        inner.width,
        1.min(inner.height),
    ));
    frame.render_widget(Paragraph::new(text), label);
    let half = bars.width / 2;
    for (i, (name, ratio)) in [("cpu", cpu), ("mem", mem)].into_iter().enumerate() {
        let a = Rect::new(
            bars.x + i as u16 * half,
            bars.y,
            half.saturating_sub(1),
            bars.height,
        );
        frame.render_widget(
            LineGauge::default()
                .ratio(ratio.clamp(0.0, 1.0))
                .label(name)
                .filled_symbol(BAR_FULL)
                .unfilled_symbol(BAR_EMPTY)
                .filled_style(Style::new().fg(util_color(Some((ratio * 100.0) as u32))))
                .unfilled_style(dim()),
            a,
        );
    }
}
