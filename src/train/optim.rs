//! AdamW with fp32 master weights and moments kept as flat buffers on the optimizer device,
//! global gradient-norm clipping, warm-up + cosine learning rate. tch cannot save optimizer
//! state, so this one is ours: its three buffers are saved and restored exactly.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

/// Hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Linear warm-up over `warmup` steps, then cosine from `base` to `base * min_ratio` at `total`.
pub fn lr_at(step: u64, total: u64, warmup: u64, base: f64, min_ratio: f64) -> f64 {
    if warmup > 0 && step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup.min(step)) as f64 / span as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    base * (min_ratio + (1.0 - min_ratio) * cosine)
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
            master,
            step: 0,
            device,
        }
    }

    pub fn numel(&self) -> i64 {
        self.master.numel() as i64
    }

    /// The gradients of `params` as one flat fp32 buffer on their device (zeros where a
    /// parameter got none), and resets them.
    pub fn flatten_grads(params: &[(String, &Tensor)]) -> Tensor {
        tch::no_grad(|| {
            let parts: Vec<Tensor> = params
                .iter()
                .map(|(_, p)| {
                    let g = p.grad();
                    if g.defined() {
                        g.to_kind(Kind::Float).reshape([-1])
                    } else {
                        Tensor::zeros([p.numel() as i64], (Kind::Float, p.device()))
                    }
                })
                .collect();
            // `cat` copies; only then may the gradients (which `parts` may view) be reset.
            let flat = Tensor::cat(&parts, 0);
            for (_, p) in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
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
    pub fn clip_on_device(grad: &mut Tensor, max_norm: f64) -> Tensor {
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

    /// One AdamW update with the averaged flat gradient (on the optimizer device). A billion
    /// fp32 weights make every element-wise pass over the state cost milliseconds, so the
    /// update is written with as few passes as libtorch's in-place operations allow.
    pub fn update(&mut self, grad: &Tensor, lr: f64) {
        tch::no_grad(|| {
            let c = self.config;
            self.step += 1;
            let t = self.step as i32;
            // m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
            let _ = self.exp_avg.lerp_(grad, 1.0 - c.beta1);
            let _ = self.exp_avg_sq.lerp_(&grad.square(), 1.0 - c.beta2);
            let bias1 = 1.0 - c.beta1.powi(t);
            let bias2 = 1.0 - c.beta2.powi(t);
            if c.weight_decay > 0.0 {
                let _ = self.master.g_mul_scalar_(1.0 - lr * c.weight_decay);
            }
            // master -= step * m / (sqrt(v / bias2) + eps), as master += m / denom with
            // denom = -(sqrt(v) / sqrt(bias2) + eps) / step.
            // (A zero learning rate, the end of a cosine schedule to 0, changes nothing.)
            let step = lr / bias1;
            if step > 0.0 {
                let mut denom = self.exp_avg_sq.sqrt();
                let _ = denom.g_mul_scalar_(-1.0 / (step * bias2.sqrt()));
                let _ = denom.g_add_scalar_(-c.eps / step);
                let _ = self.master.addcdiv_(&self.exp_avg, &denom);
            }
        })
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
            // One transfer per device, then device-local copies.
            let mut by_device: Option<(Device, Kind, Tensor)> = None;
            for (i, (name, p)) in params.iter().enumerate() {
                if name != &self.names[i] {
                    bail!(
                        "parameter {i} is {name}, the optimizer expected {}",
                        self.names[i]
                    );
                }
                let (dev, kind) = (p.device(), p.kind());
                let needs_new = match &by_device {
                    Some((d, k, _)) => *d != dev || *k != kind,
                    None => true,
                };
                if needs_new {
                    by_device = Some((dev, kind, self.master.to_device(dev).to_kind(kind)));
                }
                let Some((_, _, flat)) = &by_device else {
                    continue;
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
            for (i, name) in self.names.iter().enumerate() {
                let t = buf
                    .narrow(0, self.offsets[i], self.offsets[i + 1] - self.offsets[i])
                    .view(self.shapes[i].as_slice());
                tensors.push((format!("{prefix}.{name}"), t));
            }
        }
        crate::model::weights::save_safetensors(path, &tensors)
    }

    /// Restores what [`AdamW::save`] wrote; every tensor must be present with its shape.
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
                parts.push(Tensor::f_from_data_size(
                    view.data(),
                    &[shape.iter().product()],
                    Kind::Float,
                )?);
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(&params, Device::Cpu, cfg);
        let g = Tensor::from_slice(&[0.5f32, 0.25]);
        opt.update(&g, 0.01);
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
        opt.update(&g, 0.01);
        other.update(&g, 0.01);
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
        assert_eq!(Vec::<f32>::try_from(&p.grad()).unwrap(), vec![0.0, 0.0]);
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
}
