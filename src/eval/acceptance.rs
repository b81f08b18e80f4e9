//! Where a drafter's drafts are accepted and rejected, by how sure the target was of the token
//! it picked there. Read from an `eval --json` report (its outputs and each step's drafts) and
//! one teacher-forced forward of the target per prompt; nothing is decoded again.
//!
//! A drafter that misses where the target is sure has something left to learn; one that
//! misses mostly where the target's top choice has little probability is guessing between
//! near-equal continuations, which more training moves little.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::model::{ForwardRequest, TargetModel};

/// Lower edges of the confidence ranges (the target's top-1 probability); the last ends at 1.
pub const EDGES: [f64; 6] = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9];

/// Rows of LM-head output computed at once (as in perplexity): a long answer's full-vocabulary
/// probabilities are never materialised at once.
const LOGIT_ROWS: i64 = 1024;

/// What a prompt of an `eval --json` report holds that this needs.
#[derive(Debug, Clone, Deserialize)]
pub struct DecodedPrompt {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub accept_lengths: Vec<usize>,
    pub drafts: Vec<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
struct ReportPrompts {
    prompts: Vec<DecodedPrompt>,
}

/// Reads the prompts of an `eval --json` report.
pub fn read_report(text: &str) -> Result<Vec<DecodedPrompt>> {
    let report: ReportPrompts = serde_json::from_str(text).context(
        "not an `eval --json` report (prompts[] with output_ids, accept_lengths, drafts)",
    )?;
    Ok(report.prompts)
}

/// One range of the target's confidence.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ConfidenceRange {
    /// The target's top-1 probability, from (inclusive) .. to (exclusive; 1 inclusive).
    pub from: f64,
    pub to: f64,
    /// Output tokens (after the first, which the prefill makes) whose pick had this confidence.
    pub tokens: u64,
    /// Drafted tokens compared with the target's pick at such a token, and those accepted.
    pub drafted: u64,
    pub accepted: u64,
    /// The same for a step's first drafted token only (every step drafts one).
    pub first_drafted: u64,
    pub first_accepted: u64,
}

/// Acceptance by the target's confidence, over the prompts of a report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AcceptanceReport {
    pub prompts: usize,
    pub steps: u64,
    /// Output tokens after each prompt's first.
    pub tokens: u64,
    /// Of those, tokens that the teacher-forced target also ranks first: how well this forward
    /// reproduces the decoding (all of them in f32; near-ties can flip in bf16).
    pub target_agrees: u64,
    pub ranges: Vec<ConfidenceRange>,
}

impl AcceptanceReport {
    pub fn new() -> Self {
        let ranges = EDGES
            .iter()
            .enumerate()
            .map(|(i, &from)| ConfidenceRange {
                from,
                to: EDGES.get(i + 1).copied().unwrap_or(1.0),
                ..Default::default()
            })
            .collect();
        AcceptanceReport {
            prompts: 0,
            steps: 0,
            tokens: 0,
            target_agrees: 0,
            ranges,
        }
    }

    fn range(&mut self, confidence: f64) -> &mut ConfidenceRange {
        let i = EDGES
            .iter()
            .rposition(|&edge| confidence >= edge)
            .unwrap_or(0);
        &mut self.ranges[i]
    }

    /// Adds one prompt. `confidence[t]` and `agrees[t]`: the target's top-1 probability when
    /// it picked `output_ids[t]`, and whether its top-1 was that token. A step starts after
    /// the tokens of the steps before it (the first after the prefill's token); its draft k
    /// is compared with the output token k of the step, until the first rejection or the end
    /// of the output (cut at the token limit or the end of the answer).
    pub fn add(
        &mut self,
        prompt: &DecodedPrompt,
        confidence: &[f64],
        agrees: &[bool],
    ) -> Result<()> {
        let out = &prompt.output_ids;
        if confidence.len() != out.len() || agrees.len() != out.len() {
            bail!(
                "{} confidences for {} output tokens",
                confidence.len(),
                out.len()
            );
        }
        if prompt.drafts.len() != prompt.accept_lengths.len() {
            bail!(
                "{} steps of drafts but {} accept lengths",
                prompt.drafts.len(),
                prompt.accept_lengths.len()
            );
        }
        self.prompts += 1;
        self.steps += prompt.accept_lengths.len() as u64;
        for t in 1..out.len() {
            self.tokens += 1;
            self.target_agrees += agrees[t] as u64;
            self.range(confidence[t]).tokens += 1;
        }
        let mut start = 1;
        for (step, (drafts, &length)) in
            prompt.drafts.iter().zip(&prompt.accept_lengths).enumerate()
        {
            let mut accepted = 0;
            for (k, &draft) in drafts.iter().enumerate() {
                let t = start + k;
                let Some(&pick) = out.get(t) else { break };
                let hit = draft == pick;
                let range = self.range(confidence[t]);
                range.drafted += 1;
                range.accepted += hit as u64;
                if k == 0 {
                    range.first_drafted += 1;
                    range.first_accepted += hit as u64;
                }
                if !hit {
                    break;
                }
                accepted += 1;
            }
            // The report's own count: the same, unless the output was cut before the step's
            // first rejected (or last) draft.
            if accepted + 1 != length && start + accepted < out.len() {
                bail!(
                    "step {step}: {accepted} drafts equal the output but the report accepted {}",
                    length.saturating_sub(1)
                );
            }
            start += length;
        }
        Ok(())
    }

