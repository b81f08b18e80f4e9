//! Range checks of a [`TrainConfig`]; each message names the field in dotted form, the value
//! found and what is allowed. (The settings that take one of a few words are enums, checked as
//! the file is read: see `choices.rs`.)

use std::fmt::Display;

use anyhow::{bail, Result};

use super::{check_queue_depth, FailStage, GradSync, TrainConfig, MAX_QUEUE_DEPTH};
use crate::model::{MAX_BLOCK_SIZE, MAX_DRAFTER_LAYERS};
use crate::runtime::DeviceSpec;

// Upper bounds of the settings that size memory: generous (far beyond any run so far) but
// finite, so that a typo is refused with its field named rather than ending the process in a
// failed allocation (data.bucket_window = 2^40 asked for 8 TiB).

/// Tokens of one sequence (`data.max_len`, `regenerate --max-len`) and anchors per sequence.
pub(crate) const MAX_SEQUENCE_TOKENS: usize = 1 << 20;
/// Tokens of one batch (`data.token_budget`, `regenerate`'s prefill).
pub(crate) const MAX_BATCH_TOKENS: usize = 1 << 24;
/// Sequences of one batch (`data.max_batch`, `regenerate --batch-size`).
pub(crate) const MAX_BATCH_ROWS: usize = 65_536;
/// Sequences sorted together (`data.bucket_window`).
pub(crate) const MAX_BUCKET_WINDOW: usize = 1 << 20;
/// Tokens generated per prompt by eval and validation.
pub(crate) const MAX_NEW_TOKENS: usize = 65_536;
/// Held-out prompts or sequences kept for eval and validation.
const MAX_HELD_OUT: usize = 100_000;
/// Tapped target layers listed in `model.target_layer_ids` (as `model.num_taps`).
const MAX_TAPS: usize = 16;

impl TrainConfig {
    /// Checks every field against its allowed range; returns the first problem found, in
    /// section order and field order.
    pub fn validate(&self) -> Result<()> {
        self.check_run_and_model()?;
        self.check_data()?;
        self.check_train()?;
        self.check_devices()?;
        self.check_stages()
    }

    fn check_run_and_model(&self) -> Result<()> {
        let run = &self.run;
        let name = run.name.as_str();
        if name.trim().is_empty() {
            bail!("config: run.name is required (it names the run's folder)");
        }
        if name == "." || name == ".." || name.contains(['/', '\\']) {
            bail!("config: run.name = {name:?} is not allowed (it names a folder: no '/', '\\', '.' or '..')");
        }

        let model = &self.model;
        if model.target.trim().is_empty() {
            bail!("config: model.target is required (a Hugging Face model folder)");
        }
        int_between(
            "model.drafter_layers",
            model.drafter_layers,
            1,
            MAX_DRAFTER_LAYERS,
        )?;
        int_between(
            "model.drafter_added_layers",
            model.drafter_added_layers,
            0,
            MAX_DRAFTER_LAYERS - 1,
        )?;
        if model.drafter_added_layers > 0 && model.drafter_init.is_none() {
            bail!(
                "config: model.drafter_added_layers = {} needs model.drafter_init (layers are \
                 added to a trained drafter; a fresh one has model.drafter_layers)",
                model.drafter_added_layers
            );
        }
        int_between("model.block_size", model.block_size, 2, MAX_BLOCK_SIZE)?;
        if model.mask_token_id < 0 {
            bail!(
                "config: model.mask_token_id = {} is out of range (must be >= 0; it is required: \
                 the id of a token the training data never contains)",
                model.mask_token_id
            );
        }
        if model.target_layer_ids.len() > MAX_TAPS {
            bail!(
                "config: model.target_layer_ids lists {} layers (must list at most {MAX_TAPS}, or none for model.num_taps)",
                model.target_layer_ids.len()
            );
        }
        int_between("model.num_taps", model.num_taps, 1, MAX_TAPS)
    }

