//! `init-drafter` and `perplexity`.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::data::arrow_io::{read_token_column, resolve_split};
use crate::data::check::scan_tokens;
use crate::data::store::DataColumns;
use crate::eval::perplexity::{perplexity, PerplexityOptions};
use crate::model::{Drafter, DrafterConfig, DrafterShape, TargetConfig, TargetModel};
use crate::runtime::TorchRuntime;

use super::generate::parse_kind;
use super::progress::Bars;

pub(super) struct InitDrafterArgs {
    pub target: PathBuf,
    pub out: PathBuf,
    pub layers: i64,
    pub block_size: i64,
    pub mask_token_id: i64,
    pub target_layer_ids: Option<Vec<usize>>,
    pub num_taps: usize,
    pub seed: i64,
    /// A dataset to check the mask token against.
    pub data: Option<PathBuf>,
}

pub(super) fn init_drafter(args: InitDrafterArgs) -> Result<()> {
    let target = TargetConfig::from_model_dir(&args.target)?;
    let shape = DrafterShape {
        layers: args.layers,
        block_size: args.block_size,
        mask_token_id: args.mask_token_id,
        target_layer_ids: args.target_layer_ids,
        num_taps: args.num_taps,
    };
    let config = DrafterConfig::for_target(&target, &shape).with_context(|| {
        format!(
            "cannot make a drafter for {}",
            args.target.join("config.json").display()
        )
    })?;
    if let Some(data) = &args.data {
        // Before anything is written: a drafter with this mask token would be refused by train.
        let path = resolve_split(data, None)?;
        let mask = u32::try_from(args.mask_token_id).context("--mask-token-id is negative")?;
        let scan = scan_tokens(
            &path,
            &DataColumns::default(),
            target.vocab_size as usize,
            mask,
        )?;
        scan.refuse_trained_mask_token("--mask-token-id", &args.target, |id| {
            format!("--mask-token-id {id}")
        })?;
        println!(
            "checked {}: {} rows, mask token {mask} not trained ({} times in the context)",
            path.display(),
            scan.rows,
            scan.counts[mask as usize]
        );
    }
    let drafter = Drafter::init(config, tch::Device::Cpu, tch::Kind::Float, args.seed as u64)?;
    let out = drafter.save(&args.out)?;
    println!("{}", drafter.describe());
    println!("wrote {} (seed {})", out.display(), args.seed);
    Ok(())
}

pub(super) struct PerplexityArgs {
    pub model: PathBuf,
    pub data: PathBuf,
    pub column: String,
    pub limit: Option<usize>,
    pub max_len: usize,
    pub batch_tokens: usize,
    pub device: String,
    pub dtype: String,
}

pub(super) fn run_perplexity(
    runtime: &TorchRuntime,
    args: PerplexityArgs,
    bars: &Bars,
) -> Result<()> {
    let device = runtime.device(&args.device)?;
    let kind = parse_kind(&args.dtype, device)?;
    let model = TargetModel::load(&args.model, device, kind)?;
    let data = read_token_column(&args.data, &args.column)?;
    let bar = bars.bar("perplexity", 0, "tokens");
    let report = perplexity(
        &model,
        &data,
        &PerplexityOptions {
            limit: args.limit,
            max_len: args.max_len,
            batch_tokens: args.batch_tokens.max(args.max_len),
            progress: Some(bar.clone()),
        },
    );
    bar.finish_and_clear();
    let report = report.with_context(|| format!("{}", args.data.display()))?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
