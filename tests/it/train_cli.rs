//! `dflash-tui train` through the real binary: bad configuration and inputs get one clear
//! message and a non-zero exit; headless commands from stdin and signals steer a run.

use crate::common;
mod distributed;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::tiny_target_dir;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_dflash-tui")
}

type Inputs = common::TinyRun;

fn inputs() -> Inputs {
    common::tiny_run(32, 3)
}

fn base_args(i: &Inputs, run_dir: &Path) -> Vec<String> {
    common::tiny_train_args(i, run_dir, &[])
}

fn run(args: &[String]) -> (i32, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env("DFLASH_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh drafter of the tiny config's shape (1 layer, block 4, mask token 1, 2 taps) for
/// the target in `target`, saved to `out`.
fn save_tiny_drafter(target: &Path, out: &Path) -> PathBuf {
    let t = dflash_tui::model::TargetConfig::from_model_dir(target).unwrap();
    let shape = dflash_tui::model::DrafterShape {
        layers: 1,
        block_size: 4,
        mask_token_id: 1,
        target_layer_ids: None,
        num_taps: 2,
    };
    let config = dflash_tui::model::DrafterConfig::for_target(&t, &shape).unwrap();
    dflash_tui::model::Drafter::init(config, tch::Device::Cpu, tch::Kind::Float, 0)
        .unwrap()
        .save(out)
        .unwrap()
}

#[test]
fn config_errors_name_the_field() {
    let i = inputs();
    let run_dir = i.tmp.path().join("run");
    let bad = i.tmp.path().join("bad.toml");
    std::fs::write(&bad, "[train]\nlearning_rate = 1\n").unwrap();
    let (code, _, err) = run(&["train".into(), "--config".into(), bad.display().to_string()]);
    assert_ne!(code, 0);
    assert!(
        err.contains("bad.toml") && err.contains("learning_rate"),
        "{err}"
    );

    let mut args = base_args(&i, &run_dir);
    args.extend(["--set".into(), "train.lr=-1".into()]);
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert!(
        err.contains("train.lr = -1") && err.contains("must be > 0"),
        "{err}"
    );
    assert!(!run_dir.exists(), "nothing is created for a bad config");

    let mut args = base_args(&i, &run_dir);
    args.extend(["--set".into(), "model.mask_token_id=50".into()]);
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert!(
        err.contains("mask_token_id = 50") && err.contains("vocabulary"),
        "{err}"
    );

    // [validation]: a value out of range, and a held-out split the data set does not have
    let mut args = base_args(&i, &run_dir);
    args.extend(["--set".into(), "validation.sequences=0".into()]);
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert_eq!(
        err.trim(),
        "error: config: validation.sequences = 0 is out of range (must be between 1 and 100000)"
    );
    let dict = i.tmp.path().join("dict");
    std::fs::create_dir_all(dict.join("train")).unwrap();
    std::fs::copy(&i.data, dict.join("train/data.arrow")).unwrap();
    std::fs::write(dict.join("dataset_dict.json"), r#"{"splits": ["train"]}"#).unwrap();
    let mut args = base_args(&i, &run_dir);
    args.extend([
        "--set".into(),
        format!("data.path={}", dict.display()),
        "--set".into(),
        "validation.every_steps=5".into(),
    ]);
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert!(
        err.contains("config: validation")
            && err.contains("no split \"validation\" (splits: train)"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn a_drafter_that_does_not_match_the_target_is_refused() {
    let i = inputs();
    // a drafter for another target (hidden size 32 -> a different vocabulary here)
    let other = i.tmp.path().join("other");
    tiny_target_dir(&other, "llama", false, None, 4);
    let cfg_path = other.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["vocab_size"] = 40.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let drafter = save_tiny_drafter(&other, &i.tmp.path().join("drafter"));
    let run_dir = i.tmp.path().join("run");
    let mut args = base_args(&i, &run_dir);
    args.extend([
        "--set".into(),
        format!("model.drafter_init={}", drafter.display()),
    ]);
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert!(
        err.contains(&drafter.join("config.json").display().to_string())
            && err.contains("vocab_size = 40"),
        "{err}"
    );
}

#[test]
fn an_unwritable_run_directory_is_refused() {
    let i = inputs();
    let blocker = i.tmp.path().join("blocker");
    std::fs::write(&blocker, b"").unwrap();
    let (code, _, err) = run(&base_args(&i, &blocker.join("run")));
    assert_ne!(code, 0);
    assert!(
        err.contains("blocker") && err.contains("cannot create the run directory"),
        "{err}"
    );
}

#[test]
fn a_failing_stage_exits_non_zero_with_the_error() {
    let i = inputs();
    let run_dir = i.tmp.path().join("run");
    let mut args = base_args(&i, &run_dir);
    for s in [
        "train.total_steps=100",
        "checkpoint.save_every_steps=2",
        "debug.fail_at_step=5",
        "debug.fail_stage=target",
    ] {
        args.extend(["--set".into(), s.into()]);
    }
    let (code, _, err) = run(&args);
    assert_eq!(code, 1);
    assert!(
        err.contains("target worker 0 failed") && err.contains("injected failure"),
        "{err}"
    );
    assert!(err.contains("last checkpoint"), "{err}");
    assert!(run_dir.join("checkpoints/latest").exists());
}

#[test]
fn stdin_commands_and_signals_steer_a_headless_run() {
    let i = inputs();
    let run_dir = i.tmp.path().join("run");
    let mut args = base_args(&i, &run_dir);
    args.extend([
        "--set".into(),
        "train.total_steps=1000000".into(),
        "--set".into(),
        "checkpoint.save_every_steps=0".into(),
    ]);
    let mut child = Command::new(bin())
        .args(&args)
        .env("DFLASH_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut replies = common::Lines::read(child.stdout.take().unwrap());
    let metrics = run_dir.join("metrics.jsonl");
    common::wait_until(
        "the first step in metrics.jsonl",
        Duration::from_secs(60),
        || {
            std::fs::read_to_string(&metrics)
                .unwrap_or_default()
                .contains("\"type\":\"step\"")
                .then_some(())
        },
    );
    // one command at a time: each gets its reply line before the next is sent
    for line in [
        "pause",
        "resume",
        "queue feature_q 1",
        "queue nowhere 2",
        "checkpoint",
        "profile 1",
        "bogus",
    ] {
        writeln!(stdin, "{line}").unwrap();
        replies.next_with(
            &format!("the reply to {line:?}"),
            Duration::from_secs(60),
            |l| l.starts_with("ok: ") || l.starts_with("error: "),
        );
    }
    // SIGTERM: stop with a checkpoint, exit 0
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let stdout = replies.all(Duration::from_secs(120));
    let status = child.wait().unwrap();
    assert!(status.success(), "{stdout}");
    assert!(
        stdout.contains("ok: paused") && stdout.contains("ok: resumed"),
        "{stdout}"
    );
    assert!(stdout.contains("ok: feature_q depth set to 1"), "{stdout}");
    assert!(
        stdout.contains("error: unknown queue \"nowhere\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("error: unknown command \"bogus\""),
        "{stdout}"
    );
    // stopped by the signal long before its 1,000,000 steps
    assert!(
        stdout.contains("run stopped (stop command): ") && stdout.contains(" of 1000000 steps"),
        "{stdout}"
    );
    let ckpts = dflash_tui::train::checkpoint::list_checkpoints(&run_dir.join("checkpoints"));
    assert!(!ckpts.is_empty());
    let records = dflash_tui::telemetry::records::read_metrics(&metrics).unwrap();
    assert!(records.iter().any(|r| matches!(
        r,
        dflash_tui::telemetry::records::MetricsRecord::Summary { .. }
    )));
}

/// `model.drafter_added_layers` grows a trained drafter: the run trains the deeper drafter,
/// its checkpoints hold every layer (a servable drafter of the new depth), a resume rebuilds
/// the same shape and goes on, and a resume that changes the number of added layers is
/// refused. Without `model.drafter_init` the setting is refused before anything is written.
#[test]
fn layers_added_to_a_trained_drafter_are_trained_and_resumed() {
    let i = inputs();
    let init = save_tiny_drafter(&i.target, &i.tmp.path().join("init"));

    let refused_dir = i.tmp.path().join("refused");
    let mut args = base_args(&i, &refused_dir);
    args.extend(["--set".into(), "model.drafter_added_layers=2".into()]);
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert!(
        err.contains("model.drafter_added_layers = 2 needs model.drafter_init"),
        "{err}"
    );
    assert!(!refused_dir.exists());

    let run_dir = i.tmp.path().join("run");
    let mut args = base_args(&i, &run_dir);
    for s in [
        format!("model.drafter_init={}", init.display()),
        "model.drafter_added_layers=2".into(),
        "train.total_steps=12".into(),
        "checkpoint.save_every_steps=6".into(),
        "debug.fail_at_step=8".into(),
    ] {
        args.extend(["--set".into(), s]);
    }
    let (code, _, err) = run(&args);
    assert_eq!(code, 1, "{err}");
    let checkpoints = run_dir.join("checkpoints");
    let first = dflash_tui::train::checkpoint::list_checkpoints(&checkpoints);
    assert!(!first.is_empty(), "{err}");

    let resume = |set: &[&str]| {
        let mut args: Vec<String> = vec![
            "train".into(),
            "--resume".into(),
            run_dir.display().to_string(),
            "--no-tui".into(),
        ];
        for s in set {
            args.extend(["--set".into(), (*s).into()]);
        }
        run(&args)
    };
    let (code, _, err) = resume(&["model.drafter_added_layers=3", "debug.fail_at_step=0"]);
    assert_ne!(code, 0);
    assert!(err.contains("model.drafter_added_layers"), "{err}");

    let (code, stdout, err) = resume(&["debug.fail_at_step=0"]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("run finished: 12 of 12 steps"), "{stdout}");
    let all = dflash_tui::train::checkpoint::list_checkpoints(&checkpoints);
    let (step, last) = all.last().unwrap();
    assert_eq!(*step, 12, "{all:?}");
    let drafter =
        dflash_tui::model::Drafter::load(&last.join("drafter"), tch::Device::Cpu, tch::Kind::Float)
            .unwrap();
    assert_eq!(drafter.config.num_hidden_layers, 3);
    // the layers added start as the identity and were trained: no output projection is zero
    for (name, p) in drafter.named_parameters() {
        if name.starts_with("layers.2.") && name.ends_with("o_proj.weight") {
            assert!(p.abs().max().double_value(&[]) > 0.0, "{name}");
        }
    }

    // A resume of the finished run has nothing to do: it says so, exits 0 and changes nothing
    // (no second evaluation, no final checkpoint written again).
    let metrics = run_dir.join("metrics.jsonl");
    let before = std::fs::read(&metrics).unwrap();
    let state = last.join("trainer_state.json");
    let saved = std::fs::metadata(&state).unwrap().modified().unwrap();
    let (code, stdout, err) = resume(&["debug.fail_at_step=0"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        stdout.trim(),
        format!(
            "run {} already finished at step 12 of 12; nothing to do (raise train.total_steps \
             with --allow-schedule-change to train on)",
            run_dir.display()
        )
    );
    assert_eq!(std::fs::read(&metrics).unwrap(), before);
    assert_eq!(
        std::fs::metadata(&state).unwrap().modified().unwrap(),
        saved
    );
}

/// A start that fails after its configuration is recorded (the `model.drafter_init` weights do
/// not load) says how to start again; `--resume` then starts from step 0, also with a changed
/// `model.drafter_init` (nothing trained depends on it), and a fresh start there names it.
#[test]
fn a_failed_start_resumes_from_step_0() {
    let i = inputs();
    let init = save_tiny_drafter(&i.target, &i.tmp.path().join("init"));
    std::fs::write(init.join("model.safetensors"), b"not safetensors").unwrap();
    let run_dir = i.tmp.path().join("run");
    let mut args = base_args(&i, &run_dir);
    for s in [
        format!("model.drafter_init={}", init.display()),
        "train.total_steps=2".into(),
    ] {
        args.extend(["--set".into(), s]);
    }
    let (code, _, err) = run(&args);
    assert_eq!(code, 1, "{err}");
    let restart = format!(
        "the run did not start (dflash-tui train --resume {} starts it from step 0 once the cause below is fixed)",
        run_dir.display()
    );
    assert!(err.contains(&restart), "{err}");
    assert!(run_dir.join("config.toml").is_file());

    let (code, _, again) = run(&args);
    assert_eq!(code, 1, "{again}");
    assert!(
        again.contains("no checkpoint yet, so --resume") && again.contains("from step 0"),
        "{again}"
    );

    let resume: Vec<String> = [
        "train",
        "--resume",
        &run_dir.display().to_string(),
        "--no-tui",
        "--set",
        "model.drafter_init=\"\"",
    ]
    .map(String::from)
    .to_vec();
    let (code, stdout, err) = run(&resume);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("run finished: 2 of 2 steps"), "{stdout}");
    let recorded = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(recorded.contains("drafter_init = \"\""), "{recorded}");
}
