//! `acceptance`: where the drafts of an `eval --json` report were accepted and rejected, by the
//! target's confidence in the token it picked there.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::config::Dtype;
use crate::eval::acceptance::{read_report, target_confidence, AcceptanceReport};
use crate::model::TargetModel;
use crate::runtime::{DeviceSpec, TorchRuntime};

use super::progress::Bars;

#[derive(Debug, clap::Args)]
pub struct AcceptanceArgs {
    /// The `eval --json` report (its prompts' outputs and drafts).
    pub report: PathBuf,
    /// The target's Hugging Face model folder (the one the report decoded with).
    #[arg(long)]
    pub target: PathBuf,
    /// The report's first prompts only.
    #[arg(long)]
    pub limit: Option<usize>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value_t = DeviceSpec::Auto)]
    pub device: DeviceSpec,
    /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU). f32 reproduces an f32
    /// report's picks exactly; the table says how many agree.
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub(super) fn run(runtime: &TorchRuntime, args: AcceptanceArgs, bars: &Bars) -> Result<()> {
    let text = std::fs::read_to_string(&args.report)
        .with_context(|| format!("reading {}", args.report.display()))?;
    let mut prompts = read_report(&text).with_context(|| format!("{}", args.report.display()))?;
    if let Some(limit) = args.limit {
        prompts.truncate(limit);
    }
    let device = runtime.resolve(args.device)?;
    let kind = args.dtype.kind(device);
    let target = TargetModel::load(&args.target, device, kind)?;
    let bar = bars.bar("acceptance", prompts.len() as u64, "prompts");
    let mut report = AcceptanceReport::new();
    let tallied = prompts.iter().enumerate().try_for_each(|(i, prompt)| {
        target_confidence(&target, prompt)
            .and_then(|(confidence, agrees)| report.add(prompt, &confidence, &agrees))
            .with_context(|| format!("prompt {i}"))?;
        bar.inc(1);
        anyhow::Ok(())
    });
    bar.finish_and_clear();
    tallied.with_context(|| format!("{}", args.report.display()))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
