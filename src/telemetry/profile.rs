//! ProfileStats: per named event, count / total / mean / min / max wall time for the current
//! interval and since start, and the share of the interval. Recording is a few relaxed atomic
//! operations on a pre-registered slot: no lock on the hot path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The event names of the control-room spec §3, in pipeline order.
pub const EVENTS: [&str; 15] = [
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
    pub const LOADER_FETCH: Event = Event(0);
    pub const LOADER_PACK: Event = Event(1);
    pub const BATCH_Q_WAIT: Event = Event(2);
    pub const TARGET_H2D: Event = Event(3);
    pub const TARGET_FORWARD: Event = Event(4);
    pub const TARGET_HANDOFF: Event = Event(5);
    pub const FEATURE_Q_WAIT: Event = Event(6);
    pub const DRAFTER_ANCHORS: Event = Event(7);
    pub const DRAFTER_FORWARD: Event = Event(8);
    pub const DRAFTER_LOSS: Event = Event(9);
    pub const DRAFTER_BACKWARD: Event = Event(10);
    pub const GRAD_SYNC: Event = Event(11);
    pub const OPTIM_STEP: Event = Event(12);
    pub const CHECKPOINT_SAVE: Event = Event(13);
    pub const STEP_TOTAL: Event = Event(14);
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

    fn read(&self) -> EventStats {
        EventStats::from_raw(
            self.count.load(Ordering::Relaxed),
            self.total_ns.load(Ordering::Relaxed),
            self.min_ns.load(Ordering::Relaxed),
            self.max_ns.load(Ordering::Relaxed),
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

/// One row of a report.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProfileRow {
    pub event: String,
    pub interval: EventStats,
    pub cumulative: EventStats,
    /// interval total / interval wall time
    pub share: f64,
}

/// A report: the interval since the previous report and everything since start.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProfileReport {
    pub interval_s: f64,
    pub elapsed_s: f64,
    /// Sorted by share of the interval, largest first.
    pub rows: Vec<ProfileRow>,
}

impl ProfileReport {
    /// The table printed in headless mode.
    pub fn table(&self) -> String {
        let mut out = format!(
            "ProfileStats over the last {:.1} s ({:.0} s since start)\n{:<18} {:>7} {:>10} {:>10} {:>10} {:>10} {:>7} {:>12}\n",
            self.interval_s, self.elapsed_s, "event", "count", "total s", "mean ms", "min ms", "max ms", "share", "all-time s"
        );
        for r in &self.rows {
            out.push_str(&format!(
                "{:<18} {:>7} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>6.1}% {:>12.3}\n",
                r.event,
                r.interval.count,
                r.interval.total_s,
                r.interval.mean_s * 1e3,
                r.interval.min_s * 1e3,
                r.interval.max_s * 1e3,
                r.share * 100.0,
                r.cumulative.total_s
            ));
        }
        out
    }
}

/// The shared recorder.
pub struct ProfileStats {
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
        let now = Instant::now();
        ProfileStats {
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
        let mut cumulative = self.cumulative.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<ProfileRow> = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let interval = slot.take();
                cumulative[i].merge(&interval);
                ProfileRow {
                    event: EVENTS[i].to_string(),
                    interval,
                    cumulative: cumulative[i],
                    share: if interval_s > 0.0 {
                        interval.total_s / interval_s
                    } else {
                        0.0
                    },
                }
            })
            .collect();
        rows.sort_by(|a, b| b.share.total_cmp(&a.share));
        ProfileReport {
            interval_s,
            elapsed_s: now.duration_since(self.started).as_secs_f64(),
            rows,
        }
    }

    /// The current interval so far, without closing it (for live views).
    pub fn peek(&self) -> Vec<(String, EventStats)> {
        self.slots
            .iter()
            .enumerate()
            .map(|(i, s)| (EVENTS[i].to_string(), s.read()))
            .collect()
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
        assert_eq!(r.rows[0].event, "drafter.forward", "sorted by share");
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
}
