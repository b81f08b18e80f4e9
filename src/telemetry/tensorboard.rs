//! TensorBoard event files of a run's scalars, in `RUN_DIR/tensorboard/` beside `metrics.jsonl`:
//! written while training ([`TensorBoardWriter`]) and, for runs made before, converted from
//! their `metrics.jsonl` by `export-tensorboard` ([`export`]).
//!
//! The format is TFRecord framing (u64 length, masked CRC-32C of the length, the data, masked
//! CRC-32C of the data) of `Event` protobufs: the first one carries the file version, each
//! later one the scalars of one metrics record as a `Summary` of tagged `simple_value`s.
//! `crc32c` computes the checksums (hardware CRC-32C, well kept); prost's derive encodes the
//! three messages declared below (no .proto file, no build script). `tensorboard-rs` (protobuf
//! 2, images, last released years ago) and `tfrecord` (generated code, optional libtorch) bring
//! far more than these few fields.
//!
//! Tags are `GROUP/FIELD`: the group names the record (`train` for steps, `eval`,
//! `validation`, `gpuN`, `queue`, `profile`, `summary`) and every number in it is a scalar,
//! named by its path (`train/loss`, `eval/accepted_by_slot/2`, `queue/batch_q/len`,
//! `profile/drafter.forward/interval/mean_s`); lists of named things (queues, profile rows)
//! are keyed by the name. Flags and text are left out. The x axis is the training step: a
//! record's own step, else the last step written before it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde_json::Value as Json;

use super::metrics_tail;
use super::records::MetricsRecord;

/// The folder of a run's event files.
pub(crate) const TENSORBOARD_DIR: &str = "tensorboard";

/// Fields that are axes or names, not scalars: the step (the x axis), the run's clock (the
/// wall time) and the GPU's index (in the group's name).
const NOT_SCALARS: [&str; 3] = ["step", "elapsed_s", "index"];

/// How long written records may wait in memory before they reach the file: a crash loses at
/// most this much (metrics.jsonl keeps it; `export-tensorboard` rebuilds the files).
const FLUSH_EVERY: Duration = Duration::from_secs(2);

#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "EventWhat", tags = "3, 5")]
    what: Option<EventWhat>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum EventWhat {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    /// A member of a oneof in TensorFlow's summary.proto: written even when it is 0.
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// The scalars of one record, tag and value, and the step they belong to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RecordScalars {
    pub(crate) step: u64,
    pub(crate) values: Vec<(String, f32)>,
}

/// The scalars of `record`; `last_step` is the last training step written before it (the step
/// of records that have none of their own).
pub(crate) fn scalars(record: &MetricsRecord, last_step: u64) -> RecordScalars {
    let (group, step) = match record {
        MetricsRecord::Step(r) => ("train".to_string(), r.step),
        MetricsRecord::Eval(r) => ("eval".to_string(), r.step),
        MetricsRecord::Validation(r) => ("validation".to_string(), r.step),
        MetricsRecord::Gpu(r) => (format!("gpu{}", r.index), last_step),
        MetricsRecord::Queues { .. } => ("queue".to_string(), last_step),
        MetricsRecord::Profile(_) => ("profile".to_string(), last_step),
        MetricsRecord::Summary { .. } => ("summary".to_string(), last_step),
        MetricsRecord::Event { .. } => {
            return RecordScalars {
                step: last_step,
                values: Vec::new(),
            }
        }
    };
    let mut values = Vec::new();
    if let Ok(json) = serde_json::to_value(record) {
        flatten(&group, &json, &mut values);
    }
    RecordScalars { step, values }
}

/// The numbers in `value` under `prefix`, each named by its path.
fn flatten(prefix: &str, value: &Json, out: &mut Vec<(String, f32)>) {
    match value {
        Json::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((prefix.to_string(), x as f32));
            }
        }
        Json::Object(fields) => {
            for (key, v) in fields
                .iter()
                .filter(|(k, _)| !NOT_SCALARS.contains(&k.as_str()))
            {
                match named_items(v) {
                    // queues, profile rows: keyed by their names, not by their list's
                    Some(items) => {
                        for (name, item) in items {
                            flatten(&format!("{prefix}/{name}"), item, out);
                        }
                    }
                    None => flatten(&format!("{prefix}/{key}"), v, out),
                }
            }
        }
        Json::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                flatten(&format!("{prefix}/{i}"), v, out);
            }
        }
        Json::Null | Json::Bool(_) | Json::String(_) => {}
    }
}

