//! `eval`: acceptance length of a drafter by real greedy speculative decoding against its
//! target, the speed-up over plain greedy decoding, and a losslessness check.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};

use crate::config::Dtype;
use crate::config::{flag_between, MAX_NEW_TOKENS};
use crate::eval::prompts::{check_prompts, prompts_from_data, prompts_from_file};
use crate::eval::speculative::{drafter_warnings, evaluate, EvalOptions, EvalReport};
use crate::model::{Drafter, FrozenHead, TargetConfig, TargetModel};
use crate::runtime::{DeviceSpec, TorchRuntime};

use super::progress::Bars;
use indicatif::ProgressBar;

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// The target's Hugging Face model folder.
    #[arg(long)]
    pub target: PathBuf,
    /// The drafter folder (init-drafter or a training checkpoint's drafter/).
    #[arg(long)]
    pub drafter: PathBuf,
    /// A tokenised dataset (its validation split); prompts end where the assistant starts.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// JSONL prompts: {"messages": [...]} or {"prompt_ids": [...]}.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Prompts evaluated at most (the first ones).
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// The split of a --data dataset folder the prompts come from.
    #[arg(long, default_value = "validation")]
    pub split: String,
    /// Tokens generated per prompt at most (fewer when the target ends its answer).
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// auto, cpu, cuda, cuda:N, or a comma-separated list of CUDA devices: the prompts are
    /// shared out, one worker with its own copy of both models per device.
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    pub device: Vec<DeviceSpec>,
    /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
    /// Prompts decoded once, untimed, before the measured pass (graph capture and libtorch's
    /// lazy set-up happen there, not in the timing).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Decode eagerly (no CUDA graphs), e.g. to compare.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Run the drafter and the target with libtorch's operations only, without the fused
    /// kernels compiled at run time for their norms, rotation, cache writes and SwiGLU (GPU),
    /// e.g. to compare.
    #[arg(long)]
    pub no_fused_kernels: bool,
    /// Write a profiler trace (Chrome trace JSON, as torch.profiler exports it: operators with
    /// their shapes, and on a GPU the CUDA kernels) of one more decoding of the first prompt,
    /// greedy then DFlash, untimed, to this file (on the first device). See
    /// tools/trace_summary.py.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// One JSON object: tau, speedup, prompts (output_ids, accept_lengths), ...
    #[arg(long)]
    pub json: bool,
}

/// One device's share: every n-th prompt starting at `first`; `trace`: the profiler trace's
/// file, for the first device only.
fn run_shard(
    args: &EvalArgs,
    runtime: &TorchRuntime,
    device: tch::Device,
    prompts: &[Vec<u32>],
    eos: &[u32],
    bar: &ProgressBar,
    trace: Option<PathBuf>,
) -> Result<EvalReport> {
    let kind = args.dtype.kind(device);
    let mut target = TargetModel::load(&args.target, device, kind)?;
    if args.no_fused_kernels {
        target.set_fused_kernels(None);
    }
    let drafter = Drafter::load_for_target(&args.drafter, &target.config, device, kind)?;
    let head = FrozenHead::from_target(&target, device, kind);
    let opts = EvalOptions {
        graphs: runtime.graphs(!args.no_cuda_graphs),
        // the target's own (already compiled for the device), else compiled here
        kernels: target
            .fused_kernels()
            .or_else(|| runtime.fused_kernels(!args.no_fused_kernels, device)),
        warmup_prompts: args.warmup,
        progress: Some(bar.clone()),
        trace,
    };
    log::info!(
        "eval on {device:?}: {} prompts x {} new tokens, {}",
        prompts.len(),
        args.max_new_tokens,
        if opts.graphs.is_some() && device.is_cuda() {
            "CUDA graphs"
        } else {
            "eager"
        }
    );
    let mut report = evaluate(
        &target,
        &drafter,
        &head,
        prompts,
        args.max_new_tokens,
        eos,
        &opts,
    )?;
    report.drafter_warnings = drafter_warnings(&drafter);
    Ok(report)
}

