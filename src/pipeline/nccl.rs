//! NCCL at run time: finding and loading libnccl, one communicator per drafter device in this
//! process, and the two collectives the trainer uses (a sum-reduce to rank 0 and a broadcast
//! from rank 0) on the raw device pointers of tch tensors.
//!
//! The FFI types (communicator handle, data types, reduction operators, stream) and the library
//! names NCCL is usually installed under come from `cudarc` (features `nccl` +
//! `dynamic-loading`, so nothing is linked at build time). The library itself is loaded here
//! rather than through cudarc's lazy loader, which only tries names such as `libnccl.so` and
//! `libnccl.so.<CUDA major>`: the NCCL that PyTorch's wheels bring is `libnccl.so.2` in
//! `site-packages/nvidia/nccl/lib`, found through `libtorch_cuda.so`'s own rpath and not on the
//! library path. Nothing here runs (and libnccl is never loaded) unless gradients are to be
//! synchronised with NCCL.
//!
//! Streams: tch runs every kernel on libtorch's default stream, which is the legacy default
//! stream of each device. The collectives are issued on that stream too (a null
//! `cudaStream_t`), so they start after the kernels that produced their input and finish
//! before any later kernel on the device reads their output, without a host synchronisation.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{anyhow, bail, Result};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

use crate::runtime::library_symbol;
use tch::{Device, Kind, Tensor};

/// Environment variable naming the libnccl file to load (tried before anything else).
pub(crate) const LIBRARY_ENV: &str = "DFLASH_NCCL_LIBRARY";

// The entry points used, with `ncclResult_t` taken as a plain integer: NCCL versions differ in
// the codes they may return, and a Rust enum must never hold a value it does not list.
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type CommInitAllFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> c_int;
type CommAbortFn = unsafe extern "C" fn(ncclComm_t) -> c_int;
type GroupFn = unsafe extern "C" fn() -> c_int;
type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type SendRecvFn = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;

/// A loaded libnccl and the entry points the trainer uses.
pub(crate) struct NcclLibrary {
    /// The file it was loaded from (as given to the dynamic loader).
    pub path: PathBuf,
    /// `ncclGetVersion`: major * 10000 + minor * 100 + patch (NCCL >= 2.9).
    pub version: i32,
    get_error_string: GetErrorStringFn,
    comm_init_all: CommInitAllFn,
    comm_abort: CommAbortFn,
    group_start: GroupFn,
    group_end: GroupFn,
    reduce: ReduceFn,
    broadcast: BroadcastFn,
    // across processes (see `distributed::nccl_peer`)
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    send: SendRecvFn,
    recv: SendRecvFn,
    all_gather: AllGatherFn,
    /// Kept loaded for the life of the process (the entry points above point into it).
    _library: libloading::Library,
}

impl NcclLibrary {
    /// "2.28.9"
    pub(crate) fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    }

    fn error(&self, call: &str, code: c_int) -> anyhow::Error {
        // SAFETY: ncclGetErrorString takes any code and returns a static string (or null).
        let text = unsafe { (self.get_error_string)(code) };
        let text = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a non-null result is a NUL-terminated static string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        anyhow!("{call} failed: NCCL error {code} ({text})")
    }

    fn check(&self, call: &str, code: c_int) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }
}

/// Where libnccl is looked for: only `$DFLASH_NCCL_LIBRARY` when it is set; otherwise, in
/// order, a libnccl this process has already loaded (libtorch_cuda.so brings PyTorch's), the
/// pip wheel's file beside the loaded libtorch (`<site-packages>/nvidia/nccl/lib/libnccl.so.2`,
/// as `torch/lib/../../nvidia/...`), then `libnccl.so.2` and cudarc's usual names through the
/// dynamic loader's search (LD_LIBRARY_PATH, the ld.so cache).
pub(crate) fn library_candidates(libtorch_dir: Option<&Path>) -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut out: Vec<PathBuf> = loaded_nccl();
    if let Some(dir) = libtorch_dir {
        // torch/lib -> site-packages
        if let Some(site) = dir.parent().and_then(Path::parent) {
            let wheel = site.join("nvidia/nccl/lib/libnccl.so.2");
            if wheel.is_file() {
                out.push(wheel);
            }
        }
    }
    out.push(PathBuf::from("libnccl.so.2"));
    out.extend(
        cudarc::get_lib_name_candidates("nccl")
            .into_iter()
            .map(PathBuf::from),
    );
    let mut seen = Vec::new();
    out.retain(|p| {
        let new = !seen.contains(p);
        seen.push(p.clone());
        new
    });
    out
}

