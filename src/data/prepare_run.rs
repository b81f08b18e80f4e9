//! The whole `prepare-data` run: read inputs, split off validation, tokenise on every core,
//! write a `DatasetDict` in the `save_to_disk` layout, summarise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

use super::arrow_io::{write_split, SplitSummary, TokenRow};
use super::chat::{read_inputs, Skip};
use super::prepare::{prepare_record, PreparedSample};
use crate::fsutil::{write_json, StagedDir};
use crate::text::TextTokenizer;

/// Options of `prepare-data`.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub max_len: usize,
    pub shard_rows: usize,
    pub val_fraction: f64,
    pub seed: u64,
    /// Print progress to stderr.
    pub progress: bool,
}

/// What `prepare-data` did.
#[derive(Debug, Clone)]
pub struct PrepareSummary {
    pub out_dir: PathBuf,
    pub records_in: usize,
    pub kept: usize,
    pub train: SplitSummary,
    pub validation: SplitSummary,
    /// reason -> count
    pub skipped: BTreeMap<String, usize>,
    /// a few examples, with file and row
    pub skip_examples: Vec<Skip>,
    pub truncated_inputs: Vec<String>,
    pub tokens: u64,
    pub loss_tokens: u64,
    pub cut: usize,
    pub max_len: usize,
    /// p50, p90, p99, max of sample lengths
    pub length_percentiles: [usize; 4],
    pub seconds: f64,
}

/// Reason categories for the summary (the detail stays in the examples).
fn reason_category(reason: &str) -> String {
    let cut = reason.find(':').unwrap_or(reason.len());
    let head = &reason[..cut];
    if head.starts_with("turn ") && reason.contains("unknown speaker") {
        "unknown speaker".into()
    } else if head.starts_with("no assistant token within") {
        "no assistant token within max length".into()
    } else {
        head.to_string()
    }
}

