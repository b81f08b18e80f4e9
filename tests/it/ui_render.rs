//! The pure render of the control room: snapshot tests of whole screens (insta) plus plain
//! assertions on their content.

use dflash_tui::frontend::tui::render::{
    downsample, fmt_duration, fmt_si, render, EMPTY_CHARTS, NO_TAU,
};
use dflash_tui::frontend::tui::state::{AppState, Mode, QuitChoice};
use dflash_tui::pipeline::queue::{QueueLevel, QueueName};
use dflash_tui::telemetry::gpu::GpuReading;
use dflash_tui::telemetry::host::HostReading;
use dflash_tui::telemetry::profile::{
    EventStats, ProfileEvent, ProfileReport, ProfileRow, StageWorkers,
};
use dflash_tui::telemetry::ranks::RankReport;
use dflash_tui::telemetry::rate::RateWindow;
use dflash_tui::telemetry::records::{EvalRecord, Phase, Snapshot, StepRecord, ValidationRecord};
use ratatui::backend::TestBackend;
use ratatui::Terminal;

mod details;
mod fixtures;

use fixtures::*;

const GIB: u64 = 1024 * 1024 * 1024;

macro_rules! snap_both {
    ($name:literal, $state:expr) => {{
        let state = $state;
        let big = screen(&state, 120, 40);
        insta::assert_snapshot!(concat!($name, "_120x40"), big);
        let small = screen(&state, 80, 24);
        insta::assert_snapshot!(concat!($name, "_80x24"), small);
        (big, small)
    }};
}

// ---------------------------------------------------------------------------------------------
// Screens

#[test]
fn one_gpu_screen() {
    let (big, small) = snap_both!("one_gpu", one_gpu());
    for s in [&big, &small] {
        assert!(s.contains("H200"), "{s}");
        assert!(s.contains("training"), "{s}");
        assert!(s.contains("smollm2-dflash"), "{s}");
        assert!(s.contains("step 300 / 10000"), "{s}");
        assert!(s.contains("target+drafter"), "{s}");
        assert!(s.contains("feature_q"), "{s}");
        assert!(s.contains("target.forward"), "{s}");
        assert!(s.contains("tokens/s"), "{s}");
        assert!(s.contains("Logs"), "{s}");
        assert!(s.contains("3:30:10"), "ETA: {s}");
    }
    assert!(big.contains("quit"), "{big}");
    assert!(big.contains("full"), "{big}");
    // the verdict: the busiest stage of the interval, and the queues
    assert!(
        big.contains("bottleneck: target (busy 100 %); batch_q ok, feature_q full"),
        "{big}"
    );
    // compact log lines, each on one row: its start shown, its end cut
    assert!(big.contains("14:09:52 I command pause"), "{big}");
    assert!(big.contains("14:09:40 W command queue feature_q"), "{big}");
    // no share above 100 %; step.total has none (overlapping steps are no stage's time)
    assert!(
        !big.contains("100.0%") || big.contains("step.total"),
        "{big}"
    );
    let total_row = big.lines().find(|l| l.contains("step.total")).unwrap();
    assert!(total_row.contains(" - "), "{total_row}");
}

/// Periodic evaluations at steps 100, 200, 300, the run evaluating now.
fn evaluating() -> AppState {
    let mut s = training();
    s.phase = Phase::Evaluating;
    s.evals = [(100u64, 1.84), (200, 2.31), (300, 2.47)]
        .into_iter()
        .map(|(step, tau)| EvalRecord {
            step,
            tau,
            prompts: 16,
            decode_steps: 800,
            generated_tokens: (800.0 * tau) as u64,
            accepted_by_slot: vec![800; 16],
            eval_s: 4.0,
            best: true,
            elapsed_s: 1.3 * step as f64,
        })
        .collect();
    AppState::new(s)
}