/// Files named `libnccl.so*` mapped into this process, from /proc/self/maps.
fn loaded_nccl() -> Vec<PathBuf> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = Vec::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let p = Path::new(path);
        let named = p
            .file_name()
            .and_then(|f| f.to_str())
            .is_some_and(|f| f.starts_with("libnccl.so"));
        if named && !out.iter().any(|o| o == p) {
            out.push(p.to_path_buf());
        }
    }
    out
}

/// Loads libnccl (once per process; later calls return the first outcome).
pub(crate) fn library(
    libtorch_dir: Option<&Path>,
) -> std::result::Result<&'static NcclLibrary, String> {
    static LIBRARY: OnceLock<std::result::Result<NcclLibrary, String>> = OnceLock::new();
    LIBRARY
        .get_or_init(|| load(&library_candidates(libtorch_dir)))
        .as_ref()
        .map_err(Clone::clone)
}

fn load(candidates: &[PathBuf]) -> std::result::Result<NcclLibrary, String> {
    let mut failures = Vec::new();
    for path in candidates {
        match load_from(path) {
            Ok(lib) => return Ok(lib),
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
    }
    Err(format!(
        "libnccl could not be loaded (tried {}); set {LIBRARY_ENV} to the file's path \
         (e.g. <site-packages>/nvidia/nccl/lib/libnccl.so.2)",
        failures.join("; ")
    ))
}

fn load_from(path: &Path) -> std::result::Result<NcclLibrary, String> {
    // SAFETY: loading libnccl runs only its own initialisers; it is a plain C library.
    let library = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    // SAFETY: each symbol is looked up with the C signature nccl.h declares for it.
    unsafe {
        let get_version = library_symbol::<GetVersionFn>(&library, "ncclGetVersion")?;
        let lib = NcclLibrary {
            path: path.to_path_buf(),
            version: 0,
            get_error_string: library_symbol::<GetErrorStringFn>(&library, "ncclGetErrorString")?,
            comm_init_all: library_symbol::<CommInitAllFn>(&library, "ncclCommInitAll")?,
            comm_abort: library_symbol::<CommAbortFn>(&library, "ncclCommAbort")?,
            group_start: library_symbol::<GroupFn>(&library, "ncclGroupStart")?,
            group_end: library_symbol::<GroupFn>(&library, "ncclGroupEnd")?,
            reduce: library_symbol::<ReduceFn>(&library, "ncclReduce")?,
            broadcast: library_symbol::<BroadcastFn>(&library, "ncclBroadcast")?,
            get_unique_id: library_symbol::<GetUniqueIdFn>(&library, "ncclGetUniqueId")?,
            comm_init_rank: library_symbol::<CommInitRankFn>(&library, "ncclCommInitRank")?,
            send: library_symbol::<SendRecvFn>(&library, "ncclSend")?,
            recv: library_symbol::<SendRecvFn>(&library, "ncclRecv")?,
            all_gather: library_symbol::<AllGatherFn>(&library, "ncclAllGather")?,
            _library: library,
        };
        let mut version: c_int = 0;
        let code = get_version(&mut version);
        if code != 0 {
            return Err(lib.error("ncclGetVersion", code).to_string());
        }
        // (before 2.9 the code was major * 1000 + minor * 100 + patch: smaller still)
        if version < 21000 {
            return Err(format!(
                "NCCL version code {version} is too old (2.10 or newer is needed, for bf16)"
            ));
        }
        Ok(NcclLibrary { version, ..lib })
    }
}

/// A communicator handle that may move to another thread.
///
/// SAFETY of the `Send`/`Sync` impls: NCCL communicators are not tied to the thread that
/// created them; what NCCL forbids is using one communicator from two threads at once. A
/// handle is only used through the one [`NcclRank`] of its rank (not `Clone`; all ranks are
/// held and used by one thread) and, once every rank has been dropped, by [`Clique`]'s `Drop`,
/// which then has the only reference.
struct RawComm(ncclComm_t);

unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// The communicators of all drafter devices of this process (rank r on device r of the list).
struct Clique {
    library: &'static NcclLibrary,
    comms: Vec<RawComm>,
    devices: Vec<i32>,
    /// Set when a rank failed in the middle of the collective protocol: a collective may then
    /// be waiting on a device for a peer that will never join, so the devices are not waited
    /// for before the communicators are aborted.
    poisoned: AtomicBool,
}

impl Drop for Clique {
    fn drop(&mut self) {
        // (no waiting while a panic unwinds: a CUDA error would panic again and abort)
        if !self.poisoned.load(Ordering::SeqCst) && !std::thread::panicking() {
            // Every collective issued was issued by all ranks: let them finish.
            for &d in &self.devices {
                tch::Cuda::synchronize(d as i64);
            }
        }
        for (rank, comm) in self.comms.iter().enumerate() {
            // SAFETY: every NcclRank is gone (they hold the Arc), so nothing else uses the
            // handle; ncclCommAbort frees it and stops whatever is still running on it.
            let code = unsafe { (self.library.comm_abort)(comm.0) };
            if code != 0 {
                log::warn!(
                    "NCCL rank {rank}: {}",
                    self.library.error("ncclCommAbort", code)
                );
            }
        }
    }
}

/// One rank's communicator. All ranks are driven by one thread (the coordinator's), every
/// collective as one NCCL group over all ranks: no rank's half of a collective is ever queued
/// on a GPU while another thread still has to queue the other half.
pub(crate) struct NcclRank {
    clique: Arc<Clique>,
    rank: usize,
}

/// Runs `issue` (which queues one call per rank) between `ncclGroupStart` and `ncclGroupEnd`:
/// NCCL then launches the whole collective on every rank's device at once. On failure the
/// clique is poisoned (some ranks' halves may be queued without the others').
pub(crate) fn group(ranks: &[NcclRank], issue: impl FnOnce() -> Result<()>) -> Result<()> {
    let Some(first) = ranks.first() else {
        return Ok(());
    };
    let lib = first.clique.library;
    // SAFETY: group calls take no arguments; every call between them is checked below.
    let started = lib.check("ncclGroupStart", unsafe { (lib.group_start)() });
    let issued = started.and_then(|_| issue());
    // SAFETY: as above; a group that was started is always ended, even after a failed call.
    let ended = lib.check("ncclGroupEnd", unsafe { (lib.group_end)() });
    let result = issued.and(ended);
    if result.is_err() {
        first.poison();
    }
    result
}

/// Creates one communicator per device (`ncclCommInitAll`, within this process); the ranks
/// follow the order of `devices`, so rank 0 is the first drafter device.
pub(crate) fn communicators(
    library: &'static NcclLibrary,
    devices: &[Device],
) -> Result<Vec<NcclRank>> {
    let ordinals = devices
        .iter()
        .map(|d| match d {
            Device::Cuda(i) => Ok(*i as c_int),
            other => bail!("NCCL needs CUDA devices, not {other:?}"),
        })
        .collect::<Result<Vec<c_int>>>()?;
    let mut handles: Vec<ncclComm_t> = vec![std::ptr::null_mut(); ordinals.len()];
    // SAFETY: `handles` has room for one communicator per listed device.
    let code = unsafe {
        (library.comm_init_all)(
            handles.as_mut_ptr(),
            ordinals.len() as c_int,
            ordinals.as_ptr(),
        )
    };
    library.check("ncclCommInitAll", code)?;
    let clique = Arc::new(Clique {
        library,
        comms: handles.into_iter().map(RawComm).collect(),
        devices: ordinals,
        poisoned: AtomicBool::new(false),
    });
    Ok((0..devices.len())
        .map(|rank| NcclRank {
            clique: clique.clone(),
            rank,
        })
        .collect())
}

/// The NCCL type of a tensor kind that is moved by the collectives.
fn data_type(kind: Kind) -> Result<ncclDataType_t> {
    Ok(match kind {
        Kind::Float => ncclDataType_t::ncclFloat32,
        Kind::BFloat16 => ncclDataType_t::ncclBfloat16,
        Kind::Half => ncclDataType_t::ncclFloat16,
        Kind::Double => ncclDataType_t::ncclFloat64,
        other => bail!("NCCL: tensors of kind {other:?} are not supported here"),
    })
}

impl NcclRank {
    fn comm(&self) -> ncclComm_t {
        self.clique.comms[self.rank].0
    }

    /// Marks the clique as failed mid-protocol (see [`Clique::poisoned`]).
    pub(crate) fn poison(&self) {
        self.clique.poisoned.store(true, Ordering::SeqCst);
    }

    /// A contiguous tensor on this rank's device, as (pointer, count, type).
    fn buffer(&self, t: &Tensor, what: &str) -> Result<(*mut c_void, usize, ncclDataType_t)> {
        let device = Device::Cuda(self.clique.devices[self.rank] as usize);
        if t.device() != device {
            bail!(
                "NCCL rank {}: the {what} is on {:?}, the communicator on {device:?}",
                self.rank,
                t.device()
            );
        }
        if !t.is_contiguous() {
            bail!("NCCL rank {}: the {what} is not contiguous", self.rank);
        }
        Ok((t.data_ptr(), t.numel(), data_type(t.kind())?))
    }

    /// Sums `t` over all ranks into rank 0's `t`, in place (other ranks' `t` is only read).
    /// Issued on the device's default stream, inside a [`group`] with the other ranks' calls.
    pub(crate) fn reduce_sum_to_root(&self, t: &Tensor) -> Result<()> {
        let (ptr, count, dtype) = self.buffer(t, "gradient")?;
        // SAFETY: `ptr` addresses `count` elements of `dtype` on this communicator's device,
        // alive until the queued reduce has run: the caller keeps `t` until later work on the
        // same stream, and the caching allocator reuses its memory only in stream order.
        let code = unsafe {
            (self.clique.library.reduce)(
                ptr,
                ptr,
                count,
                dtype,
                ncclRedOp_t::ncclSum,
                0,
                self.comm(),
                std::ptr::null_mut(),
            )
        };
        self.clique.library.check("ncclReduce", code)
    }

    /// Copies rank 0's `t` into every other rank's `t` (same count and kind on every rank).
    /// Issued on the device's default stream, inside a [`group`] with the other ranks' calls.
    pub(crate) fn broadcast_from_root(&self, t: &Tensor) -> Result<()> {
        let (ptr, count, dtype) = self.buffer(t, "weight buffer")?;
        // SAFETY: as in `reduce_sum_to_root`; the root only reads `t`, the others write it.
        let code = unsafe {
            (self.clique.library.broadcast)(
                ptr,
                ptr,
                count,
                dtype,
                0,
                self.comm(),
                std::ptr::null_mut(),
            )
        };
        self.clique.library.check("ncclBroadcast", code)
    }
}

/// The size of NCCL's unique id (`NCCL_UNIQUE_ID_BYTES`).
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

impl NcclLibrary {
    /// A new unique id for a communicator across processes (made by one rank, shared with the
    /// others, e.g. through the c10d store).
    pub(crate) fn unique_id(&self) -> Result<Vec<u8>> {
        let mut id = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: `id` is an ncclUniqueId NCCL fills.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id.internal.iter().map(|&b| b as u8).collect())
    }
}

