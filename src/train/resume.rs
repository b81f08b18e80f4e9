//! The checkpoint a resume starts from: the newest one that verifies (its manifest, its
//! trainer state against its folder, the schedule and the data, its optimizer state parsed and
//! finite), older ones tried in turn where a newer one fails, each failure logged with its
//! reason. The servable `drafter/` of the chosen one is checked too, and rewritten from the
//! master weights where it is damaged or missing ([`rewrite_servable`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use crate::data::packer::{Packer, PackerConfig};
use crate::data::store::TokenStore;
use crate::model::Drafter;

use super::checkpoint::{
    checkpoints_dir, list_checkpoints, newest_checkpoint, read_state, replace_dir, step_name,
    TrainerState,
};
use super::manifest::{self, ManifestCheck, Mismatch};
use super::optim::AdamW;

/// The data a trainer state must fit: its positions index this store's epochs.
pub(crate) struct DataBounds<'a> {
    pub store: &'a Arc<TokenStore>,
    pub packer: &'a PackerConfig,
}

/// The checkpoint chosen, its optimizer state loaded.
#[derive(Debug)]
pub(crate) struct ResumePoint {
    pub checkpoint: PathBuf,
    pub state: TrainerState,
    /// Why the servable `drafter/` must be rewritten from the master weights (None: it is
    /// sound).
    pub damaged_drafter: Option<String>,
    /// Newer checkpoints that failed their verification (logged).
    pub newer_failed: usize,
}

/// The newest checkpoint of `run_dir` that verifies, with its optimizer state loaded into
/// `optimizer`; newer ones that fail are logged (warn) with their reason. None verifying is an
/// error listing each checkpoint and its failure.
pub(crate) fn choose(
    run_dir: &Path,
    optimizer: &mut AdamW,
    data: &DataBounds,
) -> Result<ResumePoint> {
    if list_checkpoints(&checkpoints_dir(run_dir)).is_empty() {
        // no complete step folder: the error names what is missing
        newest_checkpoint(run_dir)?;
        bail!("{}: no checkpoint to resume from", run_dir.display());
    }
    let candidates = step_folders(&checkpoints_dir(run_dir));
    let mut failed: Vec<String> = Vec::new();
    for (step, ckpt) in candidates.into_iter().rev() {
        match verify(step, &ckpt, optimizer, data) {
            Ok(resumed) => {
                return Ok(ResumePoint {
                    newer_failed: failed.len(),
                    ..resumed
                })
            }
            Err(e) => {
                log::warn!(
                    "checkpoint {} fails its verification, not resumed from: {e:#}",
                    ckpt.display()
                );
                failed.push(format!("{}: {e:#}", step_name(step)));
            }
        }
    }
    bail!(
        "{}: no checkpoint verifies, nothing to resume from (each is kept as it is):\n  {}",
        run_dir.display(),
        failed.join("\n  ")
    )
}

