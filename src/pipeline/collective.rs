//! How the drafter replicas' gradients reach the coordinator (drafter worker 0) and how the new
//! weights get back, per optimizer step (`devices.grad_sync`):
//!
//! - copy: each replica moves its flat fp32 gradient to the coordinator's device and sends it
//!   over the channel; the coordinator adds them up, and sends the new weights back as one flat
//!   fp32 tensor, which each replica copies to its device (the reference path; any devices).
//! - nccl: each replica sends its flat gradient (left on its device) and its weight buffer
//!   over the channel; the coordinator's thread sums the gradients into its own with an NCCL
//!   reduce (rank 0 = the coordinator's device) and fills every weight buffer with an NCCL
//!   broadcast (in the parameters' dtype, so the result is the same as the copy path's), then
//!   tells each replica that its new weights are queued. CUDA devices only.
//!
//! With NCCL one thread queues every rank's half of each collective, as one NCCL group. Were
//! the halves queued by the ranks' own threads, a GPU could sit in its half waiting for a rank
//! whose thread is held up in the meantime, for instance by a memory allocation that waits for
//! the GPUs of the process, or by a copy between the two GPUs ordered behind that half: on the
//! 8B shape that happened at the first step. The replicas wait on the channel while the
//! collectives are queued, so they queue nothing across devices meanwhile.
//!
//! The loss sums, token counts and batch metadata go over the channel either way.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use crossbeam_channel::{Receiver, Sender};
use tch::{Device, Kind, Tensor};

use super::nccl::{self, NcclLibrary, NcclRank};
use crate::config::GradSync;
use crate::runtime::{device_name, DeviceSpec};

/// What the coordinator sends a replica after that replica's gradient message of a step.
pub(crate) enum ParamsMsg {
    /// Copy path: the new weights (flat fp32, on the coordinator's device).
    Weights(Tensor),
    /// NCCL: the broadcast of the new weights into the replica's buffer is queued.
    Broadcast,
    Stop,
}

/// What a replica's gradient message carries besides the metrics.
pub(crate) struct Outgoing {
    /// Copy path: the flat gradient on the coordinator's device. NCCL: on the replica's own
    /// device, for the reduce.
    pub grad: Tensor,
    /// NCCL: the replica's flat weight buffer, which the broadcast fills.
    pub weights: Option<Tensor>,
}

/// The resolved `devices.grad_sync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GradSyncKind {
    Copy,
    Nccl,
}

/// What `devices.grad_sync` resolved to on this machine, and why.
pub(crate) struct GradSyncPlan {
    pub kind: GradSyncKind,
    pub reason: String,
    library: Option<&'static NcclLibrary>,
    /// "auto": fall back to the copy path if the communicators cannot be set up.
    fallback: bool,
}

impl GradSyncPlan {
    pub(crate) fn describe(&self) -> String {
        match self.kind {
            GradSyncKind::Copy => format!("gradient sync: copy ({})", self.reason),
            GradSyncKind::Nccl => format!("gradient sync: nccl ({})", self.reason),
        }
    }
}

