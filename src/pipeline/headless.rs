//! The headless front end (`--no-tui`, or stdout not a terminal): human lines, ProfileStats
//! tables, queue and GPU records, commands from stdin and signals.

use std::io::BufRead;
use std::time::{Duration, Instant};

use anyhow::Result;
use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::command::Command;
use super::control::Request;
use super::signals::{SignalFlags, SignalRequest};
use super::trainer::{RunOutcome, TrainerHandle};
use crate::telemetry::gpu::GpuMonitor;
use crate::telemetry::records::{GpuRecord, MetricsRecord, Snapshot, ValidationRecord};

fn fmt_duration(s: f64) -> String {
    let s = s.max(0.0) as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// The human line of a snapshot; `validation`, a pass made since the previous line, is added
/// at its end.
pub fn human_line(s: &Snapshot, validation: Option<&ValidationRecord>) -> String {
    let line = progress_line(s);
    match validation {
        Some(v) => format!(
            "{line} | val (step {}) loss {:.4} acc {:.3} tau {:.2}",
            v.step, v.loss, v.accuracy, v.tau
        ),
        None => line,
    }
}

fn progress_line(s: &Snapshot) -> String {
    let q: Vec<String> = s
        .queues
        .iter()
        .map(|q| format!("{} {}/{}", q.name, q.len, q.capacity))
        .collect();
    match &s.last {
        Some(l) => format!(
            "step {}/{} epoch {} loss {:.4} acc {:.3} accept {:.2} lr {:.2e} tok/s {:.0} samples/s {:.2} | {} | ETA {}",
            s.step,
            s.total_steps,
            s.epoch,
            l.loss,
            l.accuracy,
            l.accept_mean,
            l.lr,
            s.tokens_per_s,
            s.samples_per_s,
            q.join(", "),
            s.eta_s.map(fmt_duration).unwrap_or_else(|| "?".into())
        ),
        None => format!("{} | step {}/{} | {}", s.phase, s.step, s.total_steps, q.join(", ")),
    }
}

/// Reads commands from stdin lines until EOF (no stdin, as in CI, ends it at once).
pub fn spawn_stdin_reader(requests: crossbeam_channel::Sender<Request>) {
    let _ = std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                let Ok(line) = line else { break };
                if line.trim().is_empty() {
                    continue;
                }
                match Command::parse(&line) {
                    Ok(command) => {
                        if requests
                            .send(Request {
                                command,
                                reply: None,
                            })
                            .is_err()
                        {
                            break;
                        }
                    }
                    Err(e) => println!("error: {e}"),
                }
            }
        });
}

/// How often the loop looks at the run when no request arrives.
const TICK: Duration = Duration::from_millis(50);

fn apply_request(handle: &TrainerHandle, req: Request) {
    let reply = handle.command(&req.command);
    match req.reply {
        Some(tx) => {
            let _ = tx.send(reply);
        }
        None => match reply {
            Ok(r) => println!("ok: {r}"),
            Err(e) => println!("error: {e}"),
        },
    }
}

/// Acts on the signals received since the last look (the signal thread logs them);
/// `first_step` is the step the run started from.
fn apply_signals(handle: &TrainerHandle, signals: &mut SignalFlags, first_step: u64) {
    for request in signals.take(handle.progress().0 > first_step) {
        match request {
            SignalRequest::Command(command) => {
                if let Err(e) = handle.command(&command) {
                    log::warn!("signal: {e}");
                }
            }
            SignalRequest::Abort => handle.abort(),
        }
    }
}

/// Answers requests as they arrive (a socket client waits for its reply) until `deadline`,
/// also under a storm of them: the loop's other work must come round.
fn answer_requests_until(handle: &TrainerHandle, requests: &Receiver<Request>, deadline: Instant) {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        match requests.recv_timeout(left) {
            Ok(req) => apply_request(handle, req),
            Err(RecvTimeoutError::Timeout) => return,
            Err(RecvTimeoutError::Disconnected) => return std::thread::sleep(left),
        }
    }
}

/// Runs the headless front end until the trainer ends. A control socket that cannot be
/// served stops the run: `ctl` would otherwise report no trainer while it trains.
pub fn run(
    handle: TrainerHandle,
    mut signals: SignalFlags,
    log_every_steps: u64,
    gpu_interval_s: f64,
) -> Result<RunOutcome> {
    signals.running();
    let (req_tx, req_rx) = super::control::channel();
    let _socket = match super::control::serve(&handle.shared.run_dir, req_tx.clone()) {
        Ok(socket) => socket,
        Err(e) => {
            handle.abort();
            let _ = handle.join();
            return Err(e.context(
                "the run is stopped: without its control socket, ctl could not reach it",
            ));
        }
    };
    spawn_stdin_reader(req_tx);
    let gpu = GpuMonitor::open().ok();
    let mut last_logged = u64::MAX;
    let mut last_validation = None;
    let mut last_profile = Instant::now();
    let mut last_queues = Instant::now();
    let mut last_gpu = Instant::now();
    let started = Instant::now();
    let first_step = handle.progress().0;
    while !handle.is_finished() {
        let tick_end = Instant::now() + TICK;
        apply_signals(&handle, &mut signals, first_step);
        let snap = handle.snapshot();
        if snap.step != last_logged
            && snap.step > 0
            && (snap.step.is_multiple_of(log_every_steps.max(1)) || snap.step == snap.total_steps)
        {
            last_logged = snap.step;
            let validation = snap
                .validations
                .last()
                .filter(|v| last_validation != Some(v.step));
            last_validation = snap.validations.last().map(|v| v.step);
            log::info!("{}", human_line(&snap, validation));
        }
        let interval = handle.profile_interval_s();
        if interval > 0.0 && last_profile.elapsed().as_secs_f64() >= interval {
            last_profile = Instant::now();
            log::info!("\n{}", handle.profile_report().table());
        }
        if last_queues.elapsed() >= Duration::from_secs(5) {
            last_queues = Instant::now();
            handle.write_record(&MetricsRecord::Queues {
                elapsed_s: started.elapsed().as_secs_f64(),
                queues: snap.queues.clone(),
            });
        }
        if let Some(g) = &gpu {
            if last_gpu.elapsed().as_secs_f64() >= gpu_interval_s {
                last_gpu = Instant::now();
                if let Ok(readings) = g.sample() {
                    for r in &readings {
                        handle.write_record(&MetricsRecord::Gpu(GpuRecord::from_reading(
                            started.elapsed().as_secs_f64(),
                            r,
                        )));
                    }
                }
            }
        }
        answer_requests_until(&handle, &req_rx, tick_end);
    }
    let report = handle.profile_report();
    log::info!("\n{}", report.table());
    Ok(handle.join())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_validation_pass_ends_the_progress_line() {
        let snap = crate::ui::sample::synthetic_state(10, 1).snapshot;
        let plain = human_line(&snap, None);
        assert!(plain.starts_with("step 10/20 epoch 0 loss "), "{plain}");
        assert!(plain.contains(" accept 1.00 "), "{plain}");
        assert!(!plain.contains("tau"), "{plain}");
        let v = ValidationRecord {
            step: 10,
            loss: 2.5,
            accuracy: 0.25,
            accept_mean: 1.75,
            tau: 1.5,
            sequences: 4,
            answers: 5,
            answer_steps: 60,
            tokens: 90,
            blocks: 300,
            validation_s: 0.5,
            best: true,
            elapsed_s: 2.5,
        };
        let line = human_line(&snap, Some(&v));
        assert_eq!(
            line,
            format!("{plain} | val (step 10) loss 2.5000 acc 0.250 tau 1.50")
        );
    }
}
