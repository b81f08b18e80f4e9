//! `import-gguf` and `import-sharegpt`.

use std::path::PathBuf;

use anyhow::Result;

use crate::data::sharegpt;
use crate::gguf::{self, OutputDtype};

#[derive(Debug, clap::Args)]
pub struct ImportGgufArgs {
    /// The .gguf file.
    pub file: PathBuf,
    /// The model folder to create (must not exist yet, or be empty).
    pub out_dir: PathBuf,
    /// Element type of the written weights.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: OutputDtype,
}

pub(super) fn import_gguf(args: &ImportGgufArgs) -> Result<()> {
    let ImportGgufArgs {
        file,
        out_dir,
        dtype,
    } = args;
    let started = std::time::Instant::now();
    let summary = gguf::import_gguf(file, out_dir, *dtype)?;
    let hp = &summary.hparams;
    let types: Vec<String> = summary
        .source_types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    println!(
        "imported {} -> {}\n  {} tensors ({}), {:.1} M parameters, written as {:?}\n  llama: {} layers, hidden {}, {} heads ({} KV), head_dim {}, vocab {}, tied embeddings: {}\n  took {:.1} s",
        file.display(),
        summary.out_dir.display(),
        summary.tensors,
        types.join(", "),
        summary.parameters as f64 / 1e6,
        dtype,
        hp.layers,
        hp.hidden,
        hp.heads,
        hp.kv_heads,
        hp.head_dim,
        summary.vocab_size,
        hp.tied_embeddings,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct ImportSharegptArgs {
    /// The ShareGPT .json file (a JSON array of {"id", "conversations"} records).
    pub file: PathBuf,
    /// The .jsonl file to write.
    pub out: PathBuf,
}

pub(super) fn import_sharegpt(args: &ImportSharegptArgs) -> Result<()> {
    let ImportSharegptArgs { file, out } = args;
    let (conversations, report) = sharegpt::read_conversations(file)?;
    sharegpt::write_jsonl(&conversations, out)?;
    println!(
        "recovered {} conversations from {} -> {}",
        conversations.len(),
        file.display(),
        out.display()
    );
    if let Some(at) = report.truncated_at {
        println!("  the input is cut off at byte {at}: the incomplete last record was dropped");
    }
    if report.skipped_count > 0 {
        println!(
            "  skipped {} records that are not ShareGPT conversations, e.g.:",
            report.skipped_count
        );
        for (index, reason) in &report.skipped {
            println!("    record {index}: {reason}");
        }
    }
    Ok(())
}