/// A non-empty list of objects each named by a `name` or `event` field, with the names.
fn named_items(value: &Json) -> Option<Vec<(&str, &Json)>> {
    let items = value.as_array().filter(|a| !a.is_empty())?;
    items
        .iter()
        .map(|item| {
            let name = item.get("name").or_else(|| item.get("event"))?.as_str()?;
            Some((name, item))
        })
        .collect()
}

/// The TFRecord of one event.
fn framed(event: &Event) -> Vec<u8> {
    let data = prost::Message::encode_to_vec(event);
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(&data);
    out.extend_from_slice(&masked_crc(&data).to_le_bytes());
    out
}

/// TFRecord's masked CRC-32C (a CRC of data holding CRCs is masked so it is not one itself).
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn version_event(wall_time: f64) -> Event {
    Event {
        wall_time,
        step: 0,
        what: Some(EventWhat::FileVersion("brain.Event:2".into())),
    }
}

/// The event of one record's scalars; None when it has none.
fn scalar_event(wall_time: f64, scalars: RecordScalars) -> Option<Event> {
    if scalars.values.is_empty() {
        return None;
    }
    let value = scalars
        .values
        .into_iter()
        .map(|(tag, v)| SummaryValue {
            tag,
            simple_value: Some(v),
        })
        .collect();
    Some(Event {
        wall_time,
        step: i64::try_from(scalars.step).unwrap_or(i64::MAX),
        what: Some(EventWhat::Summary(Summary { value })),
    })
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `events.out.tfevents.<secs>.<host>`, as TensorFlow names them (TensorBoard reads every
/// file with `tfevents` in its name).
fn event_file_name(now: SystemTime) -> String {
    let host = sysinfo::System::host_name()
        .map(|h| h.replace(['/', '\\'], "_"))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!(
        "events.out.tfevents.{}.{host}",
        unix_seconds(now).floor() as u64
    )
}

fn is_event_file(path: &Path) -> bool {
    path.is_file()
        && path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("events.out.tfevents."))
}

/// A new event file in `dir`; a second one in the same second gets `.1`, `.2`, ...
fn create_event_file(dir: &Path, now: SystemTime) -> Result<(File, PathBuf)> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let name = event_file_name(now);
    for n in 0..1000 {
        let path = match n {
            0 => dir.join(&name),
            n => dir.join(format!("{name}.{n}")),
        };
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(file) => return Ok((file, path)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => bail!("{}: cannot create: {e}", path.display()),
        }
    }
    bail!("{}: no free name for {name}", dir.display())
}

/// Writes the scalars of a training run's records into a new event file of
/// `RUN_DIR/tensorboard/` as they come. Records wait in memory up to [`FLUSH_EVERY`] (an
/// evaluation, validation or the summary goes out at once) and reach the file in one write
/// each time, so a crash leaves whole records, or at worst one cut short at the end, which
/// TensorBoard's reader stops at. A failed write (a full disk) is cut back off the file and
/// its records dropped; the log says so at the first failure and at each doubling.
pub(crate) struct TensorBoardWriter {
    inner: Mutex<LiveFile>,
}

struct LiveFile {
    file: File,
    path: PathBuf,
    pending: Vec<u8>,
    last_flush: Instant,
    last_step: u64,
    lost: u64,
}

impl TensorBoardWriter {
    /// A new event file for the run in `run_dir`, whose records go on after step `last_step`
    /// (0 for a new run; a resumed run's checkpoint step).
    pub(crate) fn open(run_dir: &Path, last_step: u64) -> Result<Self> {
        let now = SystemTime::now();
        let (file, path) = create_event_file(&run_dir.join(TENSORBOARD_DIR), now)?;
        let mut live = LiveFile {
            file,
            path,
            pending: framed(&version_event(unix_seconds(now))),
            last_flush: Instant::now(),
            last_step,
            lost: 0,
        };
        live.flush();
        Ok(TensorBoardWriter {
            inner: Mutex::new(live),
        })
    }

