//! Runs that outlive their terminal, end to end in tmux with the real binary on the tiny
//! config: a closed terminal (tmux kill-session: SIGHUP) leaves the run training with a
//! checkpoint, `attach` opens its control room again (keys work, two viewers at once, a
//! read-only one), leaving a screen never stops the run, `ctl status` answers, SIGTERM ends a
//! screen run without a key, and `attach` on a finished run shows its record.

use crate::common;

use common::{ctl, wait_until, Tmux};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_dflash-tui")
}

fn train_command(i: &common::TinyRun, run_dir: &Path, exit_file: &Path) -> String {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    format!(
        "{} train --config {} --set model.target={} --set data.path={} \
         --set train.total_steps=1000000 --set checkpoint.save_every_steps=0 --run-dir {}; \
         echo EXIT=$? > {}; sleep 60",
        bin(),
        config.display(),
        i.target.display(),
        i.data.display(),
        run_dir.display(),
        exit_file.display()
    )
}

fn checkpoints(run_dir: &Path) -> usize {
    dflash_tui::train::checkpoint::list_checkpoints(&run_dir.join("checkpoints")).len()
}

/// The newest step in metrics.jsonl.
fn recorded_step(run_dir: &Path) -> u64 {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"type\":\"step\""))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["step"].as_u64())
        .max()
        .unwrap_or(0)
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// The trainer of a run dir (its PID from the lock file); killed with the test.
struct Trainer(i32);

