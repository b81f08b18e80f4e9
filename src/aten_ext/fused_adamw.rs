//! One parameter's AdamW step on the `adamw_step` kernel (fused_kernels.cu): the gradient read
//! where the backward pass left it, in the parameter's storage type, the float32 master weight
//! and moments updated and the new weight rounded into the parameter, all in one pass. The
//! drafter's optimizer (src/train/optim.rs, `AdamW::fused_step`) runs it per parameter where one
//! replica trains: libtorch's path first copies every gradient into a flat float32 buffer, then
//! reads that for the norm and the update, then copies the master weights into the parameters.

use anyhow::{anyhow, ensure, Result};
use tch::{Kind, Tensor};

use super::super::nvrtc::{arg, kind_index};
use super::FusedKernels;

/// One step's rates as the kernel takes them (its `AdamWRates`, six float32 in this order):
/// `decay` = lr * weight_decay, `step_size` = lr / (1 - beta1^t), `bias2_sqrt` =
/// sqrt(1 - beta2^t).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStepRates {
    pub decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub step_size: f32,
    pub bias2_sqrt: f32,
    pub eps: f32,
}

/// The float32 state of one parameter: its slices of the optimizer's flat buffers.
pub struct AdamWSlices<'a> {
    pub master: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
}

impl FusedKernels {
    /// AdamW on `param` (dense, bf16, f16 or f32, on this device) with its gradient `grad` (its
    /// kind and size; `None`: zeros) divided by `grad_scale` (one float32 on the device, or
    /// none), the float32 `state` of the same size updated in place, the new master weights
    /// rounded into `param`.
    pub fn adamw_step(
        &self,
        param: &Tensor,
        grad: Option<&Tensor>,
        state: &AdamWSlices<'_>,
        grad_scale: Option<&Tensor>,
        rates: AdamWStepRates,
    ) -> Result<()> {
        let kind = param.kind();
        let which =
            kind_index(kind).ok_or_else(|| anyhow!("fused AdamW: no kernel for {kind:?}"))?;
        let n = param.numel() as i64;
        self.check("the parameter", param, kind)?;
        if let Some(g) = grad {
            self.check("the gradient", g, kind)?;
            ensure!(
                g.numel() as i64 == n,
                "fused AdamW: a gradient of {} elements for a parameter of {n}",
                g.numel()
            );
        }
        for (what, t) in [
            ("master weights", state.master),
            ("first moments", state.exp_avg),
            ("second moments", state.exp_avg_sq),
        ] {
            self.check(what, t, Kind::Float)?;
            ensure!(
                t.numel() as i64 == n,
                "fused AdamW: {what} of {} elements for a parameter of {n}",
                t.numel()
            );
        }
        if let Some(s) = grad_scale {
            self.check("the gradient scale", s, Kind::Float)?;
            ensure!(
                s.numel() == 1,
                "fused AdamW: a gradient scale of {:?}",
                s.size()
            );
        }
        if n == 0 {
            return Ok(());
        }
        let threads: i64 = 256;
        // a grid-stride loop over 16-byte vectors of the parameter: enough blocks to fill the
        // device a few times over
        let per_block = threads * (16 / kind.elt_size_in_bytes() as i64);
        let blocks = ((n + per_block - 1) / per_block)
            .min(i64::from(self.module.multiprocessors().max(1)) * 16);
        let null = std::ptr::null_mut();
        let mut pg = grad.map_or(null, Tensor::data_ptr);
        let mut pp = param.data_ptr();
        let (mut pm, mut pa, mut ps) = (
            state.master.data_ptr(),
            state.exp_avg.data_ptr(),
            state.exp_avg_sq.data_ptr(),
        );
        let mut count = n;
        let mut scale = grad_scale.map_or(null, Tensor::data_ptr);
        let mut rates = rates;
        self.module.launch(
            self.adamw_step[which],
            (blocks as u32, 1),
            threads as u32,
            &mut [
                arg(&mut pg),
                arg(&mut pp),
                arg(&mut pm),
                arg(&mut pa),
                arg(&mut ps),
                arg(&mut count),
                arg(&mut scale),
                arg(&mut rates),
            ],
        )
    }
}
