//! The one line a rank ends with when the others are gone or do not answer in time: which
//! rank, at which step, why, and the last checkpoint to resume from.

use std::time::Duration;

use anyhow::anyhow;

use super::shared::Shared;
use crate::pipeline::distributed::Distributed;

/// How long a survivor looks for the rank whose heartbeat stopped (it beats every second).
const SILENCE_GRACE: Duration = Duration::from_secs(4);

/// The error of a collective that failed (a rank died, hung past the timeout, or the network
/// broke), as the run's failure.
pub(super) fn lost_rank(
    shared: &Shared,
    d: &Distributed,
    step: u64,
    error: anyhow::Error,
) -> anyhow::Error {
    let last = shared
        .status()
        .last_checkpoint
        .clone()
        .map_or("none".into(), |p| p.display().to_string());
    let who = match d.silent_ranks(SILENCE_GRACE) {
        Ok(silent) if silent.is_empty() => "a rank did not answer in time".to_string(),
        Ok(silent) => format!(
            "rank {} went silent",
            silent
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", rank ")
        ),
        Err(_) => "rank 0 (which hosts the store) is gone".to_string(),
    };
    anyhow!(
        "{who}: rank {} of {} stops at step {step} ({:#}; collective timeout {:.0} s); last checkpoint: {last}",
        d.rank(),
        d.world(),
        error,
        d.group.timeout.as_secs_f64()
    )
}
