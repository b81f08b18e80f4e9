//! ProfileStats: per named event, count / total / mean / min / max wall time for the current
//! interval and since start, and the share of the interval. Recording is a few relaxed atomic
//! operations on a pre-registered slot: no lock on the hot path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The event names of the control-room spec §3, in pipeline order.
pub(crate) const EVENTS: [&str; 15] = [
    "loader.fetch",
    "loader.pack",
    "batch_q.wait",
    "target.h2d",
    "target.forward",
    "target.handoff",
    "feature_q.wait",
    "drafter.anchors",
    "drafter.forward",
    "drafter.loss",
    "drafter.backward",
    "grad.sync",
    "optim.step",
    "checkpoint.save",
    "step.total",
];

/// Index of an event in [`EVENTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event(usize);

impl Event {
    pub fn named(name: &str) -> Option<Event> {
        EVENTS.iter().position(|e| *e == name).map(Event)
    }
    pub(crate) const LOADER_FETCH: Event = Event(0);
    pub(crate) const LOADER_PACK: Event = Event(1);
    pub(crate) const BATCH_Q_WAIT: Event = Event(2);
    pub(crate) const TARGET_H2D: Event = Event(3);
    pub(crate) const TARGET_FORWARD: Event = Event(4);
    pub(crate) const TARGET_HANDOFF: Event = Event(5);
    pub(crate) const FEATURE_Q_WAIT: Event = Event(6);
    pub(crate) const DRAFTER_ANCHORS: Event = Event(7);
    pub(crate) const DRAFTER_FORWARD: Event = Event(8);
    pub(crate) const DRAFTER_LOSS: Event = Event(9);
    pub(crate) const DRAFTER_BACKWARD: Event = Event(10);
    pub(crate) const GRAD_SYNC: Event = Event(11);
    pub(crate) const OPTIM_STEP: Event = Event(12);
    pub(crate) const CHECKPOINT_SAVE: Event = Event(13);
    pub(crate) const STEP_TOTAL: Event = Event(14);
}

