//! The results of [`super::evaluate`]: per prompt and over all prompts, the spread of the
//! per-prompt speed-ups, and the warnings that say when the measured speed-up is not to be
//! trusted.

use super::{count_slots, StepTimes, StepTimesMs};

/// Spread of a per-prompt number.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub p10: f64,
    pub median: f64,
    pub p90: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Spread::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| {
            let i = q * (v.len() - 1) as f64;
            let (lo, hi) = (i.floor() as usize, i.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (i - lo as f64)
        };
        Spread {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            p10: at(0.1),
            median: at(0.5),
            p90: at(0.9),
            max: v[v.len() - 1],
        }
    }
}

/// A two-sided confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

/// The normal quantile of a two-sided 95 % interval.
const Z_95: f64 = 1.959_964;

/// tau = sum(accepted) / sum(steps) of per-prompt (accepted tokens, steps); 0 without steps.
fn tau_of(per_prompt: &[(usize, usize)]) -> f64 {
    let accepted: usize = per_prompt.iter().map(|&(a, _)| a).sum();
    let steps: usize = per_prompt.iter().map(|&(_, s)| s).sum();
    accepted as f64 / steps.max(1) as f64
}

impl Interval {
    /// The 95 % interval of tau = sum(accepted) / sum(steps) over prompts drawn from a larger
    /// set. The standard error is the delta method's for a ratio with the prompt as the unit (a
    /// prompt's steps are not independent of each other: its answer's kind sets them all). tau
    /// is bounded, 1 <= tau <= `block_size` (a step takes at least the target's token and at
    /// most a block), and its spread over prompts is skewed: the interval is taken on the logit
    /// of tau's place between the bounds, p = (tau - 1) / (block_size - 1), and mapped back, so
    /// it stays inside them (the interval tau +- 1.96 se went to 0.093-5.013 around 2.55 on a
    /// few uneven prompts). Near the middle of the range it is the symmetric one. `None` for
    /// fewer than two prompts or no steps.
    pub fn tau_95(per_prompt: &[(usize, usize)], block_size: usize) -> Option<Self> {
        let n = per_prompt.len();
        let steps: usize = per_prompt.iter().map(|&(_, s)| s).sum();
        if n < 2 || steps == 0 {
            return None;
        }
        let tau = tau_of(per_prompt);
        let squares: f64 = per_prompt
            .iter()
            .map(|&(a, s)| (a as f64 - tau * s as f64).powi(2))
            .sum();
        let se = (n as f64 / (n - 1) as f64 * squares).sqrt() / steps as f64;
        let range = block_size.max(2) as f64 - 1.0;
        let p = (tau - 1.0) / range;
        if se == 0.0 || p <= 0.0 || p >= 1.0 {
            // every prompt accepts alike, or all at a bound: nothing to spread
            return Some(Interval {
                low: tau,
                high: tau,
            });
        }
        let logit = (p / (1.0 - p)).ln();
        // d logit / d tau = 1 / (range p (1 - p))
        let half = Z_95 * se / (range * p * (1.0 - p));
        let back = |x: f64| 1.0 + range / (1.0 + (-x).exp());
        Some(Interval {
            low: back(logit - half),
            high: back(logit + half),
        })
    }
}

