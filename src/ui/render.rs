//! The pure render of the control room (control-room spec §4): draws the whole screen from an
//! [`AppState`] only: no I/O, no clocks, no global state (the logs pane shows the run log's
//! lines the state holds).
//!
//! Layout, top to bottom: header (2 lines), a red error line when the run failed, GPUs,
//! queues beside the ProfileStats table, charts beside the logs, and the status bar. Overlays
//! (help, quit dialog, end of run) are drawn on top. Below [`MIN_WIDTH`] x [`MIN_HEIGHT`] only a
//! "terminal too small" message is drawn.

use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span, Text};
use ratatui::widgets::{
    Axis, Block, Cell, Chart, Clear, Dataset, GraphType, LineGauge, Paragraph, Row, Table, Wrap,
};
use ratatui::Frame;

use crate::pipeline::queue::QueueLevel;
use crate::telemetry::gpu::GpuReading;
use crate::telemetry::host::HostReading;
use crate::telemetry::profile::{fmt_share, ProfileReport};
use crate::telemetry::records::{
    queue_state, EvalRecord, Phase, Snapshot, StepRecord, ValidationRecord,
};
use crate::ui::state::{AppState, Mode, Viewer, QUIT_CHOICES, ZOOM_LEVELS};

/// The smallest terminal the layout is drawn in.
pub const MIN_WIDTH: u16 = 80;
/// The smallest terminal the layout is drawn in.
pub const MIN_HEIGHT: u16 = 24;

/// Text shown in the chart area before the first step.
pub const EMPTY_CHARTS: &str = "waiting for the first step";

/// From this many GPUs on, the GPU panel uses the compact (multi-column) form.
pub const COMPACT_GPUS: usize = 8;

const BAR_FULL: &str = "█";
const BAR_EMPTY: &str = "░";

/// Draws the whole control room from `state`.
pub fn render(frame: &mut Frame, state: &AppState) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        render_too_small(frame, area);
        return;
    }
    let snap = &state.snapshot;
    let error_h = u16::from(snap.error.is_some());
    let [header, error, body, status] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(error_h),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(area);

    render_header(frame, header, state);
    if let Some(e) = &snap.error {
        let line = Line::from(vec![
            Span::styled(
                " ERROR ",
                Style::new().fg(Color::White).bg(Color::Red).bold(),
            ),
            Span::styled(format!(" {e}"), Style::new().fg(Color::Red).bold()),
        ]);
        frame.render_widget(Paragraph::new(line), error);
    }
    render_body(frame, body, state);
    render_status_bar(frame, status, state);

    match &state.mode {
        Mode::Normal | Mode::CommandLine(_) => {}
        Mode::Help => render_help(frame, area),
        Mode::QuitDialog { selected } => render_quit_dialog(frame, area, *selected),
        Mode::Ended => render_ended(frame, area, snap),
    }
}

// ---------------------------------------------------------------------------------------------
// Formatting helpers

/// A number with an SI suffix: `950`, `12.3k`, `3.4M`, `1.2G`; below 100 one decimal (`4.2`).
pub fn fmt_si(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let a = x.abs();
    if a < 100.0 {
        if x == x.trunc() {
            format!("{x:.0}")
        } else {
            format!("{x:.1}")
        }
    } else if a < 999.5 {
        format!("{x:.0}")
    } else if a < 999_950.0 {
        format!("{:.1}k", x / 1e3)
    } else if a < 999_950_000.0 {
        format!("{:.1}M", x / 1e6)
    } else {
        format!("{:.1}G", x / 1e9)
    }
}

/// Seconds as `h:mm:ss` (`-` when not finite or negative).
pub fn fmt_duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".into();
    }
    let s = seconds.round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}

/// A chart value: 4 significant digits, scientific for very small or large magnitudes.
pub fn fmt_value(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let a = x.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{x:.2e}")
    } else if a >= 1000.0 {
        fmt_si(x)
    } else if a >= 100.0 {
        format!("{x:.1}")
    } else if a >= 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Seconds for messages: `10` or `2.5`.
fn fmt_secs(s: f64) -> String {
    if s == s.trunc() {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}

fn fmt_ms(seconds: f64) -> String {
    let ms = seconds * 1e3;
    if ms < 10.0 {
        format!("{ms:.2}")
    } else if ms < 1000.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.0}")
    }
}

/// Cuts `s` to `width` characters, ending in `…` when cut.
fn truncate(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n <= width {
        s.to_string()
    } else if width == 0 {
        String::new()
    } else {
        let mut out: String = s.chars().take(width - 1).collect();
        out.push('…');
        out
    }
}

