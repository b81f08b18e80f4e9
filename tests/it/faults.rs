//! Faults a long run meets, through the real binary on the CPU with a tiny model: kill -9
//! during checkpoints, a kill between a checkpoint and `latest`, a reused step folder, a panic
//! in each stage, two trainers on one run directory, a resume that would change the model, a
//! corrupt data position, checkpoints that fail their verification (a flipped bit, a
//! non-finite weight, a cut or lost servable drafter, a false trainer state, no manifest). Each case prints its trials and outcomes (`--nocapture`). Events are
//! awaited by reading the run's output, never by sleeping.

use crate::common;

mod damaged_checkpoints;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use dflash_tui::telemetry::records::{read_metrics, EventKind, MetricsRecord};
use dflash_tui::train::checkpoint::{
    latest_checkpoint, list_checkpoints, newest_checkpoint, read_state,
};
use dflash_tui::train::manifest::ManifestCheck;

/// `train` on the tiny inputs in `run_dir`, with `--set` overrides.
fn train_args(i: &common::TinyRun, run_dir: &Path, set: &[&str]) -> Vec<String> {
    common::tiny_train_args(i, run_dir, set)
}

fn resume_args(run_dir: &Path) -> Vec<String> {
    vec![
        "train".into(),
        "--resume".into(),
        run_dir.display().to_string(),
        "--no-tui".into(),
    ]
}

/// A trainer process whose stderr (the log) and stdout arrive line by line.
struct Run {
    child: Child,
    lines: common::Lines,
}

impl Run {
    fn start(args: &[String]) -> Run {
        let mut child = common::spawn_dflash(args, Stdio::piped());
        let lines = common::Lines::merged(&mut child);
        Run { child, lines }
    }

    /// Reads output until a line contains `pattern` (the `count`-th such line); panics after
    /// `limit`.
    fn wait_for(&mut self, pattern: &str, count: usize, limit: Duration) -> String {
        let mut found = self
            .lines
            .seen
            .iter()
            .filter(|l| l.contains(pattern))
            .count();
        self.lines
            .next_with(&format!("{pattern:?}"), limit, |line| {
                found += usize::from(line.contains(pattern));
                line.contains(pattern) && found >= count
            })
    }

    fn kill9(mut self) {
        // SAFETY: a signal to our own child.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }

    /// Waits for the process to end (within `limit`); its exit code and all its output.
    fn finish(mut self, limit: Duration) -> (i32, String) {
        // the output ends when the process does
        let out = self.lines.all(limit);
        let code = self.child.wait().unwrap().code().unwrap_or(-1);
        (code, out)
    }

    fn stop(mut self, limit: Duration) -> (i32, String) {
        use std::io::Write;
        if let Some(stdin) = self.child.stdin.as_mut() {
            let _ = writeln!(stdin, "stop");
        }
        self.finish(limit)
    }
}

impl Drop for Run {
    /// A test that fails mid-way leaves no trainer running behind it.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The newest checkpoint loads: its drafter in the public format, its optimizer state and its
/// trainer state. Returns its step.
fn newest_loads(run_dir: &Path) -> u64 {
    let ckpt = newest_checkpoint(run_dir).unwrap();
    let state = read_state(&ckpt).unwrap();
    dflash_tui::model::Drafter::load(&ckpt.join("drafter"), tch::Device::Cpu, tch::Kind::Float)
        .unwrap();
    let opt = std::fs::read(ckpt.join("optimizer.safetensors")).unwrap();
    safetensors::SafeTensors::deserialize(&opt).unwrap();
    state.step
}

fn step_records(run_dir: &Path) -> Vec<u64> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Step(s) => Some(s.step),
            _ => None,
        })
        .collect()
}

fn hidden_leftovers(run_dir: &Path) -> Vec<String> {
    [run_dir.to_path_buf(), run_dir.join("checkpoints")]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != ".lock")
        .collect()
}

const LIMIT: Duration = Duration::from_secs(90);

/// A resume of `run_dir` whose checkpoint of step `hold_at` stops for good at a point of its
/// writing (`debug.fail_mode` hold-*), or none with `hold` None.
fn resume_holding(run_dir: &Path, hold: Option<(&str, u64)>) -> Vec<String> {
    let mut args = resume_args(run_dir);
    let (mode, at) = hold.unwrap_or(("error", 0));
    for set in [
        "debug.fail_stage=checkpoint".to_string(),
        format!("debug.fail_mode={mode}"),
        format!("debug.fail_at_step={at}"),
    ] {
        args.extend(["--set".into(), set]);
    }
    args
}

