//! Perplexity of a target model over tokenised sequences: `exp(mean NLL)` of every next-token
//! prediction inside the (cut) sequences.

use anyhow::Result;
use indicatif::ProgressBar;
use tch::{Kind, Reduction, Tensor};

use crate::data::arrow_io::TokenColumn;
use crate::model::{ForwardRequest, TargetModel};

/// What `perplexity` measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PerplexityReport {
    pub ppl: f64,
    /// Predicted tokens (each sequence of length L contributes L - 1).
    pub tokens: u64,
    pub sequences: usize,
    /// Input tokens through the model per second (prefill throughput).
    pub tokens_per_s: f64,
    pub seconds: f64,
}

/// Options of a perplexity run.
#[derive(Debug, Clone)]
pub struct PerplexityOptions {
    pub limit: Option<usize>,
    pub max_len: usize,
    /// Upper bound on padded tokens per forward batch.
    pub batch_tokens: usize,
    /// Advanced by the (cut) sequences' tokens after each batch; its length is set to all of
    /// them.
    pub progress: Option<ProgressBar>,
}

/// Rows of LM-head output computed at once, so that the full-vocabulary logits are never
/// materialised for a whole batch.
const LOGIT_ROWS: i64 = 4096;

pub fn perplexity(
    model: &TargetModel,
    data: &TokenColumn,
    opts: &PerplexityOptions,
) -> Result<PerplexityReport> {
    let vocab = model.config.vocab_size as u32;
    let mut seqs: Vec<&[u32]> = Vec::new();
    for (row, seq) in data.iter().enumerate() {
        if opts.limit.is_some_and(|l| seqs.len() >= l) {
            break;
        }
        if let Some(bad) = seq.iter().find(|&&t| t >= vocab) {
            anyhow::bail!("row {row}: token id {bad} is outside the model's vocabulary of {vocab}");
        }
        let cut = &seq[..seq.len().min(opts.max_len)];
        if cut.len() >= 2 {
            seqs.push(cut);
        }
    }

    if let Some(bar) = &opts.progress {
        bar.set_length(seqs.iter().map(|s| s.len() as u64).sum());
    }
    let started = std::time::Instant::now();
    let mut nll = 0f64;
    let mut predicted = 0u64;
    let mut input_tokens = 0u64;
    let mut i = 0;
    let req = ForwardRequest {
        final_hidden: true,
        ..Default::default()
    };
    while i < seqs.len() {
        // Greedy batch: as many following sequences as fit the token budget when padded.
        let mut j = i + 1;
        let mut longest = seqs[i].len();
        while j < seqs.len() {
            let l = longest.max(seqs[j].len());
            if l * (j + 1 - i) > opts.batch_tokens {
                break;
            }
            longest = l;
            j += 1;
        }
        let batch = &seqs[i..j];
        let b = batch.len() as i64;
        let l = longest as i64;
        let mut ids = vec![0i64; (b * l) as usize];
        let mut valid = vec![false; (b * (l - 1)) as usize];
        for (r, s) in batch.iter().enumerate() {
            for (c, &t) in s.iter().enumerate() {
                ids[r * l as usize + c] = t as i64;
            }
            for c in 0..s.len() - 1 {
                valid[r * (l - 1) as usize + c] = true;
            }
            predicted += s.len() as u64 - 1;
            input_tokens += s.len() as u64;
        }
        let ids = Tensor::from_slice(&ids)
            .view([b, l])
            .to_device(model.device);
        let valid = Tensor::from_slice(&valid).to_device(model.device);
        let hidden = model
            .run(&ids, None, &req)
            .final_hidden
            .ok_or_else(|| anyhow::anyhow!("the model returned no hidden states"))?;
        let rows = tch::no_grad(|| {
            let h = hidden.narrow(1, 0, l - 1).reshape([b * (l - 1), -1]);
            let targets = ids.narrow(1, 1, l - 1).reshape([-1]);
            let keep = valid.nonzero().squeeze_dim(1);
            (h.index_select(0, &keep), targets.index_select(0, &keep))
        });
        let (h, targets) = rows;
        for (start, logits) in model.logits_by_rows(&h, LOGIT_ROWS) {
            let len = logits.size()[0];
            let loss = tch::no_grad(|| {
                logits.cross_entropy_loss::<Tensor>(
                    &targets.narrow(0, start, len),
                    None,
                    Reduction::Sum,
                    -100,
                    0.0,
                )
            });
            nll += loss.to_kind(Kind::Double).double_value(&[]);
        }
        if let Some(bar) = &opts.progress {
            bar.inc(batch.iter().map(|s| s.len() as u64).sum());
        }
        i = j;
    }
    let seconds = started.elapsed().as_secs_f64();
    let ppl = if predicted > 0 {
        (nll / predicted as f64).exp()
    } else {
        f64::NAN
    };
    Ok(PerplexityReport {
        ppl,
        tokens: predicted,
        sequences: seqs.len(),
        tokens_per_s: input_tokens as f64 / seconds.max(1e-9),
        seconds,
    })
}
