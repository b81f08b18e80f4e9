//! Signals against a real training run (issue 47): a stop during start-up ends the start and
//! the run resumes from step 0, a lock file left behind blocks nothing, and a second stop
//! signal ends the process within seconds during a long validation pass or while a stage
//! cannot stop.

use std::process::Command;
use std::time::{Duration, Instant};

use super::{train_args, train_to_end, Inputs, Trainer};

/// Starts runs until `sig` lands during start-up (sent as soon as the handlers exist; its log
/// line tells whether the models were still loading); returns that run, the line and the trials
/// made.
fn signalled_during_start_up(i: &Inputs, name: &str, sig: i32) -> (Trainer, String, usize) {
    let sig_name = match sig {
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGINT => "SIGINT",
        _ => "SIGTERM",
    };
    for trial in 1..=5 {
        let mut run = Trainer::start(i, &i.tmp.path().join(format!("{name}-{trial}")), &[]);
        run.line_with("SIGUSR1 = checkpoint", Duration::from_secs(30));
        run.signal(sig);
        let line = run.line_with(sig_name, Duration::from_secs(10));
        if line.contains("during start-up") {
            return (run, line, trial);
        }
        run.signal(libc::SIGKILL);
        let _ = run.wait(Duration::from_secs(10));
    }
    panic!("{sig_name} never arrived during start-up in 5 trials");
}

#[test]
fn signals_during_start_up_are_remembered_or_end_the_start() {
    let i = crate::common::tiny_run(32, 3);

    // SIGUSR1 while the models load: a checkpoint after the first step.
    let (mut run, _, trials) = signalled_during_start_up(&i, "usr1", libc::SIGUSR1);
    let t = Instant::now();
    let checkpoint = run.line_with("checkpoint (command) at step", Duration::from_secs(60));
    run.signal(libc::SIGTERM);
    let (code, stdout) = run.wait(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("run stopped (stop command)"), "{stdout}");
    eprintln!(
        "SIGUSR1 during start-up ({trials} trial(s) to land in it): survived, remembered as \
         \"{}\" {:.2} s later; SIGTERM then ended it with exit 0",
        checkpoint.split("] ").nth(1).unwrap_or(&checkpoint),
        t.elapsed().as_secs_f64()
    );

    // SIGTERM while the models load: nothing is trained, so there is no checkpoint to wait
    // for: the process exits at once with 128 + 15 and says how to start the run again.
    let (run, line, trials) = signalled_during_start_up(&i, "term", libc::SIGTERM);
    let t = Instant::now();
    let run_dir = run.run_dir.clone();
    let (code, stdout) = run.wait(Duration::from_secs(10));
    let exit_s = t.elapsed().as_secs_f64();
    assert_eq!(code, Some(128 + libc::SIGTERM), "{stdout}\n{line}");
    let restart = format!(
        "dflash-tui train --resume {} starts it from step 0",
        run_dir.display()
    );
    assert!(
        line.contains("SIGTERM during start-up: exiting now with status 143")
            && line.contains("no checkpoint is written")
            && line.ends_with(&restart),
        "{line}"
    );
    assert!(!line.contains("with a checkpoint"), "{line}");
    assert!(!run_dir.join("checkpoints").exists());

    // A fresh start there names the resume; the resume starts from step 0 (its recorded
    // configuration, here with fewer steps: nothing trained depends on them).
    let (code, _, stderr) = train_to_end(&train_args(&i, &run_dir, &[]));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "it has no checkpoint yet, so --resume {} starts it again from step 0",
            run_dir.display()
        )),
        "{stderr}"
    );
    let resume = [
        "train",
        "--no-tui",
        "--resume",
        &run_dir.display().to_string(),
        "--set",
        "train.total_steps=2",
    ]
    .map(String::from);
    let (code, stdout, stderr) = train_to_end(&resume);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "has no checkpoint yet (the run ended before its first one): it starts from step 0"
        ) && stderr.contains("2 steps from step 0"),
        "{stderr}"
    );
    assert!(stdout.contains("run finished: 2 of 2 steps"), "{stdout}");
    assert!(run_dir.join("checkpoints/step-000002").is_dir());
    eprintln!(
        "SIGTERM during start-up ({trials} trial(s)): exit 143 {exit_s:.2} s later, no \
         checkpoint claimed; a fresh start there was refused naming --resume; --resume trained \
         from step 0 to step 2"
    );
}

