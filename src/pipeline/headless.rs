//! The headless front end (`--no-tui`, or stdout not a terminal): human lines, ProfileStats
//! tables, queue and GPU records, commands from stdin and signals.

use std::io::BufRead;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::command::Command;
use super::control::Request;
use super::trainer::{RunOutcome, TrainerHandle};
use crate::telemetry::gpu::GpuMonitor;
use crate::telemetry::records::{GpuRecord, MetricsRecord, Snapshot, ValidationRecord};

/// Signals: SIGINT/SIGTERM stop with a checkpoint (a second one stops at once), SIGUSR1
/// checkpoints. Handlers only count.
pub struct SignalFlags {
    pub stop: Arc<AtomicUsize>,
    pub checkpoint: Arc<AtomicUsize>,
}

impl SignalFlags {
    pub fn install() -> Self {
        let stop = Arc::new(AtomicUsize::new(0));
        let checkpoint = Arc::new(AtomicUsize::new(0));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let flag = stop.clone();
            // SAFETY: the handler only increments an atomic counter.
            let _ = unsafe {
                signal_hook::low_level::register(sig, move || {
                    flag.fetch_add(1, Ordering::SeqCst);
                })
            };
        }
        let flag = checkpoint.clone();
        // SAFETY: as above.
        let _ = unsafe {
            signal_hook::low_level::register(signal_hook::consts::SIGUSR1, move || {
                flag.fetch_add(1, Ordering::SeqCst);
            })
        };
        SignalFlags { stop, checkpoint }
    }
}

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

/// Applies queued requests; replies go back to their sender, or to stdout.
pub fn apply_requests(handle: &TrainerHandle, requests: &crossbeam_channel::Receiver<Request>) {
    while let Ok(req) = requests.try_recv() {
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
}

/// Runs the headless front end until the trainer ends.
pub fn run(handle: TrainerHandle, log_every_steps: u64, gpu_interval_s: f64) -> RunOutcome {
    let signals = SignalFlags::install();
    let (req_tx, req_rx) = super::control::channel();
    spawn_stdin_reader(req_tx.clone());
    let _socket = match super::control::serve(&handle.shared.run_dir, req_tx) {
        Ok(s) => Some(s),
        Err(e) => {
            log::warn!("control socket unavailable: {e:#}");
            None
        }
    };
    let gpu = GpuMonitor::open().ok();
    let mut last_logged = u64::MAX;
    let mut last_validation = None;
    let mut last_profile = Instant::now();
    let mut last_queues = Instant::now();
    let mut last_gpu = Instant::now();
    let mut stops_seen = 0;
    let mut checkpoints_seen = 0;
    let started = Instant::now();
    while !handle.is_finished() {
        apply_requests(&handle, &req_rx);
        let stops = signals.stop.load(Ordering::SeqCst);
        if stops > stops_seen {
            stops_seen = stops;
            if stops == 1 {
                log::warn!("signal: stopping with a checkpoint (send again to stop at once)");
                let _ = handle.command(&Command::Stop { checkpoint: true });
            } else {
                log::warn!("second signal: stopping now");
                handle.abort();
            }
        }
        let cps = signals.checkpoint.load(Ordering::SeqCst);
        if cps > checkpoints_seen {
            checkpoints_seen = cps;
            let _ = handle.command(&Command::Checkpoint);
        }
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
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = handle.profile_report();
    log::info!("\n{}", report.table());
    handle.join()
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