/// This process's communicator among the processes of a multi-process run (one rank per
/// process, on its drafter device 0), used by one thread (the coordinator's).
pub(crate) struct ProcessComm {
    library: &'static NcclLibrary,
    comm: RawComm,
    device: i32,
    pub world: usize,
}

impl ProcessComm {
    /// Joins the communicator of `id` as `rank` of `world` on CUDA device `device` (every rank
    /// calls this at the same time; it returns once all have). `set_device` makes `device` the
    /// thread's current CUDA device, which ncclCommInitRank binds the communicator to.
    pub(crate) fn join(
        library: &'static NcclLibrary,
        id: &[u8],
        rank: usize,
        world: usize,
        device: i32,
        set_device: impl FnOnce(i32) -> Result<()>,
    ) -> Result<ProcessComm> {
        if id.len() != UNIQUE_ID_BYTES {
            bail!(
                "NCCL unique id of {} bytes, not {UNIQUE_ID_BYTES}",
                id.len()
            );
        }
        let mut unique = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        for (d, s) in unique.internal.iter_mut().zip(id) {
            *d = *s as c_char;
        }
        set_device(device)?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: an out pointer for the handle, the id by value, rank < world.
        let code =
            unsafe { (library.comm_init_rank)(&mut comm, world as c_int, unique, rank as c_int) };
        library.check("ncclCommInitRank", code)?;
        Ok(ProcessComm {
            library,
            comm: RawComm(comm),
            device,
            world,
        })
    }