    pub(crate) fn write(&self, record: &MetricsRecord) {
        let mut live = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let scalars = scalars(record, live.last_step);
        live.last_step = scalars.step.max(live.last_step);
        if let Some(event) = scalar_event(unix_seconds(SystemTime::now()), scalars) {
            live.pending.extend_from_slice(&framed(&event));
        }
        let now = matches!(
            record,
            MetricsRecord::Eval(_) | MetricsRecord::Validation(_) | MetricsRecord::Summary { .. }
        );
        if now || live.last_flush.elapsed() >= FLUSH_EVERY {
            live.flush();
        }
    }
}

impl LiveFile {
    fn flush(&mut self) {
        self.last_flush = Instant::now();
        if self.pending.is_empty() {
            return;
        }
        match crate::fsutil::append_whole(&mut self.file, &self.pending) {
            Ok(()) => {
                if self.lost > 0 {
                    log::info!("{}: writing again", self.path.display());
                    self.lost = 0;
                }
            }
            Err(e) => {
                self.lost += 1;
                if self.lost.is_power_of_two() {
                    log::warn!(
                        "{}: {} write(s) of scalars lost so far ({e}); metrics.jsonl keeps them \
                         (export-tensorboard RUN_DIR writes the event files again from it)",
                        self.path.display(),
                        self.lost
                    );
                }
            }
        }
        self.pending.clear();
    }
}

impl Drop for TensorBoardWriter {
    fn drop(&mut self) {
        self.inner
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .flush();
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Exported {
    pub(crate) file: PathBuf,
    pub(crate) records: usize,
    pub(crate) scalars: usize,
    /// Event files of the run that the new one replaced.
    pub(crate) replaced: usize,
    /// A last line cut short (a run that was killed while writing it) was left out.
    pub(crate) cut_last_line: bool,
}

/// Writes the scalars of `RUN_DIR/metrics.jsonl` into one event file of `RUN_DIR/tensorboard/`
/// that replaces the event files there (written during training or by an earlier export: the
/// same records, so running it again gives the same file). The wall time of a record is the
/// run's start, taken as the time metrics.jsonl was last written less the run's clock then,
/// plus the record's `elapsed_s`. A line that does not parse is an error naming it, except a
/// last line without its newline: a run killed while writing it leaves one.
pub(crate) fn export(run_dir: &Path) -> Result<Exported> {
    let metrics = run_dir.join("metrics.jsonl");
    let mut records = Vec::new();
    let read = metrics_tail::read_all(&metrics, |r, _| records.push((r.clone(), r.elapsed_s())))
        .with_context(|| format!("{}: cannot read", metrics.display()))?;
    if !read.exists {
        bail!("{}: cannot read: no such file", metrics.display());
    }
    if let Some((line, why)) = read.bad.first {
        bail!("{}: line {line}: {why}", metrics.display());
    }
    let cut_last_line = read.cut_last_line;
    let clock_end = records.iter().map(|(_, e)| *e).fold(0.0, f64::max);
    let written = std::fs::metadata(&metrics)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| SystemTime::now());
    let start = unix_seconds(written) - clock_end;

    let mut bytes = framed(&version_event(start));
    let (mut last_step, mut scalar_count) = (0, 0);
    for (record, elapsed) in &records {
        let s = scalars(record, last_step);
        last_step = s.step.max(last_step);
        scalar_count += s.values.len();
        if let Some(event) = scalar_event(start + elapsed, s) {
            bytes.extend_from_slice(&framed(&event));
        }
    }
    let dir = run_dir.join(TENSORBOARD_DIR);
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    // Written aside under a name TensorBoard does not read, then put in place of the old ones.
    let tmp = dir.join(format!(".export.partial-{}", std::process::id()));
    std::fs::write(&tmp, &bytes).with_context(|| format!("{}: cannot write", tmp.display()))?;
    let replaced = remove_event_files(&dir);
    let file = dir.join(event_file_name(SystemTime::now()));
    let moved = replaced.and_then(|n| {
        std::fs::rename(&tmp, &file)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), file.display()))
            .map(|()| n)
    });
    let replaced = moved.inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    Ok(Exported {
        file,
        records: records.len(),
        scalars: scalar_count,
        replaced,
        cut_last_line,
    })
}

