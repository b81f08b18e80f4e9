//! GPU readings through NVML. On a machine without an NVIDIA driver NVML is unavailable and
//! every caller shows that instead of GPU rows.

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::Nvml;

/// What holds a GPU's clocks: its SM clock and power draw, and whether the driver is holding
/// the clocks back for power or for heat (benchmarks read it to compare runs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct GpuClocks {
    pub index: u32,
    pub sm_mhz: Option<u32>,
    pub power_watts: Option<f64>,
    /// The software power cap (the board's power limit) is lowering the clocks.
    pub power_capped: Option<bool>,
    /// A thermal or hardware slowdown is lowering the clocks.
    pub slowed_down: Option<bool>,
}

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuReading {
    pub index: u32,
    pub name: String,
    pub utilization_pct: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub power_limit_watts: Option<f64>,
    pub temperature_c: Option<u32>,
}

/// The NVML view of the machine.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum NvmlStatus {
    Available {
        driver_version: String,
        gpus: Vec<GpuReading>,
    },
    Unavailable {
        reason: String,
    },
}

/// A connection to NVML, kept open by samplers.
pub(crate) struct GpuMonitor {
    nvml: Nvml,
}

impl GpuMonitor {
    pub(crate) fn open() -> Result<Self, String> {
        Nvml::init()
            .map(|nvml| GpuMonitor { nvml })
            .map_err(|e| e.to_string())
    }

    pub(crate) fn driver_version(&self) -> String {
        self.nvml
            .sys_driver_version()
            .unwrap_or_else(|e| format!("unknown ({e})"))
    }

    /// Reads every GPU; a reading NVML cannot give is left empty.
    pub(crate) fn sample(&self) -> Result<Vec<GpuReading>, String> {
        self.each_gpu(|index, device| {
            let memory = device.memory_info().ok();
            GpuReading {
                index,
                name: device.name().unwrap_or_else(|_| "unknown GPU".into()),
                utilization_pct: device.utilization_rates().ok().map(|u| u.gpu),
                memory_used_bytes: memory.as_ref().map(|m| m.used),
                memory_total_bytes: memory.as_ref().map(|m| m.total),
                power_watts: device.power_usage().ok().map(|mw| mw as f64 / 1000.0),
                power_limit_watts: device
                    .enforced_power_limit()
                    .ok()
                    .map(|mw| mw as f64 / 1000.0),
                temperature_c: device.temperature(TemperatureSensor::Gpu).ok(),
            }
        })
    }

    /// The clocks of every GPU now; a reading NVML cannot give is left empty.
    pub(crate) fn clocks(&self) -> Result<Vec<GpuClocks>, String> {
        let slow = ThrottleReasons::HW_SLOWDOWN
            | ThrottleReasons::SW_THERMAL_SLOWDOWN
            | ThrottleReasons::HW_THERMAL_SLOWDOWN
            | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN;
        self.each_gpu(|index, device| {
            let reasons = device.current_throttle_reasons().ok();
            GpuClocks {
                index,
                sm_mhz: device.clock_info(Clock::SM).ok(),
                power_watts: device.power_usage().ok().map(|mw| mw as f64 / 1000.0),
                power_capped: reasons.map(|r| r.contains(ThrottleReasons::SW_POWER_CAP)),
                slowed_down: reasons.map(|r| r.intersects(slow)),
            }
        })
    }

    /// `read` of every GPU NVML lists, in its order.
    fn each_gpu<T>(
        &self,
        read: impl Fn(u32, &nvml_wrapper::Device<'_>) -> T,
    ) -> Result<Vec<T>, String> {
        let count = self.nvml.device_count().map_err(|e| e.to_string())?;
        (0..count)
            .map(|index| {
                let device = self
                    .nvml
                    .device_by_index(index)
                    .map_err(|e| e.to_string())?;
                Ok(read(index, &device))
            })
            .collect()
    }
}

/// One-shot status for reports such as `doctor`.
pub(crate) fn nvml_status() -> NvmlStatus {
    match GpuMonitor::open() {
        Err(reason) => NvmlStatus::Unavailable { reason },
        Ok(monitor) => match monitor.sample() {
            Ok(gpus) => NvmlStatus::Available {
                driver_version: monitor.driver_version(),
                gpus,
            },
            Err(reason) => NvmlStatus::Unavailable { reason },
        },
    }
}