/// Results over a set of prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Mean accepted tokens per DFlash step over all steps of all prompts.
    pub tau: f64,
    /// tau's 95 % confidence interval over prompts (how far another draw of as many prompts
    /// of the same kind may put it); `None` for fewer than two prompts.
    pub tau_ci95: Option<Interval>,
    /// Time per output token, plain greedy / DFlash (prefill and warm-up excluded).
    pub speedup: f64,
    /// The per-prompt speed-ups (each prompt's greedy / DFlash time per token).
    pub speedup_spread: Spread,
    pub greedy_s_per_token: f64,
    pub dflash_s_per_token: f64,
    /// Milliseconds of one plain greedy step (one token).
    pub greedy_ms_per_token: f64,
    /// Milliseconds of one DFlash step (draft + verify of a block), and that in greedy steps.
    pub dflash_ms_per_step: f64,
    pub step_cost_in_greedy_steps: f64,
    /// Where a DFlash step's time goes (mean ms per step).
    pub dflash_step_ms: StepTimesMs,
    /// Where a greedy step's time goes (mean ms per step; verify = its forward).
    pub greedy_step_ms: StepTimesMs,
    /// Decoding seconds and output tokens (after the first) of each decoder, summed.
    pub greedy_s: f64,
    pub greedy_tokens: usize,
    pub dflash_s: f64,
    pub dflash_tokens: usize,
    /// Prompts whose DFlash output differs from plain greedy decoding.
    pub mismatches: usize,
    /// Per block slot: index 0 counts the steps (the bonus token is always taken), index k >= 1
    /// how often the drafted token of slot k was accepted.
    pub accepted_by_slot: Vec<u64>,
    /// Prompts decoded untimed before the measured pass.
    pub warmup_prompts: usize,
    /// Whether the decoding steps ran as CUDA graphs.
    pub cuda_graphs: bool,
    /// Whether the drafter's steps ran the fused kernels.
    pub fused_kernels: bool,
    /// Why `speedup` should not be trusted, each reason with what to do; empty when nothing
    /// stands out (see [`EvalReport::speedup_warnings`]; `eval` fills it in).
    pub speedup_warnings: Vec<String>,
    /// Why tau says nothing of the drafter (its weights hold NaN or infinite values); empty
    /// when its weights are finite (see [`super::drafter_warnings`]; `eval` fills it in).
    pub drafter_warnings: Vec<String>,
    pub prompts: Vec<PromptResult>,
}

/// Fewer timed prompts than this: the speed-up is one of a few samples.
pub const MIN_TRUSTED_PROMPTS: usize = 10;
/// Fewer timed output tokens (per decoder) than this: a few milliseconds of noise move it.
pub const MIN_TRUSTED_TOKENS: usize = 500;
/// Per-prompt speed-ups whose p10..p90 range is wider than this share of their median
/// disagree too much for one number to stand for them.
pub const MAX_TRUSTED_SPREAD: f64 = 0.5;

/// One prompt's result.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PromptResult {
    pub prompt_ids: Vec<u32>,
    pub tau: f64,
    pub output_ids: Vec<u32>,
    pub accept_lengths: Vec<usize>,
    /// Each step's drafted tokens d_1 .. d_{B-1} (for comparisons with other implementations).
    pub drafts: Vec<Vec<u32>>,
    pub matches_greedy: bool,
    /// Index of the first differing token, when it does not match.
    pub first_mismatch: Option<usize>,
    /// The target's top-1 minus top-2 logit at that token in plain greedy decoding.
    pub mismatch_margin: Option<f32>,
    /// Decoding seconds and timed tokens (after the first) of each decoder on this prompt.
    pub greedy_s: f64,
    pub dflash_s: f64,
    pub greedy_tokens: usize,
    pub dflash_tokens: usize,
    #[serde(skip)]
    pub greedy_times: StepTimes,
    #[serde(skip)]
    pub dflash_times: StepTimes,
}

impl PromptResult {
    /// This prompt's speed-up (greedy / DFlash time per output token).
    pub fn speedup(&self) -> f64 {
        let g = self.greedy_s / self.greedy_tokens.max(1) as f64;
        let d = self.dflash_s / self.dflash_tokens.max(1) as f64;
        g / d.max(1e-12)
    }
}

