//! `dflash-tui bench` (benchmarks spec): the real training pipeline run for a warm-up and a
//! measured window, each stage also run alone on the same batches, and one JSON object with
//! throughput, stage occupancy, GPU utilisation and memory, model FLOP utilisation and the
//! pipeline efficiency.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::aten_ext::graph::AllocatorStats;
use crate::aten_ext::ProfilerTrace;
use crate::config::{self, TrainConfig};
use crate::pipeline::command::Command;
use crate::pipeline::trainer::{self, TrainerHandle};
use crate::runtime::{DeviceSpec, TorchRuntime};
use crate::telemetry::profile::{stage_busy, ProfileEvent, ProfileReport, StageWorkers};
use crate::telemetry::records::{Phase, Snapshot, StepRecord};
use drafter_steps::DrafterStepMs;
use flops::ModelFlops;
use gpu_sampler::{GpuSampler, PhaseClocks, PhaseMark, SampledPhase};
use stages_alone::{measure_stages_alone, StageAloneRates, TraceRequest};

// Each stage alone on the pipeline's code: only the bench uses it.
mod stages_alone;
// The drafter stage's device time per part of a step, and its trace's named ranges.
mod drafter_steps;
// The target's forward alone (`bench-forward`).
pub(crate) mod forward;
// NVML sampling: utilisation, peak memory, clocks per phase.
mod gpu_sampler;
// The model FLOPs behind `mfu`.
pub(crate) mod flops;
// The gated delta rule kernels alone (`bench-gdn`).
pub(crate) mod gdn;

/// H200 dense bf16 peak (benchmarks spec).
pub(crate) const PEAK_FLOPS_PER_GPU: f64 = 989e12;

/// Profiles shipped in `configs/` as `bench-NAME.toml`.
pub(crate) const PROFILES: [&str; 8] = [
    "cpu-tiny",
    "smollm2",
    "qwen3-0.6b-shape",
    "qwen3-8b-shape",
    "qwen3.5-4b-shape",
    "qwen3.5-27b-shape",
    "qwen3-30b-a3b-shape",
    "qwen3.5-35b-a3b-shape",
];

#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// A profile (cpu-tiny, smollm2, qwen3-0.6b-shape, qwen3-8b-shape, qwen3.5-4b-shape,
    /// qwen3.5-27b-shape, qwen3-30b-a3b-shape, qwen3.5-35b-a3b-shape: configs/bench-NAME.toml)
    /// or a training config file.
    #[arg(long, default_value = "cpu-tiny")]
    pub profile: String,
    /// Override a config field, as in `train` (repeatable).
    #[arg(long = "set", value_name = "SECTION.FIELD=VALUE")]
    pub overrides: Vec<String>,
    /// Steps run before the measured window.
    #[arg(long, default_value_t = 5)]
    pub warmup_steps: u64,
    /// Steps measured.
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Batches each stage runs alone; 0 = exactly the measured window's batches.
    #[arg(long, default_value_t = 0)]
    pub stage_batches: usize,
    /// Write a profiler trace (Chrome trace JSON, as torch.profiler exports it: operators with
    /// their shapes, on a GPU the CUDA kernels, and a named range per step and per part of it)
    /// of --trace-steps drafter training steps alone, run after the timed stages, to this file.
    /// They train on the batches right after the measured window's, the ones --trace-pipeline
    /// records, so that the two traces compare kernel by kernel. See tools/trace_summary.py.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Training steps --trace records (at most the measured window's batches), and
    /// --trace-pipeline.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub trace_steps: usize,
    /// Write a profiler trace of the whole pipeline at work to this file: --trace-steps steps
    /// right after the measured window, every thread's CUDA kernels, copies and runtime calls
    /// (launches, synchronisations, allocations), so that the device's idle gaps can be put
    /// down to what the host threads were doing (tools/trace_summary.py --gaps).
    #[arg(long, value_name = "FILE")]
    pub trace_pipeline: Option<PathBuf>,
}

