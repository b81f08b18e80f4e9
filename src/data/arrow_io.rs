//! Reading token columns from the files Hugging Face `datasets` and friends write: Arrow IPC
//! (file or stream format), a `save_to_disk` folder (Arrow stream shards listed in
//! state.json), or Parquet. A column is a list (or large list) of int32, int64 or uint32.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Int32Type, Int64Type, UInt32Type};

/// Token lists stored flat: sequence `i` is `tokens[offsets[i]..offsets[i + 1]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenColumn {
    pub tokens: Vec<u32>,
    pub offsets: Vec<usize>,
}

impl TokenColumn {
    pub fn new() -> Self {
        TokenColumn {
            tokens: Vec::new(),
            offsets: vec![0],
        }
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> &[u32] {
        &self.tokens[self.offsets[i]..self.offsets[i + 1]]
    }

    pub fn push(&mut self, seq: &[u32]) {
        self.tokens.extend_from_slice(seq);
        self.offsets.push(self.tokens.len());
    }

    pub fn iter(&self) -> impl Iterator<Item = &[u32]> {
        (0..self.len()).map(|i| self.get(i))
    }
}

/// A `DatasetDict` folder (with `dataset_dict.json`) stands for one of its splits: `split`, or
/// "train" when none is named. Any other path stands for itself.
pub(crate) fn resolve_split(path: &Path, split: Option<&str>) -> Result<PathBuf> {
    let dict = path.join("dataset_dict.json");
    if !dict.is_file() {
        if let Some(s) = split {
            bail!(
                "{}: not a dataset with splits (no dataset_dict.json), cannot pick split {s:?}",
                path.display()
            );
        }
        return Ok(path.to_path_buf());
    }
    let text = std::fs::read_to_string(&dict)
        .with_context(|| format!("{}: cannot read", dict.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", dict.display()))?;
    let splits: Vec<String> = value
        .get("splits")
        .and_then(|s| s.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let want = split.unwrap_or("train");
    if !splits.iter().any(|s| s == want) {
        bail!(
            "{}: no split {want:?} (splits: {})",
            dict.display(),
            splits.join(", ")
        );
    }
    Ok(path.join(want))
}

/// The split names listed in `path/dataset_dict.json`, or `None` when `path` is not a dataset
/// with splits.
pub(crate) fn split_names(path: &Path) -> Result<Option<Vec<String>>> {
    let dict = path.join("dataset_dict.json");
    if !dict.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&dict)
        .with_context(|| format!("{}: cannot read", dict.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", dict.display()))?;
    let list = value
        .get("splits")
        .and_then(|s| s.as_array())
        .with_context(|| format!("{}: no \"splits\" list", dict.display()))?;
    let mut names = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        let name = s
            .as_str()
            .with_context(|| format!("{}: splits[{i}] is not a string", dict.display()))?;
        names.push(name.to_string());
    }
    Ok(Some(names))
}

/// The files that make up a dataset at `path`, in order.
pub(crate) fn dataset_files(path: &Path) -> Result<Vec<PathBuf>> {
    let path = &resolve_split(path, None)?;
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !path.is_dir() {
        bail!("{}: no such file or folder", path.display());
    }
    let state = path.join("state.json");
    if state.is_file() {
        let text = std::fs::read_to_string(&state)
            .with_context(|| format!("{}: cannot read", state.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", state.display()))?;
        let files = value
            .get("_data_files")
            .and_then(|f| f.as_array())
            .with_context(|| format!("{}: no \"_data_files\" list", state.display()))?;
        let mut out = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let name = f
                .get("filename")
                .and_then(|n| n.as_str())
                .with_context(|| {
                    format!("{}: _data_files[{i}] has no filename", state.display())
                })?;
            out.push(path.join(name));
        }
        return Ok(out);
    }
    // A folder without state.json: its .arrow or .parquet files in name order.
    let mut out: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("{}: cannot list", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "arrow" || e == "parquet")
        })
        .collect();
    out.sort();
    if out.is_empty() {
        bail!(
            "{}: no state.json and no .arrow or .parquet files: not a dataset folder",
            path.display()
        );
    }
    Ok(out)
}

/// The record batches of one file, read one at a time.
pub(crate) type BatchReader =
    Box<dyn Iterator<Item = std::result::Result<RecordBatch, arrow::error::ArrowError>>>;

/// Opens one Arrow IPC (file or stream) or Parquet file for reading its record batches in
/// order (the schema is read here, the data as the batches are taken).
pub(crate) fn batch_reader(path: &Path) -> Result<BatchReader> {
    let mut file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut magic = [0u8; 6];
    let n = file.read(&mut magic).unwrap_or(0);
    drop(file);
    let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    Ok(if n >= 4 && &magic[..4] == b"PAR1" {
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .with_context(|| format!("{}: not a readable Parquet file", path.display()))?
            .build()
            .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
        Box::new(reader)
    } else if n == 6 && &magic == b"ARROW1" {
        Box::new(
            arrow::ipc::reader::FileReader::try_new(file, None)
                .with_context(|| format!("{}: not a readable Arrow IPC file", path.display()))?,
        )
    } else {
        Box::new(
            arrow::ipc::reader::StreamReader::try_new(BufReader::new(file), None).with_context(
                || {
                    format!(
                        "{}: neither Parquet, nor an Arrow IPC file or stream",
                        path.display()
                    )
                },
            )?,
        )
    })
}

/// Reads every record batch of one Arrow IPC (file or stream) or Parquet file.
pub fn read_batches(path: &Path) -> Result<Vec<RecordBatch>> {
    let batches: std::result::Result<Vec<RecordBatch>, arrow::error::ArrowError> =
        batch_reader(path)?.collect();
    batches.with_context(|| format!("{}: cannot read record batches", path.display()))
}

/// A list column of one record batch: row offsets into `values`.
pub(crate) struct ListColumn {
    pub offsets: Vec<usize>,
    pub values: ArrayRef,
}

/// Why a list column could not be read. Callers branch on [`ColumnError::Missing`] (a file
/// without `input_ids` is not a prepared dataset); the error reaches them inside an
/// `anyhow::Error`, where `downcast_ref::<ColumnError>()` finds it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ColumnError {
    #[error("{}: no column {column:?} (columns: {})", file.display(), columns.join(", "))]
    Missing {
        file: PathBuf,
        column: String,
        /// The columns the file has.
        columns: Vec<String>,
    },
    #[error("{}: column {column:?}, row {row}: the list is null", file.display())]
    NullList {
        file: PathBuf,
        column: String,
        row: usize,
    },
    #[error("{}: column {column:?} has type {data_type}, expected a list of integers", file.display())]
    NotAList {
        file: PathBuf,
        column: String,
        data_type: DataType,
    },
}

impl ColumnError {
    /// Whether this is the column `name` missing.
    pub(crate) fn is_missing(&self, name: &str) -> bool {
        matches!(self, ColumnError::Missing { column, .. } if column == name)
    }
}

pub(crate) fn list_column(
    batch: &RecordBatch,
    file: &Path,
    column: &str,
) -> std::result::Result<ListColumn, ColumnError> {
    let Some(col) = batch.column_by_name(column) else {
        return Err(ColumnError::Missing {
            file: file.to_path_buf(),
            column: column.to_string(),
            columns: batch
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect(),
        });
    };
    let nulls = |row: Option<usize>| match row {
        Some(row) => Err(ColumnError::NullList {
            file: file.to_path_buf(),
            column: column.to_string(),
            row,
        }),
        None => Ok(()),
    };
    if let Some(list) = col.as_list_opt::<i32>() {
        nulls((0..list.len()).find(|&r| list.is_null(r)))?;
        Ok(ListColumn {
            offsets: list.value_offsets().iter().map(|&o| o as usize).collect(),
            values: list.values().clone(),
        })
    } else if let Some(list) = col.as_list_opt::<i64>() {
        nulls((0..list.len()).find(|&r| list.is_null(r)))?;
        Ok(ListColumn {
            offsets: list.value_offsets().iter().map(|&o| o as usize).collect(),
            values: list.values().clone(),
        })
    } else {
        Err(ColumnError::NotAList {
            file: file.to_path_buf(),
            column: column.to_string(),
            data_type: col.data_type().clone(),
        })
    }
}

/// Integer list items as i64 (None for nulls).
fn items_i64(values: &ArrayRef, file: &Path, column: &str) -> Result<Vec<Option<i64>>> {
    use arrow::datatypes::{Int8Type, UInt8Type};
    Ok(match values.data_type() {
        DataType::Int8 => values.as_primitive::<Int8Type>().iter().map(|v| v.map(i64::from)).collect(),
        DataType::UInt8 => values.as_primitive::<UInt8Type>().iter().map(|v| v.map(i64::from)).collect(),
        DataType::Int32 => values.as_primitive::<Int32Type>().iter().map(|v| v.map(i64::from)).collect(),
        DataType::Int64 => values.as_primitive::<Int64Type>().iter().collect(),
        DataType::UInt32 => values.as_primitive::<UInt32Type>().iter().map(|v| v.map(i64::from)).collect(),
        DataType::Boolean => values.as_boolean().iter().map(|v| v.map(i64::from)).collect(),
        other => bail!(
            "{}: column {column:?} holds lists of {other}, expected int8, int32, int64, uint32 or bool",
            file.display()
        ),
    })
}

/// Token sequences and, when asked for, their loss masks, stored flat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenData {
    pub ids: TokenColumn,
    /// Same length as `ids.tokens` when a mask column was read.
    pub masks: Option<Vec<u8>>,
    /// The files read, each with the index of its first row.
    pub sources: Vec<(PathBuf, usize)>,
}

impl TokenData {
    /// `file: row r` for a global row index.
    pub(crate) fn locate(&self, row: usize) -> String {
        match self.sources.iter().rev().find(|(_, first)| *first <= row) {
            Some((file, first)) => format!("{}: row {}", file.display(), row - first),
            None => format!("row {row}"),
        }
    }
}

/// Reads the token list column `ids_column` (and the 0/1 list column `mask_column`, which must
/// have the same lengths) of the dataset at `path` (file or folder).
pub fn read_token_data(
    path: &Path,
    ids_column: &str,
    mask_column: Option<&str>,
) -> Result<TokenData> {
    let mut out = TokenData {
        ids: TokenColumn::new(),
        masks: mask_column.map(|_| Vec::new()),
        sources: Vec::new(),
    };
    for file in dataset_files(path)? {
        out.sources.push((file.clone(), out.ids.len()));
        let mut row_base = 0usize;
        for batch in read_batches(&file)? {
            let ids = list_column(&batch, &file, ids_column)?;
            let id_items = items_i64(&ids.values, &file, ids_column)?;
            let mask = match mask_column {
                Some(m) => {
                    let col = list_column(&batch, &file, m)?;
                    let items = items_i64(&col.values, &file, m)?;
                    Some((m, col, items))
                }
                None => None,
            };
            for row in 0..batch.num_rows() {
                let at = || format!("{}: row {}", file.display(), row_base + row);
                let (start, end) = (ids.offsets[row], ids.offsets[row + 1]);
                for (k, v) in id_items[start..end].iter().enumerate() {
                    match v.and_then(|x| u32::try_from(x).ok()) {
                        Some(t) => out.ids.tokens.push(t),
                        None => bail!(
                            "{}, column {ids_column:?}: item {k} is {} (token ids must be non-negative integers)",
                            at(),
                            v.map(|x| x.to_string()).unwrap_or_else(|| "null".into())
                        ),
                    }
                }
                out.ids.offsets.push(out.ids.tokens.len());
                if let (Some((name, col, items)), Some(masks)) = (&mask, out.masks.as_mut()) {
                    let (ms, me) = (col.offsets[row], col.offsets[row + 1]);
                    if me - ms != end - start {
                        bail!(
                            "{}: column {name:?} has {} items but {ids_column:?} has {}",
                            at(),
                            me - ms,
                            end - start
                        );
                    }
                    for (k, v) in items[ms..me].iter().enumerate() {
                        match v {
                            Some(0) => masks.push(0),
                            Some(1) => masks.push(1),
                            other => bail!(
                                "{}, column {name:?}: item {k} is {}, expected 0 or 1",
                                at(),
                                other.map_or("null".into(), |x| x.to_string())
                            ),
                        }
                    }
                }
            }
            row_base += batch.num_rows();
        }
    }
    Ok(out)
}

/// Reads only the token list column `column` of the dataset at `path`.
pub fn read_token_column(path: &Path, column: &str) -> Result<TokenColumn> {
    Ok(read_token_data(path, column, None)?.ids)
}

/// The string column `column` of the dataset at `path` (file or folder), one entry per row, or
/// `None` when its files have no such column. Integer ids are written out in decimal; a null
/// entry becomes the row number.
pub fn read_string_column(path: &Path, column: &str) -> Result<Option<Vec<String>>> {
    use arrow::datatypes::{Int64Type, UInt64Type};
    let mut out = Vec::new();
    let mut found = false;
    for file in dataset_files(path)? {
        for batch in read_batches(&file)? {
            let Some(col) = batch.column_by_name(column) else {
                out.extend((out.len()..out.len() + batch.num_rows()).map(|r| r.to_string()));
                continue;
            };
            found = true;
            let base = out.len();
            let cell =
                |row: usize, v: Option<String>| v.unwrap_or_else(|| (base + row).to_string());
            match col.data_type() {
                DataType::Utf8 => out.extend(
                    col.as_string::<i32>()
                        .iter()
                        .enumerate()
                        .map(|(r, v)| cell(r, v.map(str::to_string))),
                ),
                DataType::LargeUtf8 => out.extend(
                    col.as_string::<i64>()
                        .iter()
                        .enumerate()
                        .map(|(r, v)| cell(r, v.map(str::to_string))),
                ),
                DataType::Int64 => out.extend(
                    col.as_primitive::<Int64Type>()
                        .iter()
                        .enumerate()
                        .map(|(r, v)| cell(r, v.map(|x| x.to_string()))),
                ),
                DataType::UInt64 => out.extend(
                    col.as_primitive::<UInt64Type>()
                        .iter()
                        .enumerate()
                        .map(|(r, v)| cell(r, v.map(|x| x.to_string()))),
                ),
                DataType::Int32 => out.extend(
                    col.as_primitive::<Int32Type>()
                        .iter()
                        .enumerate()
                        .map(|(r, v)| cell(r, v.map(|x| x.to_string()))),
                ),
                other => bail!(
                    "{}: column {column:?} has type {other}, expected strings or integers",
                    file.display()
                ),
            }
        }
    }
    Ok(found.then_some(out))
}

/// Writes rows (id, input_ids, loss_mask) as one Arrow IPC stream file, in record batches of
/// at most 1000 rows as `datasets` writes them; returns the bytes written.
pub(crate) fn write_token_rows(path: &Path, rows: &[TokenRow<'_>]) -> Result<u64> {
    use crate::fsutil::write_error;
    let batch = rows_batch(rows)?;
    let file = File::create(path).map_err(|e| write_error(path, e))?;
    let mut writer =
        arrow::ipc::writer::StreamWriter::try_new(std::io::BufWriter::new(file), &batch.schema())
            .map_err(|e| write_error(path, e))?;
    let mut batches = (0..batch.num_rows())
        .step_by(1000)
        .map(|start| batch.slice(start, 1000.min(batch.num_rows() - start)))
        .collect::<Vec<_>>();
    if batches.is_empty() {
        batches.push(batch);
    }
    for b in &batches {
        writer.write(b).map_err(|e| write_error(path, e))?;
    }
    writer.finish().map_err(|e| write_error(path, e))?;
    Ok(std::fs::metadata(path).map(|m| m.len()).unwrap_or(0))
}

/// One row to write: id, token ids, loss mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRow<'a> {
    pub id: &'a str,
    pub input_ids: &'a [u32],
    pub loss_mask: &'a [u8],
}

fn rows_batch(rows: &[TokenRow<'_>]) -> Result<RecordBatch> {
    use arrow::array::{Int32Builder, Int8Builder, ListBuilder, StringBuilder};
    use std::sync::Arc;
    let mut ids = StringBuilder::new();
    let mut tokens = ListBuilder::new(Int32Builder::new());
    let mut masks = ListBuilder::new(Int8Builder::new());
    for r in rows {
        ids.append_value(r.id);
        for &t in r.input_ids {
            let t = i32::try_from(t).context("token id above i32::MAX")?;
            tokens.values().append_value(t);
        }
        tokens.append(true);
        for &m in r.loss_mask {
            masks.values().append_value(m as i8);
        }
        masks.append(true);
    }
    Ok(RecordBatch::try_from_iter([
        ("id", Arc::new(ids.finish()) as ArrayRef),
        ("input_ids", Arc::new(tokens.finish()) as ArrayRef),
        ("loss_mask", Arc::new(masks.finish()) as ArrayRef),
    ])?)
}

/// What was written for one split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSummary {
    pub rows: usize,
    pub shards: usize,
    pub bytes: u64,
}

/// Writes one split in the `datasets` `save_to_disk` layout into the existing folder `dir`:
/// Arrow stream shards `data-0000i-of-0000n.arrow`, `dataset_info.json`, `state.json`.
pub fn write_split(
    dir: &Path,
    split: &str,
    rows: &[TokenRow<'_>],
    shard_rows: usize,
) -> Result<SplitSummary> {
    let shard_rows = shard_rows.max(1);
    let shards = rows.len().div_ceil(shard_rows).max(1);
    let mut files = Vec::new();
    let mut bytes = 0u64;
    for s in 0..shards {
        let name = format!("data-{s:05}-of-{shards:05}.arrow");
        let path = dir.join(&name);
        let chunk = &rows[(s * shard_rows).min(rows.len())..((s + 1) * shard_rows).min(rows.len())];
        bytes += write_token_rows(&path, chunk)?;
        files.push(serde_json::json!({"filename": name}));
    }
    let info = serde_json::json!({
        "builder_name": null, "citation": "", "config_name": null, "dataset_name": null,
        "description": "Tokenised chat data written by dflash-tui prepare-data",
        "homepage": "", "license": "",
        "splits": {split: {"name": split, "num_bytes": bytes, "num_examples": rows.len(), "dataset_name": null}},
        "dataset_size": bytes, "size_in_bytes": bytes,
        "supervised_keys": null, "version": null,
    });
    crate::fsutil::write_json(&dir.join("dataset_info.json"), &info)?;
    let fingerprint = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for r in rows {
            r.id.hash(&mut h);
            r.input_ids.hash(&mut h);
        }
        format!("{:016x}", h.finish())
    };
    let state = serde_json::json!({
        "_data_files": files,
        "_fingerprint": fingerprint,
        "_format_columns": null,
        "_format_kwargs": {},
        "_format_type": null,
        "_output_all_columns": false,
        "_split": split,
    });
    crate::fsutil::write_json(&dir.join("state.json"), &state)?;
    Ok(SplitSummary {
        rows: rows.len(),
        shards,
        bytes,
    })
}
