//! Held-out measurements between optimizer steps, made by drafter worker 0 on the first drafter
//! device: the periodic evaluation (`[eval]`: tau by real speculative decoding on held-out
//! prompts) and validation (`[validation]`: the drafter teacher-forced on held-out sequences,
//! see [`crate::train::validation`]). Both use one target on that device (the target worker's
//! own where one runs there, else one copy), and together they keep `RUN_DIR/best/`: the best
//! validation walk tau when validation is on, else the best evaluation tau.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tch::Device;

use crate::config::TrainConfig;
use crate::data::arrow_io::resolve_split;
use crate::data::store::{DataColumns, StoreOptions, TokenStore};
use crate::eval::prompts::{check_prompts, prompts_from_data};
use crate::eval::speculative::{measure_tau, TauSummary};
use crate::model::{model_eos_ids, Drafter, FrozenHead, SharedTarget, TargetModel};
use crate::train::checkpoint::{read_best, save_best, BestEval, BestRule};
use crate::train::validation::{validate, Validation, ValidationOptions};

/// The held-out sequences of validation and how they are measured.
struct ValidationSet {
    store: TokenStore,
    /// Sequences per pass: the first `count` of `store`.
    count: usize,
    options: ValidationOptions,
}

/// The held-out prompts and sequences, the target they run on, and the best drafter so far.
pub(super) struct HeldOut {
    target: Arc<SharedTarget>,
    eos: Vec<u32>,
    /// Evaluation prompts; empty when `[eval]` is off.
    prompts: Vec<Vec<u32>>,
    validation: Option<ValidationSet>,
    best: Option<BestEval>,
    /// Validation passes since the one with the best walk tau.
    pub(super) since_best: u64,
    /// Step of the latest evaluation.
    pub(super) last_eval: Option<u64>,
    /// Step of the latest validation pass.
    pub(super) last_validation: Option<u64>,
}

/// Where a run resumes from: its directory and its validation passes since the best one.
pub(super) struct Resumed<'a> {
    pub run_dir: &'a Path,
    pub validations_since_best: u64,
}

impl HeldOut {
    /// The prompts, sequences and target of the measurements `config` asks for (`None` when it
    /// asks for none). `load` loads a copy of the target on `device` when no target worker has
    /// one there. On resume the best drafter so far is read back when it was chosen by the
    /// rule in force.
    pub(super) fn prepare(
        config: &TrainConfig,
        targets: &[Arc<SharedTarget>],
        device: Device,
        load: impl FnOnce() -> Result<TargetModel>,
        resume: Option<Resumed<'_>>,
    ) -> Result<Option<Self>> {
        let evaluates = config.eval.every_steps > 0;
        let validates = config.validation.every_steps > 0;
        if !evaluates && !validates {
            return Ok(None);
        }
        let target_dir = Path::new(&config.model.target);
        let target_cfg = &targets[0].config;
        let prompts = if evaluates {
            eval_prompts(config, target_cfg)?
        } else {
            Vec::new()
        };
        let eos = model_eos_ids(target_dir, target_cfg)?;
        let validation = validates
            .then(|| validation_set(config, target_cfg, &eos))
            .transpose()?;
        let target = match targets.iter().find(|t| t.device == device) {
            Some(t) => t.clone(),
            None => {
                let t = load()?;
                log::info!("evaluation and validation: a copy of the target on {device:?}");
                Arc::new(SharedTarget::new(t))
            }
        };
        let mut held_out = HeldOut {
            target,
            eos,
            prompts,
            validation,
            best: None,
            since_best: 0,
            last_eval: None,
            last_validation: None,
        };
        if let Some(r) = resume {
            let rule = held_out.rule();
            held_out.best = read_best(r.run_dir).filter(|b| b.rule == rule);
            held_out.since_best = r.validations_since_best;
        }
        Ok(Some(held_out))
    }

    /// What chooses `RUN_DIR/best/`.
    pub(super) fn rule(&self) -> BestRule {
        if self.validation.is_some() {
            BestRule::ValidationWalkTau
        } else {
            BestRule::EvalDecodedTau
        }
    }

    pub(super) fn evaluates(&self) -> bool {
        !self.prompts.is_empty()
    }

    pub(super) fn validates(&self) -> bool {
        self.validation.is_some()
    }

    pub(super) fn prompts(&self) -> usize {
        self.prompts.len()
    }

    pub(super) fn best(&self) -> Option<&BestEval> {
        self.best.as_ref()
    }

    /// Tau of `drafter` by real speculative decoding of the evaluation prompts; cancelled (see
    /// [`crate::eval::cancel`]) once `cancel` is set.
    pub(super) fn evaluate(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        step: u64,
        max_new_tokens: usize,
        cancel: &AtomicBool,
    ) -> Result<TauSummary> {
        self.last_eval = Some(step);
        // A pass on a real target takes minutes: the log says what the run is doing meanwhile.
        log::info!(
            "evaluation at step {step}: decoding {} held-out prompts ...",
            self.prompts.len()
        );
        measure_tau(
            &self.target,
            drafter,
            head,
            &self.prompts,
            max_new_tokens,
            &self.eos,
            cancel,
        )
    }

