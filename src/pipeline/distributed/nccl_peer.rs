//! CUDA gradients across processes with NCCL: c10d for the rendezvous, NCCL for the collective,
//! as torch.distributed's ProcessGroupNCCL does inside. Rank 0 makes NCCL's unique id and puts
//! it in the run's c10d store; every rank joins the communicator with it (`ncclCommInitRank`)
//! on its drafter device 0, and the flat gradient bucket is summed on the GPUs in rank order
//! (grouped sends and receives for the all-to-all, then `ncclAllGather`: the same bits as Gloo's
//! path and as one process). libnccl is the one the in-process path loads (src/pipeline/nccl.rs):
//! no NCCL header is needed at build time.
//!
//! Which transport CUDA tensors take is decided once, at the first CUDA sum, by every rank
//! together: NCCL when every rank's bucket is on a CUDA device and loads libnccl (and
//! `DFLASH_DIST_BACKEND` does not say "gloo"), else Gloo on host copies.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::group::ordered_sum_with;
use super::ProcessGroup;
use crate::pipeline::nccl::{self, NcclLibrary, ProcessComm, UNIQUE_ID_BYTES};

/// Picks the transport of CUDA tensors across processes: "auto" (the default), "nccl" or "gloo".
pub const BACKEND_ENV: &str = "DFLASH_DIST_BACKEND";
const UNIQUE_ID_KEY: &str = "dflash/nccl/unique_id";

/// How a CUDA gradient bucket crosses processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaTransport {
    /// On the GPUs, through a cross-process NCCL communicator.
    Nccl,
    /// Through Gloo, on host copies.
    Gloo,
}

/// `DFLASH_DIST_BACKEND` as read from the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendSetting {
    Auto,
    Nccl,
    Gloo,
}

impl BackendSetting {
    pub fn parse(value: Option<&str>) -> Result<BackendSetting> {
        match value.map(str::trim) {
            None | Some("") | Some("auto") => Ok(BackendSetting::Auto),
            Some("nccl") => Ok(BackendSetting::Nccl),
            Some("gloo") => Ok(BackendSetting::Gloo),
            Some(other) => {
                bail!("{BACKEND_ENV}={other:?} is not one of \"auto\", \"nccl\", \"gloo\"")
            }
        }
    }
}

/// This rank's choice for a bucket on `device` (pure): NCCL for a CUDA device when libnccl
/// loaded (`library`: its description, or why not), unless the setting says Gloo. "nccl" that
/// cannot be had is an error naming why.
pub fn choose(
    setting: BackendSetting,
    device: Device,
    library: Result<String, String>,
) -> Result<(CudaTransport, String)> {
    if setting == BackendSetting::Gloo {
        return Ok((CudaTransport::Gloo, format!("{BACKEND_ENV}=gloo")));
    }
    let not = |why: String| -> Result<(CudaTransport, String)> {
        if setting == BackendSetting::Nccl {
            bail!("{BACKEND_ENV}=nccl, but {why}");
        }
        Ok((CudaTransport::Gloo, format!("Gloo on host copies ({why})")))
    };
    if !device.is_cuda() {
        return not(format!(
            "the gradient bucket is on {device:?}, not a CUDA device"
        ));
    }
    match library {
        Ok(lib) => Ok((CudaTransport::Nccl, format!("NCCL on the GPUs ({lib})"))),
        Err(why) => not(why),
    }
}

/// Rank 0's NCCL unique id for every rank: rank 0 makes it (`make`) and puts it in the store;
/// the others read it (waiting up to `timeout`).
pub fn share_unique_id(
    group: &ProcessGroup,
    timeout: Duration,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let id = if group.rank == 0 {
        let id = make()?;
        group.store_set(UNIQUE_ID_KEY, &id)?;
        id
    } else {
        group
            .store_get(UNIQUE_ID_KEY, timeout)
            .context("rank 0's NCCL unique id did not come through the store")?
    };
    if id.len() != UNIQUE_ID_BYTES {
        bail!(
            "NCCL unique id of {} bytes, not {UNIQUE_ID_BYTES}",
            id.len()
        );
    }
    Ok(id)
}

/// Whether every rank chose NCCL (each says its own choice; a sum of 0/1 flags has no
/// rounding to order).
fn every_rank_agrees(group: &ProcessGroup, mine: bool) -> Result<bool> {
    let mut flag = Tensor::from_slice(&[f64::from(u8::from(mine))]).to_kind(Kind::Double);
    group.ordered_sum(&mut flag)?;
    Ok(flag.double_value(&[0]) as usize == group.world)
}

