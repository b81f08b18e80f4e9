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

/// The files that make up a dataset at `path`, in order.
pub fn dataset_files(path: &Path) -> Result<Vec<PathBuf>> {
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

/// Reads every record batch of one Arrow IPC (file or stream) or Parquet file.
pub fn read_batches(path: &Path) -> Result<Vec<RecordBatch>> {
    let mut file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut magic = [0u8; 6];
    let n = file.read(&mut magic).unwrap_or(0);
    drop(file);
    let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let batches: std::result::Result<Vec<RecordBatch>, arrow::error::ArrowError> = if n >= 4
        && &magic[..4] == b"PAR1"
    {
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .with_context(|| format!("{}: not a readable Parquet file", path.display()))?
            .build()
            .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
        reader.collect()
    } else if n == 6 && &magic == b"ARROW1" {
        arrow::ipc::reader::FileReader::try_new(file, None)
            .with_context(|| format!("{}: not a readable Arrow IPC file", path.display()))?
            .collect()
    } else {
        arrow::ipc::reader::StreamReader::try_new(BufReader::new(file), None)
            .with_context(|| {
                format!(
                    "{}: neither Parquet, nor an Arrow IPC file or stream",
                    path.display()
                )
            })?
            .collect()
    };
    batches.with_context(|| format!("{}: cannot read record batches", path.display()))
}

fn append_lists<O: arrow::array::OffsetSizeTrait>(
    list: &arrow::array::GenericListArray<O>,
    out: &mut TokenColumn,
    where_: &dyn Fn(usize) -> String,
) -> Result<()> {
    let values: &ArrayRef = list.values();
    let as_u32: Vec<Option<u32>> = match values.data_type() {
        DataType::Int32 => values
            .as_primitive::<Int32Type>()
            .iter()
            .map(|v| v.and_then(|x| u32::try_from(x).ok()))
            .collect(),
        DataType::Int64 => values
            .as_primitive::<Int64Type>()
            .iter()
            .map(|v| v.and_then(|x| u32::try_from(x).ok()))
            .collect(),
        DataType::UInt32 => values.as_primitive::<UInt32Type>().iter().collect(),
        other => bail!(
            "{}: the list items are {other}, expected int32, int64 or uint32",
            where_(0)
        ),
    };
    let offsets = list.value_offsets();
    for row in 0..list.len() {
        if list.is_null(row) {
            bail!("{}: the list is null", where_(row));
        }
        let (start, end) = (offsets[row].as_usize(), offsets[row + 1].as_usize());
        for (k, v) in as_u32[start..end].iter().enumerate() {
            match v {
                Some(t) => out.tokens.push(*t),
                None => bail!(
                    "{}: item {k} is null or negative or too large for a token id",
                    where_(row)
                ),
            }
        }
        out.offsets.push(out.tokens.len());
    }
    Ok(())
}

/// Reads the list column `column` of the dataset at `path` (file or folder).
pub fn read_token_column(path: &Path, column: &str) -> Result<TokenColumn> {
    let mut out = TokenColumn::new();
    for file in dataset_files(path)? {
        let mut row_base = 0usize;
        for batch in read_batches(&file)? {
            let col = batch.column_by_name(column).with_context(|| {
                let names: Vec<String> = batch
                    .schema()
                    .fields()
                    .iter()
                    .map(|f| f.name().clone())
                    .collect();
                format!(
                    "{}: no column {column:?} (columns: {})",
                    file.display(),
                    names.join(", ")
                )
            })?;
            let where_ = |row: usize| {
                format!(
                    "{}: column {column:?}, row {}",
                    file.display(),
                    row_base + row
                )
            };
            if let Some(list) = col.as_list_opt::<i32>() {
                append_lists(list, &mut out, &where_)?;
            } else if let Some(list) = col.as_list_opt::<i64>() {
                append_lists(list, &mut out, &where_)?;
            } else {
                bail!(
                    "{}: column {column:?} has type {}, expected a list of integers",
                    file.display(),
                    col.data_type()
                );
            }
            row_base += batch.num_rows();
        }
    }
    Ok(out)
}
