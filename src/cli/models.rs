//! `init-drafter` and `perplexity`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::config::Dtype;
use crate::data::arrow_io::{read_token_column, resolve_split};
use crate::data::check::{scan_tokens, TokenScan};
use crate::data::store::DataColumns;
use crate::eval::perplexity::{perplexity, PerplexityOptions};
use crate::model::mask_token;
use crate::model::{Drafter, DrafterConfig, DrafterShape, TargetConfig, TargetModel};
use crate::runtime::{DeviceSpec, TorchRuntime};

use super::progress::Bars;

#[derive(Debug, clap::Args)]
pub struct InitDrafterArgs {
    /// The target's Hugging Face model folder.
    #[arg(long)]
    pub target: PathBuf,
    /// The drafter folder to create.
    #[arg(long)]
    pub out: PathBuf,
    /// Transformer layers of the drafter.
    #[arg(long, default_value_t = 5)]
    pub layers: i64,
    /// Tokens per drafted block (the token after the last accepted one + block_size - 1
    /// drafts).
    #[arg(long, default_value_t = 16)]
    pub block_size: i64,
    /// Token id fed in the masked block slots; its embedding row stays frozen. Pick a
    /// token that never occurs in the data (SmolLM2: 16, `<empty_output>`; Qwen3: 151669).
    /// Left out: one is chosen from the target's tokenizer (and --data), and said why.
    #[arg(long)]
    pub mask_token_id: Option<i64>,
    /// Tapped target layers, comma separated (default: the DFlash formula).
    #[arg(long, value_delimiter = ',')]
    pub target_layer_ids: Option<Vec<usize>>,
    /// Number of tapped layers when --target-layer-ids is not given.
    #[arg(long, default_value_t = 5)]
    pub num_taps: usize,
    /// Seed of the random initialisation (the same seed gives the same weights).
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// A prepared dataset (prepare-data output; its train split) to check the mask token
    /// against: refused when the loss trains on it there (loss_mask 1).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Sliding-window attention of N positions in every layer but those of
    /// --full-attention-layers (the layer_types / sliding_window of Qwen3.6-27B's drafter:
    /// --sliding-window 2048 with 5 layers, the last full). A sliding layer's block slot at
    /// position p sees the keys at positions p - N < k <= p (its block causally). Left out:
    /// every layer full.
    #[arg(long, value_name = "N")]
    pub sliding_window: Option<i64>,
    /// With --sliding-window: the layers (0-based, comma separated) that keep full
    /// attention [default: the last one].
    #[arg(long, value_delimiter = ',', requires = "sliding_window")]
    pub full_attention_layers: Option<Vec<usize>>,
}

pub(super) fn init_drafter(args: InitDrafterArgs) -> Result<()> {
    let target = TargetConfig::from_model_dir(&args.target)?;
    // Before anything is written: a drafter with a trained mask token would be refused by train.
    let scan = match &args.data {
        Some(data) => {
            let path = resolve_split(data, None)?;
            let provisional = args.mask_token_id.unwrap_or(0);
            let mask = u32::try_from(provisional).context("--mask-token-id is negative")?;
            let vocab = target.vocab_size as usize;
            Some(scan_tokens(&path, &DataColumns::default(), vocab, mask)?)
        }
        None => None,
    };
    let mask = match args.mask_token_id {
        Some(id) => id,
        None => choose_mask_token(&args.target, &target, scan.as_ref())?,
    };
    if let Some(scan) = &scan {
        if args.mask_token_id.is_some() {
            scan.refuse_trained_mask_token("--mask-token-id", &args.target, |id| {
                format!("--mask-token-id {id}")
            })?;
        }
        println!(
            "checked {}: {} rows, mask token {mask} not trained ({} times in the context)",
            scan.path.display(),
            scan.rows,
            scan.counts.get(mask as usize).copied().unwrap_or(0)
        );
    }
    let shape = DrafterShape {
        layers: args.layers,
        block_size: args.block_size,
        mask_token_id: mask,
        target_layer_ids: args.target_layer_ids,
        num_taps: args.num_taps,
    };
    let config = DrafterConfig::for_target(&target, &shape).with_context(|| {
        format!(
            "cannot make a drafter for {}",
            args.target.join("config.json").display()
        )
    })?;
    let config = match args.sliding_window {
        Some(window) => {
            let last = (args.layers.max(1) - 1) as usize;
            let full = args.full_attention_layers.unwrap_or_else(|| vec![last]);
            config
                .with_sliding_window(window, &full)
                .context("--sliding-window / --full-attention-layers")?
        }
        None => config,
    };
    let drafter = Drafter::init(config, tch::Device::Cpu, tch::Kind::Float, args.seed as u64)?;
    let out = drafter.save(&args.out)?;
    println!("{}", drafter.describe());
    println!("wrote {} (seed {})", out.display(), args.seed);
    Ok(())
}

/// A mask token for a drafter made without `--mask-token-id`: suggested from the target's
/// tokenizer and, where given, the ids of the data ([`mask_token::suggest`]); printed with its
/// text and the reason.
fn choose_mask_token(dir: &Path, target: &TargetConfig, scan: Option<&TokenScan>) -> Result<i64> {
    let rows = target.vocab_size as usize;
    let tokenizer_path = dir.join("tokenizer.json");
    let vocab = match tokenizers::Tokenizer::from_file(&tokenizer_path) {
        Ok(tok) => mask_token::Vocab::of(rows, &tok),
        Err(_) if scan.is_some() => mask_token::Vocab {
            model_rows: rows,
            tokenizer_len: rows,
            specials: Vec::new(),
        },
        Err(e) => bail!(
            "{}: cannot read ({e}); without --mask-token-id the mask token is chosen from the tokenizer: give --mask-token-id ID or --data DIR",
            tokenizer_path.display()
        ),
    };
    let seen = scan.map(|s| move |id: u32| s.counts.get(id as usize) != Some(&0));
    let seen_ref = seen.as_ref().map(|f| f as &dyn Fn(u32) -> bool);
    let Some(choice) = mask_token::suggest(&vocab, seen_ref) else {
        bail!(
            "no mask token to suggest for {}: no spare embedding row or untrained-looking special token{}; give --mask-token-id ID",
            dir.display(),
            if scan.is_some() { ", and every id occurs in the data" } else { " (--data DIR would let any token the data never holds be chosen)" }
        );
    };
    println!("mask token {choice}");
    Ok(choice.id as i64)
}

#[derive(Debug, clap::Args)]
pub struct PerplexityArgs {
    /// Hugging Face model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// The tokenised dataset: a folder, split folder, Arrow or Parquet file.
    #[arg(long)]
    pub data: PathBuf,
    /// The token column.
    #[arg(long, default_value = "input_ids")]
    pub column: String,
    /// Use at most this many sequences.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Cut sequences to this many tokens.
    #[arg(long, default_value_t = 1024)]
    pub max_len: usize,
    /// Padded tokens per forward batch.
    #[arg(long, default_value_t = 8192)]
    pub batch_tokens: usize,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value_t = DeviceSpec::Auto)]
    pub device: DeviceSpec,
    /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
}

pub(super) fn run_perplexity(
    runtime: &TorchRuntime,
    args: PerplexityArgs,
    bars: &Bars,
) -> Result<()> {
    let device = runtime.resolve(args.device)?;
    let kind = args.dtype.kind(device);
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
