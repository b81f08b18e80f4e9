//! Streak weighting (spec §3): each trained slot's weight from the confidence of the slots
//! before it in its block.

use tch::{Kind, Tensor};

use super::lm_head::PickedRows;
use super::{cross_entropy_f32, LossOptions};

/// The weight of each row [m]: the base weight, times the streak weight when streak
/// weighting is on. Streak weighting needs every slot's CE before any weight is final: a
/// first pass without gradients.
pub(super) fn row_weights(
    picked: &PickedRows,
    lm_head: &Tensor,
    opts: &LossOptions,
    chunk: i64,
    blocks: i64,
    block: i64,
) -> Tensor {
    if opts.streak_alpha > 0.0 {
        let m = picked.m;
        let ce_all = tch::no_grad(|| {
            let mut parts = Vec::new();
            let mut s = 0;
            while s < m {
                let len = chunk.min(m - s);
                let logits = picked
                    .selected
                    .narrow(0, s, len)
                    .linear::<&Tensor>(lm_head, None);
                parts.push(cross_entropy_f32(&logits, &picked.labels.narrow(0, s, len)));
                s += len;
            }
            Tensor::cat(&parts, 0)
        });
        let ce = ce_all.view([blocks, block - 1]);
        let s = streak_weights(&ce, opts.streak_alpha, opts.streak_tau_power).view([m]);
        &picked.base_w * s
    } else {
        picked.base_w.shallow_clone()
    }
}

/// The streak weights [blocks, block - 1] of blocks from the cross-entropy of their trained
/// slots 1..block [blocks, block - 1]: confidence `q_k = exp(-CE_k)`, `q'_k = (1 - alpha) q_k +
/// alpha`, `C_k = prod_{i<=k} q'_i`, `s_k = sum_{m>=k} C_m` (the spec's streak weighting), then
/// divided by the block's expected acceptance length `tau = 1 + s_1` to the power `tau_power`.
///
/// With alpha 0, `sum_j s_1j` is the anchors' expected accepted length if slots were accepted
/// independently, and its gradient in `log q_jk` is `s_jk`: power 0 follows it. Decoding starts
/// a step at a position about 1 / tau of the time, so the expected number of steps is about
/// `sum_j 1 / tau_j`, whose gradient in `log q_jk` is `-s_jk / tau_j^2`: power 2 follows that,
/// counting the hard positions where decoding spends its steps more.
fn streak_weights(ce: &Tensor, alpha: f64, tau_power: f64) -> Tensor {
    let q = ce.neg().exp() * (1.0 - alpha) + alpha;
    let c = q.cumprod(1, Kind::Float);
    // s_k = sum_{m >= k} C_m: a reversed cumulative sum
    let s = c.flip([1]).cumsum(1, Kind::Float).flip([1]);
    if tau_power > 0.0 {
        let tau = s.narrow(1, 0, 1) + 1.0;
        s * tau.pow_tensor_scalar(-tau_power)
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).expect("a float tensor")
    }

    fn assert_close(got: &[f64], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() < 1e-5 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    #[test]
    fn streak_weights_of_an_oracle_and_an_always_wrong_drafter() {
        // an oracle (CE 0, q = 1): C_k = 1, s_k = slots left from k, tau = block
        let oracle = Tensor::zeros([2, 15], (Kind::Float, Device::Cpu));
        let left: Vec<f64> = (1..=15).rev().map(f64::from).collect();
        assert_close(
            &values(&streak_weights(&oracle, 0.0, 0.0))[..15],
            &left,
            "oracle",
        );
        let by_tau2: Vec<f64> = left.iter().map(|s| s / 256.0).collect();
        assert_close(
            &values(&streak_weights(&oracle, 0.0, 2.0))[15..],
            &by_tau2,
            "oracle",
        );
        // always wrong (q = 0) with alpha 0.5: q' = 0.5, C = 0.5^k, s = (0.875, 0.375, 0.125)
        let wrong = Tensor::full([1, 3], f64::INFINITY, (Kind::Float, Device::Cpu));
        let s = [0.875, 0.375, 0.125];
        assert_close(&values(&streak_weights(&wrong, 0.5, 0.0)), &s, "wrong");
        let by_tau: Vec<f64> = s.iter().map(|x| x / 1.875).collect();
        assert_close(&values(&streak_weights(&wrong, 0.5, 1.0)), &by_tau, "wrong");
        // q = (0.5, 1, 0.25): C = (0.5, 0.5, 0.125), s = (1.125, 0.625, 0.125), tau 2.125
        let ce = Tensor::from_slice(&[0.5f32.ln(), 0.0, 0.25f32.ln()])
            .neg()
            .view([1, 3]);
        let tau2 = 2.125f64.powi(2);
        let want: Vec<f64> = [1.125, 0.625, 0.125].iter().map(|x| x / tau2).collect();
        assert_close(&values(&streak_weights(&ce, 0.0, 2.0)), &want, "mixed");
    }

    #[test]
    fn streak_weights_are_the_gradients_of_accepted_length_and_of_decoding_steps() {
        // log q of 3 blocks of 5 slots, drawn from a seeded generator
        tch::manual_seed(5);
        let log_q =
            (Tensor::rand([3, 5], (Kind::Double, Device::Cpu)) * -3.0).set_requires_grad(true);
        let s = |log_q: &Tensor| {
            let c = log_q.exp().cumprod(1, Kind::Double);
            c.flip([1]).cumsum(1, Kind::Double).flip([1])
        };
        let ce = log_q.detach().neg().to_kind(Kind::Float);
        // power 0: d(sum_j s_1j) / d log q = s
        let accepted = s(&log_q).narrow(1, 0, 1).sum(Kind::Double);
        let grad = Tensor::run_backward(&[accepted], &[&log_q], false, false);
        let want = values(&streak_weights(&ce, 0.0, 0.0));
        assert_close(&values(&grad[0]), &want, "accepted length");
        // power 2: d(sum_j 1 / tau_j) / d log q = -s / tau^2
        let steps = (s(&log_q).narrow(1, 0, 1) + 1.0)
            .reciprocal()
            .sum(Kind::Double);
        let grad = Tensor::run_backward(&[steps], &[&log_q], false, false);
        let want: Vec<f64> = values(&streak_weights(&ce, 0.0, 2.0))
            .iter()
            .map(|w| -w)
            .collect();
        assert_close(&values(&grad[0]), &want, "decoding steps");
    }
}
