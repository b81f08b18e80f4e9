//! The one line a rank ends with when the others are gone or do not answer in time: which
//! rank, at which step, why, and the last checkpoint to resume from.

use anyhow::anyhow;

use super::shared::Shared;
use crate::pipeline::distributed::Distributed;

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
    anyhow!(
        "rank {} of {}: the ranks lost each other at step {step} ({:#}; collective timeout {:.0} s); last checkpoint: {last}",
        d.rank(),
        d.world(),
        error,
        d.group.timeout.as_secs_f64()
    )
}
