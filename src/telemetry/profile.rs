//! ProfileStats: per named event, count / total / mean / min / max wall time for the current
//! interval and since start, and the share of the interval. Recording is a few relaxed atomic
//! operations on a pre-registered slot: no lock on the hot path.
//!
//! An event is counted in the interval it ends in, with only its time inside that interval (a
//! handoff that waited 4.4 s on a full queue read as a 4424 ms mean "in the last 0.2 s"); the
//! time before goes to the since-start totals, and the row says that it began earlier. Waits
//! (a stage idle on a queue) are grouped apart from work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use super::profile_event::{ProfileEvent, Stage, TimingKind};

struct Slot {
    count: AtomicU64,
    /// Time inside the interval.
    total_ns: AtomicU64,
    min_ns: AtomicU64,
    max_ns: AtomicU64,
    /// Events that began before the interval, and their time before it.
    began_earlier: AtomicU64,
    earlier_ns: AtomicU64,
    /// The longest event, whole.
    whole_max_ns: AtomicU64,
}

impl Slot {
    fn new() -> Self {
        Slot {
            count: AtomicU64::new(0),
            total_ns: AtomicU64::new(0),
            min_ns: AtomicU64::new(u64::MAX),
            max_ns: AtomicU64::new(0),
            began_earlier: AtomicU64::new(0),
            earlier_ns: AtomicU64::new(0),
            whole_max_ns: AtomicU64::new(0),
        }
    }

    /// An event of `ns` that ended `inside_ns` after the interval began.
    fn record(&self, ns: u64, inside_ns: u64) {
        let inside = ns.min(inside_ns);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.total_ns.fetch_add(inside, Ordering::Relaxed);
        self.min_ns.fetch_min(inside, Ordering::Relaxed);
        self.max_ns.fetch_max(inside, Ordering::Relaxed);
        self.whole_max_ns.fetch_max(ns, Ordering::Relaxed);
        if inside < ns {
            self.began_earlier.fetch_add(1, Ordering::Relaxed);
            self.earlier_ns.fetch_add(ns - inside, Ordering::Relaxed);
        }
    }

    /// The interval's stats, and the same with the events whole (for the since-start totals).
    fn take(&self) -> (EventStats, EventStats) {
        let count = self.count.swap(0, Ordering::Relaxed);
        let total = self.total_ns.swap(0, Ordering::Relaxed);
        let min = self.min_ns.swap(u64::MAX, Ordering::Relaxed);
        let max = self.max_ns.swap(0, Ordering::Relaxed);
        let earlier = self.earlier_ns.swap(0, Ordering::Relaxed);
        let whole_max = self.whole_max_ns.swap(0, Ordering::Relaxed);
        let interval = EventStats {
            began_earlier: self.began_earlier.swap(0, Ordering::Relaxed),
            ..EventStats::from_raw(count, total, min, max)
        };
        (
            interval,
            EventStats::from_raw(count, total + earlier, min, whole_max),
        )
    }
}

/// Timings of one event over some window, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EventStats {
    pub count: u64,
    pub total_s: f64,
    pub mean_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    /// Events that began before the interval (only their time inside it is counted here).
    #[serde(default)]
    pub began_earlier: u64,
}

impl EventStats {
    fn from_raw(count: u64, total: u64, min: u64, max: u64) -> Self {
        let s = |ns: u64| ns as f64 * 1e-9;
        EventStats {
            count,
            total_s: s(total),
            mean_s: if count > 0 {
                s(total) / count as f64
            } else {
                0.0
            },
            min_s: if count > 0 { s(min) } else { 0.0 },
            max_s: s(max),
            began_earlier: 0,
        }
    }

    fn merge(&mut self, other: &EventStats) {
        if other.count == 0 {
            return;
        }
        self.min_s = if self.count == 0 {
            other.min_s
        } else {
            self.min_s.min(other.min_s)
        };
        self.max_s = self.max_s.max(other.max_s);
        self.count += other.count;
        self.total_s += other.total_s;
        self.mean_s = self.total_s / self.count as f64;
    }
}