/// The benchmark's result (benchmarks spec fields, plus what they were computed from).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BenchReport {
    pub profile: String,
    pub config: String,
    pub target_devices: Vec<DeviceSpec>,
    pub drafter_devices: Vec<DeviceSpec>,
    pub warmup_steps: u64,
    pub steps: u64,
    pub window_s: f64,
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub draft_positions_per_s: f64,
    pub step_ms: f64,
    /// Fraction of wall time each stage spent working, not waiting on a queue.
    pub stage_busy: BTreeMap<String, f64>,
    /// Mean NVML utilisation per GPU over the window (empty without NVML).
    pub gpu_util: BTreeMap<String, f64>,
    /// Per GPU (NVML, every 100 ms): mean SM clock, power and the fraction of samples with the
    /// clocks held back by the power limit or a slowdown, over the pipeline's window
    /// (`pipeline`) and each stage alone (`target_alone`, `drafter_alone`); empty without NVML.
    pub gpu_clocks: BTreeMap<String, BTreeMap<String, PhaseClocks>>,
    pub mfu: Option<f64>,
    pub pipeline_efficiency: f64,
    /// tokens/s of each stage run alone on the same batches. Stages that share a device are
    /// also listed together ("target+drafter"): run alone, one after the other, on that device.
    pub stage_alone_tokens_per_s: BTreeMap<String, f64>,
    /// The drafter stage alone: milliseconds per step of each part of its steps, device time
    /// on a GPU (the pipeline's `profile_ms` are host times).
    pub drafter_step_ms: DrafterStepMs,
    /// The slowest of the stages run alone; where stages share a device, the stages of that
    /// device together (they cannot overlap there: the device is the stage).
    pub slowest_stage: String,
    /// Host time per ProfileStats event over the window: mean ms per occurrence (work queued,
    /// not device time, for the device stages) and the number of occurrences.
    pub profile_ms: BTreeMap<String, (f64, u64)>,
    /// Peak NVML memory per GPU over the run, GB (1e9 bytes).
    pub peak_mem_gb: BTreeMap<String, f64>,
    /// Per GPU of the pipeline, libtorch's caching allocator over the measured window: its
    /// counts there (retries and syncs of all streams each stall the device) and its peaks
    /// since the start (empty without CUDA).
    pub allocator: BTreeMap<String, AllocatorStats>,
    /// Parameters the FLOP count uses: target layers actually run (up to the last tapped
    /// layer, no embedding), drafter trainable parameters.
    pub target_params_used: f64,
    /// FLOPs per target token beyond 2 per parameter: the Gated DeltaNet layers' state
    /// products (0 for targets without them).
    pub target_rule_flops_per_token: f64,
    pub drafter_params: f64,
    pub model_flops_per_s: f64,
    pub tokens: u64,
    pub samples: u64,
    pub draft_blocks: u64,
}

/// A device setting with "auto" and "cuda" written as the GPU they pick first, "cuda:0".
fn first_gpu_named(device: DeviceSpec) -> DeviceSpec {
    match device {
        DeviceSpec::Auto => DeviceSpec::Cuda(0),
        other => other,
    }
}

/// Whether the target and the drafter stages run on the same devices (as configured; "auto"
/// and "cuda" name the first GPU, as "cuda:0" does).
fn shared_devices(targets: &[DeviceSpec], drafters: &[DeviceSpec]) -> bool {
    let mut t: Vec<DeviceSpec> = targets.iter().map(|&d| first_gpu_named(d)).collect();
    let mut d: Vec<DeviceSpec> = drafters.iter().map(|&d| first_gpu_named(d)).collect();
    t.sort();
    t.dedup();
    d.sort();
    d.dedup();
    t == d
}

/// The config file of a profile name, or the path itself.
pub(crate) fn profile_path(profile: &str) -> PathBuf {
    let p = Path::new(profile);
    if p.extension().is_some_and(|e| e == "toml") || p.components().count() > 1 {
        p.to_path_buf()
    } else {
        Path::new("configs").join(format!("bench-{profile}.toml"))
    }
}

/// Cumulative seconds of the named events.
fn totals(report: &ProfileReport, events: &[ProfileEvent]) -> f64 {
    report
        .rows
        .iter()
        .filter(|r| events.contains(&r.event))
        .map(|r| r.cumulative.total_s)
        .sum()
}

/// The config a benchmark runs: the profile's, changed so that the run never ends, saves or
/// evaluates by itself within the window.
fn bench_config(path: &Path, opts: &BenchOptions) -> Result<TrainConfig> {
    let mut cfg = config::load(path, &opts.overrides)?;
    // More steps than measured: the run is stopped after the window (never reaching its end,
    // where it would save a final checkpoint).
    cfg.train.total_steps = opts.warmup_steps + opts.steps + 1000;
    cfg.checkpoint.save_every_steps = 0;
    cfg.checkpoint.save_every_minutes = 0.0;
    cfg.eval.every_steps = 0;
    cfg.telemetry.profile_interval_s = 0.0;
    Ok(cfg)
}