/// Removes the event files in `dir`; how many there were.
fn remove_event_files(dir: &Path) -> Result<usize> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("{}: cannot read", dir.display()))?;
    let mut removed = 0;
    for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        if is_event_file(&path) {
            std::fs::remove_file(&path)
                .with_context(|| format!("{}: cannot remove", path.display()))?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::records::{EvalRecord, GpuRecord, QueueLevel, QueueName, StepRecord};

    fn step(n: u64, loss: f64) -> MetricsRecord {
        MetricsRecord::Step(StepRecord {
            step: n,
            epoch: 0,
            loss,
            accuracy: 0.25,
            accept_mean: 1.5,
            lr: 1e-4,
            grad_norm: 0.0,
            tokens: 1000,
            samples: 4,
            blocks: 100,
            step_s: 0.2,
            tokens_per_s: 5000.0,
            samples_per_s: 20.0,
            elapsed_s: n as f64,
        })
    }

    /// The events of a file, each checked against its two checksums.
    fn read_events(bytes: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let len_bytes: [u8; 8] = rest[..8].try_into().unwrap();
            let len = u64::from_le_bytes(len_bytes) as usize;
            assert_eq!(rest[8..12], masked_crc(&len_bytes).to_le_bytes());
            let data = &rest[12..12 + len];
            assert_eq!(rest[12 + len..16 + len], masked_crc(data).to_le_bytes());
            events.push(<Event as prost::Message>::decode(data).unwrap());
            rest = &rest[16 + len..];
        }
        events
    }

    #[test]
    fn the_masked_crc_is_tensorflows() {
        // CRC-32C("123456789") is 0xe3069283 (RFC 3720's check value); the masked values are
        // tensorboard 2.21's (tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c),
        // of the check string and of a record length of 24 as written in a record's header.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc(&24u64.to_le_bytes()), 0x224b_7fa3);
    }

    #[test]
    fn every_number_of_a_record_is_a_tagged_scalar() {
        let s = scalars(&step(7, 2.5), 3);
        assert_eq!(s.step, 7);
        let tags: Vec<&str> = s.values.iter().map(|(t, _)| t.as_str()).collect();
        for tag in [
            "train/loss",
            "train/accept_mean",
            "train/lr",
            "train/grad_norm",
        ] {
            assert!(tags.contains(&tag), "{tags:?}");
        }
        assert!(!tags
            .iter()
            .any(|t| t.ends_with("/step") || t.ends_with("elapsed_s")));
        assert!(s.values.contains(&("train/loss".into(), 2.5)));
        // zero is a value like any other
        assert!(s.values.contains(&("train/grad_norm".into(), 0.0)));

        let eval = MetricsRecord::Eval(EvalRecord {
            step: 5,
            tau: 2.25,
            prompts: 8,
            decode_steps: 40,
            generated_tokens: 98,
            accepted_by_slot: vec![40, 30],
            eval_s: 1.5,
            best: true,
            elapsed_s: 2.0,
        });
        let s = scalars(&eval, 9);
        assert_eq!(s.step, 5);
        assert!(s.values.contains(&("eval/tau".into(), 2.25)));
        assert!(s.values.contains(&("eval/accepted_by_slot/1".into(), 30.0)));
        assert!(
            !s.values.iter().any(|(t, _)| t == "eval/best"),
            "flags are no scalars"
        );

        let gpu = MetricsRecord::Gpu(GpuRecord {
            elapsed_s: 1.0,
            index: 1,
            name: "H200".into(),
            utilization_pct: Some(90),
            memory_used_bytes: Some(1 << 30),
            memory_total_bytes: None,
            power_watts: Some(500.0),
            temperature_c: None,
        });
        let s = scalars(&gpu, 9);
        assert_eq!(s.step, 9, "a reading is drawn at the last step");
        assert_eq!(
            s.values,
            vec![
                ("gpu1/utilization_pct".to_string(), 90.0),
                ("gpu1/memory_used_bytes".to_string(), (1u64 << 30) as f32),
                ("gpu1/power_watts".to_string(), 500.0),
            ],
            "readings that are missing are left out (fields in the record's order)"
        );
        let queues = MetricsRecord::Queues {
            elapsed_s: 2.0,
            queues: vec![QueueLevel {
                name: QueueName::Feature,
                len: 1,
                capacity: 4,
                pushed: 9,
                popped: 8,
            }],
        };
        let s = scalars(&queues, 9);
        assert!(s.values.contains(&("queue/feature_q/len".into(), 1.0)));
        assert!(s.values.contains(&("queue/feature_q/capacity".into(), 4.0)));
    }

    #[test]
    fn the_live_file_holds_the_version_then_each_records_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let w = TensorBoardWriter::open(dir.path(), 0).unwrap();
        w.write(&step(1, 3.0));
        w.write(&MetricsRecord::Event {
            elapsed_s: 1.0,
            kind: crate::telemetry::records::EventKind::Checkpoint,
            message: "saved".into(),
        });
        w.write(&step(2, 2.0));
        drop(w);
        let files: Vec<PathBuf> = std::fs::read_dir(dir.path().join(TENSORBOARD_DIR))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1);
        assert!(is_event_file(&files[0]), "{files:?}");
        let events = read_events(&std::fs::read(&files[0]).unwrap());
        assert_eq!(
            events.len(),
            3,
            "version, step 1, step 2 (the event has no numbers)"
        );
        assert_eq!(
            events[0].what,
            Some(EventWhat::FileVersion("brain.Event:2".into()))
        );
        assert_eq!(events[2].step, 2);
        let Some(EventWhat::Summary(summary)) = &events[2].what else {
            panic!("{:?}", events[2]);
        };
        assert!(summary.value.contains(&SummaryValue {
            tag: "train/loss".into(),
            simple_value: Some(2.0)
        }));
        // a second writer in the same second gets a name of its own
        let again = TensorBoardWriter::open(dir.path(), 2).unwrap();
        drop(again);
        assert_eq!(
            std::fs::read_dir(dir.path().join(TENSORBOARD_DIR))
                .unwrap()
                .count(),
            2
        );
    }

    #[test]
    fn export_replaces_the_event_files_and_names_a_bad_line() {
        let dir = tempfile::tempdir().unwrap();
        let lines: Vec<String> = (1..=3)
            .map(|n| serde_json::to_string(&step(n, 4.0 - n as f64)).unwrap())
            .collect();
        let mut text = lines.join("\n");
        text.push_str("\n{\"type\":\"step\",\"st"); // a half line left by a kill
        std::fs::write(dir.path().join("metrics.jsonl"), &text).unwrap();
        drop(TensorBoardWriter::open(dir.path(), 0).unwrap());

        let first = export(dir.path()).unwrap();
        assert_eq!((first.records, first.replaced), (3, 1));
        assert!(first.cut_last_line);
        assert_eq!(first.scalars, 3 * scalars(&step(1, 0.0), 0).values.len());
        let bytes = std::fs::read(&first.file).unwrap();
        let events = read_events(&bytes);
        assert_eq!(events.len(), 4);
        assert_eq!(
            events.iter().map(|e| e.step).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        // again: the same file content, still one file
        let second = export(dir.path()).unwrap();
        assert_eq!(second.replaced, 1);
        assert_eq!(std::fs::read(&second.file).unwrap(), bytes);
        let files = std::fs::read_dir(dir.path().join(TENSORBOARD_DIR))
            .unwrap()
            .count();
        assert_eq!(files, 1);

        std::fs::write(
            dir.path().join("metrics.jsonl"),
            format!("{}\n{{\"type\":\"nope\"}}\n{}\n", lines[0], lines[1]),
        )
        .unwrap();
        let err = format!("{:#}", export(dir.path()).unwrap_err());
        assert!(err.contains("metrics.jsonl: line 2"), "{err}");
    }
}
