//! The staged trainer end to end on CPU with a tiny random target: learning, pause/resume,
//! queue resizing without losing or duplicating samples, bit-identical resume, failures, and a
//! storm of commands.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_tui::config::{self, GradSync, TrainConfig};
use dflash_tui::pipeline::command::Command;
use dflash_tui::pipeline::queue::QueueName;
use dflash_tui::pipeline::trainer::{self, RunOutcome, TrainerHandle};
use dflash_tui::runtime::TorchRuntime;
use dflash_tui::telemetry::records::{
    read_metrics, EventKind, MetricsRecord, Phase, Snapshot, StepRecord, ValidationRecord,
};

type Setup = common::TinyRun;

fn setup(rows: usize) -> Setup {
    common::tiny_run(rows, 5)
}

fn tiny_config(s: &Setup, extra: &[&str]) -> TrainConfig {
    let mut overrides = vec![
        format!("model.target={}", s.target.display()),
        format!("data.path={}", s.data.display()),
    ];
    overrides.extend(extra.iter().map(|e| e.to_string()));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    config::load(&path, &overrides).unwrap()
}

fn start(cfg: &TrainConfig, run_dir: &Path, resume: bool) -> TrainerHandle {
    std::fs::create_dir_all(run_dir).unwrap();
    trainer::start(&TorchRuntime::init(), cfg, run_dir, resume).unwrap()
}

fn wait_for(
    handle: &TrainerHandle,
    what: &str,
    limit: Duration,
    cond: impl Fn(&TrainerHandle) -> bool,
) {
    let t = Instant::now();
    while !cond(handle) {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Joins with a deadline: a hang fails the test instead of blocking it.
fn join_within(handle: TrainerHandle, limit: Duration) -> RunOutcome {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(handle.join());
    });
    rx.recv_timeout(limit)
        .expect("the trainer did not finish: deadlock")
}

fn steps(run_dir: &Path) -> Vec<StepRecord> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Step(s) => Some(s),
            _ => None,
        })
        .collect()
}

#[test]
fn loss_falls_on_a_small_repeated_dataset() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=80",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let st = steps(&run);
    assert_eq!(st.len(), 80);
    let mean = |xs: &[StepRecord], f: fn(&StepRecord) -> f64| {
        xs.iter().map(f).sum::<f64>() / xs.len() as f64
    };
    let (first, last) = (&st[..10], &st[70..]);
    let (l0, l1) = (mean(first, |x| x.loss), mean(last, |x| x.loss));
    let (a0, a1) = (mean(first, |x| x.accuracy), mean(last, |x| x.accuracy));
    let (t0, t1) = (
        mean(first, |x| x.accept_mean),
        mean(last, |x| x.accept_mean),
    );
    eprintln!(
        "loss {l0:.3} -> {l1:.3}, accuracy {a0:.3} -> {a1:.3}, accept_mean {t0:.2} -> {t1:.2}"
    );
    assert!(l1 < 0.6 * l0, "loss {l0} -> {l1}");
    assert!(a1 > a0 + 0.2, "accuracy {a0} -> {a1}");
    assert!(t1 > t0 + 0.5, "accept_mean {t0} -> {t1}");
    // the final checkpoint is a servable drafter folder
    let ckpt = out.last_checkpoint.unwrap();
    assert!(ckpt.join("drafter/config.json").is_file());
    assert!(ckpt.join("drafter/model.safetensors").is_file());
}