    fn check_data(&self) -> Result<()> {
        let data = &self.data;
        if data.path.trim().is_empty() {
            bail!("config: data.path is required (a tokenised dataset: a save_to_disk folder, Arrow or Parquet file)");
        }
        if data.split.trim().is_empty() {
            bail!("config: data.split is required (e.g. \"train\")");
        }
        if data.input_ids_column.trim().is_empty() {
            bail!("config: data.input_ids_column is required (e.g. \"input_ids\")");
        }
        int_between("data.max_len", data.max_len, 8, MAX_SEQUENCE_TOKENS)?;
        int_between("data.token_budget", data.token_budget, 1, MAX_BATCH_TOKENS)?;
        int_between("data.max_batch", data.max_batch, 1, MAX_BATCH_ROWS)?;
        int_between(
            "data.bucket_window",
            data.bucket_window,
            1,
            MAX_BUCKET_WINDOW,
        )
    }

    fn check_train(&self) -> Result<()> {
        let t = &self.train;
        float("train.epochs", t.epochs, t.epochs > 0.0, "> 0")?;
        int_between("train.num_anchors", t.num_anchors, 1, MAX_SEQUENCE_TOKENS)?;
        int_between("train.grad_accum", t.grad_accum, 1, 1024)?;
        float("train.lr", t.lr, t.lr > 0.0 && t.lr <= 1.0, "> 0 and <= 1")?;
        float(
            "train.beta1",
            t.beta1,
            (0.0..1.0).contains(&t.beta1),
            ">= 0 and < 1",
        )?;
        float(
            "train.beta2",
            t.beta2,
            (0.0..1.0).contains(&t.beta2),
            ">= 0 and < 1",
        )?;
        float("train.eps", t.eps, t.eps > 0.0, "> 0")?;
        float(
            "train.weight_decay",
            t.weight_decay,
            t.weight_decay >= 0.0,
            ">= 0",
        )?;
        float(
            "train.warmup_ratio",
            t.warmup_ratio,
            (0.0..1.0).contains(&t.warmup_ratio),
            ">= 0 and < 1",
        )?;
        unit("train.min_lr_ratio", t.min_lr_ratio)?;
        float(
            "train.clip_grad_norm",
            t.clip_grad_norm,
            t.clip_grad_norm >= 0.0,
            ">= 0; 0 = off",
        )?;
        float(
            "train.loss_decay_gamma",
            t.loss_decay_gamma,
            t.loss_decay_gamma >= 0.0,
            ">= 0; 0 = the default for the block size",
        )?;
        unit("train.kl_weight", t.kl_weight)?;
        float(
            "train.kl_temperature",
            t.kl_temperature,
            t.kl_temperature > 0.0,
            "> 0",
        )?;
        unit("train.streak_alpha", t.streak_alpha)?;
        float(
            "train.streak_tau_power",
            t.streak_tau_power,
            (0.0..=2.0).contains(&t.streak_tau_power),
            ">= 0 and <= 2",
        )?;
        if t.streak_tau_power > 0.0 && t.streak_alpha == 0.0 {
            bail!(
                "config: train.streak_tau_power = {} has no effect: it divides the streak weights, \
                 which train.streak_alpha = 0 switches off (set train.streak_alpha > 0, e.g. 0.0001)",
                t.streak_tau_power
            );
        }
        Ok(())
    }

    fn check_devices(&self) -> Result<()> {
        devices("devices.target_devices", &self.devices.target_devices)?;
        devices("devices.drafter_devices", &self.devices.drafter_devices)?;
        let batches = &self.devices.drafter_batches;
        if !batches.is_empty() && batches.len() != self.devices.drafter_devices.len() {
            bail!(
                "config: devices.drafter_batches has {} entries but devices.drafter_devices has {} \
                 (one count per drafter device, or [] for train.grad_accum on each)",
                batches.len(),
                self.devices.drafter_devices.len()
            );
        }
        for (i, &b) in batches.iter().enumerate() {
            int_between(&format!("devices.drafter_batches[{i}]"), b, 1, 1024)?;
        }
        if self.devices.grad_sync == GradSync::Nccl {
            // Devices that resolve to the CPU only at run time ("auto") are refused there.
            let cpu = |d: &DeviceSpec| *d == DeviceSpec::Cpu;
            if let Some(i) = self.devices.drafter_devices.iter().position(cpu) {
                bail!(
                    "config: devices.grad_sync = \"nccl\" needs CUDA drafter devices, but \
                     devices.drafter_devices[{i}] = \"cpu\" (use \"copy\" or \"auto\")"
                );
            }
        }
        Ok(())
    }

