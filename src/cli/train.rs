//! `train`: a training run in this process, headless for now.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::train_ranks::RunFolderNotice;
use crate::config::{self, TrainConfig};
use crate::data::arrow_io::resolve_split;
use crate::data::check::scan_tokens;
use crate::data::store::DataColumns;
use crate::frontend::ranks::RankLink;
use crate::frontend::run_loop::{self, RunLoopOptions, ScreenLink};
use crate::frontend::signals::SignalFlags;
use crate::frontend::socket;
use crate::frontend::tui::state::Viewer;
use crate::model::{Drafter, DrafterConfig, TargetConfig};
use crate::paths::Locations;
use crate::pipeline::distributed::Distributed;
use crate::pipeline::trainer;
use crate::runtime::TorchRuntime;
use crate::telemetry::records::Phase;
use crate::train::run_lock::RunLock;

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The TOML configuration (see configs/).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config field, e.g. --set train.lr=1e-4 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The run directory (default: RUNS_DIR/NAME-DATE-TIME).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Continue the run in this directory from its newest checkpoint. Fields that change
    /// the model or the data stream cannot change on a resume.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// On --resume: allow changes of the schedule (train.total_steps, epochs, lr,
    /// warmup_ratio, min_lr_ratio, clip_grad_norm); they are logged.
    #[arg(long, requires = "resume")]
    pub allow_schedule_change: bool,
    /// Headless: human lines and metrics.jsonl, commands from stdin.
    #[arg(long)]
    pub no_tui: bool,
}

fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // UTC date and time from the Unix time (civil-from-days).
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Loads the configuration: `--config` with overrides, or the resolved config of the run
/// being resumed.
pub(super) fn load_config(args: &TrainArgs) -> Result<TrainConfig> {
    match (&args.config, &args.resume) {
        (Some(path), _) => config::load(path, &args.set),
        (None, Some(run)) => config::load(&run.join("config.toml"), &args.set),
        (None, None) => bail!("train needs --config FILE (or --resume RUN_DIR)"),
    }
}

/// Where `train --resume` starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResumeFrom {
    /// The run's newest checkpoint.
    Checkpoint,
    /// Step 0: the run ended before its first checkpoint (a start-up that failed or was
    /// stopped, a kill before the first save); its recorded configuration is what it starts
    /// with.
    StepZero,
}

/// A resume checked: where it starts and the changes of configuration to log.
struct Resume {
    from: ResumeFrom,
    changes: Vec<String>,
}

/// A resume's checks, before anything in the run directory is written: the run exists (its
/// config.toml), and, when it has a checkpoint, the configuration changes nothing that the
/// checkpoint depends on (refused by name) nor the schedule unless `--allow-schedule-change`.
/// A run without a checkpoint starts from step 0: nothing trained depends on its settings.
fn check_resume(run: &Path, config: &TrainConfig, args: &TrainArgs) -> Result<Resume> {
    let stored_path = run.join("config.toml");
    if !stored_path.is_file() {
        bail!(
            "{}: not a run directory (no config.toml); start a run there with --run-dir instead of --resume",
            run.display()
        );
    }
    let stored = config::load(&stored_path, &[])
        .with_context(|| format!("{}: the run's configuration", stored_path.display()))?;
    let changes = config::resume_changes(&stored, config);
    if !trainer::ever_checkpointed(run) {
        let changes = (changes.refused.into_iter())
            .chain(changes.schedule)
            .chain(changes.free)
            .collect();
        return Ok(Resume {
            from: ResumeFrom::StepZero,
            changes,
        });
    }
    crate::train::checkpoint::newest_checkpoint(run)?;
    if !changes.refused.is_empty() {
        bail!(
            "resume of {} refused: these fields change the model or the data stream the checkpoints were trained with: {}; nothing in the run directory was changed (start a new run with --run-dir for a different setup)",
            run.display(),
            changes.refused.join(", ")
        );
    }
    if !changes.schedule.is_empty() && !args.allow_schedule_change {
        bail!(
            "resume of {} refused: the schedule changes ({}); pass --allow-schedule-change to resume with it; nothing in the run directory was changed",
            run.display(),
            changes.schedule.join(", ")
        );
    }
    Ok(Resume {
        from: ResumeFrom::Checkpoint,
        changes: changes.schedule.into_iter().chain(changes.free).collect(),
    })
}

