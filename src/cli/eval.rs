//! `eval`: acceptance length of a drafter by real greedy speculative decoding against its
//! target, the speed-up over plain greedy decoding, and a losslessness check.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::data::arrow_io::{read_token_data, resolve_split};
use crate::eval::speculative::evaluate;
use crate::model::{Drafter, FrozenHead, TargetModel};
use crate::runtime::TorchRuntime;
use crate::text::{Message, TextTokenizer};

use super::generate::parse_kind;

pub struct EvalArgs {
    pub target: PathBuf,
    pub drafter: PathBuf,
    pub data: Option<PathBuf>,
    pub prompts: Option<PathBuf>,
    pub limit: usize,
    pub max_new_tokens: usize,
    pub device: String,
    pub json: bool,
}

/// Prompts from a JSONL file: `{"messages": [...]}` (chat template + generation prompt) or
/// `{"prompt_ids": [...]}`.
fn prompts_from_file(path: &Path, target_dir: &Path, limit: usize) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let mut tokenizer: Option<TextTokenizer> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || out.len() >= limit {
            continue;
        }
        let where_ = || format!("{}: line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(where_)?;
        if let Some(ids) = v.get("prompt_ids") {
            let ids: Vec<u32> = serde_json::from_value(ids.clone())
                .with_context(|| format!("{}: prompt_ids must be a list of token ids", where_()))?;
            out.push(ids);
        } else if let Some(m) = v.get("messages") {
            let messages: Vec<Message> = serde_json::from_value(m.clone()).with_context(|| {
                format!("{}: messages must be a list of {{role, content}}", where_())
            })?;
            if tokenizer.is_none() {
                tokenizer = Some(TextTokenizer::from_model_dir(target_dir)?);
            }
            let tok = tokenizer.as_ref().context("no tokenizer")?;
            out.push(
                tok.apply_chat_template(&messages, true)
                    .with_context(where_)?,
            );
        } else {
            bail!("{}: needs \"messages\" or \"prompt_ids\"", where_());
        }
    }
    Ok(out)
}

/// Prompts from a tokenised dataset: each sample up to its first trained (assistant) token.
fn prompts_from_data(path: &Path, limit: usize) -> Result<Vec<Vec<u32>>> {
    let split = if path.join("dataset_dict.json").is_file() {
        resolve_split(path, Some("validation"))?
    } else {
        path.to_path_buf()
    };
    let data = read_token_data(&split, "input_ids", Some("loss_mask"))?;
    let masks = data.masks.as_ref().context("no loss_mask column")?;
    let mut out = Vec::new();
    for i in 0..data.ids.len() {
        if out.len() >= limit {
            break;
        }
        let (s, e) = (data.ids.offsets[i], data.ids.offsets[i + 1]);
        if let Some(first) = masks[s..e].iter().position(|&m| m == 1) {
            if first > 0 {
                out.push(data.ids.get(i)[..first].to_vec());
            }
        }
    }
    Ok(out)
}

pub fn run(runtime: &TorchRuntime, args: EvalArgs) -> Result<()> {
    let device = runtime.device(&args.device)?;
    let kind = parse_kind("auto", device)?;
    let target = TargetModel::load(&args.target, device, kind)?;
    let drafter = Drafter::load_for_target(&args.drafter, &target.config, device, kind)?;
    let head = FrozenHead::from_target(&target, device, kind);
    let prompts = match (&args.prompts, &args.data) {
        (Some(p), _) => prompts_from_file(p, &args.target, args.limit)?,
        (None, Some(d)) => prompts_from_data(d, args.limit)?,
        (None, None) => bail!("eval needs --data PATH or --prompts FILE"),
    };
    if prompts.is_empty() {
        bail!("no prompts to evaluate");
    }
    let mut eos = target.config.eos_ids();
    if let Ok(tok) = TextTokenizer::from_model_dir(&args.target) {
        if let Some(id) = tok.eos_token.as_deref().and_then(|t| tok.token_to_id(t)) {
            eos.push(id);
        }
    }
    let report = evaluate(
        &target,
        &drafter,
        &head,
        &prompts,
        args.max_new_tokens,
        &eos,
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "tau {:.3} over {} prompts; speed-up {:.2}x (greedy {:.2} ms/token, DFlash {:.2} ms/token, prefill excluded); {} mismatches with plain greedy decoding",
        report.tau,
        report.prompts.len(),
        report.speedup,
        report.greedy_s_per_token * 1e3,
        report.dflash_s_per_token * 1e3,
        report.mismatches
    );
    let steps = report.accepted_by_slot.first().copied().unwrap_or(0).max(1);
    let slots: Vec<String> = report.accepted_by_slot[1..]
        .iter()
        .enumerate()
        .map(|(k, &n)| format!("{}:{:.0}%", k + 1, 100.0 * n as f64 / steps as f64))
        .collect();
    println!("accepted by slot: {}", slots.join(" "));
    for (i, p) in report.prompts.iter().enumerate() {
        println!(
            "prompt {i}: tau {:.2}, {} tokens, accept lengths {:?}{}",
            p.tau,
            p.output_ids.len(),
            p.accept_lengths,
            match p.first_mismatch {
                Some(at) => format!(", DIFFERS from greedy at token {at}"),
                None => String::new(),
            }
        );
    }
    Ok(())
}
