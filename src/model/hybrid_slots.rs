//! A hybrid target's layers over a [`SlotCache`]: gated attention through the cache's keys and
//! values (libtorch's projections and rotation, the cache's fused slot kernels assuming the
//! plain layout; the norms by the model's own fused kernels on a GPU),
//! Gated DeltaNet layers through the cache's per-slot states ([`SlotStates`]). Uniform batches
//! (decoding steps) are device operations only, so that a CUDA graph can capture them; packed
//! batches (prefills) run the chunked rule per sequence.

use anyhow::{Context, Result};
use tch::Tensor;

use super::gated_delta::GdnState;
use super::hybrid::{GatedDeltaNet, HybridLayer, Mixer};
use super::slot_states::SlotStates;
use super::slots::{SlotBatch, SlotCache};
use crate::aten_ext::fused::FusedKernels;

/// Where a hybrid layer's token mixing keeps its cache: which key/value layer of the cache (an
/// attention layer) or which state layer (a Gated DeltaNet one). Counted in layer order.
#[derive(Debug, Default)]
pub(crate) struct MixerOrdinals {
    attention: usize,
    delta_net: i64,
}

impl HybridLayer {
    /// The layer over the new tokens of `batch`: `x` [1, n, H] in place, at the rotary angles
    /// `rope` (cos, signed sin, [n, rotary]); its keys and values or states go to `cache`. The
    /// norms and SwiGLU's product by the model's fused `kernels`, as in its other forwards.
    pub(crate) fn forward_slots(
        &self,
        x: &mut Tensor,
        ordinals: &mut MixerOrdinals,
        (cos, sin): (&Tensor, &Tensor),
        batch: &SlotBatch,
        cache: &mut SlotCache,
        kernels: Option<&FusedKernels>,
    ) -> Result<()> {
        let h = self.input_norm.forward(x, kernels);
        match &self.mixer {
            Mixer::Attention(attn) => {
                let [q, k, v, projected] = attn.project(&h, cos, sin, kernels);
                let a = cache.attend(ordinals.attention, &q, &k, &v, batch, true)?;
                attn.add_output(x, &a, &projected, kernels);
                ordinals.attention += 1;
            }
            Mixer::DeltaNet(net) => {
                let states = cache
                    .states()
                    .context("a hybrid target's slot cache without Gated DeltaNet states")?;
                *x += delta_net_slots(net, &h, ordinals.delta_net, batch, states)?;
                ordinals.delta_net += 1;
            }
        }
        self.add_mlp(x, kernels);
        Ok(())
    }
}

/// Gated DeltaNet layer `layer` (of the states) over the normed new tokens `h` [1, n, H]:
/// each sequence continues its slot's states (zeros from position 0), which then hold the
/// state after its last token; a uniform step within the kept block also keeps the states
/// after each token. Returns the output [1, n, H].
fn delta_net_slots(
    net: &GatedDeltaNet,
    h: &Tensor,
    layer: i64,
    batch: &SlotBatch,
    states: &SlotStates,
) -> Result<Tensor> {
    let width = h.size()[2];
    if let Some((b, t)) = batch.uniform_shape() {
        let x = h.view([b, t, width]);
        let state = states.uniform_in(layer, b, &batch.start);
        let (out, last) = if states.keeps(t) {
            let (out, each) = net.step_kept(&x, Some(&state), None);
            states.write_steps(layer, &each);
            let last = GdnState {
                conv: each.conv.select(1, t - 1),
                recurrent: each.recurrent.select(1, t - 1),
            };
            (out, last)
        } else {
            net.step(&x, Some(&state), None)
        };
        states.write_uniform(layer, &last, batch.live.as_ref());
        return Ok(out.view([1, b * t, width]));
    }
    let spans = batch
        .spans()
        .context("a batch neither uniform nor packed")?;
    let mut outs = Vec::with_capacity(spans.len());
    let mut offset = 0;
    for s in spans {
        let part = h.narrow(1, offset, s.len);
        let state = states.slot_in(layer, s.slot, s.start);
        let (out, new) = net.step(&part, state.as_ref(), None);
        states.write_slot(layer, s.slot, &new);
        outs.push(out);
        offset += s.len;
    }
    Ok(Tensor::cat(&outs, 1))
}

#[cfg(test)]
#[path = "hybrid_slots_tests.rs"]
mod tests;
