//! The drafter's optimizer step on fused kernels (`adamw_square_sums`, `adamw_update` in
//! fused_kernels.cu), for one drafter replica. libtorch's path copies every gradient into a flat
//! float32 buffer, reads it for the norm, runs its fused AdamW over the float32 master weights
//! and moments, then copies the master weights into the parameters: at the 8B shape's billion
//! weights some 46 GB of memory traffic a step. Here the gradients are read where the backward
//! pass left them, in their storage type, and the new parameters are written in the update's
//! pass: about 31 GB.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::super::nvrtc::{arg, kind_index};
use super::super::upload;
use super::FusedKernels;

/// Elements per chunk (the source's `ADAMW_CHUNK`).
const CHUNK: i64 = 16_384;
/// Threads per block of both kernels.
const THREADS: u32 = 256;

/// The chunks of a set of tensors laid out back to back in flat buffers: [n, 4] int64 on the
/// device, per chunk its first element in the flat buffers, its first element in its tensor,
/// the tensor's index and its length.
#[derive(Debug)]
pub struct AdamWChunks {
    table: Tensor,
    chunks: i64,
    sizes: Vec<i64>,
}

impl AdamWChunks {
    /// The chunks of tensors of `sizes` elements, flat offsets from 0 in that order.
    pub fn new(sizes: &[i64], device: Device) -> AdamWChunks {
        let mut rows: Vec<i64> = Vec::new();
        let mut flat = 0;
        for (i, &n) in sizes.iter().enumerate() {
            let mut start = 0;
            while start < n {
                let len = CHUNK.min(n - start);
                rows.extend([flat + start, start, i as i64, len]);
                start += len;
            }
            flat += n;
        }
        let chunks = rows.len() as i64 / 4;
        AdamWChunks {
            table: upload(&Tensor::from_slice(&rows).view([chunks, 4]), device),
            chunks,
            sizes: sizes.to_vec(),
        }
    }
}

/// What one step reads and writes besides the parameters' gradients.
pub struct AdamWState<'a> {
    pub master: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
}

/// One step's rates: `decay` = lr * weight_decay, `step_size` = lr / (1 - beta1^t),
/// `bias2_sqrt` = sqrt(1 - beta2^t).
#[derive(Debug, Clone, Copy)]
pub struct AdamWStepRates {
    pub decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub step_size: f64,
    pub bias2_sqrt: f64,
    pub eps: f64,
}

