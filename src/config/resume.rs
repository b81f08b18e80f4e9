//! What a resume may change. A run's `config.toml` is the configuration its checkpoints were
//! trained with; a resume that changes how the model is built or how the data stream is cut
//! would write weights the saved config no longer describes (a drafter saying block size 8 for
//! weights trained at 16), so those fields are refused by name. The schedule may change only
//! when asked for; the rest (devices, queues, checkpoints, evaluation, telemetry) freely.

use super::TrainConfig;

/// The fields a resume changes, by what they are allowed to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ResumeChanges {
    /// Change the model or the data stream: refused.
    pub refused: Vec<String>,
    /// Change the learning-rate schedule or the length of the run: allowed on request.
    pub schedule: Vec<String>,
    /// Anything else (paths, devices, queues, checkpoints, evaluation, telemetry).
    pub free: Vec<String>,
}

/// Fields a resume may change with `--allow-schedule-change`.
const SCHEDULE: &[&str] = &[
    "train.total_steps",
    "train.epochs",
    "train.lr",
    "train.warmup_ratio",
    "train.min_lr_ratio",
    "train.clip_grad_norm",
];

/// Fields of the model and data sections that do not change what is trained: where things are.
const PATHS: &[&str] = &["model.target", "model.drafter_init", "data.path"];

/// Whole sections a resume may change: where and how fast things run, and what is measured.
const FREE_SECTIONS: &[&str] = &[
    "pipeline.",
    "checkpoint.",
    "eval.",
    "validation.",
    "telemetry.",
    "debug.",
];

/// Fields outside the model and data sections that do not change what is trained.
const FREE_FIELDS: &[&str] = &[
    "run.name",
    "run.runs_dir",
    "train.attention",
    "train.fused_loss",
    "devices.target_devices",
    "devices.grad_sync",
    "devices.concurrent_target",
];

/// Each field (dotted name) whose value differs between the run's `stored` configuration and
/// the `new` one, as "field: stored -> new", sorted by what a resume may do with it.
pub fn resume_changes(stored: &TrainConfig, new: &TrainConfig) -> ResumeChanges {
    let (a, b) = (flatten(stored), flatten(new));
    let mut out = ResumeChanges::default();
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for name in names {
        let (old, now) = (a.get(name), b.get(name));
        if old == now {
            continue;
        }
        let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(none)".into());
        let line = format!("{name}: {} -> {}", show(old), show(now));
        let name = name.as_str();
        let free = PATHS.contains(&name)
            || FREE_FIELDS.contains(&name)
            || FREE_SECTIONS.iter().any(|s| name.starts_with(s))
            // drafter devices may be renamed, not added or removed (the step's batches)
            || (name == "devices.drafter_devices"
                && stored.devices.drafter_devices.len() == new.devices.drafter_devices.len());
        if SCHEDULE.contains(&name) {
            out.schedule.push(line);
        } else if free {
            out.free.push(line);
        } else {
            out.refused.push(line);
        }
    }
    out
}

/// Every leaf of the configuration as (dotted name, value as TOML text).
fn flatten(config: &TrainConfig) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    if let Ok(value) = toml::Value::try_from(config) {
        walk("", &value, &mut out);
    }
    out
}

fn walk(prefix: &str, value: &toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let name = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                walk(&name, v, out);
            }
        }
        leaf => {
            out.insert(prefix.to_string(), leaf.to_string());
        }
    }
}
