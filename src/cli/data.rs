//! `prepare-data`, `inspect-data`, `bench-data`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::data::arrow_io::{dataset_files, read_token_data, resolve_split, ColumnError};
use crate::data::packer::{collate, Packer, PackerConfig};
use crate::data::prepare_data::{prepare_data, PrepareOptions};
use crate::data::store::{DataColumns, StoreOptions, TokenStore};
use crate::model::{describe_target, TargetConfig};
use crate::text::TextTokenizer;

use super::progress::Bars;

#[derive(Debug, clap::Args)]
pub struct PrepareDataArgs {
    /// Model folder whose tokenizer.json and chat template are used.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Input files (several allowed).
    #[arg(long, num_args = 1.., required = true)]
    pub input: Vec<PathBuf>,
    /// The dataset folder to create.
    #[arg(long)]
    pub out: PathBuf,
    /// Longest sample in tokens; longer conversations are cut to it (and counted).
    #[arg(long, default_value_t = 3072)]
    pub max_len: usize,
    /// Rows per Arrow shard.
    #[arg(long, default_value_t = 50_000)]
    pub shard_rows: usize,
    /// Share of conversations held out for validation.
    #[arg(long, default_value_t = 0.01)]
    pub val_fraction: f64,
    /// Seed of the validation split.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep only the first N usable conversations (in input order); reading and
    /// tokenising stop once N are kept.
    #[arg(long)]
    pub limit: Option<usize>,
}

pub(super) fn prepare(args: PrepareDataArgs, bars: &Bars) -> Result<()> {
    // The length grows as the inputs are read.
    let bar = bars.bar("prepare-data", 0, "rows");
    let opts = PrepareOptions {
        max_len: args.max_len,
        shard_rows: args.shard_rows,
        val_fraction: args.val_fraction,
        seed: args.seed,
        limit: args.limit,
        progress: Some(bar.clone()),
    };
    let summary = prepare_data(&args.tokenizer, &args.input, &args.out, &opts);
    bar.finish_and_clear();
    let summary = summary?;
    println!("{summary}");
    Ok(())
}

/// Length histogram with power-of-two buckets.
fn histogram(lengths: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut buckets: Vec<(usize, usize, usize)> = Vec::new();
    let mut lo = 0;
    let mut hi = 64;
    let max = lengths.iter().copied().max().unwrap_or(0);
    while lo <= max {
        let n = lengths.iter().filter(|&&l| l >= lo && l < hi).count();
        buckets.push((lo, hi, n));
        lo = hi;
        hi *= 2;
    }
    buckets
}

/// What to do with chat data that is not a dataset yet.
const PREPARE_HINT: &str = "make one from chat data (ShareGPT, {\"messages\"} or {\"text\"} JSON/JSONL) with `dflash-tui prepare-data --tokenizer MODEL_DIR --input FILE... --out DIR`";

/// Why `path` is not a prepared dataset at all (a JSON file, a folder without Arrow or Parquet
/// files), as opposed to a dataset with a fault of its own; `None` when it looks like one or
/// does not exist.
fn not_a_dataset(path: &Path) -> Option<String> {
    let is_data = |p: &Path| {
        p.extension()
            .is_some_and(|e| e == "arrow" || e == "parquet")
    };
    if path.is_dir() {
        if path.join("dataset_dict.json").is_file() || path.join("state.json").is_file() {
            return None;
        }
        let entries: Vec<PathBuf> = std::fs::read_dir(path)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        if entries.iter().any(|p| is_data(p)) {
            return None;
        }
        let mut chat: Vec<String> = entries
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "json" || e == "jsonl"))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        chat.sort();
        let why = "a folder without dataset_dict.json, state.json or .arrow/.parquet files";
        return Some(match chat.len() {
            0 => why.to_string(),
            n => format!(
                "{why}; it holds {}{}",
                chat[..n.min(3)].join(", "),
                if n > 3 { ", ..." } else { "" }
            ),
        });
    }
    if !path.is_file() || is_data(path) {
        return None;
    }
    let mut head = [0u8; 512];
    let n = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .ok()?;
    let head = &head[..n];
    // Parquet, an Arrow IPC file, an Arrow IPC stream (continuation marker).
    if head.starts_with(b"PAR1") || head.starts_with(b"ARROW1") || head.starts_with(&[0xff; 4]) {
        return None;
    }
    Some(match head.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') | Some(b'[') => "a JSON file, which looks like chat data".to_string(),
        _ => "neither an Arrow nor a Parquet file".to_string(),
    })
}

