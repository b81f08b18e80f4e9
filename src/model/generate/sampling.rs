//! How the next token is chosen from the logits, the same way in every generation engine:
//! greedy, or temperature / top-p sampling with one uniform draw per token.

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax); above 0, sample from softmax(logits / temperature).
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens whose mass reaches `top_p` (1 = all).
    pub top_p: f64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
    };

    pub(crate) fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// Next tokens of every batch row from `logits` [rows, vocab] (float32). `uniforms` holds one
/// draw in [0, 1) per row when sampling.
pub(super) fn pick(logits: &Tensor, sampling: &Sampling, uniforms: &[f64]) -> Result<Vec<u32>> {
    let chosen = if sampling.is_greedy() {
        logits.argmax(-1, false)
    } else {
        let vocab = logits.size()[1];
        let probs = (logits / sampling.temperature).softmax(-1, Kind::Float);
        // The inverse CDF below works in any fixed order of the vocabulary: nucleus sampling
        // needs the tokens by falling probability, plain sampling takes them as they are (a
        // sort of every row, the costliest part of a sampled step, saved).
        let (weights, order) = if sampling.top_p < 1.0 {
            let (sorted, order) = probs.sort(-1, true);
            // Keep a token while the mass before it is below top_p (the first always).
            let before = sorted.cumsum(-1, Kind::Float) - &sorted;
            let kept = &sorted * before.lt(sampling.top_p).to_kind(Kind::Float);
            (kept, Some(order))
        } else {
            (probs, None)
        };
        let cum = weights.cumsum(-1, Kind::Float);
        let total = cum.narrow(1, vocab - 1, 1);
        let u = Tensor::from_slice(uniforms)
            .to_kind(Kind::Float)
            .to_device(logits.device())
            .unsqueeze(1);
        // Inverse CDF: the first token (in that order) whose cumulative mass reaches u * total.
        let at = cum
            .lt_tensor(&(u * total))
            .sum_dim_intlist(-1, true, Kind::Int64)
            .clamp_max(vocab - 1);
        match order {
            Some(order) => order.gather(1, &at, false).squeeze_dim(1),
            None => at.squeeze_dim(1),
        }
    };
    let chosen = chosen.to_kind(Kind::Int64).to_device(tch::Device::Cpu);
    let ids = Vec::<i64>::try_from(&chosen).context("cannot read the chosen tokens")?;
    Ok(ids.into_iter().map(|t| t as u32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Picks of one row of `probs` for `n` evenly spread uniform draws, counted per token.
    fn counts(probs: &[f64], sampling: Sampling, n: usize) -> Vec<usize> {
        let logits = Tensor::from_slice(probs).log().to_kind(Kind::Float);
        let logits = logits.unsqueeze(0).repeat([n as i64, 1]);
        let uniforms: Vec<f64> = (0..n).map(|i| (i as f64 + 0.5) / n as f64).collect();
        let mut counts = vec![0; probs.len()];
        for t in pick(&logits, &sampling, &uniforms).unwrap() {
            counts[t as usize] += 1;
        }
        counts
    }

    #[test]
    fn evenly_spread_draws_pick_each_token_by_its_probability() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        let plain = Sampling {
            temperature: 1.0,
            top_p: 1.0,
        };
        assert_eq!(counts(&probs, plain, 1000), vec![100, 400, 200, 300]);
        // temperature 0.5 squares the odds: 1, 16, 4, 9 of 30
        let cool = Sampling {
            temperature: 0.5,
            top_p: 1.0,
        };
        assert_eq!(counts(&probs, cool, 300), vec![10, 160, 40, 90]);
        // top_p 0.6: 0.4 then 0.3 (the mass before 0.3 is 0.4 < 0.6; before 0.2 it is 0.7)
        let nucleus = Sampling {
            temperature: 1.0,
            top_p: 0.6,
        };
        assert_eq!(counts(&probs, nucleus, 700), vec![0, 400, 0, 300]);
        let greedy = counts(&probs, Sampling::GREEDY, 5);
        assert_eq!(greedy, vec![0, 5, 0, 0]);
    }
}
