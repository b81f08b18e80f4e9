//! Everything a run needs, loaded before any stage starts: devices, the targets, the data
//! store, the drafter replicas and the optimizer, the resume point, the held-out data.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use crate::aten_ext::graph::GraphLibrary;
use crate::config::{Dtype, TrainConfig};
use crate::data::packer::{Packer, PackerConfig, PackerState};
use crate::data::store::{DataColumns, StoreOptions, TokenStore};
use crate::model::{Drafter, DrafterConfig, FrozenHead, SharedTarget, TargetConfig, TargetModel};
use crate::pipeline::collective::{self, GradSyncPlan};
use crate::pipeline::held_out::{HeldOut, Resumed};
use crate::runtime::{DeviceSpec, TorchRuntime};
use crate::train::checkpoint::repair_latest;
use crate::train::optim::{AdamW, AdamWConfig};
use crate::train::resume::{self, DataBounds, ResumePoint};

/// Everything the stages need, prepared before any thread starts (so configuration and input
/// errors are reported before training begins).
pub(crate) struct Prepared {
    pub(super) config: TrainConfig,
    pub(crate) store: Arc<TokenStore>,
    pub(crate) targets: Vec<Arc<SharedTarget>>,
    pub(crate) drafters: Vec<Drafter>,
    pub(crate) heads: Vec<FrozenHead>,
    pub(crate) optimizer: AdamW,
    pub(crate) packer: Packer,
    pub(super) start_step: u64,
    pub(super) start_epoch: u64,
    pub(super) tokens_seen: u64,
    pub(super) samples_seen: u64,
    pub(super) total_steps: u64,
    pub(crate) target_devices: Vec<Device>,
    pub(crate) drafter_devices: Vec<Device>,
    pub(super) grad_sync: GradSyncPlan,
    pub(super) held_out: Option<HeldOut>,
    /// The checkpoint resumed from: the run's last checkpoint until it saves one.
    pub(super) resumed_from: Option<PathBuf>,
    /// The CUDA shim library, for the side streams of targets that share a device with a
    /// drafter (`devices.concurrent_target`); `None` without CUDA or with the setting off.
    pub(super) side_streams: Option<GraphLibrary>,
}

fn resolve_kind(dtype: Dtype, device: Device) -> Kind {
    dtype.kind(device)
}

fn load_target(
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

/// "X GiB in memory" of the target's weights in `dir` held as `kind`; on a GPU, refused (naming both
/// sizes) when they cannot fit it with a margin ([`crate::model::memory::check_fits`]). The
/// GPU's memory is NVML's smallest (NVML numbers GPUs regardless of CUDA_VISIBLE_DEVICES).
fn target_weight_bytes(dir: &Path, dev: Device, kind: Kind) -> Result<String> {
    let config = TargetConfig::from_model_dir(dir)?;
    let total = match crate::telemetry::gpu::nvml_status() {
        crate::telemetry::gpu::NvmlStatus::Available { gpus, .. } if dev.is_cuda() => {
            gpus.iter().filter_map(|g| g.memory_total_bytes).min()
        }
        _ => None,
    };
    crate::model::memory::weights_on_device(&config, kind, &super::device_name(dev), total)
}

/// "N layers, X GB of files" of the target in `dir` (its config.json and safetensors files), for the
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
    format!("{layers}, {:.2} GB of files", bytes as f64 / 1e9)
}

