//! The decoding cache of [`super::TargetModel::run`]: keys and values of the attention layers,
//! and the conv and recurrent states of a hybrid target's Gated DeltaNet layers.

use anyhow::{bail, Result};
use tch::Tensor;

use super::gated_delta::GdnState;

/// Keys and values of past positions, per attention layer: [batch, kv_heads, len, head_dim];
/// per Gated DeltaNet layer its [`GdnState`] after the last position.
///
/// By default every append concatenates (the cache grows one copy at a time). A cache made with
/// [`KvCache::with_capacity`] writes into buffers allocated once for that many positions, which
/// long batched decoding needs; it falls back to concatenation past its capacity.
///
/// Rolling back: keys and values are cut, but a recurrent state cannot be undone. A hybrid
/// cache therefore returns only to lengths at which it kept the states: those saved with
/// [`KvCache::save_states`], or, with [`KvCache::keep_step_states`] on, every length within
/// the latest forward (the state before it and after each of its tokens: what speculative
/// verification rejects into). [`KvCache::truncate`] to any other length is an error.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer, the preallocated buffers whose first positions `layers` views.
    buffers: Vec<Option<(Tensor, Tensor)>>,
    capacity: i64,
    pub(crate) len: i64,
    /// Per layer, a Gated DeltaNet layer's states (None for attention layers).
    states: Vec<Option<GdnState>>,
    /// States kept at earlier lengths, in increasing length: where `truncate` may return to.
    saved: Vec<(i64, Vec<Option<GdnState>>)>,
    keep_step_states: bool,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache that preallocates room for `positions` positions per layer on the first append.
    pub fn with_capacity(positions: i64) -> Self {
        KvCache {
            capacity: positions.max(0),
            ..Self::default()
        }
    }

    /// Number of cached positions.
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rolls back to the first `len` positions (used when draft tokens are rejected). A cache
    /// with Gated DeltaNet states returns only to a length whose states it kept (see the
    /// type's documentation); to any other it is left as it was and an error says so.
    pub fn truncate(&mut self, len: i64) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        let len = len.max(0);
        if self.has_recurrent_state() {
            let Some(at) = self.saved.iter().position(|(n, _)| *n == len) else {
                let kept: Vec<i64> = self.saved.iter().map(|(n, _)| *n).collect();
                bail!(
                    "cannot roll a hybrid (Gated DeltaNet) cache back from {} to {len} positions: its recurrent states were kept only at {kept:?} (KvCache::save_states, or keep_step_states before the step)",
                    self.len
                );
            };
            self.states = clone_states(&self.saved[at].1);
            self.saved.truncate(at + 1);
        }
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.narrow(2, 0, len);
            *v = v.narrow(2, 0, len);
        }
        self.len = len;
        Ok(())
    }

    /// Whether the cache holds Gated DeltaNet states (a hybrid target's).
    pub fn has_recurrent_state(&self) -> bool {
        self.states.iter().any(Option::is_some)
    }

    /// Keeps the Gated DeltaNet states of the current length, so that [`KvCache::truncate`]
    /// can return here (a shallow copy: states are replaced, never written in place).
    pub fn save_states(&mut self) {
        self.saved.retain(|(n, _)| *n < self.len);
        self.saved.push((self.len, clone_states(&self.states)));
    }

    /// With `on`, every later forward keeps the states before it and after each of its tokens
    /// (replacing what was kept before: a rollback reaches back within the latest forward).
    /// Its Gated DeltaNet layers then run token by token: for short steps, not prefills.
    pub fn keep_step_states(&mut self, on: bool) {
        self.keep_step_states = on;
    }

    pub(crate) fn keeps_step_states(&self) -> bool {
        self.keep_step_states
    }

    /// The states of Gated DeltaNet layer `layer` (None before its first forward).
    pub(crate) fn gdn_state(&self, layer: usize) -> Option<&GdnState> {
        self.states.get(layer).and_then(Option::as_ref)
    }

    pub(crate) fn set_gdn_state(&mut self, layer: usize, state: GdnState) {
        if self.states.len() <= layer {
            self.states.resize_with(layer + 1, || None);
        }
        self.states[layer] = Some(state);
    }

    /// A shallow copy of every layer's states, e.g. before a forward.
    pub(crate) fn states_now(&self) -> Vec<Option<GdnState>> {
        clone_states(&self.states)
    }

    /// After a forward of `steps` tokens from length `start` with [`KvCache::keep_step_states`]:
    /// keeps `before` (the states at `start`) and, per layer, the states after each token.
    pub(crate) fn record_steps(
        &mut self,
        start: i64,
        before: Vec<Option<GdnState>>,
        per_layer: Vec<(usize, Vec<GdnState>)>,
        steps: i64,
    ) {
        let layers = self.states.len().max(before.len());
        let mut saved = vec![(start, before)];
        for t in 0..steps {
            let mut states: Vec<Option<GdnState>> = (0..layers).map(|_| None).collect();
            for (layer, each) in &per_layer {
                if let (Some(slot), Some(s)) = (states.get_mut(*layer), each.get(t as usize)) {
                    *slot = Some(s.shallow_clone());
                }
            }
            saved.push((start + t + 1, states));
        }
        self.saved = saved;
    }

    /// Keeps only the batch rows `rows` (int64 indices, in this order), e.g. to drop sequences
    /// that finished decoding from a batch.
    pub fn select_rows(&mut self, rows: &Tensor) {
        let pick = |t: &Tensor| t.index_select(0, &rows.to_device(t.device()));
        if self.buffers.len() < self.layers.len() {
            self.buffers.resize_with(self.layers.len(), || None);
        }
        for (layer, buffer) in self.layers.iter_mut().zip(self.buffers.iter_mut()) {
            let Some((k, v)) = layer.as_mut() else {
                continue;
            };
            match buffer.as_mut() {
                Some((bk, bv)) => {
                    let n = k.size()[2];
                    *bk = pick(bk);
                    *bv = pick(bv);
                    *k = bk.narrow(2, 0, n);
                    *v = bv.narrow(2, 0, n);
                }
                None => {
                    *k = pick(k);
                    *v = pick(v);
                }
            }
        }
        let select = |states: &[Option<GdnState>]| -> Vec<Option<GdnState>> {
            states
                .iter()
                .map(|s| s.as_ref().map(|s| s.select_rows(rows)))
                .collect()
        };
        self.states = select(&self.states);
        for (_, states) in self.saved.iter_mut() {
            *states = select(states);
        }
    }

    /// Appends keys and values of new positions to a layer; returns all of that layer's.
    pub(crate) fn append(&mut self, layer: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        if self.capacity > 0 {
            if self.buffers.len() <= layer {
                self.buffers.resize_with(layer + 1, || None);
            }
            let n = k.size()[2];
            let held = self.layers[layer].as_ref().map(|(pk, _)| pk.size()[2]);
            if held.is_none() {
                // First append: allocate the buffers.
                let alloc = |t: &Tensor| {
                    let mut shape = t.size();
                    shape[2] = self.capacity.max(n);
                    Tensor::zeros(&shape[..], (t.kind(), t.device()))
                };
                self.buffers[layer] = Some((alloc(&k), alloc(&v)));
            }
            let start = held.unwrap_or(0);
            if let Some((bk, bv)) = self.buffers[layer].as_ref() {
                if start + n <= bk.size()[2] {
                    bk.narrow(2, start, n).copy_(&k);
                    bv.narrow(2, start, n).copy_(&v);
                    let merged = (bk.narrow(2, 0, start + n), bv.narrow(2, 0, start + n));
                    self.layers[layer] = Some((merged.0.shallow_clone(), merged.1.shallow_clone()));
                    return merged;
                }
            }
            // Past the capacity: concatenate from here on.
            self.buffers[layer] = None;
        }
        let merged = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[pk, k], 2), Tensor::cat(&[pv, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some((merged.0.shallow_clone(), merged.1.shallow_clone()));
        merged
    }
}

fn clone_states(states: &[Option<GdnState>]) -> Vec<Option<GdnState>> {
    states
        .iter()
        .map(|s| s.as_ref().map(GdnState::shallow_clone))
        .collect()
}
