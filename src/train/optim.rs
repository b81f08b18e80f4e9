//! AdamW with fp32 master weights and moments kept as flat buffers on the optimizer device,
//! global gradient-norm clipping, warm-up + cosine learning rate. tch cannot save optimizer
//! state, so this one is ours: its three buffers are saved and restored exactly.
//!
//! The update itself is libtorch's fused AdamW kernel (`at::_fused_adamw_`, one pass over
//! the weights, gradient and moments), which tch does not bind (see [`crate::aten_ext`]); or,
//! where one replica trains on a GPU, [`AdamW::fused_step`]: the program's own kernel per
//! parameter, reading each gradient where the backward pass left it and writing the new weights
//! in the same pass (no flat gradient, no copy of the master weights after).

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use crate::aten_ext::fused::{AdamWSlices, AdamWStepRates, FusedKernels};
use crate::aten_ext::{fused_adamw, AdamWRates, AdamWTensors};

/// Hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Linear warm-up over `warmup` steps, then cosine from `base` to `base * min_ratio` at `total`.
pub(crate) fn lr_at(step: u64, total: u64, warmup: u64, base: f64, min_ratio: f64) -> f64 {
    if warmup > 0 && step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup.min(step)) as f64 / span as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    base * (min_ratio + (1.0 - min_ratio) * cosine)
}

/// The divisor that clips gradients of global norm `norm` (a scalar on the device) to
/// `max_norm`: `(norm + 1e-6) / max_norm` where the norm exceeds it, else 1, as a one-element
/// tensor (the fused AdamW kernels' gradient scale); `None` without clipping (`max_norm` 0).
fn clip_divisor(norm: &Tensor, max_norm: f64) -> Result<Option<Tensor>> {
    if max_norm <= 0.0 {
        return Ok(None);
    }
    let over = norm.f_gt(max_norm).context("gradient clip")?;
    let scale = (norm + 1e-6)
        .f_div_scalar(max_norm)
        .and_then(|s| s.f_where_self(&over, &s.ones_like()))
        .and_then(|s| s.f_reshape([1]))
        .context("gradient clip scale")?;
    Ok(Some(scale))
}

/// The optimizer.
pub struct AdamW {
    pub config: AdamWConfig,
    names: Vec<String>,
    shapes: Vec<Vec<i64>>,
    offsets: Vec<i64>,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// The step count the fused kernel reads (fp32, one element, on the optimizer device),
    /// set before each update.
    state_step: Tensor,
    /// Optimizer steps taken.
    pub step: u64,
    pub device: Device,
}

impl AdamW {
    /// Master weights from the given parameters (in order), moments at zero.
    pub fn new(params: &[(String, &Tensor)], device: Device, config: AdamWConfig) -> Self {
        let mut offsets = vec![0i64];
        let mut flat = Vec::with_capacity(params.len());
        for (_, p) in params {
            offsets.push(offsets.last().copied().unwrap_or(0) + p.numel() as i64);
            flat.push(
                p.detach()
                    .to_device(device)
                    .to_kind(Kind::Float)
                    .reshape([-1]),
            );
        }
        let master = Tensor::cat(&flat, 0);
        AdamW {
            config,
            names: params.iter().map(|(n, _)| n.clone()).collect(),
            shapes: params.iter().map(|(_, p)| p.size()).collect(),
            offsets,
            exp_avg: master.zeros_like(),
            exp_avg_sq: master.zeros_like(),
            state_step: Tensor::zeros([1], (Kind::Float, device)),
            master,
            step: 0,
            device,
        }
    }

