//! NVML sampling through a benchmark: GPU utilisation and peak memory of the pipeline run, and
//! the SM clock and power of each measured phase (the pipeline's window, each stage alone), so
//! that a pipeline slower than its stages alone can be told apart from a GPU running at lower
//! clocks in it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::telemetry::gpu::{GpuClocks, GpuMonitor, GpuReading};

/// What the benchmark is doing while a sample is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SampledPhase {
    /// Nothing measured (start-up, between phases).
    Idle = 0,
    /// The pipeline's warm-up steps.
    Warmup = 1,
    /// The pipeline's measured window.
    Window = 2,
    /// The target stage alone, timed.
    TargetAlone = 3,
    /// The drafter stage alone, timed.
    DrafterAlone = 4,
}

impl SampledPhase {
    fn of(v: u8) -> SampledPhase {
        match v {
            1 => SampledPhase::Warmup,
            2 => SampledPhase::Window,
            3 => SampledPhase::TargetAlone,
            4 => SampledPhase::DrafterAlone,
            _ => SampledPhase::Idle,
        }
    }

    /// The pipeline is running (its utilisation and memory are what the report gives).
    fn in_pipeline(self) -> bool {
        matches!(self, SampledPhase::Warmup | SampledPhase::Window)
    }

    fn name(self) -> Option<&'static str> {
        match self {
            SampledPhase::Window => Some("pipeline"),
            SampledPhase::TargetAlone => Some("target_alone"),
            SampledPhase::DrafterAlone => Some("drafter_alone"),
            SampledPhase::Idle | SampledPhase::Warmup => None,
        }
    }
}

/// Means of one GPU's clock readings over one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct PhaseClocks {
    pub samples: u64,
    /// Mean SM clock, MHz.
    pub sm_mhz: f64,
    /// Mean power draw, W.
    pub power_w: f64,
    /// Fraction of the samples with the clocks held back by the board's power limit.
    pub power_capped: f64,
    /// Fraction of the samples with a thermal or hardware slowdown.
    pub slowed_down: f64,
}

#[derive(Debug, Default)]
struct Sums {
    util: f64,
    util_samples: u64,
    peak_mem: f64,
    phases: BTreeMap<&'static str, [f64; 5]>,
}

/// Marks the phase the benchmark is in, for the sampling thread.
#[derive(Clone)]
pub(crate) struct PhaseMark(Arc<AtomicU8>);

impl PhaseMark {
    pub(crate) fn set(&self, phase: SampledPhase) {
        self.0.store(phase as u8, Ordering::Relaxed);
    }
}

