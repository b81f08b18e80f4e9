//! The MLP of a target layer: a dense SwiGLU ([`Mlp`]) or, in a mixture of experts, a sparse
//! block of routed experts ([`SparseMoe`]), as the config's [`super::moe::MoeSettings`] says
//! per layer.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::config::TargetConfig;
use super::layers::{AddFeedForward, Mlp};
use super::moe::{SparseMoe, TensorSource};
use super::weights::WeightSource;
use crate::aten_ext::fused::FusedKernels;

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