/// `writes`: whether this process may mend the run folder it resumes (rank 0, or the only
/// process); another rank of a multi-process run only reads it.
pub(crate) fn prepare(
    runtime: &TorchRuntime,
    config: &TrainConfig,
    resume: Option<&Path>,
    writes: bool,
) -> Result<Prepared> {
    let target_dir = PathBuf::from(&config.model.target);
    let target_devices = devices(
        runtime,
        &config.devices.target_devices,
        "devices.target_devices",
    )?;
    let drafter_devices = devices(
        runtime,
        &config.devices.drafter_devices,
        "devices.drafter_devices",
    )?;
    // Decided (and libnccl loaded, where NCCL is to be used) before any model is loaded.
    let grad_sync = collective::plan(
        config.devices.grad_sync,
        &config.devices.drafter_devices,
        &drafter_devices,
        runtime.libtorch_dir.as_deref(),
    )?;
    let target_kind = resolve_kind(config.model.dtype, target_devices[0]);
    let drafter_kind = resolve_kind(config.model.dtype, drafter_devices[0]);
    let targets = load_targets(config, &target_dir, &target_devices, target_kind)?;
    let target_cfg = &targets[0].config;

    // Drafter configuration: from drafter_init, the resume checkpoint, or fresh.
    let drafter_config = fit_drafter_config(config, target_cfg, &target_dir)?;
    let init_dir = config.model.drafter_init.as_deref();

    let store = load_store(config, target_cfg.vocab_size as usize)?;
    let packer_config = packer_config(config);
    let drafters = load_drafters(
        config,
        init_dir,
        &drafter_config,
        target_cfg,
        &drafter_devices,
        drafter_kind,
    )?;
    let mut optimizer = new_optimizer(config, &drafters[0], drafter_devices[0]);
    let total_steps = planned_steps(config, &store, &packer_config);

    let bounds = DataBounds {
        store: &store,
        packer: &packer_config,
    };
    let resumed = resume
        .map(|run_dir| resume_point(run_dir, &mut optimizer, &bounds))
        .transpose()?;
    let resumed_from = resumed.as_ref().map(|r| &r.checkpoint);
    let state = resumed.as_ref().map(|r| &r.state);
    let packer_state = state.map_or(PackerState::default(), |s| s.packer);
    let packer = start_packer(&store, &packer_config, packer_state, resumed_from)?;
    // Every replica starts from the master weights (exactly those saved, on resume).
    for d in &drafters {
        optimizer.write_params(&d.named_parameters())?;
    }
    let heads = drafter_devices
        .iter()
        .map(|&d| {
            // a target on the same device already compiled the fused kernels: no second copy
            let on_target = targets.iter().find(|t| t.device == d);
            let kernels = match on_target.and_then(|t| t.fused_kernels()) {
                Some(k) if config.train.fused_loss => Some(k),
                _ => runtime.fused_kernels(config.train.fused_loss, d),
            };
            FrozenHead::from_target(&targets[0], d, drafter_kind).with_loss_kernels(kernels)
        })
        .collect();
    let dev = drafter_devices[0];
    let held_out = HeldOut::prepare(
        config,
        &targets,
        dev,
        || load_target(config, &target_dir, dev, target_kind),
        resume.map(|run_dir| Resumed {
            run_dir,
            validations_since_best: state.map_or(0, |s| s.validations_since_best),
        }),
    )?;
    // Everything loaded: now the run directory may be touched.
    if let (Some(run_dir), Some(ckpt), true) = (resume, resumed_from, writes) {
        if repair_latest(run_dir, ckpt)? {
            log::warn!(
                "checkpoints/latest pointed elsewhere than {} (a run killed between saving and pointing at it, or a newer checkpoint that fails its verification): repaired",
                ckpt.display()
            );
        }
    }
    if let Some(r) = &resumed {
        rewrite_damaged_servable(r, &drafters[0])?;
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
        start_step: state.map_or(0, |s| s.step),
        start_epoch: state.map_or(0, |s| s.epoch),
        tokens_seen: state.map_or(0, |s| s.tokens_seen),
        samples_seen: state.map_or(0, |s| s.samples_seen),
        total_steps,
        target_devices,
        drafter_devices,
        grad_sync,
        resumed_from: resumed_from.cloned(),
        side_streams: runtime
            .graphs
            .clone()
            .ok()
            .filter(|_| config.devices.concurrent_target),
    })
}

/// The devices a `devices.*` setting names.
fn devices(runtime: &TorchRuntime, specs: &[DeviceSpec], setting: &str) -> Result<Vec<Device>> {
    specs
        .iter()
        .map(|&d| {
            runtime
                .resolve(d)
                .with_context(|| format!("config: {setting}"))
        })
        .collect()
}

/// The target on each target device, loaded once per device (workers on one device share it).
fn load_targets(
    config: &TrainConfig,
    target_dir: &Path,
    devices: &[Device],
    kind: Kind,
) -> Result<Vec<Arc<SharedTarget>>> {
    let mut targets: Vec<Arc<SharedTarget>> = Vec::new();
    for &dev in devices {
        if let Some(t) = targets.iter().find(|t| t.device == dev) {
            targets.push(t.clone());
            continue;
        }
        let weights = target_weight_bytes(target_dir, dev, kind)?;
        // Start-up time goes here for a big target: say so before, and how long after.
        log::info!(
            "loading target {} ({}, {weights}) on {dev:?} as {kind:?} ...",
            target_dir.display(),
            target_files_summary(config, target_dir)
        );
        let started = Instant::now();
        let t = load_target(config, target_dir, dev, kind)?;
        log::info!(
            "target loaded in {:.1} s: {} ({}, {:.1} M parameters) on {dev:?}",
            started.elapsed().as_secs_f64(),
            target_dir.display(),
            crate::model::describe_target(&t.config),
            t.parameter_count() as f64 / 1e6,
        );
        targets.push(Arc::new(SharedTarget::new(t)));
    }
    Ok(targets)
}

/// The drafter shape the `model` section asks for, fitted to the target.
fn fit_drafter_config(
    config: &TrainConfig,
    target_cfg: &TargetConfig,
    target_dir: &Path,
) -> Result<DrafterConfig> {
    let shape = config.drafter_shape();
    DrafterConfig::for_target(target_cfg, &shape).with_context(|| {
        format!(
            "config: model section does not fit the target {}",
            target_dir.display()
        )
    })
}

