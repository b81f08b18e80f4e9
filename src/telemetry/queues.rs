//! The pipeline's queues as telemetry sees them: their names (typed: the `queue NAME DEPTH`
//! command, the screen and `metrics.jsonl` use the same words) and their fill levels.

use serde::{Deserialize, Serialize};

/// The pipeline's queues, by the names the `queue NAME DEPTH` command, the screen and
/// `metrics.jsonl` use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QueueName {
    /// Batches waiting between the data loader and the target.
    #[serde(rename = "batch_q")]
    Batch,
    /// Target features waiting for the drafter.
    #[serde(rename = "feature_q")]
    Feature,
}

impl QueueName {
    /// Every queue, in pipeline order.
    pub(crate) const ALL: [QueueName; 2] = [QueueName::Batch, QueueName::Feature];

    pub fn as_str(self) -> &'static str {
        match self {
            QueueName::Batch => "batch_q",
            QueueName::Feature => "feature_q",
        }
    }
}

impl std::fmt::Display for QueueName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// A name that is no queue's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown queue {0:?} (queues: batch_q, feature_q)")]
pub struct UnknownQueue(pub String);

impl std::str::FromStr for QueueName {
    type Err = UnknownQueue;
    fn from_str(s: &str) -> Result<Self, UnknownQueue> {
        QueueName::ALL
            .into_iter()
            .find(|q| q.as_str() == s)
            .ok_or_else(|| UnknownQueue(s.to_string()))
    }
}

/// Fill level of a queue, for the screen.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueLevel {
    pub name: QueueName,
    pub len: usize,
    pub capacity: usize,
    pub pushed: u64,
    pub popped: u64,
}

impl QueueLevel {
    pub(crate) fn fill(&self) -> f64 {
        self.len as f64 / self.capacity.max(1) as f64
    }
}

/// A queue's state in words, once data flows through it (before, its level means nothing).
pub(crate) fn queue_state(q: &QueueLevel) -> Option<&'static str> {
    if q.pushed == 0 && q.popped == 0 {
        None
    } else if q.len >= q.capacity {
        Some("full")
    } else if q.len == 0 {
        Some("empty")
    } else {
        Some("ok")
    }
}
