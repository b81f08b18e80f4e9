//! The drafter stage's time per part of a training step (forward, loss, backward, gradient
//! sync, optimizer), measured on the device while the stage runs alone, and the named ranges
//! of those parts in a profiler trace (`bench --trace`).
//!
//! In the pipeline each part is timed on the host ([`ProfileStats`]); on a GPU that is the time
//! its work took to queue, or the time the host waited somewhere in it for earlier work (the
//! target's kernels share the device's queue), not what the part costs the device. Here CUDA
//! timing events, recorded around each part on the device's queue and read once the device has
//! finished, give each part's device time; on the CPU the host time is the work's time.
//!
//! [`ProfileStats`]: crate::telemetry::profile::ProfileStats

use std::cell::RefCell;
use std::ffi::CStr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tch::Device;

use crate::aten_ext::ProfilerRange;
use crate::device_event::{DeviceEvents, TimingEvent};
use crate::pipeline::trainer::StageTimer;
use crate::telemetry::profile::ProfileEvent;

/// The named range of a part in a profiler trace (what `tools/trace_summary.py` totals per
/// stage): the part's profile event name.
fn range_name(event: ProfileEvent) -> &'static CStr {
    match event {
        ProfileEvent::DrafterAnchors => c"drafter.anchors",
        ProfileEvent::DrafterForward => c"drafter.forward",
        ProfileEvent::DrafterLoss => c"drafter.loss",
        ProfileEvent::DrafterBackward => c"drafter.backward",
        ProfileEvent::GradSync => c"grad.sync",
        ProfileEvent::OptimStep => c"optim.step",
        _ => c"other",
    }
}

/// The named range around one whole training step in a trace.
pub(crate) fn step_range() -> ProfilerRange {
    ProfilerRange::new(c"training step")
}

/// One timed part: its device events, or its host time.
enum Mark {
    Device(ProfileEvent, TimingEvent, TimingEvent),
    Host(ProfileEvent, Duration),
}

/// Times the parts of the drafter's steps on `device` (see the module doc) and opens a named
/// range around each, for a profiler trace.
pub(crate) struct StageClock {
    events: Option<DeviceEvents>,
    device: Device,
    marks: RefCell<Vec<Mark>>,
}

impl StageClock {
    pub(crate) fn new(device: Device) -> StageClock {
        StageClock {
            events: DeviceEvents::load().filter(|_| device.is_cuda()),
            device,
            marks: RefCell::default(),
        }
    }

    /// Mean milliseconds per step of each part over `steps` steps; reading device times waits
    /// for the device.
    pub(crate) fn per_step(&self, steps: usize) -> DrafterStepMs {
        let marks = self.marks.borrow();
        let on_device = marks
            .iter()
            .filter(|m| matches!(m, Mark::Device(..)))
            .count();
        let mut ms = DrafterStepMs {
            clock: match on_device {
                0 => "host",
                n if n == marks.len() => "device (CUDA events)",
                _ => "device, host where the runtime gave no event",
            },
            steps,
            ..DrafterStepMs::default()
        };
        let per_step = 1e3 / steps.max(1) as f64;
        for mark in marks.iter() {
            let (event, s) = match mark {
                Mark::Device(event, start, end) => (*event, start.seconds_until(end)),
                Mark::Host(event, d) => (*event, d.as_secs_f64()),
            };
            let slot = match event {
                ProfileEvent::DrafterAnchors => &mut ms.anchors,
                ProfileEvent::DrafterForward => &mut ms.forward,
                ProfileEvent::DrafterLoss => &mut ms.loss,
                ProfileEvent::DrafterBackward => &mut ms.backward,
                ProfileEvent::GradSync => &mut ms.grad_sync,
                ProfileEvent::OptimStep => &mut ms.optimizer,
                _ => continue,
            };
            *slot += s * per_step;
        }
        ms.total = ms.anchors + ms.forward + ms.loss + ms.backward + ms.grad_sync + ms.optimizer;
        ms.forward_over_backward = ms.forward / ms.backward.max(1e-12);
        ms
    }
}

impl StageTimer for StageClock {
    fn time<R>(&self, event: ProfileEvent, f: impl FnOnce() -> R) -> R {
        let _range = ProfilerRange::new(range_name(event));
        let timing = self
            .events
            .and_then(|e| Some((e.timing(self.device)?, e.timing(self.device)?)));
        match timing {
            Some((start, end)) => {
                start.record();
                let out = f();
                end.record();
                self.marks
                    .borrow_mut()
                    .push(Mark::Device(event, start, end));
                out
            }
            None => {
                let t = Instant::now();
                let out = f();
                self.marks.borrow_mut().push(Mark::Host(event, t.elapsed()));
                out
            }
        }
    }
}

/// Milliseconds per training step of each part of the drafter stage run alone (one batch per
/// step), on the device where it is a GPU. `loss` is the LM head's forward and backward pass
/// with the loss (the fused kernel's, where it loads); `backward` is the drafter's layers' from
/// the hidden states' gradient; `grad_sync` the gradients flattened into one buffer (one
/// replica: nothing to exchange); `optimizer` clipping, AdamW and the new compute weights.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct DrafterStepMs {
    /// What measured it: "device (CUDA events)" or "host".
    pub clock: &'static str,
    pub steps: usize,
    pub anchors: f64,
    pub forward: f64,
    pub loss: f64,
    pub backward: f64,
    pub grad_sync: f64,
    pub optimizer: f64,
    /// The sum of the parts.
    pub total: f64,
    /// forward / backward (issue 43's goal: at most 0.6).
    pub forward_over_backward: f64,
}
