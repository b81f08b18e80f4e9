//! CUDA graphs of libtorch work (libtorch's `at::cuda::CUDAGraph`), for the decoding engines: a
//! decoding step of a small model is hundreds of tiny kernels, and launching them one by one
//! from the host (a few microseconds each) costs far more than running them. A captured graph
//! replays them all with one launch.
//!
//! The C++ side (`cuda_graph.cpp`) needs libtorch's CUDA library, which the binary does not link
//! (it loads it at run time where it exists, see [`crate::runtime`]). So build.rs compiles it
//! into a shared library of its own that the binary embeds; [`GraphLibrary::load`] writes it to
//! an anonymous in-memory file and loads it once CUDA is loaded, its undefined symbols resolving
//! against that libtorch_cuda.

use std::ffi::{c_char, c_int, c_void, CStr};

use anyhow::{anyhow, bail, Result};
use tch::Device;

type GraphNew = unsafe extern "C" fn(c_int, *mut *mut c_char) -> *mut c_void;
type GraphCall = unsafe extern "C" fn(*mut c_void) -> *mut c_char;
type GraphFree = unsafe extern "C" fn(*mut c_void);
type ErrorFree = unsafe extern "C" fn(*mut c_char);
type CurrentStream = unsafe extern "C" fn(c_int, *mut *mut c_void) -> *mut c_char;
type AllocatorStatsFn = unsafe extern "C" fn(c_int, *mut i64) -> *mut c_char;
pub(super) type HandleNew = unsafe extern "C" fn(c_int, *mut *mut c_char) -> *mut c_void;
pub(super) type HandleFree = unsafe extern "C" fn(*mut c_void);
pub(super) type EventBlock = unsafe extern "C" fn(*mut c_void, c_int) -> *mut c_char;
pub(super) type RecordStream = unsafe extern "C" fn(*const c_void, c_int) -> *mut c_char;

/// Counters of libtorch's CUDA caching allocator on one device (what `torch.cuda.memory_stats`
/// reports), since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AllocatorStats {
    /// Device allocations that failed and were retried after freeing the cache: each one
    /// synchronises the device.
    pub alloc_retries: i64,
    /// Synchronisations of every stream to free cached blocks.
    pub syncs_all_streams: i64,
    /// Device memory allocations (cudaMalloc, or mapped pages with expandable segments).
    pub device_allocs: i64,
    /// Device memory frees (cudaFree or unmapped pages).
    pub device_frees: i64,
    /// Allocations that failed even after freeing the cache.
    pub ooms: i64,
    /// Peak bytes handed out to tensors.
    pub peak_allocated_bytes: i64,
    /// Peak bytes held from the device (tensors and the cache).
    pub peak_reserved_bytes: i64,
}

impl AllocatorStats {
    /// The counts of `self` since `before` (the peaks are kept as they are).
    pub fn since(&self, before: &AllocatorStats) -> AllocatorStats {
        AllocatorStats {
            alloc_retries: self.alloc_retries - before.alloc_retries,
            syncs_all_streams: self.syncs_all_streams - before.syncs_all_streams,
            device_allocs: self.device_allocs - before.device_allocs,
            device_frees: self.device_frees - before.device_frees,
            ooms: self.ooms - before.ooms,
            ..*self
        }
    }
}

/// The loaded graph library's functions.
#[derive(Clone, Copy)]
pub struct GraphLibrary {
    new: GraphNew,
    enter_side_stream: GraphCall,
    leave_side_stream: GraphCall,
    capture_begin: GraphCall,
    capture_end: GraphCall,
    replay: GraphCall,
    free: GraphFree,
    free_error: ErrorFree,
    current_stream: CurrentStream,
    allocator_stats: AllocatorStatsFn,
    // the streams and events of `super::streams`
    pub(super) stream_guard_new: HandleNew,
    pub(super) stream_guard_free: HandleFree,
    pub(super) event_record: HandleNew,
    pub(super) event_block: EventBlock,
    pub(super) event_free: HandleFree,
    pub(super) record_stream: RecordStream,
}

impl std::fmt::Debug for GraphLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GraphLibrary")
    }
}

#[cfg(dflash_cuda_graphs)]
const LIBRARY: Option<&[u8]> = Some(include_bytes!(concat!(
    env!("OUT_DIR"),
    "/libdflash_cuda_graph.so"
)));
#[cfg(not(dflash_cuda_graphs))]
const LIBRARY: Option<&[u8]> = None;