/// Resolves `devices.grad_sync` (`setting`) for the drafter devices (`specs` as configured,
/// `devices` as resolved). "nccl" that cannot work here is an error naming the field; "auto"
/// takes NCCL when there are two or more distinct CUDA drafter devices and libnccl loads, and
/// the copy path otherwise. libnccl is loaded only when NCCL is otherwise possible.
pub(crate) fn plan(
    setting: GradSync,
    specs: &[DeviceSpec],
    devices: &[Device],
    libtorch_dir: Option<&Path>,
) -> Result<GradSyncPlan> {
    let copy = |reason: String| GradSyncPlan {
        kind: GradSyncKind::Copy,
        reason,
        library: None,
        fallback: false,
    };
    let field = "config: devices.grad_sync";
    let explicit = match setting {
        GradSync::Copy => return Ok(copy("devices.grad_sync = \"copy\"".into())),
        GradSync::Nccl => true,
        GradSync::Auto => false,
    };
    let spec = |i: usize| specs.get(i).map_or("?".into(), DeviceSpec::to_string);
    if let Some(i) = devices.iter().position(|d| !d.is_cuda()) {
        // Only CUDA and the CPU are configurable.
        let why = format!("devices.drafter_devices[{i}] = {:?} is the CPU", spec(i));
        if explicit {
            bail!("{field} = \"nccl\" needs CUDA drafter devices, but {why} (use \"copy\" or \"auto\")");
        }
        return Ok(copy(if devices.len() < 2 {
            "one drafter device".into()
        } else {
            format!("{why}, not a CUDA device")
        }));
    }
    if let Some((i, j)) = first_repeat(devices) {
        let why = format!(
            "devices.drafter_devices[{i}] = {:?} and [{j}] = {:?} are both {}",
            spec(i),
            spec(j),
            device_name(devices[i])
        );
        if explicit {
            bail!("{field} = \"nccl\" needs distinct CUDA devices (one NCCL rank per GPU), but {why} (use \"copy\")");
        }
        return Ok(copy(format!("{why}; NCCL needs one rank per GPU")));
    }
    if !explicit && devices.len() < 2 {
        return Ok(copy("one drafter device".into()));
    }
    match nccl::library(libtorch_dir) {
        Ok(library) => Ok(GradSyncPlan {
            kind: GradSyncKind::Nccl,
            reason: format!(
                "{} CUDA drafter devices; NCCL {} from {}",
                devices.len(),
                library.version_string(),
                library.path.display()
            ),
            library: Some(library),
            fallback: !explicit,
        }),
        Err(e) if explicit => bail!("{field} = \"nccl\", but {e}"),
        Err(e) => Ok(copy(e)),
    }
}

fn first_repeat(devices: &[Device]) -> Option<(usize, usize)> {
    (0..devices.len()).find_map(|j| {
        devices[..j]
            .iter()
            .position(|d| *d == devices[j])
            .map(|i| (i, j))
    })
}

/// The coordinator's side of the exchange.
pub(crate) enum CoordinatorSync {
    Copy,
    Nccl {
        /// Every rank, rank 0 first (the coordinator's device), then one per replica.
        ranks: Vec<NcclRank>,
    },
}

/// A replica's side of the exchange.
pub(crate) enum ReplicaSync {
    Copy {
        /// The coordinator's device.
        dev0: Device,
    },
    Nccl {
        /// The flat weight buffer the broadcast writes (allocated before the first step).
        weights: Option<Tensor>,
    },
}

impl GradSyncPlan {
    /// Sets the plan up for the drafter devices (creates the NCCL communicators): the
    /// coordinator's side, one side per further device, and a line saying what is used.
    pub(crate) fn connect(
        self,
        devices: &[Device],
    ) -> Result<(CoordinatorSync, Vec<ReplicaSync>, String)> {
        let dev0 = *devices
            .first()
            .ok_or_else(|| anyhow!("no drafter device"))?;
        let copy = |note: String| {
            let replicas = devices[1..]
                .iter()
                .map(|_| ReplicaSync::Copy { dev0 })
                .collect();
            (CoordinatorSync::Copy, replicas, note)
        };
        let Some(library) = self.library else {
            return Ok(copy(self.describe()));
        };
        let ranks = match nccl::communicators(library, devices) {
            Ok(r) => r,
            Err(e) if self.fallback => {
                return Ok(copy(format!(
                    "gradient sync: copy (NCCL communicators could not be set up: {e:#})"
                )))
            }
            Err(e) => {
                return Err(e.context("config: devices.grad_sync = \"nccl\": NCCL set-up failed"))
            }
        };
        let replicas = (1..ranks.len())
            .map(|_| ReplicaSync::Nccl { weights: None })
            .collect();
        Ok((CoordinatorSync::Nccl { ranks }, replicas, self.describe()))
    }
}

