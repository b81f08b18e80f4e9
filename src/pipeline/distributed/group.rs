//! libtorch's c10d process group through the C++ shim (src/aten_ext/c10d.cpp): rank 0 hosts
//! the `TCPStore`, every rank joins the Gloo process group, and the collectives the trainer
//! uses (sum, broadcast, barrier) plus the store's set/get run on tch tensors and bytes.

use std::ffi::{c_char, c_void, CString};
use std::time::Duration;

use std::sync::Mutex;

use anyhow::{Context, Result};
use tch::{Device, Tensor};

use super::nccl_peer::{self, CudaTransport};
use super::settings::DistSettings;
use crate::aten_ext::check;
use crate::pipeline::nccl::ProcessComm;

extern "C" {
    fn dflash_c10d_connect(
        host: *const c_char,
        port: i32,
        rank: i32,
        world: i32,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn dflash_c10d_free(group: *mut c_void);
    fn dflash_c10d_allreduce_sum(group: *mut c_void, tensor: *const c_void) -> *mut c_char;
    fn dflash_c10d_broadcast(group: *mut c_void, tensor: *const c_void, root: i32) -> *mut c_char;
    fn dflash_c10d_barrier(group: *mut c_void) -> *mut c_char;
    fn dflash_c10d_alltoall(
        group: *mut c_void,
        output: *const c_void,
        input: *const c_void,
    ) -> *mut c_char;
    fn dflash_c10d_allgather(
        group: *mut c_void,
        output: *const c_void,
        input: *const c_void,
    ) -> *mut c_char;
    fn dflash_c10d_store_set(
        group: *mut c_void,
        key: *const c_char,
        data: *const u8,
        len: usize,
    ) -> *mut c_char;
    fn dflash_c10d_store_get(
        group: *mut c_void,
        key: *const c_char,
        timeout_ms: i64,
        out: *mut *mut u8,
        len: *mut usize,
    ) -> *mut c_char;
    fn dflash_c10d_free_bytes(bytes: *mut u8);
    fn dflash_c10d_store_check(
        group: *mut c_void,
        key: *const c_char,
        set: *mut i32,
    ) -> *mut c_char;
}

/// This process's membership of the run's process group.
pub struct ProcessGroup {
    group: *mut c_void,
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    /// How CUDA buckets cross processes, decided by every rank at the first CUDA sum (see
    /// [`super::nccl_peer`]): `Some(None)` is Gloo on host copies.
    cuda: Mutex<Option<Option<ProcessComm>>>,
}

// SAFETY: c10d's store client and process groups are used from several threads by
// torch.distributed itself (they lock internally); the handle is freed once, on drop.
unsafe impl Send for ProcessGroup {}
unsafe impl Sync for ProcessGroup {}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).with_context(|| format!("{s:?} holds a NUL byte"))
}

fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

impl ProcessGroup {
    /// Joins: rank 0 starts the store and waits for the others, up to the settings' timeout.
    pub fn connect(s: &DistSettings) -> Result<ProcessGroup> {
        let host = c_string(&s.master_addr)?;
        let mut group = std::ptr::null_mut();
        // SAFETY: valid C strings and an out pointer; the shim catches every C++ exception.
        unsafe {
            check(dflash_c10d_connect(
                host.as_ptr(),
                i32::from(s.master_port),
                s.rank as i32,
                s.world as i32,
                millis(s.timeout),
                &mut group,
            ))
        }
        .with_context(|| {
            format!(
                "rank {} of {} could not join the process group at {}:{} within {:.0} s",
                s.rank,
                s.world,
                s.master_addr,
                s.master_port,
                s.timeout.as_secs_f64()
            )
        })?;
        Ok(ProcessGroup {
            group,
            rank: s.rank,
            world: s.world,
            timeout: s.timeout,
            cuda: Mutex::new(None),
        })
    }

    /// Runs `op` on `t`, through a host copy when `t` is not on the CPU (Gloo works on host
    /// memory; a CUDA tensor is copied out and back on its stream).
    fn on_host(&self, t: &mut Tensor, op: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
        if t.device() == Device::Cpu {
            return op(t);
        }
        let host = t.to_device(Device::Cpu);
        op(&host)?;
        t.copy_(&host);
        Ok(())
    }

    /// Sums `t` over every rank, in place.
    pub fn allreduce_sum(&self, t: &mut Tensor) -> Result<()> {
        self.on_host(t, |t| {
            // SAFETY: a live group and a tch tensor (`as_ptr` is its `at::Tensor *`).
            unsafe { check(dflash_c10d_allreduce_sum(self.group, t.as_ptr() as _)) }
        })
    }

