//! Multi-process runs through torch.distributed's c10d (Gloo on the CPU), as torchrun starts
//! them: each rank is the real binary with torchrun's variables. Tiny models; every wait is
//! on a process or a file, with a deadline.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dflash_tui::pipeline::distributed::group::free_port;
use dflash_tui::telemetry::records::{read_metrics, MetricsRecord, StepRecord};

use super::{base_args, bin, inputs, Inputs};
use crate::common::{self, wait_until};

/// Starts `world` ranks of one run (rank 0 first in the list), each with `extra` settings.
fn start_ranks(i: &Inputs, run: &Path, world: usize, extra: &[String]) -> Vec<Child> {
    let port = free_port().unwrap().to_string();
    let mut args = base_args(i, run);
    for e in extra {
        args.extend(["--set".into(), e.clone()]);
    }
    (0..world)
        .map(|rank| {
            Command::new(bin())
                .args(&args)
                .env("DFLASH_LOG", "warn")
                .env("TORCH_CPP_LOG_LEVEL", "ERROR")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("DFLASH_DIST_TIMEOUT_S", "60")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Each rank's exit code and output, waiting at most `limit` for all of them.
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<(i32, String)> {
    let t = Instant::now();
    children
        .into_iter()
        .map(|mut c| {
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if t.elapsed() > limit {
                    let _ = c.kill();
                    panic!("a rank did not end within {limit:?}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let out = c.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status.code().unwrap_or(-1), text)
        })
        .collect()
}

fn steps(metrics: &Path) -> Vec<StepRecord> {
    read_metrics(metrics)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Step(s) => Some(s),
            _ => None,
        })
        .collect()
}

fn weights(run: &Path, step: u64) -> Vec<(String, tch::Tensor)> {
    let file = run
        .join("checkpoints")
        .join(format!("step-{step:06}"))
        .join("drafter/model.safetensors");
    let mut w = tch::Tensor::read_safetensors(&file).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

/// The run of `world` processes of one replica and grad_accum 1 against one process of one
/// replica and grad_accum `world`: the same global batches, the same losses and gradient norms
/// (1e-6), weights within `weight_tolerance`. (The processes add their gradients in rank order,
/// as the single process adds its micro-batches: (g0 + g1) + g2, so three processes give its
/// weights too; Gloo's ring allreduce, in another order, left 3e-4 after AdamW.)
fn equals_single_process(world: usize, weight_tolerance: f64) {
    let i = inputs();
    let common = ["train.total_steps=6", "checkpoint.save_every_steps=0"].map(String::from);
    let single = i.tmp.path().join("single");
    let mut one = common.to_vec();
    one.push(format!("train.grad_accum={world}"));
    let out = wait_all(start_ranks(&i, &single, 1, &one), Duration::from_secs(300));
    assert_eq!(out[0].0, 0, "{}", out[0].1);
    let multi = i.tmp.path().join("multi");
    let out = wait_all(
        start_ranks(&i, &multi, world, &common),
        Duration::from_secs(300),
    );
    for (rank, (code, text)) in out.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {text}");
    }
    let (a, b) = (
        steps(&single.join("metrics.jsonl")),
        steps(&multi.join("metrics.jsonl")),
    );
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.step, x.tokens, x.samples), (y.step, y.tokens, y.samples));
        assert!(
            close(x.loss, y.loss),
            "step {}: loss {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
        assert!(
            close(x.grad_norm, y.grad_norm),
            "step {}: grad norm",
            x.step
        );
    }
    // every other rank recorded the same steps in its own folder, and wrote no checkpoint
    for rank in 1..world {
        let own: PathBuf = multi.join(format!("ranks/rank-{rank}"));
        let theirs = steps(&own.join("metrics.jsonl"));
        assert_eq!(theirs.len(), 6, "rank {rank}");
        assert!(theirs.iter().zip(&b).all(|(x, y)| x.loss == y.loss));
        assert!(!own.join("checkpoints").exists());
    }
    let (wa, wb) = (weights(&single, 6), weights(&multi, 6));
    assert_eq!(wa.len(), wb.len());
    for ((na, ta), (nb, tb)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb);
        let diff = (ta - tb).abs().max().double_value(&[]);
        assert!(diff <= weight_tolerance, "{na}: weights differ by {diff}");
    }
}

