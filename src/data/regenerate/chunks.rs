//! The chunk store of `regenerate`: `<OUT>.partial/` holds a manifest of the input and options,
//! and per split the finished chunks (`chunk-NNNNN.arrow`, then its counts in
//! `chunk-NNNNN.json`: a chunk is done when its `.json` exists). A later run with the same
//! manifest continues from there; the finished chunks are assembled into the output.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::Kind;

use super::input::SplitInput;
use super::summary::RegenerateStats;
use super::RegenerateOptions;
use crate::data::arrow_io::{
    read_string_column, read_token_data, write_split, write_token_rows, SplitSummary, TokenColumn,
    TokenData, TokenRow,
};
use crate::fsutil::{remove_stale_staging, write_atomic, write_json, StagedDir};

/// A chunk: (index of its split, chunk number within the split).
pub(super) type ChunkId = (usize, usize);

/// What one chunk produced: rows in input order and the counts.
pub(super) struct ChunkOutput {
    pub(super) ids: Vec<String>,
    pub(super) tokens: Vec<Vec<u32>>,
    pub(super) masks: Vec<Vec<u8>>,
    pub(super) stats: RegenerateStats,
}

/// `<OUT>.partial` beside `<OUT>`.
pub(crate) fn partial_dir(out: &Path) -> Result<PathBuf> {
    let name = out
        .file_name()
        .with_context(|| format!("{}: not a usable folder name", out.display()))?
        .to_string_lossy()
        .into_owned();
    Ok(out.with_file_name(format!("{name}.partial")))
}

pub(super) fn chunk_path(partial: &Path, split: &str, chunk: usize, ext: &str) -> PathBuf {
    partial.join(split).join(format!("chunk-{chunk:05}.{ext}"))
}

pub(super) fn save_chunk(
    partial: &Path,
    split: &str,
    chunk: usize,
    out: &ChunkOutput,
) -> Result<()> {
    let rows: Vec<TokenRow<'_>> = (0..out.ids.len())
        .map(|i| TokenRow {
            id: &out.ids[i],
            input_ids: &out.tokens[i],
            loss_mask: &out.masks[i],
        })
        .collect();
    write_atomic(&chunk_path(partial, split, chunk, "arrow"), |p| {
        write_token_rows(p, &rows).map(|_| ())
    })?;
    // The counts last: a chunk is done when its .json exists.
    write_atomic(&chunk_path(partial, split, chunk, "json"), |p| {
        write_json(p, &serde_json::to_value(&out.stats)?)
    })
}

pub(super) fn load_stats(path: &Path) -> Result<RegenerateStats> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not a chunk summary of regenerate; remove the partial folder to start over",
            path.display()
        )
    })
}

/// The manifest's key of the input's content: per split, [`SplitInput::fingerprint`].
const CONTENT_KEY: &str = "input_xxh3_128";

/// The manifest of a partial output: what must not change between a run and its resumption.
pub(super) fn manifest(
    input: &Path,
    target: &Path,
    kind: Kind,
    splits: &[SplitInput],
    opts: &RegenerateOptions,
) -> Result<serde_json::Value> {
    let abs = |p: &Path| {
        std::fs::canonicalize(p)
            .unwrap_or_else(|_| p.to_path_buf())
            .display()
            .to_string()
    };
    let mut files = Vec::new();
    for s in splits {
        for (file, _) in &s.data.sources {
            files.push(serde_json::json!({
                "path": abs(file),
                "bytes": std::fs::metadata(file).map(|m| m.len()).unwrap_or(0),
            }));
        }
    }
    let content: serde_json::Map<String, serde_json::Value> = splits
        .iter()
        .map(|s| (s.name.clone(), s.fingerprint().into()))
        .collect();
    Ok(serde_json::json!({
        "input": abs(input),
        "input_files": files,
        CONTENT_KEY: content,
        "target": abs(target),
        "dtype": format!("{kind:?}"),
        "options": {
            "max_new_tokens": opts.max_new_tokens,
            "max_turns": opts.max_turns,
            "limit": opts.limit,
            "temperature": opts.sampling.temperature,
            "top_p": opts.sampling.top_p,
            "seed": opts.seed,
            "max_len": opts.max_len,
        },
        "chunk_rows": opts.chunk_rows,
        "splits": splits.iter().map(|s| serde_json::json!({"name": s.name, "rows": s.rows})).collect::<Vec<_>>(),
    }))
}

