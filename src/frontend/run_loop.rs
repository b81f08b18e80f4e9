//! The run loop of a training process, under either front end: it answers the control
//! socket (commands, and the `status` and `snapshot` queries that `ctl` and `attach` send),
//! acts on signals, writes the queue, GPU and process records and the progress lines, and reads
//! stdin commands when no screen owns the terminal. The screen, when there is one, is a viewer
//! of the run through its socket like `attach`: it can close (a key, a dead terminal) while the
//! run goes on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::ranks::RankLink;
use super::signals::{SignalFlags, SignalRequest};
use super::socket::Request;
use super::stdin::{say, spawn_stdin_reader};
use crate::pipeline::command::Command;
use crate::pipeline::trainer::{RunOutcome, TrainerHandle};
use crate::telemetry::format::fmt_duration_compact;
use crate::telemetry::gpu::{GpuMonitor, GpuReading};
use crate::telemetry::host::{HostMonitor, HostReading};
use crate::telemetry::records::{
    EventKind, GpuRecord, MetricsRecord, RunStatus, Snapshot, StepRecord, ValidationRecord,
};

/// The human line of step `r` (a record of the run `s` shows now); `validation`, a pass made
/// since the previous line, is added at its end.
pub(crate) fn human_line(
    s: &Snapshot,
    r: &StepRecord,
    validation: Option<&ValidationRecord>,
) -> String {
    let q: Vec<String> = s
        .queues
        .iter()
        .map(|q| format!("{} {}/{}", q.name, q.len, q.capacity))
        .collect();
    let line = format!(
        "step {}/{} epoch {} loss {:.4} acc {:.3} accept {:.2} lr {:.2e} tok/s {:.0} samples/s {:.2} | {} | ETA {}",
        r.step,
        s.total_steps,
        r.epoch,
        r.loss,
        r.accuracy,
        r.accept_mean,
        r.lr,
        r.tokens_per_s,
        r.samples_per_s,
        q.join(", "),
        s.eta_s.map(fmt_duration_compact).unwrap_or_else(|| "?".into())
    );
    match validation {
        Some(v) => format!(
            "{line} | val (step {}) loss {:.4} acc {:.3} tau {:.2}",
            v.step, v.loss, v.accuracy, v.tau
        ),
        None => line,
    }
}

/// How often the loop looks at the run when no request arrives.
const TICK: Duration = Duration::from_millis(50);

/// How long the stages have to end after a second stop signal before the process exits without
/// them. The passes and the steps look at the stop between their units of work and end well
/// within it; what cannot (a checkpoint writer that hangs on its disk, a device that does not
/// answer) must not outlast a scheduler's grace period, commonly 30 s, before its SIGKILL.
const STOP_AT_ONCE_GRACE: Duration = Duration::from_secs(5);

/// How the run loop is set up.
pub(crate) struct RunLoopOptions {
    pub log_every_steps: u64,
    pub gpu_interval_s: f64,
    /// The logger's terminal output (off while a screen is up and once the terminal is gone).
    pub log_to_terminal: Arc<AtomicBool>,
    /// The screen of this process, if any.
    pub screen: Option<ScreenLink>,
    /// This process's part in the control room of a multi-process run (none alone).
    pub ranks: Option<RankLink>,
}

/// The run loop's hold on this process's screen (a viewer thread).
pub(crate) struct ScreenLink {
    /// Set to close the screen (its terminal is gone, or the run was stopped by a signal).
    pub close: Arc<AtomicBool>,
    /// Set by the screen when it has closed.
    pub closed: Arc<AtomicBool>,
}

/// How the run ended, beyond its outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct RunEnd {
    /// SIGINT or SIGTERM stopped it: nobody waits at a screen for a key.
    pub stop_signalled: bool,
    /// The terminal went away (SIGHUP).
    pub hung_up: bool,
    /// When a second stop signal asked every stage to stop at once.
    pub stopped_at_once: Option<Instant>,
}

