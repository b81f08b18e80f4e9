//! The ranks of a multi-process run as rank 0's control room shows them: each rank other than 0
//! sends a [`RankReport`] at its step boundaries (through the run's c10d store, see
//! docs/distributed.md), rank 0 adds its own, and the snapshot, `ctl status` and the screen
//! list them with the slowest one named.

use serde::{Deserialize, Serialize};

use super::gpu::GpuReading;
use super::profile::ProfileEvent;
use super::queues::QueueLevel;
use super::records::{Phase, Snapshot};

/// One rank's state, as it last reported it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    /// The machine it runs on.
    pub host: String,
    pub phase: Phase,
    pub step: u64,
    /// The last step's wall time (its wait for the other ranks included).
    pub step_s: Option<f64>,
    /// The mean time of a step's gradient exchange over the last ProfileStats interval: mostly
    /// the wait for the other ranks, so the slowest rank is the one that waits least.
    pub sync_s: Option<f64>,
    /// The busiest stage of the last ProfileStats interval and how busy (0..1).
    pub bottleneck: Option<(String, f64)>,
    pub queues: Vec<QueueLevel>,
    pub gpus: Option<Vec<GpuReading>>,
    /// How old the report was when rank 0 read it (none for rank 0's own row).
    #[serde(default)]
    pub age_s: Option<f64>,
    /// A signal asked this rank to stop: rank 0 stops the run, for every rank at once.
    #[serde(default)]
    pub stop_requested: bool,
}

impl RankReport {
    /// A rank's report from its own snapshot.
    pub fn from_snapshot(rank: usize, host: &str, s: &Snapshot) -> RankReport {
        let profile = s.profile.as_ref();
        RankReport {
            rank,
            host: host.to_string(),
            phase: s.phase,
            step: s.step,
            step_s: s.last.as_ref().map(|l| l.step_s),
            sync_s: profile.and_then(|p| {
                p.rows
                    .iter()
                    .find(|r| r.event == ProfileEvent::GradSync && r.interval.count > 0)
                    .map(|r| r.interval.mean_s)
            }),
            bottleneck: profile
                .and_then(|p| p.bottleneck())
                .map(|(stage, busy)| (stage.to_string(), busy)),
            queues: s.queues.clone(),
            gpus: s.gpus.clone(),
            age_s: None,
            stop_requested: false,
        }
    }

    /// The time of a step this rank spends on its own work: its step time less its wait in the
    /// gradient exchange (the whole step time before a ProfileStats report says the wait).
    pub fn busy_s(&self) -> Option<f64> {
        let step = self.step_s?;
        Some((step - self.sync_s.unwrap_or(0.0)).max(0.0))
    }
}

/// The rank the others wait for: the largest [`RankReport::busy_s`] (the lowest rank on a
/// tie); none with fewer than two ranks that have finished a step.
pub fn slowest(ranks: &[RankReport]) -> Option<usize> {
    let timed: Vec<(usize, f64)> = ranks
        .iter()
        .filter_map(|r| r.busy_s().map(|b| (r.rank, b)))
        .collect();
    if timed.len() < 2 {
        return None;
    }
    timed
        .iter()
        .fold(
            None,
            |best: Option<(usize, f64)>, &(rank, busy)| match best {
                Some((_, b)) if b >= busy => best,
                _ => Some((rank, busy)),
            },
        )
        .map(|(rank, _)| rank)
}

/// A rank's GPUs in a few characters: "2 GPU 87%" (mean utilisation), "-" without readings.
pub fn gpu_summary(r: &RankReport) -> String {
    match r.gpus.as_deref() {
        None | Some([]) => "-".into(),
        Some(gpus) => {
            let used: Vec<u32> = gpus.iter().filter_map(|g| g.utilization_pct).collect();
            let util = if used.is_empty() {
                String::new()
            } else {
                format!(" {}%", used.iter().sum::<u32>() / used.len() as u32)
            };
            format!("{} GPU{util}", gpus.len())
        }
    }
}

/// A rank's queue fill levels: "3/4 1/2" (batch_q, feature_q).
pub fn queue_summary(r: &RankReport) -> String {
    if r.queues.is_empty() {
        return "-".into();
    }
    r.queues
        .iter()
        .map(|q| format!("{}/{}", q.len, q.capacity))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line per rank for people (`ctl status`, logs): "rank 1 node2: step 40, 0.52 s/step,
/// 0.10 s sync, drafter 97 %, queues 3/4 1/2, 2 GPU 87% (slowest)".
pub fn describe(r: &RankReport, slowest: Option<usize>) -> String {
    let mut line = format!("rank {} {}: {} step {}", r.rank, r.host, r.phase, r.step);
    if let Some(s) = r.step_s {
        line.push_str(&format!(", {s:.2} s/step"));
    }
    if let Some(s) = r.sync_s {
        line.push_str(&format!(", {s:.2} s sync"));
    }
    if let Some((stage, busy)) = &r.bottleneck {
        line.push_str(&format!(", {stage} {:.0} %", busy * 100.0));
    }
    line.push_str(&format!(
        ", queues {}, {}",
        queue_summary(r),
        gpu_summary(r)
    ));
    if let Some(age) = r.age_s.filter(|a| *a >= 10.0) {
        line.push_str(&format!(", last heard {age:.0} s ago"));
    }
    if slowest == Some(r.rank) {
        line.push_str(" (slowest)");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn report(rank: usize, step_s: Option<f64>, sync_s: Option<f64>) -> RankReport {
        RankReport {
            rank,
            host: format!("node{rank}"),
            phase: Phase::Training,
            step: 40,
            step_s,
            sync_s,
            bottleneck: Some(("drafter".into(), 0.97)),
            queues: Vec::new(),
            gpus: None,
            age_s: None,
            stop_requested: false,
        }
    }

    #[test]
    fn the_slowest_rank_is_the_one_that_waits_least() {
        // the same step time on every rank (they wait for each other); rank 2 waits least
        let ranks = [
            report(0, Some(0.5), Some(0.2)),
            report(1, Some(0.5), Some(0.3)),
            report(2, Some(0.5), Some(0.05)),
        ];
        assert_eq!(slowest(&ranks), Some(2));
        assert_eq!(slowest(&ranks[..1]), None, "one rank: no slowest");
        let untimed = [report(0, None, None), report(1, Some(0.4), None)];
        assert_eq!(slowest(&untimed), None);
        let tie = [report(0, Some(0.4), None), report(1, Some(0.4), None)];
        assert_eq!(slowest(&tie), Some(0));
    }

    #[test]
    fn a_rank_reads_as_one_line() {
        let mut r = report(2, Some(0.5), Some(0.05));
        r.age_s = Some(12.0);
        assert_eq!(
            describe(&r, Some(2)),
            "rank 2 node2: training step 40, 0.50 s/step, 0.05 s sync, drafter 97 %, \
             queues -, -, last heard 12 s ago (slowest)"
        );
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RankReport>(&json).unwrap(), r);
    }
}