impl Trainer {
    fn of(run_dir: &Path) -> Trainer {
        let pid = wait_until("the run's lock file", Duration::from_secs(60), || {
            std::fs::read_to_string(run_dir.join(".lock"))
                .ok()
                .and_then(|t| t.trim().parse().ok())
        });
        Trainer(pid)
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        if alive(self.0) {
            // SAFETY: the trainer this test started.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

#[test]
fn a_closed_terminal_leaves_the_run_training_and_attach_opens_it_again() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let exit_file = i.tmp.path().join("exit");
    let first = Tmux::start("hup", &train_command(&i, &run_dir, &exit_file));
    let trainer = Trainer::of(&run_dir);
    wait_until("steps on the screen", Duration::from_secs(60), || {
        first.step().filter(|&s| s > 2)
    });

    // The terminal goes away.
    let t = Instant::now();
    let before = checkpoints(&run_dir);
    first.kill();
    wait_until(
        "the checkpoint after SIGHUP",
        Duration::from_secs(30),
        || (checkpoints(&run_dir) > before).then_some(()),
    );
    let saved_in = t.elapsed();
    let at = recorded_step(&run_dir);
    wait_until("training after SIGHUP", Duration::from_secs(30), || {
        (recorded_step(&run_dir) > at + 3).then_some(())
    });
    assert!(alive(trainer.0), "the trainer lives on");
    let log = std::fs::read_to_string(run_dir.join("train.log")).unwrap();
    assert!(
        log.contains("SIGHUP: the terminal is gone; training goes on"),
        "{log}"
    );
    eprintln!(
        "tmux kill-session: trainer PID {} alive, checkpoint {:.2} s later, steps {at} -> {}",
        trainer.0,
        saved_in.as_secs_f64(),
        recorded_step(&run_dir)
    );

    // ctl status: one JSON object.
    let (ok, text) = ctl(&run_dir, &["status"]);
    assert!(ok, "{text}");
    let status: serde_json::Value = serde_json::from_str(text.trim()).expect(&text);
    assert_eq!(status["pid"].as_i64(), Some(i64::from(trainer.0)));
    assert_eq!(status["phase"], "training");
    // the tiny target named by family and layers
    let target = status["target"].as_str().unwrap_or_default();
    assert!(target.ends_with(" decoder layers"), "{status}");
    assert!(status["step"].as_u64().unwrap() > at, "{status}");
    assert!(status["tokens_per_s"].as_f64().unwrap() > 0.0, "{status}");
    assert!(status["last_checkpoint"].is_string(), "{status}");
    assert_eq!(
        status["queues"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );

    // attach: the control room again, advancing, its keys working.
    let attach_exit = i.tmp.path().join("attach-exit");
    let viewer = Tmux::start(
        "attach",
        &format!(
            "{} attach {}; echo EXIT=$? > {}; sleep 60",
            bin(),
            run_dir.display(),
            attach_exit.display()
        ),
    );
    let seen = wait_until("the attached screen", Duration::from_secs(30), || {
        viewer.step().filter(|&s| s > 0)
    });
    wait_until("steps advancing on it", Duration::from_secs(30), || {
        viewer.step().filter(|&s| s > seen)
    });
    let screen = viewer.screen();
    assert!(
        screen.contains("Process (no GPUs: NVML unavailable)") || screen.contains("GPUs ("),
        "the process's CPU and memory where NVML is missing: {screen}"
    );
    // log lines as "HH:MM:SS L message" (a long one wraps over the next rows)
    let stamped = |cell: &str| {
        let b = cell.as_bytes();
        b.len() > 11
            && b[2] == b':'
            && b[5] == b':'
            && b[8] == b' '
            && matches!(b[9], b'I' | b'W' | b'E')
            && b[10] == b' '
    };
    assert!(
        screen.lines().any(|l| l.split('│').any(stamped)),
        "compact log lines: {screen}"
    );
    viewer.keys(&["p"]);
    wait_until("paused", Duration::from_secs(10), || {
        viewer.screen().contains("paused").then_some(())
    });

    // A second, read-only viewer at the same time.
    let reader = Tmux::start(
        "reader",
        &format!("{} attach --read-only {}", bin(), run_dir.display()),
    );
    wait_until(
        "the read-only screen, paused",
        Duration::from_secs(30),
        || {
            let s = reader.screen();
            (s.contains("paused") && s.contains("read-only")).then_some(())
        },
    );
    reader.keys(&["c"]);
    wait_until("its refusal", Duration::from_secs(10), || {
        reader
            .screen()
            .contains("read-only viewer: checkpoint not sent")
            .then_some(())
    });
    viewer.keys(&["p"]);
    wait_until("training again on both", Duration::from_secs(20), || {
        let (a, b) = (viewer.screen(), reader.screen());
        (a.contains("training") && b.contains("training")).then_some(())
    });
    let log = std::fs::read_to_string(run_dir.join("train.log")).unwrap();
    assert!(
        log.contains("command pause: paused"),
        "the command is logged: {log}"
    );

    // Leaving a screen never stops the run.
    viewer.keys(&["q"]);
    wait_until("the quit dialog", Duration::from_secs(10), || {
        viewer
            .screen()
            .contains("leave (the run goes on)")
            .then_some(())
    });
    viewer.keys(&["Down"]);
    viewer.keys(&["Down"]);
    viewer.keys(&["Enter"]);
    let exit = wait_until("attach to exit", Duration::from_secs(10), || {
        std::fs::read_to_string(&attach_exit).ok()
    });
    assert_eq!(exit.trim(), "EXIT=0");
    reader.keys(&["q"]);
    let at = recorded_step(&run_dir);
    wait_until("training after both left", Duration::from_secs(30), || {
        (recorded_step(&run_dir) > at + 2).then_some(())
    });
    assert!(alive(trainer.0));

    // Stopped: the process ends (nobody waits at its screen) and attach shows the record.
    let (ok, text) = ctl(&run_dir, &["stop"]);
    assert!(ok, "{text}");
    wait_until("the trainer to exit", Duration::from_secs(30), || {
        (!alive(trainer.0)).then_some(())
    });
    // ctl status on the ended run: its final state from its records, exit 0
    let (ok, text) = ctl(&run_dir, &["status"]);
    assert!(ok, "{text}");
    let stopped_at = recorded_step(&run_dir);
    let ended = format!("the run has ended: stopped at step {stopped_at} of 1000000");
    assert!(text.contains(&ended), "{text}");
    let json = text
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_default();
    let status: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(status["phase"], "stopped", "{text}");
    // from the run's config.toml when no trainer answers
    assert_eq!(status["target"].as_str(), Some(target), "{text}");
    assert_eq!(status["step"], stopped_at, "{text}");
    assert!(status["pid"].is_null(), "{text}");
    assert!(status["last_checkpoint"].is_string(), "{text}");
    let done_exit = i.tmp.path().join("done-exit");
    let done = Tmux::start(
        "done",
        &format!(
            "{} attach {}; echo EXIT=$? > {}; sleep 60",
            bin(),
            run_dir.display(),
            done_exit.display()
        ),
    );
    let screen = wait_until("the finished run's screen", Duration::from_secs(30), || {
        let s = done.screen();
        s.contains("press any key").then_some(s)
    });
    assert!(screen.contains("run stopped at step"), "{screen}");
    assert!(screen.contains("avg "), "its averages: {screen}");
    assert!(screen.contains("loss"), "its charts: {screen}");
    done.keys(&["x"]);
    let exit = wait_until("attach to exit", Duration::from_secs(10), || {
        std::fs::read_to_string(&done_exit).ok()
    });
    assert_eq!(exit.trim(), "EXIT=0");
    // A screen run writes the records a headless one does.
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"type\":\"queues\""), "queue records");
}

#[test]
fn sigterm_ends_a_screen_run_with_a_checkpoint_and_no_key() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let exit_file = i.tmp.path().join("exit");
    let window = Tmux::start("term", &train_command(&i, &run_dir, &exit_file));
    let trainer = Trainer::of(&run_dir);
    wait_until("steps on the screen", Duration::from_secs(60), || {
        window.step().filter(|&s| s > 2)
    });
    let t = Instant::now();
    // SAFETY: the trainer this test started.
    unsafe { libc::kill(trainer.0, libc::SIGTERM) };
    let exit = wait_until("the exit without a key", Duration::from_secs(30), || {
        std::fs::read_to_string(&exit_file).ok()
    });
    assert_eq!(exit.trim(), "EXIT=0");
    assert_eq!(checkpoints(&run_dir), 1, "the stop wrote a checkpoint");
    let screen = window.screen();
    assert!(screen.contains("run stopped (stop command)"), "{screen}");
    eprintln!(
        "SIGTERM on a screen run: exit 0 {:.2} s later with a checkpoint, no key pressed",
        t.elapsed().as_secs_f64()
    );
}

