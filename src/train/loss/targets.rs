//! Anchors of a batch and the labels and weights of their block slots (spec §2.2, §2.5, §3).

use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Anchors of a batch: [B, N] positions and validity, N = the largest count of any row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorPlan {
    pub rows: usize,
    pub per_row: usize,
    pub anchors: Vec<i64>,
    pub valid: Vec<bool>,
}

/// Draws anchors for every row (spec §2.2): candidates are positions p with
/// `loss_mask[p] == 1` and `p <= len - block`; `min(num_anchors, #candidates)` of them uniformly
/// without replacement, sorted; shorter rows padded with invalid blocks at position 0.
pub fn sample_anchors(
    loss_mask: &[i64],
    lengths: &[usize],
    stride: usize,
    block: usize,
    num_anchors: usize,
    seed: u64,
) -> AnchorPlan {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut per_row: Vec<Vec<i64>> = Vec::with_capacity(lengths.len());
    for (r, &len) in lengths.iter().enumerate() {
        let row = &loss_mask[r * stride..r * stride + len];
        let candidates: Vec<i64> = if len >= block {
            (0..=len - block)
                .filter(|&p| row[p] == 1)
                .map(|p| p as i64)
                .collect()
        } else {
            Vec::new()
        };
        let n = num_anchors.min(candidates.len());
        let mut chosen: Vec<i64> = sample(&mut rng, candidates.len(), n)
            .into_iter()
            .map(|i| candidates[i])
            .collect();
        chosen.sort_unstable();
        per_row.push(chosen);
    }
    let n = per_row.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut anchors = vec![0i64; lengths.len() * n];
    let mut valid = vec![false; lengths.len() * n];
    for (r, chosen) in per_row.iter().enumerate() {
        for (j, &a) in chosen.iter().enumerate() {
            anchors[r * n + j] = a;
            valid[r * n + j] = true;
        }
    }
    AnchorPlan {
        rows: lengths.len(),
        per_row: n,
        anchors,
        valid,
    }
}

/// Labels and weights of every block slot: [B, N, block].
#[derive(Debug, Clone)]
pub struct BlockTargets {
    pub labels: Vec<i64>,
    pub weights: Vec<f32>,
    /// Teacher position a_j + k - 1 of each slot (for soft labels).
    pub teacher_pos: Vec<i64>,
}

/// `w[j,k] = valid_j * [k >= 1] * [a_j + k < len] * loss_mask[a_j + k] * exp(-(k - 1) / gamma)`
/// and label `x[a_j + k]` (no shift) (spec §2.5, §3).
pub fn block_targets(
    ids: &[i64],
    loss_mask: &[i64],
    lengths: &[usize],
    stride: usize,
    plan: &AnchorPlan,
    block: usize,
    gamma: f64,
) -> BlockTargets {
    let total = plan.rows * plan.per_row * block;
    let mut labels = vec![0i64; total];
    let mut weights = vec![0f32; total];
    let mut teacher_pos = vec![0i64; total];
    for r in 0..plan.rows {
        for j in 0..plan.per_row {
            let slot = r * plan.per_row + j;
            let a = plan.anchors[slot] as usize;
            for k in 0..block {
                let i = slot * block + k;
                let p = a + k;
                if p < lengths[r] {
                    labels[i] = ids[r * stride + p];
                    teacher_pos[i] = (p.max(1) - 1) as i64;
                    if plan.valid[slot] && k >= 1 && loss_mask[r * stride + p] == 1 {
                        weights[i] = (-((k - 1) as f64) / gamma).exp() as f32;
                    }
                }
            }
        }
    }
    BlockTargets {
        labels,
        weights,
        teacher_pos,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_follow_the_candidate_rule() {
        // row 0: length 10, loss on 3..10; row 1: length 6, loss everywhere
        let stride = 10;
        let mut mask = vec![0i64; 20];
        mask[3..10].fill(1);
        mask[10..16].fill(1);
        let plan = sample_anchors(&mask, &[10, 6], stride, 4, 100, 1);
        assert_eq!(plan.per_row, 4); // row 0: p in 3..=6 -> 4 candidates; row 1: 0..=2 -> 3
        assert_eq!(&plan.anchors[..4], &[3, 4, 5, 6]);
        assert_eq!(&plan.anchors[4..7], &[0, 1, 2]);
        assert_eq!(
            plan.valid,
            vec![true, true, true, true, true, true, true, false]
        );
        let few = sample_anchors(&mask, &[10, 6], stride, 4, 2, 1);
        assert_eq!(few.per_row, 2);
        assert!(few.anchors[..2].windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            few,
            sample_anchors(&mask, &[10, 6], stride, 4, 2, 1),
            "seeded"
        );
    }

    #[test]
    fn targets_have_no_shift_and_decay() {
        let ids: Vec<i64> = (100..110).collect();
        let mask = vec![1i64; 10];
        let plan = AnchorPlan {
            rows: 1,
            per_row: 2,
            anchors: vec![2, 0],
            valid: vec![true, false],
        };
        let t = block_targets(&ids, &mask, &[10], 10, &plan, 4, 7.0);
        assert_eq!(&t.labels[..4], &[102, 103, 104, 105]);
        assert_eq!(t.weights[0], 0.0, "slot 0 has no loss");
        assert_eq!(t.weights[1], 1.0);
        assert!((t.weights[2] - (-1.0f64 / 7.0).exp() as f32).abs() < 1e-7);
        assert!(t.weights[4..].iter().all(|&w| w == 0.0), "invalid block");
        assert_eq!(
            t.teacher_pos[1], 2,
            "slot k is taught by position a + k - 1"
        );
    }
}
