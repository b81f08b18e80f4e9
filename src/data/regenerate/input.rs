//! The input of `regenerate`: every split of a tokenised dataset, checked against the target's
//! vocabulary.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use twox_hash::XxHash3_128;

use crate::data::arrow_io::{
    dataset_files, read_string_column, read_token_data, split_names, TokenData,
};
use crate::model::TargetConfig;

/// One input split.
pub(super) struct SplitInput {
    pub(super) name: String,
    pub(super) data: TokenData,
    pub(super) ids: Vec<String>,
    /// Rows used (after --limit).
    pub(super) rows: usize,
}

impl SplitInput {
    pub(super) fn row(&self, r: usize) -> (&[u32], &[u8]) {
        let (s, e) = (self.data.ids.offsets[r], self.data.ids.offsets[r + 1]);
        let masks = self.data.masks.as_deref().unwrap_or(&[]);
        (&self.data.ids.tokens[s..e], &masks[s..e])
    }

    pub(super) fn chunks(&self, chunk_rows: usize) -> usize {
        self.rows.div_ceil(chunk_rows)
    }

    /// XXH3-128 of the rows used, in order: each row's id, token ids and loss mask, each with
    /// its length. A resumed run compares it with the manifest's, so that an input rewritten
    /// in place (same files, same sizes, other tokens or masks) is not continued.
    pub(super) fn fingerprint(&self) -> String {
        let mut h = XxHash3_128::new();
        let mut bytes = Vec::new();
        for r in 0..self.rows {
            let (ids, mask) = self.row(r);
            let id = self.ids[r].as_bytes();
            bytes.clear();
            bytes.extend_from_slice(&(id.len() as u64).to_le_bytes());
            bytes.extend_from_slice(id);
            bytes.extend_from_slice(&(ids.len() as u64).to_le_bytes());
            bytes.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
            bytes.extend_from_slice(&(mask.len() as u64).to_le_bytes());
            bytes.extend_from_slice(mask);
            h.write(&bytes);
        }
        format!("{:032x}", h.finish_128())
    }
}

/// Reads every split of the input (a dataset with splits, or one split / file).
pub(super) fn read_input(
    input: &Path,
    config: &TargetConfig,
    limit: Option<usize>,
) -> Result<Vec<SplitInput>> {
    if !input.exists() {
        bail!("{}: no such file or folder", input.display());
    }
    let named: Vec<(String, PathBuf)> = match split_names(input)? {
        Some(names) => names
            .into_iter()
            .map(|n| (n.clone(), input.join(n)))
            .collect(),
        None => vec![("train".to_string(), input.to_path_buf())],
    };
    if named.is_empty() {
        bail!("{}: the dataset lists no splits", input.display());
    }
    let mut out = Vec::new();
    for (name, path) in named {
        dataset_files(&path)?;
        let data = read_token_data(&path, "input_ids", Some("loss_mask"))?;
        let total = data.ids.len();
        let ids = read_string_column(&path, "id")?
            .unwrap_or_else(|| (0..total).map(|r| r.to_string()).collect());
        if ids.len() != total {
            bail!(
                "{}: column \"id\" has {} rows but \"input_ids\" has {total}",
                path.display(),
                ids.len()
            );
        }
        let rows = limit.map_or(total, |l| l.min(total));
        let vocab = config.vocab_size.max(0) as u64;
        for r in 0..rows {
            if let Some((k, &bad)) = data
                .ids
                .get(r)
                .iter()
                .enumerate()
                .find(|(_, &t)| t as u64 >= vocab)
            {
                bail!(
                    "{}: token {k} has id {bad}, outside the target's vocabulary of {vocab} tokens",
                    data.locate(r)
                );
            }
        }
        out.push(SplitInput {
            name,
            data,
            ids,
            rows,
        });
    }
    Ok(out)
}