/// Why a resume of `run` has nothing to do, when its newest checkpoint is at its last step and
/// the configuration adds no step (`train.total_steps` raised with `--allow-schedule-change`).
/// A schedule in epochs that changed is left to the trainer, which counts its steps.
fn finished_run(run: &Path, config: &TrainConfig) -> Option<String> {
    use crate::train::checkpoint::{checkpoints_dir, list_checkpoints, read_state};
    let (folder_step, checkpoint) = list_checkpoints(&checkpoints_dir(run)).pop()?;
    let state = read_state(&checkpoint).ok()?;
    // Believed only where the checkpoint proves itself without the data: every file as its
    // manifest lists it, and a state consistent with its folder and with itself. Anything
    // else goes to the resume, which verifies every checkpoint and says what is wrong.
    if !intact(&checkpoint) || !consistent(&state, folder_step) {
        return None;
    }
    if state.step < state.total_steps {
        return None;
    }
    let total = if config.train.total_steps > 0 {
        config.train.total_steps
    } else {
        let stored = config::load(&run.join("config.toml"), &[]).ok()?;
        let same_schedule = config::resume_changes(&stored, config).schedule.is_empty();
        if !same_schedule {
            return None;
        }
        state.total_steps
    };
    (total <= state.step).then(|| {
        format!(
            "run {} already finished at step {} of {}; nothing to do (raise train.total_steps with --allow-schedule-change to train on)",
            run.display(),
            state.step,
            state.total_steps
        )
    })
}

/// Whether every file of `checkpoint` is as its manifest lists it (false without a manifest).
fn intact(checkpoint: &Path) -> bool {
    use crate::train::manifest::{verify, ManifestCheck};
    matches!(verify(checkpoint), Ok(ManifestCheck::Checked { mismatches, .. }) if mismatches.is_empty())
}

/// The checks of a trainer state that need no data: its folder's step, within its schedule,
/// its epoch where its data position is, and no more batches than samples seen.
fn consistent(state: &crate::train::checkpoint::TrainerState, folder_step: u64) -> bool {
    state.step == folder_step
        && state.step <= state.total_steps
        && state.epoch == state.packer.window_start.epoch
        && state.packer.batches_done as u64 <= state.samples_seen
}

/// What a run writes in its directory: a directory holding any of them holds a run. (Its lock
/// and control socket are not among them: they are the trainer's while it runs, and what one
/// that is gone left of them, an empty lock file included, blocks nothing.)
const RUN_FILES: &[&str] = &[
    "config.toml",
    "metrics.jsonl",
    "train.log",
    "checkpoints",
    "best",
];

/// Refuses to start a new run in a directory that holds one (its files would be mixed with
/// the new run's, its checkpoints overwritten), naming what to run instead; reads only. An
/// empty or absent directory, or one with none of a run's files, is fine.
fn refuse_existing_run(dir: &Path) -> Result<()> {
    // A trainer at work there is named first: --resume would be refused too.
    RunLock::check_free(dir)?;
    let found: Vec<String> = RUN_FILES
        .iter()
        .filter_map(|name| {
            let meta = dir.join(name).symlink_metadata().ok()?;
            Some(if meta.is_dir() {
                format!("{name}/")
            } else {
                (*name).to_string()
            })
        })
        .collect();
    if found.is_empty() {
        return Ok(());
    }
    let resume = if trainer::ever_checkpointed(dir) {
        format!("continue it with --resume {}", dir.display())
    } else if dir.join("config.toml").is_file() {
        format!(
            "it has no checkpoint yet, so --resume {} starts it again from step 0 with its recorded config.toml (--set FIELD=VALUE changes it)",
            dir.display()
        )
    } else {
        "it has no checkpoint and no config.toml: there is nothing to resume; remove it".into()
    };
    bail!(
        "{}: already holds a run ({}); {resume}, or start a new run with another --run-dir; nothing in {} was changed",
        dir.display(),
        found.join(", "),
        dir.display()
    )
}