/// What the run loop keeps between ticks.
struct Live {
    gpu: Option<GpuMonitor>,
    gpu_error: Option<String>,
    gpus: Option<Vec<GpuReading>>,
    host: HostMonitor,
    host_reading: Option<HostReading>,
    /// Every rank of a multi-process run, as rank 0 last put them together.
    rank_rows: Vec<crate::telemetry::ranks::RankReport>,
}

impl Live {
    /// The trainer's snapshot with the machine's readings, as screens show it; with the step
    /// records after `since` only, when given.
    fn snapshot(&self, handle: &TrainerHandle, since: Option<u64>) -> Snapshot {
        let mut snap = match since {
            Some(step) => handle.snapshot_since(step),
            None => handle.snapshot(),
        };
        snap.gpus = self.gpus.clone();
        snap.gpu_error = self.gpu_error.clone();
        snap.host = self.host_reading.clone();
        snap.ranks = self.rank_rows.clone();
        snap
    }

    /// Answers a query as JSON text.
    fn query(&self, handle: &TrainerHandle, command: &Command) -> Result<String, String> {
        let json = match command {
            Command::Status => {
                // (the status needs no step history)
                let snap = self.snapshot(handle, Some(u64::MAX));
                serde_json::to_string(&RunStatus::new(&snap, Some(std::process::id())))
            }
            Command::Snapshot { since } => serde_json::to_string(&self.snapshot(handle, *since)),
            other => return Err(format!("{other} is not a query")),
        };
        json.map_err(|e| format!("cannot encode the answer: {e}"))
    }

    fn answer(&self, handle: &TrainerHandle, req: Request) {
        let reply = if req.command.is_query() {
            self.query(handle, &req.command)
        } else {
            handle.command(&req.command)
        };
        match req.reply {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            None => match reply {
                Ok(r) => say(&format!("ok: {r}")),
                Err(e) => say(&format!("error: {e}")),
            },
        }
    }

    /// Answers requests as they arrive (a socket client waits for its reply) until
    /// `deadline`, also under a storm of them: the loop's other work must come round.
    fn answer_until(
        &self,
        handle: &TrainerHandle,
        requests: &Receiver<Request>,
        deadline: Instant,
    ) {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            match requests.recv_timeout(left) {
                Ok(req) => self.answer(handle, req),
                Err(RecvTimeoutError::Timeout) => return,
                Err(RecvTimeoutError::Disconnected) => return std::thread::sleep(left),
            }
        }
    }
}

/// Acts on the signals received since the last look (the signal thread logs the stops);
/// `first_step` is the step the run started from.
fn apply_signals(
    handle: &TrainerHandle,
    signals: &mut SignalFlags,
    first_step: u64,
    opts: &mut RunLoopOptions,
    end: &mut RunEnd,
) {
    for request in signals.take(handle.progress().0 > first_step) {
        match request {
            // a rank other than 0 passes a stop on to rank 0, which stops every rank
            SignalRequest::Command(Command::Stop { .. })
                if matches!(opts.ranks, Some(RankLink::Follower(_))) =>
            {
                if let Some(RankLink::Follower(f)) = &mut opts.ranks {
                    f.request_stop();
                }
            }
            SignalRequest::Command(command) => {
                if let Err(e) = handle.command(&command) {
                    log::warn!("signal: {e}");
                }
            }
            SignalRequest::Abort => {
                handle.abort();
                end.stopped_at_once.get_or_insert_with(Instant::now);
            }
            SignalRequest::HangUp => {
                end.hung_up = true;
                opts.log_to_terminal.store(false, Ordering::SeqCst);
                if let Some(screen) = &opts.screen {
                    screen.close.store(true, Ordering::SeqCst);
                }
                let run_dir = handle.shared.run_dir.display().to_string();
                log::warn!(
                    "SIGHUP: the terminal is gone; training goes on without it (log: \
                     {run_dir}/train.log; screen: dflash-tui attach {run_dir})"
                );
                // What was trained so far is saved now, whatever happens to this process next.
                if let Err(e) = handle.command(&Command::Checkpoint) {
                    log::warn!("SIGHUP: {e}");
                }
            }
        }
    }
    end.stop_signalled |= signals.stop_signalled();
}