fn percentile(sorted: &[usize], p: f64) -> usize {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

pub fn prepare_data(
    tokenizer_dir: &Path,
    inputs: &[PathBuf],
    out_dir: &Path,
    opts: &PrepareOptions,
) -> Result<PrepareSummary> {
    let started = Instant::now();
    if inputs.is_empty() {
        bail!("no --input files given");
    }
    if !(0.0..1.0).contains(&opts.val_fraction) {
        bail!(
            "--val-fraction must be in [0, 1), found {}",
            opts.val_fraction
        );
    }
    let tokenizer = TextTokenizer::from_model_dir(tokenizer_dir)?;
    let read = read_inputs(inputs)?;
    if read.records.is_empty() {
        let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "{}: no usable records ({} skipped{})",
            names.join(", "),
            read.skipped.len(),
            read.skipped
                .first()
                .map(|s| format!(", e.g. {}: {}", s.origin, s.reason))
                .unwrap_or_default()
        );
    }
    let total = read.records.len();
    let done = AtomicUsize::new(0);
    let last_report = std::sync::Mutex::new(Instant::now());
    let results: Vec<std::result::Result<PreparedSample, String>> = read
        .records
        .par_iter()
        .map(|r| {
            let out = prepare_record(&tokenizer, r, opts.max_len);
            let n = done.fetch_add(1, Ordering::Relaxed) + 1;
            if opts.progress {
                if let Ok(mut last) = last_report.try_lock() {
                    if last.elapsed() > Duration::from_secs(2) {
                        *last = Instant::now();
                        eprintln!("prepare-data: tokenised {n}/{total} records");
                    }
                }
            }
            out
        })
        .collect();

    let mut skipped_list = read.skipped.clone();
    let mut samples = Vec::with_capacity(results.len());
    let mut cut = 0;
    for (record, result) in read.records.iter().zip(results) {
        match result {
            Ok(s) => {
                cut += s.was_cut as usize;
                samples.push(s)
            }
            Err(reason) => skipped_list.push(Skip {
                origin: record.origin.clone(),
                reason,
            }),
        }
    }
    if samples.is_empty() {
        bail!(
            "no record could be used ({} skipped, e.g. {}: {})",
            skipped_list.len(),
            skipped_list[0].origin,
            skipped_list[0].reason
        );
    }

    // Validation: a seeded random subset, the same for the same inputs and seed.
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(opts.seed));
    let n_val = if opts.val_fraction > 0.0 && samples.len() > 1 {
        ((samples.len() as f64 * opts.val_fraction).round() as usize).clamp(1, samples.len() - 1)
    } else {
        0
    };
    let mut is_val = vec![false; samples.len()];
    for &i in &order[..n_val] {
        is_val[i] = true;
    }
    let rows = |val: bool| -> Vec<TokenRow<'_>> {
        samples
            .iter()
            .zip(&is_val)
            .filter(|(_, &v)| v == val)
            .map(|(s, _)| TokenRow {
                id: &s.id,
                input_ids: &s.input_ids,
                loss_mask: &s.loss_mask,
            })
            .collect()
    };

    let staged = StagedDir::create(out_dir)?;
    let mut split_summaries = Vec::new();
    for (name, val) in [("train", false), ("validation", true)] {
        let dir = staged.path().join(name);
        std::fs::create_dir(&dir)?;
        split_summaries.push(write_split(&dir, name, &rows(val), opts.shard_rows)?);
    }
    write_json(
        &staged.path().join("dataset_dict.json"),
        &serde_json::json!({"splits": ["train", "validation"]}),
    )?;
    let out_dir = staged.commit()?;

    let mut lengths: Vec<usize> = samples.iter().map(|s| s.input_ids.len()).collect();
    lengths.sort_unstable();
    let mut skipped = BTreeMap::new();
    for s in &skipped_list {
        *skipped.entry(reason_category(&s.reason)).or_insert(0) += 1;
    }
    let validation = split_summaries.pop().unwrap_or(SplitSummary {
        rows: 0,
        shards: 0,
        bytes: 0,
    });
    let train = split_summaries.pop().unwrap_or(SplitSummary {
        rows: 0,
        shards: 0,
        bytes: 0,
    });
    Ok(PrepareSummary {
        out_dir,
        records_in: total + read.skipped.len(),
        kept: samples.len(),
        train,
        validation,
        skipped,
        skip_examples: skipped_list.into_iter().take(5).collect(),
        truncated_inputs: read.truncated,
        tokens: lengths.iter().map(|&l| l as u64).sum(),
        loss_tokens: samples
            .iter()
            .map(|s| s.loss_mask.iter().map(|&m| m as u64).sum::<u64>())
            .sum(),
        cut,
        max_len: opts.max_len,
        length_percentiles: [
            percentile(&lengths, 0.5),
            percentile(&lengths, 0.9),
            percentile(&lengths, 0.99),
            lengths.last().copied().unwrap_or(0),
        ],
        seconds: started.elapsed().as_secs_f64(),
    })
}

impl std::fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "prepare-data: {} records in, {} kept",
            self.records_in, self.kept
        )?;
        for t in &self.truncated_inputs {
            writeln!(f, "  {t}")?;
        }
        let skipped: usize = self.skipped.values().sum();
        if skipped > 0 {
            let parts: Vec<String> = self
                .skipped
                .iter()
                .map(|(r, n)| format!("{r}: {n}"))
                .collect();
            writeln!(f, "  skipped {skipped} ({})", parts.join(", "))?;
            for s in &self.skip_examples {
                writeln!(f, "    e.g. {}: {}", s.origin, s.reason)?;
            }
        }
        writeln!(
            f,
            "  tokens: {} (loss-mask share {:.1} %); {} samples were cut to {} tokens",
            self.tokens,
            100.0 * self.loss_tokens as f64 / self.tokens.max(1) as f64,
            self.cut,
            self.max_len
        )?;
        let [p50, p90, p99, max] = self.length_percentiles;
        writeln!(
            f,
            "  sample length: p50 {p50}, p90 {p90}, p99 {p99}, max {max}"
        )?;
        write!(
            f,
            "  wrote {}: train {} rows in {} shard(s), validation {} rows in {} shard(s), {:.1} MiB, in {:.1} s",
            self.out_dir.display(),
            self.train.rows,
            self.train.shards,
            self.validation.rows,
            self.validation.shards,
            (self.train.bytes + self.validation.bytes) as f64 / (1u64 << 20) as f64,
            self.seconds
        )
    }
}
