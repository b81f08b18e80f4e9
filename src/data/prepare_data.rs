//! The whole `prepare-data` run: read inputs, tokenise on every core, split off validation,
//! write a `DatasetDict` in the `save_to_disk` layout, summarise. With `--limit N` only the
//! first N usable records (in input order) are kept: records are tokenised in chunks of about
//! what is still needed, and reading and tokenising stop once N are kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use indicatif::ProgressBar;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

use super::arrow_io::{write_split, SplitSummary, TokenRow};
use super::chat::{read_input, ChatRecord, ReadOutcome, Skip};
use super::tokenise_chat::{prepare_record, PreparedSample};
use crate::fsutil::{write_json, StagedDir};
use crate::text::TextTokenizer;

/// Options of `prepare-data`.
#[derive(Debug, Clone)]
pub(crate) struct PrepareOptions {
    pub max_len: usize,
    pub shard_rows: usize,
    pub val_fraction: f64,
    pub seed: u64,
    /// Keep only the first this many usable records (in input order).
    pub limit: Option<usize>,
    /// Progress: the bar counts the records tokenised, its length grows by the records handed
    /// to tokenising (each input's, or with `limit` about what is still needed); when it is
    /// hidden (stderr is not a terminal), a line every 2 s on stderr instead. `None`: silent.
    pub progress: Option<ProgressBar>,
}

/// What `prepare-data` did.
#[derive(Debug, Clone)]
pub(crate) struct PrepareSummary {
    pub out_dir: PathBuf,
    /// Records looked at (with `limit`: up to the last one kept).
    pub records_in: usize,
    pub kept: usize,
    /// `limit`, and whether it was reached.
    pub limit: Option<usize>,
    pub limit_reached: bool,
    pub train: SplitSummary,
    pub validation: SplitSummary,
    /// reason -> count
    pub skipped: BTreeMap<String, usize>,
    /// Examples with file, row and the start of the record: the first of every reason, and
    /// more of the first skips up to [`SKIP_EXAMPLES`] in all, in input order.
    pub skip_examples: Vec<Skip>,
    /// Turns with empty content in the kept records, and how many records have them.
    pub empty_turns: EmptyTurns,
    pub truncated_inputs: Vec<String>,
    pub tokens: u64,
    pub loss_tokens: u64,
    pub cut: usize,
    pub max_len: usize,
    pub mean_length: f64,
    /// p50, p90, p99, max of sample lengths
    pub length_percentiles: [usize; 4],
    pub seconds: f64,
}

/// How many skips the summary shows, at least (one of every reason is always shown).
const SKIP_EXAMPLES: usize = 5;

/// Turns with empty (or blank) content in the kept records: kept as they are, but worth
/// knowing about (a hand-written conversation with a forgotten answer trains on nothing but
/// an end-of-turn token there).
#[derive(Debug, Clone, Default)]
pub(crate) struct EmptyTurns {
    pub turns: usize,
    pub records: usize,
    /// The first such record (`file:row`).
    pub first: Option<String>,
}

/// The skips the summary shows: the first of every reason, then the first others up to
/// [`SKIP_EXAMPLES`] in all, in input order.
fn skip_examples(skipped: &[Skip]) -> Vec<Skip> {
    let mut seen = std::collections::BTreeSet::new();
    let mut first_of_reason: Vec<bool> = skipped
        .iter()
        .map(|s| seen.insert(s.reason.category()))
        .collect();
    let mut room = SKIP_EXAMPLES.saturating_sub(seen.len());
    for shown in first_of_reason.iter_mut() {
        if !*shown && room > 0 {
            *shown = true;
            room -= 1;
        }
    }
    skipped
        .iter()
        .zip(first_of_reason)
        .filter(|(_, shown)| *shown)
        .map(|(s, _)| s.clone())
        .collect()
}