/// The run directory and, on a resume, where it starts; checked without writing anything: a
/// resume's checks, a new run's directory holds no run, the control socket's path fits.
fn check_run_dir(config: &TrainConfig, args: &TrainArgs) -> Result<(PathBuf, Option<Resume>)> {
    let resume = match &args.resume {
        Some(run) => Some(check_resume(run, config, args)?),
        None => None,
    };
    let dir = match (&args.resume, &args.run_dir) {
        (Some(r), _) => r.clone(),
        (None, Some(d)) => d.clone(),
        (None, None) => {
            let root = match &config.run.runs_dir {
                Some(dir) => dir.clone(),
                None => Locations::from_env().runs_dir,
            };
            root.join(format!("{}-{}", config.run.name, timestamp()))
        }
    };
    socket::check_socket_path(&dir)?;
    if args.resume.is_none() {
        refuse_existing_run(&dir)?;
    }
    Ok((dir, resume))
}

/// The inputs' checks, before anything is written or any model loads: the target's
/// config.json and the drafter's shape (or the `drafter_init` drafter), the held-out splits,
/// and one pass over the training split's token columns (files and columns present, ids inside
/// the vocabulary, masks of 0 and 1, a mask token the loss never trains on). Returns a line
/// to log.
pub(super) fn check_inputs(config: &TrainConfig) -> Result<String> {
    let started = Instant::now();
    let target_dir = Path::new(&config.model.target);
    let target = TargetConfig::from_model_dir(target_dir)?;
    let shape = config.drafter_shape();
    DrafterConfig::for_target(&target, &shape).with_context(|| {
        format!(
            "config: model section does not fit the target {}",
            target_dir.display()
        )
    })?;
    // A released drafter brings its own mask token.
    type Fix = Box<dyn Fn(u32) -> String>;
    let (mask, field, fix): (i64, String, Fix) = match &config.model.drafter_init {
        None => (
            config.model.mask_token_id,
            "config: model.mask_token_id".into(),
            Box::new(|id| format!("--set model.mask_token_id={id}")),
        ),
        Some(init) => {
            let c = Drafter::config_for_target(init, &target)?;
            c.with_added_layers(config.model.drafter_added_layers)
                .with_context(|| format!("config: model.drafter_init = {}", init.display()))?;
            (
                c.mask_token_id(),
                format!(
                    "{}: dflash_config.mask_token_id",
                    init.join("config.json").display()
                ),
                Box::new(|id| format!("a drafter made with init-drafter --mask-token-id {id}")),
            )
        }
    };

    let data = Path::new(&config.data.path);
    let splits = data.join("dataset_dict.json").is_file();
    let data_path = resolve_split(data, splits.then_some(config.data.split.as_str()))?;
    if splits && config.validation.every_steps > 0 {
        resolve_split(data, Some(&config.validation.split)).with_context(|| {
            "config: validation (sequences come from data.path, split validation.split)"
        })?;
    }
    if splits && config.eval.every_steps > 0 {
        resolve_split(data, Some(&config.eval.split))
            .with_context(|| "config: eval (prompts come from data.path, split eval.split)")?;
    }
    let columns = DataColumns {
        input_ids: config.data.input_ids_column.clone(),
        loss_mask: (!config.data.loss_mask_column.is_empty())
            .then(|| config.data.loss_mask_column.clone()),
    };
    let mask_id = u32::try_from(mask).with_context(|| format!("{field} = {mask} is negative"))?;
    let scan = scan_tokens(&data_path, &columns, target.vocab_size as usize, mask_id)?;
    scan.refuse_trained_mask_token(&field, target_dir, fix)?;
    Ok(format!(
        "checked {} in {:.2} s: {} rows, {} tokens ({} trained), ids inside the vocabulary of {}, mask token {mask_id} not trained ({} times in the context)",
        data_path.display(),
        started.elapsed().as_secs_f64(),
        scan.rows,
        scan.tokens,
        scan.trained,
        target.vocab_size,
        scan.counts[mask_id as usize]
    ))
}