    fn buffer(&self, t: &Tensor) -> Result<(*mut c_void, usize, ncclDataType_t)> {
        if t.device() != Device::Cuda(self.device as usize) || !t.is_contiguous() {
            bail!(
                "NCCL across processes: a contiguous tensor on cuda:{} is needed, not {:?}",
                self.device,
                t.device()
            );
        }
        Ok((t.data_ptr(), t.numel(), data_type(t.kind())?))
    }

    /// Row k of `input` (`[world, shard]`) to rank k; row r of `out` from rank r: grouped
    /// sends and receives on the device's default stream.
    pub(crate) fn alltoall(&self, out: &Tensor, input: &Tensor) -> Result<()> {
        let lib = self.library;
        let (inp, n_in, dtype) = self.buffer(input)?;
        let (outp, n_out, _) = self.buffer(out)?;
        if n_in != n_out || n_in % self.world != 0 {
            bail!(
                "NCCL all-to-all: {n_in} elements in, {n_out} out, world {}",
                self.world
            );
        }
        let shard = n_in / self.world;
        let bytes = shard * input.kind().elt_size_in_bytes();
        // SAFETY: group calls; each send/recv addresses `shard` elements inside `input`/`out`,
        // which the caller keeps alive until later work on the same stream.
        unsafe {
            lib.check("ncclGroupStart", (lib.group_start)())?;
            let mut issued = Ok(());
            for peer in 0..self.world {
                let at = peer * bytes;
                let sent = (lib.send)(
                    (inp as *mut u8).add(at) as *mut c_void,
                    shard,
                    dtype,
                    peer as c_int,
                    self.comm.0,
                    std::ptr::null_mut(),
                );
                let got = (lib.recv)(
                    (outp as *mut u8).add(at) as *mut c_void,
                    shard,
                    dtype,
                    peer as c_int,
                    self.comm.0,
                    std::ptr::null_mut(),
                );
                issued = issued
                    .and(lib.check("ncclSend", sent))
                    .and(lib.check("ncclRecv", got));
            }
            let ended = lib.check("ncclGroupEnd", (lib.group_end)());
            issued.and(ended)
        }
    }

