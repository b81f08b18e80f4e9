//! Progress bars of the long commands (`eval`, `regenerate`, `perplexity`, `prepare-data`) on
//! stderr, with rate and ETA. Nothing is drawn when stderr is not a terminal (indicatif's stderr
//! target hides itself there), and log lines go through [`LogWriter`], which clears the bars
//! around each line, so that a log line never lands inside a half-drawn bar.

use std::io::Write;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// The bars of one command. Made once in `main`, before the logger, so that the logger and
/// every bar share the same draw target.
#[derive(Clone, Debug)]
pub(crate) struct Bars {
    multi: MultiProgress,
}

impl Bars {
    /// Bars on stderr (hidden when stderr is not a terminal).
    pub(crate) fn stderr() -> Self {
        Self::with_draw_target(ProgressDrawTarget::stderr())
    }

    pub(crate) fn with_draw_target(target: ProgressDrawTarget) -> Self {
        Bars {
            multi: MultiProgress::with_draw_target(target),
        }
    }

    /// A bar of `len` items of `unit` ("prompts", "rows", "tokens"), labelled `what`.
    pub(crate) fn bar(&self, what: &str, len: u64, unit: &str) -> ProgressBar {
        let bar = self.multi.add(ProgressBar::new(len));
        bar.set_style(style(unit));
        bar.set_prefix(what.to_string());
        bar
    }

    /// Whether nothing is drawn (stderr is not a terminal): the commands then write their
    /// periodic progress lines to the log instead.
    #[cfg(test)]
    fn is_hidden(&self) -> bool {
        self.multi.is_hidden()
    }

    /// The log's writer: stderr, with the bars cleared around each line.
    pub(crate) fn log_writer(&self) -> LogWriter<std::io::Stderr> {
        LogWriter {
            multi: self.multi.clone(),
            out: std::io::stderr(),
        }
    }
}

/// `what [elapsed] ████░░ 12/80 prompts (1.30 prompts/s, ETA 52s) message`: the bar takes
/// the width the rest leaves, and the message comes last, so that the numbers stay in view.
fn style(unit: &str) -> ProgressStyle {
    let template = format!(
        "{{prefix}} [{{elapsed_precise}}] {{wide_bar}} {{human_pos}}/{{human_len}} {unit} ({{rate}}, ETA {{eta}}) {{msg}}"
    );
    let unit = unit.to_string();
    // The template is ours and fixed; should it ever not parse, a plain bar is still a bar.
    match ProgressStyle::with_template(&template) {
        Ok(s) => s.with_key(
            "rate",
            move |state: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{} {unit}/s", rate(state.per_sec()));
            },
        ),
        Err(_) => ProgressStyle::default_bar(),
    }
}

/// A rate with about three significant digits.
fn rate(per_s: f64) -> String {
    if !per_s.is_finite() {
        "?".into()
    } else if per_s >= 100.0 {
        format!("{per_s:.0}")
    } else if per_s >= 10.0 {
        format!("{per_s:.1}")
    } else {
        format!("{per_s:.2}")
    }
}

/// Writes log lines to `out` with the bars cleared while it writes (env_logger hands over each
/// record in one write).
pub(crate) struct LogWriter<W: Write> {
    multi: MultiProgress,
    out: W,
}

impl<W: Write> Write for LogWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let out = &mut self.out;
        self.multi
            .suspend(|| out.write_all(buf).and_then(|_| out.flush()))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A terminal that records what is drawn on it.
    #[derive(Debug, Clone, Default)]
    struct Screen(Arc<Mutex<Vec<String>>>);

    impl Screen {
        fn ops(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
        fn push(&self, s: String) -> std::io::Result<()> {
            self.0.lock().unwrap().push(s);
            Ok(())
        }
    }

    impl indicatif::TermLike for Screen {
        fn width(&self) -> u16 {
            160
        }
        fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
            self.push(format!("up {n}"))
        }
        fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
            self.push(format!("down {n}"))
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.push(format!("line {s}"))
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.push(format!("str {s}"))
        }
        fn clear_line(&self) -> std::io::Result<()> {
            self.push("clear".into())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_bar_shows_position_unit_rate_and_eta() {
        let screen = Screen::default();
        let bars = Bars::with_draw_target(ProgressDrawTarget::term_like(Box::new(screen.clone())));
        assert!(!bars.is_hidden());
        let bar = bars.bar("eval", 10, "prompts");
        bar.inc(3);
        bar.tick();
        let drawn = screen.ops().join("\n");
        assert!(drawn.contains("eval ["), "{drawn}");
        assert!(drawn.contains("3/10 prompts ("), "{drawn}");
        assert!(drawn.contains(" prompts/s, ETA "), "{drawn}");
    }

    #[test]
    fn log_lines_are_written_with_the_bar_cleared() {
        let screen = Screen::default();
        let bars = Bars::with_draw_target(ProgressDrawTarget::term_like(Box::new(screen.clone())));
        let bar = bars.bar("rows", 5, "rows");
        bar.inc(1);
        bar.tick();
        let before = screen.ops().len();
        let mut writer = LogWriter {
            multi: bars.multi.clone(),
            out: Vec::new(),
        };
        writer.write_all(b"INFO a log line\n").unwrap();
        assert_eq!(writer.out, b"INFO a log line\n");
        // The bar was cleared before the line and drawn again after it.
        let after: Vec<String> = screen.ops()[before..].to_vec();
        let cleared = after.iter().position(|o| o == "clear");
        let redrawn = after.iter().rposition(|o| o.contains("1/5 rows"));
        assert!(
            matches!((cleared, redrawn), (Some(c), Some(r)) if c < r),
            "{after:?}"
        );
    }

    #[test]
    fn a_hidden_target_draws_nothing() {
        let bars = Bars::with_draw_target(ProgressDrawTarget::hidden());
        assert!(bars.is_hidden());
        let bar = bars.bar("x", 2, "rows");
        assert!(bar.is_hidden());
        bar.inc(2);
        let mut writer = LogWriter {
            multi: bars.multi.clone(),
            out: Vec::new(),
        };
        writer.write_all(b"line\n").unwrap();
        assert_eq!(writer.out, b"line\n");
    }
}
