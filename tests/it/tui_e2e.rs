//! The control room end to end: the real binary on the tiny config, driven in tmux (keys, the
//! `:` line, the quit dialog), and the same scenario headless through `dflash-tui ctl` and
//! signals.

use crate::common;

use common::{ctl, wait_until, Tmux};

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_dflash-tui")
}

type Inputs = common::TinyRun;

fn inputs() -> Inputs {
    common::tiny_run(32, 3)
}

/// The tiny run training on (no end in sight, no periodic checkpoints), with the screen.
fn train_args(i: &Inputs, run_dir: &Path) -> Vec<String> {
    let endless = ["train.total_steps=1000000", "checkpoint.save_every_steps=0"];
    common::tiny_screen_train_args(i, run_dir, &endless)
}

fn checkpoints(run_dir: &Path) -> usize {
    dflash_tui::train::checkpoint::list_checkpoints(&run_dir.join("checkpoints")).len()
}

/// A trainer started by a test, killed if the test fails before it ends (a trainer runs on
/// without its test).
struct Running(Option<std::process::Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn keys_drive_the_control_room_in_tmux() {
    let i = inputs();
    let run_dir = i.tmp.path().join("run");
    let exit_file = i.tmp.path().join("exit");
    let cmd = format!(
        "{} {}; echo EXIT=$? > {}; sleep 60",
        bin(),
        train_args(&i, &run_dir).join(" "),
        exit_file.display()
    );
    let t = Tmux::start("e2e", &cmd).holding(run_dir.clone());

    // steps advance on the screen
    let first = wait_until("a first step", Duration::from_secs(60), || {
        t.step().filter(|&s| s > 0)
    });
    wait_until("more steps", Duration::from_secs(30), || {
        t.step().filter(|&s| s > first)
    });
    assert!(t.screen().contains("training"), "{}", t.screen());

    // p pauses: the header says paused; the step in flight finishes, the log says at which
    // step the pause took hold, and the count stays there
    t.keys(&["p"]);
    t.wait_for("paused", Duration::from_secs(10), |screen| {
        screen.contains("paused").then_some(())
    });
    let paused_at = t.wait_for(
        "the pause to take hold",
        Duration::from_secs(60),
        |screen| {
            let at = screen.find("paused at step ")? + "paused at step ".len();
            let digits: String = screen[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse::<u64>().ok()
        },
    );
    wait_until("the header at that step", Duration::from_secs(10), || {
        (t.step() == Some(paused_at)).then_some(())
    });
    // an interval is what is checked here (no step in it), so a sleep: no event to await
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(t.step(), Some(paused_at), "steps advanced while paused");
    // p resumes
    t.keys(&["p"]);
    wait_until("progress after resume", Duration::from_secs(20), || {
        t.step().filter(|&s| s > paused_at + 2)
    });

    // c writes a checkpoint
    t.keys(&["c"]);
    wait_until("a checkpoint", Duration::from_secs(20), || {
        (checkpoints(&run_dir) >= 1).then_some(())
    });

    // :queue feature_q 5 changes the gauge's capacity
    t.keys(&[":"]);
    t.keys(&["-l", "queue feature_q 5"]);
    t.keys(&["Enter"]);
    wait_until(
        "feature_q depth 5 on screen",
        Duration::from_secs(10),
        || {
            let s = t.screen();
            s.lines()
                .any(|l| l.contains("feature_q") && l.contains("/5"))
                .then_some(())
        },
    );

    // q, then "checkpoint and stop" (the default choice): the run ends with a checkpoint
    let before = checkpoints(&run_dir);
    t.keys(&["q"]);
    wait_until("the quit dialog", Duration::from_secs(10), || {
        t.screen().contains("checkpoint and stop").then_some(())
    });
    t.keys(&["Enter"]);
    wait_until("the end screen", Duration::from_secs(30), || {
        t.screen().contains("press any key").then_some(())
    });
    t.keys(&["x"]);
    let exit = wait_until("the process to exit", Duration::from_secs(30), || {
        std::fs::read_to_string(&exit_file).ok()
    });
    assert_eq!(exit.trim(), "EXIT=0");
    assert!(
        checkpoints(&run_dir) > before,
        "quitting wrote a checkpoint"
    );
    assert!(
        t.screen().contains("run stopped (stop command)"),
        "summary printed: {}",
        t.screen()
    );
}

#[test]
fn the_same_scenario_headless_through_ctl_and_signals() {
    let i = inputs();
    let run_dir = i.tmp.path().join("run");
    let mut args = train_args(&i, &run_dir);
    args.push("--no-tui".into());
    let mut child = Running(Some(
        Command::new(bin())
            .args(&args)
            .env("DFLASH_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let pid = child.0.as_ref().map_or(0, |c| c.id() as i32);
    let socket = run_dir.join("control.sock");
    wait_until("the control socket", Duration::from_secs(60), || {
        socket.exists().then_some(())
    });
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);

    let (ok, reply) = ctl(&run_dir, &["pause"]);
    assert!(ok && reply.contains("paused"), "{reply}");
    let (ok, reply) = ctl(&run_dir, &["resume"]);
    assert!(ok && reply.contains("resumed"), "{reply}");
    let (ok, reply) = ctl(&run_dir, &["queue", "feature_q", "2"]);
    assert!(ok && reply.contains("feature_q depth set to 2"), "{reply}");
    let (ok, reply) = ctl(&run_dir, &["queue", "feature_q", "0"]);
    assert!(!ok && reply.contains(">= 1"), "{reply}");
    let (ok, reply) = ctl(&run_dir, &["checkpoint"]);
    assert!(ok, "{reply}");
    wait_until("the ctl checkpoint", Duration::from_secs(30), || {
        (checkpoints(&run_dir) >= 1).then_some(())
    });

    // SIGUSR1 checkpoints
    let before = checkpoints(&run_dir);
    unsafe { libc::kill(pid, libc::SIGUSR1) };
    wait_until("the SIGUSR1 checkpoint", Duration::from_secs(30), || {
        (checkpoints(&run_dir) > before).then_some(())
    });
    // SIGINT stops with a checkpoint and exits 0
    unsafe { libc::kill(pid, libc::SIGINT) };
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("run stopped (stop command)"));
    assert!(!socket.exists(), "the socket is removed at exit");
    let (ok, reply) = ctl(&run_dir, &["pause"]);
    assert!(!ok && reply.contains("no running trainer"), "{reply}");
}
