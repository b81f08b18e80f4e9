//! The training configuration: what `dflash-tui train --config FILE [--set key=value ...]`
//! reads.
//!
//! # File format
//!
//! A TOML file with up to eleven sections, each a table of plain fields:
//!
//! ```toml
//! [run]          # name, runs folder, seed
//! [model]        # target model folder, drafter shape, mask token, tapped layers, dtype
//! [data]         # tokenised dataset, columns, lengths, token-budget batching
//! [train]        # steps/epochs, anchors, optimiser, schedule, loss
//! [devices]      # where the target and the drafter run
//! [pipeline]     # queue depths between the background stages
//! [checkpoint]   # how often to save and how many checkpoints to keep
//! [eval]         # periodic tau by real speculative decoding on held-out prompts
//! [validation]   # periodic teacher-forced measurements on held-out sequences, early stopping
//! [telemetry]    # logging, profiling and GPU sampling intervals
//! [debug]        # fault injection for tests of the failure handling
//! ```
//!
//! Every field has a default (see the section types and `configs/*.toml`), so a section or a
//! field may be left out; only `model.target`, `model.mask_token_id` and `data.path` have no
//! usable default and must be given. An unknown section or field is an error naming it, so a
//! misspelt key never goes unnoticed.
//!
//! # Overrides
//!
//! `--set section.field=value` replaces one field after the file is read and before it is
//! checked. The value is read as a TOML value (`train.lr=1e-4`, `model.dtype="bf16"`,
//! `devices.drafter_devices=["cpu","cpu"]`); a value that is not valid TOML is taken as a plain
//! string (`run.name=my-run`). For a string field any value is taken literally
//! (`run.name=123` is the name "123"), and for a list field a value that is not a TOML array is
//! read as a comma-separated list (`devices.target_devices=cuda:0,cuda:1`,
//! `model.target_layer_ids=1,8,15`; an empty value is the empty list).
//!
//! # Checks
//!
//! A setting that takes one of a few words (`model.dtype`, `devices.grad_sync`,
//! `debug.fail_stage`, `debug.fail_mode`) is an enum; a word that is not one of its values is
//! refused as the file is read, as `config: section.field = "WORD" is not allowed (must be one
//! of ...)`; so is a device list's entry that is not a device word, as `config:
//! devices.target_devices[I] = "WORD" is not a device (...)`. [`TrainConfig::validate`] then checks every range and reports the first problem as
//! `config: section.field = VALUE is out of range (must be ...)`. Checks that need the target
//! model (the mask token against the vocabulary, tapped layers against the layer count) are
//! made where the model is loaded.
//!
//! [`TrainConfig::to_toml_string`] writes the resolved configuration with every field spelled
//! out (a run keeps it as `RUN_DIR/config.toml`); reading it back gives the same configuration.

mod choices;
mod parse;
mod resume;
mod validate;

pub use choices::{Choice, Dtype, FailMode, FailStage, GradSync, UnknownChoice};
pub use resume::{resume_changes, ResumeChanges};
pub(crate) use validate::{
    flag_between, MAX_BATCH_ROWS, MAX_BATCH_TOKENS, MAX_NEW_TOKENS, MAX_SEQUENCE_TOKENS,
};

use choices::{check_choices, check_device_lists};

use parse::{apply_override, deserialize_error, position, schema};

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Result};

use crate::runtime::DeviceSpec;
use serde::{Deserialize, Serialize};

/// The whole training configuration, one field per TOML section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub run: RunSection,
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub devices: DevicesSection,
    pub pipeline: PipelineSection,
    pub checkpoint: CheckpointSection,
    pub eval: EvalSection,
    pub validation: ValidationSection,
    pub telemetry: TelemetrySection,
    pub debug: DebugSection,
}

