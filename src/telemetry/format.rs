//! Durations as people read them, one place for every front end. Two styles, both kept
//! because their outputs are what screens and log lines already show: a clock (`1:02:05`,
//! the screen and regenerate's progress) and a compact span (`3h31m`, the headless step lines).

/// Seconds as a clock, `h:mm:ss` rounded to the second (`-` when not finite or negative).
pub fn fmt_duration_clock(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".into();
    }
    let s = seconds.round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}

/// Seconds as a compact span with its two largest units, cut to the second: `3h31m`, `4m05s`,
/// `12s` (negative or NaN reads as `0s`).
pub(crate) fn fmt_duration_compact(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_rounds_and_refuses_what_is_no_duration() {
        assert_eq!(fmt_duration_clock(0.0), "0:00:00");
        assert_eq!(fmt_duration_clock(3_724.6), "1:02:05");
        assert_eq!(fmt_duration_clock(100_000.0), "27:46:40");
        assert_eq!(fmt_duration_clock(f64::NAN), "-");
        assert_eq!(fmt_duration_clock(-1.0), "-");
    }

    #[test]
    fn a_compact_span_keeps_its_two_largest_units() {
        assert_eq!(fmt_duration_compact(12.9), "12s");
        assert_eq!(fmt_duration_compact(245.0), "4m05s");
        assert_eq!(fmt_duration_compact(12_660.0), "3h31m");
        assert_eq!(fmt_duration_compact(-5.0), "0s");
        assert_eq!(fmt_duration_compact(f64::NAN), "0s");
    }
}
