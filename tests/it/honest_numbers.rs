//! The numbers a headless run reports, checked against what it did: every `log_every_steps`-th
//! step gets its line (also steps that finish back to back), and the rates in metrics.jsonl
//! come from a time window, so no step shows a spike above the run's real pace; TensorBoard
//! reads the run's event files back equal to metrics.jsonl.

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

#[test]
fn every_step_gets_its_line_and_no_rate_spikes() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let steps = 40u64;
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .arg("train")
        .arg("--no-tui")
        .arg("--config")
        .arg(&config)
        .args(["--set", &format!("model.target={}", i.target.display())])
        .args(["--set", &format!("data.path={}", i.data.display())])
        .args(["--set", &format!("train.total_steps={steps}")])
        .args(["--set", "telemetry.log_every_steps=1"])
        .arg("--run-dir")
        .arg(&run_dir)
        .env("DFLASH_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let logged: Vec<u64> = stderr
        .lines()
        .filter_map(|l| l.split(" I step ").nth(1))
        .filter_map(|rest| rest.split('/').next()?.parse().ok())
        .collect();
    assert_eq!(logged, (1..=steps).collect::<Vec<_>>(), "{stderr}");

    let records =
        dflash_tui::telemetry::records::read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let mut rates = Vec::new();
    let mut gaps = Vec::new();
    let mut summary = None;
    for r in records {
        match r {
            dflash_tui::telemetry::records::MetricsRecord::Step(s) => {
                rates.push(s.tokens_per_s);
                gaps.push(s.tokens as f64 / s.step_s);
            }
            dflash_tui::telemetry::records::MetricsRecord::Summary {
                tokens_seen,
                elapsed_s,
                ..
            } => summary = Some(tokens_seen as f64 / elapsed_s),
            _ => {}
        }
    }
    let average = summary.expect("a summary record");
    let top = rates.iter().cloned().fold(0.0, f64::max);
    let top_gap = gaps.iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "{steps} steps: {} lines; run average {average:.0} tok/s (since start, loading \
         included), highest windowed rate {top:.0}, highest per-step gap rate {top_gap:.0}",
        logged.len()
    );
    // The window's rate never exceeds the pace of the fastest stretch by much; a per-step
    // rate would (two steps finishing close together).
    assert!(top < 3.0 * average, "{top} vs {average}");
}

#[test]
fn a_resumed_run_continues_its_clock_and_history() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let train = |extra: &[&str], steps: u64| {
        let target = format!("model.target={}", i.target.display());
        let data = format!("data.path={}", i.data.display());
        let total = format!("train.total_steps={steps}");
        let mut args = vec!["train", "--no-tui"];
        args.extend(extra);
        args.extend(["--set", &target, "--set", &data, "--set", &total]);
        common::dflash_ok(&args);
    };
    let cfg = config.display().to_string();
    let dir = run_dir.display().to_string();
    train(&["--config", &cfg, "--run-dir", &dir], 10);
    train(&["--resume", &dir, "--allow-schedule-change"], 20);
    let steps: Vec<(u64, f64)> =
        dflash_tui::telemetry::records::read_metrics(&run_dir.join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .filter_map(|r| match r {
                dflash_tui::telemetry::records::MetricsRecord::Step(s) => {
                    Some((s.step, s.elapsed_s))
                }
                _ => None,
            })
            .collect();
    assert_eq!(
        steps.iter().map(|s| s.0).collect::<Vec<_>>(),
        (1..=20).collect::<Vec<_>>(),
        "each step once, numbered on"
    );
    assert!(
        steps.windows(2).all(|w| w[1].1 >= w[0].1),
        "the clock goes on: {steps:?}"
    );
}

/// Reads a run's event files with TensorBoard's own reader (EventAccumulator) and, on its own,
/// the scalars metrics.jsonl says they should hold: every number of every record, tagged
/// GROUP/PATH (lists of named things keyed by name), at the record's step or the last step
/// before it, rounded to f32. Prints {"expected": {tag: [[step, value]]}, "got": {...}}.
const READ_BACK: &str = r#"
import json, struct, sys
from tensorboard.backend.event_processing import event_accumulator as ea

run = sys.argv[1]
f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]
SKIP = {"step", "elapsed_s", "index"}
GROUPS = {"step": "train", "eval": "eval", "validation": "validation", "queues": "queue",
          "profile": "profile", "summary": "summary"}

def named(v):
    if not isinstance(v, list) or not v:
        return None
    names = [x.get("name", x.get("event")) if isinstance(x, dict) else None for x in v]
    return None if any(not isinstance(n, str) for n in names) else list(zip(names, v))

def flatten(prefix, v, out):
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return
    if isinstance(v, (int, float)):
        out.append((prefix, v))
    elif isinstance(v, dict):
        for k, x in v.items():
            if k in SKIP:
                continue
            items = named(x)
            for name, item in items or [(k, x)]:
                flatten(prefix + "/" + name, item, out)
    else:
        for i, x in enumerate(v):
            flatten(f"{prefix}/{i}", x, out)

