//! `train` as one rank of a multi-process run (see docs/distributed.md): rank 0 runs the
//! ordinary `train` (checks, run folder, control socket, screen) and tells the other ranks
//! through the c10d store where the run folder is ([`RunFolderNotice`]); every other rank
//! waits for that word and trains headless, its records in `RUN/ranks/rank-N/`, with no
//! control socket of its own: it reports to rank 0 (see `frontend::ranks`).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::train::{load_config, TrainArgs};
use crate::frontend::ranks::RankLink;
use crate::frontend::run_loop::{self, RunLoopOptions};
use crate::frontend::signals::SignalFlags;
use crate::pipeline::distributed::Distributed;
use crate::pipeline::trainer;
use crate::runtime::TorchRuntime;
use crate::telemetry::records::Phase;

const RUN_FOLDER_KEY: &str = "dflash/run_folder";

/// Rank 0's word on the run folder: set once, as ready (the folder), done (nothing to train)
/// or, when dropped unsaid, that rank 0 did not start the run.
pub(super) struct RunFolderNotice {
    dist: Option<Arc<Distributed>>,
    said: bool,
}

impl RunFolderNotice {
    pub(super) fn new(dist: Option<Arc<Distributed>>) -> Self {
        RunFolderNotice { dist, said: false }
    }

    fn say(&mut self, word: &str) -> Result<()> {
        self.said = true;
        match &self.dist {
            Some(d) => d.group.store_set(RUN_FOLDER_KEY, word.as_bytes()),
            None => Ok(()),
        }
    }

    pub(super) fn ready(&mut self, dir: &Path) -> Result<()> {
        self.say(&format!("ready\n{}", dir.display()))
    }

    pub(super) fn done(&mut self, why: &str) -> Result<()> {
        self.say(&format!("done\n{why}"))
    }
}

impl Drop for RunFolderNotice {
    fn drop(&mut self) {
        if !self.said {
            let _ = self.say("failed\nrank 0 did not start the run (its error is in its output)");
        }
    }
}

/// What rank 0 said: the run folder, or `None` when there is nothing to train.
fn run_folder(d: &Distributed) -> Result<Option<PathBuf>> {
    let bytes = d
        .group
        .store_get(RUN_FOLDER_KEY, d.group.timeout)
        .with_context(|| {
            format!(
                "rank {}: rank 0 did not say where the run folder is within {:.0} s",
                d.rank(),
                d.group.timeout.as_secs_f64()
            )
        })?;
    let word = String::from_utf8_lossy(&bytes).into_owned();
    match word.split_once('\n') {
        Some(("ready", dir)) => Ok(Some(PathBuf::from(dir))),
        Some(("done", why)) => {
            println!("{why}");
            Ok(None)
        }
        Some((_, why)) => bail!("rank {}: {why}", d.rank()),
        None => bail!("rank {}: rank 0 said {word:?}", d.rank()),
    }
}

/// A rank other than 0: trains headless in rank 0's run folder.
pub(super) fn follow(
    args: TrainArgs,
    d: Arc<Distributed>,
    init_logging: impl FnOnce(&Path) -> Arc<AtomicBool>,
) -> Result<()> {
    let config = load_config(&args)?;
    let Some(run_dir) = run_folder(&d)? else {
        return Ok(());
    };
    let own = trainer::rank_dir(&run_dir, d.rank());
    std::fs::create_dir_all(&own)
        .with_context(|| format!("{}: cannot create this rank's folder", own.display()))?;
    let log_to_terminal = init_logging(&own.join("train.log"));
    log::info!(
        "{}: run folder {}",
        d.settings.describe(),
        run_dir.display()
    );
    let signals = SignalFlags::install(format!("rank {} follows rank 0", d.rank()))?;
    let runtime = TorchRuntime::init();
    let handle = trainer::start_with(
        &runtime,
        &config,
        &run_dir,
        args.resume.is_some(),
        Some(d.clone()),
    )
    .with_context(|| format!("rank {} did not start", d.rank()))?;
    let (outcome, _) = run_loop::run(
        handle,
        signals,
        RunLoopOptions {
            log_every_steps: config.telemetry.log_every_steps,
            gpu_interval_s: config.telemetry.gpu_sample_interval_s,
            log_to_terminal,
            screen: None,
            ranks: Some(RankLink::for_rank(d.clone())),
        },
    )?;
    match (&outcome.phase, &outcome.error) {
        (Phase::Finished | Phase::Stopped, None) => {
            println!(
                "rank {} {}: {} of {} steps",
                d.rank(),
                outcome.phase,
                outcome.steps,
                outcome.total_steps
            );
            Ok(())
        }
        (_, error) => bail!(
            "{}",
            error
                .clone()
                .unwrap_or_else(|| format!("rank {} stopped", d.rank()))
        ),
    }
}
