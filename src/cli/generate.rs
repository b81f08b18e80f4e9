//! `generate`: a greedy answer from a model, through its chat template.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::config::Dtype;
use crate::model::generate::greedy_generate;
use crate::model::TargetModel;
use crate::paths::Locations;
use crate::runtime::{DeviceSpec, TorchRuntime};
use crate::text::{Message, TextTokenizer};

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Hugging Face model folder (default: the demo model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The user message.
    #[arg(long)]
    pub prompt: String,
    /// A system message (otherwise the template's default, if any).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens generated after the prompt (fewer when the model ends its answer).
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value_t = DeviceSpec::Auto)]
    pub device: DeviceSpec,
    /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
    /// Use the prompt text as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
}

pub(super) fn run(runtime: &TorchRuntime, args: GenerateArgs) -> Result<()> {
    crate::config::flag_between(
        "--max-new-tokens",
        args.max_new_tokens,
        1,
        crate::config::MAX_NEW_TOKENS,
    )?;
    let model_dir = args
        .model
        .unwrap_or_else(|| Locations::from_env().demo_model());
    let device = runtime.resolve(args.device)?;
    let kind = args.dtype.kind(device);
    let started = std::time::Instant::now();
    let model = TargetModel::load(&model_dir, device, kind)?;
    let tokenizer = TextTokenizer::from_model_dir(&model_dir)?;
    log::info!(
        "loaded {} ({:.1} M parameters, {} layers) on {:?} as {:?} in {:.2} s",
        model_dir.display(),
        model.parameter_count() as f64 / 1e6,
        model.num_layers(),
        device,
        kind,
        started.elapsed().as_secs_f64()
    );
    let prompt_ids = if args.raw {
        tokenizer.encode(&args.prompt)?
    } else {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(Message::new("system", system));
        }
        messages.push(Message::new("user", &args.prompt));
        tokenizer
            .apply_chat_template(&messages, true)
            .with_context(|| format!("{}: cannot build the prompt", model_dir.display()))?
    };
    let eos = crate::model::model_eos_ids(&model_dir, &model.config)?;
    let started = std::time::Instant::now();
    let output = greedy_generate(&model, &prompt_ids, args.max_new_tokens, &eos);
    let seconds = started.elapsed().as_secs_f64();
    println!("{}", tokenizer.decode_skip_special(&output)?.trim());
    log::info!(
        "{} prompt tokens, {} new tokens in {:.2} s ({:.1} tokens/s)",
        prompt_ids.len(),
        output.len(),
        seconds,
        output.len() as f64 / seconds.max(1e-9)
    );
    Ok(())
}
