//! `ctl`: one command to a run through its control socket, a query's answer printed as JSON.
//! `status` of a run that no trainer serves any more (stopped, finished, killed) is read from
//! its records instead of failing: the final state, saying that the run has ended.

use std::path::Path;

use anyhow::{bail, Result};

use super::socket;
use super::tui::feed::recorded_snapshot;
use crate::pipeline::command::Command;
use crate::telemetry::records::RunStatus;
use crate::train::run_lock::RunLock;

/// Sends `words` as one command to the trainer of `run_dir` and prints its answer.
pub(crate) fn run(run_dir: &Path, words: &[String]) -> Result<()> {
    let line = words.join(" ");
    let reply = match socket::send(run_dir, &line) {
        Ok(reply) => reply,
        Err(e) if Command::parse(&line) == Ok(Command::Status) => {
            let status = ended_status(run_dir).map_err(|why| e.context(why))?;
            if let Some(ended) = &status.ended {
                eprintln!("{ended}");
            }
            println!("{}", serde_json::to_string(&status)?);
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    if !reply.ok {
        bail!("{}", reply.message)
    }
    match reply.data {
        Some(data) => println!("{data}"),
        None => println!("{}", reply.message),
    }
    Ok(())
}

/// The status of the run in `run_dir` as its records left it, when no trainer holds it.
pub(crate) fn ended_status(run_dir: &Path) -> Result<RunStatus> {
    if let Some(pid) = RunLock::holder(run_dir) {
        bail!("trainer PID {pid} holds the run, but its control socket does not answer");
    }
    let Some(snap) = recorded_snapshot(run_dir, false) else {
        bail!(
            "{}: no trainer runs there and it has no metrics.jsonl (not a run directory?)",
            run_dir.display()
        );
    };
    let mut status = RunStatus::new(&snap, None);
    status.ended = Some(format!(
        "the run has ended: {} at step {} of {} (no trainer answers on {})",
        snap.phase,
        snap.step,
        snap.total_steps,
        run_dir.join(socket::SOCKET_NAME).display()
    ));
    Ok(status)
}
