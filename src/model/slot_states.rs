//! The Gated DeltaNet states of a hybrid target's [`SlotCache`](super::SlotCache): per layer and
//! slot the conv window (the last `kernel - 1` inputs of the causal convolution) and the
//! recurrent state, allocated once for every slot, beside the keys and values of the attention
//! layers.
//!
//! A key/value cache rolls back by forgetting rows; a recurrent state cannot be undone. So a
//! cache that verifies drafts keeps the states after every token of its latest multi-token step
//! ([`SlotStates::keep_steps`]), and the decoding engine then selects the accepted prefix's with
//! [`SlotStates::commit_accepted`]: one gather over every layer, on the device, with no host
//! read (usable in or right after a CUDA graph).

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use super::gated_delta::GdnState;
use super::hybrid_config::GdnShape;

/// The states of every Gated DeltaNet layer of a slot cache.
#[derive(Debug)]
pub struct SlotStates {
    /// [layers, slots, conv_dim, kernel - 1], the model's dtype.
    conv: Tensor,
    /// [layers, slots, value_heads, key_dim, value_dim], float32.
    recurrent: Tensor,
    /// The states after each token of the latest step (see [`SlotStates::keep_steps`]).
    steps: Option<StepStates>,
    slots: i64,
}

/// A copy of [`SlotStates`]' conv and recurrent states (not the per-token ones), to put back
/// with [`SlotStates::restore`].
#[derive(Debug)]
pub(crate) struct SavedStates {
    conv: Tensor,
    recurrent: Tensor,
}

/// [layers, slots, block, ...]: the states after tokens 1..=block of a step, per slot.
#[derive(Debug)]
struct StepStates {
    block: i64,
    conv: Tensor,
    recurrent: Tensor,
}

impl SlotStates {
    /// Zeroed states of `layers` layers of `shape` for `slots` slots.
    pub(crate) fn new(
        layers: i64,
        slots: i64,
        shape: GdnShape,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let [conv, recurrent] = Self::sizes(shape);
        let lead = [layers, slots];
        Ok(SlotStates {
            conv: Tensor::f_zeros([&lead[..], &conv[..]].concat(), (kind, device))?,
            recurrent: Tensor::f_zeros(
                [&lead[..], &recurrent[..]].concat(),
                (Kind::Float, device),
            )?,
            steps: None,
            slots,
        })
    }

    /// One slot's conv and recurrent state shapes.
    fn sizes(s: GdnShape) -> [Vec<i64>; 2] {
        [
            vec![s.conv_dim(), s.conv_kernel - 1],
            vec![s.value_heads, s.key_dim, s.value_dim],
        ]
    }

    /// Bytes of the states of `layers` layers for `slots` slots, and of the per-token states
    /// of steps of up to `block` tokens on top (0: none kept).
    pub fn bytes(layers: i64, slots: i64, shape: GdnShape, kind: Kind, block: i64) -> i64 {
        let [conv, recurrent] = Self::sizes(shape);
        let one = conv.iter().product::<i64>() * kind.elt_size_in_bytes() as i64
            + recurrent.iter().product::<i64>() * 4;
        layers * slots * one * (1 + block)
    }

    /// Keeps from now on the states after each token of steps of up to `block` tokens (a
    /// DFlash verify block), which [`SlotStates::commit_accepted`] selects from. Allocated once
    /// (again only for a larger block: the caller then drops CUDA graphs that wrote the old
    /// buffers); returns whether it allocated.
    pub(crate) fn keep_steps(&mut self, block: i64) -> Result<bool> {
        if self.steps.as_ref().is_some_and(|s| s.block >= block) {
            return Ok(false);
        }
        let with_block = |t: &Tensor, kind: Kind| {
            let mut size = t.size();
            size.insert(2, block);
            Tensor::f_zeros(size, (kind, t.device()))
        };
        self.steps = Some(StepStates {
            block,
            conv: with_block(&self.conv, self.conv.kind())?,
            recurrent: with_block(&self.recurrent, Kind::Float)?,
        });
        Ok(true)
    }

    /// Whether a step of `tokens` tokens keeps the state after each of them.
    pub(crate) fn keeps(&self, tokens: i64) -> bool {
        self.steps.as_ref().is_some_and(|s| tokens <= s.block)
    }

    /// Layer `layer`'s states of slots 0..b as a step starting at positions `start` [b] reads
    /// them: zeros where a sequence starts at 0 (a new one in a reused slot).
    pub(crate) fn uniform_in(&self, layer: i64, b: i64, start: &Tensor) -> GdnState {
        let fresh = start.eq(0);
        let take = |all: &Tensor| {
            let t = all.select(0, layer).narrow(0, 0, b);
            let mut size = vec![b];
            size.extend(std::iter::repeat_n(1, t.dim() - 1));
            t.masked_fill(&fresh.view(size.as_slice()), 0.0)
        };
        GdnState {
            conv: take(&self.conv),
            recurrent: take(&self.recurrent),
        }
    }

