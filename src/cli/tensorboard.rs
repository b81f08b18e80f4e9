//! `export-tensorboard`: the TensorBoard event files of a run made before training wrote them,
//! from its metrics.jsonl.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::telemetry::tensorboard;
use crate::train::run_lock::RunLock;

#[derive(Debug, clap::Args)]
pub struct ExportTensorboardArgs {
    /// The run directory (it holds metrics.jsonl).
    pub run_dir: PathBuf,
}

pub(super) fn export(args: &ExportTensorboardArgs) -> Result<()> {
    let run_dir = args.run_dir.as_path();
    if !run_dir.join("metrics.jsonl").is_file() {
        bail!(
            "{}: no metrics.jsonl here; give the folder of a training run",
            run_dir.display()
        );
    }
    // A training run writes its event files as it goes; replacing them under it would lose
    // what it writes next.
    RunLock::check_free(run_dir)
        .context("export-tensorboard replaces the event files of a run that has ended")?;
    let done = tensorboard::export(run_dir)?;
    let replaced = match done.replaced {
        0 => String::new(),
        n => format!(" (in place of {n} earlier event file(s))"),
    };
    let cut = if done.cut_last_line {
        "; the last line of metrics.jsonl was cut short (the run was killed while writing it) and is left out"
    } else {
        ""
    };
    println!(
        "wrote {} scalars of {} records to {}{replaced}{cut}\nview them with: tensorboard --logdir {}",
        done.scalars,
        done.records,
        done.file.display(),
        run_dir.join(tensorboard::TENSORBOARD_DIR).display()
    );
    Ok(())
}
