//! A synthetic, deterministic control-room state (a run of N steps on two GPUs), for the render
//! benchmark.

use crate::pipeline::queue::{QueueLevel, QueueName};
use crate::telemetry::gpu::GpuReading;
use crate::telemetry::profile::{EventStats, ProfileEvent, ProfileReport, ProfileRow};
use crate::telemetry::records::{EvalRecord, Phase, Snapshot, StepRecord, ValidationRecord};

use super::state::AppState;

/// A training run `steps` long, with smooth curves and full telemetry.
pub(crate) fn synthetic_state(steps: usize, gpus: usize) -> AppState {
    let history = step_history(steps);
    let snapshot = Snapshot {
        run_name: "bench".into(),
        run_dir: "/tmp/bench".into(),
        target: Some(
            "qwen3_5_text (Qwen3.5 hybrid): 48 Gated DeltaNet + 16 gated attention layers".into(),
        ),
        phase: Phase::Training,
        step: steps as u64,
        total_steps: steps as u64 * 2,
        epoch: 0,
        elapsed_s: steps as f64 * 0.2,
        eta_s: Some(steps as f64 * 0.2),
        tokens_per_s: 80_000.0,
        samples_per_s: 45.0,
        last: history.last().cloned(),
        evals: eval_records(steps),
        validations: validation_records(steps),
        history,
        queues: queue_levels(),
        profile: Some(profile_report(steps)),
        profile_interval_s: 30.0,
        gpus: Some(gpu_readings(gpus)),
        stage_devices: vec![
            ("target".into(), "cuda:0".into()),
            ("drafter".into(), "cuda:1".into()),
        ],
        last_checkpoint: Some("/tmp/bench/checkpoints/step-001000".into()),
        ..Snapshot::default()
    };
    AppState::new(snapshot)
}

/// One step record per step, 0.2 s each: loss falling, accuracy and acceptance rising.
fn step_history(steps: usize) -> Vec<StepRecord> {
    (1..=steps as u64)
        .map(|s| {
            let x = s as f64;
            StepRecord {
                step: s,
                epoch: s / 5000,
                loss: 2.0 + 8.0 / (1.0 + x / 300.0) + 0.1 * (x / 7.0).sin(),
                accuracy: 0.6 * (1.0 - (-x / 4000.0).exp()),
                accept_mean: 1.0 + 2.5 * (1.0 - (-x / 5000.0).exp()),
                lr: 6e-4 * (x / 800.0).min(1.0),
                grad_norm: 1.0,
                tokens: 16_000,
                samples: 9,
                blocks: 2000,
                step_s: 0.2,
                tokens_per_s: 80_000.0 + 5_000.0 * (x / 50.0).sin(),
                samples_per_s: 45.0,
                elapsed_s: x * 0.2,
            }
        })
        .collect()
}

/// A profile with every event, later events taking smaller shares.
fn profile_report(steps: usize) -> ProfileReport {
    ProfileReport {
        interval_s: 30.0,
        elapsed_s: steps as f64 * 0.2,
        workers: Default::default(),
        rows: ProfileEvent::ALL
            .into_iter()
            .enumerate()
            .map(|(i, event)| ProfileRow {
                event,
                interval: EventStats {
                    count: 150,
                    total_s: 30.0 / (i + 2) as f64,
                    mean_s: 0.01,
                    min_s: 0.001,
                    max_s: 0.05,
                    began_earlier: 0,
                },
                cumulative: EventStats {
                    count: 15_000,
                    total_s: 3000.0 / (i + 2) as f64,
                    mean_s: 0.01,
                    min_s: 0.001,
                    max_s: 0.09,
                    began_earlier: 0,
                },
                share: (event != ProfileEvent::StepTotal).then_some(1.0 / (i + 2) as f64),
                all_time_share: (event != ProfileEvent::StepTotal).then_some(1.0 / (i + 2) as f64),
            })
            .collect(),
    }
}

/// An evaluation every 500 steps, tau rising, each one the best so far.
fn eval_records(steps: usize) -> Vec<EvalRecord> {
    (1..=steps as u64 / 500)
        .map(|i| {
            let step = i * 500;
            let tau = 1.0 + 2.2 * (1.0 - (-(step as f64) / 5000.0).exp());
            EvalRecord {
                step,
                tau,
                prompts: 16,
                decode_steps: 100,
                generated_tokens: (100.0 * tau) as u64,
                accepted_by_slot: vec![100; 16],
                eval_s: 3.0,
                best: true,
                elapsed_s: step as f64 * 0.2,
            }
        })
        .collect()
}

/// A validation every 250 steps, each one the best so far.
fn validation_records(steps: usize) -> Vec<ValidationRecord> {
    (1..=steps as u64 / 250)
        .map(|i| {
            let step = i * 250;
            let x = step as f64;
            ValidationRecord {
                step,
                loss: 2.4 + 8.0 / (1.0 + x / 300.0),
                accuracy: 0.5 * (1.0 - (-x / 4000.0).exp()),
                accept_mean: 1.0 + 2.0 * (1.0 - (-x / 5000.0).exp()),
                tau: 1.0 + 1.8 * (1.0 - (-x / 5000.0).exp()),
                sequences: 64,
                answers: 80,
                answer_steps: 4000,
                tokens: (4000.0 * (1.0 + x / 10_000.0)) as u64,
                blocks: 12_000,
                validation_s: 0.8,
                best: true,
                elapsed_s: x * 0.2,
            }
        })
        .collect()
}

/// The two queues, nearly full.
fn queue_levels() -> Vec<QueueLevel> {
    vec![
        QueueLevel {
            name: QueueName::Batch,
            len: 3,
            capacity: 4,
            pushed: 100,
            popped: 97,
        },
        QueueLevel {
            name: QueueName::Feature,
            len: 2,
            capacity: 2,
            pushed: 97,
            popped: 95,
        },
    ]
}

/// `gpus` busy H200s.
fn gpu_readings(gpus: usize) -> Vec<GpuReading> {
    (0..gpus as u32)
        .map(|i| GpuReading {
            index: i,
            name: "NVIDIA H200".into(),
            utilization_pct: Some(90 + i % 10),
            memory_used_bytes: Some(60 << 30),
            memory_total_bytes: Some(141 << 30),
            power_watts: Some(600.0),
            power_limit_watts: Some(700.0),
            temperature_c: Some(60),
        })
        .collect()
}