/// Every `step-N` folder, oldest first: complete ones, and ones whose trainer state is gone
/// (named as failures, where [`list_checkpoints`] passes over them in silence).
fn step_folders(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// One checkpoint's verification; the optimizer state is loaded last, so that a failure
/// leaves `optimizer` as it was.
fn verify(step: u64, ckpt: &Path, optimizer: &mut AdamW, data: &DataBounds) -> Result<ResumePoint> {
    let manifest = manifest::verify(ckpt)?;
    let drafter_mismatches = match &manifest {
        ManifestCheck::Checked { mismatches, .. } => {
            let (drafter, rest): (Vec<&Mismatch>, Vec<&Mismatch>) = mismatches
                .iter()
                .partition(|m| m.path.starts_with("drafter/"));
            if !rest.is_empty() {
                bail!("{}", listed(ckpt, &rest));
            }
            drafter
        }
        ManifestCheck::Absent => {
            log::warn!(
                "{}: no {} (written before checkpoints had one): its files are checked by parsing them and for finite values only",
                ckpt.display(),
                manifest::MANIFEST
            );
            Vec::new()
        }
    };
    let state = read_state(ckpt)?;
    check_state(step, ckpt, &state, data)?;
    optimizer.load(&ckpt.join("optimizer.safetensors"), state.step)?;
    let damaged_drafter = match manifest {
        ManifestCheck::Checked { .. } if drafter_mismatches.is_empty() => None,
        ManifestCheck::Checked { .. } => Some(listed(ckpt, &drafter_mismatches)),
        ManifestCheck::Absent => servable_matches(ckpt, optimizer)
            .err()
            .map(|e| format!("{e:#}")),
    };
    Ok(ResumePoint {
        checkpoint: ckpt.to_path_buf(),
        state,
        damaged_drafter,
        newer_failed: 0,
    })
}

fn listed(ckpt: &Path, mismatches: &[&Mismatch]) -> String {
    mismatches
        .iter()
        .map(|m| format!("{}: {}", ckpt.join(&m.path).display(), m.what))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The trainer state against its folder's step, its own schedule, the run's seed and the
/// data: each disagreement refused naming the field.
pub(crate) fn check_state(
    folder_step: u64,
    ckpt: &Path,
    state: &TrainerState,
    data: &DataBounds,
) -> Result<()> {
    let path = ckpt.join("trainer_state.json");
    let field = |what: String| anyhow::anyhow!("{}: field {what}", path.display());
    if state.step != folder_step {
        return Err(field(format!(
            "step = {} does not match its folder {}",
            state.step,
            step_name(folder_step)
        )));
    }
    if state.step > state.total_steps {
        return Err(field(format!(
            "step = {} is past field total_steps = {}",
            state.step, state.total_steps
        )));
    }
    if state.seed != data.packer.seed {
        return Err(field(format!(
            "seed = {} but the run's seed (run.seed) is {}: the data order it continues is another",
            state.seed, data.packer.seed
        )));
    }
    let at = state.packer.window_start;
    if state.epoch != at.epoch {
        return Err(field(format!(
            "epoch = {} does not match packer.window_start.epoch = {}",
            state.epoch, at.epoch
        )));
    }
    let samples = data.store.len() as u64;
    if at.position as u64 >= samples {
        return Err(field(format!(
            "packer.window_start.position = {} is past the data: an epoch holds {samples} samples",
            at.position
        )));
    }
    // Each finished epoch visited every sample once.
    if state.epoch.saturating_mul(samples) > state.samples_seen {
        return Err(field(format!(
            "epoch = {} needs {} samples seen ({samples} an epoch) but field samples_seen = {}",
            state.epoch,
            state.epoch.saturating_mul(samples),
            state.samples_seen
        )));
    }
    Packer::resume(data.store.clone(), data.packer.clone(), state.packer)
        .map_err(|e| field(format!("{e:#}")))?;
    Ok(())
}

/// Whether `ckpt/drafter/` loads and holds the master weights in bf16 (as every checkpoint
/// writes it), for checkpoints without a manifest.
fn servable_matches(ckpt: &Path, optimizer: &AdamW) -> Result<()> {
    let dir = ckpt.join("drafter");
    let drafter = Drafter::load(&dir, Device::Cpu, Kind::BFloat16)?;
    let saved = drafter.named_parameters();
    let master = optimizer.master_weights();
    if saved.len() != master.len() {
        bail!(
            "{}: {} tensors, the optimizer state holds {}",
            dir.display(),
            saved.len(),
            master.len()
        );
    }
    for ((name, w), (master_name, m)) in saved.iter().zip(&master) {
        let expected = m.to_device(Device::Cpu).to_kind(Kind::BFloat16);
        if name != master_name || w.size() != expected.size() || !w.equal(&expected) {
            bail!(
                "{}: tensor {name:?} differs from the master weights in bf16",
                dir.join("model.safetensors").display()
            );
        }
    }
    Ok(())
}

/// Rewrites `ckpt/drafter/` from `drafter` (holding the master weights), swapped in by
/// renames, and the checkpoint's manifest where it has one.
pub(crate) fn rewrite_servable(ckpt: &Path, drafter: &Drafter) -> Result<()> {
    let fresh = ckpt.join(format!(".drafter.new-{}", std::process::id()));
    if fresh.exists() {
        std::fs::remove_dir_all(&fresh)
            .with_context(|| format!("{}: cannot remove", fresh.display()))?;
    }
    drafter.save(&fresh)?;
    replace_dir(&fresh, &ckpt.join("drafter"))?;
    if manifest::read(ckpt)?.is_some() {
        manifest::write(ckpt)?;
    }
    Ok(())
}
