//! The staged trainer (control-room spec §1): a loader thread, one target worker per target
//! device, one drafter worker per drafter device, joined by resizable queues. Drafter worker 0
//! coordinates: it averages the replicas' flat gradients, clips, runs AdamW on the fp32 master
//! weights, hands the new weights back (by copies or NCCL collectives, see [`super::collective`]),
//! writes metrics and checkpoints. Everything is steered through [`TrainerHandle::command`] and
//! observed through [`TrainerHandle::snapshot`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use crossbeam_channel::{Receiver, Sender};
use tch::{Device, Kind, Tensor};

use super::collective::{self, CoordinatorSync, GradSyncPlan, ParamsMsg, ReplicaSync};
use super::command::Command;
use super::device_event::{DeviceEvent, DeviceEvents};
use super::held_out::{HeldOut, Resumed};
use super::queue::{QueueClosed, QueueLevel, ResizableQueue};
use crate::config::TrainConfig;
use crate::data::packer::{collate, Packer, PackerConfig, PackerState};
use crate::data::store::{DataColumns, StoreOptions, TokenStore};
use crate::model::layers::upload;
use crate::model::{
    AnchorBatch, Drafter, DrafterConfig, DrafterShape, ForwardRequest, FrozenHead, SharedTarget,
    TargetModel,
};
use crate::runtime::TorchRuntime;
use crate::telemetry::profile::{Event, ProfileReport, ProfileStats, StageWorkers};
use crate::telemetry::rate::RateWindow;
use crate::telemetry::records::{
    EvalRecord, MetricsRecord, MetricsWriter, Phase, RunHistory, Snapshot, StepRecord,
    ValidationRecord,
};
use crate::train::checkpoint::{
    newest_checkpoint, read_state, remove_stale_partials, repair_latest, save_checkpoint, BestEval,
    BestRule, CheckpointFault, HoldPoint, TrainerState,
};
use crate::train::loss::{
    block_targets, loss_and_backward_deferred, sample_anchors, LossOptions, LossSums, LossTensors,
};
use crate::train::optim::{lr_at, AdamW, AdamWConfig};

/// Steps kept for the charts.
const HISTORY: usize = 20_000;
/// Periodic evaluations and validation passes kept for the charts.
const EVAL_HISTORY: usize = 2_000;

/// A batch on its way to a target worker.
pub(crate) struct BatchItem {
    seq: u64,
    resume: PackerState,
    epoch: u64,
    samples: Vec<usize>,
    pub(crate) lengths: Vec<usize>,
    stride: usize,
    ids: Vec<i64>,
    mask: Vec<i64>,
    pub(crate) input_ids: Tensor,
}

/// Target features on their way to a drafter worker.
pub(crate) struct FeatureItem {
    pub(crate) batch: BatchItem,
    pub(crate) features: Tensor,
    pub(crate) teacher_hidden: Option<Tensor>,
}

/// A replica's contribution to a step.
struct GradMsg {
    /// Which replica (1..): its NCCL rank.
    replica: usize,
    /// The flat gradient (and with NCCL the weight buffer), see [`collective::Outgoing`].
    out: collective::Outgoing,
    sums: LossTensors,
    tokens: u64,
    samples: u64,
    last: Option<(u64, PackerState, u64)>,
}

#[derive(Debug, Default)]
struct Status {
    phase: Option<Phase>,
    step: u64,
    epoch: u64,
    tokens_seen: u64,
    samples_seen: u64,
    history: Vec<StepRecord>,
    evals: Vec<EvalRecord>,
    validations: Vec<ValidationRecord>,
    error: Option<String>,
    /// Why the run stopped before its last step, if it did.
    stop_reason: Option<String>,
    last_checkpoint: Option<PathBuf>,
    /// Completed steps over a window: the live rates and the ETA.
    rates: RateWindow,
    last_profile: Option<ProfileReport>,
    stage_devices: Vec<(String, String)>,
}

/// State shared by the stages and the front ends.
pub struct Shared {
    pub stop: Arc<AtomicBool>,
    paused: AtomicBool,
    pause_lock: Mutex<()>,
    pause_cv: Condvar,
    checkpoint_requested: AtomicBool,
    /// 0: run on; 1: stop with checkpoint; 2: stop without.
    stop_requested: AtomicU8,
    pub profile: ProfileStats,
    profile_interval_s: Mutex<f64>,
    batch_q: ResizableQueue<BatchItem>,
    feature_q: ResizableQueue<FeatureItem>,
    status: Mutex<Status>,
    metrics: MetricsWriter,
    /// How often each sample reached a drafter worker (store index).
    pub sample_visits: Vec<AtomicU32>,
    started: Instant,
    /// Seconds the run had trained before this process (a resumed run continues its clock).
    elapsed_before_s: f64,
    pub run_dir: PathBuf,
    pub run_name: String,
    total_steps: u64,
}