pub(super) fn run(runtime: &TorchRuntime, args: EvalArgs, bars: &Bars) -> Result<()> {
    flag_between("--max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)?;
    if let Some(trace) = &args.trace {
        // refused before the models load, not after the warm-up
        crate::aten_ext::ProfilerTrace::check_path(trace)?;
    }
    let devices = runtime.device_list(&args.device)?;
    let target_config = TargetConfig::from_model_dir(&args.target)?;
    // The drafter must fit the target before anything is decoded.
    let block_size = Drafter::config_for_target(&args.drafter, &target_config)?.block_size as usize;
    let prompts = match (&args.prompts, &args.data) {
        (Some(p), _) => prompts_from_file(p, &args.target, args.limit)?,
        (None, Some(d)) => prompts_from_data(d, &args.split, args.limit)?,
        (None, None) => bail!("eval needs --data PATH or --prompts FILE"),
    };
    let what = args
        .prompts
        .as_ref()
        .or(args.data.as_ref())
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    check_prompts(
        &prompts,
        &target_config,
        args.max_new_tokens,
        block_size,
        &what,
    )?;
    let eos = crate::model::model_eos_ids(&args.target, &target_config)?;
    let ids: Vec<Vec<u32>> = prompts.into_iter().map(|p| p.ids).collect();
    let bar = bars.bar("eval", ids.len() as u64, "prompts");
    let report = measure(&args, runtime, &devices, &ids, &eos, block_size, &bar);
    // Cleared before anything is printed, also on an error.
    bar.finish_and_clear();
    let mut report = report?;
    report.speedup_warnings = report.speedup_warnings(devices.iter().any(|d| !d.is_cuda()));
    if !report.speedup_warnings.is_empty() {
        log::warn!(
            "the speed-up ({:.2}x) is not a trustworthy measurement:\n  - {}",
            report.speedup,
            report.speedup_warnings.join("\n  - ")
        );
    }
    if args.json {
        // the text report prints them with tau
        for w in &report.drafter_warnings {
            log::warn!("{}: {w}", args.drafter.display());
        }
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    print_report(&report);
    Ok(())
}

/// Decodes the prompts on every device (prompt i on device i % n) and merges the reports, the
/// prompts in input order.
fn measure(
    args: &EvalArgs,
    runtime: &TorchRuntime,
    devices: &[tch::Device],
    ids: &[Vec<u32>],
    eos: &[u32],
    block_size: usize,
    bar: &ProgressBar,
) -> Result<EvalReport> {
    let n = devices.len();
    Ok(if n == 1 {
        run_shard(args, runtime, devices[0], ids, eos, bar, args.trace.clone())?
    } else {
        // Prompt i goes to device i % n; the merged report lists prompts in input order.
        let shards: Vec<Vec<Vec<u32>>> = (0..n)
            .map(|d| ids.iter().skip(d).step_by(n).cloned().collect())
            .collect();
        let reports = std::thread::scope(|s| {
            let handles: Vec<_> = devices
                .iter()
                .zip(&shards)
                .enumerate()
                .map(|(i, (&dev, shard))| {
                    let trace = args.trace.clone().filter(|_| i == 0);
                    s.spawn(move || run_shard(args, runtime, dev, shard, eos, bar, trace))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| anyhow!("an eval worker panicked"))?)
                .collect::<Result<Vec<_>>>()
        })?;
        let mut merged = EvalReport::merge(block_size, reports);
        let mut ordered = Vec::with_capacity(merged.prompts.len());
        let mut per_shard: Vec<std::vec::IntoIter<_>> = Vec::new();
        let mut rest = std::mem::take(&mut merged.prompts).into_iter();
        for shard in &shards {
            per_shard.push(
                rest.by_ref()
                    .take(shard.len())
                    .collect::<Vec<_>>()
                    .into_iter(),
            );
        }
        for i in 0..ids.len() {
            ordered.push(
                per_shard[i % n]
                    .next()
                    .context("eval: a worker returned fewer prompts than it was given")?,
            );
        }
        merged.prompts = ordered;
        merged
    })
}

fn print_report(report: &EvalReport) {
    let interval = report
        .tau_ci95
        .map(|ci| format!(" (95 % interval over prompts {:.3}-{:.3})", ci.low, ci.high))
        .unwrap_or_default();
    println!(
        "tau {:.3}{interval} over {} prompts; speed-up {:.2}x (greedy {:.2} ms/token, DFlash {:.2} ms/token, prefill excluded); {} mismatches with plain greedy decoding",
        report.tau,
        report.prompts.len(),
        report.speedup,
        report.greedy_s_per_token * 1e3,
        report.dflash_s_per_token * 1e3,
        report.mismatches
    );
    for w in &report.drafter_warnings {
        println!("WARNING: {w}");
    }
    let steps = report.accepted_by_slot.first().copied().unwrap_or(0).max(1);
    let slots: Vec<String> = report
        .accepted_by_slot
        .iter()
        .enumerate()
        .skip(1)
        .map(|(k, &n)| format!("{k}:{:.0}%", 100.0 * n as f64 / steps as f64))
        .collect();
    println!("accepted by slot: {}", slots.join(" "));
    let sp = &report.speedup_spread;
    println!(
        "speed-up over prompts: mean {:.2}x, median {:.2}x, p10 {:.2}x, p90 {:.2}x, min {:.2}x, max {:.2}x ({} warm-up prompt(s) excluded{}{})",
        sp.mean,
        sp.median,
        sp.p10,
        sp.p90,
        sp.min,
        sp.max,
        report.warmup_prompts,
        if report.cuda_graphs { ", CUDA graphs" } else { "" },
        if report.fused_kernels { ", fused kernels" } else { "" }
    );
    let d = &report.dflash_step_ms;
    println!(
        "a DFlash step: {:.3} ms = {:.2} greedy steps of {:.3} ms (device: draft {:.3}, verify {:.3}; host: issue draft {:.3}, issue verify {:.3}, wait {:.3}, acceptance {:.3}, roll-back {:.3})",
        report.dflash_ms_per_step,
        report.step_cost_in_greedy_steps,
        report.greedy_ms_per_token,
        d.draft_device,
        d.verify_device,
        d.draft_host,
        d.verify_host,
        d.host_wait,
        d.accept,
        d.rollback
    );
    let mut hist = vec![0usize; report.accepted_by_slot.len() + 1];
    for p in &report.prompts {
        for &a in &p.accept_lengths {
            if let Some(h) = hist.get_mut(a) {
                *h += 1;
            }
        }
    }
    let hist: Vec<String> = hist
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, &c)| c > 0)
        .map(|(a, c)| format!("{a}:{c}"))
        .collect();
    println!("steps by acceptance length: {}", hist.join(" "));
    for (i, p) in report.prompts.iter().enumerate() {
        println!(
            "prompt {i}: tau {:.2}, {} tokens, accept lengths {:?}{}",
            p.tau,
            p.output_ids.len(),
            p.accept_lengths,
            match (p.first_mismatch, p.mismatch_margin) {
                (Some(at), Some(m)) => format!(
                    ", DIFFERS from greedy at token {at} (greedy's top-2 logit margin there: {m:.3})"
                ),
                (Some(at), None) => format!(", DIFFERS from greedy at token {at}"),
                _ => String::new(),
            }
        );
    }
}
