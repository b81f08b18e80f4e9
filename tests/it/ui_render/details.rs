//! Plain assertions on drawn screens and on the render's helpers (src/frontend/tui/render/:
//! charts.rs, format.rs): selections, sizes, values that are not finite, number formats.

use super::*;

#[test]
fn status_message_replaces_keys() {
    let mut state = one_gpu();
    state.status = Some(("unknown queue: foo_q".to_string(), true));
    let s = screen(&state, 80, 24);
    let last = s.lines().last().unwrap();
    assert!(last.starts_with("unknown queue: foo_q"), "{last}");
    state.status = None;
    let s = screen(&state, 120, 40);
    let last = s.lines().last().unwrap();
    assert!(last.contains("p pause/resume"), "{last}");
    assert!(last.contains("q quit"), "{last}");
}

#[test]
fn selected_queue_is_marked() {
    let mut state = one_gpu();
    state.selected_queue = 1;
    let s = screen(&state, 120, 40);
    assert!(s.contains(">feature_q"), "{s}");
    assert!(!s.contains(">batch_q"), "{s}");
}

#[test]
fn twenty_thousand_points_render() {
    let mut s = training();
    s.history = history(20_000);
    s.last = s.history.last().cloned();
    s.step = 20_000;
    s.total_steps = 20_000;
    let state = AppState::new(s);
    // Render speed is measured by `dflash-tui bench-ui`, not here.
    let screen_all = screen(&state, 120, 40);
    assert!(screen_all.contains("tokens/s"));
    // Zoomed in as well.
    let mut state = state;
    state.zoom = 3;
    let screen = screen(&state, 120, 40);
    assert!(screen.contains("last 100 steps"), "{screen}");
}

#[test]
fn sixteen_gpus_do_not_break_the_layout() {
    let mut s = training();
    s.gpus = Some((0..16).map(|i| h200(i, 50)).collect());
    let state = AppState::new(s);
    let small = screen(&state, 80, 24);
    assert!(small.contains("more GPUs"), "{small}");
    assert!(small.contains("tokens/s"), "{small}");
    let _ = screen(&state, 120, 40);
}

#[test]
fn non_finite_values_do_not_panic() {
    let mut s = training();
    s.history[100].loss = f64::NAN;
    s.history[299].loss = f64::INFINITY;
    s.tokens_per_s = f64::NAN;
    s.eta_s = Some(f64::INFINITY);
    let state = AppState::new(s);
    for (w, h) in [(120, 40), (80, 24)] {
        let shown = screen(&state, w, h);
        // the rate and the ETA that are not numbers show as "-"; the charts' ranges skip
        // the points that are not finite (the loss title shows the last loss as it is)
        assert!(
            shown.contains("- tok/s") && shown.contains("ETA -"),
            "{w}x{h}:\n{shown}"
        );
        assert!(
            !shown.contains("NaN") && !shown.contains("..inf") && !shown.contains("inf.."),
            "{w}x{h}:\n{shown}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers of the render (src/frontend/tui/render/: charts.rs, format.rs)

#[test]
fn downsample_bucket_means() {
    assert!(downsample(&[], 10).is_empty());
    assert!(downsample(&[1.0, 2.0], 0).is_empty());
    assert_eq!(downsample(&[1.0, 2.0, 3.0], 10), vec![1.0, 2.0, 3.0]);
    assert_eq!(downsample(&[1.0, 2.0, 3.0, 4.0], 2), vec![1.5, 3.5]);
    assert_eq!(
        downsample(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3),
        vec![1.5, 3.5, 5.5]
    );
    // Uneven buckets cover every value exactly once.
    let v: Vec<f64> = (0..20_000).map(|i| i as f64).collect();
    let d = downsample(&v, 236);
    assert_eq!(d.len(), 236);
    assert!(d.windows(2).all(|w| w[0] < w[1]));
    assert!(d[0] < 100.0 && d[235] > 19_900.0);
    // Non-finite values are left out of a bucket; an all-NaN bucket is NaN.
    let d = downsample(&[1.0, f64::NAN, f64::NAN, f64::NAN], 2);
    assert_eq!(d[0], 1.0);
    assert!(d[1].is_nan());
}

#[test]
fn number_and_duration_formats() {
    assert_eq!(fmt_si(0.0), "0");
    assert_eq!(fmt_si(4.3), "4.3");
    assert_eq!(fmt_si(950.0), "950");
    assert_eq!(fmt_si(12_345.0), "12.3k");
    assert_eq!(fmt_si(3_400_000.0), "3.4M");
    assert_eq!(fmt_si(1.2e9), "1.2G");
    assert_eq!(fmt_si(f64::NAN), "-");
    assert_eq!(fmt_duration(0.0), "0:00:00");
    assert_eq!(fmt_duration(3_725.0), "1:02:05");
    assert_eq!(fmt_duration(100_000.0), "27:46:40");
    assert_eq!(fmt_duration(f64::INFINITY), "-");
}

#[test]
fn queues_show_no_state_before_data_flows() {
    let mut state = one_gpu();
    for q in &mut state.snapshot.queues {
        (q.len, q.pushed, q.popped) = (0, 0, 0);
    }
    let s = screen(&state, 120, 40);
    assert_eq!(s.matches("no data").count(), 2, "{s}");
    assert!(!s.contains("empty"), "{s}");
    // and the verdict names no queue state
    assert!(s.contains("bottleneck: target (busy 100 %)\u{20}"), "{s}");
}