/// Means of `width` equal buckets of `values` (non-finite values are left out of a bucket's
/// mean; a bucket with none is NaN). With `values.len() <= width` the values come back as they
/// are; `width == 0` gives an empty vector.
pub fn downsample(values: &[f64], width: usize) -> Vec<f64> {
    let n = values.len();
    if width == 0 {
        return Vec::new();
    }
    if n <= width {
        return values.to_vec();
    }
    (0..width)
        .map(|i| {
            let lo = i * n / width;
            let hi = ((i + 1) * n / width).max(lo + 1);
            let (sum, count) = values[lo..hi]
                .iter()
                .filter(|v| v.is_finite())
                .fold((0.0, 0usize), |(s, c), v| (s + v, c + 1));
            if count == 0 {
                f64::NAN
            } else {
                sum / count as f64
            }
        })
        .collect()
}

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

fn key_style() -> Style {
    Style::new().fg(Color::Black).bg(Color::Gray).bold()
}

fn dim() -> Style {
    Style::new().fg(Color::DarkGray)
}

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

// ---------------------------------------------------------------------------------------------
// Too small

fn render_too_small(frame: &mut Frame, area: Rect) {
    let msg = format!(
        "terminal too small: {}x{}, need at least {MIN_WIDTH}x{MIN_HEIGHT}",
        area.width, area.height
    );
    let width = area.width.max(1) as usize;
    let lines = msg.chars().count().div_ceil(width).max(1) as u16;
    let y = area.y + area.height.saturating_sub(lines) / 2;
    let rect = Rect::new(area.x, y, area.width, lines.min(area.height));
    frame.render_widget(
        Paragraph::new(msg)
            .style(Style::new().fg(Color::Yellow).bold())
            .alignment(Alignment::Center)
            .wrap(Wrap { trim: true }),
        rect,
    );
}

// ---------------------------------------------------------------------------------------------
// Header

