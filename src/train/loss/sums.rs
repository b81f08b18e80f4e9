//! The metrics of micro-batches: sums on the host ([`LossSums`]) and on the device
//! ([`LossTensors`]).

use tch::{Device, Kind, Tensor};

/// Metrics of one micro-batch (sums, so that they can be combined).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    /// sum of w * loss
    pub weighted_loss: f64,
    /// sum of w (decay and mask; streak weights excluded)
    pub weight: f64,
    /// sum of w * correct
    pub weighted_correct: f64,
    /// sum over valid blocks of the accepted-prefix length
    pub accepted: f64,
    pub blocks: f64,
}

impl LossSums {
    pub fn add(&mut self, o: &LossSums) {
        self.weighted_loss += o.weighted_loss;
        self.weight += o.weight;
        self.weighted_correct += o.weighted_correct;
        self.accepted += o.accepted;
        self.blocks += o.blocks;
    }
    pub fn loss(&self) -> f64 {
        self.weighted_loss / self.weight.max(1e-12)
    }
    pub fn accuracy(&self) -> f64 {
        self.weighted_correct / self.weight.max(1e-12)
    }
    /// The anchor-mean acceptance `1 + mean_j sum_k prod_{i<=k} [argmax == label]` (the
    /// spec's `tau_train`): a mean over anchor positions, not the acceptance length decoding
    /// gets (decoding crosses easy stretches in a few long steps and hard ones in many short
    /// ones); see [`crate::train::validation`] for what decoding gets.
    pub fn accept_mean(&self) -> f64 {
        1.0 + self.accepted / self.blocks.max(1.0)
    }
}

/// Metric sums of one or more micro-batches, kept on the device so that no step waits for
/// it: the fields of [`LossSums`] in order (weighted_loss, weight, weighted_correct,
/// accepted, blocks) as a float64 tensor [5]. Add them up over micro-batches and steps with
/// [`LossTensors::add`] and read them with [`LossTensors::to_host`] (one synchronisation)
/// only when the numbers are needed.
#[derive(Debug)]
pub struct LossTensors {
    sums: Tensor,
}

impl LossTensors {
    pub fn zeros(device: Device) -> Self {
        LossTensors {
            sums: Tensor::zeros([5], (Kind::Double, device)),
        }
    }

    /// Sums summed elsewhere (over the processes of a run): the float64 tensor [5].
    pub(crate) fn from_tensor(sums: Tensor) -> Self {
        LossTensors { sums }
    }

    /// The float64 tensor [5] of sums.
    pub fn tensor(&self) -> &Tensor {
        &self.sums
    }

    /// Adds `other` on this one's device (no synchronisation with the host).
    pub fn add(&mut self, other: &LossTensors) {
        let o = other.sums.to_device(self.sums.device());
        self.sums = &self.sums + o;
    }

    /// A copy on the host, queued behind the work the sums depend on without waiting for it
    /// (pinned memory, non-blocking): its values are there once the device has run that work
    /// (wait for an event recorded after this call, or for the device). On the CPU, a copy.
    pub(crate) fn to_host_async(&self) -> LossTensors {
        LossTensors {
            sums: self.sums.to_device_(Device::Cpu, Kind::Double, true, false),
        }
    }

    /// Reads the sums (waits for the device to finish the work they depend on).
    pub fn to_host(&self) -> LossSums {
        let v = Vec::<f64>::try_from(self.sums.to_device(Device::Cpu)).unwrap_or_default();
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        LossSums {
            weighted_loss: at(0),
            weight: at(1),
            weighted_correct: at(2),
            accepted: at(3),
            blocks: at(4),
        }
    }
}
