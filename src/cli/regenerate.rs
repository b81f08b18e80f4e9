//! `regenerate`: replace the assistant answers of a tokenised dataset by the target's own.

use std::path::PathBuf;

use anyhow::Result;

use crate::config::Dtype;
use crate::data::regenerate::{regenerate, RegenerateEngine, RegenerateOptions};
use crate::model::generate::{Sampling, TraceWindow};
use crate::runtime::{DeviceSpec, TorchRuntime};

use super::progress::Bars;

#[derive(Debug, clap::Args)]
pub struct RegenerateArgs {
    /// The target's Hugging Face model folder.
    #[arg(long)]
    pub target: PathBuf,
    /// The dataset: a prepare-data folder (every split), or one split folder / Arrow /
    /// Parquet file with input_ids and loss_mask.
    #[arg(long)]
    pub input: PathBuf,
    /// The dataset folder to create (must not exist yet, or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Longest answer; answers that reach it end their row.
    #[arg(long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Sequences decoded together (the continuous engine's cache slots: memory grows with
    /// batch size x --max-len).
    #[arg(long, default_value_t = 128)]
    pub batch_size: usize,
    /// Regenerate at most the first N assistant turns of a row; the rest is dropped.
    #[arg(long)]
    pub max_turns: Option<usize>,
    /// Use at most the first N rows of each split.
    #[arg(long)]
    pub limit: Option<usize>,
    /// 0 = greedy; above 0, sample from softmax(logits / T).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampling (per row, from the seed and the row id).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// auto, cpu, cuda, cuda:N, or a comma-separated list of CUDA devices (one worker each).
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    pub device: Vec<DeviceSpec>,
    /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
    /// Longest row (context and answers); a row that would be longer ends early.
    #[arg(long, default_value_t = 3072)]
    pub max_len: usize,
    /// Input rows per chunk; finished chunks survive an interruption.
    #[arg(long, default_value_t = 1024)]
    pub chunk_rows: usize,
    /// Padded prompt tokens per prefill forward.
    #[arg(long, default_value_t = 16_384, hide = true)]
    pub prefill_tokens: usize,
    /// continuous: slots that take the next conversation as soon as one ends, each turn after
    /// the last in its slot, the decoding step a CUDA graph on a GPU; plain: rounds of padded
    /// batches (the reference path, same tokens).
    #[arg(long, value_enum, default_value_t = RegenerateEngine::Continuous)]
    pub engine: RegenerateEngine,
    /// Decode eagerly (no CUDA graph), e.g. to compare.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Run the target with libtorch's operations only, without the fused kernels compiled at
    /// run time for its norms, rotation, cache writes and SwiGLU (GPU), e.g. to compare.
    #[arg(long)]
    pub no_fused_kernels: bool,
    /// Write a profiler trace (Chrome trace JSON, as torch.profiler exports it: operators with
    /// their shapes, and on a GPU the CUDA kernels) of the continuous engine's decoding steps
    /// --trace-steps to this file (the first device's worker). See tools/trace_summary.py.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The decoding steps --trace records, FIRST:COUNT (counted from 0; step 0 captures the
    /// CUDA graph). The run's last line says how many steps it took: e.g. a window near the
    /// end shows the steps of a draining batch.
    #[arg(long, value_name = "FIRST:COUNT", default_value = "100:20", value_parser = parse_trace_steps)]
    pub trace_steps: (u64, u64),
    /// Discard the finished chunks of an earlier run (OUT.partial) and start over, e.g. after
    /// the input changed.
    #[arg(long)]
    pub restart: bool,
    /// Stop after this many chunks, without assembling the output (tests of resumption).
    #[arg(long, hide = true)]
    pub stop_after_chunks: Option<usize>,
}

pub(super) fn run(runtime: &TorchRuntime, args: RegenerateArgs, bars: &Bars) -> Result<()> {
    let devices = runtime.device_list(&args.device)?;
    let kind = args.dtype.kind(devices[0]);
    // The length is set once the input is read.
    let bar = bars.bar("regenerate", 0, "answers");
    let opts = RegenerateOptions {
        max_new_tokens: args.max_new_tokens,
        batch_size: args.batch_size,
        max_turns: args.max_turns,
        limit: args.limit,
        sampling: Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
        },
        seed: args.seed,
        max_len: args.max_len,
        chunk_rows: args.chunk_rows,
        prefill_tokens: args.prefill_tokens,
        restart: args.restart,
        stop_after_chunks: args.stop_after_chunks,
        engine: args.engine,
        graphs: runtime.graphs(!args.no_cuda_graphs),
        kernels: runtime.fused_kernel_loader(!args.no_fused_kernels),
        trace: args.trace.clone().map(|path| TraceWindow {
            path,
            first: args.trace_steps.0,
            steps: args.trace_steps.1,
        }),
        progress: Some(bar.clone()),
        ..RegenerateOptions::default()
    };
    let summary = regenerate(&args.target, &args.input, &args.out, &devices, kind, &opts);
    bar.finish_and_clear();
    let summary = summary?;
    println!("{summary}");
    Ok(())
}

/// `FIRST:COUNT` of --trace-steps.
fn parse_trace_steps(text: &str) -> Result<(u64, u64), String> {
    let bad = || format!("{text:?}: expected FIRST:COUNT, two whole numbers, e.g. 100:20");
    let (first, count) = text.split_once(':').ok_or_else(bad)?;
    let first = first.trim().parse::<u64>().map_err(|_| bad())?;
    let count = count.trim().parse::<u64>().map_err(|_| bad())?;
    if count == 0 {
        return Err(format!("{text:?}: COUNT must be at least 1"));
    }
    Ok((first, count))
}
