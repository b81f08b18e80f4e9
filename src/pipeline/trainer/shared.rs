//! What the stages and the front ends share: the queues, the run's status, pause and stop,
//! the metrics writer; and small helpers every stage uses.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use tch::Device;

use super::loader::BatchItem;
use super::target_stage::FeatureItem;
use crate::config::{FailMode, TrainConfig};
use crate::pipeline::distributed::step::StepShare;
use crate::pipeline::distributed::Distributed;
use crate::pipeline::queue::{QueueLevel, ResizableQueue};
use crate::telemetry::profile::{ProfileReport, ProfileStats};
use crate::telemetry::rate::RateWindow;
use crate::telemetry::records::{
    EvalRecord, EventKind, MetricsRecord, MetricsWriter, Phase, StepRecord, ValidationRecord,
};

pub(super) use crate::telemetry::records::STEP_HISTORY as HISTORY;
/// Periodic evaluations and validation passes kept for the charts.
pub(super) const EVAL_HISTORY: usize = 2_000;

#[derive(Debug, Default)]
pub(super) struct Status {
    pub(super) phase: Option<Phase>,
    pub(super) step: u64,
    pub(super) epoch: u64,
    pub(super) tokens_seen: u64,
    pub(super) samples_seen: u64,
    pub(super) history: Vec<StepRecord>,
    pub(super) evals: Vec<EvalRecord>,
    pub(super) validations: Vec<ValidationRecord>,
    pub(super) error: Option<String>,
    /// Why the run stopped before its last step, if it did.
    pub(super) stop_reason: Option<String>,
    pub(super) last_checkpoint: Option<PathBuf>,
    /// Completed steps over a window: the live rates and the ETA.
    pub(super) rates: RateWindow,
    pub(super) last_profile: Option<ProfileReport>,
    pub(super) stage_devices: Vec<(String, String)>,
}

/// What the stop command asked the coordinator to do at the next step boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub(super) enum StopState {
    /// No stop asked for: the run goes on.
    #[default]
    Running = 0,
    /// `stop`: measure and checkpoint the last weights, then end.
    AfterCheckpoint = 1,
    /// `stop --no-checkpoint`: end at once.
    WithoutCheckpoint = 2,
}

impl From<StopState> for u8 {
    fn from(state: StopState) -> u8 {
        state as u8
    }
}

impl TryFrom<u8> for StopState {
    type Error = u8;
    fn try_from(v: u8) -> Result<StopState, u8> {
        [
            StopState::Running,
            StopState::AfterCheckpoint,
            StopState::WithoutCheckpoint,
        ]
        .into_iter()
        .find(|s| u8::from(*s) == v)
        .ok_or(v)
    }
}

/// A [`StopState`] shared between threads (the command path stores, the coordinator loads).
#[derive(Debug, Default)]
pub(super) struct StopRequest(AtomicU8);

impl StopRequest {
    pub(super) fn store(&self, state: StopState) {
        self.0.store(state.into(), Ordering::SeqCst);
    }

    pub(super) fn load(&self) -> StopState {
        // Only `store` writes the byte, always from a StopState.
        StopState::try_from(self.0.load(Ordering::SeqCst)).unwrap_or_default()
    }
}

/// State shared by the stages and the front ends.
pub struct Shared {
    pub stop: Arc<AtomicBool>,
    pub(super) paused: AtomicBool,
    pub(super) pause_lock: Mutex<()>,
    pub(super) pause_cv: Condvar,
    pub(super) checkpoint_requested: AtomicBool,
    /// What the last stop command asked for, acted on at the next step boundary.
    pub(super) stop_requested: StopRequest,
    pub profile: ProfileStats,
    pub(super) profile_interval_s: Mutex<f64>,
    pub(super) batch_q: ResizableQueue<BatchItem>,
    pub(super) feature_q: ResizableQueue<FeatureItem>,
    pub(super) status: Mutex<Status>,
    pub(super) metrics: MetricsWriter,
    /// How often each sample reached a drafter worker (store index).
    pub sample_visits: Vec<AtomicU32>,
    pub(super) started: Instant,
    /// Seconds the run had trained before this process (a resumed run continues its clock).
    pub(super) elapsed_before_s: f64,
    pub run_dir: PathBuf,
    pub run_name: String,
    /// The target's family and layers ([`crate::model::describe_target`]).
    pub target: Option<String>,
    pub(super) total_steps: u64,
    /// This process's part in a multi-process run (`None`: a single process).
    pub(super) dist: Option<Arc<Distributed>>,
    /// The batches of each global step this process trains.
    pub(super) share: StepShare,
}

impl Shared {
    /// Whether this process decides for the run: rank 0, or the only process.
    pub(super) fn is_leader(&self) -> bool {
        self.dist.as_ref().is_none_or(|d| d.is_leader())
    }

    /// Seconds since the run began, across resumes.
    pub(super) fn elapsed_s(&self) -> f64 {
        self.elapsed_before_s + self.started.elapsed().as_secs_f64()
    }

    pub(super) fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Blocks while paused; false once the pipeline stops.
    pub(super) fn wait_if_paused(&self) -> bool {
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

    /// Waits up to `limit` while the run is paused (and not stopping).
    pub(super) fn wait_while_paused_for(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut guard = self.pause_lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.paused.load(Ordering::Relaxed) && !self.stopping() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            guard = self
                .pause_cv
                .wait_timeout(guard, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(super) fn event(&self, kind: EventKind, message: String) {
        log::info!("{message}");
        self.metrics.write(&MetricsRecord::Event {
            elapsed_s: self.elapsed_s(),
            kind,
            message,
        });
    }

    pub(super) fn set_phase(&self, phase: Phase) {
        self.status().phase = Some(phase);
    }

    /// Records the first error and stops every stage.
    pub(super) fn fail(&self, stage: &str, error: &anyhow::Error) {
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
            kind: EventKind::Error,
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

/// An injected failure of a stage (`[debug]`): an error, or a panic as a libtorch error inside
/// a tch call gives.
pub(super) fn injected_failure(cfg: &TrainConfig, what: String) -> anyhow::Error {
    let stage = cfg.debug.fail_stage;
    if cfg.debug.fail_mode == FailMode::Panic {
        panic!("{what}: injected panic (debug.fail_stage = \"{stage}\")");
    }
    anyhow!("{what}: injected failure (debug.fail_stage = \"{stage}\")")
}

pub(crate) fn sync_device(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}