#[test]
fn evaluation_tau_is_drawn_on_the_tau_chart() {
    let (big, small) = snap_both!("evaluating", evaluating());
    for s in [&big, &small] {
        assert!(s.contains("evaluating"), "{s}");
        assert!(
            s.contains("tau decoded 2.470"),
            "the latest eval tau in the chart title: {s}"
        );
    }
    // the eval series changes the chart (and the plain screen has no eval title)
    let mut plain = evaluating();
    plain.snapshot.evals.clear();
    let without = screen(&plain, 120, 40);
    assert!(!without.contains("decoded"));
    assert!(without.contains(NO_TAU), "{without}");
    assert_ne!(without, big);
}

/// Validation passes every 25 steps that stop improving while training goes on: the held-out
/// loss turns up and the accuracy down (overfitting), the walk tau flattens below the training
/// blocks' anchor mean. The run is validating at step 300; evaluations at 100, 200, 300.
fn validating() -> AppState {
    let mut s = evaluating().snapshot;
    s.phase = Phase::Validating;
    s.validations = (1..=12u64)
        .map(|i| {
            let step = 25 * i;
            let x = step as f64;
            let late = (x - 150.0).max(0.0);
            ValidationRecord {
                step,
                loss: 1.6 + 2.2 * (-x / 90.0).exp() + 0.004 * late,
                accuracy: 0.18 + 0.4 * (1.0 - (-x / 120.0).exp()) - 0.0006 * late,
                accept_mean: 1.0 + 2.0 * (1.0 - (-x / 110.0).exp()),
                tau: 1.0 + 1.2 * (1.0 - (-x / 80.0).exp()) - 0.001 * late,
                sequences: 64,
                answers: 80,
                answer_steps: 4000,
                tokens: 8000,
                blocks: 12_000,
                validation_s: 0.8,
                best: late == 0.0,
                elapsed_s: 1.3 * x,
            }
        })
        .collect();
    AppState::new(s)
}

#[test]
fn validation_is_drawn_beside_the_training_curves_and_is_the_tau() {
    let (big, small) = snap_both!("validating", validating());
    for s in [&big, &small] {
        assert!(s.contains("validating"), "{s}");
        // the latest pass in the loss and accuracy titles, beside the training values
        assert!(s.contains("loss 1.273 val 2.278"), "{s}");
        assert!(s.contains("val 0.457"), "{s}");
    }
    assert!(big.contains("accuracy 0.659 val 0.457"), "{big}");
    // the walk tau is the tau; the decoded one stands beside it
    assert!(big.contains("tau walk 2.022 decoded 2.470"), "{big}");
    assert!(small.contains("tau 2.022 dec 2.470"), "{small}");
    assert!(big.contains("accept (train) 3.413 val 2.869"), "{big}");
    // nothing calls the training blocks' acceptance a tau
    assert!(
        !big.contains("tau_train") && !big.contains("tau (train)"),
        "{big}"
    );
    // the passes change the charts
    let mut plain = validating();
    plain.snapshot.validations.clear();
    assert_ne!(screen(&plain, 120, 40), big);
    assert_ne!(screen(&plain, 80, 24), small);
}

#[test]
fn eight_gpus_screen() {
    let (big, small) = snap_both!("eight_gpus", eight_gpus());
    for s in [&big, &small] {
        for i in 0..8 {
            // every GPU has a row: its index starts a cell
            assert!(
                s.lines()
                    .any(|l| l.contains(&format!("│{i} ")) || l.contains(&format!(" {i} "))),
                "GPU {i} missing: {s}"
            );
        }
        assert!(s.contains("drafter"), "{s}");
        assert!(s.contains("tokens/s"), "{s}");
    }
}

/// Three ranks of a multi-process run, one GPU each: rank 2 waits least in the gradient
/// exchange (the others wait for it), rank 1's last report is 14 s old.
fn three_ranks() -> AppState {
    let mut state = one_gpu();
    let s = &mut state.snapshot;
    let rank = |rank: usize, host: &str, sync_s: f64, util: u32| RankReport {
        rank,
        host: host.into(),
        phase: Phase::Training,
        step: 300 - rank as u64 % 2,
        step_s: Some(1.25),
        sync_s: Some(sync_s),
        bottleneck: Some(("target".into(), 1.0 - sync_s / 1.25)),
        queues: queues(),
        gpus: Some(vec![h200(0, util)]),
        age_s: (rank > 0).then_some(if rank == 1 { 14.0 } else { 0.4 }),
        stop_requested: false,
    };
    s.ranks = vec![
        rank(0, "gpu-node-01", 0.31, 92),
        rank(1, "gpu-node-02.cluster.example", 0.27, 90),
        rank(2, "gpu-node-03", 0.02, 99),
    ];
    state
}