/// User and system CPU time of a process so far, and its peak resident memory in bytes.
fn cpu_and_peak(pid: i32) -> (Duration, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: a plain query.
    let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let peak_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    (
        Duration::from_secs_f64(ticks as f64 / per_s),
        peak_kb * 1024,
    )
}

/// A step record's line (the shape the trainer writes).
fn step_line(step: u64) -> String {
    format!(
        "{{\"type\":\"step\",\"step\":{step},\"epoch\":0,\"loss\":2.{step},\"accuracy\":0.25,\
         \"accept_mean\":1.5,\"lr\":0.0001,\"grad_norm\":0.7,\"tokens\":1000,\"samples\":4,\
         \"blocks\":100,\"step_s\":0.2,\"tokens_per_s\":5000.0,\"samples_per_s\":20.0,\
         \"elapsed_s\":{step}.5}}\n"
    )
}

#[test]
fn attach_reads_a_long_record_once_and_counts_a_line_that_is_not_utf8() {
    // 200 MB of step records (a long run), with one line holding a byte that is not UTF-8
    const BYTES: usize = 200 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let t = Instant::now();
    let mut text = String::with_capacity(BYTES + 1024);
    text.push_str(&step_line(1));
    let mut text = text.into_bytes();
    text.extend_from_slice(b"{\"type\":\"event\",\"kind\":\"\xff\"}\n");
    let mut steps = 1;
    while text.len() < BYTES {
        steps += 1;
        text.extend_from_slice(step_line(steps).as_bytes());
    }
    let summary = format!(
        "{{\"type\":\"summary\",\"phase\":\"finished\",\"steps\":{steps},\"elapsed_s\":{steps}.5,\
         \"tokens_seen\":1000,\"samples_seen\":4,\"final_loss\":2.0,\"final_accuracy\":0.25,\
         \"final_accept_mean\":1.5,\"last_checkpoint\":null,\"error\":null}}\n"
    );
    text.extend_from_slice(summary.as_bytes());
    std::fs::write(run_dir.join("metrics.jsonl"), &text).unwrap();
    let made_s = t.elapsed().as_secs_f64();
    drop(text);

    let t = Instant::now();
    let screen = Tmux::start(
        "long",
        &format!("exec {} attach --read-only {}", bin(), run_dir.display()),
    );
    let pid: i32 = {
        let out = Command::new("tmux")
            .args(["display", "-p", "-t", &screen.session, "#{pane_pid}"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    };
    let shown = wait_until(
        "the whole run on the screen",
        Duration::from_secs(30),
        || {
            let s = screen.screen();
            s.contains("press any key").then_some(s)
        },
    );
    let first_s = t.elapsed().as_secs_f64();
    assert!(
        shown.contains(&format!("step {steps}")),
        "the last step: {shown}"
    );
    // (the log pane wraps the line)
    assert!(
        shown.contains("metrics.jsonl: 1 unreadable line")
            && shown.contains("(line 2: not UTF-8 at byte 25)"),
        "the bad line is counted in the log pane: {shown}"
    );
    // After the first read: a screen on a finished run reads nothing again.
    let window = Duration::from_secs(3);
    let (cpu0, _) = cpu_and_peak(pid);
    let w = Instant::now();
    std::thread::sleep(window);
    let (cpu1, peak) = cpu_and_peak(pid);
    let share = (cpu1 - cpu0).as_secs_f64() / w.elapsed().as_secs_f64();
    eprintln!(
        "attach --read-only on {} MB of records ({steps} steps, made in {made_s:.1} s): whole \
         run on the screen {first_s:.1} s after the start, then {:.1} % of a core over {:?}, \
         peak memory {} MB",
        BYTES >> 20,
        share * 100.0,
        window,
        peak >> 20
    );
    assert!(
        share < 0.10,
        "{:.1} % of a core after the first read",
        share * 100.0
    );
    assert!(peak < 200 << 20, "peak memory {} MB", peak >> 20);
    // a key still leaves at once
    screen.keys(&["x"]);
    wait_until("attach to exit", Duration::from_secs(5), || {
        (!alive(pid)).then_some(())
    });
}

/// A control socket that takes connections and never answers (a hung trainer); the
/// connections stay open while it lives.
fn silent_socket(run_dir: &Path) -> std::thread::JoinHandle<()> {
    let listener = std::os::unix::net::UnixListener::bind(run_dir.join("control.sock")).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            match stream {
                Ok(s) => held.push(s),
                Err(_) => return,
            }
        }
    })
}