#[test]
fn two_processes_train_as_one_with_the_same_replicas() {
    equals_single_process(2, 1e-6);
}

#[test]
fn three_processes_train_as_one_with_the_same_replicas() {
    equals_single_process(3, 1e-6);
}

/// Waits (up to `limit`) until `path` exists.
fn wait_for_file(path: &Path, limit: Duration) {
    let t = Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < limit, "{} did not appear", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_killed_rank_stops_the_other_with_one_line_and_a_resumable_checkpoint() {
    let i = inputs();
    let run = i.tmp.path().join("run");
    let settings = ["train.total_steps=100000", "checkpoint.save_every_steps=3"].map(String::from);
    let mut ranks = start_ranks(&i, &run, 2, &settings);
    wait_for_file(&run.join("checkpoints/latest"), Duration::from_secs(120));
    let t = Instant::now();
    ranks[1].kill().unwrap(); // SIGKILL
    let survivor = ranks.remove(0);
    let out = wait_all(vec![survivor], Duration::from_secs(60));
    assert!(t.elapsed() < Duration::from_secs(60));
    let (code, text) = &out[0];
    assert_ne!(*code, 0, "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("rank 1 went silent"))
        .unwrap_or_else(|| panic!("no line names rank 1: {text}"));
    assert!(
        line.contains("last checkpoint: ") && line.contains("step-"),
        "{line}"
    );
    let _ = ranks[0].wait();
    // the checkpoint it names resumes, with one process now, and goes on two more steps
    let saved: u64 = line.rsplit("step-").next().unwrap()[..6].parse().unwrap();
    let mut resume = base_args(&i, &run);
    let at = resume.iter().position(|a| a == "--run-dir").unwrap();
    resume[at] = "--resume".into();
    resume.extend([
        "--allow-schedule-change".into(),
        "--set".into(),
        format!("train.total_steps={}", saved + 2),
    ]);
    common::dflash_ok(&resume);
    let numbers: Vec<u64> = steps(&run.join("metrics.jsonl"))
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(
        numbers,
        (1..=saved + 2).collect::<Vec<u64>>(),
        "each step once"
    );
}

/// A run of `first` processes (one batch each per step) that fails after its checkpoint at
/// step 4, resumed with `then` processes: its batches after the checkpoint are the ones an
/// uninterrupted single process trains after the same number of batches (the tokens and
/// samples of each batch compared as its fingerprint), none repeated or skipped.
fn resume_with_another_process_count(first: usize, then: usize) {
    let i = inputs();
    let base = ["checkpoint.save_every_steps=4"].map(String::from);
    let reference = i.tmp.path().join("reference");
    let mut one = base.to_vec();
    one.push("train.total_steps=20".into());
    let out = wait_all(
        start_ranks(&i, &reference, 1, &one),
        Duration::from_secs(300),
    );
    assert_eq!(out[0].0, 0, "{}", out[0].1);
    let run = i.tmp.path().join("run");
    let mut failing = base.to_vec();
    failing.extend(["train.total_steps=8".into(), "debug.fail_at_step=5".into()]);
    let out = wait_all(
        start_ranks(&i, &run, first, &failing),
        Duration::from_secs(300),
    );
    assert!(out.iter().all(|(code, _)| *code != 0), "{out:?}");
    let mut resume = base_args(&i, &run);
    let at = resume.iter().position(|a| a == "--run-dir").unwrap();
    resume[at] = "--resume".into();
    resume.extend(["--set".into(), "train.total_steps=8".into()]);
    let port = free_port().unwrap().to_string();
    let ranks: Vec<Child> = (0..then)
        .map(|rank| {
            let mut c = Command::new(bin());
            c.args(&resume)
                .env("DFLASH_LOG", "warn")
                .env("TORCH_CPP_LOG_LEVEL", "ERROR")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if then > 1 {
                c.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", then.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port);
            }
            c.spawn().unwrap()
        })
        .collect();
    let out = wait_all(ranks, Duration::from_secs(300));
    for (rank, (code, text)) in out.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {text}");
    }
    let (a, b) = (
        steps(&reference.join("metrics.jsonl")),
        steps(&run.join("metrics.jsonl")),
    );
    let numbers: Vec<u64> = b.iter().map(|r| r.step).collect();
    assert_eq!(numbers, (1..=8).collect::<Vec<u64>>(), "each step once");
    // the reference's batches, one per step, cut as the run consumed them
    let mut batches = a.iter().map(|r| (r.tokens, r.samples));
    for (k, y) in b.iter().enumerate() {
        let per_step = if k < 4 { first } else { then };
        let (tokens, samples) = (0..per_step)
            .map(|_| batches.next().expect("the reference is long enough"))
            .fold((0, 0), |(t, s), (bt, bs)| (t + bt, s + bs));
        assert_eq!((y.tokens, y.samples), (tokens, samples), "step {}", y.step);
    }
}

#[test]
fn two_processes_resume_as_one_on_the_same_data_stream() {
    resume_with_another_process_count(2, 1);
}

#[test]
fn one_process_resumes_as_two_on_the_same_data_stream() {
    resume_with_another_process_count(1, 2);
}

/// `ctl status` of rank 0's run as JSON, once it answers.
fn status(run: &Path) -> Option<serde_json::Value> {
    let (ok, text) = crate::common::ctl(run, &["status"]);
    ok.then(|| serde_json::from_str(text.trim()).ok()).flatten()
}

/// Rank `rank`'s row in the status, when there is one.
fn rank_row(s: &serde_json::Value, rank: u64) -> Option<serde_json::Value> {
    s["ranks"]
        .as_array()?
        .iter()
        .find(|r| r["rank"] == rank)
        .cloned()
}

fn ctl_ok(run: &Path, words: &[&str]) -> String {
    let (ok, text) = crate::common::ctl(run, words);
    assert!(ok, "ctl {words:?}: {text}");
    text
}

/// The step numbers of the "paused" events in a metrics file.
fn paused_at(metrics: &Path) -> Vec<String> {
    std::fs::read_to_string(metrics)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"paused at step "))
        .filter_map(|l| l.split("paused at step ").nth(1))
        .map(|rest| rest.chars().take_while(char::is_ascii_digit).collect())
        .collect()
}