impl EvalReport {
    /// The totals over per-prompt results.
    pub(crate) fn from_prompts(block_size: usize, prompts: Vec<PromptResult>) -> Self {
        let mut by_slot = vec![0u64; block_size];
        let (mut g_s, mut g_tok, mut d_s, mut d_tok) = (0.0, 0usize, 0.0, 0usize);
        let (mut g_times, mut d_times) = (StepTimes::default(), StepTimes::default());
        for p in &prompts {
            count_slots(&mut by_slot, &p.accept_lengths);
            g_s += p.greedy_s;
            g_tok += p.greedy_tokens;
            d_s += p.dflash_s;
            d_tok += p.dflash_tokens;
            g_times.add(&p.greedy_times);
            d_times.add(&p.dflash_times);
        }
        let greedy_spt = g_s / g_tok.max(1) as f64;
        let dflash_spt = d_s / d_tok.max(1) as f64;
        let greedy_step_ms = g_times.per_step_ms();
        let dflash_step_ms = d_times.per_step_ms();
        let speedups: Vec<f64> = prompts.iter().map(PromptResult::speedup).collect();
        let per_prompt: Vec<(usize, usize)> = prompts
            .iter()
            .map(|p| (p.accept_lengths.iter().sum(), p.accept_lengths.len()))
            .collect();
        EvalReport {
            tau: tau_of(&per_prompt),
            tau_ci95: Interval::tau_95(&per_prompt, block_size),
            speedup: greedy_spt / dflash_spt.max(1e-12),
            speedup_spread: Spread::of(&speedups),
            greedy_s_per_token: greedy_spt,
            dflash_s_per_token: dflash_spt,
            greedy_ms_per_token: greedy_step_ms.total,
            dflash_ms_per_step: dflash_step_ms.total,
            step_cost_in_greedy_steps: dflash_step_ms.total / greedy_step_ms.total.max(1e-12),
            dflash_step_ms,
            greedy_step_ms,
            greedy_s: g_s,
            greedy_tokens: g_tok,
            dflash_s: d_s,
            dflash_tokens: d_tok,
            mismatches: prompts.iter().filter(|r| !r.matches_greedy).count(),
            accepted_by_slot: by_slot,
            warmup_prompts: 0,
            cuda_graphs: false,
            fused_kernels: false,
            speedup_warnings: Vec::new(),
            drafter_warnings: Vec::new(),
            prompts,
        }
    }

    /// Why this report's speed-up is not a trustworthy measurement, each reason with what to
    /// do; empty when nothing stands out. `on_cpu`: some of the decoding ran on the CPU. tau and
    /// the mismatches do not depend on timing and are not concerned.
    pub fn speedup_warnings(&self, on_cpu: bool) -> Vec<String> {
        let mut out = Vec::new();
        if on_cpu {
            // Identical CPU runs of the same model measured 2.78x, 0.42x and 1.83x.
            out.push(
                "decoding ran on the CPU, where the time per token swings with other processes, thread scheduling and clock speed (identical CPU runs have measured anywhere from 0.4x to 2.8x): measure the speed-up on a GPU (--device cuda)".to_string(),
            );
        }
        let n = self.prompts.len();
        if n < MIN_TRUSTED_PROMPTS {
            out.push(format!(
                "only {n} prompt(s) were timed: time at least {MIN_TRUSTED_PROMPTS} (--limit 20 or more, and as many prompts in the data)"
            ));
        }
        let tokens = self.greedy_tokens.min(self.dflash_tokens);
        if tokens < MIN_TRUSTED_TOKENS {
            out.push(format!(
                "only {tokens} output tokens were timed: time at least {MIN_TRUSTED_TOKENS} (a larger --max-new-tokens or --limit)"
            ));
        }
        let sp = &self.speedup_spread;
        if n >= 2 && sp.median > 0.0 && (sp.p90 - sp.p10) / sp.median > MAX_TRUSTED_SPREAD {
            out.push(format!(
                "the per-prompt speed-ups range from {:.2}x (p10) to {:.2}x (p90) around a median of {:.2}x: time more prompts, on an otherwise idle machine or a GPU",
                sp.p10, sp.p90, sp.median
            ));
        }
        if self.warmup_prompts == 0 {
            out.push(
                "no prompt was decoded untimed first (--warmup 0): the first prompt's time includes the set-up (libtorch's lazy initialisation, CUDA graph capture); use --warmup 1".to_string(),
            );
        }
        out
    }