    /// The gradients of `params` as one flat fp32 buffer on their device (zeros where a
    /// parameter got none), and resets them. One pass: each gradient is copied (and cast)
    /// straight into its slice of the buffer.
    pub fn flatten_grads(params: &[(String, &Tensor)]) -> Tensor {
        tch::no_grad(|| {
            let total: i64 = params.iter().map(|(_, p)| p.numel() as i64).sum();
            let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
            let flat = Tensor::empty([total], (Kind::Float, device));
            let mut offset = 0;
            for (_, p) in params {
                let n = p.numel() as i64;
                let mut slot = flat.narrow(0, offset, n);
                let g = p.grad();
                if g.defined() {
                    slot.view(g.size().as_slice()).copy_(&g);
                } else {
                    let _ = slot.zero_();
                }
                offset += n;
            }
            // The gradients are dropped, not zeroed: the next backward pass stores its own
            // instead of adding to zeros. (The copies are queued first, on the one stream, so
            // `flat` holds the gradients; libtorch's memory cache reuses freed memory in
            // stream order.)
            for (_, p) in params {
                crate::aten_ext::clear_grad(p);
            }
            flat
        })
    }

    /// Scales `grad` in place to a global norm of at most `max_norm` (0 = no clipping) and
    /// returns the norm before clipping.
    pub fn clip(grad: &mut Tensor, max_norm: f64) -> f64 {
        Self::clip_on_device(grad, max_norm).double_value(&[])
    }

    /// [`AdamW::clip`] without waiting for the device: the scale is computed there, and the
    /// norm (a scalar tensor) is read whenever the caller needs it.
    pub(crate) fn clip_on_device(grad: &mut Tensor, max_norm: f64) -> Tensor {
        tch::no_grad(|| {
            let norm = grad.norm();
            if max_norm > 0.0 {
                // max_norm / (norm + 1e-6) where the norm exceeds max_norm, else 1
                let scale = (max_norm / (&norm + 1e-6)).clamp_max(1.0);
                let over = norm.gt(max_norm);
                let scale = scale.where_self(&over, &scale.ones_like());
                let _ = grad.g_mul_(&scale);
            }
            norm
        })
    }

    /// One AdamW update with the averaged flat gradient (fp32, [`AdamW::numel`] elements, on
    /// the optimizer device), in one pass of libtorch's fused kernel: a billion fp32 weights
    /// make every element-wise pass over the state cost milliseconds.
    ///
    /// With `t` the step count after this step: `master *= 1 - lr * weight_decay` (decoupled;
    /// only a positive decay applies), `m = beta1 m + (1 - beta1) g`,
    /// `v = beta2 v + (1 - beta2) g^2`,
    /// `master -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`. A zero
    /// learning rate (the end of a cosine schedule to 0) updates the moments and leaves the
    /// weights as they are (eps > 0).
    #[cfg(test)]
    pub(crate) fn update(&mut self, grad: &Tensor, lr: f64) -> Result<()> {
        self.fused_update(grad, None, lr)
    }

    /// [`AdamW::clip_on_device`] and [`AdamW::update`] in one pass: the clip is the fused
    /// kernel's gradient scale, `grad / ((norm + 1e-6) / max_norm)` where the norm exceeds
    /// `max_norm` (0 = no clipping), computed on the device. Returns the gradient norm before
    /// clipping, still on the device; `grad` is left clipped, as `clip_on_device` leaves it.
    pub fn update_clipped(&mut self, grad: &mut Tensor, lr: f64, max_norm: f64) -> Result<Tensor> {
        tch::no_grad(|| {
            let norm = grad.f_norm().context("gradient norm")?;
            let scale = clip_divisor(&norm, max_norm)?;
            self.fused_update(grad, scale.as_ref(), lr)?;
            Ok(norm)
        })
    }

    fn fused_update(&mut self, grad: &Tensor, grad_scale: Option<&Tensor>, lr: f64) -> Result<()> {
        let step = self.step + 1;
        tch::no_grad(|| {
            // fp32 counts steps exactly up to 2^24; the host value goes into the fill kernel,
            // with no wait for the device
            let _ = self
                .state_step
                .f_fill_(step as f64)
                .context("fused AdamW: the step count")?;
            let c = &self.config;
            fused_adamw(
                &AdamWTensors {
                    param: &self.master,
                    grad,
                    exp_avg: &self.exp_avg,
                    exp_avg_sq: &self.exp_avg_sq,
                    state_step: &self.state_step,
                    grad_scale,
                },
                &AdamWRates {
                    lr,
                    beta1: c.beta1,
                    beta2: c.beta2,
                    weight_decay: c.weight_decay.max(0.0),
                    eps: c.eps,
                },
            )
        })?;
        self.step = step;
        Ok(())
    }

