//! The control socket and the signals under faults (issue 16): idle connections and a command
//! storm against a training run, over-long lines and bytes that are not text, the run-time limits
//! of `queue` and `profile`, failing accepts, a run dir whose socket path cannot exist; and in
//! [`signals`], signals during start-up and a second stop signal during a long pass (issue 47).
//! Each case prints its trials and outcomes (`--nocapture`).

use crate::common;
mod signals;
mod stand_in;

use common::ctl;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dflash_tui::frontend::socket::{self as control, ControlSocket, Limits, Request, WireReply};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_dflash-tui")
}

/// Reads one reply line, byte by byte so that nothing after it is taken (None: closed or
/// nothing within `limit`).
fn reply_within(mut stream: &UnixStream, limit: Duration) -> Option<WireReply> {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        match stream.read(&mut byte) {
            Ok(1) => line.push(byte[0]),
            _ => return None,
        }
    }
    serde_json::from_slice(&line).ok()
}

/// True when the server has closed `stream` within `limit`: end of file, or a reset when it
/// closed with bytes of ours unread (after its reply was read).
fn closed_within(mut stream: &UnixStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(n) => n == 0,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

fn percentile(sorted_ms: &[f64], p: f64) -> f64 {
    let i = ((sorted_ms.len() as f64 - 1.0) * p).round() as usize;
    sorted_ms[i]
}

fn latency_summary(mut ms: Vec<f64>) -> String {
    ms.sort_by(f64::total_cmp);
    format!(
        "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        percentile(&ms, 0.5),
        percentile(&ms, 0.99),
        ms[ms.len() - 1]
    )
}

/// How a set of idle connections ended: each with an error line and then closed.
#[derive(Default)]
struct IdleEnd {
    evicted: usize,
    timed_out: usize,
    /// Seconds after the connections were opened when the last one was seen closed.
    last_s: f64,
}

/// Watches idle connections (in the order opened, as they end) on a thread: each must get
/// an error line, evicted to make room or at the line timeout, and then be closed.
fn watch_idle(idle: Vec<UnixStream>, opened: Instant) -> std::thread::JoinHandle<IdleEnd> {
    std::thread::spawn(move || {
        let mut end = IdleEnd::default();
        for s in &idle {
            let reply = reply_within(s, Duration::from_secs(15)).expect("an error line");
            assert!(!reply.ok, "{reply:?}");
            if reply.message.contains("closed to make room") {
                end.evicted += 1;
            } else {
                assert!(
                    reply.message.contains("no complete line within"),
                    "{reply:?}"
                );
                end.timed_out += 1;
            }
            assert!(closed_within(s, Duration::from_secs(5)));
            end.last_s = opened.elapsed().as_secs_f64();
        }
        end
    })
}

// ---- a real training run (the binary on the tiny config, headless) ----

type Inputs = common::TinyRun;

/// `train` headless on the tiny inputs, to run until stopped: no step limit, no periodic
/// checkpoint or profile; `extra` settings after those.
fn train_args(i: &Inputs, run_dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut set = vec![
        "train.total_steps=1000000",
        "checkpoint.save_every_steps=0",
        "telemetry.profile_interval_s=0",
    ];
    set.extend(extra);
    common::tiny_train_args(i, run_dir, &set)
}

/// `train` run to its end: (exit code, stdout, stderr).
fn train_to_end(args: &[String]) -> (Option<i32>, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env("DFLASH_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `train --no-tui` child whose log lines (stderr) arrive line by line.
struct Trainer {
    /// None once `wait` took it; dropped with the test otherwise (killed, so that a failing
    /// test leaves no run behind).
    child: Option<Child>,
    pid: i32,
    run_dir: PathBuf,
    lines: common::Lines,
    stdout: common::Lines,
}

impl Trainer {
    fn start(i: &Inputs, run_dir: &Path, extra: &[&str]) -> Trainer {
        let mut child = common::spawn_dflash(&train_args(i, run_dir, extra), Stdio::null());
        let lines = common::Lines::read(child.stderr.take().unwrap());
        let stdout = common::Lines::read(child.stdout.take().unwrap());
        Trainer {
            pid: child.id() as i32,
            child: Some(child),
            run_dir: run_dir.to_path_buf(),
            lines,
            stdout,
        }
    }

    fn pid(&self) -> i32 {
        self.pid
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Waits for a log line containing `pattern`.
    fn line_with(&mut self, pattern: &str, limit: Duration) -> String {
        self.lines_until(pattern, limit).pop().unwrap()
    }

    /// The log lines up to and including the first that contains `pattern`.
    fn lines_until(&mut self, pattern: &str, limit: Duration) -> Vec<String> {
        let from = self.lines.seen.len();
        self.lines
            .next_with(&format!("{pattern:?}"), limit, |l| l.contains(pattern));
        self.lines.seen[from..].to_vec()
    }

    /// The share of a core the child uses over `window` (a measurement, so a sleep).
    fn cpu_share_over(&self, window: Duration) -> f64 {
        let (cpu, t) = (self.cpu_time(), Instant::now());
        std::thread::sleep(window);
        (self.cpu_time() - cpu).as_secs_f64() / t.elapsed().as_secs_f64()
    }

    /// Waits for the exit; returns the exit code (None: killed by a signal) and stdout.
    fn wait(self, limit: Duration) -> (Option<i32>, String) {
        let (code, stdout, _) = self.wait_with_log(limit);
        (code, stdout)
    }

    /// [`Trainer::wait`], and the log lines that no `line_with` or `lines_until` read.
    fn wait_with_log(mut self, limit: Duration) -> (Option<i32>, String, Vec<String>) {
        let pid = self.pid();
        let mut child = self.child.take().expect("waited once");
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = tx.send(child.wait().unwrap().code());
        });
        let code = rx.recv_timeout(limit).unwrap_or_else(|_| {
            // SAFETY: our own child, which hangs.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the run did not end within {limit:?}");
        });
        let unread = self.lines.seen.len();
        self.lines.all(limit);
        let log = self.lines.seen.split_off(unread);
        (code, self.stdout.all(limit), log)
    }

    fn socket(&self) -> PathBuf {
        self.run_dir.join(control::SOCKET_NAME)
    }

    fn raw(&self) -> UnixStream {
        UnixStream::connect(self.socket()).unwrap()
    }

    fn send(&self, command: &str) -> WireReply {
        control::send(&self.run_dir, command).unwrap()
    }

    fn last_step(&self) -> u64 {
        std::fs::read_to_string(self.run_dir.join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"type\":\"step\""))
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["step"].as_u64())
            .max()
            .unwrap_or(0)
    }

    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    /// User and system CPU time of the child so far.
    fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // SAFETY: a plain query.
        let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Duration::from_secs_f64(ticks as f64 / per_s)
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One storm command and whether it must be accepted.
fn storm_command(client: usize, k: usize) -> (String, bool) {
    match (client + k) % 8 {
        0 => (format!("queue batch_q {}", 1 + k % 8), true),
        1 => (format!("queue feature_q {}", 1 + k % 4), true),
        2 => (format!("profile {}", [0, 5, 30][k % 3]), true),
        3 => ("queue batch_q 1000000".into(), false),
        4 => ("profile 0.001".into(), false),
        5 => (format!("bogus-{k}"), false),
        6 => ("queue nowhere 2".into(), false),
        _ => ("resume".into(), true),
    }
}

/// Starts `clients` threads sending commands, each at least `at_least` and on while `going`;
/// their results are the latencies in ms.
fn storm(
    run_dir: &Path,
    clients: usize,
    at_least: usize,
    going: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Vec<f64>>> {
    (0..clients)
        .map(|c| {
            let (run_dir, going) = (run_dir.to_path_buf(), going.clone());
            std::thread::spawn(move || {
                let mut latencies = Vec::new();
                while latencies.len() < at_least || going.load(Ordering::SeqCst) {
                    let (command, accepted) = storm_command(c, latencies.len());
                    let t = Instant::now();
                    let reply = control::send(&run_dir, &command).unwrap();
                    latencies.push(t.elapsed().as_secs_f64() * 1e3);
                    assert_eq!(reply.ok, accepted, "{command}: {reply:?}");
                    assert!(reply.message.len() < 200, "{command}: {reply:?}");
                }
                latencies
            })
        })
        .collect()
}

#[test]
fn a_training_run_survives_idle_connections_a_command_storm_and_failing_accepts() {
    let i = common::tiny_run(32, 3);
    let mut run = Trainer::start(&i, &i.tmp.path().join("run"), &[]);
    run.line_with("step 5/", Duration::from_secs(60));
    let base_fds = run.open_fds();

    // 120 idle connections, each with half a command, left open.
    let t_idle = Instant::now();
    let idle: Vec<UnixStream> = (0..120)
        .map(|_| {
            let mut s = run.raw();
            s.write_all(b"{\"command\": \"queue batch").unwrap();
            s
        })
        .collect();
    let (ok, reply) = ctl(&run.run_dir, &["queue", "feature_q", "3"]);
    assert!(ok && reply.contains("feature_q depth set to 3"), "{reply}");
    let fds_with_idle = run.open_fds();
    let watcher = watch_idle(idle, t_idle);

    // A storm from 4 clients while the idle ones stay open, with the fds sampled meanwhile.
    let step_before = run.last_step();
    let sampling = Arc::new(Mutex::new((true, base_fds)));
    let sampler = {
        let (sampling, pid) = (sampling.clone(), run.pid());
        std::thread::spawn(move || {
            while sampling.lock().unwrap().0 {
                let n = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
                let mut s = sampling.lock().unwrap();
                s.1 = s.1.max(n);
                drop(s);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    // The storm lasts until the run has logged 5 more steps, and at least 100 commands each.
    let t_storm = Instant::now();
    let going = Arc::new(AtomicBool::new(true));
    let clients = storm(&run.run_dir, 4, 100, &going);
    run.line_with(
        &format!("step {}/", (step_before / 5 + 2) * 5),
        Duration::from_secs(60),
    );
    going.store(false, Ordering::SeqCst);
    let latencies: Vec<f64> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let storm_s = t_storm.elapsed().as_secs_f64();
    sampling.lock().unwrap().0 = false;
    sampler.join().unwrap();
    let max_fds = sampling.lock().unwrap().1;
    let step_after = run.last_step();
    assert!(
        max_fds <= base_fds + 16 + 4 && fds_with_idle <= base_fds + 16 + 4,
        "open fds: {base_fds} before, {fds_with_idle} with 120 idle connections, {max_fds} at most"
    );
    let n = latencies.len();
    eprintln!(
        "run: 120 idle connections + {n} storm commands from 4 clients in {storm_s:.1} s: \
         {n}/{n} answered as expected ({}); steps advanced from {step_before} to {step_after}; \
         open fds {base_fds} before, {fds_with_idle} with the idle connections, at most \
         {max_fds} during the storm",
        latency_summary(latencies)
    );

    // Bad input from clients; the run goes on.
    let mut s = run.raw();
    s.write_all(&vec![b'q'; 70 * 1024]).unwrap();
    let reply = reply_within(&s, Duration::from_secs(5)).unwrap();
    assert!(
        !reply.ok && reply.message.contains("over 65536 bytes"),
        "{reply:?}"
    );
    let mut s = run.raw();
    s.write_all(b"\xc3\x28 checkpoint\n").unwrap();
    let reply = reply_within(&s, Duration::from_secs(5)).unwrap();
    assert!(
        !reply.ok && reply.message.contains("not UTF-8"),
        "{reply:?}"
    );
    let (ok, reply) = ctl(&run.run_dir, &["queue", "batch_q", "1000000"]);
    assert!(!ok && reply.contains("above the limit of 1024"), "{reply}");
    let (ok, reply) = ctl(&run.run_dir, &["profile", "0.001"]);
    assert!(
        !ok && reply.contains("below the 1 s minimum (0 = off)"),
        "{reply}"
    );
    let step = run.last_step();
    run.line_with(
        &format!("step {}/", (step / 5 + 2) * 5),
        Duration::from_secs(30),
    );

    // Every idle connection was closed with an error line: evicted or timed out (10 s).
    let end = watcher.join().unwrap();
    assert_eq!(end.evicted + end.timed_out, 120);
    assert!(end.last_s < 15.0, "{}", end.last_s);
    eprintln!(
        "run: a 70 KiB line and invalid UTF-8 got error replies, queue batch_q 1000000 and \
         profile 0.001 were refused through ctl, training went on to step {}; the 120 idle \
         connections were closed with an error line, {} to make room and {} at the 10 s \
         timeout, the last {:.1} s after they were opened",
        run.last_step(),
        end.evicted,
        end.timed_out,
        end.last_s
    );

    emfile_backs_off(&mut run);

    let (ok, reply) = ctl(&run.run_dir, &["stop"]);
    assert!(ok && reply.contains("stopping"), "{reply}");
    let (code, stdout) = run.wait(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("run stopped (stop command)"), "{stdout}");
}

/// With no file descriptor left, accepting fails (EMFILE): the accept loop pauses instead of
/// spinning, warns once, and serves the waiting clients once descriptors are back.
fn emfile_backs_off(run: &mut Trainer) {
    assert!(run.send("pause").ok);
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads the child's limit.
    let got = unsafe { libc::prlimit(run.pid(), libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(got, 0);
    let pid = run.pid();
    let set_soft = |soft: libc::rlim_t| {
        let new = libc::rlimit {
            rlim_cur: soft,
            rlim_max: old.rlim_max,
        };
        // SAFETY: sets our own child's limit.
        let set = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
        assert_eq!(set, 0);
    };
    let paused_share = run.cpu_share_over(Duration::from_secs(1));
    // Descriptors 0, 1 and 2 are taken: every new one fails.
    set_soft(3);
    let t_emfile = Instant::now();
    let waiting: Vec<UnixStream> = (0..5).map(|_| run.raw()).collect();
    run.line_with("cannot accept a connection", Duration::from_secs(10));
    let cpu_share = run.cpu_share_over(Duration::from_millis(1500));
    set_soft(old.rlim_cur);
    let emfile_s = t_emfile.elapsed().as_secs_f64();
    let until_back = run.lines_until("accepting again after", Duration::from_secs(5));
    let warnings = until_back
        .iter()
        .filter(|l| l.contains("cannot accept a connection"))
        .count();
    assert_eq!(warnings, 0, "one warning only: {until_back:?}");
    let mut served = 0;
    for mut s in waiting {
        s.write_all(b"resume\n").unwrap();
        let reply = reply_within(&s, Duration::from_secs(10)).unwrap();
        assert!(reply.ok, "{reply:?}");
        served += 1;
    }
    let (ok, reply) = ctl(&run.run_dir, &["checkpoint"]);
    assert!(ok, "{reply}");
    run.line_with("checkpoint (command) at step", Duration::from_secs(30));
    let back = until_back.last().unwrap();
    eprintln!(
        "run (training paused, {:.1} % of a core): accepts failing with EMFILE for {emfile_s:.1} \
         s: {:.1} % of a core, one warning, then \"{}\"; {served}/5 waiting clients served, a \
         checkpoint written afterwards",
        paused_share * 100.0,
        cpu_share * 100.0,
        back.split("control socket: ").nth(1).unwrap_or(back)
    );
    // Pauses of 20 ms doubling to 1 s: about 7 attempts in 1.5 s (a loop without them made
    // 1.4 million).
    let attempts: u64 = back
        .split("after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{back}"));
    assert!(attempts <= 20, "the accept loop spins: {back}");
    // a spinning accept loop takes a whole core; one that pauses costs what the paused run does
    assert!(
        cpu_share < paused_share + 0.25,
        "{:.1} % of a core while accepts fail, {:.1} % paused before",
        cpu_share * 100.0,
        paused_share * 100.0
    );
}

#[test]
fn a_run_dir_over_the_socket_path_limit_is_refused_before_the_model_loads() {
    let i = common::tiny_run(8, 3);
    let mut run_dir = i.tmp.path().to_path_buf();
    while run_dir.join(control::SOCKET_NAME).as_os_str().len() < 108 {
        run_dir.push("long-run-directory-name");
    }
    let len = run_dir.join(control::SOCKET_NAME).as_os_str().len();
    let t = Instant::now();
    let (code, _, stderr) = train_to_end(&train_args(&i, &run_dir, &[]));
    let took = t.elapsed();
    assert_eq!(code, Some(1), "{stderr}");
    let expected = format!(
        "the control socket's path is {len} bytes, over the 107 bytes a Unix socket path may \
         have (108 with its terminating NUL); use a shorter --run-dir (at most 94 bytes)"
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(!run_dir.exists(), "nothing was written");
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one line, nothing loaded: {stderr}"
    );
    eprintln!(
        "run dir with a {len}-byte socket path: refused in {:.2} s, exit 1, nothing created: {}",
        took.as_secs_f64(),
        stderr.trim()
    );
}

#[test]
fn a_control_socket_that_cannot_be_made_fails_the_run_in_its_records() {
    // A directory where the socket goes: binding works, moving it into place does not.
    let i = common::tiny_run(8, 3);
    let run_dir = i.tmp.path().join("run");
    let in_the_way = run_dir.join(control::SOCKET_NAME);
    std::fs::create_dir_all(in_the_way.join("kept")).unwrap();
    let (code, _, stderr) = train_to_end(&train_args(&i, &run_dir, &[]));
    assert_eq!(code, Some(1), "{stderr}");
    let path = in_the_way.display().to_string();
    assert!(
        stderr.contains(
            "the run is stopped: without its control socket, ctl and attach could not reach it"
        ) && stderr.contains(&path),
        "{stderr}"
    );
    assert!(
        in_the_way.join("kept").is_dir(),
        "the directory is left as it was"
    );
    let records: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary = records.last().unwrap();
    assert_eq!(summary["type"], "summary", "{records:?}");
    assert_eq!(summary["phase"], "failed", "{summary}");
    let error = summary["error"].as_str().unwrap();
    assert!(
        error.starts_with("the control socket failed: ") && error.contains(&path),
        "{error}"
    );
    let event = records
        .iter()
        .find(|r| r["type"] == "event" && r["kind"] == "error")
        .unwrap_or_else(|| panic!("{records:?}"));
    assert_eq!(event["message"], error);
    eprintln!("control.sock a directory: exit 1, summary failed: {error}");
}