/// Threads of each stage: what a stage's wall time is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageWorkers {
    pub targets: usize,
    pub drafters: usize,
}

impl Default for StageWorkers {
    fn default() -> Self {
        StageWorkers {
            targets: 1,
            drafters: 1,
        }
    }
}

impl StageWorkers {
    fn of(&self, stage: Stage) -> usize {
        match stage {
            Stage::Loader => 1,
            Stage::Target => self.targets,
            Stage::Drafter => self.drafters,
        }
        .max(1)
    }
}

/// One row of a report.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProfileRow {
    pub event: ProfileEvent,
    pub interval: EventStats,
    pub cumulative: EventStats,
    /// Interval total over the wall time of its stage's threads in the interval (at most 1);
    /// None for events of no stage (step.total).
    pub share: Option<f64>,
    /// The same since start.
    #[serde(default)]
    pub all_time_share: Option<f64>,
}

/// A report: the interval since the previous report and everything since start.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProfileReport {
    pub interval_s: f64,
    pub elapsed_s: f64,
    #[serde(default)]
    pub workers: StageWorkers,
    /// `step.total`, then work, then waits ([`TimingKind`]); each by share of the interval,
    /// largest first.
    pub rows: Vec<ProfileRow>,
}

/// How busy each stage was in a report's interval: its threads' time not spent waiting on
/// its input queue (or handing off), over their wall time. The formulas `bench` uses for
/// `stage_busy`.
pub fn stage_busy(
    interval_total_s: impl Fn(&[ProfileEvent]) -> f64,
    span_s: f64,
    workers: StageWorkers,
) -> Vec<(&'static str, f64)> {
    let span = span_s.max(1e-9);
    vec![
        (
            "loader",
            (interval_total_s(&[ProfileEvent::LoaderFetch, ProfileEvent::LoaderPack]) / span)
                .clamp(0.0, 1.0),
        ),
        (
            "target",
            (1.0 - interval_total_s(&[ProfileEvent::BatchQWait, ProfileEvent::TargetHandoff])
                / (span * workers.targets.max(1) as f64))
                .clamp(0.0, 1.0),
        ),
        (
            "drafter",
            (1.0 - interval_total_s(&[ProfileEvent::FeatureQWait])
                / (span * workers.drafters.max(1) as f64))
                .clamp(0.0, 1.0),
        ),
    ]
}

impl ProfileReport {
    /// Each stage's busy share over the interval (see [`stage_busy`]).
    pub fn stage_busy(&self) -> Vec<(&'static str, f64)> {
        let total = |events: &[ProfileEvent]| {
            self.rows
                .iter()
                .filter(|r| events.contains(&r.event))
                .map(|r| r.interval.total_s)
                .sum::<f64>()
        };
        stage_busy(total, self.interval_s, self.workers)
    }

    /// The busiest stage and its share: the one that limits the pipeline. None before any
    /// step's work was timed.
    pub fn bottleneck(&self) -> Option<(&'static str, f64)> {
        if self.rows.iter().all(|r| r.interval.count == 0) {
            return None;
        }
        self.stage_busy()
            .into_iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }
}

/// How [`ProfileReport::table`]'s first line begins (screens fold the table by it).
pub(crate) const TABLE_TITLE: &str = "ProfileStats over the last";

impl ProfileReport {
    /// The table printed in headless mode: `step.total`, then work, then waits.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{TABLE_TITLE} {:.1} s ({:.0} s since start)\n{:<18} {:<4} {:>7} {:>10} {:>10} {:>10} {:>10} {:>7} {:>12}\n",
            self.interval_s, self.elapsed_s, "event", "kind", "count", "total s", "mean ms", "min ms", "max ms", "share", "all-time s"
        );
        for r in &self.rows {
            out.push_str(&format!(
                "{:<18} {:<4} {:>7} {:>10.3} {:>10.3} {:>10.3} {:>10} {:>7} {:>12.3}\n",
                r.event.name(),
                r.event.kind().as_str(),
                r.interval.count,
                r.interval.total_s,
                r.interval.mean_s * 1e3,
                r.interval.min_s * 1e3,
                fmt_max_ms(&r.interval, |ms| format!("{ms:.3}")),
                fmt_share(r.share),
                r.cumulative.total_s
            ));
        }
        if self.rows.iter().any(|r| r.interval.began_earlier > 0) {
            out.push_str(BEGAN_EARLIER_NOTE);
            out.push('\n');
        }
        out
    }
}