#[test]
fn three_ranks_screen() {
    let (big, small) = snap_both!("three_ranks", three_ranks());
    for s in [&big, &small] {
        assert!(s.contains("Ranks (3) · slowest: rank 2"), "{s}");
        let row = |r: &str| {
            s.lines()
                .find(|l| l.starts_with(&format!("│{r:>4} ")))
                .unwrap_or_else(|| panic!("no row for rank {r}: {s}"))
        };
        assert!(row("0").contains("gpu-node-01"), "{s}");
        assert!(row("2").contains("slowest"), "{s}");
        assert!(row("1").contains("silent 14s"), "{s}");
        assert!(
            s.contains("step.total") || s.contains("ProfileStats"),
            "{s}"
        );
    }
}

#[test]
fn nvml_absent_screen() {
    let (big, small) = snap_both!("nvml_absent", nvml_absent());
    for s in [&big, &small] {
        assert!(s.contains("Process (no GPUs: NVML unavailable)"), "{s}");
        assert!(
            s.contains("CPU 1.9 of 2 cores │ memory 1.21 of 23.0 GiB"),
            "{s}"
        );
    }
}

#[test]
fn nvml_absent_without_reason() {
    let mut state = nvml_absent();
    state.snapshot.gpu_error = None;
    state.snapshot.host = None;
    let s = screen(&state, 80, 24);
    assert!(s.contains("NVML unavailable"), "{s}");
    assert!(s.contains("no reading yet"), "{s}");
}

#[test]
fn paused_screen() {
    let (big, small) = snap_both!("paused", paused());
    for s in [&big, &small] {
        assert!(s.contains("paused"), "{s}");
        assert!(s.contains("ETA 3:30:10 (paused)"), "{s}");
    }
    assert!(big.contains("empty"), "{big}");
    assert!(big.contains("full"), "{big}");
}

#[test]
fn failed_screen() {
    let (big, small) = snap_both!("failed", failed());
    for s in [&big, &small] {
        assert!(s.contains("failed"), "{s}");
        assert!(s.contains("injected failure"), "{s}");
    }
}

#[test]
fn no_metrics_yet_screen() {
    let (big, small) = snap_both!("no_metrics_yet", no_metrics_yet());
    for s in [&big, &small] {
        assert!(s.contains("loading model"), "{s}");
        assert!(s.contains(EMPTY_CHARTS), "{s}");
        assert!(s.contains("no profile yet (interval 10 s)"), "{s}");
        assert!(s.contains("no queues yet"), "{s}");
    }
}

#[test]
fn profile_off_message() {
    let mut state = no_metrics_yet();
    state.snapshot.profile_interval_s = 0.0;
    let s = screen(&state, 120, 40);
    assert!(s.contains("profile reports off"), "{s}");
}

#[test]
fn help_overlay() {
    let mut state = one_gpu();
    state.mode = Mode::Help;
    let s = screen(&state, 120, 40);
    insta::assert_snapshot!("help_overlay_120x40", s);
    for word in [
        "Help",
        ":pause",
        ":resume",
        ":queue NAME DEPTH",
        ":checkpoint",
        ":profile SECONDS",
        ":stop",
        "zoom",
    ] {
        assert!(s.contains(word), "{word} missing: {s}");
    }
    // Also fits the smallest screen.
    let small = screen(&state, 80, 24);
    assert!(small.contains(":profile SECONDS"), "{small}");
}