/// Differences between a stored manifest and the current one, as `key: then X, now Y`.
fn manifest_diff(old: &serde_json::Value, new: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    let keys = [
        "input",
        "target",
        "dtype",
        "chunk_rows",
        "input_files",
        "splits",
    ];
    for k in keys {
        if old.get(k) != new.get(k) {
            out.push(format!(
                "{k}: {} then, {} now",
                old.get(k).unwrap_or(&serde_json::Value::Null),
                new.get(k).unwrap_or(&serde_json::Value::Null)
            ));
        }
    }
    let empty = serde_json::json!({});
    let (o, n) = (
        old.get("options").unwrap_or(&empty),
        new.get("options").unwrap_or(&empty),
    );
    if let Some(map) = n.as_object() {
        for (k, v) in map {
            let before = o.get(k).unwrap_or(&serde_json::Value::Null);
            if before != v {
                out.push(format!("--{}: {before} then, {v} now", k.replace('_', "-")));
            }
        }
    }
    out
}

/// Opens the partial folder of a run: continues one whose manifest equals `manifest` (and
/// refuses one of other input or options, naming the differences and the way out), or creates
/// it with the manifest. Either way every split has its folder, cleared of the temporary files
/// of killed writers.
pub(super) fn open_partial(
    partial: &Path,
    manifest: &serde_json::Value,
    splits: &[SplitInput],
) -> Result<()> {
    let manifest_path = partial.join("manifest.json");
    if partial.exists() {
        let text = std::fs::read_to_string(&manifest_path).with_context(|| {
            format!(
                "{}: cannot read; {} is not a partial output of regenerate (run with --restart to discard it and start over)",
                manifest_path.display(),
                partial.display()
            )
        })?;
        let old: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", manifest_path.display()))?;
        check_resumable(partial, &old, manifest)?;
    } else {
        std::fs::create_dir_all(partial)
            .with_context(|| format!("{}: cannot create", partial.display()))?;
        write_atomic(&manifest_path, |p| write_json(p, manifest))?;
    }
    let dirs = splits.iter().map(|s| partial.join(&s.name));
    for dir in dirs.clone() {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    for dir in std::iter::once(partial.to_path_buf()).chain(dirs) {
        for gone in remove_stale_staging(&dir, |_| true) {
            log::info!("removed {}, left by a writer that is gone", gone.display());
        }
    }
    Ok(())
}

/// Whether the partial run of manifest `old` can be continued by a run of manifest `new`: the
/// same options, input files and input content. A manifest written before the content was
/// recorded is continued on the files' paths and sizes (what it was checked by then), with a
/// warning: refusing it would throw its finished chunks away, which the earlier version would
/// have kept.
fn check_resumable(partial: &Path, old: &serde_json::Value, new: &serde_json::Value) -> Result<()> {
    let start_over = format!(
        "run with --restart to discard {} and start over, or choose another --out",
        partial.display()
    );
    let diff = manifest_diff(old, new);
    if !diff.is_empty() {
        bail!(
            "{}: a partial run with other input or options is there ({}); run the same command to continue it, or {start_over}",
            partial.display(),
            diff.join("; ")
        );
    }
    let Some(then) = old.get(CONTENT_KEY) else {
        log::warn!(
            "{}: started by an earlier version, which did not record the input's content: continuing it on the input files' paths and sizes; if the input was rewritten since, {start_over}",
            partial.display()
        );
        return Ok(());
    };
    let now = &new[CONTENT_KEY];
    if then != now {
        let changed: Vec<&str> = now
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(split, hash)| then.get(split.as_str()) != Some(*hash))
            .map(|(split, _)| split.as_str())
            .collect();
        bail!(
            "{}: the input's content changed since this partial run started (the tokens or loss masks of split(s) {} differ, in files of the same sizes): continuing would mix answers to the old rows with the new; {start_over}",
            partial.display(),
            changed.join(", ")
        );
    }
    Ok(())
}