/// What `>` before a max says.
pub(crate) const BEGAN_EARLIER_NOTE: &str =
    ">: began before this interval; only its time inside the interval is counted";

/// The max of an interval, marked `>` when an event began before the interval (its time
/// before is not in the row).
pub(crate) fn fmt_max_ms(stats: &EventStats, fmt: impl Fn(f64) -> String) -> String {
    let mark = if stats.began_earlier > 0 { ">" } else { "" };
    format!("{mark}{}", fmt(stats.max_s * 1e3))
}

/// A share as a percentage, "-" for none.
pub(crate) fn fmt_share(share: Option<f64>) -> String {
    share.map_or("-".into(), |s| format!("{:.1}%", s * 100.0))
}

/// The shared recorder.
pub struct ProfileStats {
    workers: StageWorkers,
    slots: Vec<Slot>,
    cumulative: Mutex<Vec<EventStats>>,
    started: Instant,
    /// When the current interval began, in nanoseconds after `started`.
    interval_start_ns: AtomicU64,
}

impl Default for ProfileStats {
    fn default() -> Self {
        Self::new()
    }
}

impl ProfileStats {
    pub fn new() -> Self {
        Self::with_workers(StageWorkers::default())
    }

    /// A recorder for a pipeline with these stage threads.
    pub(crate) fn with_workers(workers: StageWorkers) -> Self {
        ProfileStats {
            workers,
            slots: ProfileEvent::ALL.iter().map(|_| Slot::new()).collect(),
            cumulative: Mutex::new(vec![EventStats::default(); ProfileEvent::ALL.len()]),
            started: Instant::now(),
            interval_start_ns: AtomicU64::new(0),
        }
    }

    /// Records one occurrence.
    #[inline]
    pub fn record(&self, event: ProfileEvent, duration: Duration) {
        let now = self.started.elapsed().as_nanos() as u64;
        let inside = now.saturating_sub(self.interval_start_ns.load(Ordering::Relaxed));
        self.slots[event.index()].record(duration.as_nanos() as u64, inside);
    }

    /// Times `f` as `event`.
    #[inline]
    pub fn time<R>(&self, event: ProfileEvent, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.record(event, t.elapsed());
        r
    }