/// The progress lines: every `log_every_steps`-th step gets its line, also when steps finish
/// back to back between two looks.
struct ProgressLines {
    every: u64,
    last_logged: u64,
    last_validation: Option<u64>,
}

impl ProgressLines {
    fn log_due(&mut self, snap: &Snapshot) {
        let due: Vec<&StepRecord> = snap
            .history
            .iter()
            .filter(|r| {
                r.step > self.last_logged
                    && (r.step % self.every == 0 || r.step == snap.total_steps)
            })
            .collect();
        if let Some(newest) = snap.history.last() {
            self.last_logged = self.last_logged.max(newest.step);
        }
        for (k, r) in due.iter().enumerate() {
            // A validation pass made since the previous line goes with the newest.
            let newest_val = snap.validations.last();
            let validation =
                newest_val.filter(|v| k + 1 == due.len() && self.last_validation != Some(v.step));
            if validation.is_some() {
                self.last_validation = newest_val.map(|v| v.step);
            }
            log::info!("{}", human_line(snap, r, validation));
        }
    }
}

/// Ends the process when the stages did not end within [`STOP_AT_ONCE_GRACE`] of a second
/// stop signal: what they do cannot be waited for, and checkpoints are written beside and
/// renamed into place, so none is left half-written (the next start removes the leftovers).
fn exit_without_the_stages(
    handle: &TrainerHandle,
    socket: Option<super::socket::ControlSocket>,
) -> ! {
    let snap = handle.snapshot();
    let run_dir = handle.shared.run_dir.display().to_string();
    let message = format!(
        "the stages did not stop within {} s of the second stop signal (the run was {} at \
         step {}): exiting without them, status 1; last checkpoint {}; dflash-tui train \
         --resume {run_dir} goes on from it",
        STOP_AT_ONCE_GRACE.as_secs(),
        snap.phase,
        snap.step,
        snap.last_checkpoint.as_deref().unwrap_or("none")
    );
    log::error!("{message}");
    handle.write_record(&MetricsRecord::Event {
        elapsed_s: snap.elapsed_s,
        kind: EventKind::Error,
        message,
    });
    drop(socket);
    log::logger().flush();
    // `_exit`: the stages' threads still run; libtorch's destructors must not run under them.
    signal_hook::low_level::exit(1)
}

