//! Checkpoints of a run (control-room spec §6):
//!
//! ```text
//! RUN_DIR/checkpoints/step-000100/   drafter/ (servable HF dir), optimizer.safetensors, trainer_state.json,
//!                                    manifest.json (size and checksum of each file, written last)
//! RUN_DIR/checkpoints/latest         -> the newest complete checkpoint
//! ```
//! A checkpoint is written into a temporary folder and renamed when complete (a step folder that
//! exists already is set aside first and removed after: it is replaced, never kept in place of the
//! new weights); `latest` (a relative symbolic link) is replaced atomically after that, and only
//! then are old checkpoints beyond `keep` removed. A failure at any point leaves the previous
//! checkpoint and `latest` as they were. A step folder is complete once it exists under its
//! name (the rename is the last write), so a resume takes the newest one even where a kill left
//! `latest` behind it, and repairs `latest`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::config::FailMode;
use crate::data::packer::PackerState;
use crate::fsutil::{remove_stale_staging, StagedDir};
use crate::model::Drafter;

use super::optim::AdamW;

/// Everything besides weights and moments that a resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: u64,
    pub epoch: u64,
    /// Where the data stream continues.
    pub packer: PackerState,
    pub total_steps: u64,
    pub tokens_seen: u64,
    pub samples_seen: u64,
    pub seed: u64,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Last step's loss, for the record.
    pub loss: f64,
    pub elapsed_s: f64,
    pub saved_at_unix: u64,
    /// Validation passes since the one with the best walk tau (for `validation.patience`).
    #[serde(default)]
    pub validations_since_best: u64,
}

pub(crate) fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

pub(crate) fn step_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Injected failure points (tests of failure handling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CheckpointFault {
    None,
    /// Fail with "no space left on device" after the drafter was written.
    DiskFullAfterDrafter,
    /// Stop writing at this point, for good (the test kills the process there).
    Hold(HoldPoint),
}

/// Where [`CheckpointFault::Hold`] stops a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldPoint {
    /// The drafter written into the staging folder, nothing else.
    DrafterWritten,
    /// Drafter and optimizer state written, the trainer state not yet.
    OptimizerWritten,
    /// The step folder in place, `latest` not yet pointed at it.
    Renamed,
}

impl HoldPoint {
    /// Where the `debug.fail_mode` `mode` holds the writer (None: it does not).
    pub(crate) fn from_mode(mode: FailMode) -> Option<HoldPoint> {
        match mode {
            FailMode::HoldDrafter => Some(HoldPoint::DrafterWritten),
            FailMode::HoldOptimizer => Some(HoldPoint::OptimizerWritten),
            FailMode::HoldRename => Some(HoldPoint::Renamed),
            FailMode::Error | FailMode::Panic => None,
        }
    }
}

