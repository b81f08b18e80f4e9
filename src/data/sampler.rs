//! Seeded per-epoch shuffles that can resume from (epoch, position).

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Where a sampler stands: the next sample is `order(epoch)[position]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SamplerState {
    pub epoch: u64,
    pub position: usize,
}

/// Visits every sample once per epoch in an order that depends only on (seed, epoch).
#[derive(Debug, Clone)]
pub struct EpochSampler {
    seed: u64,
    state: SamplerState,
    order: Vec<u32>,
}

/// The permutation of `len` samples for one epoch.
pub(crate) fn epoch_order(len: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..len as u32).collect();
    // Mixing the epoch into the seed keeps epochs independent and reproducible.
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    order
}

impl EpochSampler {
    pub fn new(len: usize, seed: u64) -> Self {
        Self::resume(len, seed, SamplerState::default())
    }

    pub fn resume(len: usize, seed: u64, state: SamplerState) -> Self {
        EpochSampler {
            seed,
            state,
            order: epoch_order(len, seed, state.epoch),
        }
    }

    pub fn state(&self) -> SamplerState {
        self.state
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The next sample of the current epoch, or `None` at its end.
    pub fn next_in_epoch(&mut self) -> Option<usize> {
        let i = *self.order.get(self.state.position)? as usize;
        self.state.position += 1;
        Some(i)
    }

    /// Starts the next epoch.
    pub(crate) fn next_epoch(&mut self) {
        self.state = SamplerState {
            epoch: self.state.epoch + 1,
            position: 0,
        };
        self.order = epoch_order(self.order.len(), self.seed, self.state.epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_are_permutations_that_differ_and_resume_exactly() {
        let mut s = EpochSampler::new(100, 7);
        let e0: Vec<usize> = std::iter::from_fn(|| s.next_in_epoch()).collect();
        let mut sorted = e0.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        s.next_epoch();
        let first_half: Vec<usize> = (0..50).map(|_| s.next_in_epoch().unwrap()).collect();
        let state = s.state();
        let rest: Vec<usize> = std::iter::from_fn(|| s.next_in_epoch()).collect();
        assert_ne!(e0[..50], first_half[..]);
        let mut resumed = EpochSampler::resume(100, 7, state);
        let again: Vec<usize> = std::iter::from_fn(|| resumed.next_in_epoch()).collect();
        assert_eq!(again, rest);
        assert_ne!(epoch_order(100, 8, 0), epoch_order(100, 7, 0));
    }
}