    /// Every rank's `input` into `out`, in rank order.
    pub(crate) fn allgather(&self, out: &Tensor, input: &Tensor) -> Result<()> {
        let (inp, n, dtype) = self.buffer(input)?;
        let (outp, n_out, _) = self.buffer(out)?;
        if n_out != n * self.world {
            bail!(
                "NCCL allgather: {n} elements in, {n_out} out, world {}",
                self.world
            );
        }
        // SAFETY: as in `alltoall`.
        let code = unsafe {
            (self.library.all_gather)(inp, outp, n, dtype, self.comm.0, std::ptr::null_mut())
        };
        self.library.check("ncclAllGather", code)
    }
}

impl Drop for ProcessComm {
    fn drop(&mut self) {
        // SAFETY: the one handle of this communicator, not used after this.
        let code = unsafe { (self.library.comm_abort)(self.comm.0) };
        if code != 0 {
            log::warn!("{}", self.library.error("ncclCommAbort", code));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_include_the_versioned_name() {
        if std::env::var_os(LIBRARY_ENV).is_some() {
            return;
        }
        let c = library_candidates(None);
        assert!(c.contains(&PathBuf::from("libnccl.so.2")), "{c:?}");
        assert!(c.contains(&PathBuf::from("libnccl.so")), "{c:?}");
        let mut sorted = c.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), c.len(), "no duplicates: {c:?}");
    }

    #[test]
    fn the_wheel_file_beside_libtorch_is_a_candidate() {
        let tmp = tempfile::tempdir().unwrap();
        let torch_lib = tmp.path().join("torch/lib");
        let nccl_lib = tmp.path().join("nvidia/nccl/lib");
        std::fs::create_dir_all(&torch_lib).unwrap();
        std::fs::create_dir_all(&nccl_lib).unwrap();
        std::fs::write(nccl_lib.join("libnccl.so.2"), b"").unwrap();
        let c = library_candidates(Some(&torch_lib));
        if std::env::var_os(LIBRARY_ENV).is_some() {
            return;
        }
        assert!(c.contains(&nccl_lib.join("libnccl.so.2")), "{c:?}");
    }

    #[test]
    fn a_file_that_is_not_nccl_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("libnccl.so.2");
        std::fs::write(&fake, b"not a library").unwrap();
        let e = load(std::slice::from_ref(&fake))
            .err()
            .expect("cannot load");
        assert!(e.contains(&fake.display().to_string()), "{e}");
        assert!(e.contains(LIBRARY_ENV), "{e}");
    }
}