    /// Stores `new` [b, ...] as layer `layer`'s states of slots 0..b; with `live` [b] (bool),
    /// only for the sequences it marks (idle slots of a decoding batch keep theirs).
    pub(crate) fn write_uniform(&self, layer: i64, new: &GdnState, live: Option<&Tensor>) {
        let store = |all: &Tensor, new: &Tensor| {
            let b = new.size()[0];
            let mut held = all.select(0, layer).narrow(0, 0, b);
            let value = match live {
                Some(live) => {
                    let mut size = vec![b];
                    size.extend(std::iter::repeat_n(1, new.dim() - 1));
                    new.to_kind(held.kind())
                        .where_self(&live.view(size.as_slice()), &held)
                }
                None => new.to_kind(held.kind()),
            };
            held.copy_(&value);
        };
        store(&self.conv, &new.conv);
        store(&self.recurrent, &new.recurrent);
    }

    /// Keeps layer `layer`'s states after each token of a step of slots 0..b: `each` conv
    /// [b, T, ...] and recurrent [b, T, ...] (T within the kept block).
    pub(crate) fn write_steps(&self, layer: i64, each: &GdnState) {
        let Some(steps) = &self.steps else {
            return;
        };
        let store = |all: &Tensor, new: &Tensor| {
            let (b, t) = (new.size()[0], new.size()[1]);
            let mut held = all.select(0, layer).narrow(0, 0, b).narrow(1, 0, t);
            held.copy_(new);
        };
        store(&steps.conv, &each.conv);
        store(&steps.recurrent, &each.recurrent);
    }

    /// Layer `layer`'s states of slot `slot` (host-known; prefills), None (zeros) for a
    /// sequence starting at position 0.
    pub(crate) fn slot_in(&self, layer: i64, slot: i64, start: i64) -> Option<GdnState> {
        let take = |all: &Tensor| all.select(0, layer).narrow(0, slot, 1);
        (start > 0).then(|| GdnState {
            conv: take(&self.conv),
            recurrent: take(&self.recurrent),
        })
    }

    /// Stores `state` [1, ...] as layer `layer`'s states of slot `slot`.
    pub(crate) fn write_slot(&self, layer: i64, slot: i64, state: &GdnState) {
        let store = |all: &Tensor, new: &Tensor| {
            let mut held = all.select(0, layer).narrow(0, slot, 1);
            held.copy_(new);
        };
        store(&self.conv, &state.conv);
        store(&self.recurrent, &state.recurrent);
    }

    /// After a step that kept its per-token states: sets every layer's states of the slots
    /// `slots` [b] (int64, on the states' device) to those after their first `accepted[i]`
    /// tokens of that step ([b] int64, each in 1..=the step's tokens; what a speculative
    /// verify accepted, the target's token included). Device operations only (two gathers and
    /// two scatters for all layers): no host read, capturable in a CUDA graph.
    pub fn commit_accepted(&self, slots: &Tensor, accepted: &Tensor) -> Result<()> {
        let Some(steps) = &self.steps else {
            bail!("this cache keeps no per-token states to commit from (SlotStates::keep_steps)");
        };
        let index = slots * steps.block + accepted - 1;
        let commit = |all: &Tensor, kept: &Tensor| {
            let size = kept.size();
            let mut flat = vec![size[0], self.slots * steps.block];
            flat.extend_from_slice(&size[3..]);
            let picked = kept.view(flat.as_slice()).index_select(1, &index);
            let mut all = all.shallow_clone();
            let _ = all.index_copy_(1, slots, &picked);
        };
        commit(&self.conv, &steps.conv);
        commit(&self.recurrent, &steps.recurrent);
        Ok(())
    }

    /// A copy of every slot's states. The per-token states are left out: only the latest step
    /// is read from them, and it rewrites them.
    pub(crate) fn save(&self) -> Result<SavedStates> {
        let copy = |t: &Tensor| -> Result<Tensor> {
            let mut c = t.f_empty_like()?;
            c.f_copy_(t)?;
            Ok(c)
        };
        Ok(SavedStates {
            conv: copy(&self.conv)?,
            recurrent: copy(&self.recurrent)?,
        })
    }

    /// Puts back the states `saved` from these states.
    pub(crate) fn restore(&self, saved: &SavedStates) {
        self.conv.shallow_clone().copy_(&saved.conv);
        self.recurrent.shallow_clone().copy_(&saved.recurrent);
    }

    /// Layer `layer`'s states of slot `slot` (a copy; tests and checks).
    pub fn slot_state(&self, layer: i64, slot: i64) -> GdnState {
        let take = |all: &Tensor| all.select(0, layer).narrow(0, slot, 1).copy();
        GdnState {
            conv: take(&self.conv),
            recurrent: take(&self.recurrent),
        }
    }

    /// Number of layers.
    pub fn layers(&self) -> i64 {
        self.conv.size()[0]
    }
}
