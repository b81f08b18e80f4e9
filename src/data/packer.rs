//! Batches under a token budget with length bucketing.
//!
//! The packer takes the sampler's order a window at a time, sorts the window by length, cuts it
//! into batches whose padded size (`longest * count`) stays within the budget, and hands the
//! batches out in a seeded random order. Similar lengths in one batch keep padding low; the
//! window keeps the epoch's randomness. Its state (the sampler at the window start plus the
//! batches already handed out from the window) resumes exactly.

use std::collections::VecDeque;
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use super::sampler::{EpochSampler, SamplerState};
use super::store::TokenStore;

/// How batches are formed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PackerConfig {
    /// Upper bound on padded tokens (longest sample x samples) per batch.
    pub token_budget: usize,
    /// Upper bound on samples per batch.
    pub max_batch: usize,
    /// Samples sorted together for bucketing.
    pub window: usize,
    pub seed: u64,
}

impl Default for PackerConfig {
    fn default() -> Self {
        PackerConfig {
            token_budget: 8192,
            max_batch: 64,
            window: 1024,
            seed: 0,
        }
    }
}

/// A batch: store indices, sorted by length (longest first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub epoch: u64,
    pub indices: Vec<usize>,
    pub max_len: usize,
    pub real_tokens: usize,
}

impl Batch {
    pub fn padded_tokens(&self) -> usize {
        self.max_len * self.indices.len()
    }
}

/// Resumable position of a packer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PackerState {
    /// The sampler where the current window started.
    pub window_start: SamplerState,
    /// Batches of that window already handed out.
    pub batches_done: usize,
}

/// Running totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackerStats {
    pub batches: u64,
    pub real_tokens: u64,
    pub padded_tokens: u64,
}

impl PackerStats {
    pub fn padding_fraction(&self) -> f64 {
        if self.padded_tokens == 0 {
            0.0
        } else {
            1.0 - self.real_tokens as f64 / self.padded_tokens as f64
        }
    }
}

/// An endless stream of batches over the store, epoch after epoch.
pub struct Packer {
    store: Arc<TokenStore>,
    config: PackerConfig,
    sampler: EpochSampler,
    window_start: SamplerState,
    window: VecDeque<Batch>,
    batches_done: usize,
    pub stats: PackerStats,
}

/// Cuts indices (sorted by length, longest first) into batches within the budget.
pub fn bucket(
    store: &TokenStore,
    sorted: &[usize],
    config: &PackerConfig,
    epoch: u64,
) -> Vec<Batch> {
    let mut batches = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut longest = 0;
    let mut real = 0;
    for &i in sorted {
        let len = store.sample_len(i);
        let new_longest = longest.max(len);
        if !current.is_empty()
            && (new_longest * (current.len() + 1) > config.token_budget
                || current.len() >= config.max_batch)
        {
            batches.push(Batch {
                epoch,
                indices: std::mem::take(&mut current),
                max_len: longest,
                real_tokens: real,
            });
            longest = 0;
            real = 0;
        }
        longest = longest.max(len);
        real += len;
        current.push(i);
    }
    if !current.is_empty() {
        batches.push(Batch {
            epoch,
            indices: current,
            max_len: longest,
            real_tokens: real,
        });
    }
    batches
}

impl Packer {
    pub fn new(store: Arc<TokenStore>, config: PackerConfig) -> Self {
        Self::at_window(store, config, SamplerState::default())
    }

    /// The stream at the start of the window that starts at `window_start`.
    fn at_window(store: Arc<TokenStore>, config: PackerConfig, window_start: SamplerState) -> Self {
        let sampler = EpochSampler::resume(store.len(), config.seed, window_start);
        Packer {
            store,
            config,
            sampler,
            window_start,
            window: VecDeque::new(),
            batches_done: 0,
            stats: PackerStats::default(),
        }
    }