impl CoordinatorSync {
    /// Adds the replicas' gradients of this step (`others`, in replica order, as their
    /// messages carried them) into `grad`, the coordinator's own flat fp32 gradient: copy
    /// path: tensor additions on the coordinator's device; NCCL: one grouped reduce.
    pub(crate) fn reduce(&self, grad: &mut Tensor, others: &[Tensor]) -> Result<()> {
        match self {
            CoordinatorSync::Copy => {
                for g in others {
                    *grad += g;
                }
                Ok(())
            }
            CoordinatorSync::Nccl { ranks } => {
                check_count(ranks, others.len())?;
                nccl::group(ranks, || {
                    ranks[0].reduce_sum_to_root(grad)?;
                    for (rank, g) in ranks[1..].iter().zip(others) {
                        rank.reduce_sum_to_root(g)?;
                    }
                    Ok(())
                })
                .map_err(|e| e.context("NCCL gradient reduce"))
            }
        }
    }

    /// Hands the new weights (`params`, the coordinator's updated compute copy) to the
    /// replicas: copy path: one flat fp32 tensor over each channel; NCCL: one grouped
    /// broadcast into the replicas' buffers (`buffers`, in replica order), then a message
    /// to each that it is queued.
    pub(crate) fn hand_back(
        &self,
        params: &[(String, &Tensor)],
        buffers: &[Tensor],
        txs: &[Sender<ParamsMsg>],
    ) -> Result<()> {
        if txs.is_empty() {
            return Ok(());
        }
        match self {
            CoordinatorSync::Copy => {
                let flat = flat_params(params, Kind::Float);
                for tx in txs {
                    let _ = tx.send(ParamsMsg::Weights(flat.shallow_clone()));
                }
            }
            CoordinatorSync::Nccl { ranks } => {
                check_count(ranks, buffers.len())?;
                let flat = flat_params(params, flat_kind(params));
                nccl::group(ranks, || {
                    ranks[0].broadcast_from_root(&flat)?;
                    for (rank, b) in ranks[1..].iter().zip(buffers) {
                        rank.broadcast_from_root(b)?;
                    }
                    Ok(())
                })
                .map_err(|e| e.context("NCCL weight broadcast"))?;
                for tx in txs {
                    let _ = tx.send(ParamsMsg::Broadcast);
                }
            }
        }
        Ok(())
    }
}

fn check_count(ranks: &[NcclRank], replicas: usize) -> Result<()> {
    if replicas + 1 != ranks.len() {
        bail!(
            "NCCL: {} ranks but {replicas} replica tensors (one per replica expected)",
            ranks.len()
        );
    }
    Ok(())
}

impl ReplicaSync {
    /// Allocates the weight buffer the broadcast writes, before the first step.
    pub(crate) fn prepare(&mut self, params: &[(String, &Tensor)]) {
        if let ReplicaSync::Nccl { weights } = self {
            if weights.is_none() {
                *weights = Some(weight_buffer(params));
            }
        }
    }

    /// Takes the replica's flat fp32 gradient of this step and returns what its gradient
    /// message carries (see [`Outgoing`]; the NCCL weight buffer is the one [`Self::prepare`]
    /// made).
    pub(crate) fn outgoing(&mut self, flat: Tensor) -> Outgoing {
        match self {
            ReplicaSync::Copy { dev0 } => Outgoing {
                grad: flat.to_device(*dev0),
                weights: None,
            },
            ReplicaSync::Nccl { weights } => Outgoing {
                grad: flat,
                weights: weights.as_ref().map(Tensor::shallow_clone),
            },
        }
    }

    /// After the replica's gradient message went out: waits for the coordinator's answer and
    /// puts the new weights into `params` (Ok(true)), or returns Ok(false) when it says stop.
    pub(crate) fn exchange(
        &mut self,
        rx: &Receiver<ParamsMsg>,
        params: &[(String, &Tensor)],
    ) -> Result<bool> {
        let msg = match rx.recv() {
            Ok(ParamsMsg::Stop) | Err(_) => return Ok(false),
            Ok(m) => m,
        };
        match (&*self, msg) {
            (ReplicaSync::Copy { .. }, ParamsMsg::Weights(flat)) => write_flat(&flat, params),
            (ReplicaSync::Nccl { weights: Some(w) }, ParamsMsg::Broadcast) => {
                // queued on this device's stream after the broadcast that fills `w`
                write_flat(w, params)
            }
            _ => bail!("gradient sync: unexpected message from the coordinator"),
        }
        Ok(true)
    }
}