    /// [`AdamW::update_clipped`] and [`AdamW::write_params`] on the parameters' own gradients,
    /// on `kernels` (the optimizer's device, which must hold every parameter): the global norm
    /// of the gradients as they are (float32 sums of each one's norm), the clip as the
    /// kernel's gradient scale, then per parameter one kernel that updates its master weights
    /// and moments and writes the new weights into it. The gradients are dropped after (as
    /// [`AdamW::flatten_grads`] drops them); a parameter without one steps with zeros. The
    /// same numbers as the flat path up to the order of the norm's float sums. Returns the
    /// gradient norm before clipping, on the device.
    pub fn fused_step(
        &mut self,
        params: &[(String, &Tensor)],
        kernels: &FusedKernels,
        lr: f64,
        max_norm: f64,
    ) -> Result<Tensor> {
        if params.len() != self.names.len() {
            bail!(
                "the optimizer holds {} tensors, the model has {}",
                self.names.len(),
                params.len()
            );
        }
        for (i, (name, p)) in params.iter().enumerate() {
            if name != &self.names[i] || p.size() != self.shapes[i] {
                bail!(
                    "parameter {i} is {name} {:?}, the optimizer expected {} {:?}",
                    p.size(),
                    self.names[i],
                    self.shapes[i]
                );
            }
        }
        let step = self.step + 1;
        let norm = tch::no_grad(|| -> Result<Tensor> {
            let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
            let norms = grads
                .iter()
                .filter(|g| g.defined())
                .map(|g| g.f_norm_scalaropt_dtype(2, Kind::Float))
                .collect::<std::result::Result<Vec<_>, _>>()
                .context("gradient norms")?;
            let norm = if norms.is_empty() {
                Tensor::zeros([], (Kind::Float, self.device))
            } else {
                Tensor::f_stack(&norms, 0)
                    .and_then(|n| n.f_norm())
                    .context("gradient norm")?
            };
            let scale = clip_divisor(&norm, max_norm)?;
            let c = &self.config;
            let rates = AdamWStepRates {
                // libtorch's kernel multiplies the float32 lr and weight decay
                decay: lr as f32 * c.weight_decay.max(0.0) as f32,
                beta1: c.beta1 as f32,
                beta2: c.beta2 as f32,
                step_size: (lr / (1.0 - c.beta1.powf(step as f64))) as f32,
                bias2_sqrt: (1.0 - c.beta2.powf(step as f64)).sqrt() as f32,
                eps: c.eps as f32,
            };
            for (i, ((name, p), g)) in params.iter().zip(&grads).enumerate() {
                let (at, n) = (self.offsets[i], self.offsets[i + 1] - self.offsets[i]);
                let slices = AdamWSlices {
                    master: &self.master.narrow(0, at, n),
                    exp_avg: &self.exp_avg.narrow(0, at, n),
                    exp_avg_sq: &self.exp_avg_sq.narrow(0, at, n),
                };
                kernels
                    .adamw_step(p, g.defined().then_some(g), &slices, scale.as_ref(), rates)
                    .with_context(|| format!("the optimizer step of {name}"))?;
            }
            Ok(norm)
        })?;
        for (_, p) in params {
            crate::aten_ext::clear_grad(p);
        }
        self.step = step;
        Ok(norm)
    }

