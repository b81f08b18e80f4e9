//! Telemetry: what the machine and the run are doing (GPU readings from NVML for now), and how
//! its durations read (below pipeline and ui, so both front ends format them alike).

pub mod format;
pub mod gpu;
pub mod host;
pub mod profile;
pub mod rate;
pub mod records;
