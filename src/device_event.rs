//! Points in a GPU's queue of work that the host can wait for: CUDA events, recorded on the
//! default stream (the one libtorch queues every operation of this program on), through the
//! CUDA runtime libtorch itself loaded. A blocking read of a tensor from the device waits for
//! all work queued so far; waiting for an event recorded after a step's last operation waits
//! for that step only, while the next one keeps the device busy.
//!
//! The runtime is found among the libraries already loaded (never a second copy, whose state
//! would be its own); without it (a CPU run, or an unexpected layout) [`DeviceEvents::load`]
//! gives `None` and callers read their tensors the blocking way.

use std::ffi::{c_int, c_void};

use tch::Device;

type EventCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type EventWait = unsafe extern "C" fn(*mut c_void) -> c_int;
type SetDevice = unsafe extern "C" fn(c_int) -> c_int;
type EventElapsed = unsafe extern "C" fn(*mut f32, *mut c_void, *mut c_void) -> c_int;
type GetLastError = unsafe extern "C" fn() -> c_int;

/// cudaEventDisableTiming: an event only marks a point (cheaper to record and wait for).
const DISABLE_TIMING: u32 = 0x02;

/// The CUDA runtime's event functions.
#[derive(Clone, Copy)]
pub(crate) struct DeviceEvents {
    create: EventCreate,
    record: EventRecord,
    synchronize: EventWait,
    destroy: EventWait,
    set_device: SetDevice,
    elapsed: EventElapsed,
    /// Clears the runtime's "last error": a failed call of ours must not surface later as the
    /// error of an unrelated libtorch kernel launch (which checks it).
    get_last_error: GetLastError,
}

/// A recorded event: [`DeviceEvent::wait`] returns once the device has run everything queued
/// before it was recorded.
pub(crate) struct DeviceEvent {
    events: DeviceEvents,
    event: *mut c_void,
}

// SAFETY: a CUDA event handle may be waited for and destroyed from any thread.
unsafe impl Send for DeviceEvent {}

impl DeviceEvents {
    /// The event functions of the CUDA runtime this process has loaded (libtorch's), if any.
    pub(crate) fn load() -> Option<Self> {
        let path = crate::runtime::loaded_library(|f| f.starts_with("libcudart.so"))?;
        // SAFETY: RTLD_NOLOAD only returns a library that is already loaded (no initialisers
        // run); the symbols are the CUDA runtime's documented C functions with these types.
        unsafe {
            let library = libloading::os::unix::Library::open(
                Some(&path),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            )
            .ok()?;
            let create = *library
                .get::<EventCreate>(b"cudaEventCreateWithFlags\0")
                .ok()?;
            let record = *library.get::<EventRecord>(b"cudaEventRecord\0").ok()?;
            let synchronize = *library.get::<EventWait>(b"cudaEventSynchronize\0").ok()?;
            let destroy = *library.get::<EventWait>(b"cudaEventDestroy\0").ok()?;
            let set_device = *library.get::<SetDevice>(b"cudaSetDevice\0").ok()?;
            let elapsed = *library
                .get::<EventElapsed>(b"cudaEventElapsedTime\0")
                .ok()?;
            let get_last_error = *library.get::<GetLastError>(b"cudaGetLastError\0").ok()?;
            // libtorch keeps the runtime loaded for the life of the process; so does this.
            std::mem::forget(library);
            Some(DeviceEvents {
                create,
                record,
                synchronize,
                destroy,
                set_device,
                elapsed,
                get_last_error,
            })
        }
    }

    /// Makes CUDA device `index` this thread's current device (what NCCL binds a new
    /// communicator to); false when the runtime refuses.
    pub(crate) fn set_current_device(&self, index: i32) -> bool {
        // SAFETY: a plain CUDA runtime call; its error, if any, is cleared for libtorch.
        unsafe {
            let ok = (self.set_device)(index as c_int) == 0;
            if !ok {
                (self.get_last_error)();
            }
            ok
        }
    }

    /// An event recorded now on `device`'s default stream; `None` for the CPU (its work is
    /// done when the call returns) or when the runtime refuses.
    pub(crate) fn record(&self, device: Device) -> Option<DeviceEvent> {
        let Device::Cuda(index) = device else {
            return None;
        };
        let mut event = std::ptr::null_mut();
        // SAFETY: plain CUDA runtime calls; the event is destroyed by DeviceEvent's drop.
        // Setting the thread's current device is what makes stream 0 that device's default
        // stream; libtorch sets the device it needs around each of its own operations.
        unsafe {
            if (self.set_device)(index as c_int) != 0
                || (self.create)(&mut event, DISABLE_TIMING) != 0
            {
                return None;
            }
            let recorded = DeviceEvent {
                events: *self,
                event,
            };
            if (self.record)(event, std::ptr::null_mut()) != 0 {
                return None;
            }
            Some(recorded)
        }
    }
}

/// An event that can be recorded again and again and measures device time between two
/// recordings (for the decoding steps' time breakdown).
pub(crate) struct TimingEvent {
    events: DeviceEvents,
    event: *mut c_void,
    device: c_int,
    recorded: std::cell::Cell<bool>,
}

impl DeviceEvents {
    /// A timing event for `device`; `None` for the CPU or when the runtime refuses.
    pub(crate) fn timing(&self, device: Device) -> Option<TimingEvent> {
        let Device::Cuda(index) = device else {
            return None;
        };
        let mut event = std::ptr::null_mut();
        // SAFETY: plain CUDA runtime calls; the event is destroyed by TimingEvent's drop.
        unsafe {
            if (self.set_device)(index as c_int) != 0 || (self.create)(&mut event, 0) != 0 {
                return None;
            }
        }
        Some(TimingEvent {
            events: *self,
            event,
            device: index as c_int,
            recorded: std::cell::Cell::new(false),
        })
    }
}

impl TimingEvent {
    /// Records the event now on the device's default stream (the one libtorch queues on).
    pub(crate) fn record(&self) {
        // SAFETY: a live event of this runtime.
        unsafe {
            let ok = (self.events.set_device)(self.device) == 0
                && (self.events.record)(self.event, std::ptr::null_mut()) == 0;
            if !ok {
                (self.events.get_last_error)();
            }
            self.recorded.set(ok);
        }
    }

    /// Device seconds from this event's last recording to `later`'s (waits for `later`); 0
    /// where the runtime cannot tell (an event never recorded, say).
    pub(crate) fn seconds_until(&self, later: &TimingEvent) -> f64 {
        if !(self.recorded.get() && later.recorded.get()) {
            return 0.0;
        }
        let mut ms = 0f32;
        // SAFETY: live, recorded events of this runtime.
        unsafe {
            if (self.events.synchronize)(later.event) != 0
                || (self.events.elapsed)(&mut ms, self.event, later.event) != 0
            {
                (self.events.get_last_error)();
                return 0.0;
            }
        }
        f64::from(ms) / 1e3
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        // SAFETY: created by this runtime, destroyed once.
        unsafe {
            (self.events.destroy)(self.event);
        }
    }
}

impl DeviceEvent {
    /// Blocks until the device has run everything queued before the event; false if the
    /// runtime reported an error (the caller then falls back to a blocking read).
    pub(crate) fn wait(&self) -> bool {
        // SAFETY: a live event created by this runtime.
        unsafe { (self.events.synchronize)(self.event) == 0 }
    }
}

impl Drop for DeviceEvent {
    fn drop(&mut self) {
        // SAFETY: created by this runtime, destroyed once.
        unsafe {
            (self.events.destroy)(self.event);
        }
    }
}
