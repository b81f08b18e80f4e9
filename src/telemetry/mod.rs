//! Telemetry: what the machine and the run are doing (GPU readings from NVML for now).

pub mod gpu;
pub mod host;
pub mod profile;
pub mod rate;
pub mod records;
