//! Numbers, durations and text cut to a width, as the panels show them.

/// Seconds as `h:mm:ss` (`-` when not finite or negative): the screen uses the shared clock
/// style, under the name its callers and tests know.
pub use crate::telemetry::format::fmt_duration_clock as fmt_duration;

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
pub(super) fn fmt_secs(s: f64) -> String {
    if s == s.trunc() {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}

pub(super) fn fmt_ms(seconds: f64) -> String {
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
pub(super) fn truncate(s: &str, width: usize) -> String {
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

/// Width in characters (what a terminal cell counts for these texts).
pub(super) fn chars(s: &str) -> usize {
    s.chars().count()
}
