//! The control room's states the screen tests draw (deterministic), and the drawing into a
//! test terminal.

use super::*;

// ---------------------------------------------------------------------------------------------
// Fixtures (deterministic)

pub(super) fn step_record(step: u64) -> StepRecord {
    let s = step as f64;
    let warmup = 50.0;
    let peak_lr = 6e-4;
    let lr = if s < warmup {
        peak_lr * (s + 1.0) / warmup
    } else {
        let t = ((s - warmup) / 10_000.0).min(1.0);
        peak_lr * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    };
    let tokens_per_s = 12_000.0 + 1_500.0 * (1.0 - (-s / 40.0).exp()) + 300.0 * (s / 17.0).sin();
    StepRecord {
        step,
        epoch: step / 1000,
        loss: 1.2 + 2.4 * (-s / 90.0).exp() + 0.04 * (s / 5.0).sin(),
        accuracy: 0.2 + 0.5 * (1.0 - (-s / 120.0).exp()),
        accept_mean: 1.0 + 2.6 * (1.0 - (-s / 110.0).exp()) + 0.05 * (s / 9.0).cos(),
        lr,
        grad_norm: 1.0 + 0.5 * (-s / 60.0).exp(),
        tokens: 16_384,
        samples: 8,
        blocks: 1000,
        step_s: 16_384.0 / tokens_per_s,
        tokens_per_s,
        samples_per_s: tokens_per_s / 2048.0,
        elapsed_s: 1.3 * s,
    }
}

pub(super) fn history(n: u64) -> Vec<StepRecord> {
    (1..=n).map(step_record).collect()
}

pub(super) fn stats(count: u64, mean_ms: f64, max_ms: f64) -> EventStats {
    EventStats {
        count,
        total_s: count as f64 * mean_ms * 1e-3,
        mean_s: mean_ms * 1e-3,
        min_s: mean_ms * 0.6e-3,
        max_s: max_ms * 1e-3,
        began_earlier: 0,
    }
}

pub(super) fn profile() -> ProfileReport {
    // (event, interval count, mean ms, max ms, share)
    // as a report orders them: step.total, the work by share, then the waits
    let rows: [(&str, u64, f64, f64, f64); 10] = [
        ("step.total", 8, 1250.0, 1402.5, 1.0),
        ("target.forward", 8, 610.2, 688.0, 0.488),
        ("drafter.backward", 8, 301.7, 355.1, 0.241),
        ("drafter.forward", 8, 180.4, 190.0, 0.144),
        ("optim.step", 8, 40.0, 41.2, 0.032),
        ("drafter.loss", 8, 22.5, 25.0, 0.018),
        ("target.h2d", 8, 6.1, 9.7, 0.005),
        ("loader.pack", 8, 3.2, 4.4, 0.003),
        ("feature_q.wait", 9, 60.3, 240.8, 0.054),
        ("batch_q.wait", 8, 0.41, 1.9, 0.0003),
    ];
    ProfileReport {
        interval_s: 10.0,
        elapsed_s: 390.0,
        workers: StageWorkers::default(),
        rows: rows
            .iter()
            .map(|&(event, count, mean, max, share)| ProfileRow {
                event: ProfileEvent::named(event).expect("a profile event"),
                interval: stats(count, mean, max),
                cumulative: stats(count * 39, mean * 1.02, max * 1.3),
                // step.total spans overlapping steps: no stage's share
                share: (event != "step.total").then_some(share),
                all_time_share: (event != "step.total").then_some(share * 1.02),
            })
            .collect(),
    }
}

pub(super) fn h200(index: u32, util: u32) -> GpuReading {
    GpuReading {
        index,
        name: "NVIDIA H200".to_string(),
        utilization_pct: Some(util),
        memory_used_bytes: Some((60 + 9 * index as u64) * GIB + GIB / 4),
        memory_total_bytes: Some(143_771 * 1024 * 1024),
        power_watts: Some(180.0 + 5.5 * util as f64),
        power_limit_watts: Some(700.0),
        temperature_c: Some(38 + util / 3),
    }
}

pub(super) fn queues() -> Vec<QueueLevel> {
    vec![
        QueueLevel {
            name: QueueName::Batch,
            len: 4,
            capacity: 8,
            pushed: 1210,
            popped: 1206,
        },
        QueueLevel {
            name: QueueName::Feature,
            len: 2,
            capacity: 2,
            pushed: 1206,
            popped: 1204,
        },
    ]
}

/// A training run at step 300 of 10,000 on one H200.
pub(super) fn training() -> Snapshot {
    let history = history(300);
    let last = history.last().cloned();
    Snapshot {
        run_name: "smollm2-dflash".to_string(),
        run_dir: "runs/smollm2-dflash".to_string(),
        target: Some("llama (Llama): 30 decoder layers".to_string()),
        phase: Phase::Training,
        step: 300,
        total_steps: 10_000,
        epoch: 0,
        elapsed_s: 390.0,
        eta_s: Some(12_610.0),
        tokens_per_s: last.as_ref().map(|r| r.tokens_per_s).unwrap_or(0.0),
        samples_per_s: last.as_ref().map(|r| r.samples_per_s).unwrap_or(0.0),
        last,
        history,
        evals: vec![],
        validations: vec![],
        queues: queues(),
        profile: Some(profile()),
        profile_interval_s: 10.0,
        gpus: Some(vec![h200(0, 87)]),
        gpu_error: None,
        host: None,
        stage_devices: vec![
            ("loader".to_string(), "cpu".to_string()),
            ("target".to_string(), "cuda:0".to_string()),
            ("drafter".to_string(), "cuda:0".to_string()),
        ],
        last_checkpoint: Some("runs/smollm2-dflash/checkpoints/step-000250".to_string()),
        error: None,
        ranks: Vec::new(),
    }
}