#[test]
fn kill_9_during_checkpoints_leaves_a_loadable_newest_checkpoint_and_resume_starts_there() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let set = [
        "train.total_steps=1000000",
        "checkpoint.save_every_steps=1",
        "checkpoint.keep_checkpoints=3",
        "telemetry.profile_interval_s=0",
        "telemetry.log_every_steps=1",
    ];
    let mut run = Run::start(&train_args(&i, &run_dir, &set));
    run.wait_for("checkpoint (periodic) at step", 2, LIMIT);
    run.kill9();
    let mut trials = Vec::new();
    let mut before = newest_loads(&run_dir);
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    // Each kind of kill three times: in the middle of writing the drafter's staging folder,
    // after the optimizer state, between the rename and `latest`, and at a random moment.
    let kinds = ["hold-drafter", "hold-optimizer", "hold-rename", "random"];
    for trial in 0..12 {
        let kind = kinds[trial % kinds.len()];
        let hold_at = before + 2;
        let hold = (kind != "random").then_some((kind, hold_at));
        let mut run = Run::start(&resume_holding(&run_dir, hold));
        let line = run.wait_for("resuming from", 1, LIMIT);
        assert!(
            line.contains(&format!("at step {before}")),
            "trial {trial}: resumed elsewhere than the newest checkpoint {before}: {line}"
        );
        if hold.is_some() {
            run.wait_for("held", 1, LIMIT);
        } else {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            run.wait_for(
                "checkpoint (periodic) at step",
                1 + (rng % 3) as usize,
                LIMIT,
            );
            std::thread::sleep(Duration::from_micros(rng % 20_000));
        }
        run.kill9();
        let leftovers = hidden_leftovers(&run_dir);
        let latest = latest_checkpoint(&run_dir)
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .unwrap_or_default();
        let after = newest_loads(&run_dir);
        match kind {
            "hold-drafter" | "hold-optimizer" => {
                assert_eq!(after, hold_at - 1, "trial {trial} ({kind})");
                assert!(
                    !leftovers.is_empty(),
                    "trial {trial}: no staging folder left"
                );
            }
            "hold-rename" => {
                assert_eq!(after, hold_at, "trial {trial} ({kind})");
                assert_eq!(
                    latest,
                    format!("step-{:06}", hold_at - 1),
                    "latest should lag"
                );
            }
            _ => assert!(after > before, "trial {trial}: no progress"),
        }
        trials.push(format!(
            "{kind}: newest step {after}, latest {latest}, {} leftover(s)",
            leftovers.len()
        ));
        before = after;
    }
    let mut run = Run::start(&resume_holding(&run_dir, None));
    let line = run.wait_for("resuming from", 1, LIMIT);
    assert!(line.contains(&format!("at step {before}")), "{line}");
    run.wait_for(" epoch ", 1, LIMIT); // a step trained after the resume
    let (code, out) = run.stop(LIMIT);
    assert_eq!(code, 0, "{out}");
    assert!(
        hidden_leftovers(&run_dir).is_empty(),
        "{:?}",
        hidden_leftovers(&run_dir)
    );
    assert_eq!(
        latest_checkpoint(&run_dir).unwrap(),
        newest_checkpoint(&run_dir).unwrap()
    );
    // each step recorded once across all the kills
    let records = step_records(&run_dir);
    assert!(
        records.windows(2).all(|w| w[1] == w[0] + 1),
        "steps recorded twice or missing: {records:?}"
    );
    eprintln!(
        "kill -9 during checkpoints, {} trials (each resumed from the newest complete checkpoint, which loaded):\n  {}\n  final resume: staging leftovers removed, latest = newest, {} step records, each once",
        trials.len(),
        trials.join("\n  "),
        records.len()
    );
}