/// Creates the run directory checked by [`check_run_dir`], takes its lock (one trainer per run
/// directory) and writes the resolved configuration (unless a resume changes nothing): beside
/// and renamed into place, so that a full disk leaves the previous config.toml or none, never
/// a part of one that no `--resume` could read.
fn create_run_dir(
    dir: &Path,
    config: &TrainConfig,
    changes: Option<&Vec<String>>,
) -> Result<RunLock> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create the run directory", dir.display()))?;
    let lock = RunLock::acquire(dir)?;
    if changes.is_none_or(|c| !c.is_empty()) {
        let resolved = dir.join("config.toml");
        let fresh = dir.join(format!(".config.toml.partial-{}", std::process::id()));
        let written = std::fs::write(&fresh, config.to_toml_string()?)
            .and_then(|()| std::fs::rename(&fresh, &resolved));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&fresh);
            return Err(e).with_context(|| format!("{}: cannot write config.toml", dir.display()));
        }
    }
    Ok(lock)
}

/// How the run in `dir` starts again after a start-up that failed or was stopped.
fn restart_note(dir: &Path, from: Option<ResumeFrom>) -> String {
    match from {
        Some(ResumeFrom::Checkpoint) => format!(
            "dflash-tui train --resume {} goes on from its last checkpoint",
            dir.display()
        ),
        Some(ResumeFrom::StepZero) | None => format!(
            "dflash-tui train --resume {} starts it from step 0",
            dir.display()
        ),
    }
}