#[test]
fn pause_stops_progress_and_resume_continues() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &["train.total_steps=100000", "checkpoint.save_every_steps=0"],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    wait_for(&h, "step 3", Duration::from_secs(60), |h| {
        h.snapshot().step >= 3
    });
    h.command(&Command::Pause).unwrap();
    // The step in flight completes (on a loaded machine that can take seconds); then the pause
    // takes hold between steps and its event says at which step the count stays.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let paused_at = loop {
        let at = checkpoint_events(&run, EventKind::Paused)
            .first()
            .and_then(|m| {
                m.strip_prefix("paused at step ")?
                    .split(':')
                    .next()?
                    .parse::<u64>()
                    .ok()
            });
        if let Some(at) = at {
            break at;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the pause never took hold"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        h.snapshot().step,
        paused_at,
        "the status is at the paused step"
    );
    // While paused: no rate, and an ETA that waits instead of growing as the window empties.
    let before = h.snapshot();
    // an interval is what is checked here (nothing happens in it), so a sleep: no event to await
    std::thread::sleep(Duration::from_millis(1500));
    let after = h.snapshot();
    assert_eq!(after.step, paused_at, "steps advanced while paused");
    // A poll that has the records up to a step gets only those after it.
    let steps = |s: &Snapshot| -> Vec<u64> { s.history.iter().map(|r| r.step).collect() };
    assert_eq!(steps(&after).last(), Some(&paused_at));
    assert_eq!(
        steps(&h.snapshot_since(paused_at - 2)),
        [paused_at - 1, paused_at]
    );
    let none_new = h.snapshot_since(paused_at);
    assert!(none_new.history.is_empty(), "{:?}", steps(&none_new));
    assert_eq!((none_new.step, none_new.phase), (paused_at, Phase::Paused));
    assert_eq!(after.phase, Phase::Paused);
    assert_eq!((before.tokens_per_s, after.tokens_per_s), (0.0, 0.0));
    assert!(before.eta_s.is_some(), "{before:?}");
    assert_eq!(after.eta_s, before.eta_s, "the ETA held still while paused");
    h.command(&Command::Resume).unwrap();
    // at once after the resume: the pace from before the pause
    let resumed = h.snapshot();
    assert!(resumed.tokens_per_s > 0.0, "{resumed:?}");
    let (was, is) = (before.eta_s.unwrap(), resumed.eta_s.unwrap());
    assert!(
        (is - was).abs() <= 0.05 * was,
        "ETA {was} s before, {is} s after"
    );
    wait_for(&h, "progress after resume", Duration::from_secs(60), |h| {
        h.snapshot().step >= paused_at + 3
    });
    h.command(&Command::Stop { checkpoint: true }).unwrap();
    let out = join_within(h, Duration::from_secs(60));
    // stopped long before its last step: stopped, not finished, in the outcome and the records
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert_eq!(out.total_steps, 100_000);
    assert!(out.last_checkpoint.is_some(), "stop writes a checkpoint");
    let summary = records(&run, |r| match r {
        MetricsRecord::Summary { phase, steps, .. } => Some((phase, steps)),
        _ => None,
    });
    assert_eq!(summary, vec![(Phase::Stopped, out.steps)]);
}