    /// Reports of disjoint prompt shards (e.g. one per device) as one, prompts in the given
    /// order of shards.
    pub(crate) fn merge(block_size: usize, shards: Vec<EvalReport>) -> Self {
        let warmup = shards.iter().map(|r| r.warmup_prompts).sum();
        let graphs = !shards.is_empty() && shards.iter().all(|r| r.cuda_graphs);
        let fused = !shards.is_empty() && shards.iter().all(|r| r.fused_kernels);
        // every shard loaded the same drafter
        let drafter_warnings = shards
            .first()
            .map(|r| r.drafter_warnings.clone())
            .unwrap_or_default();
        let prompts = shards.into_iter().flat_map(|r| r.prompts).collect();
        let mut report = Self::from_prompts(block_size, prompts);
        report.warmup_prompts = warmup;
        report.cuda_graphs = graphs;
        report.fused_kernels = fused;
        report.drafter_warnings = drafter_warnings;
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt timed at `greedy_s` / `dflash_s` seconds for `tokens` tokens each.
    fn timed(greedy_s: f64, dflash_s: f64, tokens: usize) -> PromptResult {
        PromptResult {
            prompt_ids: vec![1],
            tau: 2.0,
            output_ids: vec![2; tokens + 1],
            accept_lengths: vec![2],
            drafts: vec![],
            matches_greedy: true,
            first_mismatch: None,
            mismatch_margin: None,
            greedy_s,
            dflash_s,
            greedy_tokens: tokens,
            dflash_tokens: tokens,
            greedy_times: StepTimes::default(),
            dflash_times: StepTimes::default(),
        }
    }

    fn report(prompts: Vec<PromptResult>, warmup: usize) -> EvalReport {
        let mut r = EvalReport::from_prompts(4, prompts);
        r.warmup_prompts = warmup;
        r
    }

    /// A prompt decoded in steps that accepted `accept_lengths` tokens each.
    fn accepting(accept_lengths: &[usize]) -> PromptResult {
        PromptResult {
            accept_lengths: accept_lengths.to_vec(),
            ..timed(1.0, 0.5, 100)
        }
    }

    /// The logit of tau's place in [1, 4] (the reports here have blocks of 4).
    fn logit4(tau: f64) -> f64 {
        let p = (tau - 1.0) / 3.0;
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn tau_interval_is_the_ratio_estimators_over_prompts() {
        // Two prompts, 2 steps each: 2 and 6 tokens, tau 2. Residuals a - tau * s: -2, +2;
        // variance 2/1 * 8 = 16, standard error 4 / 4 steps = 1. On the logit scale of
        // p = (tau - 1) / 3 = 1/3 that is 1 / (3 p (1 - p)) = 1.5 either side, times 1.96.
        let r = report(vec![accepting(&[1, 1]), accepting(&[3, 3])], 1);
        assert_eq!(r.tau, 2.0);
        let ci = r.tau_ci95.expect("two prompts have an interval");
        let centre = (0.5f64).ln();
        assert!(
            (logit4(ci.low) - (centre - 1.5 * Z_95)).abs() < 1e-9,
            "{ci:?}"
        );
        assert!(
            (logit4(ci.high) - (centre + 1.5 * Z_95)).abs() < 1e-9,
            "{ci:?}"
        );
        assert!(
            1.0 < ci.low && ci.low < 2.0 && 2.0 < ci.high && ci.high < 4.0,
            "{ci:?}"
        );
        // Prompts that all accept alike leave no doubt: the interval is tau itself, whatever
        // their lengths.
        let alike = vec![
            accepting(&[2, 4]),
            accepting(&[2, 4, 3, 3]),
            accepting(&[3]),
        ];
        let r = report(alike, 1);
        let ci = r.tau_ci95.unwrap();
        assert!(
            (ci.low - r.tau).abs() < 1e-12 && (ci.high - r.tau).abs() < 1e-12,
            "{ci:?}"
        );
        // One prompt, or none: no interval.
        assert_eq!(report(vec![accepting(&[2, 3])], 1).tau_ci95, None);
        assert_eq!(report(vec![], 1).tau_ci95, None);
    }

    #[test]
    fn a_skewed_sample_keeps_tau_interval_within_its_bounds() {
        // Blocks of 16: two prompts where every draft is rejected (1 token a step) and one that
        // takes 15 of 16 a step. tau = 170 / 30 = 5.67 with a standard error of 4.67: the
        // symmetric interval would run from below 0 to 14.8.
        let per_prompt = [(10, 10), (10, 10), (150, 10)];
        let tau = 170.0 / 30.0;
        let squares: f64 = per_prompt
            .iter()
            .map(|&(a, s)| (a as f64 - tau * s as f64).powi(2))
            .sum();
        let se = (1.5 * squares).sqrt() / 30.0;
        assert!(tau - Z_95 * se < 0.0, "the symmetric interval went below 1");
        let ci = Interval::tau_95(&per_prompt, 16).unwrap();
        assert!(1.0 < ci.low && ci.low < tau, "{ci:?} around {tau}");
        assert!(tau < ci.high && ci.high < 16.0, "{ci:?} around {tau}");
        // The skew shows: more room above tau than below.
        assert!(ci.high - tau > tau - ci.low, "{ci:?}");
        // Prompts that all take whole blocks sit at the top bound: no spread to show.
        let full = Interval::tau_95(&[(16, 1), (64, 4)], 16).unwrap();
        assert_eq!((full.low, full.high), (16.0, 16.0));
    }

    #[test]
    fn more_prompts_of_the_same_kind_narrow_tau_interval() {
        let kinds = [&[1usize, 2, 1][..], &[4, 3], &[2, 2, 2, 1], &[4]];
        let set = |copies: usize| {
            (0..copies)
                .flat_map(|_| kinds.iter().map(|k| accepting(k)))
                .collect::<Vec<_>>()
        };
        let (few, many) = (report(set(1), 1), report(set(9), 1));
        assert_eq!(few.tau, many.tau);
        let width = |r: &EvalReport| {
            let ci = r.tau_ci95.unwrap();
            assert!(ci.low < r.tau && r.tau < ci.high, "{ci:?} around {}", r.tau);
            logit4(ci.high) - logit4(ci.low)
        };
        // Nine times the prompts: about a third of the width on the logit scale (sqrt(9), and
        // the n/(n-1) of 4 prompts against 36).
        let ratio = width(&many) / width(&few);
        let expected = ((36.0 / 35.0) / (4.0 / 3.0) / 9.0f64).sqrt();
        assert!((ratio - expected).abs() < 1e-9, "{ratio} vs {expected}");
    }

    #[test]
    fn a_steady_gpu_like_measurement_has_no_warning() {
        let prompts = (0..20)
            .map(|i| timed(1.0, 0.5 + 0.001 * i as f64, 100))
            .collect();
        assert!(report(prompts, 1).speedup_warnings(false).is_empty());
    }

    #[test]
    fn each_untrustworthy_measurement_is_named_with_what_to_do() {
        let steady = || (0..20).map(|_| timed(1.0, 0.5, 100)).collect::<Vec<_>>();
        // On the CPU.
        let w = report(steady(), 1).speedup_warnings(true);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("CPU") && w[0].contains("GPU"), "{w:?}");
        // Too few prompts, and so too few tokens.
        let w = report(steady()[..3].to_vec(), 1).speedup_warnings(false);
        assert!(
            w.iter()
                .any(|m| m.contains("only 3 prompt(s)") && m.contains("--limit")),
            "{w:?}"
        );
        assert!(
            w.iter().any(|m| m.contains("only 300 output tokens")),
            "{w:?}"
        );
        // Speed-ups from 0.4x to 2.8x around a median of 1.4x.
        let wide: Vec<_> = (0..20)
            .map(|i| timed(1.0, 1.0 / (0.4 + 0.125 * i as f64), 100))
            .collect();
        let w = report(wide, 1).speedup_warnings(false);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("range from") && w[0].contains("more prompts"),
            "{w:?}"
        );
        // No warm-up.
        let w = report(steady(), 0).speedup_warnings(false);
        assert!(w.len() == 1 && w[0].contains("--warmup 1"), "{w:?}");
    }
}