/// The cross-process communicator of a bucket on `device`, when every rank takes NCCL; `None`
/// for Gloo on host copies. Called by every rank at the same point (the first CUDA sum).
pub(crate) fn connect(group: &ProcessGroup, device: Device) -> Result<Option<ProcessComm>> {
    let setting = BackendSetting::parse(std::env::var(BACKEND_ENV).ok().as_deref())?;
    let loaded: Result<&'static NcclLibrary, String> = if device.is_cuda() {
        nccl::library(None)
    } else {
        Err("not needed".into())
    };
    let (mine, why) = choose(
        setting,
        device,
        loaded.map(|l| format!("NCCL {} from {}", l.version_string(), l.path.display())),
    )?;
    let all = every_rank_agrees(group, mine == CudaTransport::Nccl)?;
    let Device::Cuda(index) = device else {
        return Ok(None);
    };
    let library = match (all, nccl::library(None)) {
        (true, Ok(lib)) => lib,
        _ => {
            log::info!(
                "rank {}: gradients across processes: Gloo on host copies ({})",
                group.rank,
                if mine == CudaTransport::Nccl {
                    "another rank cannot use NCCL".to_string()
                } else {
                    why
                }
            );
            return Ok(None);
        }
    };
    let id = share_unique_id(group, group.timeout, || library.unique_id())?;
    let events = crate::device_event::DeviceEvents::load();
    let comm =
        ProcessComm::join(
            library,
            &id,
            group.rank,
            group.world,
            index as i32,
            |d| match events {
                Some(e) if e.set_current_device(d) => Ok(()),
                _ => bail!("cannot make cuda:{d} the current device for NCCL"),
            },
        )?;
    log::info!("rank {}: gradients across processes: {why}", group.rank);
    Ok(Some(comm))
}

/// [`ProcessGroup::ordered_sum`] on the GPUs through `comm`.
pub(crate) fn ordered_sum(comm: &ProcessComm, t: &Tensor) -> Result<()> {
    ordered_sum_with(
        t,
        comm.world,
        |out, input| comm.alltoall(out, input),
        |out, input| comm.allgather(out, input),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::distributed::group::{free_port, tests::settings};

    #[test]
    fn cuda_buckets_take_nccl_where_libnccl_loads() {
        let lib = || Ok("NCCL 2.28.9 from libnccl.so.2".to_string());
        let none = || Err("libnccl could not be loaded (tried x)".to_string());
        let cuda = Device::Cuda(0);
        let auto = BackendSetting::Auto;
        assert_eq!(choose(auto, cuda, lib()).unwrap().0, CudaTransport::Nccl);
        let (t, why) = choose(auto, cuda, none()).unwrap();
        assert_eq!(t, CudaTransport::Gloo);
        assert!(why.contains("libnccl could not be loaded"), "{why}");
        let (t, why) = choose(auto, Device::Cpu, lib()).unwrap();
        assert_eq!(t, CudaTransport::Gloo);
        assert!(why.contains("not a CUDA device"), "{why}");
        assert_eq!(
            choose(BackendSetting::Gloo, cuda, lib()).unwrap().0,
            CudaTransport::Gloo
        );
        let e = choose(BackendSetting::Nccl, cuda, none())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("DFLASH_DIST_BACKEND=nccl, but libnccl"),
            "{e}"
        );
        assert_eq!(BackendSetting::parse(None).unwrap(), BackendSetting::Auto);
        assert_eq!(
            BackendSetting::parse(Some("gloo")).unwrap(),
            BackendSetting::Gloo
        );
        let e = BackendSetting::parse(Some("mpi")).unwrap_err().to_string();
        assert!(e.contains("DFLASH_DIST_BACKEND=\"mpi\""), "{e}");
    }

    #[test]
    fn rank_0_shares_its_unique_id_through_the_store() {
        let port = free_port().unwrap();
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = ProcessGroup::connect(&settings(r, 3, port)).unwrap();
                    let made = std::sync::atomic::AtomicBool::new(false);
                    let id = share_unique_id(&g, Duration::from_secs(20), || {
                        made.store(true, std::sync::atomic::Ordering::SeqCst);
                        Ok((0..UNIQUE_ID_BYTES).map(|i| (i * 7 % 251) as u8).collect())
                    })
                    .unwrap();
                    let agree = every_rank_agrees(&g, true).unwrap();
                    let disagree = every_rank_agrees(&g, r != 1).unwrap();
                    g.barrier().unwrap();
                    (id, made.into_inner(), agree, disagree)
                })
            })
            .collect();
        let expected: Vec<u8> = (0..UNIQUE_ID_BYTES).map(|i| (i * 7 % 251) as u8).collect();
        for (r, h) in ranks.into_iter().enumerate() {
            let (id, made, agree, disagree) = h.join().unwrap();
            assert_eq!(id, expected, "rank {r}");
            assert_eq!(made, r == 0, "only rank 0 makes the id");
            assert!(agree && !disagree, "rank {r}");
        }
    }

    /// `cargo test --release --lib -- --ignored nccl_peer` on a machine with 2 GPUs: two ranks
    /// (threads here, one GPU each) sum a bucket in rank order through NCCL, as Gloo does.
    #[test]
    #[ignore = "needs 2 CUDA devices and libnccl"]
    fn two_gpus_sum_in_rank_order_through_nccl() {
        let _runtime = crate::runtime::TorchRuntime::init();
        let port = free_port().unwrap();
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = ProcessGroup::connect(&settings(r, 2, port)).unwrap();
                    let dev = Device::Cuda(r);
                    let mut t = Tensor::full([7], 1.5 + 0.75 * r as f64, (Kind::Float, dev));
                    g.ordered_sum(&mut t).unwrap();
                    assert_eq!(g.cuda_transport(), Some(CudaTransport::Nccl));
                    Vec::<f32>::try_from(&t.to_device(Device::Cpu)).unwrap()
                })
            })
            .collect();
        for h in ranks {
            let sum = h.join().unwrap();
            assert_eq!(sum, vec![3.75f32; 7]);
        }
    }
}