#[test]
fn resizing_queues_neither_loses_nor_duplicates_samples() {
    let s = setup(400);
    // Batches of one epoch: the run ends exactly at the epoch boundary.
    let probe = tiny_config(&s, &[]);
    let store = Arc::new(
        dflash_tui::data::store::TokenStore::load(
            &s.data,
            &dflash_tui::data::store::DataColumns::default(),
            &dflash_tui::data::store::StoreOptions {
                vocab_size: 50,
                max_len: probe.data.max_len,
                min_loss_tokens: 8,
                max_samples: 0,
            },
        )
        .unwrap()
        .0,
    );
    let mut packer = dflash_tui::data::packer::Packer::new(
        store.clone(),
        dflash_tui::data::packer::PackerConfig {
            token_budget: probe.data.token_budget,
            max_batch: probe.data.max_batch,
            window: probe.data.bucket_window,
            seed: probe.run.seed,
        },
    );
    let mut epoch_batches = 0;
    while packer.next().unwrap().epoch == 0 {
        epoch_batches += 1;
    }
    let cfg = tiny_config(
        &s,
        &[
            &format!("train.total_steps={epoch_batches}"),
            "checkpoint.save_every_steps=0",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    let mut k = 0;
    while !h.is_finished() {
        let depth = 1 + (k * 7) % 5;
        let name = if k % 2 == 0 {
            QueueName::Batch
        } else {
            QueueName::Feature
        };
        let _ = h.command(&Command::Queue { name, depth });
        if k == 3 {
            let levels = h.shared.queue_levels();
            assert!(
                levels.iter().any(|q| q.capacity == depth),
                "capacity change visible"
            );
        }
        k += 1;
        std::thread::sleep(Duration::from_millis(30));
    }
    let visits: Vec<u32> = h
        .shared
        .sample_visits
        .iter()
        .map(|v| v.load(Ordering::Relaxed))
        .collect();
    let out = join_within(h, Duration::from_secs(60));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    assert!(k > 5, "the queues were resized while running");
    assert_eq!(visits.len(), store.len());
    assert!(
        visits.iter().all(|&v| v == 1),
        "each sample exactly once: {visits:?}"
    );
}

fn records<T>(run_dir: &Path, pick: impl Fn(MetricsRecord) -> Option<T>) -> Vec<T> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(pick)
        .collect()
}

fn validations(run_dir: &Path) -> Vec<ValidationRecord> {
    records(run_dir, |r| match r {
        MetricsRecord::Validation(v) => Some(v),
        _ => None,
    })
}

/// A 40-step run, and the same run dying at step 21 (after the checkpoint at 20) and resumed,
/// with `extra` settings: the same losses after the resume, bit for bit, and the same final
/// drafter and optimizer files. Returns the two run directories.
fn resume_is_bit_identical(s: &Setup, extra: &[&str]) -> (PathBuf, PathBuf) {
    let mut base = vec![
        "train.total_steps=40",
        "checkpoint.save_every_steps=20",
        "telemetry.profile_interval_s=0",
    ];
    base.extend(extra);
    // A: uninterrupted
    let run_a = s.tmp.path().join("a");
    let out = join_within(
        start(&tiny_config(s, &base), &run_a, false),
        Duration::from_secs(240),
    );
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    // B: the same run dies at step 21 (after the checkpoint at 20), then resumes
    let run_b = s.tmp.path().join("b");
    let mut failing: Vec<&str> = base.to_vec();
    failing.extend(["debug.fail_at_step=21", "debug.fail_stage=drafter"]);
    let out = join_within(
        start(&tiny_config(s, &failing), &run_b, false),
        Duration::from_secs(240),
    );
    assert_eq!(out.phase, Phase::Failed);
    let out = join_within(
        start(&tiny_config(s, &base), &run_b, true),
        Duration::from_secs(240),
    );
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let a = steps(&run_a);
    // The first attempt's step 21 (after its last checkpoint) is dropped from metrics.jsonl on
    // the resume: each step is recorded once.
    let all_b = steps(&run_b);
    let numbers: Vec<u64> = all_b.iter().map(|r| r.step).collect();
    assert_eq!(numbers, (1..=40).collect::<Vec<u64>>(), "each step once");
    let b: Vec<StepRecord> = all_b.into_iter().skip(20).collect();
    assert_eq!(b.first().map(|r| r.step), Some(21));
    let a_tail: Vec<(u64, u64, u64)> = a[20..]
        .iter()
        .map(|r| (r.step, r.loss.to_bits(), r.accuracy.to_bits()))
        .collect();
    let b_tail: Vec<(u64, u64, u64)> = b
        .iter()
        .map(|r| (r.step, r.loss.to_bits(), r.accuracy.to_bits()))
        .collect();
    assert_eq!(a_tail.len(), 20);
    assert_eq!(
        a_tail, b_tail,
        "losses after resume differ from the uninterrupted run"
    );
    let last = |run: &Path, file: &str| {
        std::fs::read(run.join("checkpoints/step-000040").join(file)).unwrap()
    };
    for file in ["drafter/model.safetensors", "optimizer.safetensors"] {
        assert!(
            last(&run_a, file) == last(&run_b, file),
            "{file} differs after resume"
        );
    }
    (run_a, run_b)
}

#[test]
fn checkpoint_and_resume_give_bit_identical_losses() {
    resume_is_bit_identical(&setup(24), &[]);
}

#[test]
fn validation_changes_nothing_of_training_and_resumes_bit_identical() {
    // Validation passes (every 10 steps, and at the end) between the steps of both runs: the
    // training numbers, the files and the passes after the resume stay the same bit for bit.
    let s = setup(24);
    let (run_a, run_b) = resume_is_bit_identical(
        &s,
        &[
            "validation.every_steps=10",
            "validation.sequences=4",
            "validation.max_new_tokens=16",
        ],
    );
    let key = |v: &ValidationRecord| {
        (
            v.step,
            v.loss.to_bits(),
            v.accuracy.to_bits(),
            v.accept_mean.to_bits(),
            v.tau.to_bits(),
            v.answer_steps,
            v.best,
        )
    };
    let a: Vec<_> = validations(&run_a).iter().map(key).collect();
    let b: Vec<_> = validations(&run_b).iter().map(key).collect();
    assert_eq!(
        a.iter().map(|k| k.0).collect::<Vec<_>>(),
        vec![10, 20, 30, 40]
    );
    // B: 10 and 20 before the failure, 30 and 40 after the resume
    assert_eq!(a, b);
    let best = |run: &Path| std::fs::read_to_string(run.join("best/eval.json")).unwrap();
    assert_eq!(best(&run_a), best(&run_b));
    // and without validation the losses are the same as with it
    let plain = s.tmp.path().join("plain");
    let cfg = tiny_config(
        &s,
        &["train.total_steps=40", "telemetry.profile_interval_s=0"],
    );
    let out = join_within(start(&cfg, &plain, false), Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let losses = |run: &Path| -> Vec<u64> { steps(run).iter().map(|r| r.loss.to_bits()).collect() };
    assert_eq!(losses(&plain), losses(&run_a));
}

#[test]
fn a_failing_stage_stops_cleanly_and_keeps_the_last_checkpoint() {
    // The loader runs ahead of training by the queue depths: it fails at a later batch.
    for (stage, at) in [("target", 12), ("drafter", 8), ("loader", 24)] {
        let s = setup(24);
        let cfg = tiny_config(
            &s,
            &[
                "train.total_steps=1000",
                "checkpoint.save_every_steps=3",
                &format!("debug.fail_at_step={at}"),
                &format!("debug.fail_stage={stage}"),
            ],
        );
        let run = s.tmp.path().join("run");
        let out = join_within(start(&cfg, &run, false), Duration::from_secs(120));
        assert_eq!(out.phase, Phase::Failed, "{stage}");
        let err = out.error.unwrap();
        assert!(
            err.contains("injected failure") && err.contains(stage),
            "{err}"
        );
        let latest = dflash_tui::train::checkpoint::latest_checkpoint(&run).unwrap();
        let state = dflash_tui::train::checkpoint::read_state(&latest).unwrap();
        assert!(
            state.step >= 3 && state.step.is_multiple_of(3),
            "{stage}: {state:?}"
        );
        dflash_tui::model::Drafter::load(
            &latest.join("drafter"),
            tch::Device::Cpu,
            tch::Kind::Float,
        )
        .unwrap();
    }
}

fn checkpoint_events(run: &Path, kind: EventKind) -> Vec<String> {
    read_metrics(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Event {
                kind: k, message, ..
            } if k == kind => Some(message),
            _ => None,
        })
        .collect()
}

#[test]
fn a_failed_checkpoint_keeps_the_previous_one_and_training_goes_on() {
    // Two checkpoints fail (a full disk after the drafter is written): the run goes on, the
    // previous checkpoint stays, the checkpoint is tried again 1 and then 2 steps later and
    // works on the third try.
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=14",
            "checkpoint.save_every_steps=4",
            "debug.fail_at_step=6",
            "debug.fail_stage=checkpoint",
            "debug.fail_count=2",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(120));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    assert_eq!(out.steps, 14);
    let failed = checkpoint_events(&run, EventKind::CheckpointFailed);
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed[0].contains("step 8")
            && failed[0].contains("No space left on device")
            && failed[0].contains("previous checkpoint is kept")
            && failed[0].contains("tried again at step 9"),
        "{failed:?}"
    );
    assert!(failed[1].contains("tried again at step 11"), "{failed:?}");
    let saved = checkpoint_events(&run, EventKind::Checkpoint);
    assert!(
        saved.iter().any(|m| m.contains("(retry) at step 11")),
        "{saved:?}"
    );
    let latest = dflash_tui::train::checkpoint::latest_checkpoint(&run).unwrap();
    assert!(latest.ends_with("step-000014"), "{}", latest.display());
    let leftovers: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_final_checkpoint_that_fails_fails_the_run_and_keeps_the_previous_one() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=10",
            "checkpoint.save_every_steps=4",
            "debug.fail_at_step=6",
            "debug.fail_stage=checkpoint",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(120));
    assert_eq!(out.phase, Phase::Failed);
    let err = out.error.unwrap();
    assert!(
        err.contains("No space left on device")
            && err.contains("the final checkpoint failed")
            && err.contains("step-000004"),
        "{err}"
    );
    let latest = dflash_tui::train::checkpoint::latest_checkpoint(&run).unwrap();
    assert!(latest.ends_with("step-000004"), "{}", latest.display());
    // and the run resumes from it
    let out = join_within(
        start(&cfg_without_faults(&s), &run, true),
        Duration::from_secs(120),
    );
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
}