/// `[run]`: naming and seeding of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSection {
    /// Name of the run (its folder is named after it). Default "dflash".
    pub name: String,
    /// Folder holding the runs; "" (`None`) means the `runs` folder of the platform data
    /// directory.
    #[serde(with = "optional_path")]
    pub runs_dir: Option<PathBuf>,
    /// Seed for initialisation and data order. Default 0.
    pub seed: u64,
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            name: "dflash".into(),
            runs_dir: None,
            seed: 0,
        }
    }
}

/// An optional path as the file writes it: "" for none (TOML has no null, and the overrides
/// find a field by its written default).
mod optional_path {
    use std::path::PathBuf;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(
        path: &Option<PathBuf>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match path {
            Some(path) => path.serialize(s),
            None => s.serialize_str(""),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<PathBuf>, D::Error> {
        let path = PathBuf::deserialize(d)?;
        Ok((!path.as_os_str().is_empty()).then_some(path))
    }
}

/// `[model]`: the frozen target and the shape of the drafter trained for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Hugging Face model folder of the target (required).
    pub target: String,
    /// "" (`None`) trains a freshly initialised drafter; otherwise a drafter folder to start
    /// from.
    #[serde(with = "optional_path")]
    pub drafter_init: Option<PathBuf>,
    /// Drafter decoder layers, 1..=64. Default 5.
    pub drafter_layers: i64,
    /// Decoder layers appended to the `drafter_init` drafter, 0..=63 (0 needs no init). They
    /// start as identity (zero output projections), so training goes on from what the
    /// drafter computes, with more depth. Default 0.
    pub drafter_added_layers: i64,
    /// Tokens per drafted block, 2..=64. Default 16.
    pub block_size: i64,
    /// Token id of the mask token (required, >= 0; checked against the vocabulary elsewhere).
    pub mask_token_id: i64,
    /// Target layers whose hidden states the drafter reads; [] takes the DFlash default
    /// formula for `num_taps` layers. A non-empty list (at most 16) is used as given.
    pub target_layer_ids: Vec<usize>,
    /// Number of tapped target layers when `target_layer_ids` is [], 1..=16. Default 5.
    pub num_taps: usize,
    /// Compute dtype: "auto" (bf16 on a GPU, f32 on the CPU), "f32" or "bf16". Default "auto".
    pub dtype: Dtype,
    /// Random target weights (seeded by run.seed) instead of loading them: the target folder
    /// then needs only config.json. For benchmarks of a model's shape. Default false.
    pub random_weights: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            target: String::new(),
            drafter_init: None,
            drafter_layers: 5,
            drafter_added_layers: 0,
            block_size: 16,
            mask_token_id: -1,
            target_layer_ids: Vec::new(),
            num_taps: 5,
            dtype: Dtype::Auto,
            random_weights: false,
        }
    }
}

/// `[data]`: the tokenised dataset and how it is batched.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// Tokenised dataset (a `save_to_disk` folder, Arrow or Parquet file; required).
    pub path: String,
    /// Split of a `DatasetDict` folder. Default "train".
    pub split: String,
    /// Column of token ids. Default "input_ids".
    pub input_ids_column: String,
    /// Column of the 0/1 loss mask; "" makes every token count. Default "loss_mask".
    pub loss_mask_column: String,
    /// Longest sequence in tokens (longer ones are cut), 8..=1048576. Default 3072.
    pub max_len: usize,
    /// Tokens per batch (padded length times rows), 1..=16777216. Default 8192.
    pub token_budget: usize,
    /// Most sequences per batch, 1..=65536. Default 64.
    pub max_batch: usize,
    /// Sequences sorted together by length when forming batches, 1..=1048576. Default 1024.
    pub bucket_window: usize,
    /// Train on at most this many samples, the first usable ones of the split in file order
    /// (0 = all): runs on less data, to see what more data gives. Default 0.
    pub max_samples: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            path: String::new(),
            split: "train".into(),
            input_ids_column: "input_ids".into(),
            loss_mask_column: "loss_mask".into(),
            max_len: 3072,
            token_budget: 8192,
            max_batch: 64,
            bucket_window: 1024,
            max_samples: 0,
        }
    }
}

