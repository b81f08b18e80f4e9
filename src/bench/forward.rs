//! `dflash-tui bench-forward`: the target's forward alone, as the trainer's target stage runs it
//! (no autograd, every layer's hidden state returned), on one batch of random token ids: the
//! best of N timed calls, tokens/s, the forward's model FLOPs ([`super::flops`]) and the rate
//! reached, optionally a profiler trace of one more call, and on a GPU the memory NVML reports in use after the calls (the caching allocator
//! keeps what the forward took, so this is its peak plus the CUDA context). One JSON object.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use super::flops::target_layers_cost;
use crate::aten_ext::ProfilerTrace;
use crate::config::Dtype;
use crate::model::{describe_target, ForwardRequest, TargetModel};
use crate::pipeline::trainer::sync_device;
use crate::runtime::{DeviceSpec, TorchRuntime};
use crate::telemetry::gpu::GpuMonitor;

#[derive(Debug, Clone, clap::Args)]
pub struct ForwardBenchArgs {
    /// The target's model folder (config.json, and the weights unless --random-weights).
    #[arg(long)]
    pub target: PathBuf,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 3072)]
    pub tokens: i64,
    /// Sequences per forward.
    #[arg(long, default_value_t = 1)]
    pub batch: i64,
    /// Compute dtype of the weights and activations (auto: bf16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    pub dtype: Dtype,
    /// Timed forwards (after one untimed); the best is reported.
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Seeded random weights from config.json instead of the folder's weight files.
    #[arg(long)]
    pub random_weights: bool,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value_t = DeviceSpec::Auto)]
    pub device: DeviceSpec,
    /// Seed of the random weights and token ids.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How a hybrid target's gated delta rule runs the prefill on the GPU: "auto" (the
    /// default form), "recurrent", "chunked" (on tensor cores where the GPU and the model
    /// allow) or "chunked-float32".
    #[arg(long, value_enum, default_value_t = GdnPrefill::Auto)]
    pub gdn_prefill: GdnPrefill,
    /// After the timed calls, record one more forward with libtorch's profiler and write the
    /// trace here (Chrome trace JSON; `tools/trace_summary.py` totals it by kernel).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

/// The form of the gated delta rule's prefill kernels (`--gdn-prefill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GdnPrefill {
    Auto,
    Recurrent,
    Chunked,
    #[serde(rename = "chunked-float32")]
    ChunkedFloat32,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ForwardReport {
    pub target: String,
    /// Family and layer mix ([`describe_target`]).
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub random_weights: bool,
    pub gdn_prefill: GdnPrefill,
    pub batch: i64,
    pub tokens: i64,
    /// Layers run, and hidden states returned (one per layer).
    pub layers_run: usize,
    pub hidden_states: usize,
    pub iters: usize,
    /// Seconds of each timed forward, in order.
    pub seconds: Vec<f64>,
    pub best_s: f64,
    /// batch x tokens over the best time.
    pub tokens_per_s: f64,
    /// Model FLOPs of one forward: 2 per layer parameter and token, plus the Gated DeltaNet
    /// state products; no embedding, LM head or attention scores (docs/benchmarks.md).
    pub forward_tflop: f64,
    pub tflop_per_s: f64,
    /// NVML's memory in use on the GPU after the calls, GB (1e9 bytes); None off CUDA or
    /// without NVML.
    pub peak_mem_gb: Option<f64>,
}

/// The dtype's name as `--dtype` takes it.
fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "f32",
    }
}

/// NVML's memory in use on GPU `index`, GB.
fn gpu_memory_gb(index: usize) -> Option<f64> {
    let readings = GpuMonitor::open().ok()?.sample().ok()?;
    let gpu = readings.iter().find(|g| g.index as usize == index)?;
    Some(gpu.memory_used_bytes? as f64 / 1e9)
}

/// Builds the target and times its forward.
pub(crate) fn run(runtime: &TorchRuntime, args: &ForwardBenchArgs) -> Result<ForwardReport> {
    if args.iters == 0 || args.tokens < 1 || args.batch < 1 {
        bail!("--iters, --tokens and --batch must each be at least 1");
    }
    if let Some(trace) = &args.trace {
        ProfilerTrace::check_path(trace)?;
    }
    let device = runtime.resolve(args.device)?;
    let kind = args.dtype.kind(device);
    let mut model = if args.random_weights {
        TargetModel::random(&args.target, device, kind, args.seed)?
    } else {
        TargetModel::load(&args.target, device, kind)?
    };
    match args.gdn_prefill {
        GdnPrefill::Auto => {}
        GdnPrefill::Recurrent => model.set_gdn_prefill_form(false, true),
        GdnPrefill::Chunked => model.set_gdn_prefill_form(true, true),
        GdnPrefill::ChunkedFloat32 => model.set_gdn_prefill_form(true, false),
    }
    let layers = model.num_layers();
    let req = ForwardRequest {
        tap_layers: (0..layers).collect(),
        ..Default::default()
    };
    tch::manual_seed(args.seed as i64);
    let ids = Tensor::randint(
        model.config.vocab_size,
        [args.batch, args.tokens],
        (Kind::Int64, device),
    );
    let forward = || -> Result<(f64, usize)> {
        let started = Instant::now();
        let out = model.run(&ids, None, &req);
        sync_device(device);
        let seconds = started.elapsed().as_secs_f64();
        let features = out
            .features
            .context("the forward returned no hidden states")?;
        let width = features.size().last().copied().unwrap_or(0);
        Ok((seconds, (width / model.config.hidden_size) as usize))
    };
    forward()?;
    let mut seconds = Vec::with_capacity(args.iters);
    let mut hidden_states = 0;
    for _ in 0..args.iters {
        let (s, states) = forward()?;
        seconds.push(s);
        hidden_states = states;
    }
    if let Some(path) = &args.trace {
        let trace = ProfilerTrace::start(device.is_cuda())?;
        forward()?;
        trace.save(path)?;
    }
    let best_s = seconds.iter().copied().fold(f64::INFINITY, f64::min);
    let tokens = (args.batch * args.tokens) as f64;
    let (params, rule) = target_layers_cost(&model.config, layers);
    let flops = (2.0 * params + rule) * tokens;
    let (device_name, peak_mem_gb) = match device {
        Device::Cuda(i) => (DeviceSpec::Cuda(i), gpu_memory_gb(i)),
        _ => (DeviceSpec::Cpu, None),
    };
    Ok(ForwardReport {
        target: args.target.display().to_string(),
        model: describe_target(&model.config),
        device: device_name.to_string(),
        dtype: kind_name(kind).to_string(),
        random_weights: args.random_weights,
        gdn_prefill: args.gdn_prefill,
        batch: args.batch,
        tokens: args.tokens,
        layers_run: layers,
        hidden_states,
        iters: args.iters,
        best_s,
        tokens_per_s: tokens / best_s,
        forward_tflop: flops / 1e12,
        tflop_per_s: flops / best_s / 1e12,
        seconds,
        peak_mem_gb,
    })
}