impl Shared {
    /// Seconds since the run began, across resumes.
    fn elapsed_s(&self) -> f64 {
        self.elapsed_before_s + self.started.elapsed().as_secs_f64()
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Blocks while paused; false once the pipeline stops.
    fn wait_if_paused(&self) -> bool {
        let mut guard = self.pause_lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.paused.load(Ordering::Relaxed) && !self.stopping() {
            guard = self
                .pause_cv
                .wait_timeout(guard, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        !self.stopping()
    }

    fn event(&self, kind: &str, message: String) {
        log::info!("{message}");
        self.metrics.write(&MetricsRecord::Event {
            elapsed_s: self.elapsed_s(),
            kind: kind.to_string(),
            message,
        });
    }

    fn set_phase(&self, phase: Phase) {
        self.status().phase = Some(phase);
    }

    /// Records the first error and stops every stage.
    fn fail(&self, stage: &str, error: &anyhow::Error) {
        let message = format!("{stage} failed: {error:#}");
        {
            let mut st = self.status();
            if st.error.is_none() {
                st.error = Some(message.clone());
                st.phase = Some(Phase::Failed);
            }
        }
        log::error!("{message}");
        self.metrics.write(&MetricsRecord::Event {
            elapsed_s: self.elapsed_s(),
            kind: "error".into(),
            message,
        });
        self.stop.store(true, Ordering::Relaxed);
        self.batch_q.wake_all();
        self.feature_q.wake_all();
    }

    pub fn queue_levels(&self) -> Vec<QueueLevel> {
        vec![self.batch_q.level(), self.feature_q.level()]
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    pub phase: Phase,
    pub steps: u64,
    pub error: Option<String>,
    pub last_checkpoint: Option<PathBuf>,
    pub final_step: Option<StepRecord>,
    /// Why the run stopped before its last step (a command, early stopping), if it did.
    pub stop_reason: Option<String>,
}

/// A running trainer.
pub struct TrainerHandle {
    pub shared: Arc<Shared>,
    threads: Vec<(String, JoinHandle<()>)>,
}

fn resolve_kind(name: &str, device: Device) -> Result<Kind> {
    Ok(match name {
        "auto" if device.is_cuda() => Kind::BFloat16,
        "auto" | "f32" => Kind::Float,
        "bf16" => Kind::BFloat16,
        other => bail!("config: model.dtype = {other:?} is not one of auto, f32, bf16"),
    })
}

fn seed_for(seed: u64, step: u64, replica: usize, micro: usize) -> u64 {
    // SplitMix-style mixing: distinct streams per (step, replica, micro-batch).
    let mut x = seed
        ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ ((replica as u64) << 40)
        ^ ((micro as u64) << 20);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Everything the stages need, prepared before any thread starts (so configuration and input
/// errors are reported before training begins).
pub(crate) struct Prepared {
    config: TrainConfig,
    pub(crate) store: Arc<TokenStore>,
    pub(crate) targets: Vec<Arc<SharedTarget>>,
    pub(crate) drafters: Vec<Drafter>,
    pub(crate) heads: Vec<FrozenHead>,
    pub(crate) optimizer: AdamW,
    pub(crate) packer: Packer,
    start_step: u64,
    start_epoch: u64,
    tokens_seen: u64,
    samples_seen: u64,
    total_steps: u64,
    pub(crate) target_devices: Vec<Device>,
    pub(crate) drafter_devices: Vec<Device>,
    grad_sync: GradSyncPlan,
    held_out: Option<HeldOut>,
}

pub(super) fn load_target(
    config: &TrainConfig,
    dir: &Path,
    device: Device,
    kind: Kind,
) -> Result<TargetModel> {
    if config.model.random_weights {
        TargetModel::random(dir, device, kind, config.run.seed)
    } else {
        TargetModel::load(dir, device, kind)
    }
}

/// "N layers, X GB" of the target in `dir` (its config.json and safetensors files), for the
/// line announcing its loading.
fn target_files_summary(config: &TrainConfig, dir: &Path) -> String {
    let layers = crate::model::TargetConfig::from_model_dir(dir).map_or("? layers".into(), |c| {
        format!("{} layers", c.num_hidden_layers)
    });
    if config.model.random_weights {
        return format!("{layers}, random weights");
    }
    let bytes: u64 = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    format!("{layers}, {:.2} GB", bytes as f64 / 1e9)
}

pub(crate) fn prepare(
    runtime: &TorchRuntime,
    config: &TrainConfig,
    resume: Option<&Path>,
) -> Result<Prepared> {
    let target_dir = PathBuf::from(&config.model.target);
    let target_devices = config
        .devices
        .target_devices
        .iter()
        .map(|d| {
            runtime
                .device(d)
                .with_context(|| "config: devices.target_devices".to_string())
        })
        .collect::<Result<Vec<_>>>()?;
    let drafter_devices = config
        .devices
        .drafter_devices
        .iter()
        .map(|d| {
            runtime
                .device(d)
                .with_context(|| "config: devices.drafter_devices".to_string())
        })
        .collect::<Result<Vec<_>>>()?;
    // Decided (and libnccl loaded, where NCCL is to be used) before any model is loaded.
    let grad_sync = collective::plan(
        &config.devices.grad_sync,
        &config.devices.drafter_devices,
        &drafter_devices,
        runtime.libtorch_dir.as_deref(),
    )?;
    let target_kind = resolve_kind(&config.model.dtype, target_devices[0])?;
    let drafter_kind = resolve_kind(&config.model.dtype, drafter_devices[0])?;

    // Targets: loaded once per device.
    let mut targets: Vec<Arc<SharedTarget>> = Vec::new();
    for &dev in &target_devices {
        if let Some(t) = targets.iter().find(|t| t.device == dev) {
            targets.push(t.clone());
            continue;
        }
        // Start-up time goes here for a big target: say so before, and how long after.
        log::info!(
            "loading target {} ({}) on {dev:?} as {target_kind:?} ...",
            target_dir.display(),
            target_files_summary(config, &target_dir)
        );
        let started = Instant::now();
        let t = load_target(config, &target_dir, dev, target_kind)?;
        log::info!(
            "target loaded in {:.1} s: {} ({:?}, {:.1} M parameters) on {dev:?}",
            started.elapsed().as_secs_f64(),
            target_dir.display(),
            t.family,
            t.parameter_count() as f64 / 1e6,
        );
        targets.push(Arc::new(SharedTarget::new(t)));
    }
    let target_cfg = &targets[0].config;

    // Drafter configuration: from drafter_init, the resume checkpoint, or fresh.
    let shape = DrafterShape {
        layers: config.model.drafter_layers,
        block_size: config.model.block_size,
        mask_token_id: config.model.mask_token_id,
        target_layer_ids: (!config.model.target_layer_ids.is_empty())
            .then(|| config.model.target_layer_ids.clone()),
        num_taps: config.model.num_taps,
    };
    let drafter_config = DrafterConfig::for_target(target_cfg, &shape).with_context(|| {
        format!(
            "config: model section does not fit the target {}",
            target_dir.display()
        )
    })?;
    let init_dir =
        (!config.model.drafter_init.is_empty()).then(|| PathBuf::from(&config.model.drafter_init));

    // Data.
    let data_path = crate::data::arrow_io::resolve_split(
        Path::new(&config.data.path),
        Path::new(&config.data.path)
            .join("dataset_dict.json")
            .is_file()
            .then_some(config.data.split.as_str()),
    )?;
    let columns = DataColumns {
        input_ids: config.data.input_ids_column.clone(),
        loss_mask: (!config.data.loss_mask_column.is_empty())
            .then(|| config.data.loss_mask_column.clone()),
    };
    let block = config.model.block_size as usize;
    let read_started = Instant::now();
    let (store, report) = TokenStore::load(
        &data_path,
        &columns,
        &StoreOptions {
            vocab_size: target_cfg.vocab_size as usize,
            max_len: config.data.max_len,
            min_loss_tokens: 2 * block,
            max_samples: config.data.max_samples,
        },
    )?;
    log::info!(
        "data {} read in {:.1} s: {} samples kept of {} ({} cut to {}, {} with fewer than {} loss tokens dropped{}), {} tokens, {:.1} MiB in memory",
        data_path.display(),
        read_started.elapsed().as_secs_f64(),
        report.kept,
        report.rows,
        report.cut,
        config.data.max_len,
        report.dropped_short,
        2 * block,
        if report.not_read > 0 {
            format!(
                ", {} rows past data.max_samples = {} not read",
                report.not_read, config.data.max_samples
            )
        } else {
            String::new()
        },
        report.tokens,
        store.memory_bytes() as f64 / (1u64 << 20) as f64
    );
    if store.is_empty() {
        bail!(
            "{}: no sample has {} or more loss tokens",
            data_path.display(),
            2 * block
        );
    }
    let store = Arc::new(store);
    let packer_config = packer_config(config);

    // Drafter replicas and the optimizer.
    let mut drafters = Vec::new();
    for &dev in &drafter_devices {
        let d = match &init_dir {
            Some(dir) => Drafter::load_for_target(dir, target_cfg, dev, drafter_kind)?,
            None => Drafter::init(drafter_config.clone(), dev, drafter_kind, config.run.seed)?,
        };
        drafters.push(d.with_train_attention(config.train.attention));
    }
    if init_dir.is_some() {
        // A released drafter decides its own shape; the config must agree on the block size.
        let c = &drafters[0].config;
        if c.block_size != config.model.block_size {
            bail!(
                "config: model.block_size = {} but the drafter in {} has block_size {}",
                config.model.block_size,
                config.model.drafter_init,
                c.block_size
            );
        }
    }
    log::info!("{}", drafters[0].describe());
    let adam = AdamWConfig {
        beta1: config.train.beta1,
        beta2: config.train.beta2,
        eps: config.train.eps,
        weight_decay: config.train.weight_decay,
    };
    let mut optimizer = AdamW::new(&drafters[0].named_parameters(), drafter_devices[0], adam);

    let per_step = config.step_batches() as u64;
    let total_steps = if config.train.total_steps > 0 {
        config.train.total_steps
    } else {
        let batches = batches_per_epoch(&store, &packer_config);
        ((batches as f64 * config.train.epochs) / per_step as f64)
            .ceil()
            .max(1.0) as u64
    };

    let mut packer_state = PackerState::default();
    let (mut start_step, mut start_epoch, mut tokens_seen, mut samples_seen) = (0, 0, 0, 0);
    let mut validations_since_best = 0;
    let mut resumed_from = None;
    if let Some(run_dir) = resume {
        let ckpt = newest_checkpoint(run_dir)?;
        let state = read_state(&ckpt)?;
        optimizer
            .load(&ckpt.join("optimizer.safetensors"), state.step)
            .with_context(|| format!("cannot resume from {}", ckpt.display()))?;
        packer_state = state.packer;
        start_step = state.step;
        start_epoch = state.epoch;
        tokens_seen = state.tokens_seen;
        samples_seen = state.samples_seen;
        validations_since_best = state.validations_since_best;
        log::info!("resuming from {} at step {}", ckpt.display(), state.step);
        resumed_from = Some(ckpt);
    }
    // The data stream where it stopped (a position beyond its window is refused here, before
    // any thread starts, instead of a skip loop that never ends).
    let packer =
        Packer::resume(store.clone(), packer_config.clone(), packer_state).with_context(|| {
            match &resumed_from {
                Some(ckpt) => format!(
                    "{}: cannot resume the data stream",
                    ckpt.join("trainer_state.json").display()
                ),
                None => "cannot start the data stream".to_string(),
            }
        })?;
    // Every replica starts from the master weights (exactly those saved, on resume).
    for d in &drafters {
        optimizer.write_params(&d.named_parameters())?;
    }
    let heads = drafter_devices
        .iter()
        .map(|&d| FrozenHead::from_target(&targets[0], d, drafter_kind))
        .collect();
    let dev = drafter_devices[0];
    let held_out = HeldOut::prepare(
        config,
        &targets,
        dev,
        || load_target(config, &target_dir, dev, target_kind),
        resume.map(|run_dir| Resumed {
            run_dir,
            validations_since_best,
        }),
    )?;
    // Everything loaded: now the run directory may be touched.
    if let (Some(run_dir), Some(ckpt)) = (resume, &resumed_from) {
        if repair_latest(run_dir, ckpt)? {
            log::warn!(
                "checkpoints/latest pointed at an older checkpoint than {} (a run killed between saving and pointing at it): repaired",
                ckpt.display()
            );
        }
    }
    Ok(Prepared {
        held_out,
        config: config.clone(),
        heads,
        store,
        targets,
        drafters,
        optimizer,
        packer,
        start_step,
        start_epoch,
        tokens_seen,
        samples_seen,
        total_steps,
        target_devices,
        drafter_devices,
        grad_sync,
    })
}

fn packer_config(config: &TrainConfig) -> PackerConfig {
    PackerConfig {
        token_budget: config.data.token_budget,
        max_batch: config.data.max_batch,
        window: config.data.bucket_window,
        seed: config.run.seed,
    }
}

/// Batches in the first epoch (the count is the same in every epoch up to window effects).
fn batches_per_epoch(store: &Arc<TokenStore>, config: &PackerConfig) -> u64 {
    let p = Packer::new(store.clone(), config.clone());
    let mut n = 0;
    for b in p {
        if b.epoch > 0 {
            break;
        }
        n += 1;
    }
    n
}

/// Starts a run: loads everything, then the stage threads. Errors before the threads start
/// (configuration, inputs, models) come back here.
pub fn start(
    runtime: &TorchRuntime,
    config: &TrainConfig,
    run_dir: &Path,
    resume: bool,
) -> Result<TrainerHandle> {
    let prepared = prepare(runtime, config, resume.then_some(run_dir))?;
    for gone in remove_stale_partials(run_dir) {
        log::info!("removed {}, left by a writer that is gone", gone.display());
    }
    let metrics_path = run_dir.join("metrics.jsonl");
    let (metrics, before) = if resume {
        let metrics = MetricsWriter::open_resumed(&metrics_path, prepared.start_step)?;
        (metrics, RunHistory::read(&metrics_path)?)
    } else {
        (MetricsWriter::open(&metrics_path)?, RunHistory::default())
    };
    let stop = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Shared {
        batch_q: ResizableQueue::new("batch_q", config.pipeline.batch_queue_depth, stop.clone()),
        feature_q: ResizableQueue::new(
            "feature_q",
            config.pipeline.feature_queue_depth,
            stop.clone(),
        ),
        stop,
        paused: AtomicBool::new(false),
        pause_lock: Mutex::new(()),
        pause_cv: Condvar::new(),
        checkpoint_requested: AtomicBool::new(false),
        stop_requested: AtomicU8::new(0),
        profile: ProfileStats::with_workers(StageWorkers {
            targets: prepared.target_devices.len(),
            drafters: prepared.drafter_devices.len(),
        }),
        profile_interval_s: Mutex::new(config.telemetry.profile_interval_s),
        status: Mutex::new(Status {
            phase: Some(Phase::WarmingUp),
            step: prepared.start_step,
            epoch: prepared.start_epoch,
            tokens_seen: prepared.tokens_seen,
            samples_seen: prepared.samples_seen,
            stage_devices: prepared
                .target_devices
                .iter()
                .map(|d| ("target".to_string(), device_name(*d)))
                .chain(
                    prepared
                        .drafter_devices
                        .iter()
                        .map(|d| ("drafter".to_string(), device_name(*d))),
                )
                .collect(),
            history: tail(before.steps, HISTORY),
            evals: tail(before.evals, EVAL_HISTORY),
            validations: tail(before.validations, EVAL_HISTORY),
            ..Default::default()
        }),
        metrics,
        sample_visits: (0..prepared.store.len())
            .map(|_| AtomicU32::new(0))
            .collect(),
        started: Instant::now(),
        elapsed_before_s: before.elapsed_s,
        run_dir: run_dir.to_path_buf(),
        run_name: config.run.name.clone(),
        total_steps: prepared.total_steps,
    });
    shared.event(
        "start",
        format!(
            "run {} in {}: {} steps from step {}, targets on {:?}, drafters on {:?}",
            config.run.name,
            run_dir.display(),
            prepared.total_steps,
            prepared.start_step,
            prepared.target_devices,
            prepared.drafter_devices
        ),
    );
    spawn_stages(shared, prepared)
}

/// The last `n` of `items`.
fn tail<T>(mut items: Vec<T>, n: usize) -> Vec<T> {
    let cut = items.len().saturating_sub(n);
    items.drain(..cut);
    items
}

fn device_name(d: Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}"),
    }
}

fn spawn_stages(shared: Arc<Shared>, p: Prepared) -> Result<TrainerHandle> {
    let mut threads = Vec::new();
    let spawn = |name: String, f: Box<dyn FnOnce() + Send>| -> Result<(String, JoinHandle<()>)> {
        let h = std::thread::Builder::new()
            .name(name.clone())
            .spawn(f)
            .with_context(|| format!("cannot start thread {name}"))?;
        Ok((name, h))
    };
    let config = Arc::new(p.config.clone());
    // The NCCL communicators, if any, before any thread starts.
    let (coordinator_sync, replica_syncs, sync_note) = p.grad_sync.connect(&p.drafter_devices)?;
    shared.event("grad_sync", sync_note);

    // Loader.
    {
        let shared = shared.clone();
        let store = p.store.clone();
        let cfg = config.clone();
        let packer = p.packer;
        threads.push(spawn(
            "loader".into(),
            Box::new(move || {
                run_stage(&shared, "loader", || loader(&shared, store, &cfg, packer));
                shared.batch_q.close();
            }),
        )?);
    }
    // Target workers.
    let n_targets = p.targets.len();
    let finished_targets = Arc::new(AtomicU32::new(0));
    for (i, target) in p.targets.into_iter().enumerate() {
        let shared = shared.clone();
        let cfg = config.clone();
        let taps = p.drafters[0].config.target_layer_ids().to_vec();
        let done = finished_targets.clone();
        let wait_for_device = !p.drafter_devices.contains(&target.device);
        threads.push(spawn(
            format!("target-{i}"),
            Box::new(move || {
                run_stage(&shared, &format!("target worker {i}"), || {
                    target_worker(&shared, &target, &taps, &cfg, wait_for_device)
                });
                if done.fetch_add(1, Ordering::SeqCst) + 1 == n_targets as u32 {
                    shared.feature_q.close();
                }
            }),
        )?);
    }
    // Drafter workers: 0 coordinates.
    let replicas = p.drafters.len();
    let (grad_tx, grad_rx) = crossbeam_channel::unbounded::<GradMsg>();
    let mut param_txs = Vec::new();
    let mut param_rxs = Vec::new();
    for _ in 1..replicas {
        let (tx, rx) = crossbeam_channel::unbounded::<ParamsMsg>();
        param_txs.push(tx);
        param_rxs.push(rx);
    }
    let mut drafters = p.drafters.into_iter();
    let mut heads = p.heads.into_iter();
    let coordinator = Coordinator {
        shared: shared.clone(),
        config: config.clone(),
        drafter: drafters
            .next()
            .ok_or_else(|| anyhow!("no drafter device"))?,
        head: heads.next().ok_or_else(|| anyhow!("no drafter device"))?,
        optimizer: p.optimizer,
        grad_rx,
        param_txs,
        sync: coordinator_sync,
        step: p.start_step,
        total_steps: p.total_steps,
        last_seen: None,
        tokens_seen: p.tokens_seen,
        samples_seen: p.samples_seen,
        last_save: Instant::now(),
        saved_step: None,
        retry: None,
        injected_checkpoint_failures: 0,
        held_out: p.held_out,
        queued: None,
        events: DeviceEvents::load(),
        last_step_end: Instant::now(),
    };
    {
        let shared = shared.clone();
        threads.push(spawn(
            "drafter-0".into(),
            Box::new(move || {
                let mut c = coordinator;
                run_stage(&shared, "drafter worker 0", || c.run());
                for tx in &c.param_txs {
                    let _ = tx.send(ParamsMsg::Stop);
                }
                shared.stop.store(true, Ordering::Relaxed);
                shared.batch_q.wake_all();
                shared.feature_q.wake_all();
            }),
        )?);
    }
    let workers = drafters.zip(heads.zip(param_rxs.into_iter().zip(replica_syncs)));
    for (r, (drafter, (head, (rx, sync)))) in workers.enumerate() {
        let r = r + 1;
        let shared = shared.clone();
        let cfg = config.clone();
        let tx = grad_tx.clone();
        threads.push(spawn(
            format!("drafter-{r}"),
            Box::new(move || {
                run_stage(&shared, &format!("drafter worker {r}"), || {
                    replica(&shared, &cfg, r, drafter, head, tx, rx, sync)
                });
                // a replica that ends (or fails) stops the step it would have joined
                shared.stop.store(true, Ordering::Relaxed);
                shared.batch_q.wake_all();
                shared.feature_q.wake_all();
            }),
        )?);
    }
    shared.set_phase(Phase::WarmingUp);
    Ok(TrainerHandle { shared, threads })
}

fn loader(
    shared: &Shared,
    store: Arc<TokenStore>,
    cfg: &TrainConfig,
    mut packer: Packer,
) -> Result<()> {
    let mut seq = 0u64;
    loop {
        if !shared.wait_if_paused() {
            return Ok(());
        }
        let batch = shared
            .profile
            .time(Event::LOADER_FETCH, || packer.next())
            .ok_or_else(|| anyhow!("the data set yields no batch"))?;
        let resume = packer.state();
        let item = shared.profile.time(Event::LOADER_PACK, || {
            batch_item(&store, &batch, seq, resume)
        });
        if cfg.debug.fail_stage == "loader"
            && cfg.debug.fail_at_step > 0
            && seq + 1 == cfg.debug.fail_at_step
        {
            return Err(injected_failure(cfg, format!("batch {seq}")));
        }
        seq += 1;
        match shared.batch_q.push(item) {
            Ok(()) => {}
            Err((_, QueueClosed::Stopped)) | Err((_, QueueClosed::Drained)) => return Ok(()),
        }
    }
}

/// An injected failure of a stage (`[debug]`): an error, or a panic as a libtorch error inside
/// a tch call gives.
fn injected_failure(cfg: &TrainConfig, what: String) -> anyhow::Error {
    let stage = &cfg.debug.fail_stage;
    if cfg.debug.fail_mode == "panic" {
        panic!("{what}: injected panic (debug.fail_stage = \"{stage}\")");
    }
    anyhow!("{what}: injected failure (debug.fail_stage = \"{stage}\")")
}

/// Runs a stage's work, turning a panic into the run's failure like an error: the panic
/// message goes to the log and `metrics.jsonl` and every stage stops (the caller then closes
/// its queues, as after a normal end).
fn run_stage(shared: &Shared, stage: &str, work: impl FnOnce() -> Result<()>) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    let error = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(payload) => anyhow!(
            "panicked: {}",
            crate::aten_ext::graph::panic_message(payload.as_ref())
        ),
    };
    shared.fail(stage, &error);
}

/// A packed batch as the target and drafter stages take it.
pub(crate) fn batch_item(
    store: &TokenStore,
    batch: &crate::data::packer::Batch,
    seq: u64,
    resume: PackerState,
) -> BatchItem {
    let c = collate(store, batch);
    let ids = Vec::<i64>::try_from(&c.input_ids.view([-1])).unwrap_or_default();
    let mask = Vec::<i64>::try_from(&c.loss_mask.view([-1])).unwrap_or_default();
    BatchItem {
        seq,
        resume,
        epoch: batch.epoch,
        samples: batch.indices.clone(),
        lengths: c.lengths,
        stride: batch.max_len,
        ids,
        mask,
        input_ids: c.input_ids,
    }
}

/// `wait_for_device`: wait for each forward to finish on the device, so that `target.forward`
/// times the device's work. Off where a drafter shares the device: the wait would be for the
/// drafter's queued work too, and one stream orders the drafter after the forward anyway
/// (there `target.forward` is the time to queue the forward).
fn target_worker(
    shared: &Shared,
    target: &TargetModel,
    taps: &[usize],
    cfg: &TrainConfig,
    wait_for_device: bool,
) -> Result<()> {
    let soft = cfg.train.kl_weight > 0.0;
    let req = ForwardRequest {
        tap_layers: taps.to_vec(),
        final_hidden: soft,
        logits: false,
    };
    let mut count = 0u64;
    loop {
        if !shared.wait_if_paused() {
            return Ok(());
        }
        let t = Instant::now();
        let batch = match shared.batch_q.pop() {
            Ok(b) => b,
            Err(_) => return Ok(()),
        };
        shared.profile.record(Event::BATCH_Q_WAIT, t.elapsed());
        // pinned and non-blocking: a pageable copy would wait for the device's queued work
        let ids = shared.profile.time(Event::TARGET_H2D, || {
            upload(&batch.input_ids, target.device)
        });
        let out = shared.profile.time(Event::TARGET_FORWARD, || {
            let out = target.run(&ids, None, &req);
            if wait_for_device {
                sync_device(target.device);
            }
            out
        });
        count += 1;
        if cfg.debug.fail_stage == "target"
            && cfg.debug.fail_at_step > 0
            && count == cfg.debug.fail_at_step
        {
            return Err(injected_failure(cfg, format!("batch {}", batch.seq)));
        }
        let features = out
            .features
            .ok_or_else(|| anyhow!("the target returned no features"))?;
        let item = FeatureItem {
            batch,
            features,
            teacher_hidden: out.final_hidden,
        };
        let t = Instant::now();
        let pushed = shared.feature_q.push(item);
        shared.profile.record(Event::TARGET_HANDOFF, t.elapsed());
        if pushed.is_err() {
            return Ok(());
        }
    }
}

/// Forward and backward of one replica over its micro-batches of a step.
struct MicroResult {
    /// On the drafter's device (read once per step by the coordinator).
    sums: LossTensors,
    tokens: u64,
    samples: u64,
    /// (seq, resume state, epoch) of the newest batch consumed
    last: Option<(u64, PackerState, u64)>,
}

/// The drafter's work on one batch of target features: anchors, forward, loss, backward
/// (gradients accumulate into the parameters, scaled by `scale`). The loss sums stay on the
/// device: reading them is the step's one synchronisation, after the backward is queued.
/// Clip, AdamW on the fp32 master weights, and the new weights into the compute copy; returns
/// the gradient norm before clipping, still on the device.
pub(crate) fn apply_update(
    optimizer: &mut AdamW,
    params: &[(String, &Tensor)],
    grad: &mut Tensor,
    clip: f64,
    lr: f64,
) -> Result<Tensor> {
    let norm = optimizer.update_clipped(grad, lr, clip)?;
    optimizer.write_params(params)?;
    Ok(norm)
}

/// [`Drafter::warm_up_attention`] on a drafter worker's thread (the kernels' plans are kept
/// per thread), with a line in the log.
fn warm_up_attention(
    shared: &Shared,
    drafter: &Drafter,
    head: &FrozenHead,
    cfg: &TrainConfig,
    replica: usize,
) {
    let t = Instant::now();
    let warmed = drafter.warm_up_attention(head, cfg.data.max_len);
    if warmed > 0 {
        shared.event(
            "warm_up",
            format!(
                "drafter worker {replica}: attention kernels planned for {warmed} context lengths in {:.1} s",
                t.elapsed().as_secs_f64()
            ),
        );
    }
}

pub(crate) fn sync_device(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

pub(crate) fn train_on_item(
    profile: &ProfileStats,
    cfg: &TrainConfig,
    drafter: &Drafter,
    head: &FrozenHead,
    item: &FeatureItem,
    seed: u64,
    scale: f64,
) -> LossTensors {
    let block = drafter.config.block_size as usize;
    let gamma = cfg.train.effective_gamma(drafter.config.block_size);
    let opts = LossOptions {
        kl_weight: cfg.train.kl_weight,
        kl_temperature: cfg.train.kl_temperature,
        streak_alpha: cfg.train.streak_alpha,
        chunk_rows: LossOptions::chunk_rows_for_vocab(head.lm_head.size()[0]),
    };
    let b = &item.batch;
    let (plan, targets) = profile.time(Event::DRAFTER_ANCHORS, || {
        let plan = sample_anchors(
            &b.mask,
            &b.lengths,
            b.stride,
            block,
            cfg.train.num_anchors,
            seed,
        );
        let targets = block_targets(&b.ids, &b.mask, &b.lengths, b.stride, &plan, block, gamma);
        (plan, targets)
    });
    let dev = drafter.device;
    let rows = plan.rows as i64;
    let batch = AnchorBatch {
        input_ids: Tensor::from_slice(&b.ids).view([rows, b.stride as i64]),
        anchors: Tensor::from_slice(&plan.anchors).view([rows, plan.per_row as i64]),
        valid: Tensor::from_slice(&plan.valid).view([rows, plan.per_row as i64]),
    };
    let hidden = profile.time(Event::DRAFTER_FORWARD, || {
        drafter.forward_train(head, &item.features.to_device(dev), &batch)
    });
    let teacher = item.teacher_hidden.as_ref().map(|t| t.to_device(dev));
    let (sums, pending) = profile.time(Event::DRAFTER_LOSS, || {
        loss_and_backward_deferred(
            &hidden,
            &head.lm_head,
            &targets,
            &plan.valid,
            teacher.as_ref(),
            &opts,
            scale,
        )
    });
    if let Some(p) = pending {
        profile.time(Event::DRAFTER_BACKWARD, || p.run());
    }
    sums
}

fn accumulate(
    shared: &Shared,
    cfg: &TrainConfig,
    drafter: &Drafter,
    head: &FrozenHead,
    replica: usize,
    step: u64,
) -> Result<Option<MicroResult>> {
    let mut out = MicroResult {
        sums: LossTensors::zeros(drafter.device),
        tokens: 0,
        samples: 0,
        last: None,
    };
    // Each batch's gradient counts 1 / (the step's batches over all replicas): the sum over
    // the replicas is the mean over the step's batches.
    let micro_batches = cfg.replica_batches(replica);
    let scale = 1.0 / cfg.step_batches() as f64;
    for micro in 0..micro_batches {
        if !shared.wait_if_paused() {
            return Ok(None);
        }
        let t = Instant::now();
        let item = match shared.feature_q.pop() {
            Ok(i) => i,
            Err(QueueClosed::Stopped) => return Ok(None),
            Err(QueueClosed::Drained) => bail!("the target workers ended before training did"),
        };
        shared.profile.record(Event::FEATURE_Q_WAIT, t.elapsed());
        let b = &item.batch;
        let sums = train_on_item(
            &shared.profile,
            cfg,
            drafter,
            head,
            &item,
            seed_for(cfg.run.seed, step, replica, micro),
            scale,
        );
        out.sums.add(&sums);
        out.tokens += b.lengths.iter().map(|&l| l as u64).sum::<u64>();
        out.samples += b.samples.len() as u64;
        for &s in &b.samples {
            if let Some(v) = shared.sample_visits.get(s) {
                v.fetch_add(1, Ordering::Relaxed);
            }
        }
        if out.last.is_none_or(|(seq, _, _)| b.seq > seq) {
            out.last = Some((b.seq, b.resume, b.epoch));
        }
    }
    Ok(Some(out))
}

#[allow(clippy::too_many_arguments)]
fn replica(
    shared: &Shared,
    cfg: &TrainConfig,
    r: usize,
    drafter: Drafter,
    head: FrozenHead,
    tx: Sender<GradMsg>,
    rx: Receiver<ParamsMsg>,
    mut sync: ReplicaSync,
) -> Result<()> {
    let mut step = shared.status().step;
    sync.prepare(&drafter.named_parameters());
    warm_up_attention(shared, &drafter, &head, cfg, r);
    loop {
        let Some(res) = accumulate(shared, cfg, &drafter, &head, r, step)? else {
            return Ok(());
        };
        let params = drafter.named_parameters();
        let out = shared.profile.time(Event::GRAD_SYNC, || {
            sync.outgoing(AdamW::flatten_grads(&params))
        });
        if tx
            .send(GradMsg {
                replica: r,
                out,
                sums: res.sums,
                tokens: res.tokens,
                samples: res.samples,
                last: res.last,
            })
            .is_err()
        {
            return Ok(());
        }
        if !sync.exchange(&rx, &params)? {
            return Ok(());
        }
        step += 1;
    }
}

/// An optimizer step whose work is queued on the device and whose numbers (loss sums, gradient
/// norm) were not read yet: they are read once the next step's work is queued behind them.
struct QueuedStep {
    /// The step number after the update.
    step: u64,
    epoch: u64,
    tokens_seen: u64,
    samples_seen: u64,
    /// On the device, or host copies queued behind the step's work (see `ready`).
    sums: LossTensors,
    grad_norm: Tensor,
    ready: Readiness,
    lr: f64,
    tokens: u64,
    samples: u64,
    started: Instant,
}

/// When the numbers of a [`QueuedStep`] can be read.
enum Readiness {
    /// They are on the device: reading them waits for it.
    OnDevice,
    /// Host copies, there once this event (recorded after them) has passed.
    AfterEvent(DeviceEvent),
    /// Host copies, but the runtime gave no event: there once the device has finished.
    AfterDevice,
}

struct Coordinator {
    shared: Arc<Shared>,
    config: Arc<TrainConfig>,
    drafter: Drafter,
    head: FrozenHead,
    optimizer: AdamW,
    grad_rx: Receiver<GradMsg>,
    param_txs: Vec<Sender<ParamsMsg>>,
    sync: CoordinatorSync,
    step: u64,
    total_steps: u64,
    /// (seq, resume, epoch) of the newest batch consumed
    last_seen: Option<(u64, PackerState, u64)>,
    tokens_seen: u64,
    samples_seen: u64,
    last_save: Instant,
    /// The step this process last saved (the same step is not written twice).
    saved_step: Option<u64>,
    /// After a failed checkpoint: the step at which to try again, and the gap to the next try.
    retry: Option<(u64, u64)>,
    /// Checkpoint failures injected so far (`[debug]`).
    injected_checkpoint_failures: u64,
    held_out: Option<HeldOut>,
    queued: Option<QueuedStep>,
    /// CUDA events (see [`QueuedStep`]); `None` on the CPU or without the CUDA runtime.
    events: Option<DeviceEvents>,
    last_step_end: Instant,
}

impl Coordinator {
    fn run(&mut self) -> Result<()> {
        let cfg = self.config.clone();
        warm_up_attention(&self.shared, &self.drafter, &self.head, &cfg, 0);
        let warmup = (cfg.train.warmup_ratio * self.total_steps as f64).round() as u64;
        while self.step < self.total_steps {
            if self.handle_requests()? {
                return Ok(());
            }
            // About to wait (paused, or no features yet): the queued step's numbers first, so
            // that what the operator sees is not a step behind while nothing moves.
            if self.shared.paused.load(Ordering::Relaxed) || self.shared.feature_q.is_empty() {
                self.finish_queued()?;
            }
            let step_started = Instant::now();
            let Some(res) =
                accumulate(&self.shared, &cfg, &self.drafter, &self.head, 0, self.step)?
            else {
                // stopping: the last step's record still goes out
                return self.finish_queued();
            };
            let params = self.drafter.named_parameters();
            let t = Instant::now();
            let mut grad = AdamW::flatten_grads(&params);
            let mut sums = res.sums;
            let (mut tokens, mut samples) = (res.tokens, res.samples);
            let mut newest = res.last;
            let mut outgoing = Vec::with_capacity(self.param_txs.len());
            for _ in 0..self.param_txs.len() {
                let Some(msg) = self.receive_replica()? else {
                    // a stage failed (or the run was aborted) while this step waited
                    return self.finish_queued();
                };
                outgoing.push((msg.replica, msg.out));
                sums.add(&msg.sums);
                tokens += msg.tokens;
                samples += msg.samples;
                if msg
                    .last
                    .is_some_and(|(s, _, _)| newest.is_none_or(|(n, _, _)| s > n))
                {
                    newest = msg.last;
                }
            }
            // the replicas' gradients and NCCL weight buffers in replica (rank) order
            outgoing.sort_by_key(|(replica, _)| *replica);
            let (others, buffers): (Vec<Tensor>, Vec<Option<Tensor>>) = outgoing
                .into_iter()
                .map(|(_, o)| (o.grad, o.weights))
                .unzip();
            let buffers: Vec<Tensor> = buffers.into_iter().flatten().collect();
            // (each replica's gradient is already scaled to its share of the step's mean)
            self.sync.reduce(&mut grad, &others)?;
            drop(others);
            self.shared.profile.record(Event::GRAD_SYNC, t.elapsed());
            let lr = lr_at(
                self.step,
                self.total_steps,
                warmup,
                cfg.train.lr,
                cfg.train.min_lr_ratio,
            );
            let grad_norm = self.shared.profile.time(Event::OPTIM_STEP, || {
                apply_update(
                    &mut self.optimizer,
                    &params,
                    &mut grad,
                    cfg.train.clip_grad_norm,
                    lr,
                )
            })?;
            self.sync.hand_back(&params, &buffers, &self.param_txs)?;
            self.step += 1;
            if newest.is_some() {
                self.last_seen = newest;
            }
            self.tokens_seen += tokens;
            self.samples_seen += samples;
            // This step's numbers go to the host behind its work, and an event marks their
            // arrival; they are read once the next step is queued, and waiting for the event
            // waits for this step only (a blocking read would wait for everything queued by
            // then, the next step included, and leave the device idle between steps).
            let dev = self.drafter.device;
            let (sums, grad_norm, ready) = match self.events.filter(|_| dev.is_cuda()) {
                Some(events) => {
                    let sums = sums.to_host_async();
                    let norm = grad_norm.to_device_(Device::Cpu, grad_norm.kind(), true, false);
                    let ready = match events.record(dev) {
                        Some(event) => Readiness::AfterEvent(event),
                        None => Readiness::AfterDevice,
                    };
                    (sums, norm, ready)
                }
                None => (sums, grad_norm, Readiness::OnDevice),
            };
            let queued = QueuedStep {
                step: self.step,
                epoch: self.last_seen.map_or(0, |(_, _, e)| e),
                tokens_seen: self.tokens_seen,
                samples_seen: self.samples_seen,
                sums,
                grad_norm,
                ready,
                lr,
                tokens,
                samples,
                started: step_started,
            };
            if let Some(previous) = self.queued.replace(queued) {
                self.finish_step(previous)?;
            }
            let eval_due =
                cfg.eval.every_steps > 0 && self.step.is_multiple_of(cfg.eval.every_steps);
            let validation_due = cfg.validation.every_steps > 0
                && (eval_due || self.step.is_multiple_of(cfg.validation.every_steps));
            let periodic_steps = cfg.checkpoint.save_every_steps > 0
                && self.step.is_multiple_of(cfg.checkpoint.save_every_steps);
            // (a checkpoint that failed is retried on its own schedule)
            let periodic_time = cfg.checkpoint.save_every_minutes > 0.0
                && self.retry.is_none()
                && self.last_save.elapsed().as_secs_f64()
                    >= cfg.checkpoint.save_every_minutes * 60.0;
            let fault_due = cfg.debug.fail_stage == "drafter"
                && cfg.debug.fail_at_step > 0
                && self.step == cfg.debug.fail_at_step;
            if eval_due || validation_due || periodic_steps || periodic_time || fault_due {
                self.finish_queued()?;
            }
            if fault_due {
                return Err(injected_failure(&cfg, format!("step {}", self.step)));
            }
            if eval_due {
                self.evaluate()?;
            }
            if validation_due {
                self.validate()?;
                if let Some(reason) = self.patience_exhausted() {
                    return self.stop_early(reason);
                }
            }
            let retry_due = self.retry.is_some_and(|(at, _)| self.step >= at);
            if periodic_steps || periodic_time || retry_due {
                self.finish_queued()?;
                self.checkpoint(if retry_due && !(periodic_steps || periodic_time) {
                    "retry"
                } else {
                    "periodic"
                });
            }
        }
        self.finish_queued()?;
        self.final_measurements()?;
        self.final_checkpoint("final")?;
        self.shared.set_phase(Phase::Finished);
        self.shared
            .event("finished", format!("finished after {} steps", self.step));
        Ok(())
    }

    /// The next replica's gradient message; `None` once the run stops (a failed stage must not
    /// leave this thread waiting for a replica that is gone).
    fn receive_replica(&self) -> Result<Option<GradMsg>> {
        loop {
            match self.grad_rx.recv_timeout(Duration::from_millis(100)) {
                Ok(msg) => return Ok(Some(msg)),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if self.shared.stopping() {
                        return Ok(None);
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    bail!("a drafter replica stopped")
                }
            }
        }
    }

    /// Reads the numbers of the step still queued on the device, if any (see [`QueuedStep`]).
    fn finish_queued(&mut self) -> Result<()> {
        match self.queued.take() {
            Some(q) => self.finish_step(q),
            None => Ok(()),
        }
    }

    /// The step's record: its numbers read from the device (the step's one wait for it),
    /// written to the metrics and the status.
    fn finish_step(&mut self, q: QueuedStep) -> Result<()> {
        // (numbers on the device: the blocking read below waits for them)
        let copies_pending = match &q.ready {
            Readiness::OnDevice => false,
            Readiness::AfterEvent(event) => !event.wait(),
            Readiness::AfterDevice => true,
        };
        if copies_pending {
            sync_device(self.drafter.device);
        }
        let sums: LossSums = q.sums.to_host();
        let grad_norm = q.grad_norm.double_value(&[]);
        let now = Instant::now();
        let step_s = now
            .duration_since(self.last_step_end)
            .as_secs_f64()
            .max(1e-9);
        self.last_step_end = now;
        self.shared
            .profile
            .record(Event::STEP_TOTAL, now.duration_since(q.started));
        let rates = {
            let mut st = self.shared.status();
            st.rates.complete(now, q.tokens, q.samples);
            st.rates.windowed(now)
        };
        let record = StepRecord {
            step: q.step,
            epoch: q.epoch,
            loss: sums.loss(),
            accuracy: sums.accuracy(),
            accept_mean: sums.accept_mean(),
            lr: q.lr,
            grad_norm,
            tokens: q.tokens,
            samples: q.samples,
            blocks: sums.blocks.round() as u64,
            step_s,
            tokens_per_s: rates.tokens_per_s,
            samples_per_s: rates.samples_per_s,
            elapsed_s: self.shared.elapsed_s(),
        };
        if !record.loss.is_finite() {
            bail!("step {}: the loss is {} (diverged)", q.step, record.loss);
        }
        self.shared
            .metrics
            .write(&MetricsRecord::Step(record.clone()));
        let mut st = self.shared.status();
        st.step = q.step;
        st.epoch = q.epoch;
        st.tokens_seen = q.tokens_seen;
        st.samples_seen = q.samples_seen;
        if st.history.len() >= HISTORY {
            st.history.remove(0);
        }
        st.history.push(record);
        if st.phase == Some(Phase::WarmingUp) {
            st.phase = Some(Phase::Training);
        }
        Ok(())
    }

    /// At the end of a run, the last weights are evaluated and validated too (unless this
    /// step already was), so that `best/` never misses them.
    fn final_measurements(&mut self) -> Result<()> {
        let Some(h) = &self.held_out else {
            return Ok(());
        };
        let step = Some(self.step);
        let evaluate = h.evaluates() && h.last_eval != step;
        let validate = h.validates() && h.last_validation != step;
        if self.step > 0 && evaluate {
            self.evaluate()?;
        }
        if self.step > 0 && validate {
            self.validate()?;
        }
        Ok(())
    }

    /// Acceptance length on the held-out prompts by real speculative decoding; without
    /// validation, a new best drafter is saved to `RUN_DIR/best/`.
    fn evaluate(&mut self) -> Result<()> {
        let Some(h) = self.held_out.as_mut() else {
            return Ok(());
        };
        let previous = self.shared.status().phase;
        self.shared.set_phase(Phase::Evaluating);
        let t = Instant::now();
        let max_new_tokens = self.config.eval.max_new_tokens;
        let summary = h
            .evaluate(&self.drafter, &self.head, self.step, max_new_tokens)
            .with_context(|| format!("evaluation at step {}", self.step))?;
        let eval_s = t.elapsed().as_secs_f64();
        let candidate = BestEval {
            step: self.step,
            tau: summary.tau,
            rule: BestRule::EvalDecodedTau,
            prompts: h.prompts(),
            sequences: 0,
            max_new_tokens,
        };
        let best = h.offer_best(&self.shared.run_dir, &self.drafter, candidate)?;
        let record = EvalRecord {
            step: self.step,
            tau: summary.tau,
            prompts: h.prompts(),
            decode_steps: summary.decode_steps,
            generated_tokens: summary.generated_tokens,
            accepted_by_slot: summary.accepted_by_slot,
            eval_s,
            best,
            elapsed_s: self.shared.elapsed_s(),
        };
        self.shared
            .metrics
            .write(&MetricsRecord::Eval(record.clone()));
        let note = self.best_note(best, BestRule::EvalDecodedTau);
        {
            let mut st = self.shared.status();
            if st.evals.len() >= EVAL_HISTORY {
                st.evals.remove(0);
            }
            st.evals.push(record.clone());
        }
        self.shared.event(
            "eval",
            format!(
                "eval at step {}: tau {:.3} over {} prompts ({} tokens, {:.1} s){note}",
                self.step, record.tau, record.prompts, record.generated_tokens, eval_s
            ),
        );
        if let Some(p) = previous {
            self.shared.set_phase(p);
        }
        Ok(())
    }

    /// A validation pass on the held-out sequences (see [`crate::train::validation`]); a new
    /// best walk tau saves the drafter to `RUN_DIR/best/`.
    fn validate(&mut self) -> Result<()> {
        let Some(h) = self.held_out.as_mut() else {
            return Ok(());
        };
        let previous = self.shared.status().phase;
        self.shared.set_phase(Phase::Validating);
        let t = Instant::now();
        let v = h
            .validate(&self.drafter, &self.head, self.step)
            .with_context(|| format!("validation at step {}", self.step))?;
        let validation_s = t.elapsed().as_secs_f64();
        if !v.loss.is_finite() {
            bail!(
                "validation at step {}: the loss is {} (diverged)",
                self.step,
                v.loss
            );
        }
        let candidate = BestEval {
            step: self.step,
            tau: v.tau,
            rule: BestRule::ValidationWalkTau,
            prompts: 0,
            sequences: v.sequences,
            max_new_tokens: self.config.validation.max_new_tokens,
        };
        let best = h.offer_best(&self.shared.run_dir, &self.drafter, candidate)?;
        let record = ValidationRecord {
            step: self.step,
            loss: v.loss,
            accuracy: v.accuracy,
            accept_mean: v.accept_mean,
            tau: v.tau,
            sequences: v.sequences,
            answers: v.walks.len() as u64,
            answer_steps: v.walk_steps(),
            tokens: v.walk_tokens(),
            blocks: v.blocks,
            validation_s,
            best,
            elapsed_s: self.shared.elapsed_s(),
        };
        self.shared
            .metrics
            .write(&MetricsRecord::Validation(record.clone()));
        let note = self.best_note(best, BestRule::ValidationWalkTau);
        {
            let mut st = self.shared.status();
            if st.validations.len() >= EVAL_HISTORY {
                st.validations.remove(0);
            }
            st.validations.push(record.clone());
        }
        self.shared.event(
            "validation",
            format!(
                "validation at step {}: loss {:.4} acc {:.3} tau(walk) {:.3} (anchor mean {:.3}) over {} sequences ({} answers, {} steps, {:.1} s){note}",
                self.step,
                record.loss,
                record.accuracy,
                record.tau,
                record.accept_mean,
                record.sequences,
                record.answers,
                record.answer_steps,
                validation_s
            ),
        );
        if let Some(p) = previous {
            self.shared.set_phase(p);
        }
        Ok(())
    }

    /// "; new best, saved to ..." or "; best X at step N" for a measurement of `rule`; nothing
    /// when another rule chooses the best drafter.
    fn best_note(&self, best: bool, rule: BestRule) -> String {
        let Some(h) = self.held_out.as_ref().filter(|h| h.rule() == rule) else {
            return String::new();
        };
        match h.best() {
            Some(_) if best => format!(
                "; new best, saved to {}",
                self.shared.run_dir.join("best").display()
            ),
            Some(b) => format!("; best {:.3} at step {}", b.tau, b.step),
            None => String::new(),
        }
    }

    /// Why the run stops here, when `validation.patience` passes went by without a new best.
    fn patience_exhausted(&self) -> Option<String> {
        let patience = self.config.validation.patience;
        let h = self.held_out.as_ref()?;
        if patience == 0 || h.since_best < patience {
            return None;
        }
        let best = h
            .best()
            .map(|b| format!(" (best {:.3} at step {})", b.tau, b.step))
            .unwrap_or_default();
        Some(format!(
            "early stop at step {}: no new best validation tau in {} passes{best} (validation.patience = {patience})",
            self.step, h.since_best
        ))
    }

    /// Ends the run before its last step: the last weights measured (as at the end of a run)
    /// and checkpointed, and `reason` in the log and the summary.
    fn stop_early(&mut self, reason: String) -> Result<()> {
        self.shared.set_phase(Phase::Stopping);
        self.final_measurements()?;
        self.final_checkpoint("early stop")?;
        self.shared.status().stop_reason = Some(reason.clone());
        self.shared.set_phase(Phase::Finished);
        self.shared.event("early_stop", reason);
        Ok(())
    }

    /// Checkpoint and stop requests at a step boundary; true when the run should end.
    fn handle_requests(&mut self) -> Result<bool> {
        let checkpoint = self.shared.checkpoint_requested.load(Ordering::SeqCst);
        if checkpoint || self.shared.stop_requested.load(Ordering::SeqCst) != 0 {
            self.finish_queued()?;
        }
        if self
            .shared
            .checkpoint_requested
            .swap(false, Ordering::SeqCst)
        {
            self.checkpoint("command");
        }
        match self.shared.stop_requested.load(Ordering::SeqCst) {
            1 => {
                self.shared.set_phase(Phase::Stopping);
                self.final_measurements()?;
                self.final_checkpoint("stop")?;
                self.shared.status().stop_reason = Some("stop command".into());
                self.shared.set_phase(Phase::Finished);
                self.shared.event(
                    "stopped",
                    format!("stopped at step {} by command", self.step),
                );
                Ok(true)
            }
            2 => {
                self.shared.status().stop_reason = Some("stop command, no checkpoint".into());
                self.shared.set_phase(Phase::Finished);
                self.shared.event(
                    "stopped",
                    format!("stopped at step {} without checkpoint", self.step),
                );
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// A checkpoint during the run. A failure (a full disk, permissions) does not end the run:
    /// it is reported (log, screen, `metrics.jsonl`), the previous checkpoint stays, and the
    /// checkpoint is tried again after 1, 2, 4, ... up to 64 steps.
    fn checkpoint(&mut self, why: &str) {
        match self.write_checkpoint(why) {
            Ok(()) => {
                if self.retry.take().is_some() {
                    self.shared.event(
                        "checkpoint",
                        format!("checkpoints work again at step {}", self.step),
                    );
                }
            }
            Err(e) => {
                let gap = self.retry.map_or(1, |(_, gap)| (gap * 2).min(64));
                self.retry = Some((self.step + gap, gap));
                let message = format!(
                    "{e:#}; training goes on, the checkpoint is tried again at step {}",
                    self.step + gap
                );
                log::warn!("{message}");
                self.shared.metrics.write(&MetricsRecord::Event {
                    elapsed_s: self.shared.elapsed_s(),
                    kind: "checkpoint_failed".into(),
                    message,
                });
            }
        }
    }

    /// The checkpoint that ends a run (its end, a stop command, early stopping): a failure
    /// fails the run, naming the checkpoint that is kept.
    fn final_checkpoint(&mut self, why: &str) -> Result<()> {
        self.write_checkpoint(why).map_err(|e| {
            let kept = self.shared.status().last_checkpoint.clone();
            e.context(format!(
                "the {why} checkpoint failed; the last checkpoint kept is {}",
                kept.map_or("none".into(), |p| p.display().to_string())
            ))
        })
    }

    fn write_checkpoint(&mut self, why: &str) -> Result<()> {
        if self.step == 0 || self.saved_step == Some(self.step) {
            // nothing trained yet, or this step saved already by this process
            return Ok(());
        }
        let previous = self.shared.status().phase;
        self.shared.set_phase(Phase::Checkpointing);
        let result = self.save(why);
        if let Some(p) = previous {
            self.shared.set_phase(p);
        }
        result
    }

    fn save(&mut self, why: &str) -> Result<()> {
        let cfg = &self.config;
        let injected = cfg.debug.fail_stage == "checkpoint"
            && cfg.debug.fail_at_step > 0
            && self.step >= cfg.debug.fail_at_step
            && (cfg.debug.fail_count == 0
                || self.injected_checkpoint_failures < cfg.debug.fail_count);
        let fault = if injected {
            self.injected_checkpoint_failures += 1;
            match HoldPoint::from_mode(&cfg.debug.fail_mode) {
                Some(point) => CheckpointFault::Hold(point),
                None if cfg.debug.fail_mode == "panic" => {
                    panic!(
                        "checkpoint at step {}: injected panic (debug.fail_stage = \"checkpoint\")",
                        self.step
                    )
                }
                None => CheckpointFault::DiskFullAfterDrafter,
            }
        } else {
            CheckpointFault::None
        };
        let (packer, epoch) = self
            .last_seen
            .map(|(_, s, e)| (s, e))
            .unwrap_or((PackerState::default(), 0));
        let last = self.shared.status().history.last().cloned();
        let state = TrainerState {
            step: self.step,
            epoch,
            packer,
            total_steps: self.total_steps,
            tokens_seen: self.tokens_seen,
            samples_seen: self.samples_seen,
            seed: cfg.run.seed,
            lr: last.as_ref().map_or(0.0, |l| l.lr),
            loss: last.as_ref().map_or(f64::NAN, |l| l.loss),
            elapsed_s: self.shared.elapsed_s(),
            saved_at_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            validations_since_best: self.held_out.as_ref().map_or(0, |h| h.since_best),
        };
        let t = Instant::now();
        let saved = save_checkpoint(
            &self.shared.run_dir,
            &self.drafter,
            &self.optimizer,
            &state,
            cfg.checkpoint.keep_checkpoints,
            fault,
        );
        self.shared
            .profile
            .record(Event::CHECKPOINT_SAVE, t.elapsed());
        let path = saved.with_context(|| {
            format!(
                "checkpoint ({why}) at step {} failed; the previous checkpoint is kept",
                self.step
            )
        })?;
        self.last_save = Instant::now();
        self.saved_step = Some(self.step);
        self.shared.status().last_checkpoint = Some(path.clone());
        self.shared.event(
            "checkpoint",
            format!(
                "checkpoint ({why}) at step {}: {} in {:.2} s",
                self.step,
                path.display(),
                t.elapsed().as_secs_f64()
            ),
        );
        Ok(())
    }
}

impl TrainerHandle {
    /// Applies a command; the reply says what happened or why it could not apply.
    pub fn command(&self, cmd: &Command) -> std::result::Result<String, String> {
        let reply = self.apply(cmd);
        // Every operator command and its answer, whichever way it came.
        match &reply {
            Ok(r) => log::info!("command {cmd}: {r}"),
            Err(e) => log::warn!("command {cmd} refused: {e}"),
        }
        reply
    }

    fn apply(&self, cmd: &Command) -> std::result::Result<String, String> {
        let s = &self.shared;
        let phase = s.status().phase;
        if matches!(phase, Some(Phase::Finished) | Some(Phase::Failed)) {
            return Err(format!(
                "the run has ended ({}); {cmd} ignored",
                phase.unwrap_or(Phase::Finished)
            ));
        }
        let reply = match cmd {
            Command::Pause => {
                s.paused.store(true, Ordering::SeqCst);
                s.set_phase(Phase::Paused);
                "paused: stages stop at the next item boundary".to_string()
            }
            Command::Resume => {
                s.paused.store(false, Ordering::SeqCst);
                s.pause_cv.notify_all();
                let step = s.status().step;
                s.set_phase(if step > 0 {
                    Phase::Training
                } else {
                    Phase::WarmingUp
                });
                "resumed".to_string()
            }
            Command::Queue { name, depth } => {
                let q = match name.as_str() {
                    "batch_q" => s.batch_q.set_capacity(*depth),
                    "feature_q" => s.feature_q.set_capacity(*depth),
                    other => {
                        return Err(format!(
                            "unknown queue {other:?} (queues: batch_q, feature_q)"
                        ))
                    }
                };
                q?;
                format!("{name} depth set to {depth}")
            }
            Command::Checkpoint => {
                s.checkpoint_requested.store(true, Ordering::SeqCst);
                "checkpoint requested for the next step boundary".to_string()
            }
            Command::Profile { seconds } => {
                *s.profile_interval_s
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = *seconds;
                if *seconds > 0.0 {
                    format!("profile interval {seconds} s")
                } else {
                    "profile reports off".to_string()
                }
            }
            Command::Stop { checkpoint } => {
                s.stop_requested
                    .store(if *checkpoint { 1 } else { 2 }, Ordering::SeqCst);
                // Paused stages must wake up to reach the step boundary.
                s.paused.store(false, Ordering::SeqCst);
                s.pause_cv.notify_all();
                if *checkpoint {
                    "stopping after a checkpoint at the next step boundary".to_string()
                } else {
                    "stopping without checkpoint".to_string()
                }
            }
            Command::Status | Command::Snapshot { .. } => {
                return Err(format!(
                    "{cmd} is answered by the front end, not the trainer"
                ))
            }
        };
        s.metrics.write(&MetricsRecord::Event {
            elapsed_s: s.elapsed_s(),
            kind: "command".into(),
            message: format!("{cmd}: {reply}"),
        });
        Ok(reply)
    }

    /// Stops every stage at once (second signal, or a front end that gives up).
    pub fn abort(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.pause_cv.notify_all();
        self.shared.batch_q.wake_all();
        self.shared.feature_q.wake_all();
    }

    /// Steps done, the phase and the error, without copying the chart history (for polling).
    pub fn progress(&self) -> (u64, Phase, Option<String>) {
        let st = self.shared.status();
        (
            st.step,
            st.phase.unwrap_or(Phase::LoadingModel),
            st.error.clone(),
        )
    }

    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|(_, h)| h.is_finished())
    }

    pub fn profile_interval_s(&self) -> f64 {
        *self
            .shared
            .profile_interval_s
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the current ProfileStats interval, records and returns the report.
    pub fn profile_report(&self) -> ProfileReport {
        let report = self.shared.profile.report();
        self.shared
            .metrics
            .write(&MetricsRecord::Profile(report.clone()));
        self.shared.status().last_profile = Some(report.clone());
        report
    }

    pub fn write_record(&self, record: &MetricsRecord) {
        self.shared.metrics.write(record);
    }

    pub fn snapshot(&self) -> Snapshot {
        let s = &self.shared;
        let st = s.status();
        let last = st.history.last().cloned();
        let now = Instant::now();
        let ended = matches!(st.phase, Some(Phase::Finished | Phase::Failed));
        // A finished run shows its final averages and no ETA.
        let (rates, eta_s) = if ended {
            (st.rates.final_rates(), None)
        } else {
            let remaining = s.total_steps.saturating_sub(st.step);
            (st.rates.windowed(now), st.rates.eta_s(now, remaining))
        };
        Snapshot {
            run_name: s.run_name.clone(),
            run_dir: s.run_dir.display().to_string(),
            phase: st.phase.unwrap_or(Phase::LoadingModel),
            step: st.step,
            total_steps: s.total_steps,
            epoch: st.epoch,
            elapsed_s: s.elapsed_s(),
            eta_s,
            tokens_per_s: rates.tokens_per_s,
            samples_per_s: rates.samples_per_s,
            last,
            history: st.history.clone(),
            evals: st.evals.clone(),
            validations: st.validations.clone(),
            queues: s.queue_levels(),
            profile: st.last_profile.clone(),
            profile_interval_s: *s
                .profile_interval_s
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
            gpus: None,
            gpu_error: None,
            host: None,
            stage_devices: st.stage_devices.clone(),
            last_checkpoint: st.last_checkpoint.as_ref().map(|p| p.display().to_string()),
            error: st.error.clone(),
        }
    }

    /// Waits for every stage and writes the summary record.
    pub fn join(self) -> RunOutcome {
        for (name, h) in self.threads {
            if h.join().is_err() {
                let e = anyhow!("thread {name} panicked");
                self.shared.fail(&name, &e);
            }
        }
        let st = self.shared.status();
        let phase = if st.error.is_some() {
            Phase::Failed
        } else {
            Phase::Finished
        };
        let last = st.history.last().cloned();
        self.shared.metrics.write(&MetricsRecord::Summary {
            phase,
            steps: st.step,
            elapsed_s: self.shared.elapsed_s(),
            tokens_seen: st.tokens_seen,
            samples_seen: st.samples_seen,
            final_loss: last.as_ref().map(|l| l.loss),
            final_accuracy: last.as_ref().map(|l| l.accuracy),
            final_accept_mean: last.as_ref().map(|l| l.accept_mean),
            last_checkpoint: st.last_checkpoint.as_ref().map(|p| p.display().to_string()),
            error: st.error.clone(),
            stop_reason: st.stop_reason.clone(),
        });
        RunOutcome {
            phase,
            steps: st.step,
            error: st.error.clone(),
            last_checkpoint: st.last_checkpoint.clone(),
            final_step: last,
            stop_reason: st.stop_reason.clone(),
        }
    }
}