/// `init_logging(log_file)` installs the logger (the run log and the terminal) and returns its
/// terminal switch. With the screen the run loop and the screen run side by side: the screen is
/// a viewer of the run (as `attach`), so a closed screen or a terminal that is gone leaves the
/// run training.
pub(super) fn run(
    args: TrainArgs,
    init_logging: impl FnOnce(&Path) -> Arc<AtomicBool>,
) -> Result<()> {
    use std::io::IsTerminal;
    let dist = Distributed::from_env().context("joining the multi-process run")?;
    if let Some(d) = dist.clone().filter(|d| !d.is_leader()) {
        return super::train_ranks::follow(args, d, init_logging);
    }
    let mut notice = RunFolderNotice::new(dist.clone());
    let config = load_config(&args)?;
    // Every check before anything is written or loaded: a refusal leaves no trace.
    let (run_dir, resume) = check_run_dir(&config, &args)?;
    let from = resume.as_ref().map(|r| r.from);
    let changes = resume.map(|r| r.changes);
    if let Some(done) = args
        .resume
        .as_ref()
        .and_then(|run| finished_run(run, &config))
    {
        println!("{done}");
        notice.done(&done)?;
        return Ok(());
    }
    let checked = check_inputs(&config)?;
    if args.resume.is_none() {
        // Again, just before writing: a run may have started there during the checks.
        refuse_existing_run(&run_dir)?;
    }
    let _lock = create_run_dir(&run_dir, &config, changes.as_ref())?;
    notice.ready(&run_dir)?;
    let tui = !args.no_tui && std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
    let log_to_terminal = init_logging(&run_dir.join("train.log"));
    log::info!("{checked}");
    if from == Some(ResumeFrom::StepZero) {
        log::info!(
            "{} has no checkpoint yet (the run ended before its first one): it starts from step 0 with its recorded configuration",
            run_dir.display()
        );
    }
    for change in changes.iter().flatten() {
        log::info!("resume with a changed configuration: {change}");
    }
    let restart = restart_note(&run_dir, from);
    let signals = SignalFlags::install(restart.clone())?;
    let runtime = TorchRuntime::init();
    let handle = trainer::start_with(
        &runtime,
        &config,
        &run_dir,
        args.resume.is_some(),
        dist.clone(),
    )
    .with_context(|| format!("the run did not start ({restart} once the cause below is fixed)"))?;
    let screen = tui.then(|| {
        // The screen shows train.log: the logger leaves the terminal to it.
        log_to_terminal.store(false, Ordering::SeqCst);
        let link = ScreenLink {
            close: Arc::new(AtomicBool::new(false)),
            closed: Arc::new(AtomicBool::new(false)),
        };
        let (dir, close, closed) = (run_dir.clone(), link.close.clone(), link.closed.clone());
        let thread = std::thread::Builder::new()
            .name("screen".into())
            .spawn(move || {
                if let Err(e) = crate::frontend::tui::app::run(&dir, Viewer::Trainer, &close) {
                    log::warn!("the screen closed: {e:#}");
                }
                closed.store(true, Ordering::SeqCst);
            });
        (link, thread)
    });
    let (link, screen_thread) = match screen {
        Some((link, Ok(thread))) => (Some(link), Some(thread)),
        Some((_, Err(e))) => {
            log_to_terminal.store(true, Ordering::SeqCst);
            log::warn!("cannot open the screen ({e}); going on headless");
            (None, None)
        }
        None => (None, None),
    };
    let close = link.as_ref().map(|l| l.close.clone());
    let (outcome, end) = run_loop::run(
        handle,
        signals,
        RunLoopOptions {
            log_every_steps: config.telemetry.log_every_steps,
            gpu_interval_s: config.telemetry.gpu_sample_interval_s,
            log_to_terminal: log_to_terminal.clone(),
            screen: link,
            ranks: dist.clone().map(RankLink::for_rank),
        },
    )?;
    if let (Some(close), Some(thread)) = (close, screen_thread) {
        // A stop by signal (a scheduler's SIGTERM) ends the process without waiting for a key;
        // otherwise the screen shows the end until a key is pressed.
        if end.stop_signalled || end.hung_up {
            close.store(true, Ordering::SeqCst);
        }
        let _ = thread.join();
    }
    if end.hung_up {
        log::info!("the run ended without its terminal");
    }
    match (&outcome.phase, &outcome.error) {
        (Phase::Finished | Phase::Stopped, None) => {
            let last = outcome.final_step.as_ref();
            let ended = match &outcome.stop_reason {
                Some(reason) => format!("run {} ({reason})", outcome.phase),
                None => format!("run {}", outcome.phase),
            };
            // The terminal may be gone (SIGHUP): the summary is in train.log and metrics.jsonl.
            let _ = writeln!(
                std::io::stdout(),
                "{ended}: {} of {} steps, loss {}, accuracy {}, anchor-mean acceptance (train) {}, last checkpoint {}, run dir {}",
                outcome.steps,
                outcome.total_steps,
                last.map_or("-".into(), |l| format!("{:.4}", l.loss)),
                last.map_or("-".into(), |l| format!("{:.3}", l.accuracy)),
                last.map_or("-".into(), |l| format!("{:.2}", l.accept_mean)),
                outcome
                    .last_checkpoint
                    .as_ref()
                    .map_or("none".into(), |p| p.display().to_string()),
                run_dir.display()
            );
            Ok(())
        }
        (_, error) => bail!(
            "the run failed at step {}: {}; last checkpoint: {}",
            outcome.steps,
            error.clone().unwrap_or_else(|| "stopped".into()),
            outcome
                .last_checkpoint
                .as_ref()
                .map_or("none".into(), |p| p.display().to_string())
        ),
    }
}