/// Blocks the checkpoint writer for good at `point` when `fault` asks for it (fault tests kill
/// the process there, to leave exactly what a crash at that point leaves).
fn hold_if(fault: CheckpointFault, point: HoldPoint, step: u64) {
    if fault != CheckpointFault::Hold(point) {
        return;
    }
    log::warn!("checkpoint of step {step} held {point:?} (debug.fail_mode): waiting to be killed");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

/// Writes a checkpoint for `state.step`, then points `latest` at it and prunes old ones.
pub(crate) fn save_checkpoint(
    run_dir: &Path,
    drafter: &Drafter,
    optimizer: &AdamW,
    state: &TrainerState,
    keep: usize,
    fault: CheckpointFault,
) -> Result<PathBuf> {
    let dir = checkpoints_dir(run_dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let dest = dir.join(step_name(state.step));
    // Written beside, under a name of its own: a step folder that exists (another run's, or
    // this step saved again) is replaced only once the new one is complete.
    let fresh = dir.join(format!(
        ".{}.new-{}",
        step_name(state.step),
        std::process::id()
    ));
    let staged = StagedDir::create(&fresh)?;
    drafter.save(&staged.path().join("drafter"))?;
    hold_if(fault, HoldPoint::DrafterWritten, state.step);
    if fault == CheckpointFault::DiskFullAfterDrafter {
        bail!(
            "{}: cannot write optimizer.safetensors: No space left on device (os error 28, injected by debug.fail_stage = \"checkpoint\")",
            staged.path().display()
        );
    }
    optimizer.save(&staged.path().join("optimizer.safetensors"))?;
    hold_if(fault, HoldPoint::OptimizerWritten, state.step);
    let text = serde_json::to_string_pretty(state)?;
    std::fs::write(staged.path().join("trainer_state.json"), text).with_context(|| {
        format!(
            "{}: cannot write trainer_state.json",
            staged.path().display()
        )
    })?;
    super::manifest::write(staged.path())?;
    let fresh = staged.commit()?;
    replace_dir(&fresh, &dest)?;
    hold_if(fault, HoldPoint::Renamed, state.step);
    point_latest(&dir, &step_name(state.step))?;
    prune(&dir, keep)?;
    Ok(dest)
}

/// Moves the complete folder `fresh` to `dest`: an existing `dest` is renamed aside first and
/// removed after, so that at every moment `dest` is either the old folder or the new one.
pub(crate) fn replace_dir(fresh: &Path, dest: &Path) -> Result<()> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    let had_old = dest.exists();
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dest, &old)
            .with_context(|| format!("{}: cannot set aside to replace it", dest.display()))?;
    }
    if let Err(e) = std::fs::rename(fresh, dest) {
        if had_old {
            // put the old one back: nothing is lost
            let _ = std::fs::rename(&old, dest);
        }
        return Err(e)
            .with_context(|| format!("cannot move {} to {}", fresh.display(), dest.display()));
    }
    if had_old && std::fs::remove_dir_all(&old).is_err() {
        let _ = std::fs::remove_file(&old);
    }
    Ok(())
}

/// Leftovers of writers that died (killed during a checkpoint, a save of `best/` or the
/// rewrite of a checkpoint's `drafter/`): staging folders `.NAME.partial-PID`, `.NAME.new-PID`
/// and `.NAME.old-PID`, and `.latest.tmp-PID` links, in the run directory, its `checkpoints/`
/// and each step folder, whose process is gone (or is this one, which has written nothing yet:
/// a reused PID). Returns what was removed.
pub(crate) fn remove_stale_partials(run_dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let steps = list_checkpoints(&checkpoints_dir(run_dir))
        .into_iter()
        .map(|(_, p)| p);
    let dirs = [run_dir.to_path_buf(), checkpoints_dir(run_dir)];
    for dir in dirs.into_iter().chain(steps) {
        removed.extend(remove_stale_staging(&dir, |_| true));
    }
    removed
}

/// How `RUN_DIR/best/` is chosen: the drafter with the highest tau of one kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum BestRule {
    /// The periodic evaluation's tau by real speculative decoding (`[eval]`, without
    /// validation); files written before the rule was recorded.
    #[default]
    EvalDecodedTau,
    /// The validation pass's walk tau (`[validation]` on).
    ValidationWalkTau,
}

/// What `RUN_DIR/best/eval.json` records about the best drafter so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct BestEval {
    pub step: u64,
    pub tau: f64,
    /// What `tau` is, and so the rule that chose this drafter.
    #[serde(default)]
    pub rule: BestRule,
    /// Prompts decoded (eval).
    pub prompts: usize,
    /// Held-out sequences measured (validation).
    #[serde(default)]
    pub sequences: usize,
    pub max_new_tokens: usize,
}

pub(crate) fn best_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("best")
}