/// The kind the weights travel in: the parameters' own kind when they all share one that NCCL
/// moves (bf16 weights then cost half the bytes and arrive unchanged), else fp32.
fn flat_kind(params: &[(String, &Tensor)]) -> Kind {
    let first = params.first().map_or(Kind::Float, |(_, p)| p.kind());
    let uniform = params.iter().all(|(_, p)| p.kind() == first);
    if uniform && matches!(first, Kind::Float | Kind::BFloat16 | Kind::Half) {
        first
    } else {
        Kind::Float
    }
}

/// An empty flat buffer for the parameters' weights, on their device.
fn weight_buffer(params: &[(String, &Tensor)]) -> Tensor {
    let n: i64 = params.iter().map(|(_, p)| p.numel() as i64).sum();
    let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
    Tensor::empty([n], (flat_kind(params), device))
}

/// The parameters as one flat tensor of `kind`, on their device.
pub(crate) fn flat_params(params: &[(String, &Tensor)], kind: Kind) -> Tensor {
    Tensor::cat(
        &params
            .iter()
            .map(|(_, p)| p.detach().to_kind(kind).reshape([-1]))
            .collect::<Vec<_>>(),
        0,
    )
}

/// Copies a flat weight buffer into parameters (one transfer to their device).
pub(crate) fn write_flat(flat: &Tensor, params: &[(String, &Tensor)]) {
    let Some((_, first)) = params.first() else {
        return;
    };
    tch::no_grad(|| {
        let local = flat.to_device(first.device()).to_kind(first.kind());
        let mut offset = 0i64;
        for (_, p) in params {
            let n = p.numel() as i64;
            let mut p = p.shallow_clone();
            p.copy_(&local.narrow(0, offset, n).view(p.size().as_slice()));
            offset += n;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::{AdamW, AdamWConfig};

    fn specs(devices: &[Device]) -> Vec<DeviceSpec> {
        devices
            .iter()
            .map(|d| match d {
                Device::Cuda(i) => DeviceSpec::Cuda(*i),
                _ => DeviceSpec::Cpu,
            })
            .collect()
    }

    /// `setting` as the configuration reads it (a bad word is refused there).
    fn plan_for(setting: &str, devices: &[Device]) -> Result<GradSyncPlan> {
        plan(setting.parse()?, &specs(devices), devices, None)
    }

    #[test]
    fn cpu_drafter_devices_take_the_copy_path() {
        let one = plan_for("auto", &[Device::Cpu]).unwrap();
        assert_eq!(one.kind, GradSyncKind::Copy);
        assert_eq!(one.describe(), "gradient sync: copy (one drafter device)");
        let two = plan_for("auto", &[Device::Cpu, Device::Cpu]).unwrap();
        assert_eq!(two.kind, GradSyncKind::Copy);
        assert!(two.reason.contains("the CPU"), "{}", two.reason);
        let copy = plan_for("copy", &[Device::Cuda(0), Device::Cuda(1)]).unwrap();
        assert_eq!(copy.kind, GradSyncKind::Copy);
        assert!(copy.library.is_none());

        let e = plan_for("nccl", &[Device::Cuda(0), Device::Cpu])
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "config: devices.grad_sync = \"nccl\" needs CUDA drafter devices, but \
             devices.drafter_devices[1] = \"cpu\" is the CPU (use \"copy\" or \"auto\")"
        );
        let e = plan_for("nccl", &[Device::Cuda(0), Device::Cuda(0)])
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("devices.grad_sync = \"nccl\" needs distinct CUDA devices")
                && e.contains("[0] = \"cuda:0\" and [1] = \"cuda:0\" are both cuda:0"),
            "{e}"
        );
        let twice = plan_for("auto", &[Device::Cuda(0), Device::Cuda(0)]).unwrap();
        assert_eq!(twice.kind, GradSyncKind::Copy);
        let e = plan_for("ring", &[Device::Cpu]).err().unwrap().to_string();
        assert!(e.contains("devices.grad_sync = \"ring\""), "{e}");
    }

    #[test]
    fn nccl_is_taken_only_where_libnccl_loads() {
        let devices = [Device::Cuda(0), Device::Cuda(1)];
        let loads = nccl::library(None).is_ok();
        let auto = plan_for("auto", &devices).unwrap();
        let explicit = plan_for("nccl", &devices);
        if loads {
            assert_eq!(auto.kind, GradSyncKind::Nccl);
            assert_eq!(explicit.unwrap().kind, GradSyncKind::Nccl);
        } else {
            assert_eq!(auto.kind, GradSyncKind::Copy);
            assert!(auto.reason.contains("libnccl could not be loaded"));
            let e = explicit.err().unwrap().to_string();
            assert!(
                e.starts_with(
                    "config: devices.grad_sync = \"nccl\", but libnccl could not be loaded"
                ),
                "{e}"
            );
            assert!(e.contains(nccl::LIBRARY_ENV), "{e}");
        }
    }

    /// Initial weights and per-(step, replica) gradients, made on the CPU from a fixed seed.
    struct Case {
        init: Vec<Tensor>,
        grads: Vec<Vec<Tensor>>,
    }

    fn case(replicas: usize, steps: usize) -> Case {
        let g = |seed: i64, shape: &[i64]| {
            tch::manual_seed(seed);
            Tensor::randn(shape, (Kind::Float, Device::Cpu))
        };
        let shapes: [&[i64]; 3] = [&[64, 48], &[48], &[17, 5]];
        let init = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| g(i as i64, s) * 0.1)
            .collect();
        let n: i64 = shapes.iter().map(|s| s.iter().product::<i64>()).sum();
        let grads = (0..steps)
            .map(|s| {
                (0..replicas)
                    .map(|r| g(1000 + (s * replicas + r) as i64, &[n]))
                    .collect()
            })
            .collect();
        Case { init, grads }
    }

    fn named(params: &[Tensor]) -> Vec<(String, &Tensor)> {
        params
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("p{i}"), p))
            .collect()
    }

    /// Optimizer steps as the trainer takes them, with one thread per replica: the final
    /// weights of every replica (coordinator first), as fp32 on the CPU. Every replica has its
    /// own copy of the weights (`copy`: on the CPU `to_device`/`to_kind` may alias).
    fn run_steps(plan: GradSyncPlan, devices: &[Device], kind: Kind, c: &Case) -> Vec<Vec<Tensor>> {
        let (coordinator, replicas, _) = plan.connect(devices).unwrap();
        let (grad_tx, grad_rx) = crossbeam_channel::unbounded::<(usize, Outgoing)>();
        let mut txs = Vec::new();
        let mut threads = Vec::new();
        for (r, mut sync) in replicas.into_iter().enumerate() {
            let r = r + 1;
            let (tx, rx) = crossbeam_channel::unbounded::<ParamsMsg>();
            txs.push(tx);
            let dev = devices[r];
            let params: Vec<Tensor> = c
                .init
                .iter()
                .map(|t| t.to_kind(kind).to_device(dev).copy())
                .collect();
            let grads: Vec<Tensor> = c.grads.iter().map(|g| g[r].shallow_clone()).collect();
            let grad_tx = grad_tx.clone();
            threads.push(std::thread::spawn(move || {
                let named = named(&params);
                sync.prepare(&named);
                for g in &grads {
                    let out = sync.outgoing(g.to_device(dev));
                    grad_tx.send((r, out)).unwrap();
                    assert!(sync.exchange(&rx, &named).unwrap());
                }
                assert!(!sync.exchange(&rx, &named).unwrap());
                params
                    .iter()
                    .map(|p| p.to_kind(Kind::Float).to_device(Device::Cpu))
                    .collect::<Vec<_>>()
            }));
        }
        let dev0 = devices[0];
        let params: Vec<Tensor> = c
            .init
            .iter()
            .map(|t| t.to_kind(kind).to_device(dev0).copy())
            .collect();
        let named0 = named(&params);
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut optimizer = AdamW::new(&named0, dev0, config);
        for g in &c.grads {
            let mut grad = g[0].to_device(dev0);
            let mut messages: Vec<(usize, Outgoing)> =
                (0..txs.len()).map(|_| grad_rx.recv().unwrap()).collect();
            messages.sort_by_key(|(r, _)| *r);
            let others: Vec<Tensor> = messages
                .iter()
                .map(|(_, m)| m.grad.shallow_clone())
                .collect();
            let buffers: Vec<Tensor> = messages
                .iter()
                .filter_map(|(_, m)| m.weights.as_ref().map(Tensor::shallow_clone))
                .collect();
            coordinator.reduce(&mut grad, &others).unwrap();
            grad /= devices.len() as f64;
            let _norm = AdamW::clip_on_device(&mut grad, 1.0);
            optimizer.update(&grad, 1e-2).unwrap();
            optimizer.write_params(&named0).unwrap();
            coordinator.hand_back(&named0, &buffers, &txs).unwrap();
        }
        for tx in &txs {
            tx.send(ParamsMsg::Stop).unwrap();
        }
        let mut out = vec![params
            .iter()
            .map(|p| p.to_kind(Kind::Float).to_device(Device::Cpu))
            .collect::<Vec<_>>()];
        for t in threads {
            out.push(t.join().unwrap());
        }
        drop(coordinator);
        out
    }

    fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs().max().double_value(&[]))
            .fold(0.0, f64::max)
    }

    #[test]
    fn copy_path_keeps_replicas_equal_to_the_coordinator() {
        let devices = [Device::Cpu, Device::Cpu, Device::Cpu];
        let c = case(devices.len(), 3);
        let plan = plan_for("auto", &devices).unwrap();
        let weights = run_steps(plan, &devices, Kind::Float, &c);
        assert_eq!(weights.len(), 3);
        for w in &weights[1..] {
            assert_eq!(max_diff(&weights[0], w), 0.0);
        }
        assert!(max_diff(&weights[0], &c.init) > 1e-3, "the weights moved");
    }

    /// `cargo test --release -- --ignored nccl` on a machine with two GPUs.
    #[test]
    #[ignore = "needs 2 CUDA devices and libnccl"]
    fn nccl_step_gives_the_weights_of_the_copy_path() {
        let runtime = crate::runtime::TorchRuntime::init();
        assert!(
            runtime.cuda_devices() >= 2,
            "this test needs 2 CUDA devices ({} usable)",
            runtime.cuda_devices()
        );
        let devices = [Device::Cuda(0), Device::Cuda(1)];
        let specs = specs(&devices);
        let dir = runtime.libtorch_dir.as_deref();
        let c = case(devices.len(), 3);
        for kind in [Kind::Float, Kind::BFloat16] {
            let copy = plan(GradSync::Copy, &specs, &devices, dir).unwrap();
            let nccl = plan(GradSync::Nccl, &specs, &devices, dir).unwrap();
            assert_eq!(nccl.kind, GradSyncKind::Nccl, "{}", nccl.describe());
            eprintln!("{kind:?}: {}", nccl.describe());
            let reference = run_steps(copy, &devices, kind, &c);
            let got = run_steps(nccl, &devices, kind, &c);
            for (r, (a, b)) in reference.iter().zip(&got).enumerate() {
                let d = max_diff(a, b);
                eprintln!("{kind:?} replica {r}: largest difference {d:e}");
                assert!(d <= 1e-6, "{kind:?} replica {r}: {d}");
            }
            for w in &got[1..] {
                assert_eq!(max_diff(&got[0], w), 0.0, "{kind:?}: replicas agree");
            }
            assert!(max_diff(&got[0], &c.init) > 1e-3, "the weights moved");
        }
    }
}
