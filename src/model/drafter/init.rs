//! A freshly initialised drafter, its weights drawn from generators of its own so that a seed
//! always gives the same drafter.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::Drafter;
use crate::model::drafter_config::DrafterConfig;

impl Drafter {
    /// A freshly initialised drafter: weights N(0, 0.02), norms at 1 (spec §4), drawn from
    /// generators of its own seeded with `seed` (libtorch's global generator is shared by every
    /// thread of the process, so the same seed would not give the same drafter). Each tensor is
    /// drawn in chunks of its own generator, in parallel: a drafter of an 8B target has about
    /// a billion weights.
    pub fn init(config: DrafterConfig, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        Self::build(config, device, kind, |name, shape| {
            Ok(trainable(fresh_weight(name, shape, seed), device, kind))
        })
    }
}

/// A fresh drafter's tensor `name` on the host: a norm at 1, any other weight N(0, 0.02)
/// drawn by seed and name.
fn fresh_weight(name: &str, shape: &[i64], seed: u64) -> Tensor {
    if shape.len() == 1 {
        Tensor::ones(shape, (Kind::Float, Device::Cpu))
    } else {
        let n: i64 = shape.iter().product();
        Tensor::from_slice(&normal_values(n as usize, 0.02, seed, name)).view(shape)
    }
}

fn trainable(t: Tensor, device: Device, kind: Kind) -> Tensor {
    t.to_device(device).to_kind(kind).set_requires_grad(true)
}

/// `n` values drawn from N(0, std): chunks of 2^20 values, each from a ChaCha8 generator
/// seeded by (`seed`, `name`, chunk index), drawn in parallel (Box-Muller: two uniform draws
/// give two standard normal values). The same arguments always give the same values.
fn normal_values(n: usize, std: f64, seed: u64, name: &str) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    let h = crate::model::weights::name_seed(seed, name);
    let mut values = vec![0f32; n];
    values
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            for pair in chunk.chunks_mut(2) {
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random::<f64>();
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let theta = 2.0 * std::f64::consts::PI * u2;
                pair[0] = (r * theta.cos()) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (r * theta.sin()) as f32;
                }
            }
        });
    values
}

impl Drafter {
    /// The drafter with `added` decoder layers appended after its last one. Each new layer
    /// starts as the identity: its attention and MLP output projections (`o_proj`,
    /// `down_proj`) are zero, so the residual stream passes through unchanged and the grown
    /// drafter computes exactly what this one does; its other weights are drawn as
    /// [`Drafter::init`] draws them (seed `seed`, by public name), so that the zero
    /// projections receive gradients and the layer learns. Fails where the total would exceed
    /// 64 layers ([`DrafterConfig::with_added_layers`]).
    pub fn with_added_layers(self, added: i64, seed: u64) -> Result<Self> {
        if added == 0 {
            return Ok(self);
        }
        let config = self.config.with_added_layers(added)?;
        let (device, kind) = (self.device, self.kind);
        let mut old: std::collections::HashMap<String, Tensor> = self
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.shallow_clone()))
            .collect();
        let grown = Self::build(config, device, kind, |name, shape| {
            if let Some(t) = old.remove(name) {
                return Ok(t);
            }
            let t = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                Tensor::zeros(shape, (Kind::Float, Device::Cpu))
            } else {
                fresh_weight(name, shape, seed)
            };
            Ok(trainable(t, device, kind))
        })?;
        Ok(grown.with_train_attention(self.train_attention))
    }
}
