//! The staged trainer end to end on CPU with a tiny random target: learning, pause/resume,
//! queue resizing without losing or duplicating samples, bit-identical resume, failures, and a
//! storm of commands.

use crate::common;

mod evaluation;
mod failures;
mod replicas;
mod streams;

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