    /// Sums `t` over every rank, in place, adding the ranks' values in rank order
    /// (`((t0 + t1) + t2) + ...`, element by element) as one process adds its replicas'
    /// gradients: the result is bit for bit the single process's, whatever the world size.
    /// A ring allreduce adds in an order that depends on the element's place in the ring.
    ///
    /// It is a reduce-scatter and an allgather, as a ring allreduce is, so it moves as many
    /// bytes: `t` is cut into `world` shards; rank k receives shard k of every rank (one
    /// all-to-all), adds them in rank order, and the summed shards are gathered by every rank.
    /// Memory: two buffers of `t`'s size.
    pub fn ordered_sum(&self, t: &mut Tensor) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        if t.device().is_cuda() {
            let mut cuda = self.cuda.lock().unwrap_or_else(|e| e.into_inner());
            if cuda.is_none() {
                *cuda = Some(nccl_peer::connect(self, t.device())?);
            }
            if let Some(Some(comm)) = cuda.as_ref() {
                return nccl_peer::ordered_sum(comm, t);
            }
        }
        self.on_host(t, |t| {
            ordered_sum_with(
                t,
                self.world,
                |out, input| {
                    // SAFETY: a live group and tch tensors of the sizes the shim expects.
                    unsafe {
                        check(dflash_c10d_alltoall(
                            self.group,
                            out.as_ptr() as _,
                            input.as_ptr() as _,
                        ))
                    }
                },
                |out, input| {
                    // SAFETY: as above.
                    unsafe {
                        check(dflash_c10d_allgather(
                            self.group,
                            out.as_ptr() as _,
                            input.as_ptr() as _,
                        ))
                    }
                },
            )
        })
    }

    /// How CUDA buckets cross processes, once the first one has.
    pub fn cuda_transport(&self) -> Option<CudaTransport> {
        let cuda = self.cuda.lock().unwrap_or_else(|e| e.into_inner());
        cuda.as_ref().map(|c| match c {
            Some(_) => CudaTransport::Nccl,
            None => CudaTransport::Gloo,
        })
    }

    /// Every rank's `t` becomes rank `root`'s.
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        self.on_host(t, |t| {
            // SAFETY: as in `allreduce_sum`.
            unsafe {
                check(dflash_c10d_broadcast(
                    self.group,
                    t.as_ptr() as _,
                    root as i32,
                ))
            }
        })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        // SAFETY: a live group.
        unsafe { check(dflash_c10d_barrier(self.group)) }
    }

    /// Sets `key` in the run's store (hosted by rank 0).
    pub fn store_set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = c_string(key)?;
        // SAFETY: a live group, a C string, and `value.len()` readable bytes.
        unsafe {
            check(dflash_c10d_store_set(
                self.group,
                k.as_ptr(),
                value.as_ptr(),
                value.len(),
            ))
        }
    }

    /// Whether `key` is set in the store (without waiting for it).
    pub fn store_check(&self, key: &str) -> Result<bool> {
        let k = c_string(key)?;
        let mut set = 0i32;
        // SAFETY: a live group, a C string and an out pointer.
        unsafe { check(dflash_c10d_store_check(self.group, k.as_ptr(), &mut set))? };
        Ok(set != 0)
    }

    /// The value of `key` in the store, waiting up to `timeout` for it to be set.
    pub fn store_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let k = c_string(key)?;
        let (mut out, mut len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: a live group, a C string and out pointers; on success `out` holds `len`
        // bytes the shim allocated, freed here once copied.
        unsafe {
            check(dflash_c10d_store_get(
                self.group,
                k.as_ptr(),
                millis(timeout),
                &mut out,
                &mut len,
            ))?;
            let bytes = std::slice::from_raw_parts(out, len).to_vec();
            dflash_c10d_free_bytes(out);
            Ok(bytes)
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: created by `connect`, freed once.
        unsafe { dflash_c10d_free(self.group) }
    }
}

