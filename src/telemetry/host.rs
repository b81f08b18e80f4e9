//! The trainer process's own CPU and memory use, shown in place of the GPU rows where NVML is
//! unavailable (a CPU run, a machine without the NVIDIA driver).

use serde::{Deserialize, Serialize};
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

/// One reading of the process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostReading {
    /// CPU use since the previous reading, in cores (1.0 = one core busy).
    pub cpu_cores: f64,
    /// Cores the machine has.
    pub cores: usize,
    /// Resident memory of the process.
    pub memory_bytes: u64,
    /// Memory of the machine.
    pub memory_total_bytes: u64,
}

/// Samples one process (this one) with sysinfo.
pub(crate) struct HostMonitor {
    system: System,
    pid: Pid,
    cores: usize,
}

impl HostMonitor {
    pub(crate) fn for_this_process() -> Self {
        let mut system = System::new();
        system.refresh_memory();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut monitor = HostMonitor {
            system,
            pid: Pid::from_u32(std::process::id()),
            cores,
        };
        // CPU use is measured between two refreshes: this is the first.
        monitor.refresh();
        monitor
    }

    fn refresh(&mut self) {
        self.system.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[self.pid]),
            true,
            ProcessRefreshKind::nothing().with_cpu().with_memory(),
        );
    }

    /// The process's use since the previous call.
    pub(crate) fn sample(&mut self) -> Option<HostReading> {
        self.refresh();
        let process = self.system.process(self.pid)?;
        Some(HostReading {
            cpu_cores: f64::from(process.cpu_usage()) / 100.0,
            cores: self.cores,
            memory_bytes: process.memory(),
            memory_total_bytes: self.system.total_memory(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_thread_shows_as_cpu_use_and_memory_is_read() {
        let mut host = HostMonitor::for_this_process();
        let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut x = 0u64;
        while std::time::Instant::now() < until {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let r = host.sample().expect("this process is listed");
        assert!(r.cpu_cores > 0.3, "{r:?}");
        assert!(
            r.memory_bytes > 1 << 20 && r.memory_bytes < r.memory_total_bytes,
            "{r:?}"
        );
        assert!(r.cores >= 1);
    }
}