struct Slot {
    count: AtomicU64,
    total_ns: AtomicU64,
    min_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Slot {
    fn new() -> Self {
        Slot {
            count: AtomicU64::new(0),
            total_ns: AtomicU64::new(0),
            min_ns: AtomicU64::new(u64::MAX),
            max_ns: AtomicU64::new(0),
        }
    }

    fn record(&self, ns: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
        self.min_ns.fetch_min(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    fn take(&self) -> EventStats {
        EventStats::from_raw(
            self.count.swap(0, Ordering::Relaxed),
            self.total_ns.swap(0, Ordering::Relaxed),
            self.min_ns.swap(u64::MAX, Ordering::Relaxed),
            self.max_ns.swap(0, Ordering::Relaxed),
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

/// The stage an event's time belongs to: the share of an event is of its stage's wall time
/// (with two target workers, target.forward was 122 % of the interval).
pub(crate) fn stage_of(event: &str) -> Option<&'static str> {
    match event.split('.').next() {
        Some("loader") => Some("loader"),
        Some("batch_q" | "target") => Some("target"),
        // The coordinator is drafter worker 0: it syncs, steps and checkpoints.
        Some("feature_q" | "drafter" | "grad" | "optim" | "checkpoint") => Some("drafter"),
        // step.total spans overlapping steps (the next begins before the last is read): no
        // stage's time, so no share.
        _ => None,
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
    fn of(&self, stage: &str) -> usize {
        match stage {
            "target" => self.targets,
            "drafter" => self.drafters,
            _ => 1,
        }
        .max(1)
    }
}

/// One row of a report.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProfileRow {
    pub event: String,
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
    /// Sorted by share of the interval, largest first.
    pub rows: Vec<ProfileRow>,
}

/// How busy each stage was in a report's interval: its threads' time not spent waiting on
/// its input queue (or handing off), over their wall time. The formulas `bench` uses for
/// `stage_busy`.
pub fn stage_busy(
    interval_total_s: impl Fn(&[&str]) -> f64,
    span_s: f64,
    workers: StageWorkers,
) -> Vec<(&'static str, f64)> {
    let span = span_s.max(1e-9);
    vec![
        (
            "loader",
            (interval_total_s(&["loader.fetch", "loader.pack"]) / span).clamp(0.0, 1.0),
        ),
        (
            "target",
            (1.0 - interval_total_s(&["batch_q.wait", "target.handoff"])
                / (span * workers.targets.max(1) as f64))
                .clamp(0.0, 1.0),
        ),
        (
            "drafter",
            (1.0 - interval_total_s(&["feature_q.wait"]) / (span * workers.drafters.max(1) as f64))
                .clamp(0.0, 1.0),
        ),
    ]
}

impl ProfileReport {
    /// Each stage's busy share over the interval (see [`stage_busy`]).
    pub fn stage_busy(&self) -> Vec<(&'static str, f64)> {
        let total = |events: &[&str]| {
            self.rows
                .iter()
                .filter(|r| events.contains(&r.event.as_str()))
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
    /// The table printed in headless mode.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{TABLE_TITLE} {:.1} s ({:.0} s since start)\n{:<18} {:>7} {:>10} {:>10} {:>10} {:>10} {:>7} {:>12}\n",
            self.interval_s, self.elapsed_s, "event", "count", "total s", "mean ms", "min ms", "max ms", "share", "all-time s"
        );
        for r in &self.rows {
            out.push_str(&format!(
                "{:<18} {:>7} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>7} {:>12.3}\n",
                r.event,
                r.interval.count,
                r.interval.total_s,
                r.interval.mean_s * 1e3,
                r.interval.min_s * 1e3,
                r.interval.max_s * 1e3,
                fmt_share(r.share),
                r.cumulative.total_s
            ));
        }
        out
    }
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
    last_report: Mutex<Instant>,
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
        let now = Instant::now();
        ProfileStats {
            workers,
            slots: EVENTS.iter().map(|_| Slot::new()).collect(),
            cumulative: Mutex::new(vec![EventStats::default(); EVENTS.len()]),
            started: now,
            last_report: Mutex::new(now),
        }
    }

    /// Records one occurrence.
    #[inline]
    pub fn record(&self, event: Event, duration: Duration) {
        self.slots[event.0].record(duration.as_nanos() as u64);
    }

    /// Times `f` as `event`.
    #[inline]
    pub fn time<R>(&self, event: Event, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.record(event, t.elapsed());
        r
    }

    /// Closes the current interval and returns its report.
    pub fn report(&self) -> ProfileReport {
        let now = Instant::now();
        let interval_s = {
            let mut last = self.last_report.lock().unwrap_or_else(|e| e.into_inner());
            let s = now.duration_since(*last).as_secs_f64();
            *last = now;
            s
        };
        let elapsed_s = now.duration_since(self.started).as_secs_f64();
        let mut cumulative = self.cumulative.lock().unwrap_or_else(|e| e.into_inner());
        let share = |total: f64, wall: f64, stage: Option<&str>| {
            let threads = self.workers.of(stage?) as f64;
            // Clock reads of different threads may overlap the edges by a hair.
            (wall > 0.0).then(|| (total / (wall * threads)).min(1.0))
        };
        let mut rows: Vec<ProfileRow> = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let interval = slot.take();
                cumulative[i].merge(&interval);
                let stage = stage_of(EVENTS[i]);
                ProfileRow {
                    event: EVENTS[i].to_string(),
                    interval,
                    cumulative: cumulative[i],
                    share: share(interval.total_s, interval_s, stage),
                    all_time_share: share(cumulative[i].total_s, elapsed_s, stage),
                }
            })
            .collect();
        rows.sort_by(|a, b| {
            let share = |r: &ProfileRow| r.share.unwrap_or(f64::INFINITY);
            share(b)
                .total_cmp(&share(a))
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
        p.record(Event::DRAFTER_FORWARD, Duration::from_millis(4));
        p.record(Event::DRAFTER_FORWARD, Duration::from_millis(2));
        p.record(Event::LOADER_FETCH, Duration::from_millis(1));
        let r = p.report();
        let fwd = r
            .rows
            .iter()
            .find(|r| r.event == "drafter.forward")
            .unwrap();
        assert_eq!(fwd.interval.count, 2);
        assert!((fwd.interval.mean_s - 0.003).abs() < 1e-9);
        assert!((fwd.interval.min_s - 0.002).abs() < 1e-9);
        assert!((fwd.interval.max_s - 0.004).abs() < 1e-9);
        assert_eq!(
            r.rows[0].event, "step.total",
            "the row without a share first"
        );
        assert_eq!(r.rows[1].event, "drafter.forward", "then by share");
        p.record(Event::DRAFTER_FORWARD, Duration::from_millis(10));
        let r2 = p.report();
        let fwd = r2
            .rows
            .iter()
            .find(|r| r.event == "drafter.forward")
            .unwrap();
        assert_eq!(fwd.interval.count, 1);
        assert_eq!(fwd.cumulative.count, 3);
        assert!((fwd.cumulative.max_s - 0.010).abs() < 1e-9);
        assert_eq!(Event::named("step.total"), Some(Event::STEP_TOTAL));
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
        p.record(Event::named("target.forward").unwrap(), wall);
        p.record(Event::named("target.forward").unwrap(), wall);
        p.record(Event::named("feature_q.wait").unwrap(), wall / 2);
        p.record(Event::STEP_TOTAL, wall * 3);
        let r = p.report();
        let row = |e: &str| r.rows.iter().find(|r| r.event == e).unwrap().clone();
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
}