/// Every chunk of the input, in input order.
pub(super) fn all_chunks(splits: &[SplitInput], chunk_rows: usize) -> Vec<ChunkId> {
    let mut all = Vec::new();
    for (si, s) in splits.iter().enumerate() {
        all.extend((0..s.chunks(chunk_rows)).map(|c| (si, c)));
    }
    all
}

/// The input rows of a chunk of `chunk_rows` rows.
pub(super) fn rows_of(splits: &[SplitInput], chunk_rows: usize, (si, c): ChunkId) -> Range<usize> {
    c * chunk_rows..((c + 1) * chunk_rows).min(splits[si].rows)
}

/// Whether a chunk is done (its counts, written last, are there).
pub(super) fn is_done(partial: &Path, splits: &[SplitInput], (si, c): ChunkId) -> bool {
    chunk_path(partial, &splits[si].name, c, "json").is_file()
}

/// The counts over every finished chunk (this run's and earlier ones'), and whether every chunk
/// is finished.
pub(super) fn finished_stats(
    partial: &Path,
    splits: &[SplitInput],
    chunks: &[ChunkId],
) -> Result<(RegenerateStats, bool)> {
    let mut stats = RegenerateStats::default();
    let mut complete = true;
    for &(si, c) in chunks {
        let path = chunk_path(partial, &splits[si].name, c, "json");
        if path.is_file() {
            stats.merge(&load_stats(&path)?);
        } else {
            complete = false;
        }
    }
    Ok((stats, complete))
}

/// Assembles the finished chunks into `out` in the `prepare-data` layout (which appears whole,
/// or not at all): per split, the rows of its chunks in order, in shards of `shard_rows`.
pub(super) fn assemble(
    out: &Path,
    partial: &Path,
    splits: &[SplitInput],
    chunk_rows: usize,
    shard_rows: usize,
) -> Result<(PathBuf, Vec<(String, SplitSummary)>)> {
    let staged = StagedDir::create(out)?;
    let mut written = Vec::new();
    for s in splits {
        let (ids, data, masks) = read_chunks(partial, s, chunk_rows)?;
        let rows: Vec<TokenRow<'_>> = (0..ids.len())
            .map(|r| {
                let (a, b) = (data.ids.offsets[r], data.ids.offsets[r + 1]);
                TokenRow {
                    id: &ids[r],
                    input_ids: &data.ids.tokens[a..b],
                    loss_mask: &masks[a..b],
                }
            })
            .collect();
        let dir = staged.path().join(&s.name);
        std::fs::create_dir(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        let summary = write_split(&dir, &s.name, &rows, shard_rows)?;
        written.push((s.name.clone(), summary));
    }
    let names: Vec<&str> = splits.iter().map(|s| s.name.as_str()).collect();
    write_json(
        &staged.path().join("dataset_dict.json"),
        &serde_json::json!({ "splits": names }),
    )?;
    Ok((staged.commit()?, written))
}

/// The rows of every chunk of a split, in order: ids, tokens, loss masks.
fn read_chunks(
    partial: &Path,
    s: &SplitInput,
    chunk_rows: usize,
) -> Result<(Vec<String>, TokenData, Vec<u8>)> {
    let mut ids: Vec<String> = Vec::new();
    let mut data = TokenData {
        ids: TokenColumn::new(),
        ..Default::default()
    };
    let mut masks: Vec<u8> = Vec::new();
    for c in 0..s.chunks(chunk_rows) {
        let path = chunk_path(partial, &s.name, c, "arrow");
        let part = read_token_data(&path, "input_ids", Some("loss_mask"))?;
        let part_ids = read_string_column(&path, "id")?
            .with_context(|| format!("{}: no column \"id\"", path.display()))?;
        for r in 0..part.ids.len() {
            data.ids.push(part.ids.get(r));
        }
        masks.extend(part.masks.unwrap_or_default());
        ids.extend(part_ids);
    }
    if ids.len() != data.ids.len() || masks.len() != data.ids.tokens.len() {
        bail!(
            "{}: the chunks of split {} are inconsistent; remove it to start over",
            partial.display(),
            s.name
        );
    }
    Ok((ids, data, masks))
}