/// `[train]`: length of training, optimiser, schedule and loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// Optimiser steps; 0 derives them from `epochs`. Default 0.
    pub total_steps: u64,
    /// Passes over the data when `total_steps` is 0, > 0. Default 6.
    pub epochs: f64,
    /// Anchor positions (block starts) sampled per sequence, 1..=1048576. Default 512.
    pub num_anchors: usize,
    /// Batches accumulated per optimiser step, 1..=1024. Default 1.
    pub grad_accum: usize,
    /// Peak learning rate, > 0 and <= 1. Default 6e-4.
    pub lr: f64,
    /// AdamW beta1, in [0, 1). Default 0.9.
    pub beta1: f64,
    /// AdamW beta2, in [0, 1). Default 0.999.
    pub beta2: f64,
    /// AdamW epsilon, > 0. Default 1e-8.
    pub eps: f64,
    /// AdamW decoupled weight decay, >= 0. Default 0.
    pub weight_decay: f64,
    /// Share of the steps spent warming the learning rate up, in [0, 1). Default 0.04.
    pub warmup_ratio: f64,
    /// Final learning rate of the cosine decay as a share of `lr`, in [0, 1]. Default 0.
    pub min_lr_ratio: f64,
    /// Gradient-norm clipping threshold, >= 0 (0 = off). Default 1.
    pub clip_grad_norm: f64,
    /// Decay of the loss weight along the block, >= 0; 0 takes the default for the block size
    /// (see [`TrainSection::effective_gamma`]). Default 0.
    pub loss_decay_gamma: f64,
    /// Weight of the KL term against the target's distribution, in [0, 1]. Default 0.
    pub kl_weight: f64,
    /// Softmax temperature of the KL term, > 0. Default 1.
    pub kl_temperature: f64,
    /// Weight of the accepted-streak term, in [0, 1]. Default 0.
    pub streak_alpha: f64,
    /// Divides each block's streak weights by the block's expected acceptance length
    /// `tau = 1 + s_1` to this power, in [0, 2]; only with `streak_alpha` > 0. 0: the spec's
    /// streak weighting, the gradient of the mean accepted length over anchor positions. 2: the
    /// gradient of the expected number of decoding steps (decoding starts a step at a position
    /// about 1 / tau of the time), so the hard positions where decoding spends its steps count
    /// more. Default 0.
    pub streak_tau_power: f64,
    /// Formulation of the training attention, all exact: "grouped" (groups of 128 consecutive
    /// blocks over their context in place, each block over its own keys apart; where the fused
    /// kernels run, in bf16 / f16 without sliding-window layers, else "chunked"), "grouped:G"
    /// (G blocks a group, a power of two up to 1024), "chunked"
    /// (blocks in chunks of C, each chunk over the context and its own blocks; C chosen from the
    /// sizes), "chunked:C", or "dense" (every block against all block keys, the straightforward
    /// reference). Default "grouped".
    pub attention: crate::model::drafter::TrainAttention,
    /// The drafter's training kernels compiled at run time, on a GPU where they load: the LM
    /// head's loss (cross-entropy, argmax check and gradient of each chunk of logits) in one
    /// kernel, the rotary embedding's, SwiGLU's and RMSNorm's forward and backward passes in
    /// one each, and with one drafter replica the optimizer step (AdamW reading each gradient
    /// in place and writing the new weights in its pass); false: libtorch's operations (the
    /// same numbers up to the rounding of float sums). Default true.
    pub fused_loss: bool,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            total_steps: 0,
            epochs: 6.0,
            num_anchors: 512,
            grad_accum: 1,
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_ratio: 0.04,
            min_lr_ratio: 0.0,
            clip_grad_norm: 1.0,
            loss_decay_gamma: 0.0,
            kl_weight: 0.0,
            kl_temperature: 1.0,
            attention: crate::model::drafter::TrainAttention::GROUPED,
            streak_alpha: 0.0,
            streak_tau_power: 0.0,
            fused_loss: true,
        }
    }
}