    /// Copies the master weights into `params` (cast to their dtype, on their device).
    pub fn write_params(&self, params: &[(String, &Tensor)]) -> Result<()> {
        if params.len() != self.names.len() {
            bail!(
                "the optimizer holds {} tensors, the model has {}",
                self.names.len(),
                params.len()
            );
        }
        tch::no_grad(|| {
            // On the optimizer's device: one copy per parameter, converting as it copies (one
            // pass over the weights). Elsewhere: one transfer per device, then local copies.
            let mut moved: Option<(Device, Tensor)> = None;
            for (i, (name, p)) in params.iter().enumerate() {
                if name != &self.names[i] {
                    bail!(
                        "parameter {i} is {name}, the optimizer expected {}",
                        self.names[i]
                    );
                }
                let dev = p.device();
                let flat = if dev == self.device {
                    &self.master
                } else {
                    if moved.as_ref().is_none_or(|(d, _)| *d != dev) {
                        moved = Some((dev, self.master.to_device(dev).to_kind(p.kind())));
                    }
                    match &moved {
                        Some((_, t)) => t,
                        None => continue,
                    }
                };
                let src = flat
                    .narrow(0, self.offsets[i], self.offsets[i + 1] - self.offsets[i])
                    .view(self.shapes[i].as_slice());
                let mut p = p.shallow_clone();
                p.copy_(&src);
            }
            Ok(())
        })
    }

    /// Saves master weights and moments per parameter: `master.NAME`, `exp_avg.NAME`,
    /// `exp_avg_sq.NAME` (fp32).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::with_capacity(3 * self.names.len());
        for (prefix, buf) in [
            ("master", &self.master),
            ("exp_avg", &self.exp_avg),
            ("exp_avg_sq", &self.exp_avg_sq),
        ] {
            for (name, t) in self.views(buf) {
                tensors.push((format!("{prefix}.{name}"), t));
            }
        }
        crate::model::weights::save_safetensors(path, &tensors)
    }

    /// Each parameter's slice of the flat buffer `buf`, shaped as the parameter (views).
    fn views(&self, buf: &Tensor) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let t = buf
                    .narrow(0, self.offsets[i], self.offsets[i + 1] - self.offsets[i])
                    .view(self.shapes[i].as_slice());
                (name.clone(), t)
            })
            .collect()
    }

    /// The fp32 master weights by parameter name (views, on the optimizer device).
    pub(crate) fn master_weights(&self) -> Vec<(String, Tensor)> {
        self.views(&self.master)
    }

    /// Restores what [`AdamW::save`] wrote; every tensor must be present with its shape and
    /// hold finite values only (a NaN or infinity is refused naming the tensor: resumed, it
    /// would reach every later checkpoint). On an error the optimizer is left as it was.
    pub fn load(&mut self, path: &Path, step: u64) -> Result<()> {
        let data =
            std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&data)
            .with_context(|| format!("{}: not a valid safetensors file", path.display()))?;
        let mut bufs = Vec::new();
        for prefix in ["master", "exp_avg", "exp_avg_sq"] {
            let mut parts = Vec::with_capacity(self.names.len());
            for (i, name) in self.names.iter().enumerate() {
                let key = format!("{prefix}.{name}");
                let view = st
                    .tensor(&key)
                    .with_context(|| format!("{}: tensor {key:?} is missing", path.display()))?;
                let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
                if shape != self.shapes[i] || view.dtype() != safetensors::Dtype::F32 {
                    bail!(
                        "{}: tensor {key:?} is {:?} {:?}, expected F32 {:?}",
                        path.display(),
                        view.dtype(),
                        shape,
                        self.shapes[i]
                    );
                }
                let part =
                    Tensor::f_from_data_size(view.data(), &[shape.iter().product()], Kind::Float)?;
                if !all_finite(&part)? {
                    bail!(
                        "{}: tensor {key:?} holds a non-finite value (NaN or infinity)",
                        path.display()
                    );
                }
                parts.push(part);
            }
            bufs.push(Tensor::cat(&parts, 0).to_device(self.device));
        }
        self.exp_avg_sq = bufs.pop().unwrap_or_else(|| self.exp_avg_sq.zeros_like());
        self.exp_avg = bufs.pop().unwrap_or_else(|| self.exp_avg.zeros_like());
        self.master = bufs.pop().unwrap_or_else(|| self.master.zeros_like());
        self.step = step;
        Ok(())
    }
}

/// Whether every element of `t` is finite (one pass; an empty tensor is).
pub(crate) fn all_finite(t: &Tensor) -> Result<bool> {
    let all = t.f_isfinite()?.f_all()?;
    Ok(all.f_int64_value(&[])? != 0)
}

#[cfg(test)]
#[path = "optim_tests.rs"]
mod tests;
