//! One trainer per run directory: an advisory lock (`flock`) on `RUN_DIR/.lock`, held for the
//! life of the process, with the holder's PID written in the file so that a refused second
//! trainer can name it. The kernel drops the lock when the process ends, however it ends.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

use anyhow::{Context, Result};

pub(crate) const LOCK_NAME: &str = ".lock";

/// The held lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct RunLock {
    _file: File,
}

impl RunLock {
    /// Takes the lock of `run_dir`, or fails naming the PID of the trainer that holds it.
    pub(crate) fn acquire(run_dir: &Path) -> Result<RunLock> {
        let path = run_dir.join(LOCK_NAME);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("{}: cannot open the run's lock file", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if !taken {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(held(run_dir, &mut file));
            }
            return Err(err).with_context(|| format!("{}: cannot lock", path.display()));
        }
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "{}", std::process::id()))
            .with_context(|| format!("{}: cannot write the lock file", path.display()))?;
        Ok(RunLock { _file: file })
    }

    /// The PID of the trainer that holds `run_dir`, if one is alive. Read from the lock file
    /// without locking it (a viewer's peek must never make a starting trainer fail).
    pub fn holder(run_dir: &Path) -> Option<u32> {
        let text = std::fs::read_to_string(run_dir.join(LOCK_NAME)).ok()?;
        let pid: u32 = text.trim().parse().ok()?;
        // The PID of a trainer that is gone may be another process's now: it must be ours.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let name = String::from_utf8_lossy(&cmdline);
        name.contains("dflash-tui").then_some(pid)
    }

    /// Fails as [`RunLock::acquire`] does when a trainer holds the lock of `run_dir`, but
    /// creates and writes nothing (for checks that must leave a run directory as it was).
    pub(crate) fn check_free(run_dir: &Path) -> Result<()> {
        let Ok(mut file) = File::open(run_dir.join(LOCK_NAME)) else {
            return Ok(());
        };
        // A shared lock is refused only while a trainer holds the exclusive one; it goes
        // when `file` is dropped.
        // SAFETY: flock on a descriptor this function owns.
        let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
        if !taken && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(held(run_dir, &mut file));
        }
        Ok(())
    }
}

/// The refusal naming the trainer that holds `run_dir` (its PID is in the lock file).
fn held(run_dir: &Path, file: &mut File) -> anyhow::Error {
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    let holder = text.trim();
    anyhow::anyhow!(
        "{}: another trainer is running in this run directory ({}); one trainer per run directory: stop it first (dflash-tui ctl {} stop), or choose another --run-dir",
        run_dir.display(),
        if holder.is_empty() {
            "its PID is not recorded".to_string()
        } else {
            format!("PID {holder}")
        },
        run_dir.display()
    )
}
