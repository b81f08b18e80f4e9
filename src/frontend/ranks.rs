//! The control room of a multi-process run (docs/distributed.md): rank 0 alone serves the
//! control socket and the screen; every other rank sends rank 0 its [`RankReport`] through the
//! run's c10d store (one key per rank, overwritten at its step boundaries), and rank 0 shows them
//! all. The store rather than a collective: the reports vary in size, rank 0 reads them at
//! its screen's pace without holding up a step, and a rank that fell silent still leaves its
//! last report (with its age) to look at.
//!
//! A signal that asks a rank other than 0 to stop (SIGTERM, as `srun` sends every task on
//! cancel) is passed on to rank 0 in the report: rank 0 stops the run, with its one checkpoint,
//! and every rank stops at that same step boundary.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::pipeline::command::Command;
use crate::pipeline::distributed::Distributed;
use crate::pipeline::trainer::TrainerHandle;
use crate::telemetry::ranks::RankReport;
use crate::telemetry::records::Snapshot;

/// A rank reports at least this often (and at every step boundary); rank 0 reads as often.
const REPORT_EVERY: Duration = Duration::from_secs(1);

fn report_key(rank: usize) -> String {
    format!("dflash/report/{rank}")
}

/// This machine's name, for the rows of the ranks' table.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "?".into())
}

/// What goes into the store: the report and a number that changes with each one (rank 0 ages
/// a report by its own clock from when the number last changed: no clocks compared).
#[derive(Serialize, Deserialize)]
struct Envelope {
    seq: u64,
    report: RankReport,
}

/// This process's part in the control room.
pub(crate) enum RankLink {
    Leader(Leader),
    Follower(Follower),
}

impl RankLink {
    pub(crate) fn for_rank(d: Arc<Distributed>) -> RankLink {
        if d.is_leader() {
            RankLink::Leader(Leader {
                d,
                host: host_name(),
                heard: HashMap::new(),
                last_read: None,
                stops_seen: Vec::new(),
            })
        } else {
            RankLink::Follower(Follower {
                d,
                host: host_name(),
                seq: 0,
                last_sent: None,
                stop_requested: false,
            })
        }
    }

    /// Rank 0 serves the control socket (and reads stdin); the others take no commands.
    pub(crate) fn takes_commands(link: Option<&RankLink>) -> bool {
        !matches!(link, Some(RankLink::Follower(_)))
    }
}

/// Rank 0's side: the other ranks' last reports.
pub(crate) struct Leader {
    d: Arc<Distributed>,
    host: String,
    /// Per rank: its last report, its number, and when the number last changed.
    heard: HashMap<usize, (RankReport, u64, Instant)>,
    last_read: Option<Instant>,
    /// The ranks whose stop request was already acted on.
    stops_seen: Vec<usize>,
}

impl Leader {
    /// Reads the reports (at most every [`REPORT_EVERY`]), acts on a rank's stop request, and
    /// puts every rank into `snap` (its own row first).
    pub(crate) fn fill(&mut self, handle: &TrainerHandle, snap: &mut Snapshot) {
        if self.last_read.is_none_or(|t| t.elapsed() >= REPORT_EVERY) {
            self.last_read = Some(Instant::now());
            self.read();
            self.act_on_stop_requests(handle);
        }
        let mut rows = vec![RankReport::from_snapshot(0, &self.host, snap)];
        for r in 1..self.d.world() {
            if let Some((report, _, at)) = self.heard.get(&r) {
                let mut row = report.clone();
                row.age_s = Some(at.elapsed().as_secs_f64());
                rows.push(row);
            }
        }
        snap.ranks = rows;
    }

    fn read(&mut self) {
        for r in 1..self.d.world() {
            let key = report_key(r);
            let bytes = match self.d.group.store_check(&key) {
                Ok(true) => self.d.group.store_get(&key, Duration::from_secs(1)),
                Ok(false) => continue,
                Err(e) => Err(e),
            };
            let envelope = bytes
                .map_err(|e| format!("{e:#}"))
                .and_then(|b| serde_json::from_slice::<Envelope>(&b).map_err(|e| e.to_string()));
            match envelope {
                Ok(e) => {
                    let changed = self.heard.get(&r).is_none_or(|(_, seq, _)| *seq != e.seq);
                    if changed {
                        self.heard.insert(r, (e.report, e.seq, Instant::now()));
                    }
                }
                Err(e) => log::debug!("rank {r}'s report: {e}"),
            }
        }
    }

    fn act_on_stop_requests(&mut self, handle: &TrainerHandle) {
        for (r, (report, _, _)) in &self.heard {
            if report.stop_requested && !self.stops_seen.contains(r) {
                self.stops_seen.push(*r);
                log::warn!("rank {r} was asked to stop (a signal): the run stops on every rank");
                if let Err(e) = handle.command(&Command::Stop { checkpoint: true }) {
                    log::warn!("rank {r}'s stop: {e}");
                }
            }
        }
    }
}

/// The side of a rank other than 0.
pub(crate) struct Follower {
    d: Arc<Distributed>,
    host: String,
    seq: u64,
    last_sent: Option<(Instant, u64)>,
    stop_requested: bool,
}

impl Follower {
    /// Sends this rank's report when a step has finished since the last one, or
    /// [`REPORT_EVERY`] has passed.
    pub(crate) fn report(&mut self, snap: &Snapshot) {
        let due = self
            .last_sent
            .is_none_or(|(t, step)| step != snap.step || t.elapsed() >= REPORT_EVERY);
        if due {
            self.send(snap);
        }
    }

    fn send(&mut self, snap: &Snapshot) {
        self.seq += 1;
        let mut report = RankReport::from_snapshot(self.d.rank(), &self.host, snap);
        report.stop_requested = self.stop_requested;
        let envelope = Envelope {
            seq: self.seq,
            report,
        };
        let sent = serde_json::to_vec(&envelope)
            .map_err(anyhow::Error::from)
            .and_then(|b| self.d.group.store_set(&report_key(self.d.rank()), &b));
        if let Err(e) = sent {
            log::debug!("rank {}: report not sent: {e:#}", self.d.rank());
        }
        self.last_sent = Some((Instant::now(), snap.step));
    }

    /// A signal asked this rank to stop: rank 0 is told with the next report (at once) and
    /// stops the run for all; this rank follows rank 0's word to the same step boundary.
    pub(crate) fn request_stop(&mut self) {
        if !self.stop_requested {
            self.stop_requested = true;
            self.last_sent = None;
            log::warn!(
                "rank {}: stop asked for; rank 0 stops the run on every rank",
                self.d.rank()
            );
        }
    }
}