impl GraphLibrary {
    /// Loads the embedded library. Call only after libtorch_cuda.so was loaded with
    /// RTLD_GLOBAL (its symbols are resolved now, against that library).
    pub fn load() -> Result<Self> {
        let Some(bytes) = LIBRARY else {
            bail!("this binary was built without the CUDA runtime headers (see build.rs)");
        };
        use std::io::Write;
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create with a valid C string; the descriptor is owned by the File.
        let fd = unsafe { libc::memfd_create(c"dflash_cuda_graph".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            bail!("memfd_create failed: {}", std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.write_all(bytes)
            .map_err(|e| anyhow!("cannot write the CUDA graph library to memory: {e}"))?;
        let path = format!("/proc/self/fd/{fd}");
        // SAFETY: the library's initialisers only set up C++ statics; its functions are the C
        // interface declared above.
        unsafe {
            let lib =
                libloading::os::unix::Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_LOCAL)
                    .map_err(|e| anyhow!("cannot load the CUDA graph library: {e}"))?;
            let get = |name: &[u8]| -> Result<*mut c_void> {
                lib.get::<*mut c_void>(name)
                    .map(|s| *s)
                    .map_err(|e| anyhow!("the CUDA graph library lacks a symbol: {e}"))
            };
            let library = GraphLibrary {
                new: std::mem::transmute::<*mut c_void, GraphNew>(get(b"dflash_graph_new\0")?),
                enter_side_stream: std::mem::transmute::<*mut c_void, GraphCall>(get(
                    b"dflash_graph_enter_side_stream\0",
                )?),
                leave_side_stream: std::mem::transmute::<*mut c_void, GraphCall>(get(
                    b"dflash_graph_leave_side_stream\0",
                )?),
                capture_begin: std::mem::transmute::<*mut c_void, GraphCall>(get(
                    b"dflash_graph_capture_begin\0",
                )?),
                capture_end: std::mem::transmute::<*mut c_void, GraphCall>(get(
                    b"dflash_graph_capture_end\0",
                )?),
                replay: std::mem::transmute::<*mut c_void, GraphCall>(get(
                    b"dflash_graph_replay\0",
                )?),
                free: std::mem::transmute::<*mut c_void, GraphFree>(get(b"dflash_graph_free\0")?),
                free_error: std::mem::transmute::<*mut c_void, ErrorFree>(get(
                    b"dflash_graph_free_error\0",
                )?),
                current_stream: std::mem::transmute::<*mut c_void, CurrentStream>(get(
                    b"dflash_current_stream\0",
                )?),
                allocator_stats: std::mem::transmute::<*mut c_void, AllocatorStatsFn>(get(
                    b"dflash_allocator_stats\0",
                )?),
                stream_guard_new: std::mem::transmute::<*mut c_void, HandleNew>(get(
                    b"dflash_stream_guard_new\0",
                )?),
                stream_guard_free: std::mem::transmute::<*mut c_void, HandleFree>(get(
                    b"dflash_stream_guard_free\0",
                )?),
                event_record: std::mem::transmute::<*mut c_void, HandleNew>(get(
                    b"dflash_stream_event_record\0",
                )?),
                event_block: std::mem::transmute::<*mut c_void, EventBlock>(get(
                    b"dflash_stream_event_block\0",
                )?),
                event_free: std::mem::transmute::<*mut c_void, HandleFree>(get(
                    b"dflash_stream_event_free\0",
                )?),
                record_stream: std::mem::transmute::<*mut c_void, RecordStream>(get(
                    b"dflash_record_stream\0",
                )?),
            };
            // Kept for the life of the process, like libtorch_cuda itself.
            std::mem::forget(lib);
            Ok(library)
        }
    }

    /// libtorch's current stream of this thread on CUDA device `device` (a `cudaStream_t`): the
    /// stream a kernel launched outside libtorch must use to be ordered with libtorch's work
    /// and captured with it into a graph.
    pub(crate) fn current_stream(&self, device: usize) -> Result<*mut c_void> {
        let mut stream = std::ptr::null_mut();
        // SAFETY: a C call that writes the stream or returns a message.
        let err = unsafe { (self.current_stream)(device as c_int, &mut stream) };
        self.check(err, "current stream")?;
        Ok(stream)
    }

    /// The caching allocator's counters of CUDA device `device`.
    pub fn allocator_stats(&self, device: usize) -> Result<AllocatorStats> {
        let mut out = [0i64; 7];
        // SAFETY: a C call that writes 7 values into `out` or returns a message.
        let err = unsafe { (self.allocator_stats)(device as c_int, out.as_mut_ptr()) };
        self.check(err, "allocator statistics")?;
        Ok(AllocatorStats {
            alloc_retries: out[0],
            syncs_all_streams: out[1],
            device_allocs: out[2],
            device_frees: out[3],
            ooms: out[4],
            peak_allocated_bytes: out[5],
            peak_reserved_bytes: out[6],
        })
    }

    /// `Ok` for a null result, else the message (freed here).
    pub(super) fn check(&self, err: *mut c_char, what: &str) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        // SAFETY: a message the library allocated and nobody freed yet.
        let msg = unsafe {
            let msg = CStr::from_ptr(err).to_string_lossy().into_owned();
            (self.free_error)(err);
            msg
        };
        Err(anyhow!("CUDA graph {what}: {msg}"))
    }
}

/// A captured CUDA graph. Tensors made while capturing live in the graph's own memory pool and
/// are rewritten by every replay; keep them (they are the graph's outputs).
pub(crate) struct CudaGraph {
    library: GraphLibrary,
    handle: *mut c_void,
}

impl CudaGraph {
    /// Captures the work `body` queues on `device`: the device is synchronised, `body` runs
    /// `warmup` times eagerly on a side stream (libtorch sets up its per-stream state, such as
    /// cuBLAS workspaces, before capture), then once more under capture, which queues nothing:
    /// call [`CudaGraph::replay`] for the results. `body` must only use device tensors made
    /// before the capture as its inputs (a host value read or a host-to-device copy inside it
    /// would be frozen into the graph, or fail). Returns the graph and what the captured call
    /// returned (its output tensors).
    pub(crate) fn capture<T>(
        library: GraphLibrary,
        device: Device,
        warmup: usize,
        mut body: impl FnMut() -> T,
    ) -> Result<(CudaGraph, T)> {
        let Device::Cuda(index) = device else {
            bail!("CUDA graphs need a CUDA device, not {device:?}");
        };
        let mut err = std::ptr::null_mut();
        // SAFETY: a C call that returns a new graph or sets `err`.
        let handle = unsafe { (library.new)(index as c_int, &mut err) };
        library.check(err, "creation")?;
        if handle.is_null() {
            bail!("CUDA graph creation returned nothing");
        }
        let graph = CudaGraph { library, handle };
        tch::Cuda::synchronize(index as i64);
        // SAFETY (all calls below): a live graph handle.
        library.check(
            unsafe { (library.enter_side_stream)(handle) },
            "side stream",
        )?;
        let captured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<T> {
            for _ in 0..warmup {
                drop(body());
            }
            tch::Cuda::synchronize(index as i64);
            library.check(unsafe { (library.capture_begin)(handle) }, "capture")?;
            // libtorch reports errors as panics in tch; the capture must end either way.
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut body));
            let ended = library.check(unsafe { (library.capture_end)(handle) }, "capture");
            match out {
                Ok(out) => ended.map(|_| out),
                Err(payload) => Err(anyhow!(
                    "CUDA graph capture failed: {}",
                    panic_message(payload.as_ref())
                )),
            }
        }));
        let left = library.check(
            unsafe { (library.leave_side_stream)(handle) },
            "side stream",
        );
        tch::Cuda::synchronize(index as i64);
        let out = match captured {
            Ok(r) => r?,
            Err(payload) => bail!(
                "warming up for a CUDA graph failed: {}",
                panic_message(payload.as_ref())
            ),
        };
        left?;
        Ok((graph, out))
    }

    /// Launches the captured work on the current (default) stream.
    pub(crate) fn replay(&self) -> Result<()> {
        // SAFETY: a live, captured graph.
        self.library
            .check(unsafe { (self.library.replay)(self.handle) }, "replay")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: created by this library, freed once.
        unsafe { (self.library.free)(self.handle) }
    }
}

/// The first line of a panic's message.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let msg = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("unknown error");
    msg.lines().next().unwrap_or(msg).to_string()
}