    /// One validation pass of `drafter`; cancelled (see [`crate::eval::cancel`]) once `cancel`
    /// is set.
    pub(super) fn validate(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        step: u64,
        cancel: &AtomicBool,
    ) -> Result<Validation> {
        let Some(set) = &self.validation else {
            bail!("validation is off");
        };
        self.last_validation = Some(step);
        log::info!(
            "validation at step {step}: measuring {} held-out sequences ...",
            set.count
        );
        let samples: Vec<_> = (0..set.count).map(|i| set.store.get(i)).collect();
        validate(&self.target, drafter, head, &samples, &set.options, cancel)
    }

    /// Offers a measured drafter for `RUN_DIR/best/`: saved when `candidate` is of the rule in
    /// force and beats the best so far; true when saved. A validation pass that is not a new
    /// best counts towards `validation.patience`.
    pub(super) fn offer_best(
        &mut self,
        run_dir: &Path,
        drafter: &Drafter,
        candidate: BestEval,
    ) -> Result<bool> {
        if candidate.rule != self.rule() {
            return Ok(false);
        }
        let better = self.best.as_ref().is_none_or(|b| candidate.tau > b.tau);
        if candidate.rule == BestRule::ValidationWalkTau {
            self.since_best = if better { 0 } else { self.since_best + 1 };
        }
        if better {
            save_best(run_dir, drafter, &candidate).with_context(|| {
                format!(
                    "saving the best drafter at step {}; the previous best is kept",
                    candidate.step
                )
            })?;
            self.best = Some(candidate);
        }
        Ok(better)
    }
}

/// The evaluation prompts: the split's conversations up to their first assistant token.
fn eval_prompts(
    config: &TrainConfig,
    target: &crate::model::TargetConfig,
) -> Result<Vec<Vec<u32>>> {
    let e = &config.eval;
    let data = Path::new(&config.data.path);
    let prompts = prompts_from_data(data, &e.split, e.prompts)
        .with_context(|| "config: eval (prompts come from data.path, split eval.split)")?;
    check_prompts(
        &prompts,
        target,
        e.max_new_tokens,
        config.model.block_size as usize,
        &format!("config: eval: {} split {:?}", data.display(), e.split),
    )?;
    log::info!(
        "evaluation every {} steps: {} held-out prompts, {} new tokens each",
        e.every_steps,
        prompts.len(),
        e.max_new_tokens
    );
    Ok(prompts.into_iter().map(|p| p.ids).collect())
}

/// The validation sequences: the first `validation.sequences` rows of the split that training
/// would keep (the same cut and the same minimum of loss tokens), in file order.
fn validation_set(
    config: &TrainConfig,
    target: &crate::model::TargetConfig,
    eos: &[u32],
) -> Result<ValidationSet> {
    let v = &config.validation;
    let data = Path::new(&config.data.path);
    let path = if data.join("dataset_dict.json").is_file() {
        if v.split == config.data.split {
            log::warn!(
                "validation: validation.split = {:?} is the training split: its sequences are not held out",
                v.split
            );
        }
        resolve_split(data, Some(&v.split)).with_context(|| {
            "config: validation (sequences come from data.path, split validation.split)"
        })?
    } else {
        log::warn!(
            "validation: {} has no splits; its sequences are the training data, not held out",
            data.display()
        );
        data.to_path_buf()
    };
    let block = config.model.block_size as usize;
    let columns = DataColumns {
        input_ids: config.data.input_ids_column.clone(),
        loss_mask: (!config.data.loss_mask_column.is_empty())
            .then(|| config.data.loss_mask_column.clone()),
    };
    let (store, _) = TokenStore::load(
        &path,
        &columns,
        &StoreOptions {
            vocab_size: target.vocab_size as usize,
            max_len: config.data.max_len,
            min_loss_tokens: 2 * block,
            max_samples: 0,
        },
    )
    .with_context(|| format!("config: validation: {}", path.display()))?;
    if store.is_empty() {
        bail!(
            "config: validation: {}: no sequence has {} or more loss tokens",
            path.display(),
            2 * block
        );
    }
    let count = v.sequences.min(store.len());
    log::info!(
        "validation every {} steps: {count} held-out sequences of {} (asked for {}), answers walked up to {} tokens",
        v.every_steps,
        path.display(),
        v.sequences,
        v.max_new_tokens
    );
    Ok(ValidationSet {
        store,
        count,
        options: ValidationOptions {
            max_new_tokens: v.max_new_tokens,
            gamma: config.train.effective_gamma(config.model.block_size),
            eos: eos.to_vec(),
            // as many blocks as a training batch can hold
            anchors_per_forward: (config.train.num_anchors * config.data.max_batch).max(1),
        },
    })
}