impl TrainSection {
    /// The loss-decay gamma in use: `loss_decay_gamma` when set (> 0), otherwise the DFlash
    /// default for the block size: 7 for 16, 5 for 10, 4 for 8, else `block_size * 7 / 16`.
    pub(crate) fn effective_gamma(&self, block_size: i64) -> f64 {
        if self.loss_decay_gamma > 0.0 {
            return self.loss_decay_gamma;
        }
        match block_size {
            16 => 7.0,
            10 => 5.0,
            8 => 4.0,
            b => b as f64 * 7.0 / 16.0,
        }
    }
}

/// `[devices]`: where the target and the drafter run. Each entry is a [`DeviceSpec`] ("auto",
/// "cpu", "cuda" or "cuda:N"), read when the file is loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicesSection {
    /// Devices running target forwards (one worker each). Default ["auto"].
    pub target_devices: Vec<DeviceSpec>,
    /// Devices training the drafter (one replica each). Default ["auto"].
    pub drafter_devices: Vec<DeviceSpec>,
    /// How the replicas' gradients are summed on the first drafter device and the new weights
    /// handed back: "nccl" (NCCL collectives between the GPUs; CUDA drafter devices only,
    /// libnccl loaded at run time), "copy" (tensor copies to and from the first drafter
    /// device; the reference, any devices), or "auto" (NCCL when there are 2+ distinct drafter
    /// devices, all CUDA, and libnccl loads; else copy). Default "auto".
    pub grad_sync: GradSync,
    /// Batches each drafter device trains per optimiser step, in the order of
    /// drafter_devices; [] = train.grad_accum on each. Unequal counts balance a layout where
    /// some GPUs also run target forwards (target on cuda:0, drafters on cuda:0 and cuda:1:
    /// [1, 2]). The step's gradient is the mean over all its batches. Default [].
    pub drafter_batches: Vec<u32>,
    /// Where a target device also trains a drafter: true = the target's forwards run on a CUDA
    /// stream of their own, beside the drafter's work, so that the GPU runs both at once;
    /// false = queued on the drafter's stream, one after the other. Default true.
    pub concurrent_target: bool,
}

impl Default for DevicesSection {
    fn default() -> Self {
        DevicesSection {
            target_devices: vec![DeviceSpec::Auto],
            drafter_devices: vec![DeviceSpec::Auto],
            grad_sync: GradSync::Auto,
            drafter_batches: Vec::new(),
            concurrent_target: true,
        }
    }
}

impl TrainConfig {
    /// Batches drafter replica `replica` trains per optimiser step.
    pub(crate) fn replica_batches(&self, replica: usize) -> usize {
        self.devices
            .drafter_batches
            .get(replica)
            .map_or(self.train.grad_accum, |&b| b as usize)
            .max(1)
    }

    /// Batches per optimiser step over all drafter replicas.
    pub(crate) fn step_batches(&self) -> usize {
        (0..self.devices.drafter_devices.len().max(1))
            .map(|r| self.replica_batches(r))
            .sum()
    }
}

/// The most items a pipeline queue may hold: `pipeline.*_queue_depth` in the config and
/// `queue NAME DEPTH` at run time (a batch_q of a million batches grew memory by 3.5 GB).
pub(crate) const MAX_QUEUE_DEPTH: usize = 1024;

/// Why a queue depth is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BadQueueDepth {
    #[error("depth must be at least 1")]
    Zero,
    #[error("depth {0} is above the limit of {MAX_QUEUE_DEPTH}")]
    AboveLimit(usize),
}

/// The one check of a queue depth, 1..=[`MAX_QUEUE_DEPTH`]: for `pipeline.*_queue_depth`,
/// `queue NAME DEPTH`, a queue's new capacity and the control room's +/- keys.
pub(crate) fn check_queue_depth(depth: usize) -> Result<usize, BadQueueDepth> {
    match depth {
        0 => Err(BadQueueDepth::Zero),
        d if d > MAX_QUEUE_DEPTH => Err(BadQueueDepth::AboveLimit(d)),
        d => Ok(d),
    }
}

