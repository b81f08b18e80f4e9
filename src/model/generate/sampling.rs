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
        let (sorted, order) = probs.sort(-1, true);
        let kept = if sampling.top_p < 1.0 {
            // Keep a token while the mass before it is below top_p (the first always).
            let before = sorted.cumsum(-1, Kind::Float) - &sorted;
            &sorted * before.lt(sampling.top_p).to_kind(Kind::Float)
        } else {
            sorted
        };
        let cum = kept.cumsum(-1, Kind::Float);
        let total = cum.narrow(1, vocab - 1, 1);
        let u = Tensor::from_slice(uniforms)
            .to_kind(Kind::Float)
            .to_device(logits.device())
            .unsqueeze(1);
        // Inverse CDF: the first sorted token whose cumulative mass reaches u * total.
        let at = cum
            .lt_tensor(&(u * total))
            .sum_dim_intlist(-1, true, Kind::Int64)
            .clamp_max(vocab - 1);
        order.gather(1, &at, false).squeeze_dim(1)
    };
    let chosen = chosen.to_kind(Kind::Int64).to_device(tch::Device::Cpu);
    let ids = Vec::<i64>::try_from(&chosen).context("cannot read the chosen tokens")?;
    Ok(ids.into_iter().map(|t| t as u32).collect())
}