expected, last = {}, 0
for line in open(run + "/metrics.jsonl"):
    r = json.loads(line)
    if r["type"] == "event":
        continue
    group = f"gpu{r['index']}" if r["type"] == "gpu" else GROUPS[r["type"]]
    step = r["step"] if r["type"] in ("step", "eval", "validation") else last
    last = max(last, step)
    values = []
    flatten(group, r, values)
    for tag, v in values:
        expected.setdefault(tag, []).append([step, f32(v)])

acc = ea.EventAccumulator(run + "/tensorboard", size_guidance={ea.SCALARS: 0})
acc.Reload()
got = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
print(json.dumps({"expected": expected, "got": got}))
"#;

type Scalars = std::collections::BTreeMap<String, Vec<(i64, f64)>>;

/// TensorBoard's reading of `run_dir/tensorboard` and what metrics.jsonl says it should be;
/// None when Python's tensorboard is not installed.
fn tensorboard_read_back(run_dir: &std::path::Path) -> Option<(Scalars, Scalars)> {
    let tools = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".deps/pytools");
    let pythonpath = format!(
        "{}:{}",
        tools.display(),
        std::env::var("PYTHONPATH").unwrap_or_default()
    );
    let has = Command::new("python3")
        .args(["-c", "import tensorboard"])
        .env("PYTHONPATH", &pythonpath)
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        return None;
    }
    let out = Command::new("python3")
        .args(["-c", READ_BACK])
        .arg(run_dir)
        .env("PYTHONPATH", &pythonpath)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    #[derive(serde::Deserialize)]
    struct Both {
        expected: Scalars,
        got: Scalars,
    }
    let both: Both = serde_json::from_slice(&out.stdout).unwrap();
    Some((both.expected, both.got))
}

fn event_files(run_dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(run_dir.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn tensorboard_reads_the_runs_scalars_as_metrics_jsonl_records_them() {
    let i = common::tiny_run(32, 5);
    let run_dir = i.tmp.path().join("run");
    common::dflash_ok(&common::tiny_train_args(
        &i,
        &run_dir,
        &[
            "train.total_steps=12",
            "eval.every_steps=6",
            "eval.prompts=2",
            "eval.max_new_tokens=8",
            "validation.every_steps=4",
            "validation.sequences=4",
            "validation.max_new_tokens=8",
        ],
    ));
    let live = event_files(&run_dir);
    assert_eq!(live.len(), 1, "{live:?}");
    assert!(live[0].starts_with("events.out.tfevents."), "{live:?}");
    let Some((expected, got)) = tensorboard_read_back(&run_dir) else {
        // CI runs `make test`, whose set-up installs it: there a missing tool is a failure
        assert!(
            std::env::var_os("CI").is_none(),
            "Python `tensorboard` is not installed in .deps/pytools (make setup installs it)"
        );
        eprintln!("Python `tensorboard` is not installed (make setup installs it into .deps/pytools): not run");
        return;
    };
    let count = |s: &Scalars| s.values().map(Vec::len).sum::<usize>();
    for tag in [
        "train/loss",
        "train/accuracy",
        "train/accept_mean",
        "train/tokens_per_s",
        "train/lr",
        "train/grad_norm",
        "eval/tau",
        "validation/tau",
        "queue/batch_q/len",
        "summary/final_loss",
    ] {
        assert!(
            expected.contains_key(tag),
            "no {tag} in {:?}",
            expected.keys()
        );
    }
    assert_eq!(expected["train/loss"].len(), 12);
    assert_eq!(
        expected["eval/tau"].iter().map(|s| s.0).collect::<Vec<_>>(),
        [6, 12]
    );
    assert!(expected.keys().any(|t| t.starts_with("profile/")));
    assert_eq!(got, expected, "written while training");

    // export-tensorboard: the same scalars from metrics.jsonl, in one file in place of the
    // training's; again, the same file once more
    let export = || {
        let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
            .arg("export-tensorboard")
            .arg(&run_dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let first = export();
    let said = format!("wrote {} scalars of ", count(&expected));
    assert!(
        first.starts_with(&said) && first.contains("(in place of 1 earlier event file(s))"),
        "{first}"
    );
    let exported = event_files(&run_dir);
    assert_eq!(exported.len(), 1, "{exported:?}");
    let bytes = std::fs::read(run_dir.join("tensorboard").join(&exported[0])).unwrap();
    let (_, got) = tensorboard_read_back(&run_dir).unwrap();
    assert_eq!(got, expected, "exported");
    let again = export();
    assert!(again.starts_with(&said), "{again}");
    let files = event_files(&run_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        std::fs::read(run_dir.join("tensorboard").join(&files[0])).unwrap(),
        bytes
    );
    eprintln!(
        "{} tags, {} scalars read back by EventAccumulator equal to metrics.jsonl, written \
         while training and by export-tensorboard: {first}",
        expected.len(),
        count(&expected)
    );

    // a run directory without metrics.jsonl is refused, naming it
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .arg("export-tensorboard")
        .arg(i.tmp.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no metrics.jsonl"),
        "{err}"
    );
}
