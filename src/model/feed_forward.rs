//! The MLP of a decoder layer: the dense SwiGLU ([`Mlp`], the drafter's and a dense target's;
//! its training forward and its inference forms) or, in a mixture of experts, a sparse block of
//! routed experts ([`SparseMoe`]), as the config's [`super::moe::MoeSettings`] says per layer.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::config::TargetConfig;
use super::layers::add_product;
use super::moe::{SparseMoe, TensorSource};
use super::weights::WeightSource;
use crate::aten_ext::fused::{swiglu_autograd, FusedKernels};
use crate::aten_ext::shared_input_linear;

/// What a decoder layer's MLP does at inference: add its output to the residual stream.
pub(crate) trait AddFeedForward {
    /// `residual += mlp(x)` in place.
    fn add_forward(&self, residual: &mut Tensor, x: &Tensor);
    /// The same with the cache's fused kernels where the MLP can use them.
    fn add_forward_fused(
        &self,
        residual: &mut Tensor,
        x: &Tensor,
        kernels: &FusedKernels,
    ) -> Result<()>;
}

impl AddFeedForward for Mlp {
    /// `residual += forward(x)` in place, the sum done by the down projection's product
    /// ([`add_product`]): inference only.
    fn add_forward(&self, residual: &mut Tensor, x: &Tensor) {
        self.add_down(residual, &self.gated(x));
    }

    /// [`Mlp::add_forward`] with `silu(gate) * up` as one fused kernel (fused weights only;
    /// else as `add_forward`).
    fn add_forward_fused(
        &self,
        residual: &mut Tensor,
        x: &Tensor,
        kernels: &FusedKernels,
    ) -> Result<()> {
        let Some(w) = &self.fused else {
            self.add_forward(residual, x);
            return Ok(());
        };
        self.add_down(residual, &kernels.silu_mul(&x.linear::<&Tensor>(w, None))?);
        Ok(())
    }
}

impl Mlp {
    /// `residual += down(gated)` in place, the sum done by the product ([`add_product`]).
    fn add_down(&self, residual: &mut Tensor, gated: &Tensor) {
        let width = gated.size().last().copied().unwrap_or(0);
        add_product(residual, &gated.view([-1, width]), &self.down_proj);
    }
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub(crate) struct Mlp {
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
    /// After [`Mlp::fuse`]: [gate; up] as one matrix, of which the two are views.
    pub fused: Option<Tensor>,
}

impl Mlp {
    /// Stores gate and up as one matrix (see [`AttentionWeights::fuse`]); frozen weights only.
    pub(crate) fn fuse(&mut self) {
        let w = Tensor::cat(&[&self.gate_proj, &self.up_proj], 0);
        let i = self.gate_proj.size()[0];
        self.gate_proj = w.narrow(0, 0, i);
        self.up_proj = w.narrow(0, i, i);
        self.fused = Some(w);
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        self.gated(x).linear::<&Tensor>(&self.down_proj, None)
    }

    /// [`Mlp::forward`] with `silu(gate) * up` as one fused kernel (fused weights only; else as
    /// `forward`).
    pub(crate) fn forward_fused(&self, x: &Tensor, kernels: &FusedKernels) -> Result<Tensor> {
        let Some(w) = &self.fused else {
            return Ok(self.forward(x));
        };
        let gated = kernels.silu_mul(&x.linear::<&Tensor>(w, None))?;
        Ok(gated.linear::<&Tensor>(&self.down_proj, None))
    }

    /// [`Mlp::forward`] of a training forward (gate and up separate weights, as a drafter's
    /// are): gate and up as one autograd node ([`shared_input_linear`], whose backward pass sums
    /// x's gradient inside the products), and with `kernels` on x's device SwiGLU's product as
    /// one node whose passes are one kernel each ([`swiglu_autograd`]); else libtorch's
    /// operations.
    pub(crate) fn forward_train(&self, x: &Tensor, kernels: Option<&FusedKernels>) -> Tensor {
        if self.fused.is_some() {
            return self.forward(x);
        }
        let both = shared_input_linear(x, &[&self.gate_proj, &self.up_proj])
            .map_err(|e| log::warn!("the shared-input gate and up failed ({e:#}); linear's"))
            .ok()
            .and_then(|v| <[Tensor; 2]>::try_from(v).ok());
        let [gate, up] = both.unwrap_or_else(|| {
            [
                x.linear::<&Tensor>(&self.gate_proj, None),
                x.linear::<&Tensor>(&self.up_proj, None),
            ]
        });
        let gated = match kernels.filter(|k| k.device() == x.device()) {
            Some(k) => swiglu_autograd(&gate, &up, Some(k)).unwrap_or_else(|e| {
                log::warn!("the fused SwiGLU failed ({e:#}); libtorch's operations");
                gate.silu() * &up
            }),
            None => gate.silu() * &up,
        };
        gated.linear::<&Tensor>(&self.down_proj, None)
    }

