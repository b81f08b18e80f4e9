//! Each stage of the training pipeline run alone, on the pipeline's own code: the bench's
//! reference rates for the pipeline efficiency.

use std::time::Instant;

use anyhow::{anyhow, Result};
use tch::{Device, Tensor};

use super::drafter_steps::{step_range, DrafterStepMs, StageClock};
use super::gpu_sampler::{PhaseMark, SampledPhase};
use crate::aten_ext::ProfilerTrace;
use crate::config::TrainConfig;
use crate::model::layers::upload;
use crate::model::ForwardRequest;
use crate::pipeline::trainer::StageTimer;
use crate::pipeline::trainer::{
    apply_update, batch_item, prepare, sync_device, train_on_item, BatchItem, FeatureItem,
};
use crate::runtime::TorchRuntime;
use crate::telemetry::profile::ProfileEvent;
use crate::train::optim::{lr_at, AdamW};

/// Target tokens per second of each stage run alone, one stage after the other on the same
/// batches, with the models and settings `train` would use (the benchmark's reference for the
/// pipeline efficiency). The packer's batches `skip .. skip + batches` are timed (a run's
/// measured window sees exactly these when `skip` is its warm-up's batch count); up to two
/// batches before them run first, untimed, as the stages' own warm-up. The drafter stage
/// trains a scratch copy (one optimizer step per batch), each part of its steps timed on the
/// device ([`DrafterStepMs`]); with `trace`, it then trains on the batches right after the
/// measured ones (those the pipeline's trace records) with libtorch's profiler recording (see
/// [`TraceRequest`]). Several target or drafter devices
/// are counted as that many times one device's rate.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct StageAloneRates {
    pub batches: usize,
    pub tokens: u64,
    pub loader_tokens_per_s: f64,
    pub target_tokens_per_s: f64,
    pub drafter_tokens_per_s: f64,
    /// The drafter's time per part of a step (see [`DrafterStepMs`]).
    pub drafter_step_ms: DrafterStepMs,
}

/// `bench --trace`: the file, and the drafter training steps it records.
#[derive(Debug, Clone)]
pub(crate) struct TraceRequest {
    pub path: std::path::PathBuf,
    pub steps: usize,
}