#[test]
fn quit_dialog() {
    let mut state = one_gpu();
    state.mode = Mode::QuitDialog {
        selected: QuitChoice::CheckpointAndStop,
    };
    let s = screen(&state, 120, 40);
    insta::assert_snapshot!("quit_dialog_120x40", s);
    assert!(s.contains("Quit?"), "{s}");
    assert!(s.contains("> checkpoint and stop <"), "{s}");
    assert!(s.contains("stop"), "{s}");
    assert!(s.contains("cancel"), "{s}");
    assert!(s.contains("leave (the run goes on)"), "{s}");
    state.mode = Mode::QuitDialog {
        selected: QuitChoice::Cancel,
    };
    let s = screen(&state, 120, 40);
    assert!(s.contains("> cancel <"), "{s}");
    assert!(!s.contains("> checkpoint and stop <"), "{s}");
}

#[test]
fn command_line() {
    let mut state = one_gpu();
    state.mode = Mode::CommandLine("queue feature_q 2".to_string());
    let (s, cursor) = draw(&state, 120, 40);
    insta::assert_snapshot!("command_line_120x40", s);
    let last = s.lines().last().unwrap();
    assert!(last.starts_with(":queue feature_q 2"), "{last}");
    assert_eq!(cursor, Some((18, 39)));
}

#[test]
fn ended_popup() {
    let state = ended();
    let s = screen(&state, 120, 40);
    insta::assert_snapshot!("ended_120x40", s);
    assert!(s.contains("run finished"), "{s}");
    assert!(s.contains("press any key"), "{s}");
    assert!(s.contains("step-010000"), "{s}");
    assert!(s.lines().last().unwrap().contains("press any key"), "{s}");
    // a finished run: its averages, no ETA
    assert!(s.contains("took 3:36:40"), "{s}");
    assert!(s.contains("avg "), "{s}");
    assert!(!s.contains("ETA"), "{s}");

    let mut state = failed();
    state.mode = Mode::Ended;
    let s = screen(&state, 120, 40);
    assert!(s.contains("run failed: drafter worker 0 failed"), "{s}");
    assert!(s.contains("last checkpoint: none"), "{s}");
}

#[test]
fn too_small() {
    let s = screen(&one_gpu(), 60, 20);
    insta::assert_snapshot!("too_small_60x20", s);
    assert!(s.contains("too small"), "{s}");
    assert!(s.contains("60x20"), "{s}");
    assert!(!s.contains("H200"), "{s}");
    // Even tinier terminals do not panic.
    for (w, h) in [(1, 1), (10, 3), (79, 40), (200, 23)] {
        let s = screen(&one_gpu(), w, h);
        assert!(w < 20 || s.contains("too small"), "{w}x{h}: {s}");
    }
}

// ---------------------------------------------------------------------------------------------
// What a new user found (issue 42)

/// Step 60 of 300 at one step a second, then paused for 10 minutes at t = 60 s and resumed at
/// t = 660 s (the report: `ETA 0:39:45 | 19.0 tok/s` with about 4 minutes left after such a
/// pause); the screen at `at_s` seconds, the rates and ETA as the trainer's window gives them.
fn around_a_pause(at_s: u64) -> AppState {
    let t0 = std::time::Instant::now();
    let secs = std::time::Duration::from_secs;
    let mut w = RateWindow::new(secs(30), t0);
    for i in 1..=60 {
        w.complete(t0 + secs(i), 16_384, 8);
    }
    w.pause(t0 + secs(60));
    let phase = if at_s < 660 {
        Phase::Paused
    } else {
        w.resume(t0 + secs(660));
        Phase::Training
    };
    let (rates, eta) = w.live(t0 + secs(at_s), 240, phase);
    let mut s = training();
    s.phase = phase;
    s.step = 60;
    s.total_steps = 300;
    s.history = history(60);
    s.last = s.history.last().cloned();
    s.elapsed_s = at_s as f64;
    s.eta_s = eta;
    s.tokens_per_s = rates.tokens_per_s;
    s.samples_per_s = rates.samples_per_s;
    let mut state = AppState::new(s);
    state.log = log_lines();
    state
}