/// [`ProcessGroup::ordered_sum`] over any transport: `alltoall(out, input)` sends row k of
/// `input` (`[world, shard]`) to rank k and fills row r of `out` with rank r's; `allgather(out,
/// input)` fills `out` (`[world * shard]`) with every rank's `input` (`[shard]`) in rank order.
/// Works on `t`'s device; `t` must be contiguous and one-dimensional.
pub(crate) fn ordered_sum_with(
    t: &Tensor,
    world: usize,
    alltoall: impl FnOnce(&Tensor, &Tensor) -> Result<()>,
    allgather: impl FnOnce(&Tensor, &Tensor) -> Result<()>,
) -> Result<()> {
    let n = t.numel() as i64;
    let w = world as i64;
    let shard = (n + w - 1) / w;
    let padded = Tensor::zeros([w * shard], (t.kind(), t.device()));
    padded.narrow(0, 0, n).copy_(&t.reshape([-1]));
    let rows = Tensor::empty([w, shard], (t.kind(), t.device()));
    alltoall(&rows, &padded.view([w, shard]))?;
    // this rank's shard of the sum: rank 0's row, then each next rank's added in turn
    let mut mine = rows.get(0).copy();
    for r in 1..w {
        mine += rows.get(r);
    }
    allgather(&padded, &mine)?;
    t.reshape([-1]).copy_(&padded.narrow(0, 0, n));
    Ok(())
}

/// A free TCP port on this host (for tests that start several ranks here).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("no free port on 127.0.0.1")?;
    Ok(l.local_addr()?.port())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::settings::Launcher;
    use super::*;
    use tch::Kind;

    pub(crate) fn settings(rank: usize, world: usize, port: u16) -> DistSettings {
        DistSettings {
            launcher: Launcher::Torchrun,
            rank,
            world,
            local_rank: rank,
            local_world: world,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn three_ranks_sum_broadcast_and_share_the_store_through_gloo() {
        let port = free_port().unwrap();
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = ProcessGroup::connect(&settings(r, 3, port)).unwrap();
                    let mut t = Tensor::from_slice(&[r as f32 + 1.0, 10.0]);
                    g.allreduce_sum(&mut t).unwrap();
                    let sum = Vec::<f32>::try_from(&t).unwrap();
                    let mut b = Tensor::full([2], r as i64, (Kind::Int64, Device::Cpu));
                    g.broadcast(&mut b, 2).unwrap();
                    let from_two = Vec::<i64>::try_from(&b).unwrap();
                    g.store_set(&format!("k{r}"), &[r as u8; 3]).unwrap();
                    g.barrier().unwrap();
                    let next = g
                        .store_get(&format!("k{}", (r + 1) % 3), Duration::from_secs(5))
                        .unwrap();
                    (sum, from_two, next)
                })
            })
            .collect();
        for (r, h) in ranks.into_iter().enumerate() {
            let (sum, from_two, next) = h.join().unwrap();
            assert_eq!(sum, vec![6.0, 30.0]);
            assert_eq!(from_two, vec![2, 2]);
            assert_eq!(next, vec![((r + 1) % 3) as u8; 3]);
        }
    }

    /// 1e8, -1e8 and 1 add up to 1 in rank order and to 0 the other way round (1 is below
    /// half an ulp of 1e8 in fp32): every element of the sum must be 1, on every rank, also
    /// where the bucket does not divide into equal shards.
    #[test]
    fn the_ordered_sum_adds_in_rank_order_on_every_rank() {
        let port = free_port().unwrap();
        let values = [1e8f32, -1e8, 1.0];
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = ProcessGroup::connect(&settings(r, 3, port)).unwrap();
                    let mut t = Tensor::full([7], f64::from(values[r]), (Kind::Float, Device::Cpu));
                    g.ordered_sum(&mut t).unwrap();
                    let mut n = Tensor::from_slice(&[r as f64, 0.5]);
                    g.ordered_sum(&mut n).unwrap();
                    (
                        Vec::<f32>::try_from(&t).unwrap(),
                        Vec::<f64>::try_from(&n).unwrap(),
                    )
                })
            })
            .collect();
        for h in ranks {
            let (sum, numbers) = h.join().unwrap();
            assert_eq!(sum, vec![1.0; 7]);
            assert_eq!(numbers, vec![3.0, 1.5]);
        }
        let (a, b, c) = (values[0], values[1], values[2]);
        assert_ne!(
            (a + b) + c,
            a + (b + c),
            "the order matters for these values"
        );
    }

    #[test]
    fn a_rank_alone_times_out_naming_the_store() {
        let port = free_port().unwrap();
        let mut s = settings(1, 2, port);
        s.timeout = Duration::from_millis(500);
        let e = ProcessGroup::connect(&s)
            .err()
            .expect("no rank 0: no group");
        let msg = format!("{e:#}");
        assert!(msg.contains("rank 1 of 2 could not join"), "{msg}");
        assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    }
}