    /// A table for the terminal.
    pub fn table(&self) -> String {
        let pct = |a: u64, b: u64| {
            if b == 0 {
                "-".to_string()
            } else {
                format!("{:.1} %", 100.0 * a as f64 / b as f64)
            }
        };
        let misses: u64 = self.ranges.iter().map(|r| r.drafted - r.accepted).sum();
        let mut s = format!(
            "{} prompts, {} steps, {} output tokens (the target's teacher-forced top-1 agrees on {})\n",
            self.prompts,
            self.steps,
            self.tokens,
            pct(self.target_agrees, self.tokens)
        );
        s.push_str("target's top-1 p   tokens   drafted  accepted   first drafted  first accepted  share of rejections\n");
        for r in &self.ranges {
            s.push_str(&format!(
                "{:.1}-{:.1}  {:>14}  {:>8}  {:>8}  {:>14}  {:>14}  {:>19}\n",
                r.from,
                r.to,
                format!("{} ({})", r.tokens, pct(r.tokens, self.tokens)),
                r.drafted,
                pct(r.accepted, r.drafted),
                r.first_drafted,
                pct(r.first_accepted, r.first_drafted),
                pct(r.drafted - r.accepted, misses),
            ));
        }
        s
    }
}

impl Default for AcceptanceReport {
    fn default() -> Self {
        Self::new()
    }
}