#[test]
fn the_eta_waits_during_a_pause_and_is_right_at_once_after_it() {
    // paused: no rate, the 4 minutes left held (not growing as the window empties)
    for at in [61, 300, 659] {
        let s = screen(&around_a_pause(at), 120, 40);
        let header = s.lines().nth(1).unwrap();
        assert!(header.contains("ETA 0:04:00 (paused)"), "{at} s: {header}");
        assert!(header.contains("│ 0 tok/s"), "{at} s: {header}");
    }
    // resumed after 10 minutes: the pace before the pause, at once
    let (big, _) = snap_both!("resumed_after_a_pause", around_a_pause(660));
    let header = big.lines().nth(1).unwrap();
    assert!(header.contains("ETA 0:04:00 │"), "{header}");
    assert!(header.contains("16.4k tok/s"), "{header}");
    assert!(header.contains("elapsed 0:11:00"), "{header}");
}

#[test]
fn status_on_the_command_line_shows_the_runs_status() {
    let mut state = one_gpu();
    state.mode = Mode::Status;
    let s = screen(&state, 120, 40);
    insta::assert_snapshot!("status_overlay_120x40", s);
    for part in [
        " Status ",
        "smollm2-dflash (runs/smollm2-dflash)",
        "target      llama (Llama): 30 decoder layers",
        "phase       training",
        "step        300 / 10000 (3 %), epoch 0",
        "ETA 3:30:10",
        "tok/s",
        "batch_q 4/8 ok, feature_q 2/2 full",
        "runs/smollm2-dflash/checkpoints/step-000250",
        "bottleneck:",
    ] {
        assert!(s.contains(part), "{part:?} missing: {s}");
    }
    let small = screen(&state, 80, 24);
    assert!(small.contains("300 / 10000"), "{small}");
}

#[test]
fn long_log_lines_wrap_and_the_newest_stays_visible() {
    let mut state = one_gpu();
    let newest = "14:10:05 I validation at step 300: loss 1.3001 acc 0.642 tau(walk) 2.412 (anchor mean 3.36) over 64 sequences (120 answers, 980 steps, 4.1 s)";
    state.log.push(newest.to_string());
    let s = screen(&state, 120, 40);
    // every word of the newest line is on the screen, none cut with "…"
    for word in newest.split(' ') {
        assert!(s.contains(word), "{word:?} missing: {s}");
    }
    assert!(!s.contains("…"), "a line was cut: {s}");
    // and it is the pane's last line: the row above the bottom border ends it
    let pane_rows: Vec<&str> = s.lines().filter(|l| l.ends_with('│')).collect();
    let last = pane_rows.last().unwrap();
    assert!(last.contains("4.1 s)"), "{last}");
}

#[test]
fn a_run_stopped_before_its_last_step_is_named_stopped() {
    let mut s = training();
    s.phase = Phase::Stopped;
    s.step = 45;
    s.total_steps = 60;
    s.eta_s = None;
    let mut state = AppState::new(s);
    state.mode = Mode::Ended;
    let s = screen(&state, 120, 40);
    assert!(s.contains(" stopped "), "{s}");
    assert!(s.contains("run stopped at step 45 of 60"), "{s}");
    assert!(!s.contains("finished"), "{s}");
    assert!(s.contains("avg "), "{s}");
}

#[test]
fn waits_are_grouped_apart_and_an_event_from_before_the_interval_says_so() {
    let mut state = one_gpu();
    let profile = state.snapshot.profile.as_mut().unwrap();
    let wait = profile
        .rows
        .iter_mut()
        .find(|r| r.event == ProfileEvent::FeatureQWait)
        .unwrap();
    wait.interval.began_earlier = 1;
    let s = screen(&state, 120, 40);
    let at = |needle: &str| s.find(needle).unwrap_or_else(|| panic!("{needle}: {s}"));
    assert!(at("step.total") < at("target.forward"), "{s}");
    assert!(at("optim.step") < at("-- waits --"), "{s}");
    assert!(at("-- waits --") < at("feature_q.wait"), "{s}");
    let row = s.lines().find(|l| l.contains("feature_q.wait")).unwrap();
    assert!(row.contains(">240.8"), "{row}");
}