/// Commands given to rank 0's socket act on both ranks: rank 1 serves no socket of its own;
/// `ctl status` lists both; pause holds both at the same step boundary; queue depth and profile
/// interval reach rank 1; checkpoint is written by rank 0 alone; resume and stop end both at
/// the same step.
#[test]
fn commands_to_rank_0_act_on_every_rank() {
    let i = inputs();
    let run = i.tmp.path().join("run");
    let settings = [
        "train.total_steps=100000",
        "checkpoint.save_every_steps=0",
        "telemetry.profile_interval_s=0",
    ]
    .map(String::from);
    let ranks = start_ranks(&i, &run, 2, &settings);
    let limit = Duration::from_secs(120);
    let own = run.join("ranks/rank-1");
    let s = wait_until("both ranks in ctl status", limit, || {
        status(&run).filter(|s| rank_row(s, 1).is_some_and(|r| r["step"].as_u64() > Some(0)))
    });
    assert!(rank_row(&s, 0).is_some(), "{s}");
    assert!(
        !own.join("control.sock").exists(),
        "rank 1 serves no socket"
    );
    assert!(run.join("control.sock").exists());

    ctl_ok(&run, &["pause"]);
    wait_until("rank 1 paused", limit, || {
        status(&run)
            .and_then(|s| rank_row(&s, 1))
            .filter(|r| r["phase"] == "paused")
    });
    // both held at one step boundary
    let (zero, one) = (
        paused_at(&run.join("metrics.jsonl")),
        paused_at(&own.join("metrics.jsonl")),
    );
    assert_eq!(zero.len(), 1, "{zero:?}");
    assert_eq!(zero, one, "the same step boundary");

    ctl_ok(&run, &["queue", "feature_q", "1"]);
    ctl_ok(&run, &["profile", "1"]);
    wait_until("rank 1 takes the queue depth", limit, || {
        status(&run).and_then(|s| rank_row(&s, 1)).filter(|r| {
            r["queues"].as_array().is_some_and(|qs| {
                qs.iter()
                    .any(|q| q["name"] == "feature_q" && q["capacity"] == 1)
            })
        })
    });
    ctl_ok(&run, &["checkpoint"]);
    ctl_ok(&run, &["resume"]);
    // the profile interval reached rank 1: its reports now carry a ProfileStats summary
    wait_until("rank 1's ProfileStats", limit, || {
        status(&run)
            .and_then(|s| rank_row(&s, 1))
            .filter(|r| r["phase"] == "training" && !r["bottleneck"].is_null())
    });
    wait_for_file(&run.join("checkpoints/latest"), limit);
    ctl_ok(&run, &["stop"]);
    let out = wait_all(ranks, limit);
    for (rank, (code, text)) in out.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {text}");
    }
    assert!(out[1].1.contains("rank 1 stopped"), "{}", out[1].1);
    let (a, b) = (
        steps(&run.join("metrics.jsonl")),
        steps(&own.join("metrics.jsonl")),
    );
    assert_eq!(
        a.last().map(|r| r.step),
        b.last().map(|r| r.step),
        "one last step"
    );
    assert!(
        !own.join("checkpoints").exists(),
        "checkpoints are rank 0's"
    );
}

