//! The charts beside the logs: training curves with the held-out measurements beside them.

use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Dataset, GraphType, Paragraph};
use ratatui::Frame;

use super::dim;
use super::format::{chars, fmt_si, fmt_value};
use crate::telemetry::records::{EvalRecord, StepRecord, ValidationRecord};

/// Text shown in the chart area before the first step.
pub const EMPTY_CHARTS: &str = "waiting for the first step";

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
pub(super) fn render_charts(
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
