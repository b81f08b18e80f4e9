//! Telemetry: what the machine and the run are doing (GPU readings from NVML, the process's CPU
//! and memory, stage profiles, queue levels, rates), the run's records (metrics.jsonl, TensorBoard),
//! and how its durations read (below pipeline and frontend, so the run loop and the screen format them alike).

pub mod event_kind;
pub(crate) mod format;
pub mod gpu;
pub mod host;
pub(crate) mod metrics_tail;
pub mod profile;
pub(crate) mod profile_event;
pub(crate) mod queues;
pub mod ranks;
pub mod rate;
pub mod records;
pub(crate) mod status;
pub(crate) mod tensorboard;