/// Runs the loop until the trainer ends. A control socket that cannot be served fails the run
/// as it starts (its path was checked before anything loaded, so this is a file in the way or
/// a permission): `ctl`, `attach` and the screen reach a run only through it, and a run
/// recorded as stopped with no error left the cause out of its records.
/// In a multi-process run only rank 0 takes commands (its socket, its stdin); the other ranks
/// report to it (see [`super::ranks`]).
pub(crate) fn run(
    handle: TrainerHandle,
    mut signals: SignalFlags,
    mut opts: RunLoopOptions,
) -> Result<(RunOutcome, RunEnd)> {
    signals.running();
    let (req_tx, req_rx) = super::socket::channel();
    let takes_commands = RankLink::takes_commands(opts.ranks.as_ref());
    let socket = if takes_commands {
        match super::socket::serve(&handle.shared.run_dir, req_tx.clone()) {
            Ok(socket) => Some(socket),
            Err(e) => {
                handle.fail("the control socket", &e);
                let _ = handle.join();
                return Err(e.context(
                    "the run is stopped: without its control socket, ctl and attach could not reach it",
                ));
            }
        }
    } else {
        None
    };
    if opts.screen.is_none() && takes_commands {
        spawn_stdin_reader(req_tx);
    }
    let gpu = GpuMonitor::open();
    let mut live = Live {
        gpu_error: gpu.as_ref().err().cloned(),
        gpu: gpu.ok(),
        gpus: None,
        host: HostMonitor::for_this_process(),
        host_reading: None,
        rank_rows: Vec::new(),
    };
    let mut end = RunEnd::default();
    let mut progress = ProgressLines {
        every: opts.log_every_steps.max(1),
        last_logged: handle.progress().0,
        last_validation: None,
    };
    let mut last_profile = Instant::now();
    let mut last_queues = Instant::now();
    let mut last_sample: Option<Instant> = None;
    let mut screen_open = opts.screen.is_some();
    let first_step = handle.progress().0;
    while !handle.is_finished() {
        let tick_end = Instant::now() + TICK;
        apply_signals(&handle, &mut signals, first_step, &mut opts, &mut end);
        if end
            .stopped_at_once
            .is_some_and(|t| t.elapsed() >= STOP_AT_ONCE_GRACE)
        {
            exit_without_the_stages(&handle, socket);
        }
        if let Some(screen) = &opts.screen {
            if screen_open && screen.closed.load(Ordering::SeqCst) {
                screen_open = false;
                if !end.hung_up {
                    // The operator left the screen: the terminal is theirs again.
                    opts.log_to_terminal.store(true, Ordering::SeqCst);
                }
                log::info!(
                    "the screen is closed; the run goes on (dflash-tui attach {} opens it again)",
                    handle.shared.run_dir.display()
                );
            }
        }
        // (the progress lines need only the steps not logged yet)
        let mut snap = live.snapshot(&handle, Some(progress.last_logged));
        match &mut opts.ranks {
            Some(RankLink::Leader(leader)) => {
                leader.fill(&handle, &mut snap);
                live.rank_rows = snap.ranks.clone();
            }
            Some(RankLink::Follower(follower)) => follower.report(&snap),
            None => {}
        }
        progress.log_due(&snap);
        let interval = handle.profile_interval_s();
        if interval > 0.0 && last_profile.elapsed().as_secs_f64() >= interval {
            last_profile = Instant::now();
            let report = handle.profile_report();
            let mut with_report = snap.clone();
            with_report.profile = Some(report.clone());
            let verdict = with_report.verdict().unwrap_or_default();
            log::info!("\n{}{verdict}", report.table());
        }
        if last_queues.elapsed() >= Duration::from_secs(5) {
            last_queues = Instant::now();
            handle.write_record(&MetricsRecord::Queues {
                elapsed_s: snap.elapsed_s,
                queues: snap.queues.clone(),
            });
        }
        if last_sample.is_none_or(|t| t.elapsed().as_secs_f64() >= opts.gpu_interval_s) {
            last_sample = Some(Instant::now());
            live.host_reading = live.host.sample();
            if let Some(g) = &live.gpu {
                if let Ok(readings) = g.sample() {
                    for r in &readings {
                        handle.write_record(&MetricsRecord::Gpu(GpuRecord::from_reading(
                            snap.elapsed_s,
                            r,
                        )));
                    }
                    live.gpus = Some(readings);
                }
            }
        }
        live.answer_until(&handle, &req_rx, tick_end);
    }
    // Steps that finished after the last look, and the queues as the run ends.
    let last = live.snapshot(&handle, Some(progress.last_logged));
    progress.log_due(&last);
    handle.write_record(&MetricsRecord::Queues {
        elapsed_s: last.elapsed_s,
        queues: last.queues,
    });
    let report = handle.profile_report();
    log::info!("\n{}", report.table());
    let outcome = handle.join();
    // The summary is written: screens and `attach` now read the end from metrics.jsonl.
    drop(socket);
    end.stop_signalled |= signals.stop_signalled();
    Ok((outcome, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_validation_pass_ends_the_progress_line() {
        let snap = crate::frontend::tui::sample::synthetic_state(10, 1).snapshot;
        let last = snap.history.last().unwrap().clone();
        let plain = human_line(&snap, &last, None);
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
        let line = human_line(&snap, &last, Some(&v));
        assert_eq!(
            line,
            format!("{plain} | val (step 10) loss 2.5000 acc 0.250 tau 1.50")
        );
    }
}