    /// Closes the current interval and returns its report.
    pub fn report(&self) -> ProfileReport {
        let now = self.started.elapsed().as_nanos() as u64;
        let began = self.interval_start_ns.swap(now, Ordering::Relaxed);
        // (divided, as Duration::as_secs_f64 does: the seconds read back from JSON the same)
        let interval_s = now.saturating_sub(began) as f64 / 1e9;
        let elapsed_s = now as f64 / 1e9;
        let mut cumulative = self.cumulative.lock().unwrap_or_else(|e| e.into_inner());
        let share = |total: f64, wall: f64, stage: Option<Stage>| {
            let threads = self.workers.of(stage?) as f64;
            // Clock reads of different threads may overlap the edges by a hair.
            (wall > 0.0).then(|| (total / (wall * threads)).min(1.0))
        };
        let mut rows: Vec<ProfileRow> = ProfileEvent::ALL
            .into_iter()
            .map(|event| {
                let i = event.index();
                let (interval, whole) = self.slots[i].take();
                cumulative[i].merge(&whole);
                let stage = event.stage();
                ProfileRow {
                    event,
                    interval,
                    cumulative: cumulative[i],
                    share: share(interval.total_s, interval_s, stage),
                    all_time_share: share(cumulative[i].total_s, elapsed_s, stage),
                }
            })
            .collect();
        // step.total, then the work by share, then the waits by share.
        rows.sort_by(|a, b| {
            let share = |r: &ProfileRow| r.share.unwrap_or(0.0);
            a.event
                .kind()
                .cmp(&b.event.kind())
                .then(share(b).total_cmp(&share(a)))
                .then(b.interval.total_s.total_cmp(&a.interval.total_s))
        });
        ProfileReport {
            interval_s,
            elapsed_s,
            workers: self.workers,
            rows,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_and_cumulative_views() {
        let p = ProfileStats::new();
        // (events end inside the interval: it must be longer than they are)
        std::thread::sleep(Duration::from_millis(20));
        p.record(ProfileEvent::DrafterForward, Duration::from_millis(4));
        p.record(ProfileEvent::DrafterForward, Duration::from_millis(2));
        p.record(ProfileEvent::LoaderFetch, Duration::from_millis(1));
        let r = p.report();
        let fwd = r
            .rows
            .iter()
            .find(|r| r.event == ProfileEvent::DrafterForward)
            .unwrap();
        assert_eq!(fwd.interval.count, 2);
        assert!((fwd.interval.mean_s - 0.003).abs() < 1e-9);
        assert!((fwd.interval.min_s - 0.002).abs() < 1e-9);
        assert!((fwd.interval.max_s - 0.004).abs() < 1e-9);
        assert_eq!(
            r.rows[0].event,
            ProfileEvent::StepTotal,
            "the span without a share first"
        );
        assert_eq!(
            r.rows[1].event,
            ProfileEvent::DrafterForward,
            "then the work by share"
        );
        std::thread::sleep(Duration::from_millis(20));
        p.record(ProfileEvent::DrafterForward, Duration::from_millis(10));
        let r2 = p.report();
        let fwd = r2
            .rows
            .iter()
            .find(|r| r.event == ProfileEvent::DrafterForward)
            .unwrap();
        assert_eq!(fwd.interval.count, 1);
        assert_eq!(fwd.cumulative.count, 3);
        assert!((fwd.cumulative.max_s - 0.010).abs() < 1e-9);
        assert_eq!(
            ProfileEvent::named("step.total"),
            Some(ProfileEvent::StepTotal)
        );
        assert!(r2.table().contains("drafter.forward"));
    }

    #[test]
    fn shares_are_of_the_stage_threads_wall_time() {
        let p = ProfileStats::with_workers(StageWorkers {
            targets: 2,
            drafters: 1,
        });
        // Two target workers both busy the whole time, a drafter waiting half of it.
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(40));
        let wall = t.elapsed();
        p.record(ProfileEvent::named("target.forward").unwrap(), wall);
        p.record(ProfileEvent::named("target.forward").unwrap(), wall);
        p.record(ProfileEvent::named("feature_q.wait").unwrap(), wall / 2);
        p.record(ProfileEvent::StepTotal, wall * 3);
        let r = p.report();
        let row = |e: &str| r.rows.iter().find(|r| r.event.name() == e).unwrap().clone();
        let fwd = row("target.forward").share.unwrap();
        assert!(
            fwd > 0.9 && fwd <= 1.0,
            "{fwd}: two workers' time over two workers"
        );
        assert_eq!(row("step.total").share, None);
        let wait = row("feature_q.wait").share.unwrap();
        assert!(wait > 0.4 && wait <= 0.5, "{wait}");
        assert!(r
            .rows
            .iter()
            .filter_map(|r| r.all_time_share)
            .all(|s| s <= 1.0));
        let (stage, busy) = r.bottleneck().unwrap();
        assert_eq!(stage, "target");
        assert!(busy > 0.99, "{busy}");
        let drafter = r
            .stage_busy()
            .into_iter()
            .find(|s| s.0 == "drafter")
            .unwrap()
            .1;
        assert!((0.5..0.6).contains(&drafter), "{drafter}");
    }

    #[test]
    fn an_event_that_began_before_the_interval_counts_only_its_time_inside() {
        let p = ProfileStats::new();
        std::thread::sleep(Duration::from_millis(30));
        p.report();
        // a handoff that waited on a full queue for 4.4 s, ending 30 ms into this interval
        std::thread::sleep(Duration::from_millis(30));
        p.record(ProfileEvent::TargetHandoff, Duration::from_millis(4424));
        p.record(ProfileEvent::TargetForward, Duration::from_millis(5));
        let r = p.report();
        let row = |e: &str| r.rows.iter().find(|r| r.event.name() == e).unwrap().clone();
        let handoff = row("target.handoff");
        assert_eq!(handoff.interval.count, 1);
        assert_eq!(handoff.interval.began_earlier, 1);
        assert!(
            handoff.interval.mean_s <= r.interval_s && handoff.interval.max_s <= r.interval_s,
            "{handoff:?} in {} s",
            r.interval_s
        );
        assert!(handoff.share.unwrap() <= 1.0);
        // since the start, the wait is whole
        assert!(
            (handoff.cumulative.total_s - 4.424).abs() < 1e-6,
            "{handoff:?}"
        );
        assert!((handoff.cumulative.max_s - 4.424).abs() < 1e-6);
        assert_eq!(row("target.forward").interval.began_earlier, 0);
        let table = r.table();
        assert!(table.contains(BEGAN_EARLIER_NOTE), "{table}");
        let line = table
            .lines()
            .find(|l| l.starts_with("target.handoff"))
            .unwrap();
        assert!(line.contains(" wait ") && line.contains(" >"), "{line}");
        // step.total, then the work, then the waits
        let kinds: Vec<TimingKind> = r.rows.iter().map(|r| r.event.kind()).collect();
        assert!(kinds.windows(2).all(|k| k[0] <= k[1]), "{kinds:?}");
        assert_eq!(ProfileEvent::FeatureQWait.kind(), TimingKind::Wait);
    }

    #[test]
    fn validation_and_evaluation_are_the_drafter_stages_time() {
        let p = ProfileStats::new();
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(40));
        let wall = t.elapsed();
        // the drafter worker validated for 3/4 of the interval and trained the rest
        p.record(ProfileEvent::ValidationPass, wall * 3 / 4);
        p.record(ProfileEvent::DrafterForward, wall / 8);
        p.record(ProfileEvent::EvalPass, wall / 16);
        let r = p.report();
        let drafter: f64 = r
            .rows
            .iter()
            .filter(|r| r.event.stage() == Some(Stage::Drafter))
            .filter_map(|r| r.share)
            .sum();
        let busy = r
            .stage_busy()
            .into_iter()
            .find(|s| s.0 == "drafter")
            .unwrap()
            .1;
        assert_eq!(busy, 1.0, "no wait on feature_q");
        assert!(drafter > 0.85 && drafter <= 1.0, "{drafter}");
        assert_eq!(ProfileEvent::ValidationPass.stage(), Some(Stage::Drafter));
        assert_eq!(ProfileEvent::EvalPass.stage(), Some(Stage::Drafter));
    }

    #[test]
    fn events_are_named_as_the_spec_and_read_back_by_name() {
        for (i, event) in ProfileEvent::ALL.into_iter().enumerate() {
            assert_eq!(event.index(), i, "{event}: ALL is in declaration order");
            assert_eq!(ProfileEvent::named(event.name()), Some(event));
            let json = serde_json::to_string(&event).unwrap();
            assert_eq!(json, format!("\"{}\"", event.name()));
            assert_eq!(serde_json::from_str::<ProfileEvent>(&json).unwrap(), event);
        }
        assert_eq!(
            ProfileEvent::named("target.h2d"),
            Some(ProfileEvent::TargetH2d)
        );
        assert_eq!(ProfileEvent::named("drafter"), None);
        assert_eq!(ProfileEvent::StepTotal.stage(), None);
        assert_eq!(ProfileEvent::BatchQWait.stage(), Some(Stage::Target));
    }
}