fn render_header(frame: &mut Frame, area: Rect, state: &AppState) {
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

// ---------------------------------------------------------------------------------------------
// Body

fn render_body(frame: &mut Frame, area: Rect, state: &AppState) {
    let snap = &state.snapshot;
    let gpu_h = gpu_panel_height(snap, area);
    let rest = area.height.saturating_sub(gpu_h);
    let queue_h = snap.queues.len().max(1) as u16 + 2;
    let profile_h = match &snap.profile {
        Some(p) if !p.rows.is_empty() => p.rows.len() as u16 + 4,
        _ => 3,
    };
    let mid_h = queue_h.max(profile_h).min((rest * 2 / 5).max(4));
    let [gpus, mid, bottom] = Layout::vertical([
        Constraint::Length(gpu_h),
        Constraint::Length(mid_h),
        Constraint::Min(0),
    ])
    .areas(area);

    render_gpus(frame, gpus, snap);

    let queue_w = if mid.width >= 110 {
        44
    } else {
        (mid.width * 2 / 5).max(30)
    };
    let [queues, profile] =
        Layout::horizontal([Constraint::Length(queue_w), Constraint::Min(0)]).areas(mid);
    render_queues(frame, queues, &snap.queues, state.selected_queue);
    let verdict = snap.verdict();
    render_profile(
        frame,
        profile,
        snap.profile.as_ref(),
        snap.profile_interval_s,
        verdict.as_deref(),
    );

    let [charts, logs] =
        Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(bottom);
    render_charts(
        frame,
        charts,
        state.chart_window(),
        &snap.evals,
        &snap.validations,
    );
    render_logs(frame, logs, &state.log);
}

/// The newest log lines that fit, each cut to the pane's width (a long line would wrap over
/// several rows and push the rest out), coloured by level.
fn render_logs(frame: &mut Frame, area: Rect, log: &[String]) {
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

// ---------------------------------------------------------------------------------------------
// GPUs

/// GPU rows wanted: (rows, columns per row).
fn gpu_grid(n: usize, inner_width: u16) -> (usize, usize) {
    if n >= COMPACT_GPUS {
        let cols = if inner_width >= 2 * 36 + 2 { 2 } else { 1 };
        (n.div_ceil(cols), cols)
    } else {
        (n.max(1), 1)
    }
}

fn gpu_panel_height(snap: &Snapshot, body: Rect) -> u16 {
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

fn chars(s: &str) -> usize {
    s.chars().count()
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

fn render_gpus(frame: &mut Frame, area: Rect, snap: &Snapshot) {
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

// ---------------------------------------------------------------------------------------------
// Queues

fn render_queues(frame: &mut Frame, area: Rect, queues: &[QueueLevel], selected: usize) {
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
        .map(|q| q.name.chars().count())
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

// ---------------------------------------------------------------------------------------------
// ProfileStats

fn render_profile(
    frame: &mut Frame,
    area: Rect,
    report: Option<&ProfileReport>,
    interval: f64,
    verdict: Option<&str>,
) {
    let report = match report {
        Some(r) if !r.rows.is_empty() => r,
        other => {
            let msg = if interval <= 0.0 {
                "profile reports off".to_string()
            } else if other.is_some() {
                format!(
                    "no events in the last report (interval {} s)",
                    fmt_secs(interval)
                )
            } else {
                format!("no profile yet (interval {} s)", fmt_secs(interval))
            };
            frame.render_widget(
                Paragraph::new(Span::styled(msg, dim()))
                    .block(Block::bordered().title(" ProfileStats ")),
                area,
            );
            return;
        }
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
    let inner_w = table_area.width as usize;
    let inner_h = table_area.height as usize;
    let event_w = report
        .rows
        .iter()
        .map(|r| r.event.chars().count())
        .max()
        .unwrap_or(5)
        .clamp(5, 18);
    // Columns in order of importance; the least important are dropped when narrow.
    // (title, width, priority: lower = kept longer)
    let cols: [(&str, usize, u8); 6] = [
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
        if width_of(&keep) <= inner_w {
            break;
        }
        for (i, c) in cols.iter().enumerate() {
            if c.2 == prio {
                keep[i] = false;
            }
        }
    }
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
    let max_rows = inner_h.saturating_sub(1);
    let rows = report.rows.iter().take(max_rows).map(|r| {
        let values = [
            Cell::from(truncate(&r.event, event_w)),
            right(r.interval.count.to_string()),
            right(fmt_ms(r.interval.mean_s)),
            right(fmt_ms(r.interval.max_s)),
            right(fmt_share(r.share)),
            right(fmt_share(r.all_time_share)),
        ];
        let style = if r.event.ends_with(".wait") && r.share.is_some_and(|s| s >= 0.2) {
            Style::new().fg(Color::Yellow)
        } else {
            Style::new()
        };
        Row::new(
            values
                .into_iter()
                .zip(keep)
                .filter(|(_, k)| *k)
                .map(|(v, _)| v),
        )
        .style(style)
    });
    let widths: Vec<Constraint> = cols
        .iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(c, _)| Constraint::Length(c.1 as u16))
        .collect();
    frame.render_widget(
        Table::new(rows, widths).header(header).column_spacing(1),
        table_area,
    );
}

// ---------------------------------------------------------------------------------------------
// Charts

/// Held-out measurements on a chart: validation passes beside the training curves, the walk
/// tau and the periodic evaluation's decoded tau on the tau chart.
const VALIDATION: Color = Color::LightCyan;
const DECODED: Color = Color::Yellow;

/// Text in the tau chart before any held-out tau.
pub const NO_TAU: &str = "no held-out tau yet";

/// From this chart-area height on, six charts (three rows); below it, four.
const SIX_CHARTS_FROM: u16 = 18;

/// A training curve: one value per step of the window.
struct Curve {
    color: Color,
    values: Vec<f64>,
}

/// Points at the steps of held-out measurements.
struct Points {
    /// Its name in the title, long and short ("" = none).
    label: (&'static str, &'static str),
    color: Color,
    points: Vec<(f64, f64)>,
}

/// One chart: a training curve, held-out points, or both.
struct Plot {
    name: (&'static str, &'static str),
    curve: Option<Curve>,
    points: Vec<Points>,
}

impl Plot {
    fn new(name: (&'static str, &'static str)) -> Self {
        Plot {
            name,
            curve: None,
            points: Vec::new(),
        }
    }

    fn curve(mut self, color: Color, window: &[StepRecord], get: fn(&StepRecord) -> f64) -> Self {
        self.curve = Some(Curve {
            color,
            values: window.iter().map(get).collect(),
        });
        self
    }

    fn points(
        mut self,
        label: (&'static str, &'static str),
        color: Color,
        points: Vec<(f64, f64)>,
    ) -> Self {
        self.points.push(Points {
            label,
            color,
            points,
        });
        self
    }

    /// The title: the name, then the latest value of the curve and of each set of points,
    /// in their colours; the short names where the long ones do not fit in `width`.
    fn title(&self, width: usize) -> Line<'static> {
        let spans = |short: bool| {
            let pick =
                |(long, brief): (&'static str, &'static str)| if short { brief } else { long };
            let mut spans = vec![Span::raw(format!(" {} ", pick(self.name)))];
            if let Some(c) = &self.curve {
                let latest = fmt_value(c.values.last().copied().unwrap_or(f64::NAN));
                spans.push(Span::styled(
                    format!("{latest} "),
                    Style::new().fg(c.color).bold(),
                ));
            }
            for p in &self.points {
                let Some(&(_, y)) = p.points.last() else {
                    continue;
                };
                let label = pick(p.label);
                let text = if label.is_empty() {
                    format!("{} ", fmt_value(y))
                } else {
                    format!("{label} {} ", fmt_value(y))
                };
                spans.push(Span::styled(text, Style::new().fg(p.color).bold()));
            }
            spans
        };
        let long = spans(false);
        if long.iter().map(Span::width).sum::<usize>() <= width {
            Line::from(long)
        } else {
            Line::from(spans(true))
        }
    }
}

/// The charts beside the logs: loss and accuracy with the validation passes beside the
/// training curves (overfitting shows as the curves parting), tau (the validation walk tau and
/// the evaluation's decoded tau), the training blocks' anchor-mean acceptance with the
/// validation's, tokens/s and the learning rate; the last two are left out where there is room
/// for four charts only.
fn render_charts(
    frame: &mut Frame,
    area: Rect,
    window: &[StepRecord],
    evals: &[EvalRecord],
    validations: &[ValidationRecord],
) {
    if window.is_empty() {
        let block = Block::bordered().title(" Charts ");
        let inner = block.inner(area);
        frame.render_widget(block, area);
        centered_note(frame, inner, EMPTY_CHARTS);
        return;
    }
    let first = window.first().map_or(0, |r| r.step);
    let held_out = |points: &mut dyn Iterator<Item = (u64, f64)>| -> Vec<(f64, f64)> {
        points
            .filter(|&(step, y)| step >= first && y.is_finite())
            .map(|(step, y)| (step as f64, y))
            .collect()
    };
    let val = |get: fn(&ValidationRecord) -> f64| {
        held_out(&mut validations.iter().map(|v| (v.step, get(v))))
    };
    let decoded = held_out(&mut evals.iter().map(|e| (e.step, e.tau)));
    let loss = Plot::new(("loss", "loss"))
        .curve(Color::Red, window, |r| r.loss)
        .points(("val", "val"), VALIDATION, val(|v| v.loss));
    let accuracy = Plot::new(("accuracy", "acc"))
        .curve(Color::Green, window, |r| r.accuracy)
        .points(("val", "val"), VALIDATION, val(|v| v.accuracy));
    let tau = Plot::new(("tau", "tau"))
        .points(("walk", ""), VALIDATION, val(|v| v.tau))
        .points(("decoded", "dec"), DECODED, decoded);
    let tokens = Plot::new(("tokens/s", "tok/s")).curve(Color::Cyan, window, |r| r.tokens_per_s);
    let plots = if area.height >= SIX_CHARTS_FROM {
        let accept = Plot::new(("accept (train)", "accept"))
            .curve(Color::Green, window, |r| r.accept_mean)
            .points(("val", "val"), VALIDATION, val(|v| v.accept_mean));
        let lr = Plot::new(("learning rate", "lr")).curve(Color::Magenta, window, |r| r.lr);
        vec![loss, accuracy, tau, accept, tokens, lr]
    } else {
        vec![loss, accuracy, tau, tokens]
    };
    let rows = plots.len() as u32 / 2;
    let row_areas = Layout::vertical((0..rows).map(|_| Constraint::Ratio(1, rows))).split(area);
    let cells = row_areas.iter().flat_map(|&r| {
        Layout::horizontal([Constraint::Ratio(1, 2), Constraint::Ratio(1, 2)])
            .split(r)
            .to_vec()
    });
    let steps: Vec<f64> = window.iter().map(|r| r.step as f64).collect();
    for (plot, rect) in plots.iter().zip(cells) {
        render_plot(frame, rect, &steps, plot);
    }
}

/// `text` dimmed, centred in `area`.
fn centered_note(frame: &mut Frame, area: Rect, text: &'static str) {
    let y = area.y + area.height.saturating_sub(1) / 2;
    frame.render_widget(
        Paragraph::new(Span::styled(text, dim())).alignment(Alignment::Center),
        Rect::new(area.x, y, area.width, 1.min(area.height)),
    );
}

/// A lower bound padded below a non-negative minimum stays at 0 or above (rates, losses and
/// throughputs are never negative).
fn not_below_zero(min: f64, padded: f64) -> f64 {
    if min >= 0.0 {
        padded.max(0.0)
    } else {
        padded
    }
}

fn finite_range(values: &[f64]) -> Option<(f64, f64)> {
    values
        .iter()
        .filter(|v| v.is_finite())
        .fold(None, |acc, &v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

fn render_plot(frame: &mut Frame, area: Rect, steps: &[f64], plot: &Plot) {
    let mut block = Block::bordered().title(plot.title(area.width.saturating_sub(2) as usize));
    let inner = block.inner(area);
    // Braille: two dots a column.
    let points_w = (inner.width as usize * 2).max(1);
    let xs = downsample(steps, points_w);
    let curve: Vec<(f64, f64)> = plot.curve.as_ref().map_or_else(Vec::new, |c| {
        xs.iter()
            .copied()
            .zip(downsample(&c.values, points_w))
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    });
    let ys: Vec<f64> = curve
        .iter()
        .chain(plot.points.iter().flat_map(|p| &p.points))
        .map(|p| p.1)
        .collect();
    if ys.is_empty() && plot.curve.is_none() {
        frame.render_widget(block, area);
        centered_note(frame, inner, NO_TAU);
        return;
    }
    let (x0, x1) = finite_range(steps).unwrap_or((0.0, 1.0));
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let (y0, y1) = match finite_range(&ys) {
        None => (0.0, 1.0),
        Some((lo, hi)) if hi > lo => {
            let pad = (hi - lo) * 0.05;
            (not_below_zero(lo, lo - pad), hi + pad)
        }
        Some((v, _)) => {
            let pad = if v == 0.0 { 1.0 } else { v.abs() * 0.1 };
            (not_below_zero(v, v - pad), v + pad)
        }
    };
    let mut x_axis = Axis::default().bounds([x0, x1]).style(dim());
    let mut y_axis = Axis::default().bounds([y0, y1]).style(dim());
    // Axis labels only where they leave room for the plot; else the value range goes into
    // the bottom border.
    if inner.height >= 7 && inner.width >= 30 {
        x_axis = x_axis.labels([fmt_si(x0), fmt_si(x1)]);
        y_axis = y_axis.labels([fmt_value(y0), fmt_value(y1)]);
    } else if let Some((lo, hi)) = finite_range(&ys) {
        let range = format!(" {}..{} ", fmt_value(lo), fmt_value(hi));
        if chars(&range) <= inner.width as usize {
            block = block.title_bottom(Line::from(Span::styled(range, dim())).right_aligned());
        }
    }
    let line = |color: Color, data| {
        Dataset::default()
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::new().fg(color))
            .data(data)
    };
    let mut datasets = Vec::new();
    if let Some(c) = &plot.curve {
        datasets.push(line(c.color, &curve));
    }
    for p in &plot.points {
        datasets.push(line(p.color, &p.points));
    }
    frame.render_widget(
        Chart::new(datasets)
            .block(block)
            .x_axis(x_axis)
            .y_axis(y_axis),
        area,
    );
}

// ---------------------------------------------------------------------------------------------
// Status bar

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

fn render_status_bar(frame: &mut Frame, area: Rect, state: &AppState) {
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

// ---------------------------------------------------------------------------------------------
// Overlays

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

fn render_help(frame: &mut Frame, area: Rect) {
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

fn render_quit_dialog(frame: &mut Frame, area: Rect, selected: usize) {
    let mut lines = vec![Line::raw("")];
    for (i, choice) in QUIT_CHOICES.iter().enumerate() {
        if i == selected {
            lines.push(
                Line::from(Span::styled(
                    format!("> {choice} <"),
                    Style::new().add_modifier(Modifier::REVERSED | Modifier::BOLD),
                ))
                .centered(),
            );
        } else {
            lines.push(Line::from(format!("  {choice}  ")).centered());
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

fn render_ended(frame: &mut Frame, area: Rect, snap: &Snapshot) {
    let failed = snap.error.is_some() || snap.phase == Phase::Failed;
    let (headline, style) = if failed {
        let what = match &snap.error {
            Some(e) => format!("run failed: {e}"),
            None => "run failed".to_string(),
        };
        (what, Style::new().fg(Color::Red).bold())
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
