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
mod tests {
    use super::*;

    /// PyTorch's default betas and eps, with `weight_decay`.
    fn pytorch_defaults(weight_decay: f64) -> AdamWConfig {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        }
    }

    #[test]
    fn a_non_finite_optimizer_state_is_refused_naming_the_tensor_and_changes_nothing() {
        let good = Tensor::from_slice(&[1.0f32, 2.0]);
        let bad = Tensor::from_slice(&[1.0f32, f32::INFINITY]);
        let norm = Tensor::from_slice(&[1.0f32]);
        let cfg = pytorch_defaults(0.0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("opt.safetensors");
        let saved = [("w".to_string(), &bad), ("n".to_string(), &norm)];
        AdamW::new(&saved, Device::Cpu, cfg).save(&path).unwrap();
        let mut opt = AdamW::new(
            &[("w".into(), &good), ("n".into(), &norm)],
            Device::Cpu,
            cfg,
        );
        let err = format!("{:#}", opt.load(&path, 3).unwrap_err());
        assert!(
            err.contains("tensor \"master.w\" holds a non-finite value"),
            "{err}"
        );
        assert_eq!(opt.step, 0);
        assert_eq!(
            Vec::<f32>::try_from(&opt.master).unwrap(),
            vec![1.0, 2.0, 1.0]
        );
        let nan = Tensor::from_slice(&[f32::NAN]);
        assert!(!all_finite(&nan).unwrap() && all_finite(&good).unwrap());
        assert!(all_finite(&Tensor::zeros([0], (Kind::Float, Device::Cpu))).unwrap());
    }

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let lr = |s| lr_at(s, 100, 10, 1.0, 0.1);
        assert!((lr(0) - 0.1).abs() < 1e-12);
        assert!((lr(9) - 1.0).abs() < 1e-12);
        assert!((lr(10) - 1.0).abs() < 1e-12);
        assert!(lr(50) < lr(20) && lr(50) > 0.1);
        assert!((lr(100) - 0.1).abs() < 1e-12);
        assert!((lr(500) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn adamw_matches_the_formula_and_round_trips() {
        let p = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let params = vec![("w".to_string(), &p)];
        let cfg = pytorch_defaults(0.1);
        let mut opt = AdamW::new(&params, Device::Cpu, cfg);
        let g = Tensor::from_slice(&[0.5f32, 0.25]);
        opt.update(&g, 0.01).unwrap();
        opt.write_params(&params).unwrap();
        // step 1: m/(1-b1) = g, v/(1-b2) = g^2 -> update = lr * g/|g| = lr * sign(g)
        let want = [
            1.0 * (1.0 - 0.01 * 0.1) - 0.01,
            -2.0 * (1.0 - 0.01 * 0.1) - 0.01,
        ];
        let got = Vec::<f32>::try_from(&p.detach()).unwrap();
        for (a, b) in got.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{got:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("opt.safetensors");
        opt.save(&path).unwrap();
        let mut other = AdamW::new(&params, Device::Cpu, cfg);
        other.load(&path, opt.step).unwrap();
        opt.update(&g, 0.01).unwrap();
        other.update(&g, 0.01).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&opt.master).unwrap(),
            Vec::<f32>::try_from(&other.master).unwrap()
        );
        // flattened gradients survive the reset of the parameters' gradients
        (&p * Tensor::from_slice(&[2.0f32, 3.0]))
            .sum(Kind::Float)
            .backward();
        let flat = AdamW::flatten_grads(&params);
        assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), vec![2.0, 3.0]);
        assert!(!p.grad().defined(), "the gradient is dropped");
        // the next backward pass starts from nothing, not from the old gradient
        (&p * Tensor::from_slice(&[5.0f32, 7.0]))
            .sum(Kind::Float)
            .backward();
        assert_eq!(Vec::<f32>::try_from(&p.grad()).unwrap(), vec![5.0, 7.0]);
        assert_eq!(
            Vec::<f32>::try_from(&AdamW::flatten_grads(&params)).unwrap(),
            vec![5.0, 7.0]
        );
        let mut big = Tensor::from_slice(&[3.0f32, 4.0]);
        assert_eq!(AdamW::clip(&mut big, 1.0), 5.0);
        assert!((big.norm().double_value(&[]) - 1.0).abs() < 1e-5);
        // below the limit, or no limit: unchanged, the norm still reported
        let mut small = Tensor::from_slice(&[0.3f32, 0.4]);
        let norm = AdamW::clip_on_device(&mut small, 1.0);
        assert!((norm.double_value(&[]) - 0.5).abs() < 1e-6);
        assert_eq!(Vec::<f32>::try_from(&small).unwrap(), vec![0.3, 0.4]);
        let mut any = Tensor::from_slice(&[30.0f32, 40.0]);
        assert_eq!(AdamW::clip(&mut any, 0.0), 50.0);
        assert_eq!(Vec::<f32>::try_from(&any).unwrap(), vec![30.0, 40.0]);
    }

    /// AdamW as the formulas read, in f64 on the host, with the global-norm clip in front.
    struct Reference {
        cfg: AdamWConfig,
        p: Vec<f64>,
        m: Vec<f64>,
        v: Vec<f64>,
        /// The magnitude of the terms that summed to `m` (the scale of its rounding errors
        /// when they cancel to about zero)
        m_terms: Vec<f64>,
        t: i32,
    }

    impl Reference {
        /// One step; returns the gradient norm before clipping.
        fn step(&mut self, g: &[f32], lr: f64, max_norm: f64) -> f64 {
            let c = self.cfg;
            self.t += 1;
            let norm = g.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            let scale = if max_norm > 0.0 && norm > max_norm {
                max_norm / (norm + 1e-6)
            } else {
                1.0
            };
            let bias1 = 1.0 - c.beta1.powi(self.t);
            let bias2 = 1.0 - c.beta2.powi(self.t);
            for i in 0..self.p.len() {
                let g = g[i] as f64 * scale;
                self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
                self.m_terms[i] = c.beta1 * self.m_terms[i] + (1.0 - c.beta1) * g.abs();
                self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
                self.p[i] *= 1.0 - lr * c.weight_decay;
                let m_hat = self.m[i] / bias1;
                let v_hat = self.v[i] / bias2;
                self.p[i] -= lr * m_hat / (v_hat.sqrt() + c.eps);
            }
            norm
        }
    }

    fn host(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.to_device(Device::Cpu).to_kind(Kind::Float).reshape([-1])).unwrap()
    }

    /// Every element within `rel` of the reference, relative to `scale` (its magnitude, or
    /// that of the terms it sums).
    fn assert_close(what: &str, step: usize, got: &[f32], want: &[f64], scale: &[f64], rel: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
            let err = (a as f64 - b).abs() / scale[i];
            assert!(
                err <= rel,
                "step {step}: {what}[{i}] = {a}, the reference {b} (relative error {err:.2e})"
            );
        }
    }

    #[test]
    fn fused_update_matches_an_elementwise_adamw() {
        tch::manual_seed(7);
        // two parameters (one matrix, one vector) of 317 elements, of magnitude 0.5 to 2
        let init = |shape: &[i64]| {
            let u = Tensor::rand(shape, (Kind::Float, Device::Cpu)) * 1.5 + 0.5;
            let sign = Tensor::rand(shape, (Kind::Float, Device::Cpu)).gt(0.5);
            u.where_self(&sign, &-&u)
        };
        let a = init(&[12, 20]).set_requires_grad(true);
        let b = init(&[77]).set_requires_grad(true);
        let params = vec![("a".to_string(), &a), ("b".to_string(), &b)];
        // a large eps and a small beta2 make the place of eps in the denominator matter
        let cfg = AdamWConfig {
            beta1: 0.8,
            beta2: 0.95,
            eps: 1e-3,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(&params, Device::Cpu, cfg);
        let start: Vec<f64> = host(&opt.master).iter().map(|&x| x as f64).collect();
        let n = start.len();
        assert_eq!(n, 317);
        let mut reference = Reference {
            cfg,
            p: start,
            m: vec![0.0; n],
            v: vec![0.0; n],
            m_terms: vec![0.0; n],
            t: 0,
        };
        // (gradient size, lr, max_norm): clipped (norm about 18 > 5) or not (norm about 1.8
        // < 5, or no limit), a step with lr = 0, and plain `update` (no clip) at the end
        let steps = [
            (1.0, 0.05, 5.0),
            (0.1, 0.05, 5.0),
            (1.0, 0.03, 5.0),
            (1.0, 0.0, 5.0),
            (0.1, 0.02, 5.0),
            (1.0, 0.02, 0.0),
            (1.0, 0.01, f64::NAN),
        ];
        let (mut clipped, mut unclipped) = (0, 0);
        for (k, &(size, lr, max_norm)) in steps.iter().enumerate() {
            let mut grad = Tensor::randn([n as i64], (Kind::Float, Device::Cpu)) * size;
            let g = host(&grad);
            let before = host(&opt.master);
            let plain = max_norm.is_nan();
            let want_norm = reference.step(&g, lr, if plain { 0.0 } else { max_norm });
            if !plain && max_norm > 0.0 && want_norm > max_norm {
                clipped += 1;
            } else {
                unclipped += 1;
            }
            if plain {
                opt.update(&grad, lr).unwrap();
            } else {
                let norm = opt.update_clipped(&mut grad, lr, max_norm).unwrap();
                let norm = norm.double_value(&[]);
                assert!(
                    (norm - want_norm).abs() <= 1e-6 * want_norm,
                    "{norm} {want_norm}"
                );
            }
            assert_eq!(opt.step, k as u64 + 1);
            let after = host(&opt.master);
            if lr == 0.0 {
                assert_eq!(before, after, "lr = 0 changed the weights");
            } else {
                assert!(before != after);
            }
            let r = &reference;
            let abs = |x: &[f64]| x.iter().map(|v| v.abs()).collect::<Vec<_>>();
            assert_close("master", k, &after, &r.p, &abs(&r.p), 1e-6);
            assert_close("exp_avg", k, &host(&opt.exp_avg), &r.m, &r.m_terms, 1e-6);
            assert_close("exp_avg_sq", k, &host(&opt.exp_avg_sq), &r.v, &r.v, 1e-6);
        }
        assert!(clipped >= 2 && unclipped >= 3, "{clipped} {unclipped}");
        // the weights reach the parameters
        opt.write_params(&params).unwrap();
        let mut written = host(&a);
        written.extend(host(&b));
        let scale: Vec<f64> = reference.p.iter().map(|v| v.abs()).collect();
        assert_close("written", steps.len(), &written, &reference.p, &scale, 1e-6);
    }

    #[test]
    fn update_clipped_returns_the_norm_before_clipping() {
        let p = Tensor::from_slice(&[0.0f32; 4]);
        let params = vec![("w".to_string(), &p)];
        let cfg = pytorch_defaults(0.0);
        let mut opt = AdamW::new(&params, Device::Cpu, cfg);
        // norm 13, clipped to 1: the gradient is left scaled to a norm of about 1
        let mut grad = Tensor::from_slice(&[3.0f32, 4.0, 12.0, 0.0]);
        let norm = opt.update_clipped(&mut grad, 1e-3, 1.0).unwrap();
        assert!((norm.double_value(&[]) - 13.0).abs() < 1e-5);
        assert!((grad.norm().double_value(&[]) - 1.0).abs() < 1e-5);
        // below the limit and without a limit: the norm, the gradient unchanged
        let mut grad = Tensor::from_slice(&[0.3f32, 0.4, 0.0, 0.0]);
        let norm = opt.update_clipped(&mut grad, 1e-3, 1.0).unwrap();
        assert!((norm.double_value(&[]) - 0.5).abs() < 1e-6);
        assert_eq!(host(&grad), vec![0.3, 0.4, 0.0, 0.0]);
        let mut grad = Tensor::from_slice(&[30.0f32, 40.0, 0.0, 0.0]);
        let norm = opt.update_clipped(&mut grad, 1e-3, 0.0).unwrap();
        assert!((norm.double_value(&[]) - 50.0).abs() < 1e-4);
        assert_eq!(host(&grad), vec![30.0, 40.0, 0.0, 0.0]);
        assert_eq!(opt.step, 3);
    }

    #[test]
    fn mismatched_tensors_are_errors() {
        let p = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let params = vec![("w".to_string(), &p)];
        let cfg = pytorch_defaults(0.0);
        let mut opt = AdamW::new(&params, Device::Cpu, cfg);
        let short = Tensor::from_slice(&[1.0f32, 2.0]);
        let err = opt.update(&short, 0.1).unwrap_err().to_string();
        assert!(err.contains("gradient") && err.contains("[2]"), "{err}");
        let double = Tensor::from_slice(&[1.0f64, 2.0, 3.0]);
        let err = opt.update(&double, 0.1).unwrap_err().to_string();
        assert!(err.contains("Double"), "{err}");
        assert_eq!(opt.step, 0, "a failed update counts no step");
        // past the checks, libtorch's own error comes back through the shim
        let step = Tensor::from_slice(&[1.0f32]);
        let tensors = AdamWTensors {
            param: &opt.master,
            grad: &double,
            exp_avg: &opt.exp_avg,
            exp_avg_sq: &opt.exp_avg_sq,
            state_step: &step,
            grad_scale: None,
        };
        let rates = AdamWRates {
            lr: 0.1,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            weight_decay: cfg.weight_decay,
            eps: cfg.eps,
        };
        // SAFETY: every tensor has three contiguous elements
        let err = unsafe { crate::aten_ext::fused_adamw_unchecked(&tensors, &rates) }
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("fused AdamW (at::_fused_adamw_): "),
            "{err}"
        );
        assert_eq!(host(&opt.master), vec![1.0, 2.0, 3.0]);
    }

    /// On a GPU: the optimizer step on the fused kernel gives the flat path's numbers: bf16
    /// parameters (sizes the kernel takes by vectors and one element at a time), four steps
    /// with weight decay, one of them clipped, one with a parameter that got no gradient; the
    /// master weights and moments within float32 rounding, the parameters their rounding.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn gpu_fused_step_equals_the_flat_path() {
        let runtime = crate::runtime::TorchRuntime::init();
        assert!(
            runtime.cuda_devices() > 0,
            "no CUDA device: {:?}",
            runtime.cuda
        );
        let dev = Device::Cuda(0);
        let kernels = runtime
            .fused_kernels(true, dev)
            .expect("the fused kernels load");
        tch::manual_seed(3);
        let shapes: [&[i64]; 4] = [&[256, 64], &[64], &[333, 3], &[7]];
        let start: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn(*s, (Kind::Float, dev)).to_kind(Kind::BFloat16))
            .collect();
        let copy = || -> Vec<Tensor> {
            start
                .iter()
                .map(|t| t.copy().set_requires_grad(true))
                .collect()
        };
        let (flat_params, fused_params) = (copy(), copy());
        let named = |ps: &[Tensor]| -> Vec<(String, Tensor)> {
            ps.iter()
                .enumerate()
                .map(|(i, p)| (format!("p{i}"), p.shallow_clone()))
                .collect()
        };
        let (flat_named, fused_named) = (named(&flat_params), named(&fused_params));
        fn refs(n: &[(String, Tensor)]) -> Vec<(String, &Tensor)> {
            n.iter().map(|(k, t)| (k.clone(), t)).collect()
        }
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut flat = AdamW::new(&refs(&flat_named), dev, cfg);
        let mut fused = AdamW::new(&refs(&fused_named), dev, cfg);
        for step in 0..4 {
            // the same gradients into both (step 1 large: clipped; step 2: none for p1)
            let size = if step == 1 { 30.0 } else { 0.05 };
            let grads: Vec<Tensor> = shapes
                .iter()
                .map(|s| Tensor::randn(*s, (Kind::Float, dev)) * size)
                .collect();
            for ps in [&flat_params, &fused_params] {
                let loss = ps
                    .iter()
                    .zip(&grads)
                    .enumerate()
                    .filter(|(i, _)| step != 2 || *i != 1)
                    .map(|(_, (p, g))| (p.to_kind(Kind::Float) * g).sum(Kind::Float))
                    .fold(Tensor::zeros([], (Kind::Float, dev)), |a, b| a + b);
                loss.backward();
            }
            let mut g = AdamW::flatten_grads(&refs(&flat_named));
            let want = flat
                .update_clipped(&mut g, 1e-2, 1.0)
                .unwrap()
                .double_value(&[]);
            flat.write_params(&refs(&flat_named)).unwrap();
            let got = fused
                .fused_step(&refs(&fused_named), &kernels, 1e-2, 1.0)
                .unwrap()
                .double_value(&[]);
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "step {step}: norm {got} against {want}"
            );
            assert!(
                fused_params.iter().all(|p| !p.grad().defined()),
                "gradients kept"
            );
            for (what, a, b) in [
                ("master weights", &fused.master, &flat.master),
                ("first moments", &fused.exp_avg, &flat.exp_avg),
                ("second moments", &fused.exp_avg_sq, &flat.exp_avg_sq),
            ] {
                let scale = b.abs().max().double_value(&[]);
                let diff = (a - b).abs().max().double_value(&[]);
                assert!(
                    diff <= 1e-5 * scale,
                    "step {step}: {what} {diff} off of {scale}"
                );
            }
            for (i, (p, q)) in fused_params.iter().zip(&flat_params).enumerate() {
                let diff = (p.to_kind(Kind::Float) - q.to_kind(Kind::Float))
                    .abs()
                    .max()
                    .double_value(&[]);
                let scale = q.to_kind(Kind::Float).abs().max().double_value(&[]);
                assert!(
                    diff <= 1e-2 * scale,
                    "step {step}: parameter {i} {diff} off of {scale}"
                );
            }
        }
        assert_eq!((fused.step, flat.step), (4, 4));
    }
}