/// What the pipeline run leaves to measure: the profile at the window's start and end, and
/// the run's snapshot at its end.
struct PipelineWindow {
    p0: ProfileReport,
    p1: ProfileReport,
    snap: Snapshot,
    allocator: BTreeMap<String, AllocatorStats>,
    /// The run's temporary directory, removed when the benchmark is done.
    _run_dir: tempfile::TempDir,
}

/// Waits until the pipeline has done `step` steps; an error if it ends before.
fn wait_for_step(handle: &TrainerHandle, step: u64) -> Result<()> {
    loop {
        let (done, phase, error) = handle.progress();
        if done >= step {
            return Ok(());
        }
        if phase.is_ended() {
            bail!(
                "the pipeline ended at step {done} before step {step}: {}",
                error.unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs the real pipeline through the warm-up and the measured window (GPU utilisation is
/// sampled over the window), then stops it without a checkpoint.
fn run_pipeline(
    runtime: &TorchRuntime,
    cfg: &TrainConfig,
    opts: &BenchOptions,
    sampler: &mut GpuSampler,
) -> Result<PipelineWindow> {
    let run_dir = tempfile::Builder::new()
        .prefix("dflash-bench-")
        .tempdir()
        .context("cannot create a temporary run directory")?;
    let gpus = pipeline_gpus(runtime, cfg);
    sampler.set(SampledPhase::Warmup);
    let handle = trainer::start(runtime, cfg, run_dir.path(), false)?;
    let waited = wait_for_step(&handle, opts.warmup_steps.max(1));
    let a0 = allocator_stats(runtime, &gpus);
    let p0 = handle.profile_report();
    sampler.set(SampledPhase::Window);
    let end = opts.warmup_steps + opts.steps;
    let waited = waited.and_then(|_| wait_for_step(&handle, end));
    sampler.set(SampledPhase::Warmup);
    let p1 = handle.profile_report();
    let snap = handle.snapshot();
    let allocator = allocator_stats(runtime, &gpus)
        .into_iter()
        .map(|(gpu, after)| {
            let before = a0.get(&gpu).copied().unwrap_or_default();
            (gpu, after.since(&before))
        })
        .collect();
    let traced = match (&opts.trace_pipeline, &waited) {
        (Some(path), Ok(())) => trace_pipeline(&handle, path, end + opts.trace_steps as u64),
        _ => Ok(()),
    };
    // A benchmark's weights are thrown away: stop without the final checkpoint (for an 8B
    // target's drafter that is 20 GB of training state written to disk).
    let _ = handle.command(&Command::Stop { checkpoint: false });
    let outcome = handle.join();
    sampler.set(SampledPhase::Idle);
    waited?;
    if outcome.phase == Phase::Failed {
        bail!("the pipeline failed: {}", outcome.error.unwrap_or_default());
    }
    traced?;
    Ok(PipelineWindow {
        p0,
        p1,
        snap,
        allocator,
        _run_dir: run_dir,
    })
}

/// The CUDA devices the pipeline's stages run on, by index.
fn pipeline_gpus(runtime: &TorchRuntime, cfg: &TrainConfig) -> Vec<usize> {
    // (target and drafter may share a device: each spec on its own, then each GPU once)
    let mut gpus: Vec<usize> = cfg
        .devices
        .target_devices
        .iter()
        .chain(&cfg.devices.drafter_devices)
        .filter_map(|&spec| match runtime.resolve(spec) {
            Ok(tch::Device::Cuda(i)) => Some(i),
            _ => None,
        })
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    gpus
}

/// The caching allocator's counters of each of `gpus` ("gpuN"); none where the CUDA library
/// is not there.
fn allocator_stats(runtime: &TorchRuntime, gpus: &[usize]) -> BTreeMap<String, AllocatorStats> {
    let Ok(graphs) = &runtime.graphs else {
        return BTreeMap::new();
    };
    gpus.iter()
        .filter_map(|&i| match graphs.allocator_stats(i) {
            Ok(s) => Some((format!("gpu{i}"), s)),
            Err(e) => {
                log::warn!("bench: no allocator statistics of cuda:{i}: {e:#}");
                None
            }
        })
        .collect()
}

/// Records the running pipeline until it has done `until` steps, into `path`.
fn trace_pipeline(handle: &TrainerHandle, path: &Path, until: u64) -> Result<()> {
    let trace = ProfilerTrace::start(true)?;
    let waited = wait_for_step(handle, until);
    trace.save(path)?;
    waited
}

/// Each stage alone on the same batches as the measured window (the packer's order after
/// the warm-up's); run after the pipeline, so that its memory does not count in the
/// pipeline's peak.
fn stages_alone(
    runtime: &TorchRuntime,
    cfg: &TrainConfig,
    opts: &BenchOptions,
    mark: &PhaseMark,
) -> Result<StageAloneRates> {
    let per_step = cfg.step_batches();
    let skip = (opts.warmup_steps.max(1) as usize) * per_step;
    let batches = if opts.stage_batches > 0 {
        opts.stage_batches
    } else {
        opts.steps as usize * per_step
    };
    log::info!(
        "bench {}: each stage alone on {batches} batches",
        opts.profile
    );
    let trace = opts.trace.as_ref().map(|path| TraceRequest {
        path: path.clone(),
        steps: opts.trace_steps,
    });
    let alone: StageAloneRates =
        measure_stages_alone(runtime, cfg, skip, batches, trace.as_ref(), mark)?;
    log::info!(
        "alone: loader {:.0}, target {:.0}, drafter {:.0} tokens/s",
        alone.loader_tokens_per_s,
        alone.target_tokens_per_s,
        alone.drafter_tokens_per_s
    );
    Ok(alone)
}

/// The measured window's counts: steps after the warm-up, timed by the step records
/// themselves.
struct WindowCounts {
    window_s: f64,
    steps: usize,
    tokens: u64,
    samples: u64,
    blocks: u64,
    /// Drafted positions: blocks times the block size.
    positions: f64,
}

impl WindowCounts {
    fn of(history: &[StepRecord], opts: &BenchOptions, block: i64) -> Result<WindowCounts> {
        let first = opts.warmup_steps.max(1);
        let start = history
            .iter()
            .find(|r| r.step == first)
            .map(|r| r.elapsed_s)
            .context("the warm-up's last step is not in the history")?;
        let window: Vec<&StepRecord> = history
            .iter()
            .filter(|r| r.step > first && r.step <= opts.warmup_steps + opts.steps)
            .collect();
        let end = window.last().map_or(start, |r| r.elapsed_s);
        let blocks: u64 = window.iter().map(|r| r.blocks).sum();
        Ok(WindowCounts {
            window_s: (end - start).max(1e-9),
            steps: window.len(),
            tokens: window.iter().map(|r| r.tokens).sum(),
            samples: window.iter().map(|r| r.samples).sum(),
            blocks,
            positions: (blocks as i64 * block) as f64,
        })
    }
}

/// Stage occupancy from ProfileStats between `p0` and `p1` (queue waits are idle time).
fn stage_occupancy(
    cfg: &TrainConfig,
    p0: &ProfileReport,
    p1: &ProfileReport,
) -> BTreeMap<String, f64> {
    let span = (p1.elapsed_s - p0.elapsed_s).max(1e-9);
    let diff = |events: &[ProfileEvent]| totals(p1, events) - totals(p0, events);
    let workers = StageWorkers {
        targets: cfg.devices.target_devices.len(),
        drafters: cfg.devices.drafter_devices.len(),
    };
    stage_busy(diff, span, workers)
        .into_iter()
        .map(|(stage, busy)| (stage.to_string(), busy))
        .collect()
}

/// The stages' rates alone, by name, and the slowest of them with its rate. Target and
/// drafter on the same devices: each token costs that device the time of both stages, so
/// what the pipeline can reach there is their sequential rate ("target+drafter"), which then
/// stands for both in the choice of the slowest.
fn alone_rates_and_slowest(
    cfg: &TrainConfig,
    alone: &StageAloneRates,
) -> (BTreeMap<String, f64>, String, f64) {
    let mut alone_rates = BTreeMap::new();
    alone_rates.insert("loader".to_string(), alone.loader_tokens_per_s);
    alone_rates.insert("target".to_string(), alone.target_tokens_per_s);
    alone_rates.insert("drafter".to_string(), alone.drafter_tokens_per_s);
    let mut candidates = alone_rates.clone();
    if shared_devices(&cfg.devices.target_devices, &cfg.devices.drafter_devices) {
        let both = 1.0
            / (1.0 / alone.target_tokens_per_s.max(1e-9)
                + 1.0 / alone.drafter_tokens_per_s.max(1e-9));
        alone_rates.insert("target+drafter".to_string(), both);
        candidates.remove("target");
        candidates.remove("drafter");
        candidates.insert("target+drafter".to_string(), both);
    }
    let (slowest, slowest_rate) = candidates
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(k, v)| (k.clone(), *v))
        .unwrap_or_default();
    (alone_rates, slowest, slowest_rate)
}

/// Host time per ProfileStats event between `p0` and `p1`: mean ms per occurrence and the
/// number of occurrences, for the events that occurred.
fn profile_means(p0: &ProfileReport, p1: &ProfileReport) -> BTreeMap<String, (f64, u64)> {
    let mut profile_ms = BTreeMap::new();
    for row in &p1.rows {
        let before = p0.rows.iter().find(|r| r.event == row.event);
        let count = row.cumulative.count - before.map_or(0, |r| r.cumulative.count);
        let total = row.cumulative.total_s - before.map_or(0.0, |r| r.cumulative.total_s);
        if count > 0 {
            profile_ms.insert(
                row.event.name().to_string(),
                (total * 1e3 / count as f64, count),
            );
        }
    }
    profile_ms
}

/// Model FLOP utilisation of `flops` over `window_s` on the GPUs the run used (each counted
/// once); None when it used none.
fn model_flops_utilisation(
    runtime: &TorchRuntime,
    cfg: &TrainConfig,
    flops: f64,
    window_s: f64,
) -> Option<f64> {
    let mut cuda: Vec<DeviceSpec> = cfg
        .devices
        .target_devices
        .iter()
        .chain(&cfg.devices.drafter_devices)
        .filter(|&&d| match d {
            DeviceSpec::Cuda(_) => true,
            DeviceSpec::Auto => runtime.cuda_devices() > 0,
            DeviceSpec::Cpu => false,
        })
        .map(|&d| first_gpu_named(d))
        .collect();
    cuda.sort();
    cuda.dedup();
    (!cuda.is_empty()).then(|| flops / window_s / (PEAK_FLOPS_PER_GPU * cuda.len() as f64))
}

pub(crate) fn run(runtime: &TorchRuntime, opts: &BenchOptions) -> Result<BenchReport> {
    if opts.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if let Some(trace) = &opts.trace {
        if opts.trace_steps == 0 {
            bail!("--trace-steps must be at least 1");
        }
        // refused before anything runs, not after the pipeline's window
        ProfilerTrace::check_path(trace)?;
    }
    if let Some(trace) = &opts.trace_pipeline {
        if opts.trace_steps == 0 {
            bail!("--trace-steps must be at least 1");
        }
        ProfilerTrace::check_path(trace)?;
    }
    let path = profile_path(&opts.profile);
    if !path.is_file() {
        bail!(
            "{}: no such benchmark config (profiles: {})",
            path.display(),
            PROFILES.join(", ")
        );
    }
    let cfg = bench_config(&path, opts)?;
    let model = ModelFlops::of(&cfg)?;

    let mut sampler = GpuSampler::start();
    let PipelineWindow {
        p0,
        p1,
        snap,
        allocator,
        _run_dir,
    } = run_pipeline(runtime, &cfg, opts, &mut sampler)?;
    let alone = stages_alone(runtime, &cfg, opts, &sampler.mark())?;
    sampler.stop();

    let w = WindowCounts::of(&snap.history, opts, model.block)?;
    let tokens_per_s = w.tokens as f64 / w.window_s;
    let stage_busy = stage_occupancy(&cfg, &p0, &p1);
    let (alone_rates, slowest, slowest_rate) = alone_rates_and_slowest(&cfg, &alone);
    let profile_ms = profile_means(&p0, &p1);
    let flops = model.flops(w.tokens, w.positions);
    let mfu = model_flops_utilisation(runtime, &cfg, flops, w.window_s);
    let gpus = sampler.summary();

    Ok(BenchReport {
        profile: opts.profile.clone(),
        config: path.display().to_string(),
        target_devices: cfg.devices.target_devices.clone(),
        drafter_devices: cfg.devices.drafter_devices.clone(),
        warmup_steps: opts.warmup_steps,
        steps: opts.steps,
        window_s: w.window_s,
        tokens_per_s,
        samples_per_s: w.samples as f64 / w.window_s,
        draft_positions_per_s: w.positions / w.window_s,
        step_ms: w.window_s * 1e3 / w.steps.max(1) as f64,
        stage_busy,
        gpu_util: gpus.util,
        gpu_clocks: gpus.clocks,
        mfu,
        pipeline_efficiency: tokens_per_s / slowest_rate.max(1e-9),
        stage_alone_tokens_per_s: alone_rates,
        drafter_step_ms: alone.drafter_step_ms.clone(),
        slowest_stage: slowest,
        profile_ms,
        peak_mem_gb: gpus.peak_mem_gb,
        allocator,
        target_params_used: model.target_params,
        target_rule_flops_per_token: model.target_rule_flops,
        drafter_params: model.drafter_params,
        model_flops_per_s: flops / w.window_s,
        tokens: w.tokens,
        samples: w.samples,
        draft_blocks: w.blocks,
    })
}