    /// `silu(gate(x)) * up(x)`.
    fn gated(&self, x: &Tensor) -> Tensor {
        match &self.fused {
            Some(w) => {
                let both = x.linear::<&Tensor>(w, None);
                let i = self.gate_proj.size()[0];
                both.narrow(-1, 0, i).silu() * both.narrow(-1, i, i)
            }
            None => {
                x.linear::<&Tensor>(&self.gate_proj, None).silu()
                    * x.linear::<&Tensor>(&self.up_proj, None)
            }
        }
    }

    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

/// A target layer's MLP.
#[derive(Debug)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    /// The MLP of layer `l` under `{prefix}.mlp` (e.g. `model.layers.3`), frozen: a dense one's
    /// gate and up (and a shared expert's) stored as one matrix.
    pub(crate) fn load(
        config: &TargetConfig,
        l: usize,
        prefix: &str,
        weights: &dyn WeightSource,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let h = config.hidden_size;
        let load = |name: &str, shape: &[i64]| {
            weights.load(&format!("{prefix}.mlp.{name}"), shape, kind, device)
        };
        match config.moe.as_ref().filter(|m| m.is_sparse(l as i64)) {
            Some(moe) => {
                let load_full = |name: &str, shape: &[i64]| weights.load(name, shape, kind, device);
                let contains = |name: &str| weights.contains(name);
                let source = TensorSource {
                    load: &load_full,
                    contains: &contains,
                };
                let mut block = SparseMoe::load(&format!("{prefix}.mlp"), moe.shape(h), &source)?;
                if let Some(shared) = &mut block.shared {
                    shared.mlp.fuse();
                }
                Ok(FeedForward::Sparse(block))
            }
            None => {
                let i = config.dense_intermediate_size(l as i64)?;
                let mut mlp = Mlp {
                    gate_proj: load("gate_proj.weight", &[i, h])?,
                    up_proj: load("up_proj.weight", &[i, h])?,
                    down_proj: load("down_proj.weight", &[h, i])?,
                    fused: None,
                };
                mlp.fuse();
                Ok(FeedForward::Dense(mlp))
            }
        }
    }

    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.tensors(),
            FeedForward::Sparse(moe) => moe.tensors(),
        }
    }

    /// Parameters a token does not run through: the experts it is not routed to.
    pub(crate) fn inactive_numel(&self) -> usize {
        match self {
            FeedForward::Dense(_) => 0,
            FeedForward::Sparse(moe) => {
                let experts = moe.gate_up.numel() + moe.down.numel();
                let e = moe.num_experts().max(1) as usize;
                experts / e * (e - moe.top_k as usize)
            }
        }
    }
}

impl FeedForward {
    /// `residual += mlp(x)` in place, a dense MLP's `silu(gate) * up` by the fused kernel where
    /// `kernels` are given (for `x`'s device); libtorch's operations where the kernel refuses
    /// the call (nothing is added before it runs).
    pub(crate) fn add_forward_with(
        &self,
        residual: &mut Tensor,
        x: &Tensor,
        kernels: Option<&FusedKernels>,
    ) {
        let Some(k) = kernels else {
            return self.add_forward(residual, x);
        };
        if let Err(e) = self.add_forward_fused(residual, x, k) {
            log::warn!("fused SwiGLU refused a call, libtorch instead: {e:#}");
            self.add_forward(residual, x);
        }
    }
}

impl AddFeedForward for FeedForward {
    /// `residual += mlp(x)` in place (inference).
    fn add_forward(&self, residual: &mut Tensor, x: &Tensor) {
        match self {
            FeedForward::Dense(mlp) => mlp.add_forward(residual, x),
            FeedForward::Sparse(moe) => moe.add_forward(residual, x),
        }
    }

    /// [`FeedForward::add_forward`] with the SwiGLU products (and a sparse block's combination
    /// of its experts' products) on the fused kernels.
    fn add_forward_fused(
        &self,
        residual: &mut Tensor,
        x: &Tensor,
        kernels: &FusedKernels,
    ) -> Result<()> {
        match self {
            FeedForward::Dense(mlp) => mlp.add_forward_fused(residual, x, kernels),
            FeedForward::Sparse(moe) => moe.add_forward_fused(residual, x, kernels),
        }
    }
}