/// `[pipeline]`: capacities of the queues between the background stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineSection {
    /// Batches waiting between the data loader and the target, 1..=1024. Default 4.
    pub batch_queue_depth: usize,
    /// Target features waiting for the drafter, 1..=1024. Default 2.
    pub feature_queue_depth: usize,
}

impl Default for PipelineSection {
    fn default() -> Self {
        PipelineSection {
            batch_queue_depth: 4,
            feature_queue_depth: 2,
        }
    }
}

/// `[checkpoint]`: when checkpoints are saved and how many are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every N optimiser steps (0 = off). Default 500.
    pub save_every_steps: u64,
    /// Save every N minutes of training, >= 0 (0 = off). Default 30.
    pub save_every_minutes: f64,
    /// Checkpoints kept on disk (older ones are removed), >= 1. Default 3.
    pub keep_checkpoints: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            save_every_steps: 500,
            save_every_minutes: 30.0,
            keep_checkpoints: 3,
        }
    }
}

/// `[eval]`: periodic evaluation during training. Every `every_steps` steps drafter worker 0
/// (on the first drafter device, between steps; a copy of the target is loaded there when no
/// target worker runs on that device) decodes `prompts` held-out prompts by real greedy speculative decoding against the target
/// (dflash spec §5) and records the acceptance length tau; the drafter with the best tau so far
/// is kept in `RUN_DIR/best/`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate every N optimiser steps (0 = off). Default 0.
    pub every_steps: u64,
    /// Held-out prompts per evaluation, 1..=100000. Default 16.
    pub prompts: usize,
    /// New tokens decoded per prompt, >= 1. Default 128.
    pub max_new_tokens: usize,
    /// Split of `data.path` the prompts come from (the conversation up to its first assistant
    /// token). Default "validation".
    pub split: String,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            every_steps: 0,
            prompts: 16,
            max_new_tokens: 128,
            split: "validation".into(),
        }
    }
}

/// `[validation]`: held-out validation during training (see [`crate::train::validation`]).
/// Every `every_steps` steps, and at every `[eval]` evaluation, drafter worker 0 (on the first
/// drafter device, between steps, with the target copy evaluation uses) measures the drafter
/// teacher-forced on the first `sequences` usable rows of `split`: loss, weighted accuracy,
/// anchor-mean acceptance, and the walk tau, the acceptance length greedy decoding would get on
/// each answer (up to `max_new_tokens` into it). With validation on, `RUN_DIR/best/` keeps the
/// drafter of the best walk tau, and `patience` passes without a new best stop the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValidationSection {
    /// Validate every N optimiser steps (0 = off). Default 0.
    pub every_steps: u64,
    /// Split of `data.path` the sequences come from (a dataset without splits is used as
    /// it is). Default "validation".
    pub split: String,
    /// Held-out sequences per pass: the first N usable rows of the split (the rows training
    /// would keep), in file order, so that every pass measures the same set; 1..=100000. Default 64.
    pub sequences: usize,
    /// How far into each answer the walk goes, in tokens (as `eval --max-new-tokens`),
    /// 1..=65536. Default 128.
    pub max_new_tokens: usize,
    /// Stop the run (with a checkpoint) after this many passes without a new best walk tau
    /// (0 = never). Default 0.
    pub patience: u64,
}

impl Default for ValidationSection {
    fn default() -> Self {
        ValidationSection {
            every_steps: 0,
            split: "validation".into(),
            sequences: 64,
            max_new_tokens: 128,
            patience: 0,
        }
    }
}

