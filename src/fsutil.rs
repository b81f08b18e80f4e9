//! File-system helpers: output files and directories that appear whole or not at all, the
//! removal of what killed writers left behind, and write errors that name their file.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

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
        remove_stale_staging_of(dest);
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

/// Removes the staging folders `.NAME.partial-PID` that writers of `dest` (named NAME) left
/// beside it when they were killed, logging each; those of live processes are kept.
pub(crate) fn remove_stale_staging_of(dest: &Path) {
    let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else {
        return;
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let prefix = format!(".{}.partial-", name.to_string_lossy());
    for gone in remove_stale_staging(parent, |n| n.starts_with(&prefix)) {
        log::info!("removed {}, left by a writer that is gone", gone.display());
    }
}

/// Removes the leftovers of writers that died in `dir` whose names `select` accepts: staging
/// entries `.X.partial-PID`, `.X.new-PID`, `.X.old-PID` and `.latest.tmp-PID` whose process is
/// gone (or is this one, which has not written them: a reused PID). Returns what was removed.
pub(crate) fn remove_stale_staging(dir: &Path, select: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = stale_writer_pid(&name).filter(|_| select(&name)) else {
            continue;
        };
        if pid != std::process::id() && process_alive(pid) {
            continue;
        }
        let path = entry.path();
        let gone = if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// The PID in the name of a staging leftover (`.X.partial-PID`, `.X.new-PID`, `.X.old-PID`,
/// `.latest.tmp-PID`).
pub(crate) fn stale_writer_pid(name: &str) -> Option<u32> {
    if !name.starts_with('.') {
        return None;
    }
    let (head, pid) = name.rsplit_once('-')?;
    let known = [".partial", ".new", ".old", ".latest.tmp"];
    if !known.iter().any(|k| head.ends_with(k)) {
        return None;
    }
    pid.parse().ok()
}

/// Whether a process with this PID exists (signal 0 asks without sending anything).
pub(crate) fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for the process.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A failed write of `path` as one message naming it: `PATH: cannot write: CAUSE`. Where the
/// cause is an I/O error (a full disk, say) wrapped by a library (Arrow's `Io error: X`, whose
/// source is X again), the I/O error alone, said once.
pub(crate) fn write_error(path: &Path, err: impl Into<anyhow::Error>) -> anyhow::Error {
    let err = err.into();
    match err.chain().find_map(|e| e.downcast_ref::<std::io::Error>()) {
        Some(io) => anyhow!("{}: cannot write: {io}", path.display()),
        None => err.context(format!("{}: cannot write", path.display())),
    }
}

/// Appends `bytes` to `file` whole or not at all: a failed write (a full disk) is cut back off,
/// so a file of records keeps whole records.
pub(crate) fn append_whole(file: &mut std::fs::File, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let before = file.metadata().map(|m| m.len()).ok();
    let written = file.write_all(bytes);
    if written.is_err() {
        if let Some(len) = before {
            let _ = file.set_len(len);
        }
    }
    written
}

/// Writes `value` as pretty JSON with a trailing newline.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| write_error(path, e))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_leftovers_are_recognised_by_name() {
        assert_eq!(stale_writer_pid(".step-000004.new-1234"), Some(1234));
        assert_eq!(
            stale_writer_pid("..step-000004.new-1234.partial-99"),
            Some(99)
        );
        assert_eq!(stale_writer_pid(".data.partial-77"), Some(77));
        assert_eq!(stale_writer_pid(".step-000004.old-7"), Some(7));
        assert_eq!(stale_writer_pid(".best.new-5"), Some(5));
        assert_eq!(stale_writer_pid(".latest.tmp-42"), Some(42));
        assert_eq!(stale_writer_pid("step-000004"), None);
        assert_eq!(stale_writer_pid("data.partial"), None);
        assert_eq!(stale_writer_pid(".lock"), None);
        assert_eq!(stale_writer_pid(".hidden-12"), None);
    }

    #[test]
    fn a_new_staged_dir_removes_the_staging_folders_of_dead_writers_of_its_name() {
        let tmp = tempfile::tempdir().unwrap();
        // no PID exceeds the kernel's PID_MAX_LIMIT (2^22); PID 1 always exists
        let dead = tmp.path().join(".data.partial-4194305");
        let live = tmp.path().join(".data.partial-1");
        let other = tmp.path().join(".other.partial-4194305");
        for d in [&dead, &live, &other] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("shard.arrow"), b"half").unwrap();
        }
        let staged = StagedDir::create(&tmp.path().join("data")).unwrap();
        assert!(!dead.exists(), "a dead writer's staging folder is removed");
        assert!(live.exists(), "a live writer's is kept");
        assert!(other.exists(), "another output's is left to its own writer");
        staged.commit().unwrap();
        assert!(tmp.path().join("data").is_dir());
    }

    #[test]
    fn a_full_disk_is_named_with_the_file_once() {
        let full = Path::new("/dev/full");
        if !full.exists() {
            return;
        }
        let e = format!(
            "{:#}",
            write_json(full, &serde_json::json!({"a": 1})).unwrap_err()
        );
        assert_eq!(
            e,
            "/dev/full: cannot write: No space left on device (os error 28)"
        );
        // a library error that wraps the I/O error (Arrow's "Io error: X", source X)
        let io = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        let wrapped = arrow::error::ArrowError::IoError(io().to_string(), io());
        let e = format!("{:#}", write_error(Path::new("out/x.arrow"), wrapped));
        assert_eq!(
            e,
            "out/x.arrow: cannot write: No space left on device (os error 28)"
        );
        // the Arrow writer of prepare-data's and regenerate's shards
        let rows = [crate::data::arrow_io::TokenRow {
            id: "0",
            input_ids: &[5; 4096],
            loss_mask: &[1; 4096],
        }];
        let e = format!(
            "{:#}",
            crate::data::arrow_io::write_token_rows(full, &rows).unwrap_err()
        );
        assert_eq!(
            e,
            "/dev/full: cannot write: No space left on device (os error 28)"
        );
        let other = write_error(Path::new("x.json"), anyhow!("not a number"));
        assert_eq!(format!("{other:#}"), "x.json: cannot write: not a number");
    }
}
