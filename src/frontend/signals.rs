//! Signals of a training run, handled from start-up on: SIGINT/SIGTERM stop with a checkpoint (a
//! second one stops at once), SIGUSR1 writes a checkpoint, SIGHUP (the terminal is gone: a closed
//! SSH session or tmux window) leaves the run training without it, with a checkpoint. The handlers
//! are installed before any model loads (SIGUSR1's default action, before they were, killed the
//! process); what arrives is counted and acted on by the run loop (`run_loop`) once the trainer
//! runs.
//!
//! SIGINT or SIGTERM while the models still load exits at once with status 128 + the signal, as
//! a shell reports a process the signal ended: nothing is trained yet, so there is no checkpoint
//! to wait for, and loading a large target only to stop would take minutes of a scheduler's grace
//! period. The status is not 0: the run did not do what it was started for, and a script or a
//! scheduler must not take it for a run that ended. The log says how to start it again.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

use crate::pipeline::command::Command;

/// What the signals received since the last look ask of the run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SignalRequest {
    Command(Command),
    /// Stop every stage now (a second SIGINT/SIGTERM).
    Abort,
    /// The terminal is gone (SIGHUP): go on without it.
    HangUp,
}

/// Counters of the signals received, shared with the thread that receives them.
pub(crate) struct SignalFlags {
    stops: Arc<AtomicUsize>,
    checkpoints: Arc<AtomicUsize>,
    hangups: Arc<AtomicUsize>,
    /// True until a front end takes over: a second stop signal then exits the process.
    starting: Arc<AtomicBool>,
    /// Armed by the first stop signal during start-up; the handler exits when it is set.
    exit_now: Arc<AtomicBool>,
    stops_seen: usize,
    checkpoints_seen: usize,
    hangups_seen: usize,
}

impl SignalFlags {
    /// Counters that no signal moves (front ends run in-process by tests).
    pub(crate) fn none() -> Self {
        SignalFlags {
            stops: Arc::default(),
            checkpoints: Arc::default(),
            hangups: Arc::default(),
            starting: Arc::new(AtomicBool::new(true)),
            exit_now: Arc::default(),
            stops_seen: 0,
            checkpoints_seen: 0,
            hangups_seen: 0,
        }
    }

