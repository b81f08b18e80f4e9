//! `regenerate`: replace the assistant answers of a tokenised dataset by the target's own.

use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::data::regenerate::{regenerate, RegenerateOptions};
use crate::eval::regenerate::Sampling;
use crate::runtime::TorchRuntime;

use super::generate::parse_kind;

pub struct RegenerateArgs {
    pub target: PathBuf,
    pub input: PathBuf,
    pub out: PathBuf,
    pub max_new_tokens: usize,
    pub batch_size: usize,
    pub max_turns: Option<usize>,
    pub limit: Option<usize>,
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    pub device: String,
    pub dtype: String,
    pub max_len: usize,
    pub chunk_rows: usize,
    pub prefill_tokens: usize,
    pub stop_after_chunks: Option<usize>,
}

/// `auto`, `cpu`, `cuda`, `cuda:N`, or a comma-separated list of CUDA devices.
fn parse_devices(runtime: &TorchRuntime, spec: &str) -> Result<Vec<tch::Device>> {
    let mut devices = Vec::new();
    for name in spec.split(',') {
        let device = runtime.device(name)?;
        if devices.contains(&device) {
            bail!("--device {spec:?} names {device:?} twice");
        }
        devices.push(device);
    }
    if devices.len() > 1 && devices.iter().any(|d| !d.is_cuda()) {
        bail!("--device {spec:?}: a list of devices must all be CUDA devices (cuda:N,cuda:M)");
    }
    Ok(devices)
}

pub fn run(runtime: &TorchRuntime, args: RegenerateArgs) -> Result<()> {
    let devices = parse_devices(runtime, &args.device)?;
    let kind = parse_kind(&args.dtype, devices[0])?;
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
        stop_after_chunks: args.stop_after_chunks,
        ..RegenerateOptions::default()
    };
    let summary = regenerate(&args.target, &args.input, &args.out, &devices, kind, &opts)?;
    println!("{summary}");
    Ok(())
}