/// `[telemetry]`: logging and measurement intervals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySection {
    /// Log metrics every N optimiser steps, >= 1. Default 10.
    pub log_every_steps: u64,
    /// Seconds between stage-profile reports, >= 0 (0 = off). Default 30.
    pub profile_interval_s: f64,
    /// Seconds between GPU utilisation and memory samples, > 0. Default 1.
    pub gpu_sample_interval_s: f64,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        TelemetrySection {
            log_every_steps: 10,
            profile_interval_s: 30.0,
            gpu_sample_interval_s: 1.0,
        }
    }
}

/// `[debug]`: fault injection, for tests of the failure handling only. When `fail_at_step` is
/// set, the stage named by `fail_stage` fails on purpose at that step, so that tests can check
/// that the run stops cleanly and reports the failure. Leave `fail_at_step` at 0 for real runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DebugSection {
    /// Step at which to inject a failure (0 = never). Default 0.
    pub fail_at_step: u64,
    /// Stage that fails: "loader", "target", "drafter" or "checkpoint". Default "drafter".
    pub fail_stage: FailStage,
    /// How a stage fails: "error" (returns an error; a checkpoint: disk full), "panic" (panics,
    /// as a libtorch error inside a tch call does), or for the checkpoint stage
    /// "hold-drafter" / "hold-optimizer" / "hold-rename" (the writer stops for good at that
    /// point, for tests that kill the process there). Default "error".
    pub fail_mode: FailMode,
    /// How many checkpoints fail ("checkpoint" stage), from `fail_at_step` on; 0 = every one.
    /// Default 0.
    pub fail_count: u64,
}

impl Default for DebugSection {
    fn default() -> Self {
        DebugSection {
            fail_at_step: 0,
            fail_stage: FailStage::Drafter,
            fail_mode: FailMode::Error,
            fail_count: 0,
        }
    }
}

/// Reads the configuration file `path`, applies the `--set key=value` overrides and checks the
/// result.
pub fn load(path: &Path, overrides: &[String]) -> Result<TrainConfig> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow!("config: cannot read {}: {e}", path.display()))?;
    from_toml_str(&text, &path.display().to_string(), overrides)
}

/// Parses configuration text (`source` names it in messages, usually the file path), applies
/// the `--set key=value` overrides and checks the result.
pub(crate) fn from_toml_str(text: &str, source: &str, overrides: &[String]) -> Result<TrainConfig> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| {
        let at = e
            .span()
            .map(|span| format!(" ({})", position(text, span.start)))
            .unwrap_or_default();
        anyhow!(
            "config: {source} is not valid TOML{at}: {}",
            e.message().trim()
        )
    })?;
    let schema = schema()?;
    let mut applied = Vec::with_capacity(overrides.len());
    for spec in overrides {
        applied.push((apply_override(&mut table, &schema, spec)?, spec.as_str()));
    }
    check_choices(&table)?;
    check_device_lists(&table)?;
    let config: TrainConfig = toml::Value::Table(table)
        .try_into()
        .map_err(|e| deserialize_error(&e, text, source, &applied))?;
    config.validate()?;
    Ok(config)
}

impl TrainConfig {
    /// The drafter's shape as `[model]` asks for it (target_layer_ids empty: the formula's).
    pub(crate) fn drafter_shape(&self) -> crate::model::DrafterShape {
        crate::model::DrafterShape {
            layers: self.model.drafter_layers,
            block_size: self.model.block_size,
            mask_token_id: self.model.mask_token_id,
            target_layer_ids: (!self.model.target_layer_ids.is_empty())
                .then(|| self.model.target_layer_ids.clone()),
            num_taps: self.model.num_taps,
        }
    }

    /// The configuration as TOML with every field written out; [`from_toml_str`] reads it back
    /// to an equal configuration.
    pub(crate) fn to_toml_string(&self) -> Result<String> {
        let body = toml::to_string(self).map_err(|e| anyhow!("config: cannot write TOML: {e}"))?;
        Ok(format!(
            "# dflash-tui training configuration, resolved (every field written out)\n\n{body}"
        ))
    }
}