/// The training split of `data.path`, tokens checked against the target's vocabulary; samples
/// with fewer than two blocks of loss tokens are dropped.
fn load_store(config: &TrainConfig, vocab_size: usize) -> Result<Arc<TokenStore>> {
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
            vocab_size,
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
    Ok(Arc::new(store))
}

/// A drafter replica on each drafter device: from `init_dir` (`model.drafter_init`) or fresh.
fn load_drafters(
    config: &TrainConfig,
    init_dir: Option<&Path>,
    drafter_config: &DrafterConfig,
    target_cfg: &TargetConfig,
    devices: &[Device],
    kind: Kind,
) -> Result<Vec<Drafter>> {
    let mut drafters = Vec::new();
    for &dev in devices {
        let d = match init_dir {
            Some(dir) => Drafter::load_for_target(dir, target_cfg, dev, kind)?
                .with_added_layers(config.model.drafter_added_layers, config.run.seed)?,
            None => Drafter::init(drafter_config.clone(), dev, kind, config.run.seed)?,
        };
        drafters.push(d.with_train_attention(config.train.attention));
    }
    if let Some(dir) = init_dir {
        // A released drafter decides its own shape; the config must agree on the block size.
        let c = &drafters[0].config;
        if c.block_size != config.model.block_size {
            bail!(
                "config: model.block_size = {} but the drafter in {} has block_size {}",
                config.model.block_size,
                dir.display(),
                c.block_size
            );
        }
        let added = config.model.drafter_added_layers;
        if added > 0 {
            let total = c.num_hidden_layers;
            log::info!(
                "model.drafter_added_layers = {added}: layers {} to {} appended to the drafter of {}, starting as the identity",
                total - added,
                total - 1,
                dir.display()
            );
        }
    }
    log::info!("{}", drafters[0].describe());
    Ok(drafters)
}

/// AdamW over `drafter`'s parameters, its fp32 master weights on `device`.
fn new_optimizer(config: &TrainConfig, drafter: &Drafter, device: Device) -> AdamW {
    let adam = AdamWConfig {
        beta1: config.train.beta1,
        beta2: config.train.beta2,
        eps: config.train.eps,
        weight_decay: config.train.weight_decay,
    };
    AdamW::new(&drafter.named_parameters(), device, adam)
}

/// `train.total_steps`, or the steps of `train.epochs` over the data.
fn planned_steps(
    config: &TrainConfig,
    store: &Arc<TokenStore>,
    packer_config: &PackerConfig,
) -> u64 {
    let per_step = config.step_batches() as u64;
    if config.train.total_steps > 0 {
        config.train.total_steps
    } else {
        let batches = batches_per_epoch(store, packer_config);
        ((batches as f64 * config.train.epochs) / per_step as f64)
            .ceil()
            .max(1.0) as u64
    }
}

/// The newest checkpoint of `run_dir` that verifies, its optimizer state loaded.
fn resume_point(
    run_dir: &Path,
    optimizer: &mut AdamW,
    bounds: &DataBounds<'_>,
) -> Result<ResumePoint> {
    let r = resume::choose(run_dir, optimizer, bounds)?;
    let (ckpt, step) = (r.checkpoint.display(), r.state.step);
    match r.newer_failed {
        0 => log::info!("resuming from {ckpt} at step {step}"),
        n => log::warn!(
            "resuming from {ckpt} at step {step}, the newest checkpoint that verifies ({n} newer failed, named above)"
        ),
    }
    Ok(r)
}

/// The resumed checkpoint's servable `drafter/`, where damaged or missing, written anew from
/// `drafter` (which holds the master weights).
fn rewrite_damaged_servable(r: &ResumePoint, drafter: &Drafter) -> Result<()> {
    let Some(why) = &r.damaged_drafter else {
        return Ok(());
    };
    resume::rewrite_servable(&r.checkpoint, drafter).with_context(|| {
        format!(
            "{}: cannot rewrite the damaged drafter/ ({why})",
            r.checkpoint.display()
        )
    })?;
    log::warn!(
        "{}: drafter/ was damaged ({why}): rewritten from the checkpoint's master weights",
        r.checkpoint.display()
    );
    Ok(())
}

/// The data stream where it stopped (a position beyond its window is refused here, before
/// any thread starts, instead of a skip loop that never ends).
fn start_packer(
    store: &Arc<TokenStore>,
    packer_config: &PackerConfig,
    state: PackerState,
    resumed_from: Option<&PathBuf>,
) -> Result<Packer> {
    Packer::resume(store.clone(), packer_config.clone(), state).with_context(|| match &resumed_from
    {
        Some(ckpt) => format!(
            "{}: cannot resume the data stream",
            ckpt.join("trainer_state.json").display()
        ),
        None => "cannot start the data stream".to_string(),
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