/// GPU sampling (NVML, every 100 ms) for the whole benchmark: utilisation over the pipeline's
/// window, peak memory over the pipeline run (warm-up and window), clocks per measured phase.
/// Without NVML it samples nothing.
pub(crate) struct GpuSampler {
    phase: PhaseMark,
    done: Arc<AtomicBool>,
    sums: Arc<Mutex<BTreeMap<String, Sums>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GpuSampler {
    pub(crate) fn start() -> GpuSampler {
        let monitor = GpuMonitor::open().ok();
        let phase = PhaseMark(Arc::new(AtomicU8::new(SampledPhase::Idle as u8)));
        let done = Arc::new(AtomicBool::new(false));
        let sums: Arc<Mutex<BTreeMap<String, Sums>>> = Arc::default();
        let thread = monitor.map(|m| {
            let (phase, done, sums) = (phase.clone(), done.clone(), sums.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let now = SampledPhase::of(phase.0.load(Ordering::Relaxed));
                    sample_once(&m, now, &sums);
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        });
        GpuSampler {
            phase,
            done,
            sums,
            thread,
        }
    }

    /// A handle that sets the phase (for the stages alone, which run elsewhere).
    pub(crate) fn mark(&self) -> PhaseMark {
        self.phase.clone()
    }

    pub(crate) fn set(&self, phase: SampledPhase) {
        self.phase.set(phase);
    }

    /// Stops sampling and waits for the sampling thread.
    pub(crate) fn stop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(s) = self.thread.take() {
            let _ = s.join();
        }
    }

    /// Per GPU ("gpuN"): mean utilisation (0..1) over the window of each GPU sampled in it,
    /// peak memory in GB over the pipeline run, and the clocks of each measured phase.
    pub(crate) fn summary(&self) -> GpuSummary {
        let sums = self.sums.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = GpuSummary::default();
        for (gpu, s) in sums.iter() {
            if s.util_samples > 0 {
                out.util
                    .insert(gpu.clone(), s.util / s.util_samples as f64 / 100.0);
            }
            out.peak_mem_gb.insert(gpu.clone(), s.peak_mem / 1e9);
            let phases: BTreeMap<String, PhaseClocks> = s
                .phases
                .iter()
                .map(|(name, [n, mhz, w, capped, slowed])| {
                    let mean = |x: &f64| x / n.max(1.0);
                    let clocks = PhaseClocks {
                        samples: *n as u64,
                        sm_mhz: mean(mhz),
                        power_w: mean(w),
                        power_capped: mean(capped),
                        slowed_down: mean(slowed),
                    };
                    (name.to_string(), clocks)
                })
                .collect();
            if !phases.is_empty() {
                out.clocks.insert(gpu.clone(), phases);
            }
        }
        out
    }
}

/// What [`GpuSampler::summary`] returns.
#[derive(Debug, Default)]
pub(crate) struct GpuSummary {
    pub util: BTreeMap<String, f64>,
    pub peak_mem_gb: BTreeMap<String, f64>,
    pub clocks: BTreeMap<String, BTreeMap<String, PhaseClocks>>,
}

fn sample_once(m: &GpuMonitor, phase: SampledPhase, sums: &Mutex<BTreeMap<String, Sums>>) {
    let readings = phase.in_pipeline().then(|| m.sample().ok()).flatten();
    let clocks = phase.name().and_then(|_| m.clocks().ok());
    let mut sums = sums.lock().unwrap_or_else(|e| e.into_inner());
    accumulate(
        &mut sums,
        phase,
        &readings.unwrap_or_default(),
        &clocks.unwrap_or_default(),
    );
}

/// Adds one sample of every GPU taken in `phase`.
fn accumulate(
    sums: &mut BTreeMap<String, Sums>,
    phase: SampledPhase,
    readings: &[GpuReading],
    clocks: &[GpuClocks],
) {
    for g in readings.iter().filter(|_| phase.in_pipeline()) {
        let e = sums.entry(format!("gpu{}", g.index)).or_default();
        if phase == SampledPhase::Window {
            e.util += g.utilization_pct.unwrap_or(0) as f64;
            e.util_samples += 1;
        }
        e.peak_mem = e.peak_mem.max(g.memory_used_bytes.unwrap_or(0) as f64);
    }
    let Some(name) = phase.name() else {
        return;
    };
    for c in clocks {
        let (Some(mhz), Some(w)) = (c.sm_mhz, c.power_watts) else {
            continue;
        };
        let e = sums.entry(format!("gpu{}", c.index)).or_default();
        let p = e.phases.entry(name).or_default();
        let flag = |b: Option<bool>| f64::from(u8::from(b.unwrap_or(false)));
        p[0] += 1.0;
        p[1] += mhz as f64;
        p[2] += w;
        p[3] += flag(c.power_capped);
        p[4] += flag(c.slowed_down);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(util: u32, mem: u64) -> GpuReading {
        GpuReading {
            index: 0,
            name: "test".into(),
            utilization_pct: Some(util),
            memory_used_bytes: Some(mem),
            memory_total_bytes: None,
            power_watts: None,
            power_limit_watts: None,
            temperature_c: None,
        }
    }

    fn clocks(mhz: u32, w: f64, capped: bool) -> GpuClocks {
        GpuClocks {
            index: 0,
            sm_mhz: Some(mhz),
            power_watts: Some(w),
            power_capped: Some(capped),
            slowed_down: Some(false),
        }
    }

    #[test]
    fn phases_keep_their_own_means_and_only_the_pipeline_counts_utilisation_and_memory() {
        let sampler = GpuSampler {
            phase: PhaseMark(Arc::new(AtomicU8::new(0))),
            done: Arc::new(AtomicBool::new(true)),
            sums: Arc::default(),
            thread: None,
        };
        {
            let mut sums = sampler.sums.lock().unwrap();
            let s = &mut sums;
            accumulate(s, SampledPhase::Warmup, &[reading(10, 7e9 as u64)], &[]);
            accumulate(
                s,
                SampledPhase::Window,
                &[reading(90, 5e9 as u64)],
                &[clocks(1500, 600.0, true)],
            );
            accumulate(
                s,
                SampledPhase::Window,
                &[reading(70, 6e9 as u64)],
                &[clocks(1700, 500.0, false)],
            );
            accumulate(
                s,
                SampledPhase::TargetAlone,
                &[],
                &[clocks(1980, 400.0, false)],
            );
            // not measured: neither clocks nor memory count
            accumulate(
                s,
                SampledPhase::Idle,
                &[reading(0, 9e9 as u64)],
                &[clocks(100, 1.0, true)],
            );
        }
        let out = sampler.summary();
        assert_eq!(out.util["gpu0"], 0.8);
        assert_eq!(out.peak_mem_gb["gpu0"], 7.0);
        let phases = &out.clocks["gpu0"];
        assert_eq!(phases.len(), 2);
        let p = phases["pipeline"];
        assert_eq!(
            (p.samples, p.sm_mhz, p.power_w, p.power_capped),
            (2, 1600.0, 550.0, 0.5)
        );
        let t = phases["target_alone"];
        assert_eq!((t.samples, t.sm_mhz, t.power_capped), (1, 1980.0, 0.0));
    }
}