/// Saves `drafter` as the best one so far: `RUN_DIR/best/drafter/` (servable) and
/// `RUN_DIR/best/eval.json`, written beside and swapped in by renames, so that a failure keeps
/// the previous best.
pub(crate) fn save_best(run_dir: &Path, drafter: &Drafter, best: &BestEval) -> Result<PathBuf> {
    let dest = best_dir(run_dir);
    let fresh = run_dir.join(format!(".best.new-{}", std::process::id()));
    let staged = StagedDir::create(&fresh)?;
    drafter.save(&staged.path().join("drafter"))?;
    std::fs::write(
        staged.path().join("eval.json"),
        serde_json::to_string_pretty(best)?,
    )
    .with_context(|| format!("{}: cannot write eval.json", staged.path().display()))?;
    let fresh = staged.commit()?;
    let old = run_dir.join(format!(".best.old-{}", std::process::id()));
    if dest.exists() {
        std::fs::rename(&dest, &old)
            .with_context(|| format!("{}: cannot replace", dest.display()))?;
    }
    std::fs::rename(&fresh, &dest).with_context(|| format!("{}: cannot write", dest.display()))?;
    if old.exists() {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(dest)
}

/// The best evaluation recorded in a run directory, if any.
pub(crate) fn read_best(run_dir: &Path) -> Option<BestEval> {
    let text = std::fs::read_to_string(best_dir(run_dir).join("eval.json")).ok()?;
    serde_json::from_str(&text).ok()
}

fn point_latest(dir: &Path, name: &str) -> Result<()> {
    let tmp = dir.join(format!(".latest.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(name, &tmp)
        .with_context(|| format!("{}: cannot create link", tmp.display()))?;
    std::fs::rename(&tmp, dir.join("latest"))
        .with_context(|| format!("{}: cannot update latest", dir.display()))
}

/// Complete checkpoints, oldest first.
pub fn list_checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            let path = e.path();
            path.join("trainer_state.json")
                .is_file()
                .then_some((step, path))
        })
        .collect();
    out.sort();
    out
}

fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = list_checkpoints(dir);
    let latest = std::fs::read_link(dir.join("latest")).ok();
    for (_, path) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        if latest.as_deref() == path.file_name().map(Path::new) {
            continue;
        }
        std::fs::remove_dir_all(path)
            .with_context(|| format!("{}: cannot remove", path.display()))?;
    }
    Ok(())
}

/// The checkpoint to resume from: the newest complete one, even where `latest` lags behind it
/// (a kill between the rename of a checkpoint and the update of `latest`). Reads only; see
/// [`repair_latest`].
pub fn newest_checkpoint(run_dir: &Path) -> Result<PathBuf> {
    match list_checkpoints(&checkpoints_dir(run_dir)).pop() {
        Some((_, newest)) => Ok(newest),
        None => latest_checkpoint(run_dir),
    }
}

/// Points `latest` at `checkpoint` when it points elsewhere; true when it was repaired.
pub(crate) fn repair_latest(run_dir: &Path, checkpoint: &Path) -> Result<bool> {
    let dir = checkpoints_dir(run_dir);
    let Some(name) = checkpoint.file_name() else {
        return Ok(false);
    };
    if std::fs::read_link(dir.join("latest")).ok().as_deref() == Some(Path::new(name)) {
        return Ok(false);
    }
    point_latest(&dir, &name.to_string_lossy())?;
    Ok(true)
}

/// The checkpoint `latest` points to.
pub fn latest_checkpoint(run_dir: &Path) -> Result<PathBuf> {
    let dir = checkpoints_dir(run_dir);
    let link = dir.join("latest");
    let target = std::fs::read_link(&link).with_context(|| {
        format!(
            "{}: no checkpoint to resume from (no checkpoints/latest)",
            run_dir.display()
        )
    })?;
    let path = dir.join(target);
    if !path.join("trainer_state.json").is_file() {
        bail!(
            "{}: the latest checkpoint {} is incomplete",
            run_dir.display(),
            path.display()
        );
    }
    Ok(path)
}

pub fn read_state(checkpoint: &Path) -> Result<TrainerState> {
    let path = checkpoint.join("trainer_state.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not a trainer state", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_leftovers_of_dead_writers_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        std::fs::create_dir_all(run.join("checkpoints")).unwrap();
        // a PID that cannot exist (above the kernel's limit) and this process's own
        let dead = run.join("checkpoints/.step-000002.new-4194303");
        let mine = run.join(format!(".best.new-{}", std::process::id()));
        // a live writer: PID 1 always exists
        let live = run.join("checkpoints/.step-000003.new-1");
        for d in [&dead, &mine, &live] {
            std::fs::create_dir_all(d).unwrap();
        }
        let removed = remove_stale_partials(run);
        assert_eq!(removed.len(), 2, "{removed:?}");
        assert!(!dead.exists() && !mine.exists() && live.exists());
    }
}