#[test]
fn a_trainer_that_does_not_answer_gets_a_timeout_message_from_ctl_and_attach() {
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let _listener = silent_socket(&run_dir);

    let t = Instant::now();
    let (ok, text) = ctl(&run_dir, &["pause"]);
    let ctl_s = t.elapsed().as_secs_f64();
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!(
            "the trainer at {} did not answer within 5 s; it may be busy or hung",
            run_dir.join("control.sock").display()
        )) && text.contains("attach --read-only"),
        "{text}"
    );
    assert!(ctl_s < 8.0, "ctl answered after {ctl_s:.1} s");

    let t = Instant::now();
    let screen = Tmux::start(
        "silent",
        &format!("exec {} attach {}", bin(), run_dir.display()),
    );
    wait_until("connecting... at once", Duration::from_secs(3), || {
        screen
            .screen()
            .contains("connecting to the trainer")
            .then_some(())
    });
    let connecting_s = t.elapsed().as_secs_f64();
    let shown = wait_until("the timeout on the screen", Duration::from_secs(10), || {
        let s = screen.screen();
        s.contains("did not answer within 5 s").then_some(s)
    });
    let timeout_s = t.elapsed().as_secs_f64();
    eprintln!(
        "a silent socket: ctl failed after {ctl_s:.1} s; attach drew \"connecting\" after \
         {connecting_s:.1} s and the timeout after {timeout_s:.1} s"
    );
    assert!(timeout_s < 9.0, "{timeout_s:.1} s: {shown}");
    // the keys work while the trainer stays silent
    screen.keys(&["?"]);
    wait_until("the help overlay", Duration::from_secs(5), || {
        screen.screen().contains("┌ Help ").then_some(())
    });
}

#[test]
fn a_run_with_a_line_that_is_not_utf8_in_its_records_resumes() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let train = |steps: u64, dir_flag: &[&str]| {
        Command::new(bin())
            .arg("train")
            .arg("--config")
            .arg(&config)
            .args(["--set", &format!("model.target={}", i.target.display())])
            .args(["--set", &format!("data.path={}", i.data.display())])
            .args(["--set", &format!("train.total_steps={steps}")])
            .args(["--set", "checkpoint.save_every_steps=2"])
            .args(dir_flag)
            .arg(&run_dir)
            .arg("--no-tui")
            .output()
            .unwrap()
    };
    let out = train(4, &["--run-dir"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = run_dir.join("metrics.jsonl");
    let mut bytes = std::fs::read(&metrics).unwrap();
    let second = bytes.iter().position(|&b| b == b'\n').unwrap() + 1;
    bytes.splice(
        second..second,
        b"{\"type\":\"event\",\"kind\":\"\xfe\"}\n".iter().copied(),
    );
    std::fs::write(&metrics, &bytes).unwrap();

    let out = train(6, &["--allow-schedule-change", "--resume"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("metrics.jsonl: 1 unreadable line skipped (line 2: not UTF-8 at byte 25)"),
        "the bad line is counted in the log: {log}"
    );
    let steps: Vec<u64> = dflash_tui::telemetry::records::read_metrics(&metrics)
        .expect("the resumed run's records are whole again")
        .into_iter()
        .filter_map(|r| match r {
            dflash_tui::telemetry::records::MetricsRecord::Step(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert_eq!(steps, (1..=6).collect::<Vec<_>>());
}