    /// The stream at a saved position: the window that started at `state.window_start`, less
    /// its first `state.batches_done` batches. A position that the data cannot have produced
    /// (more batches done than the window holds) is an error.
    pub fn resume(
        store: Arc<TokenStore>,
        config: PackerConfig,
        state: PackerState,
    ) -> anyhow::Result<Self> {
        let mut packer = Self::at_window(store, config, state.window_start);
        if state.batches_done > 0 {
            packer.fill_window();
            if state.batches_done > packer.window.len() {
                anyhow::bail!(
                    "packer.batches_done = {} but the data window it counts in holds {} batches (a state of other data or other batching)",
                    state.batches_done,
                    packer.window.len()
                );
            }
            packer.window.drain(..state.batches_done);
            packer.batches_done = state.batches_done;
        }
        Ok(packer)
    }

    pub fn state(&self) -> PackerState {
        PackerState {
            window_start: self.window_start,
            batches_done: self.batches_done,
        }
    }

    pub fn store(&self) -> &Arc<TokenStore> {
        &self.store
    }

    fn fill_window(&mut self) {
        if self.sampler.is_empty() {
            return;
        }
        let mut taken = Vec::with_capacity(self.config.window);
        while taken.len() < self.config.window.max(1) {
            match self.sampler.next_in_epoch() {
                Some(i) => taken.push(i),
                None if taken.is_empty() => {
                    self.sampler.next_epoch();
                    self.window_start = self.sampler.state();
                }
                None => break,
            }
        }
        let epoch = self.window_start.epoch;
        let store = &self.store;
        taken.sort_by_key(|&i| std::cmp::Reverse(store.sample_len(i)));
        let mut batches = bucket(store, &taken, &self.config, epoch);
        let mut rng = ChaCha8Rng::seed_from_u64(
            self.config.seed ^ (epoch << 32) ^ self.window_start.position as u64,
        );
        batches.shuffle(&mut rng);
        self.window = batches.into();
        self.batches_done = 0;
    }
}

impl Iterator for Packer {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        if self.window.is_empty() {
            self.window_start = self.sampler.state();
            self.fill_window();
        }
        let batch = self.window.pop_front()?;
        self.batches_done += 1;
        self.stats.batches += 1;
        self.stats.real_tokens += batch.real_tokens as u64;
        self.stats.padded_tokens += batch.padded_tokens() as u64;
        Some(batch)
    }
}

/// A batch as CPU tensors, right-padded with token 0 and mask 0.
#[derive(Debug)]
pub struct CollatedBatch {
    /// [B, L] int64
    pub input_ids: Tensor,
    /// [B, L] int64 (0/1)
    pub loss_mask: Tensor,
    /// real length of each row
    pub lengths: Vec<usize>,
}

/// Lays a batch out as padded tensors. (Pinned memory is not used: tch's `pin_memory` passes
/// a device argument that libtorch 2.11 deprecates with a warning per call, and the id tensors
/// are small next to the features, which stay on the GPU.)
pub fn collate(store: &TokenStore, batch: &Batch) -> CollatedBatch {
    let (b, l) = (batch.indices.len(), batch.max_len);
    let mut ids = vec![0i64; b * l];
    let mut mask = vec![0i64; b * l];
    let mut lengths = Vec::with_capacity(b);
    for (r, &i) in batch.indices.iter().enumerate() {
        let s = store.get(i);
        for (c, (&t, &m)) in s.input_ids.iter().zip(s.loss_mask).enumerate() {
            ids[r * l + c] = t as i64;
            mask[r * l + c] = m as i64;
        }
        lengths.push(s.input_ids.len());
    }
    let shape = [b as i64, l as i64];
    let input_ids = Tensor::from_slice(&ids).view(shape);
    let loss_mask = Tensor::from_slice(&mask).view(shape);
    debug_assert_eq!(input_ids.kind(), Kind::Int64);
    CollatedBatch {
        input_ids,
        loss_mask,
        lengths,
    }
}