fn cfg_without_faults(s: &Setup) -> TrainConfig {
    tiny_config(
        s,
        &["train.total_steps=10", "checkpoint.save_every_steps=4"],
    )
}

#[test]
fn a_storm_of_random_commands_ends_without_deadlock() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=1000000",
            "checkpoint.save_every_steps=0",
            "checkpoint.keep_checkpoints=2",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    let mut rng = common::Lcg(99);
    let t = Instant::now();
    let mut sent = 0;
    while t.elapsed() < Duration::from_secs(30) {
        let cmd = match rng.next_u32() % 9 {
            0 | 1 => Command::Pause,
            2 | 3 => Command::Resume,
            4 => Command::Queue {
                name: QueueName::Batch,
                depth: 1 + (rng.next_u32() % 6) as usize,
            },
            5 => Command::Queue {
                name: QueueName::Feature,
                depth: 1 + (rng.next_u32() % 6) as usize,
            },
            6 => Command::Checkpoint,
            7 => Command::Profile {
                seconds: (rng.next_u32() % 3) as f64,
            },
            // refused (a queue name that is none is refused as the command is parsed)
            _ => Command::Queue {
                name: QueueName::Batch,
                depth: 0,
            },
        };
        let _ = h.command(&cmd);
        if rng.next_u32().is_multiple_of(10) {
            let _ = h.profile_report();
            let _ = h.snapshot();
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis((rng.next_u32() % 20) as u64));
    }
    assert!(h.snapshot().step > 0, "training advanced during the storm");
    h.command(&Command::Stop { checkpoint: true }).unwrap();
    let out = join_within(h, Duration::from_secs(60));
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert!(sent > 500);
}