fn percentile(sorted: &[usize], p: f64) -> usize {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

/// Samples and skips in input order.
#[derive(Default)]
struct Collected {
    samples: Vec<PreparedSample>,
    skipped: Vec<Skip>,
    records_in: usize,
    cut: usize,
    empty_turns: EmptyTurns,
    truncated: Vec<String>,
}

impl Collected {
    fn full(&self, limit: Option<usize>) -> bool {
        limit.is_some_and(|n| self.samples.len() >= n)
    }

    /// Tokenises the records of one input in order (in parallel, in chunks when there is a
    /// limit) and adds them and the input's read skips, in input order, until the limit.
    fn take(&mut self, tokenizer: &TextTokenizer, read: ReadOutcome, opts: &PrepareOptions) {
        let ReadOutcome {
            records,
            skipped,
            skipped_after,
            ..
        } = read;
        let mut skips = skipped.into_iter().zip(skipped_after).peekable();
        let total = records.len();
        let done = AtomicUsize::new(0);
        let last_report = std::sync::Mutex::new(Instant::now());
        let bar = opts.progress.as_ref();
        let lines = bar.is_some_and(|b| b.is_hidden());
        let tokenise = |r: &ChatRecord| {
            let out = prepare_record(tokenizer, r, opts.max_len);
            let n = done.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(bar) = bar {
                bar.inc(1);
            }
            if lines {
                if let Ok(mut last) = last_report.try_lock() {
                    if last.elapsed() > Duration::from_secs(2) {
                        *last = Instant::now();
                        eprintln!("prepare-data: tokenised {n}/{total} records");
                    }
                }
            }
            out
        };
        let mut start = 0;
        while start < total && !self.full(opts.limit) {
            // With a limit: what is still needed, plus a margin for skips.
            let chunk = match opts.limit {
                Some(n) => {
                    let need = n - self.samples.len();
                    (need + need / 16 + 64).min(total - start)
                }
                None => total - start,
            };
            if let Some(bar) = bar {
                bar.inc_length(chunk as u64);
            }
            let results: Vec<_> = records[start..start + chunk]
                .par_iter()
                .map(&tokenise)
                .collect();
            for (i, result) in results.into_iter().enumerate() {
                let index = start + i;
                while let Some((skip, _)) = skips.next_if(|(_, after)| *after <= index) {
                    self.records_in += 1;
                    self.skipped.push(skip);
                }
                self.records_in += 1;
                match result {
                    Ok(s) => {
                        self.cut += s.was_cut as usize;
                        if s.empty_turns > 0 {
                            let empty = &mut self.empty_turns;
                            empty.turns += s.empty_turns;
                            empty.records += 1;
                            empty
                                .first
                                .get_or_insert_with(|| records[index].origin.clone());
                        }
                        self.samples.push(s);
                    }
                    Err(reason) => self.skipped.push(Skip {
                        origin: records[index].origin.clone(),
                        excerpt: records[index].excerpt.clone(),
                        reason,
                    }),
                }
                if self.full(opts.limit) {
                    return;
                }
            }
            start += chunk;
        }
        for (skip, _) in skips {
            self.records_in += 1;
            self.skipped.push(skip);
        }
    }
}

pub(crate) fn prepare_data(
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
    if opts.limit == Some(0) {
        bail!("--limit must be at least 1");
    }
    let tokenizer = TextTokenizer::from_model_dir(tokenizer_dir)?;
    let acc = collect(&tokenizer, inputs, opts)?;
    let Collected {
        samples,
        skipped: skipped_list,
        records_in,
        cut,
        empty_turns,
        truncated,
    } = acc;
    if samples.is_empty() {
        bail!(
            "no record could be used ({} skipped, e.g. {}: {})",
            skipped_list.len(),
            skipped_list[0].origin,
            skipped_list[0].reason
        );
    }
    let (out_dir, mut split_summaries) = write_splits(out_dir, &samples, opts)?;

    let mut lengths: Vec<usize> = samples.iter().map(|s| s.input_ids.len()).collect();
    lengths.sort_unstable();
    let mut skipped = BTreeMap::new();
    for s in &skipped_list {
        // by category (the detail stays in the examples)
        *skipped.entry(s.reason.category()).or_insert(0) += 1;
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
        records_in,
        kept: samples.len(),
        limit: opts.limit,
        limit_reached: opts.limit == Some(samples.len()),
        train,
        validation,
        skipped,
        skip_examples: skip_examples(&skipped_list),
        empty_turns,
        truncated_inputs: truncated,
        tokens: lengths.iter().map(|&l| l as u64).sum(),
        loss_tokens: samples
            .iter()
            .map(|s| s.loss_mask.iter().map(|&m| m as u64).sum::<u64>())
            .sum(),
        cut,
        max_len: opts.max_len,
        mean_length: lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64,
        length_percentiles: [
            percentile(&lengths, 0.5),
            percentile(&lengths, 0.9),
            percentile(&lengths, 0.99),
            lengths.last().copied().unwrap_or(0),
        ],
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Reads and tokenises the inputs in order, until `opts.limit` samples are kept; refuses
/// inputs without a usable record.
fn collect(
    tokenizer: &TextTokenizer,
    inputs: &[PathBuf],
    opts: &PrepareOptions,
) -> Result<Collected> {
    let mut acc = Collected::default();
    let mut records_read = 0;
    for input in inputs {
        if acc.full(opts.limit) {
            break;
        }
        let mut read = ReadOutcome::default();
        if let Some(bar) = &opts.progress {
            // The name only: the bar has one line.
            let name = input.file_name().unwrap_or(input.as_os_str());
            bar.set_message(name.to_string_lossy().into_owned());
        }
        read_input(input, &mut read)?;
        records_read += read.records.len();
        acc.truncated.extend(read.truncated.iter().cloned());
        acc.take(tokenizer, read, opts);
    }
    if records_read == 0 {
        let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        bail!(
            "{}: no usable records ({} skipped{})",
            names.join(", "),
            acc.skipped.len(),
            acc.skipped
                .first()
                .map(|s| format!(", e.g. {}: {}", s.origin, s.reason))
                .unwrap_or_default()
        );
    }
    Ok(acc)
}

/// Writes the samples to `out_dir` (which appears whole, or not at all) as a train and a
/// validation split; returns the folder and the two splits' summaries.
fn write_splits(
    out_dir: &Path,
    samples: &[PreparedSample],
    opts: &PrepareOptions,
) -> Result<(PathBuf, Vec<SplitSummary>)> {
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
    Ok((staged.commit()?, split_summaries))
}

impl std::fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "prepare-data: {} records in, {} kept{}",
            self.records_in,
            self.kept,
            match self.limit {
                Some(n) if self.limit_reached => format!(" (the first {n} usable: --limit {n})"),
                Some(n) => format!(" (fewer than --limit {n}: the inputs ran out)"),
                None => String::new(),
            }
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
                writeln!(f, "         {}", s.excerpt)?;
            }
        }
        let empty = &self.empty_turns;
        if let Some(first) = &empty.first {
            writeln!(
                f,
                "  {} turn(s) with empty content in {} kept record(s), rendered as they are (e.g. {first})",
                empty.turns, empty.records
            )?;
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
            "  sample length: mean {:.0}, p50 {p50}, p90 {p90}, p99 {p99}, max {max}",
            self.mean_length
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