impl FusedKernels {
    /// The device table of the data pointers of `tensors` (0 for an undefined one), checked to
    /// be dense, of `kind`, on this device and of the chunks' sizes; kept alive by the caller
    /// until the kernels that read them have run (stream order).
    fn pointer_table(
        &self,
        what: &str,
        tensors: &[Tensor],
        chunks: &AdamWChunks,
        kind: Kind,
    ) -> Result<Tensor> {
        ensure!(
            tensors.len() == chunks.sizes.len(),
            "fused AdamW: {} {what} for {} tensors",
            tensors.len(),
            chunks.sizes.len()
        );
        let mut pointers = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if !t.defined() {
                pointers.push(0i64);
                continue;
            }
            self.check(what, t, kind)?;
            ensure!(
                t.numel() as i64 == chunks.sizes[i],
                "fused AdamW: {what} {i} has {} elements, the optimizer {}",
                t.numel(),
                chunks.sizes[i]
            );
            pointers.push(t.data_ptr() as i64);
        }
        Ok(upload(&Tensor::from_slice(&pointers), self.device()))
    }

    /// Each chunk's sum of squares of `grads` (float32 [chunks]; an undefined gradient counts
    /// as zeros): summed in a fixed order by the caller, the squared global gradient norm.
    pub fn adamw_square_sums(
        &self,
        grads: &[Tensor],
        chunks: &AdamWChunks,
        kind: Kind,
    ) -> Result<Tensor> {
        let Some(which) = kind_index(kind) else {
            bail!("fused AdamW: no kernel for gradients of {kind:?}");
        };
        let table = self.pointer_table("gradient", grads, chunks, kind)?;
        let partial = Tensor::zeros([chunks.chunks.max(1)], (Kind::Float, self.device()));
        if chunks.chunks == 0 {
            return Ok(partial);
        }
        let (mut gp, mut cp, mut n, mut pp) = (
            table.data_ptr(),
            chunks.table.data_ptr(),
            chunks.chunks,
            partial.data_ptr(),
        );
        let mut params = [arg(&mut gp), arg(&mut cp), arg(&mut n), arg(&mut pp)];
        self.module.launch(
            self.adamw_square_sums[which],
            (self.adamw_blocks(chunks), 1),
            THREADS,
            &mut params,
        )?;
        // the table must outlive the launch: freed now, its memory is reused in stream order
        drop(table);
        Ok(partial)
    }

    /// One AdamW step (see the source) over the parameters `params` of `kind` with their
    /// gradients `grads` (an undefined one counts as zeros) divided by `grad_scale` (float32
    /// [1] on the device, or none), the float32 `state` buffers laid out as `chunks`; the new
    /// master weights rounded into `params`.
    pub fn adamw_update(
        &self,
        params: &[Tensor],
        grads: &[Tensor],
        chunks: &AdamWChunks,
        state: &AdamWState<'_>,
        grad_scale: Option<&Tensor>,
        rates: AdamWStepRates,
    ) -> Result<()> {
        let kind = params.first().map_or(Kind::Float, Tensor::kind);
        let Some(which) = kind_index(kind) else {
            bail!("fused AdamW: no kernel for parameters of {kind:?}");
        };
        let total: i64 = chunks.sizes.iter().sum();
        for (what, t) in [
            ("master weights", state.master),
            ("first moments", state.exp_avg),
            ("second moments", state.exp_avg_sq),
        ] {
            self.check(what, t, Kind::Float)?;
            ensure!(
                t.numel() as i64 == total,
                "fused AdamW: {what} of {} elements for {total}",
                t.numel()
            );
        }
        if let Some(s) = grad_scale {
            self.check("gradient scale", s, Kind::Float)?;
        }
        let param_table = self.pointer_table("parameter", params, chunks, kind)?;
        ensure!(
            params.iter().all(Tensor::defined),
            "fused AdamW: an undefined parameter"
        );
        let grad_table = self.pointer_table("gradient", grads, chunks, kind)?;
        if chunks.chunks == 0 {
            return Ok(());
        }
        let (mut gp, mut pp, mut cp, mut n) = (
            grad_table.data_ptr(),
            param_table.data_ptr(),
            chunks.table.data_ptr(),
            chunks.chunks,
        );
        let (mut mp, mut ap, mut sp) = (
            state.master.data_ptr(),
            state.exp_avg.data_ptr(),
            state.exp_avg_sq.data_ptr(),
        );
        let mut scale = grad_scale.map_or(std::ptr::null_mut(), Tensor::data_ptr);
        let (mut decay, mut b1, mut b2, mut step, mut b2s, mut eps) = (
            rates.decay as f32,
            rates.beta1 as f32,
            rates.beta2 as f32,
            rates.step_size as f32,
            rates.bias2_sqrt as f32,
            rates.eps as f32,
        );
        let mut args = [
            arg(&mut gp),
            arg(&mut pp),
            arg(&mut cp),
            arg(&mut n),
            arg(&mut mp),
            arg(&mut ap),
            arg(&mut sp),
            arg(&mut scale),
            arg(&mut decay),
            arg(&mut b1),
            arg(&mut b2),
            arg(&mut step),
            arg(&mut b2s),
            arg(&mut eps),
        ];
        self.module.launch(
            self.adamw_update[which],
            (self.adamw_blocks(chunks), 1),
            THREADS,
            &mut args,
        )?;
        drop((grad_table, param_table));
        Ok(())
    }

    /// Blocks of a launch over `chunks`: enough to fill the device, at most one per chunk.
    fn adamw_blocks(&self, chunks: &AdamWChunks) -> u32 {
        let fill = 8 * self.module.multiprocessors() as i64;
        chunks.chunks.clamp(1, fill) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::super::norms::tests::{fused_ptx, param_sizes};
    use super::*;

    #[test]
    fn chunks_cover_each_tensor_once_in_flat_order() {
        let sizes = [5, CHUNK, CHUNK + 3, 0, 1];
        let chunks = AdamWChunks::new(&sizes, Device::Cpu);
        let rows = Vec::<i64>::try_from(chunks.table.reshape([-1])).unwrap();
        let rows: Vec<&[i64]> = rows.chunks(4).collect();
        assert_eq!(
            rows,
            [
                &[0, 0, 0, 5][..],
                &[5, 0, 1, CHUNK],
                &[5 + CHUNK, 0, 2, CHUNK],
                &[5 + 2 * CHUNK, CHUNK, 2, 3],
                &[5 + 2 * CHUNK + 3, 0, 4, 1],
            ]
        );
        assert_eq!(chunks.chunks, 5);
    }

    /// The kernels take, in order, parameters of the sizes their launches pass.
    #[test]
    fn the_adamw_kernels_take_what_their_launches_pass() {
        let Some(text) = fused_ptx() else {
            return;
        };
        let text = text.as_str();
        let ptr = std::mem::size_of::<*mut std::ffi::c_void>();
        let (long, float) = (8, std::mem::size_of::<f32>());
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                param_sizes(text, &format!("adamw_square_sums_{kind}")),
                [ptr, ptr, long, ptr]
            );
            assert_eq!(
                param_sizes(text, &format!("adamw_update_{kind}")),
                [
                    ptr, ptr, ptr, long, ptr, ptr, ptr, ptr, float, float, float, float, float,
                    float
                ]
            );
        }
    }
}