#[test]
fn two_drafter_replicas_average_gradients_and_learn() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=40",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
            "devices.drafter_devices=[\"cpu\", \"cpu\"]",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let st = steps(&run);
    assert_eq!(st.len(), 40);
    let first: f64 = st[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    let last: f64 = st[35..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    assert!(last < 0.7 * first, "loss {first} -> {last}");
    // devices.grad_sync = "auto" (the default) takes the copy path on CPU devices
    assert_eq!(cfg.devices.grad_sync, GradSync::Auto);
    let sync = grad_sync_events(&run);
    assert_eq!(sync.len(), 1, "{sync:?}");
    assert!(sync[0].starts_with("gradient sync: copy ("), "{sync:?}");
    assert!(sync[0].contains("the CPU"), "{sync:?}");
}

/// The messages of the `grad_sync` events (what gradient synchronisation a run uses, and why).
fn grad_sync_events(run_dir: &Path) -> Vec<String> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Event {
                kind: EventKind::GradSync,
                message,
                ..
            } => Some(message),
            _ => None,
        })
        .collect()
}

#[test]
fn nccl_gradient_sync_is_refused_before_training_where_it_cannot_work() {
    let s = setup(24);
    // "cpu" is refused when the configuration is read ...
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let e = config::load(
        &path,
        &[
            "devices.grad_sync=nccl".to_string(),
            "devices.drafter_devices=cpu,cpu".to_string(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("devices.grad_sync = \"nccl\" needs CUDA drafter devices")
            && e.contains("devices.drafter_devices[0] = \"cpu\""),
        "{e}"
    );
    // ... and "auto" devices when they resolve: to the CPU here, or twice to one GPU.
    let cfg = tiny_config(
        &s,
        &[
            "devices.grad_sync=nccl",
            "devices.drafter_devices=auto,auto",
            "train.total_steps=5",
        ],
    );
    let run = s.tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let e = match trainer::start(&TorchRuntime::init(), &cfg, &run, false) {
        Ok(h) => {
            h.abort();
            panic!(
                "the run started: {:?}",
                join_within(h, Duration::from_secs(60))
            );
        }
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.starts_with("config: devices.grad_sync = \"nccl\" needs")
            && e.contains("devices.drafter_devices[")
            && e.contains("\"auto\""),
        "{e}"
    );
    // nothing was written: the configuration was refused before the run started
    assert!(!run.join("metrics.jsonl").exists());
}

/// `cargo test --release -- --ignored nccl` on a machine with two GPUs: two replicas whose
/// gradients are summed and weights handed back by NCCL learn like the copy path, and a pause,
/// a resume and a stop in the middle of training end cleanly.
#[test]
#[ignore = "needs 2 CUDA devices and libnccl"]
fn nccl_two_gpu_replicas_learn_pause_and_stop_cleanly() {
    let runtime = TorchRuntime::init();
    assert!(
        runtime.cuda_devices() >= 2,
        "this test needs 2 CUDA devices ({} usable)",
        runtime.cuda_devices()
    );
    let s = setup(24);
    let run = |sync: &str, dtype: &str, dir: &str| {
        let cfg = tiny_config(
            &s,
            &[
                "train.total_steps=40",
                "train.lr=1e-2",
                "checkpoint.save_every_steps=0",
                "devices.target_devices=cuda:0",
                "devices.drafter_devices=cuda:0,cuda:1",
                &format!("devices.grad_sync={sync}"),
                &format!("model.dtype={dtype}"),
            ],
        );
        let run = s.tmp.path().join(dir);
        let out = join_within(start(&cfg, &run, false), Duration::from_secs(300));
        assert_eq!(
            out.phase,
            Phase::Finished,
            "{sync} {dtype}: {:?}",
            out.error
        );
        let events = grad_sync_events(&run);
        assert_eq!(events.len(), 1, "{events:?}");
        assert!(
            events[0].starts_with(&format!("gradient sync: {sync} (")),
            "{events:?}"
        );
        let st = steps(&run);
        assert_eq!(st.len(), 40);
        let first: f64 = st[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
        let last: f64 = st[35..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
        eprintln!("{sync} {dtype}: loss {first:.3} -> {last:.3}");
        assert!(last < 0.7 * first, "{sync} {dtype}: loss {first} -> {last}");
    };
    run("nccl", "f32", "nccl-f32");
    run("nccl", "bf16", "nccl-bf16");
    run("copy", "bf16", "copy-bf16");

    // pause, resume and stop between and during collectives
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=100000",
            "checkpoint.save_every_steps=0",
            "devices.target_devices=cuda:0",
            "devices.drafter_devices=cuda:0,cuda:1",
            "devices.grad_sync=nccl",
        ],
    );
    let dir = s.tmp.path().join("nccl-stop");
    let h = start(&cfg, &dir, false);
    wait_for(&h, "step 5", Duration::from_secs(120), |h| {
        h.snapshot().step >= 5
    });
    h.command(&Command::Pause).unwrap();
    wait_for(&h, "the pause to take hold", Duration::from_secs(120), |h| {
        h.snapshot().phase == Phase::Paused
    });
    h.command(&Command::Resume).unwrap();
    let at = h.snapshot().step;
    wait_for(&h, "progress after resume", Duration::from_secs(120), |h| {
        h.snapshot().step >= at + 3
    });
    h.command(&Command::Stop { checkpoint: true }).unwrap();
    let out = join_within(h, Duration::from_secs(120));
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert!(out.last_checkpoint.is_some());
}

#[test]
fn periodic_evaluation_records_tau_and_keeps_the_best_drafter() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=35",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
            "eval.every_steps=10",
            "eval.prompts=3",
            "eval.max_new_tokens=9",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    let out = join_within(h, Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let evals: Vec<_> = read_metrics(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Eval(e) => Some(e),
            _ => None,
        })
        .collect();
    // every 10 steps, and the last weights at the end of the run
    assert_eq!(
        evals.iter().map(|e| e.step).collect::<Vec<_>>(),
        vec![10, 20, 30, 35]
    );
    let block = cfg.model.block_size as u64;
    for e in &evals {
        assert_eq!(e.prompts, 3);
        assert_eq!(e.accepted_by_slot.len() as u64, block);
        // every step takes the bonus token; the slots sum to the accepted tokens
        assert_eq!(e.accepted_by_slot[0], e.decode_steps);
        let accepted: u64 = e.accepted_by_slot.iter().sum();
        assert!((e.tau - accepted as f64 / e.decode_steps as f64).abs() < 1e-9);
        assert!(e.tau >= 1.0 && e.tau <= block as f64);
        // 9 tokens per prompt: the prefill's first plus at least one per step
        assert!(e.generated_tokens <= 27 && e.decode_steps >= 3);
    }
    // "best" marks each new maximum; best/ holds the drafter of the highest tau
    let mut best = f64::NEG_INFINITY;
    for e in &evals {
        assert_eq!(e.best, e.tau > best, "step {}", e.step);
        best = best.max(e.tau);
    }
    let top = evals.iter().rfind(|e| e.best).unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/eval.json")).unwrap())
            .unwrap();
    assert_eq!(saved["step"], top.step);
    assert!((saved["tau"].as_f64().unwrap() - top.tau).abs() < 1e-12);
    let target = dflash_tui::model::TargetConfig::from_model_dir(&s.target).unwrap();
    dflash_tui::model::Drafter::load_for_target(
        &run.join("best/drafter"),
        &target,
        tch::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap();
}

#[test]
fn validation_records_the_walk_tau_and_keeps_the_best_drafter() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=20",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
            "eval.every_steps=10",
            "eval.prompts=2",
            "eval.max_new_tokens=9",
            "validation.every_steps=4",
            "validation.sequences=5",
            "validation.max_new_tokens=16",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    wait_for(&h, "the end of the run", Duration::from_secs(240), |h| {
        h.is_finished()
    });
    // The passes are the drafter worker's time: rows of their own in ProfileStats.
    let report = h.profile_report();
    let count = |e: &str| {
        let row = report.rows.iter().find(|r| r.event.name() == e);
        row.map_or(0, |r| r.cumulative.count)
    };
    assert_eq!((count("validation.pass"), count("eval.pass")), (6, 2));
    let out = join_within(h, Duration::from_secs(60));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    assert_eq!(out.stop_reason, None);
    let vals = validations(&run);
    // every 4 steps and at every evaluation (10, 20)
    assert_eq!(
        vals.iter().map(|v| v.step).collect::<Vec<_>>(),
        vec![4, 8, 10, 12, 16, 20]
    );
    let block = cfg.model.block_size as f64;
    let mut best = f64::NEG_INFINITY;
    for v in &vals {
        assert_eq!(v.sequences, 5);
        assert!(v.answers >= 5 && v.answer_steps >= v.answers, "{v:?}");
        assert!(v.loss.is_finite() && v.loss > 0.0, "{v:?}");
        assert!((0.0..=1.0).contains(&v.accuracy), "{v:?}");
        assert!((1.0..=block).contains(&v.accept_mean), "{v:?}");
        assert!((1.0..=block).contains(&v.tau), "{v:?}");
        assert_eq!(v.tau, v.tokens as f64 / v.answer_steps as f64);
        // at most 16 tokens into each answer
        assert!(v.tokens <= 16 * v.answers, "{v:?}");
        assert_eq!(v.best, v.tau > best, "step {}", v.step);
        best = best.max(v.tau);
    }
    // with validation on, best/ follows the walk tau, not the decoded one
    let evals: Vec<_> = records(&run, |r| match r {
        MetricsRecord::Eval(e) => Some(e),
        _ => None,
    });
    assert_eq!(
        evals.iter().map(|e| e.step).collect::<Vec<_>>(),
        vec![10, 20]
    );
    assert!(evals.iter().all(|e| !e.best));
    let top = vals.iter().rfind(|v| v.best).unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/eval.json")).unwrap())
            .unwrap();
    assert_eq!(saved["rule"], "validation_walk_tau");
    assert_eq!(saved["step"], top.step);
    assert_eq!(saved["sequences"], 5);
    assert!((saved["tau"].as_f64().unwrap() - top.tau).abs() < 1e-12);
    // the log line says what was measured
    let events: Vec<String> = records(&run, |r| match r {
        MetricsRecord::Event {
            kind: EventKind::Validation,
            message,
            ..
        } => Some(message),
        _ => None,
    });
    assert_eq!(events.len(), vals.len());
    assert!(
        events[0].starts_with("validation at step 4: loss ") && events[0].contains("tau(walk)"),
        "{}",
        events[0]
    );
}

#[test]
fn patience_stops_a_run_that_no_longer_improves_with_a_checkpoint() {
    // A learning rate too small to move an fp32 weight: every pass measures the same tau, so
    // after the first (the best) two more without a new best end the run at step 6 of 200.
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=200",
            "train.lr=1e-12",
            "checkpoint.save_every_steps=0",
            "validation.every_steps=2",
            "validation.sequences=3",
            "validation.patience=2",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert_eq!(out.steps, 6);
    let reason = out.stop_reason.clone().unwrap();
    assert!(
        reason.starts_with("early stop at step 6: no new best validation tau in 2 passes"),
        "{reason}"
    );
    assert!(reason.contains("validation.patience = 2"), "{reason}");
    let ckpt = out.last_checkpoint.unwrap();
    assert!(ckpt.ends_with("step-000006"), "{}", ckpt.display());
    assert_eq!(
        std::fs::read_link(run.join("checkpoints/latest")).unwrap(),
        PathBuf::from("step-000006")
    );
    let vals = validations(&run);
    assert_eq!(
        vals.iter().map(|v| (v.step, v.best)).collect::<Vec<_>>(),
        vec![(2, true), (4, false), (6, false)]
    );
    let summary = records(&run, |r| match r {
        MetricsRecord::Summary {
            phase, stop_reason, ..
        } => Some((phase, stop_reason)),
        _ => None,
    });
    assert_eq!(summary, vec![(Phase::Stopped, Some(reason.clone()))]);
    let early: Vec<String> = records(&run, |r| match r {
        MetricsRecord::Event {
            kind: EventKind::EarlyStop,
            message,
            ..
        } => Some(message),
        _ => None,
    });
    assert_eq!(early, vec![reason]);
}

#[test]
fn chunked_and_dense_attention_give_the_same_loss_curve_on_the_demo_data() {
    // The real SmolLM2 target on the demo chat data, 50 steps with each exact formulation of
    // the training attention (same seeds, same batches, same anchors).
    let data = common::require_demo(&common::demo_dir().join("sharegpt-smollm2"));
    let target = common::require_demo(&common::demo_dir().join("SmolLM2-135M-Instruct"));
    let tmp = tempfile::tempdir().unwrap();
    let run = |attention: &str| -> Vec<StepRecord> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/demo-cpu.toml");
        let cfg = config::load(
            &path,
            &[
                format!("model.target={}", target.display()),
                format!("data.path={}", data.display()),
                "train.total_steps=50".into(),
                "checkpoint.save_every_steps=0".into(),
                "eval.every_steps=0".into(),
                "validation.every_steps=0".into(),
                format!("train.attention={attention}"),
            ],
        )
        .unwrap();
        let dir = tmp.path().join(attention.replace(':', "-"));
        let out = join_within(start(&cfg, &dir, false), Duration::from_secs(900));
        assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
        steps(&dir)
    };
    let dense = run("dense");
    let chunked = run("chunked:2");
    assert_eq!(dense.len(), 50);
    assert_eq!(chunked.len(), 50);
    let mut worst = 0.0f64;
    for (d, c) in dense.iter().zip(&chunked) {
        assert_eq!(d.tokens, c.tokens, "same batches");
        assert_eq!(d.blocks, c.blocks, "same anchors");
        let rel = (d.loss - c.loss).abs() / d.loss.abs();
        worst = worst.max(rel);
        assert!(
            rel < 1e-3,
            "step {}: loss {} (dense) vs {} (chunked)",
            d.step,
            d.loss,
            c.loss
        );
    }
    eprintln!(
        "loss {:.4} -> {:.4} (dense), {:.4} -> {:.4} (chunked); largest relative difference {worst:.2e}",
        dense[0].loss, dense[49].loss, chunked[0].loss, chunked[49].loss
    );
    assert!(dense[49].loss < dense[0].loss, "it learns");
}