    /// Installs the handlers and a thread that counts and logs each signal; `restart` says how
    /// the run starts again after a stop during start-up (see the module documentation).
    pub(crate) fn install(restart: String) -> Result<Self> {
        let flags = Self::none();
        for sig in [SIGINT, SIGTERM] {
            signal_hook::flag::register_conditional_shutdown(
                sig,
                128 + sig,
                flags.exit_now.clone(),
            )
            .context("cannot install the signal handlers")?;
        }
        let mut signals = Signals::new([SIGINT, SIGTERM, SIGUSR1, SIGHUP])
            .context("cannot install the signal handlers")?;
        let counters = (
            flags.stops.clone(),
            flags.checkpoints.clone(),
            flags.hangups.clone(),
            flags.starting.clone(),
            flags.exit_now.clone(),
        );
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let (stops, checkpoints, hangups, starting, exit_now) = counters;
                for sig in signals.forever() {
                    let starting = starting.load(Ordering::SeqCst);
                    if sig == SIGHUP {
                        // Logged by the front end, which first stops writing to the terminal.
                        hangups.fetch_add(1, Ordering::SeqCst);
                    } else if sig == SIGUSR1 {
                        checkpoints.fetch_add(1, Ordering::SeqCst);
                        log_checkpoint(starting);
                    } else {
                        let n = stops.fetch_add(1, Ordering::SeqCst) + 1;
                        exit_now.store(starting, Ordering::SeqCst);
                        if starting {
                            exit_during_start_up(sig, &restart);
                        }
                        log_stop(sig, n);
                    }
                }
            })
            .context("cannot start the signal thread")?;
        log::info!(
            "pid {}: SIGUSR1 = checkpoint, SIGINT/SIGTERM = stop with a checkpoint (twice: at once), \
             SIGHUP = go on without the terminal",
            std::process::id()
        );
        Ok(flags)
    }

    /// A front end has taken over: a second stop signal now stops the run instead of the
    /// process.
    pub(crate) fn running(&self) {
        self.starting.store(false, Ordering::SeqCst);
        self.exit_now.store(false, Ordering::SeqCst);
    }

    /// What arrived since the last call: the stop first, then a checkpoint. A checkpoint waits
    /// until the run has `trained` a step (the trainer has nothing to save before and drops the
    /// request), so SIGUSR1 during start-up is kept for after the first step.
    pub(crate) fn take(&mut self, trained: bool) -> Vec<SignalRequest> {
        let mut out = Vec::new();
        let hangups = self.hangups.load(Ordering::SeqCst);
        if hangups > self.hangups_seen {
            self.hangups_seen = hangups;
            out.push(SignalRequest::HangUp);
        }
        let stops = self.stops.load(Ordering::SeqCst);
        if stops > self.stops_seen {
            self.stops_seen = stops;
            out.push(if stops == 1 {
                SignalRequest::Command(Command::Stop { checkpoint: true })
            } else {
                SignalRequest::Abort
            });
        }
        let checkpoints = self.checkpoints.load(Ordering::SeqCst);
        if checkpoints > self.checkpoints_seen && trained {
            self.checkpoints_seen = checkpoints;
            out.push(SignalRequest::Command(Command::Checkpoint));
        }
        out
    }

    /// Whether a stop signal (SIGINT/SIGTERM) has arrived: the run then ends without waiting
    /// for a key.
    pub(crate) fn stop_signalled(&self) -> bool {
        self.stops.load(Ordering::SeqCst) > 0
    }

    /// Counts a signal as the handler thread would.
    #[cfg(test)]
    fn simulate(&self, stop: bool) {
        let counter = if stop { &self.stops } else { &self.checkpoints };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

fn log_checkpoint(starting: bool) {
    if starting {
        log::warn!("SIGUSR1 during start-up: a checkpoint follows after the first step");
    } else {
        log::info!("SIGUSR1: checkpoint at the next step boundary");
    }
}

fn signal_name(sig: i32) -> &'static str {
    if sig == SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}

/// Ends the process on a stop signal while the run starts (see the module documentation).
fn exit_during_start_up(sig: i32, restart: &str) -> ! {
    let status = 128 + sig;
    log::warn!(
        "{} during start-up: exiting now with status {status}: the run has not started \
         training, so no checkpoint is written; {restart}",
        signal_name(sig)
    );
    log::logger().flush();
    // `_exit`: the loading threads are left as they are (nothing of theirs needs finishing, and
    // libtorch's destructors must not run under them).
    signal_hook::low_level::exit(status)
}

fn log_stop(sig: i32, n: usize) {
    let name = signal_name(sig);
    if n == 1 {
        log::warn!("{name}: stopping with a checkpoint (send it again to stop at once)");
    } else {
        log::warn!("{name} again: stopping now, without a checkpoint");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_stop_checkpoints_a_second_aborts_and_checkpoints_wait_for_a_step() {
        let mut flags = SignalFlags::none();
        assert!(flags.take(true).is_empty());
        flags.simulate(false);
        flags.simulate(false);
        flags.simulate(true);
        assert_eq!(
            flags.take(false),
            vec![SignalRequest::Command(Command::Stop { checkpoint: true })],
            "checkpoints wait for the first step"
        );
        assert_eq!(
            flags.take(true),
            vec![SignalRequest::Command(Command::Checkpoint)]
        );
        flags.simulate(true);
        flags.simulate(false);
        assert_eq!(
            flags.take(true),
            vec![
                SignalRequest::Abort,
                SignalRequest::Command(Command::Checkpoint)
            ]
        );
        assert!(flags.take(true).is_empty());
    }
}