/// SIGTERM to every rank (as `srun` sends on cancel): both end cleanly (status 0) at the same
/// step boundary, with one checkpoint, rank 0's.
#[test]
fn sigterm_to_every_rank_stops_the_run_with_one_checkpoint() {
    let i = inputs();
    let run = i.tmp.path().join("run");
    let settings = ["train.total_steps=100000", "checkpoint.save_every_steps=0"].map(String::from);
    let ranks = start_ranks(&i, &run, 2, &settings);
    let own = run.join("ranks/rank-1");
    wait_until("a step on rank 1", Duration::from_secs(120), || {
        (!steps_or_none(&own.join("metrics.jsonl")).is_empty()).then_some(())
    });
    for r in &ranks {
        // SAFETY: a plain kill(2) of a child this test started.
        unsafe {
            libc::kill(r.id() as i32, libc::SIGTERM);
        }
    }
    let out = wait_all(ranks, Duration::from_secs(60));
    for (rank, (code, text)) in out.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {text}");
    }
    let (a, b) = (
        steps(&run.join("metrics.jsonl")),
        steps(&own.join("metrics.jsonl")),
    );
    let last = a.last().map(|r| r.step);
    assert_eq!(last, b.last().map(|r| r.step), "one last step");
    let saved = dflash_tui::train::checkpoint::list_checkpoints(&run.join("checkpoints"));
    assert_eq!(saved.len(), 1, "one checkpoint: {saved:?}");
    assert_eq!(Some(saved[0].0), last, "{saved:?}");
    assert!(!own.join("checkpoints").exists());
}

fn steps_or_none(metrics: &Path) -> Vec<StepRecord> {
    if metrics.exists() {
        read_metrics(metrics)
            .map(|records| {
                records
                    .into_iter()
                    .filter_map(|r| match r {
                        MetricsRecord::Step(s) => Some(s),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    } else {
        Vec::new()
    }
}