/// The target's top-1 probability and whether its top-1 is the output token, for every output
/// token of `prompt`, from one forward over the prompt and the output.
pub fn target_confidence(
    target: &TargetModel,
    prompt: &DecodedPrompt,
) -> Result<(Vec<f64>, Vec<bool>)> {
    let out = &prompt.output_ids;
    if out.is_empty() {
        return Ok((vec![], vec![]));
    }
    if prompt.prompt_ids.is_empty() {
        bail!("an empty prompt");
    }
    let vocab = target.config.vocab_size as u32;
    let ids: Vec<i64> = prompt
        .prompt_ids
        .iter()
        .chain(out)
        .map(|&t| {
            if t >= vocab {
                bail!("token id {t} is outside the target's vocabulary of {vocab}")
            }
            Ok(t as i64)
        })
        .collect::<Result<_>>()?;
    let context = target.config.max_position_embeddings;
    if ids.len() as i64 - 1 > context {
        bail!(
            "{} prompt and output tokens are more than the target's context of {context}",
            ids.len()
        );
    }
    // The last output token predicts nothing that is kept.
    let input = Tensor::from_slice(&ids[..ids.len() - 1])
        .view([1, -1])
        .to_device(target.device);
    let req = ForwardRequest {
        final_hidden: true,
        ..Default::default()
    };
    let hidden = target
        .run(&input, None, &req)
        .final_hidden
        .context("the target returned no hidden states")?;
    // position p predicts token p + 1: the output tokens are predicted from the prompt's last
    // position on
    let first = prompt.prompt_ids.len() as i64 - 1;
    let n = out.len() as i64;
    let rows = hidden.squeeze_dim(0).narrow(0, first, n);
    let (mut confidence, mut top) = (Vec::with_capacity(out.len()), Vec::with_capacity(out.len()));
    for (_, logits) in target.logits_by_rows(&rows, LOGIT_ROWS) {
        let (p, i) = tch::no_grad(|| logits.softmax(-1, Kind::Float).max_dim(-1, false));
        confidence.extend(Vec::<f64>::try_from(
            p.to_kind(Kind::Double).to_device(tch::Device::Cpu),
        )?);
        top.extend(Vec::<i64>::try_from(i.to_device(tch::Device::Cpu))?);
    }
    let agrees = top.iter().zip(out).map(|(&a, &b)| a == b as i64).collect();
    Ok((confidence, agrees))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(output: &[u32], drafts: &[&[u32]], lengths: &[usize]) -> DecodedPrompt {
        DecodedPrompt {
            prompt_ids: vec![1],
            output_ids: output.to_vec(),
            accept_lengths: lengths.to_vec(),
            drafts: drafts.iter().map(|d| d.to_vec()).collect(),
        }
    }

    #[test]
    fn drafts_are_counted_in_the_range_of_the_targets_confidence_until_the_first_rejection() {
        // output 10 11 12 13 14 15; step 1 starts at token 1 (11): drafts 11 12 99 -> 2
        // accepted, a rejection at token 3 (13), length 3; step 2 starts at token 4 (14):
        // drafts 77 -> rejected at once, length 1; step 3 at token 5 (15): drafts 15 16 -> 15
        // accepted, then the output ends (cut): length 3 in the report, 2 seen.
        let p = prompt(
            &[10, 11, 12, 13, 14, 15],
            &[&[11, 12, 99], &[77, 1, 1], &[15, 16, 17]],
            &[3, 1, 3],
        );
        let confidence = [0.5, 0.95, 0.85, 0.1, 0.3, 0.65];
        let agrees = [true, true, true, false, true, true];
        let mut r = AcceptanceReport::new();
        r.add(&p, &confidence, &agrees).unwrap();
        assert_eq!(
            (r.prompts, r.steps, r.tokens, r.target_agrees),
            (1, 3, 5, 4)
        );
        let by = |from: f64| r.ranges.iter().find(|x| x.from == from).unwrap().clone();
        // 0.95 (token 1): drafted and accepted, a first draft
        let top = by(0.9);
        assert_eq!(
            (
                top.tokens,
                top.drafted,
                top.accepted,
                top.first_drafted,
                top.first_accepted
            ),
            (1, 1, 1, 1, 1)
        );
        // 0.85 (token 2): drafted and accepted, not a first draft
        let high = by(0.8);
        assert_eq!(
            (high.tokens, high.drafted, high.accepted, high.first_drafted),
            (1, 1, 1, 0)
        );
        // 0.1 (token 3): the rejection of step 1
        let low = by(0.0);
        assert_eq!((low.tokens, low.drafted, low.accepted), (1, 1, 0));
        // 0.3 (token 4): step 2's first draft, rejected
        let lowish = by(0.2);
        assert_eq!(
            (
                lowish.drafted,
                lowish.accepted,
                lowish.first_drafted,
                lowish.first_accepted
            ),
            (1, 0, 1, 0)
        );
        // 0.65 (token 5): step 3's first draft, accepted; nothing after the cut
        let mid = by(0.6);
        assert_eq!(
            (
                mid.drafted,
                mid.accepted,
                mid.first_drafted,
                mid.first_accepted
            ),
            (1, 1, 1, 1)
        );
        assert_eq!(
            by(0.4),
            ConfidenceRange {
                from: 0.4,
                to: 0.6,
                ..Default::default()
            }
        );
        let table = r.table();
        assert!(
            table.contains("1 prompts, 3 steps, 5 output tokens"),
            "{table}"
        );
        assert!(table.contains("agrees on 80.0 %"), "{table}");
    }

    #[test]
    fn an_oracle_drafter_is_always_accepted_and_a_wrong_one_never() {
        let output: Vec<u32> = (100..140).collect();
        let confidence: Vec<f64> = (0..40).map(|i| i as f64 / 40.0).collect();
        let agrees = vec![true; 40];
        // Oracle: blocks of 4 drafts, all right: every step accepts 4 (+1), so 5 tokens a step.
        let mut drafts = vec![];
        let mut lengths = vec![];
        let mut start = 1;
        while start < output.len() {
            drafts.push(
                (0..4)
                    .map(|k| output.get(start + k).copied().unwrap_or(0))
                    .collect::<Vec<_>>(),
            );
            lengths.push(5);
            start += 5;
        }
        let p = DecodedPrompt {
            prompt_ids: vec![1],
            output_ids: output.clone(),
            accept_lengths: lengths,
            drafts,
        };
        let mut oracle = AcceptanceReport::new();
        oracle.add(&p, &confidence, &agrees).unwrap();
        let drafted: u64 = oracle.ranges.iter().map(|r| r.drafted).sum();
        let accepted: u64 = oracle.ranges.iter().map(|r| r.accepted).sum();
        // every token of a step but its last (the target's bonus token) is drafted and
        // accepted: 8 steps of 4
        assert_eq!((drafted, accepted), (32, 32));
        // Always wrong: one token a step, its one draft rejected.
        let p = DecodedPrompt {
            prompt_ids: vec![1],
            output_ids: output.clone(),
            accept_lengths: vec![1; 39],
            drafts: vec![vec![0, 0, 0, 0]; 39],
        };
        let mut wrong = AcceptanceReport::new();
        wrong.add(&p, &confidence, &agrees).unwrap();
        let first: u64 = wrong.ranges.iter().map(|r| r.first_drafted).sum();
        let accepted: u64 = wrong
            .ranges
            .iter()
            .map(|r| r.accepted + r.first_accepted)
            .sum();
        assert_eq!((first, accepted), (39, 0));
        // the ranges hold the tokens by confidence: 0.0..0.2 holds t/40 < 0.2, t = 1..7
        assert_eq!(wrong.ranges[0].tokens, 7);
        assert_eq!(wrong.ranges.iter().map(|r| r.tokens).sum::<u64>(), 39);
    }

    #[test]
    fn a_report_whose_drafts_contradict_its_accept_lengths_is_refused() {
        // the drafts match two tokens but the report says none were accepted
        let p = prompt(&[10, 11, 12, 13], &[&[11, 12, 50]], &[1]);
        let err = AcceptanceReport::new()
            .add(&p, &[0.5; 4], &[true; 4])
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("step 0: 2 drafts equal the output but the report accepted 0"),
            "{err}"
        );
        let err = AcceptanceReport::new()
            .add(&p, &[0.5; 3], &[true; 3])
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("3 confidences for 4 output tokens"),
            "{err}"
        );
    }
}