#[test]
fn a_kill_between_a_checkpoint_and_latest_resumes_from_the_newest_and_repairs_latest() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let set = [
        "train.total_steps=8",
        "checkpoint.save_every_steps=2",
        "debug.fail_stage=checkpoint",
        "debug.fail_mode=hold-rename",
        "debug.fail_at_step=6",
    ];
    let mut run = Run::start(&train_args(&i, &run_dir, &set));
    run.wait_for("held", 1, LIMIT);
    run.kill9();
    // step 6 complete, latest still at step 4
    let dir = run_dir.join("checkpoints");
    assert_eq!(
        std::fs::read_link(dir.join("latest")).unwrap(),
        Path::new("step-000004")
    );
    assert!(dir.join("step-000006/trainer_state.json").is_file());
    let mut run = Run::start(&resume_holding(&run_dir, None));
    let line = run.wait_for("resuming from", 1, LIMIT);
    assert!(
        line.contains("step-000006") && line.contains("at step 6"),
        "{line}"
    );
    let (code, out) = run.finish(LIMIT);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("repaired"), "{out}");
    assert!(latest_checkpoint(&run_dir)
        .unwrap()
        .ends_with("step-000008"));
    eprintln!("kill between rename and latest (latest at step 4, step 6 complete): resumed at step 6, latest repaired, run finished at step 8");
}

#[test]
fn a_step_folder_of_an_earlier_run_is_replaced_not_kept() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let set = ["train.total_steps=4", "checkpoint.save_every_steps=2"];
    let (code, out) = Run::start(&train_args(&i, &run_dir, &set)).finish(LIMIT);
    assert_eq!(code, 0, "{out}");
    // A new run cannot start in a run's directory any more; a step folder is met again by a
    // resume from an older checkpoint: here step-000004 is left incomplete (no
    // trainer_state.json, so the resume starts at step 2) and holds a stale file and stale
    // weights.
    let step4 = run_dir.join("checkpoints/step-000004");
    std::fs::remove_file(step4.join("trainer_state.json")).unwrap();
    std::fs::write(step4.join("stale"), b"from the earlier run").unwrap();
    let stale_weights = b"stale weights".to_vec();
    std::fs::write(step4.join("drafter/model.safetensors"), &stale_weights).unwrap();
    let (code, out) = Run::start(&resume_args(&run_dir)).finish(LIMIT);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("at step 2"), "{out}");
    assert!(!step4.join("stale").exists(), "the stale file was kept");
    assert_ne!(
        std::fs::read(step4.join("drafter/model.safetensors")).unwrap(),
        stale_weights,
        "the step folder still holds the earlier weights"
    );
    assert_eq!(newest_loads(&run_dir), 4);
    assert!(
        hidden_leftovers(&run_dir).is_empty(),
        "{:?}",
        hidden_leftovers(&run_dir)
    );
    eprintln!("reused step folder: an incomplete step-000004 with stale files replaced whole by the resumed run's");
}

#[test]
fn a_panic_in_any_stage_ends_the_run_within_seconds_with_the_message() {
    let i = common::tiny_run(32, 3);
    let mut outcomes = Vec::new();
    for (stage, at) in [("loader", 12u64), ("target", 8), ("drafter", 6)] {
        let run_dir = i.tmp.path().join(format!("run-{stage}"));
        let at_step = format!("debug.fail_at_step={at}");
        let fail_stage = format!("debug.fail_stage={stage}");
        let set = [
            "train.total_steps=1000000",
            "checkpoint.save_every_steps=2",
            "debug.fail_mode=panic",
            &at_step,
            &fail_stage,
        ];
        let t = Instant::now();
        let (code, out) =
            Run::start(&train_args(&i, &run_dir, &set)).finish(Duration::from_secs(60));
        let took = t.elapsed();
        assert_eq!(code, 1, "{stage}: {out}");
        assert!(
            out.contains("panicked") && out.contains("injected panic"),
            "{stage}: {out}"
        );
        let errors: Vec<String> = read_metrics(&run_dir.join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .filter_map(|r| match r {
                MetricsRecord::Event {
                    kind: EventKind::Error,
                    message,
                    ..
                } => Some(message),
                _ => None,
            })
            .collect();
        assert!(
            errors.iter().any(|e| e.contains("panicked")),
            "{stage}: {errors:?}"
        );
        let kept = newest_loads(&run_dir);
        assert!(kept >= 2, "{stage}: no checkpoint kept");
        outcomes.push(format!(
            "{stage}: exit 1 in {:.1} s, last checkpoint step {kept}",
            took.as_secs_f64()
        ));
    }
    eprintln!("stage panics: {}", outcomes.join("; "));
}

#[test]
fn a_second_trainer_on_a_run_directory_is_refused_naming_the_first() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let set = [
        "train.total_steps=1000000",
        "checkpoint.save_every_steps=3",
        "telemetry.log_every_steps=1",
    ];
    let mut first = Run::start(&train_args(&i, &run_dir, &set));
    first.wait_for(" epoch ", 1, LIMIT);
    let pid = first.child.id();
    let socket = run_dir.join("control.sock");
    assert!(socket.exists());
    for args in [resume_args(&run_dir), train_args(&i, &run_dir, &set)] {
        let t = Instant::now();
        let (code, out) = Run::start(&args).finish(Duration::from_secs(30));
        assert_ne!(code, 0, "{out}");
        assert!(
            out.contains("another trainer is running") && out.contains(&format!("PID {pid}")),
            "{out}"
        );
        assert!(t.elapsed() < Duration::from_secs(30));
    }
    // the first one is untouched: its socket answers, and it stops cleanly
    assert!(socket.exists());
    let reply = dflash_tui::frontend::socket::send(&run_dir, "pause").unwrap();
    assert!(reply.ok, "{}", reply.message);
    let (code, out) = first.stop(LIMIT);
    assert_eq!(code, 0, "{out}");
    eprintln!("two trainers: the second (resume and fresh) refused naming PID {pid}; the first kept its socket and stopped with exit 0");
}

