//! File-system helpers: output files and directories that appear whole or not at all.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// A directory written under a temporary name beside its destination and renamed into place by
/// [`StagedDir::commit`]. Dropped without commit, it removes itself, so a failed command leaves
/// no half-written output behind.
#[derive(Debug)]
pub(crate) struct StagedDir {
    staging: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// Prepares `dest`. Refuses a destination that exists and is not an empty directory, so that
    /// nothing already saved is overwritten.
    pub(crate) fn create(dest: &Path) -> Result<Self> {
        if dest.exists() {
            let empty = dest.is_dir()
                && std::fs::read_dir(dest)
                    .with_context(|| format!("{}: cannot read", dest.display()))?
                    .next()
                    .is_none();
            if !empty {
                bail!(
                    "{}: already exists; choose another output folder or remove it first",
                    dest.display()
                );
            }
        }
        let name = dest
            .file_name()
            .with_context(|| format!("{}: not a usable folder name", dest.display()))?
            .to_string_lossy()
            .into_owned();
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)
            .with_context(|| format!("{}: cannot create the output folder", parent.display()))?;
        let staging = parent.join(format!(".{name}.partial-{}", std::process::id()));
        if staging.exists() {
            std::fs::remove_dir_all(&staging).with_context(|| {
                format!(
                    "{}: cannot remove a stale staging folder",
                    staging.display()
                )
            })?;
        }
        std::fs::create_dir(&staging).with_context(|| {
            format!(
                "{}: cannot write into this folder (creating {})",
                parent.display(),
                staging.display()
            )
        })?;
        Ok(StagedDir {
            staging,
            dest: dest.to_path_buf(),
            committed: false,
        })
    }

    /// Where files go until commit.
    pub(crate) fn path(&self) -> &Path {
        &self.staging
    }

    /// Moves the finished directory into place.
    pub(crate) fn commit(mut self) -> Result<PathBuf> {
        if self.dest.is_dir() {
            // Only an empty directory can be here (checked in create); rename cannot replace it.
            std::fs::remove_dir(&self.dest)
                .with_context(|| format!("{}: cannot replace", self.dest.display()))?;
        }
        std::fs::rename(&self.staging, &self.dest).with_context(|| {
            format!(
                "cannot move {} to {}",
                self.staging.display(),
                self.dest.display()
            )
        })?;
        self.committed = true;
        Ok(self.dest.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Writes `value` as pretty JSON with a trailing newline.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("{}: cannot write", path.display()))
}

/// Writes a file through `write` under a temporary name beside `path` (in the same folder, so
/// the rename cannot cross file systems), then renames it into place: `path` is either absent,
/// its earlier content, or complete. On failure the temporary file is removed.
pub(crate) fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a usable file name", path.display()))?
        .to_string_lossy()
        .into_owned();
    // Hidden and per process: never a name the user chose, nor another writer's.
    let tmp = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let result = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
