//! Work of two threads on one GPU at once: a stream of libtorch's pool made a thread's current
//! stream ([`SideStream`]), and the events that order work across streams ([`StreamEvent`]).
//!
//! The pipeline's target worker queues its forwards on a side stream where a drafter trains on
//! the same device: the device then runs the target's kernels beside the drafter's instead of
//! after them, filling what one stream leaves idle (launch gaps, the tails of large kernels,
//! memory-bound kernels beside compute-bound ones). The features cross to the drafter's stream
//! through an event, and the caching allocator is told that the drafter's stream uses them.
//!
//! The functions live in the CUDA shim library ([`GraphLibrary`], `cuda_graph.cpp`).

use std::ffi::{c_char, c_int, c_void};
use std::marker::PhantomData;

use anyhow::{anyhow, bail, Result};
use tch::{Device, Tensor};

use super::graph::GraphLibrary;

fn cuda_index(device: Device) -> Result<c_int> {
    match device {
        Device::Cuda(i) => Ok(i as c_int),
        other => bail!("streams are a CUDA notion, not one of {other:?}"),
    }
}

/// While alive, libtorch queues this thread's work on `device` on a stream of its pool instead
/// of the default stream. Dropped on the thread that made it (it is not `Send`), which gets its
/// previous stream back.
pub(crate) struct SideStream {
    library: GraphLibrary,
    guard: *mut c_void,
    /// The guard restores the stream of the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl SideStream {
    pub(crate) fn enter(library: GraphLibrary, device: Device) -> Result<SideStream> {
        let index = cuda_index(device)?;
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: a C call that returns a new guard or sets `err`.
        let guard = unsafe { (library.stream_guard_new)(index, &mut err) };
        library.check(err, "side stream")?;
        if guard.is_null() {
            bail!("the side stream guard was not made");
        }
        Ok(SideStream {
            library,
            guard,
            _not_send: PhantomData,
        })
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        // SAFETY: made by this library, freed once, on its own thread.
        unsafe { (self.library.stream_guard_free)(self.guard) }
    }
}

/// A point in one stream's queue of work that another stream can be made to wait for.
pub(crate) struct StreamEvent {
    library: GraphLibrary,
    event: *mut c_void,
    device: c_int,
}

// SAFETY: a CUDA event may be waited for and destroyed from any thread.
unsafe impl Send for StreamEvent {}

impl StreamEvent {
    /// An event recorded now on this thread's current stream of `device`.
    pub(crate) fn record(library: GraphLibrary, device: Device) -> Result<StreamEvent> {
        let index = cuda_index(device)?;
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: a C call that returns a new event or sets `err`.
        let event = unsafe { (library.event_record)(index, &mut err) };
        library.check(err, "event")?;
        if event.is_null() {
            bail!("the stream event was not recorded");
        }
        Ok(StreamEvent {
            library,
            event,
            device: index,
        })
    }

    /// Makes this thread's current stream of the event's device wait for the work queued
    /// before the event (on the device; the host goes on), and tells the caching allocator that
    /// `tensors` are used on that stream too, so that their memory, once freed, is not handed
    /// out again before that stream's work on them has run.
    pub(crate) fn hand_over(&self, tensors: &[&Tensor]) -> Result<()> {
        // SAFETY: a live event of this library.
        let err = unsafe { (self.library.event_block)(self.event, self.device) };
        self.library.check(err, "event wait")?;
        for t in tensors {
            // SAFETY: a live tensor (tch's `at::Tensor *`).
            let err = unsafe { (self.library.record_stream)(t.as_ptr().cast(), self.device) };
            self.library
                .check(err, "record_stream")
                .map_err(|e| anyhow!("{e} (a tensor of {:?})", t.size()))?;
        }
        Ok(())
    }
}

impl Drop for StreamEvent {
    fn drop(&mut self) {
        // SAFETY: made by this library, freed once.
        unsafe { (self.library.event_free)(self.event) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// `cargo test --release --lib -- --ignored streams` on a GPU: a thread on a side stream
    /// queues a long chain of products and hands its result over at once; the main thread's
    /// stream waits for it through the event (the host never waits), and the memory, freed on
    /// the main thread, is not handed out to the side stream while the main stream reads it.
    /// Each round's sum is exact (small integers in float32).
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_side_stream_hands_its_work_over_through_an_event() {
        let runtime = crate::runtime::TorchRuntime::init();
        assert!(runtime.cuda_devices() >= 1, "this test needs a CUDA device");
        let library = runtime.graphs.clone().expect("the CUDA shim library");
        let dev = Device::Cuda(0);
        let (tx, rx) = std::sync::mpsc::sync_channel::<(i64, Tensor, StreamEvent)>(2);
        let producer = std::thread::spawn(move || {
            let _side = SideStream::enter(library, dev).expect("side stream");
            let eye = Tensor::eye(2048, (Kind::Float, dev));
            for round in 0..20i64 {
                // ~40 products of 2048^3 before the values are there: far longer than the
                // host takes to hand the tensor over
                let mut x = Tensor::full([2048, 2048], round as f64, (Kind::Float, dev));
                for _ in 0..40 {
                    x = x.matmul(&eye);
                }
                let event = StreamEvent::record(library, dev).expect("event");
                tx.send((round, x, event)).expect("send");
            }
        });
        for (round, x, event) in rx {
            event.hand_over(&[&x]).expect("hand over");
            let sum = x.sum(Kind::Double).double_value(&[]);
            assert_eq!(sum, round as f64 * 2048.0 * 2048.0, "round {round}");
        }
        producer.join().expect("producer");
    }
}