/// The run log's last lines, as train.log has them.
pub(super) fn log_lines() -> Vec<String> {
    [
        "14:02:51 I pid 4242: SIGUSR1 = checkpoint, SIGINT/SIGTERM = stop with a checkpoint (twice: at once), SIGHUP = go on without the terminal",
        "14:03:02 I target SmolLM2-135M-Instruct (Llama, 134.5 M parameters) on Cuda(0) as BFloat16 in 1.9 s",
        "14:09:20 I step 250/10000 epoch 0 loss 1.3001 acc 0.642 accept 3.36 lr 5.99e-4 tok/s 13208 samples/s 6.45 | batch_q 4/8, feature_q 2/2 | ETA 3h31m",
        "14:09:21 I checkpoint at step 250: runs/smollm2-dflash/checkpoints/step-000250 in 0.21 s",
        "14:09:40 W command queue feature_q 9999 refused: queue feature_q: depth 9999 is above the limit of 1024 (as pipeline.*_queue_depth)",
        "14:09:52 I command pause: paused: stages stop at the next item boundary",
        "14:09:58 I command resume: resumed",
    ]
    .into_iter()
    .map(String::from)
    .collect()
}

pub(super) fn one_gpu() -> AppState {
    let mut state = AppState::new(training());
    state.log = log_lines();
    state
}

pub(super) fn eight_gpus() -> AppState {
    let mut s = training();
    s.gpus = Some(
        (0..8)
            .map(|i| h200(i, [92, 88, 95, 90, 71, 64, 12, 0][i as usize]))
            .collect(),
    );
    s.stage_devices = vec![("loader".to_string(), "cpu".to_string())];
    for i in 0..4 {
        s.stage_devices
            .push(("target".to_string(), format!("cuda:{i}")));
    }
    for i in 4..6 {
        s.stage_devices
            .push(("drafter".to_string(), format!("cuda:{i}")));
    }
    AppState::new(s)
}

pub(super) fn nvml_absent() -> AppState {
    let mut s = training();
    s.gpus = None;
    s.gpu_error = Some("libnvidia-ml.so.1: cannot open shared object file".to_string());
    s.stage_devices = vec![
        ("loader".to_string(), "cpu".to_string()),
        ("target".to_string(), "cpu".to_string()),
        ("drafter".to_string(), "cpu".to_string()),
    ];
    s.host = Some(HostReading {
        cpu_cores: 1.93,
        cores: 2,
        memory_bytes: 1_234 << 20,
        memory_total_bytes: 23 * GIB,
    });
    AppState::new(s)
}

pub(super) fn paused() -> AppState {
    let mut s = training();
    s.phase = Phase::Paused;
    s.tokens_per_s = 0.0;
    s.samples_per_s = 0.0;
    s.gpus = Some(vec![h200(0, 0)]);
    s.queues[0].len = 8;
    s.queues[1].len = 0;
    AppState::new(s)
}

pub(super) fn failed() -> AppState {
    let mut s = training();
    s.phase = Phase::Failed;
    s.eta_s = None;
    s.error = Some("drafter worker 0 failed: step 8: injected failure".to_string());
    s.history.truncate(8);
    s.last = s.history.last().cloned();
    s.tokens_per_s = s.last.as_ref().unwrap().tokens_per_s;
    s.samples_per_s = s.last.as_ref().unwrap().samples_per_s;
    s.step = 8;
    s.elapsed_s = 10.4;
    s.last_checkpoint = None;
    s.queues[0].len = 0;
    s.queues[1].len = 0;
    AppState::new(s)
}

pub(super) fn no_metrics_yet() -> AppState {
    let mut s = training();
    s.phase = Phase::LoadingModel;
    s.step = 0;
    s.elapsed_s = 4.0;
    s.eta_s = None;
    s.tokens_per_s = 0.0;
    s.samples_per_s = 0.0;
    s.last = None;
    s.history.clear();
    s.profile = None;
    s.queues = vec![];
    s.gpus = Some(vec![h200(0, 0)]);
    s.last_checkpoint = None;
    AppState::new(s)
}

pub(super) fn ended() -> AppState {
    let mut s = training();
    s.phase = Phase::Finished;
    s.step = 10_000;
    s.eta_s = Some(0.0);
    s.history = history(10_000);
    s.last = s.history.last().cloned();
    s.elapsed_s = 13_000.0;
    s.last_checkpoint = Some("runs/smollm2-dflash/checkpoints/step-010000".to_string());
    let mut state = AppState::new(s);
    state.mode = Mode::Ended;
    state
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Renders `state` into a `width` x `height` test terminal; the screen as text (symbols only,
/// lines joined with '\n') and the cursor position when shown.
pub(super) fn draw(state: &AppState, width: u16, height: u16) -> (String, Option<(u16, u16)>) {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    terminal.draw(|f| render(f, state)).unwrap();
    let backend = terminal.backend();
    let cursor = backend
        .cursor_visible()
        .then(|| (backend.cursor_position().x, backend.cursor_position().y));
    let text = buffer_text(terminal.backend().buffer());
    (text, cursor)
}

pub(super) fn buffer_text(buf: &ratatui::buffer::Buffer) -> String {
    let w = buf.area.width as usize;
    buf.content
        .chunks(w)
        .map(|row| {
            row.iter()
                .map(|c| c.symbol())
                .collect::<String>()
                .trim_end()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub(super) fn screen(state: &AppState, width: u16, height: u16) -> String {
    draw(state, width, height).0
}