    /// The sections of the stages around training: pipeline, checkpoint, eval, validation,
    /// telemetry and debug.
    fn check_stages(&self) -> Result<()> {
        let p = &self.pipeline;
        for (field, depth) in [
            ("pipeline.batch_queue_depth", p.batch_queue_depth),
            ("pipeline.feature_queue_depth", p.feature_queue_depth),
        ] {
            check_queue_depth(depth).map_err(|_| {
                out_of_range(field, depth, &format!("between 1 and {MAX_QUEUE_DEPTH}"))
            })?;
        }

        let c = &self.checkpoint;
        float(
            "checkpoint.save_every_minutes",
            c.save_every_minutes,
            c.save_every_minutes >= 0.0,
            ">= 0; 0 = off",
        )?;
        at_least("checkpoint.keep_checkpoints", c.keep_checkpoints, 1)?;

        let e = &self.eval;
        int_between("eval.prompts", e.prompts, 1, MAX_HELD_OUT)?;
        int_between("eval.max_new_tokens", e.max_new_tokens, 1, MAX_NEW_TOKENS)?;

        let v = &self.validation;
        if v.split.trim().is_empty() {
            bail!("config: validation.split is required (e.g. \"validation\")");
        }
        int_between("validation.sequences", v.sequences, 1, MAX_HELD_OUT)?;
        int_between(
            "validation.max_new_tokens",
            v.max_new_tokens,
            1,
            MAX_NEW_TOKENS,
        )?;
        if v.patience > 0 && v.every_steps == 0 {
            bail!(
                "config: validation.patience = {} needs validation.every_steps > 0 (patience \
                 counts validation passes; 0 turns early stopping off)",
                v.patience
            );
        }

        let tel = &self.telemetry;
        at_least("telemetry.log_every_steps", tel.log_every_steps, 1)?;
        float(
            "telemetry.profile_interval_s",
            tel.profile_interval_s,
            tel.profile_interval_s >= 0.0,
            ">= 0; 0 = off",
        )?;
        float(
            "telemetry.gpu_sample_interval_s",
            tel.gpu_sample_interval_s,
            tel.gpu_sample_interval_s > 0.0,
            "> 0",
        )?;

        let d = &self.debug;
        if d.fail_mode.holds() && d.fail_stage != FailStage::Checkpoint {
            bail!(
                "debug.fail_mode = \"{}\" holds a checkpoint: it needs debug.fail_stage = \"checkpoint\", not \"{}\"",
                d.fail_mode,
                d.fail_stage
            );
        }
        Ok(())
    }
}

/// A command-line option's range check: `--FLAG = VALUE is out of range (must be between LO
/// and HI)`.
pub(crate) fn flag_between(flag: &str, value: usize, lo: usize, hi: usize) -> Result<()> {
    if !(lo..=hi).contains(&value) {
        bail!("{flag} = {value} is out of range (must be between {lo} and {hi})");
    }
    Ok(())
}

fn out_of_range(field: &str, value: impl Display, rule: &str) -> anyhow::Error {
    anyhow::anyhow!("config: {field} = {value} is out of range (must be {rule})")
}

fn int_between<T: PartialOrd + Display>(field: &str, value: T, lo: T, hi: T) -> Result<()> {
    if value < lo || value > hi {
        return Err(out_of_range(
            field,
            &value,
            &format!("between {lo} and {hi}"),
        ));
    }
    Ok(())
}

fn at_least<T: PartialOrd + Display>(field: &str, value: T, lo: T) -> Result<()> {
    if value < lo {
        return Err(out_of_range(field, &value, &format!(">= {lo}")));
    }
    Ok(())
}

/// A float check: `ok` must hold and the value must be finite (which also rules out NaN).
fn float(field: &str, value: f64, ok: bool, rule: &str) -> Result<()> {
    if !ok || !value.is_finite() {
        return Err(out_of_range(field, value, rule));
    }
    Ok(())
}

/// A float in [0, 1].
fn unit(field: &str, value: f64) -> Result<()> {
    float(field, value, (0.0..=1.0).contains(&value), ">= 0 and <= 1")
}

/// A device list has at least one device (its words are read with the file: `choices.rs`).
fn devices(field: &str, list: &[DeviceSpec]) -> Result<()> {
    if list.is_empty() {
        bail!("config: {field} is empty (must list at least one device, e.g. [\"auto\"])");
    }
    Ok(())
}
