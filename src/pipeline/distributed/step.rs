//! What the ranks exchange at each optimiser step: which batches of the global step each one
//! trains ([`StepShare`]), the one summed bucket of gradients and the step's numbers
//! ([`sum_step`]), and rank 0's decision at the step boundary ([`Control`]).

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use super::ProcessGroup;

/// Which batches of each global optimiser step this process trains: the packer's one stream
/// is cut into steps of `global` batches, and this process takes `count` of them from
/// `first` on (rank r of a world of W, each with the same replicas: `first = r * count`,
/// `global = W * count`). A single process takes them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShare {
    pub global: usize,
    pub first: usize,
    pub count: usize,
}

impl StepShare {
    pub fn whole(count: usize) -> StepShare {
        StepShare {
            global: count,
            first: 0,
            count,
        }
    }

    pub fn of_rank(rank: usize, world: usize, count: usize) -> StepShare {
        StepShare {
            global: world * count,
            first: rank * count,
            count,
        }
    }

    /// Whether the batch at `position` (0..global) of a step is this process's.
    pub fn takes(&self, position: usize) -> bool {
        (self.first..self.first + self.count).contains(&position)
    }
}

/// Sums the flat fp32 gradient (one bucket) and then the step's numbers (loss sums, tokens,
/// samples) over every rank, in rank order ([`ProcessGroup::ordered_sum`]: the single
/// process's order, so its weights bit for bit). Each rank's gradient is already scaled to its
/// share of the global step's mean, so the sum is that mean. Returns the summed loss sums (on
/// the CPU) and counts.
pub fn sum_step(
    group: &ProcessGroup,
    grad: &mut Tensor,
    sums: &Tensor,
    tokens: u64,
    samples: u64,
) -> Result<(Tensor, u64, u64)> {
    group.ordered_sum(grad)?;
    let counts = Tensor::from_slice(&[tokens as f64, samples as f64]);
    let mut numbers = Tensor::cat(&[sums.to_device(Device::Cpu), counts], 0);
    group.ordered_sum(&mut numbers)?;
    let n = numbers.size()[0];
    let v = Vec::<f64>::try_from(&numbers.narrow(0, n - 2, 2))?;
    Ok((numbers.narrow(0, 0, n - 2), v[0] as u64, v[1] as u64))
}

/// What rank 0 decided at a step boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Every rank trains the next step.
    Train,
    /// The run is paused: every rank holds, and hears from rank 0 again within a second.
    Paused,
    /// The run ends here (rank 0 saved what it was asked to save).
    Stop,
}

/// Rank 0's word to every rank at a step boundary: the decision and the settings every rank
/// mirrors (queue depths, profile interval), so that a command acts on all ranks at the same
/// step boundary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Control {
    pub decision: Decision,
    pub batch_depth: usize,
    pub feature_depth: usize,
    pub profile_interval_s: f64,
}

impl Control {
    fn encode(&self) -> [f64; 4] {
        let d = match self.decision {
            Decision::Train => 0.0,
            Decision::Paused => 1.0,
            Decision::Stop => 2.0,
        };
        [
            d,
            self.batch_depth as f64,
            self.feature_depth as f64,
            self.profile_interval_s,
        ]
    }

    fn decode(v: &[f64]) -> Result<Control> {
        let decision = match v.first().copied() {
            Some(0.0) => Decision::Train,
            Some(1.0) => Decision::Paused,
            Some(2.0) => Decision::Stop,
            other => bail!("rank 0 sent an unknown decision {other:?}"),
        };
        if v.len() != 4 {
            bail!("rank 0's control word has {} numbers, not 4", v.len());
        }
        Ok(Control {
            decision,
            batch_depth: v[1] as usize,
            feature_depth: v[2] as usize,
            profile_interval_s: v[3],
        })
    }

    /// Rank 0 sends `mine`; every other rank passes `None` and gets rank 0's.
    pub fn exchange(group: &ProcessGroup, mine: Option<Control>) -> Result<Control> {
        let words = mine.map_or([0.0; 4], |c| c.encode());
        let mut t = Tensor::from_slice(&words).to_kind(Kind::Double);
        group.broadcast(&mut t, 0)?;
        Control::decode(&Vec::<f64>::try_from(&t)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cut_each_global_step_in_rank_order() {
        let shares: Vec<StepShare> = (0..3).map(|r| StepShare::of_rank(r, 3, 2)).collect();
        for p in 0..6 {
            let takers: Vec<usize> = (0..3).filter(|&r| shares[r].takes(p)).collect();
            assert_eq!(takers, vec![p / 2], "position {p}");
        }
        assert!((0..4).all(|p| StepShare::whole(4).takes(p)));
    }

    #[test]
    fn control_words_round_trip_and_garbage_is_refused() {
        for decision in [Decision::Train, Decision::Paused, Decision::Stop] {
            let c = Control {
                decision,
                batch_depth: 7,
                feature_depth: 3,
                profile_interval_s: 2.5,
            };
            assert_eq!(Control::decode(&c.encode()).unwrap(), c);
        }
        assert!(Control::decode(&[9.0, 1.0, 1.0, 0.0]).is_err());
        assert!(Control::decode(&[0.0, 1.0]).is_err());
    }
}