#[derive(Debug, clap::Args)]
pub struct InspectDataArgs {
    /// A prepare-data output folder, one split folder, or an Arrow / Parquet file.
    pub path: PathBuf,
    /// Split of a dataset with splits (default: train).
    #[arg(long)]
    pub split: Option<String>,
    /// Model folder to decode the sample with.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Which sample to show.
    #[arg(long, default_value_t = 0)]
    pub sample: usize,
}

pub(super) fn inspect(args: &InspectDataArgs) -> Result<()> {
    if let Some(why) = not_a_dataset(&args.path) {
        anyhow::bail!(
            "{}: not a prepared dataset ({why}); {PREPARE_HINT}",
            args.path.display()
        );
    }
    let path = resolve_split(&args.path, args.split.as_deref())?;
    let files = dataset_files(&path)?;
    let data = match read_token_data(&path, "input_ids", Some("loss_mask"))
        .or_else(|_| read_token_data(&path, "input_ids", None))
    {
        Ok(data) => data,
        Err(e)
            if e.downcast_ref::<ColumnError>()
                .is_some_and(|c| c.is_missing("input_ids")) =>
        {
            return Err(e.context(format!(
                "{}: not a prepared dataset (no input_ids column); {PREPARE_HINT}",
                path.display()
            )))
        }
        Err(e) => return Err(e),
    };
    let rows = data.ids.len();
    let lengths: Vec<usize> = data.ids.iter().map(|s| s.len()).collect();
    let tokens: usize = lengths.iter().sum();
    println!(
        "{}: {} file(s), {rows} rows, {tokens} tokens",
        path.display(),
        files.len()
    );
    if rows == 0 {
        return Ok(());
    }
    let mut sorted = lengths.clone();
    sorted.sort_unstable();
    println!(
        "  length: min {}, mean {:.0}, p50 {}, p90 {}, max {}",
        sorted[0],
        tokens as f64 / rows as f64,
        sorted[rows / 2],
        sorted[(rows - 1) * 9 / 10],
        sorted[rows - 1]
    );
    match &data.masks {
        Some(m) => {
            let ones: usize = m.iter().map(|&x| x as usize).sum();
            println!(
                "  loss-mask share: {:.1} % ({ones} tokens)",
                100.0 * ones as f64 / tokens.max(1) as f64
            );
        }
        None => println!("  no loss_mask column: every token counts"),
    }
    println!("  length histogram:");
    let widest = histogram(&lengths)
        .iter()
        .map(|b| b.2)
        .max()
        .unwrap_or(1)
        .max(1);
    for (lo, hi, n) in histogram(&lengths) {
        let bar = "#".repeat((n * 40).div_ceil(widest));
        println!("    {lo:>6}-{:<6} {n:>8} {bar}", hi - 1);
    }
    let tokenizer = args.tokenizer.as_deref();
    if let Some(dir) = tokenizer.filter(|d| d.join("config.json").is_file()) {
        let largest = data.ids.tokens.iter().copied().max().unwrap_or(0);
        println!("  {}", model_line(dir, largest));
    }
    let i = args.sample.min(rows - 1);
    let ids = data.ids.get(i);
    let mask: Vec<u8> = match &data.masks {
        Some(m) => m[data.ids.offsets[i]..data.ids.offsets[i + 1]].to_vec(),
        None => vec![1; ids.len()],
    };
    println!(
        "  sample {i} ({}), trained part between \u{27e6} and \u{27e7}:",
        data.locate(i)
    );
    let text = match tokenizer {
        Some(dir) => {
            let tok = TextTokenizer::from_model_dir(dir)?;
            // Decode runs of equal mask value, so multi-byte characters stay whole.
            let mut out = String::new();
            let mut start = 0;
            while start < ids.len() {
                let mut end = start;
                while end < ids.len() && mask[end] == mask[start] {
                    end += 1;
                }
                let piece = tok.decode(&ids[start..end])?;
                if mask[start] == 1 {
                    out.push_str(&format!("\u{27e6}{piece}\u{27e7}"));
                } else {
                    out.push_str(&piece);
                }
                start = end;
            }
            out
        }
        None => ids
            .iter()
            .zip(&mask)
            .map(|(t, m)| {
                if *m == 1 {
                    format!("\u{27e6}{t}\u{27e7}")
                } else {
                    t.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
    };
    println!("{text}");
    Ok(())
}

/// The model folder of `--tokenizer` as a target: its family and layers, and whether the
/// dataset's largest token id fits its vocabulary; or why it cannot be a target.
fn model_line(dir: &Path, largest_id: u32) -> String {
    let config = match TargetConfig::from_model_dir(dir) {
        Ok(c) => c,
        Err(e) => return format!("model: not usable as a target: {e:#}"),
    };
    let fits = if i64::from(largest_id) < config.vocab_size {
        format!("vocabulary {} holds every id", config.vocab_size)
    } else {
        format!(
            "WARNING: token id {largest_id} is outside its vocabulary of {} (tokenised for another model?)",
            config.vocab_size
        )
    };
    format!(
        "model {}: {}; {fits}",
        dir.display(),
        describe_target(&config)
    )
}

/// Random-access latency of the token store and batches per second of the packer, and the
/// same single-row access through pyarrow for comparison. Prints one JSON object.
#[derive(Debug, clap::Args)]
pub struct BenchDataArgs {
    /// A prepared dataset (folder, split folder or Arrow / Parquet file).
    pub path: PathBuf,
    /// Random single-row reads timed.
    #[arg(long, default_value_t = 1_000_000)]
    pub samples: usize,
    /// Packed training batches timed.
    #[arg(long, default_value_t = 2_000)]
    pub batches: usize,
    /// Python with pyarrow, for the comparison.
    #[arg(long, default_value = "python3")]
    pub python: String,
}

pub(super) fn bench(args: &BenchDataArgs) -> Result<()> {
    let path = resolve_split(&args.path, None)?;
    let started = Instant::now();
    let (store, report) = TokenStore::load(
        &path,
        &DataColumns::default(),
        &StoreOptions {
            vocab_size: u32::MAX as usize,
            max_len: usize::MAX,
            min_loss_tokens: 0,
            max_samples: 0,
        },
    )?;
    let load_s = started.elapsed().as_secs_f64();
    anyhow::ensure!(!store.is_empty(), "{}: no samples", path.display());
    let n = store.len();

    // Random indices from a fixed LCG, so both sides read the same rows.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let indices: Vec<usize> = (0..args.samples)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        })
        .collect();
    let mut buf: Vec<u32> = Vec::with_capacity(8192);
    let mut checksum = 0u64;
    let t = Instant::now();
    for &i in &indices {
        let s = store.get(i);
        buf.clear();
        buf.extend_from_slice(s.input_ids);
        checksum = checksum.wrapping_add(buf.len() as u64 + s.loss_mask.len() as u64);
    }
    let access_ns = t.elapsed().as_nanos() as f64 / args.samples as f64;

    let store = Arc::new(store);
    let mut packer = Packer::new(store.clone(), PackerConfig::default());
    let t = Instant::now();
    for _ in 0..args.batches {
        let b = packer.next().context("the packer produced no batch")?;
        let c = collate(&store, &b);
        checksum = checksum.wrapping_add(c.lengths.len() as u64);
    }
    let pack_s = t.elapsed().as_secs_f64();

    let files: Vec<String> = dataset_files(&path)?
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let pyarrow = pyarrow_take(&args.python, &files, &indices[..indices.len().min(20_000)]);
    let mut out = serde_json::json!({
        "dataset": path.display().to_string(),
        "samples": n,
        "tokens": report.tokens,
        "store_mib": store.memory_bytes() as f64 / (1u64 << 20) as f64,
        "load_s": load_s,
        "random_access_ns_per_sample": access_ns,
        "random_accesses": args.samples,
        "batches_per_s": args.batches as f64 / pack_s,
        "batches": args.batches,
        "padding_fraction": packer.stats.padding_fraction(),
        "token_budget": PackerConfig::default().token_budget,
        "checksum": checksum,
    });
    match pyarrow {
        Ok((take_us, take_pylist_us, n_take, n_pylist, combined_us, n_combined)) => {
            out["pyarrow_combined_take_us_per_sample"] = combined_us.into();
            out["pyarrow_combined_take_samples"] = n_combined.into();
            out["speedup_vs_pyarrow_combined_take"] = (combined_us * 1000.0 / access_ns).into();
            out["pyarrow_take_us_per_sample"] = take_us.into();
            out["pyarrow_take_samples"] = n_take.into();
            out["pyarrow_take_to_pylist_us_per_sample"] = take_pylist_us.into();
            out["pyarrow_take_to_pylist_samples"] = n_pylist.into();
            out["speedup_vs_pyarrow_take"] = (take_us * 1000.0 / access_ns).into();
            out["speedup_vs_pyarrow_take_to_pylist"] = (take_pylist_us * 1000.0 / access_ns).into();
        }
        Err(e) => out["pyarrow"] = format!("not measured: {e:#}").into(),
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Microseconds per single-row `Table.take` (and take + `to_pylist`) in pyarrow, each measured
/// over as many of `indices` as fit in 10 s, and those counts; then `take` on the table with its
/// chunks combined into one.
fn pyarrow_take(
    python: &str,
    files: &[String],
    indices: &[usize],
) -> Result<(f64, f64, u64, u64, f64, u64)> {
    const SCRIPT: &str = r#"
import json, sys, time
import pyarrow as pa
args = json.loads(sys.stdin.read())
tables = []
for f in args["files"]:
    with open(f, "rb") as fh:
        magic = fh.read(6)
    reader = pa.ipc.open_file(f) if magic == b"ARROW1" else pa.ipc.open_stream(f)
    tables.append(reader.read_all())
t = pa.concat_tables(tables)
idx = args["indices"]
budget = args["seconds"]
for i in idx[:10]:
    t.take([i])
def timed(fn):
    # per-sample mean over as many indices as fit the time budget
    s = time.perf_counter()
    n = 0
    for i in idx:
        fn(i)
        n += 1
        if time.perf_counter() - s > budget:
            break
    return (time.perf_counter() - s) / n * 1e6, n
take, n1 = timed(lambda i: t.take([i]))
pylist, n2 = timed(lambda i: t.take([i]).to_pylist())
# The same table as one contiguous chunk (the fastest layout pyarrow can be given).
c = t.combine_chunks()
for i in idx[:10]:
    c.take([i])
ctake, n3 = timed(lambda i: c.take([i]))
print(json.dumps([take, pylist, n1, n2, ctake, n3]))
"#;
    use std::io::Write;
    let mut child = std::process::Command::new(python)
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {python}"))?;
    let input =
        serde_json::json!({"files": files, "indices": indices, "seconds": 10.0}).to_string();
    child
        .stdin
        .take()
        .context("no stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("{python} failed: {}", err.lines().last().unwrap_or(""));
    }
    let v: (f64, f64, u64, u64, f64, u64) =
        serde_json::from_slice(&out.stdout).context("unexpected pyarrow output")?;
    Ok(v)
}
