//! The numbers a headless run reports, checked against what it did: every `log_every_steps`-th
//! step gets its line (also steps that finish back to back), and the rates in metrics.jsonl
//! come from a time window, so no step shows a spike above the run's real pace.

mod common;

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
        let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
            .arg("train")
            .arg("--no-tui")
            .args(extra)
            .args(["--set", &format!("model.target={}", i.target.display())])
            .args(["--set", &format!("data.path={}", i.data.display())])
            .args(["--set", &format!("train.total_steps={steps}")])
            .env("DFLASH_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
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