pub(crate) fn measure_stages_alone(
    runtime: &TorchRuntime,
    config: &TrainConfig,
    skip: usize,
    batches: usize,
    trace: Option<&TraceRequest>,
    mark: &PhaseMark,
) -> Result<StageAloneRates> {
    let mut p = prepare(runtime, config, None, true)?;
    let packer = &mut p.packer;
    let warmup = skip.min(2);
    for _ in 0..skip - warmup {
        packer
            .next()
            .ok_or_else(|| anyhow!("the data set yields no batch"))?;
    }
    let total = warmup + batches.max(1);
    let tokens_of = |b: &BatchItem| b.lengths.iter().map(|&l| l as u64).sum::<u64>();

    let mut items = Vec::with_capacity(total);
    let mut loader_s = 0.0;
    for seq in 0..total {
        let t = Instant::now();
        let batch = packer
            .next()
            .ok_or_else(|| anyhow!("the data set yields no batch"))?;
        let item = batch_item(&p.store, &batch, seq as u64, packer.state());
        if seq >= warmup {
            loader_s += t.elapsed().as_secs_f64();
        }
        items.push(item);
    }
    let tokens: u64 = items[warmup..].iter().map(tokens_of).sum();
    // the traced steps' batches: those right after the measured ones, which the pipeline's
    // trace (--trace-pipeline) covers, so that the two traces can be compared (as many as the
    // data still holds)
    let traced = trace.map_or(0, |t| t.steps * config.step_batches());
    for seq in total..total + traced {
        let Some(batch) = packer.next() else {
            break;
        };
        items.push(batch_item(&p.store, &batch, seq as u64, packer.state()));
    }

    let target = &p.targets[0];
    let req = ForwardRequest {
        tap_layers: p.drafters[0].config.target_layer_ids().to_vec(),
        final_hidden: config.train.kl_weight > 0.0,
        logits: false,
    };
    // Each device stage is timed over its measured batches as a whole, with one wait for the
    // device at the end (as in the pipeline, the host queues the next batch's work while the
    // device still runs the last one); the warm-up batches are waited for before the clock
    // starts.
    let mut features = Vec::with_capacity(items.len());
    let mut target_clock = None;
    let mut target_s = 0.0;
    for (i, batch) in items.into_iter().enumerate() {
        if i == warmup {
            sync_device(target.device);
            target_clock = Some(Instant::now());
            mark.set(SampledPhase::TargetAlone);
        }
        if i == total {
            // the traced steps' features, untimed
            sync_device(target.device);
            target_s = target_clock.map_or(0.0, |t| t.elapsed().as_secs_f64());
            mark.set(SampledPhase::Idle);
        }
        let out = target.run(&upload(&batch.input_ids, target.device), None, &req);
        features.push(FeatureItem {
            features: out
                .features
                .ok_or_else(|| anyhow!("the target returned no features"))?,
            teacher_hidden: out.final_hidden,
            batch,
            ready: None,
        });
    }
    sync_device(target.device);
    if features.len() <= total {
        target_s = target_clock.map_or(0.0, |t| t.elapsed().as_secs_f64());
    }
    mark.set(SampledPhase::Idle);

    let drafter = &p.drafters[0];
    let head = &p.heads[0];
    let mut optimizer = p.optimizer;
    let params = drafter.named_parameters();
    // the learning rates the run uses at these steps (a full rate on a fresh drafter would
    // blow its weights up, and denormal arithmetic is slow on CPUs)
    let total_steps = config.train.total_steps.max(1);
    let warmup_steps = (config.train.warmup_ratio * total_steps as f64).round() as u64;
    let first_step = (skip - warmup) as u64;
    let mut step = |clock: &StageClock, i: usize, item: &FeatureItem| -> Result<()> {
        let _range = step_range();
        train_on_item(clock, config, drafter, head, item, i as u64, 1.0);
        // as the trainer's one replica steps (coordinator.rs): on the fused kernels where they
        // run, else through the flat gradient
        let fused = head
            .loss_kernels
            .filter(|k| k.device() == drafter.device && k.device() == optimizer.device);
        let mut grad = match fused {
            Some(_) => Tensor::new(),
            None => clock.time(ProfileEvent::GradSync, || AdamW::flatten_grads(&params)),
        };
        let lr = lr_at(
            first_step + i as u64,
            total_steps,
            warmup_steps,
            config.train.lr,
            config.train.min_lr_ratio,
        );
        let _norm = clock.time(ProfileEvent::OptimStep, || match &fused {
            Some(kernels) => {
                optimizer.fused_step(&params, kernels, lr, config.train.clip_grad_norm)
            }
            None => apply_update(
                &mut optimizer,
                &params,
                &mut grad,
                config.train.clip_grad_norm,
                lr,
            ),
        })?;
        Ok(())
    };
    // this thread's kernel plans, as the pipeline's drafter threads make theirs at their start
    drafter.warm_up_attention(head, config.data.max_len);
    let untimed = StageClock::new(Device::Cpu);
    for (i, item) in features.iter().enumerate().take(warmup) {
        step(&untimed, i, item)?;
    }
    sync_device(drafter.device);
    let clock = StageClock::new(drafter.device);
    mark.set(SampledPhase::DrafterAlone);
    let drafter_clock = Instant::now();
    for (i, item) in features.iter().enumerate().take(total).skip(warmup) {
        step(&clock, i, item)?;
    }
    sync_device(drafter.device);
    let drafter_s = drafter_clock.elapsed().as_secs_f64();
    mark.set(SampledPhase::Idle);
    let drafter_step_ms = clock.per_step(total - warmup);
    if let Some(trace) = trace {
        // The batches after the measured ones (the scratch drafter trains on), traced: after
        // the timing, so that the profiler's overhead is not in it. Where the data ended
        // there, the first measured batches again.
        let first = if features.len() > total {
            total
        } else {
            warmup
        };
        let recording = ProfilerTrace::start(drafter.device.is_cuda())?;
        let traced = StageClock::new(drafter.device);
        let mut steps = 0;
        for (i, item) in features.iter().enumerate().skip(first).take(trace.steps) {
            step(&traced, i, item)?;
            steps += 1;
        }
        sync_device(drafter.device);
        recording.save(&trace.path)?;
        log::info!(
            "bench: profiler trace of {steps} drafter training steps written to {}",
            trace.path.display()
        );
    }
    let distinct = |devs: &[Device]| {
        let mut d = devs.to_vec();
        d.dedup();
        d.len().max(1) as f64
    };
    let rate = |s: f64| tokens as f64 / s.max(1e-9);
    Ok(StageAloneRates {
        batches: batches.max(1),
        tokens,
        loader_tokens_per_s: rate(loader_s),
        target_tokens_per_s: rate(target_s) * distinct(&p.target_devices),
        drafter_tokens_per_s: rate(drafter_s) * distinct(&p.drafter_devices),
        drafter_step_ms,
    })
}