#[test]
fn a_lock_file_left_behind_blocks_nothing_and_a_held_lock_refuses() {
    let i = crate::common::tiny_run(32, 3);
    let quick = ["train.total_steps=2"];
    // An empty lock file (a full disk when the PID was to be written), nothing else.
    let empty = i.tmp.path().join("empty-lock");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join(".lock"), b"").unwrap();
    let (code, stdout, stderr) = train_to_end(&train_args(&i, &empty, &quick));
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("run finished: 2 of 2 steps"), "{stdout}");

    // The lock file of a trainer that is gone (its PID recorded), beside its config.toml: a
    // resume starts from step 0.
    let stale = i.tmp.path().join("stale-lock");
    std::fs::create_dir(&stale).unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    std::fs::write(stale.join(".lock"), format!("{gone_pid}\n")).unwrap();
    std::fs::copy(empty.join("config.toml"), stale.join("config.toml")).unwrap();
    let resume = [
        "train",
        "--no-tui",
        "--resume",
        &stale.display().to_string(),
    ]
    .map(String::from);
    let (code, stdout, stderr) = train_to_end(&resume);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stderr.contains("2 steps from step 0"), "{stderr}");

    // A lock held by a live process still refuses, before anything loads.
    let held = i.tmp.path().join("held-lock");
    std::fs::create_dir(&held).unwrap();
    let lock = std::fs::File::create(held.join(".lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        },
        0
    );
    let (code, _, stderr) = train_to_end(&train_args(&i, &held, &quick));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("another trainer is running in this run directory"),
        "{stderr}"
    );
    assert!(!stderr.contains("loading target"), "{stderr}");
    drop(lock);
    eprintln!(
        "an empty .lock: a new run trained there; a dead trainer's .lock ({gone_pid}): --resume \
         trained from step 0; a held .lock: refused before loading"
    );
}

/// The log line of `run` that contains `pattern`, among those that came so far.
fn seen_line(lines: &[String], pattern: &str) -> String {
    lines
        .iter()
        .find(|l| l.contains(pattern))
        .unwrap_or_else(|| panic!("no line with {pattern:?} in {lines:#?}"))
        .clone()
}

#[test]
fn a_second_sigterm_during_a_validation_pass_stops_within_seconds() {
    // 2,000 held-out sequences: a pass of many seconds on the tiny model.
    let sequences = 2000;
    let i = crate::common::tiny_run(sequences, 3);
    let mut run = Trainer::start(
        &i,
        &i.tmp.path().join("run"),
        &[
            "validation.every_steps=2",
            &format!("validation.sequences={sequences}"),
        ],
    );
    run.line_with(
        &format!("validation at step 2: measuring {sequences} held-out sequences"),
        Duration::from_secs(60),
    );
    let pass_started = Instant::now();
    run.signal(libc::SIGTERM);
    run.line_with(
        "SIGTERM: stopping with a checkpoint",
        Duration::from_secs(10),
    );
    let t = Instant::now();
    run.signal(libc::SIGTERM);
    let run_dir = run.run_dir.clone();
    let (code, stdout, log) = run.wait_with_log(Duration::from_secs(60));
    let stop_s = t.elapsed().as_secs_f64();
    let in_pass_s = pass_started.elapsed().as_secs_f64();
    assert_eq!(code, Some(0), "{stdout}\n{log:#?}");
    assert!(
        stop_s < 5.0,
        "{stop_s:.2} s from the second SIGTERM to the exit"
    );
    let stopped = seen_line(
        &log,
        "stopped at once at step 2: validation at step 2: after ",
    );
    let measured: usize = stopped
        .split("after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stopped}"));
    // Cut short: most of the pass was still to come.
    assert!(4 * measured < sequences, "{stopped}");
    assert!(
        stdout.contains("run stopped (at once, no checkpoint): 2 of 1000000 steps")
            && stdout.contains("last checkpoint none"),
        "{stdout}"
    );
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(!metrics.contains("\"type\":\"validation\""), "{metrics}");
    eprintln!(
        "second SIGTERM during a validation pass of {sequences} sequences: exit 0 {stop_s:.2} s \
         later, the pass cancelled after {measured} sequences ({in_pass_s:.2} s into it: the whole \
         pass would take about {:.0} s)",
        in_pass_s * sequences as f64 / measured.max(1) as f64
    );
}

#[test]
fn a_second_sigterm_exits_within_seconds_when_a_stage_cannot_stop() {
    // The stop's checkpoint writer hangs for good: the second SIGTERM cannot be waited for.
    let i = crate::common::tiny_run(32, 3);
    let mut run = Trainer::start(
        &i,
        &i.tmp.path().join("run"),
        &[
            "debug.fail_stage=checkpoint",
            "debug.fail_at_step=1",
            "debug.fail_mode=hold-drafter",
        ],
    );
    run.line_with("step 5/", Duration::from_secs(60));
    run.signal(libc::SIGTERM);
    run.line_with("waiting to be killed", Duration::from_secs(30));
    let t = Instant::now();
    run.signal(libc::SIGTERM);
    let (code, stdout, log) = run.wait_with_log(Duration::from_secs(30));
    let exit_s = t.elapsed().as_secs_f64();
    assert_eq!(code, Some(1), "{stdout}\n{log:#?}");
    assert!((5.0..8.0).contains(&exit_s), "{exit_s:.2} s");
    let line = seen_line(
        &log,
        "the stages did not stop within 5 s of the second stop signal",
    );
    assert!(
        line.contains("(the run was checkpointing at step ")
            && line.contains("last checkpoint none"),
        "{line}"
    );
    eprintln!("second SIGTERM while a checkpoint writer hangs: exit 1 after {exit_s:.2} s: {line}");
}
