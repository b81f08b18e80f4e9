//! What a `{"type": "event"}` line of metrics.jsonl is about: the closed set the trainer and
//! the run loop write, by the names the file has always used.

use serde::{Deserialize, Serialize};

/// The kind of a run event. Read from a string, so that a metrics.jsonl written by another
/// version, with a kind this one does not know, still reads whole: such a kind is kept as
/// [`EventKind::Other`] and written back as it was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum EventKind {
    /// The run started (devices, data, drafter).
    Start,
    /// The drafter's warm-up (the first steps' compilation and allocation).
    WarmUp,
    /// How gradients are synchronised across drafter workers.
    GradSync,
    Eval,
    Validation,
    Checkpoint,
    /// A checkpoint could not be written; training went on.
    CheckpointFailed,
    /// A control command the trainer answered, with its reply.
    Command,
    Paused,
    Stopped,
    EarlyStop,
    Finished,
    Error,
    /// A kind this version does not write (from another version's file).
    Other(String),
}

impl EventKind {
    /// Every kind this version writes.
    pub const KNOWN: [EventKind; 13] = [
        EventKind::Start,
        EventKind::WarmUp,
        EventKind::GradSync,
        EventKind::Eval,
        EventKind::Validation,
        EventKind::Checkpoint,
        EventKind::CheckpointFailed,
        EventKind::Command,
        EventKind::Paused,
        EventKind::Stopped,
        EventKind::EarlyStop,
        EventKind::Finished,
        EventKind::Error,
    ];

    /// The name in metrics.jsonl.
    pub fn as_str(&self) -> &str {
        match self {
            EventKind::Start => "start",
            EventKind::WarmUp => "warm_up",
            EventKind::GradSync => "grad_sync",
            EventKind::Eval => "eval",
            EventKind::Validation => "validation",
            EventKind::Checkpoint => "checkpoint",
            EventKind::CheckpointFailed => "checkpoint_failed",
            EventKind::Command => "command",
            EventKind::Paused => "paused",
            EventKind::Stopped => "stopped",
            EventKind::EarlyStop => "early_stop",
            EventKind::Finished => "finished",
            EventKind::Error => "error",
            EventKind::Other(name) => name,
        }
    }
}

impl From<String> for EventKind {
    fn from(name: String) -> Self {
        EventKind::KNOWN
            .into_iter()
            .find(|k| k.as_str() == name)
            .unwrap_or(EventKind::Other(name))
    }
}

impl From<EventKind> for String {
    fn from(kind: EventKind) -> Self {
        kind.as_str().to_string()
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::records::MetricsRecord;

    #[test]
    fn kinds_keep_their_names_in_metrics_jsonl() {
        for kind in EventKind::KNOWN {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind);
        }
        let line =
            r#"{"type":"event","elapsed_s":1.5,"kind":"checkpoint_failed","message":"disk full"}"#;
        let record: MetricsRecord = serde_json::from_str(line).unwrap();
        assert_eq!(
            record,
            MetricsRecord::Event {
                elapsed_s: 1.5,
                kind: EventKind::CheckpointFailed,
                message: "disk full".into(),
            }
        );
        assert_eq!(serde_json::to_string(&record).unwrap(), line);
    }

    #[test]
    fn a_kind_from_another_version_reads_and_writes_back_unchanged() {
        let line = r#"{"type":"event","elapsed_s":2.0,"kind":"resharded","message":"4 ranks"}"#;
        let record: MetricsRecord = serde_json::from_str(line).unwrap();
        let MetricsRecord::Event { kind, .. } = &record else {
            panic!("{record:?}");
        };
        assert_eq!(kind, &EventKind::Other("resharded".into()));
        assert_eq!(serde_json::to_string(&record).unwrap(), line);
    }
}