/// Files of a run directory with their contents (to see that nothing changed).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                todo.push(p);
            } else if p.is_symlink() {
                out.push((
                    p.clone(),
                    std::fs::read_link(&p)
                        .unwrap()
                        .display()
                        .to_string()
                        .into_bytes(),
                ));
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_resume_that_changes_the_model_or_the_schedule_is_refused_before_anything_is_written() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let set = ["train.total_steps=4", "checkpoint.save_every_steps=2"];
    let (code, out) = Run::start(&train_args(&i, &run_dir, &set)).finish(LIMIT);
    assert_eq!(code, 0, "{out}");
    let before = snapshot(&run_dir);
    let with = |extra: &[&str]| {
        let mut args = train_args(&i, &run_dir, extra);
        let at = args.iter().position(|a| a == "--run-dir").unwrap();
        args[at] = "--resume".into();
        args
    };
    let cases: [(&[&str], &str); 3] = [
        (&["model.block_size=8"], "model.block_size: 4 -> 8"),
        (&["data.token_budget=128"], "data.token_budget: 256 -> 128"),
        (&["train.total_steps=10"], "--allow-schedule-change"),
    ];
    for (extra, expect) in cases {
        let (code, out) = Run::start(&with(extra)).finish(LIMIT);
        assert_ne!(code, 0, "{extra:?}: {out}");
        assert!(
            out.contains(expect) && out.contains("nothing in the run directory was changed"),
            "{extra:?}: {out}"
        );
        assert_eq!(
            snapshot(&run_dir),
            before,
            "{extra:?} changed the run directory"
        );
    }
    // a data position its data cannot have (batches_done 1e15) in every checkpoint: refused at
    // once, naming the file and the field
    for (_, ckpt) in list_checkpoints(&run_dir.join("checkpoints")) {
        edit_state(&ckpt, |s| {
            s["packer"]["batches_done"] = serde_json::json!(1_000_000_000_000_000u64)
        });
    }
    let t = Instant::now();
    let (code, out) = Run::start(&resume_args(&run_dir)).finish(Duration::from_secs(30));
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("step-000004/trainer_state.json: field packer.batches_done")
            && out.contains("step-000002/trainer_state.json: field packer.batches_done"),
        "{out}"
    );
    eprintln!(
        "resume refusals: model.block_size, data.token_budget, total_steps without the flag: refused, run directory byte-identical; batches_done 1e15 in every checkpoint refused in {:.1} s naming each trainer_state.json and the field",
        t.elapsed().as_secs_f64()
    );
}

/// Edits the trainer state of `ckpt` and writes its manifest anew (a checkpoint written with
/// a false state, not a damaged file).
fn edit_state(ckpt: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = ckpt.join("trainer_state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut state);
    std::fs::write(&path, serde_json::to_string_pretty(&state).unwrap()).unwrap();
    dflash_tui::train::manifest::write(ckpt).unwrap();
}
