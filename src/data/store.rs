//! The in-memory token store: every sample's tokens and loss mask in two flat arrays with
//! offsets, so that any sample is two slices away (O(1), no Arrow access on the hot path).

use std::path::Path;

use anyhow::{bail, Result};

use super::arrow_io::{read_token_data, TokenData};

/// Column names of a dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataColumns {
    pub input_ids: String,
    /// `None`: every token counts for the loss.
    pub loss_mask: Option<String>,
}

impl Default for DataColumns {
    fn default() -> Self {
        DataColumns {
            input_ids: "input_ids".into(),
            loss_mask: Some("loss_mask".into()),
        }
    }
}

/// Rules applied while loading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Longer samples are cut to this many tokens.
    pub max_len: usize,
    /// Samples with fewer loss tokens (after the cut) are dropped; DFlash uses 2 * block size.
    pub min_loss_tokens: usize,
    /// Keep at most this many samples, the first usable ones in file order (0 = all).
    pub max_samples: usize,
}

/// What loading did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadReport {
    pub rows: usize,
    pub kept: usize,
    pub cut: usize,
    pub dropped_short: usize,
    pub tokens: u64,
    pub loss_tokens: u64,
    /// Rows past the `max_samples` limit (not read).
    pub not_read: usize,
}

/// One sample: token ids and loss mask of equal length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample<'a> {
    pub input_ids: &'a [u32],
    pub loss_mask: &'a [u8],
}

/// All samples of a dataset, flat.
#[derive(Debug, Clone, Default)]
pub struct TokenStore {
    tokens: Vec<u32>,
    masks: Vec<u8>,
    offsets: Vec<usize>,
    /// Row of the source dataset each sample came from.
    rows: Vec<u32>,
}

impl TokenStore {
    /// Reads, validates and stores the dataset at `path`.
    pub fn load(
        path: &Path,
        columns: &DataColumns,
        opts: &StoreOptions,
    ) -> Result<(Self, LoadReport)> {
        let data = read_token_data(path, &columns.input_ids, columns.loss_mask.as_deref())?;
        Self::from_data(&data, opts)
    }

    /// Validates (ids below the vocabulary) and applies the cut and drop rules.
    pub(crate) fn from_data(data: &TokenData, opts: &StoreOptions) -> Result<(Self, LoadReport)> {
        let mut store = TokenStore {
            tokens: Vec::with_capacity(data.ids.tokens.len()),
            masks: Vec::with_capacity(data.ids.tokens.len()),
            offsets: vec![0],
            rows: Vec::new(),
        };
        let mut report = LoadReport {
            rows: data.ids.len(),
            ..Default::default()
        };
        for row in 0..data.ids.len() {
            if opts.max_samples > 0 && store.len() >= opts.max_samples {
                report.not_read = data.ids.len() - row;
                break;
            }
            let (start, end) = (data.ids.offsets[row], data.ids.offsets[row + 1]);
            let ids = &data.ids.tokens[start..end];
            if let Some((k, bad)) = ids
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= opts.vocab_size)
            {
                bail!(
                    "{}: token {k} has id {bad}, outside the vocabulary of {} tokens",
                    data.locate(row),
                    opts.vocab_size
                );
            }
            let keep = ids.len().min(opts.max_len);
            let ids = &ids[..keep];
            let ones;
            let mask: &[u8] = match &data.masks {
                Some(m) => &m[start..start + keep],
                None => {
                    ones = vec![1u8; keep];
                    &ones
                }
            };
            let loss: usize = mask.iter().map(|&m| m as usize).sum();
            if loss < opts.min_loss_tokens {
                report.dropped_short += 1;
                continue;
            }
            if keep < end - start {
                report.cut += 1;
            }
            store.tokens.extend_from_slice(ids);
            store.masks.extend_from_slice(mask);
            store.offsets.push(store.tokens.len());
            store.rows.push(row as u32);
            report.tokens += keep as u64;
            report.loss_tokens += loss as u64;
        }
        report.kept = store.len();
        Ok((store, report))
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, i: usize) -> Sample<'_> {
        let (s, e) = (self.offsets[i], self.offsets[i + 1]);
        Sample {
            input_ids: &self.tokens[s..e],
            loss_mask: &self.masks[s..e],
        }
    }

    #[inline]
    pub fn sample_len(&self, i: usize) -> usize {
        self.offsets[i + 1] - self.offsets[i]
    }

    /// The source row of sample `i`.
    pub fn source_row(&self, i: usize) -> usize {
        self.rows[i] as usize
    }

    /// Bytes held.
    pub fn memory_bytes(&self) -> usize {
        self.tokens.len() * 4 + self.masks.len() + self.offsets.len() * 8 + self.rows.len() * 4
    }
}
