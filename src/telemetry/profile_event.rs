//! The events ProfileStats times ([`ProfileEvent`]): their spec names, the stage whose wall time
//! each one's share is of, and whether its time is work or a wait.

/// The timed events of the control-room spec §3, in pipeline order. Their names are the
/// spec's and the wire format's (metrics.jsonl, the screen, `bench`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ProfileEvent {
    #[serde(rename = "loader.fetch")]
    LoaderFetch,
    #[serde(rename = "loader.pack")]
    LoaderPack,
    #[serde(rename = "batch_q.wait")]
    BatchQWait,
    #[serde(rename = "target.h2d")]
    TargetH2d,
    #[serde(rename = "target.forward")]
    TargetForward,
    #[serde(rename = "target.handoff")]
    TargetHandoff,
    #[serde(rename = "feature_q.wait")]
    FeatureQWait,
    #[serde(rename = "drafter.anchors")]
    DrafterAnchors,
    #[serde(rename = "drafter.forward")]
    DrafterForward,
    #[serde(rename = "drafter.loss")]
    DrafterLoss,
    #[serde(rename = "drafter.backward")]
    DrafterBackward,
    #[serde(rename = "grad.sync")]
    GradSync,
    #[serde(rename = "optim.step")]
    OptimStep,
    #[serde(rename = "checkpoint.save")]
    CheckpointSave,
    #[serde(rename = "validation.pass")]
    ValidationPass,
    #[serde(rename = "eval.pass")]
    EvalPass,
    #[serde(rename = "step.total")]
    StepTotal,
}

impl ProfileEvent {
    /// Every event, in pipeline order (a recorder's slots are indexed by it).
    pub const ALL: [ProfileEvent; 17] = [
        ProfileEvent::LoaderFetch,
        ProfileEvent::LoaderPack,
        ProfileEvent::BatchQWait,
        ProfileEvent::TargetH2d,
        ProfileEvent::TargetForward,
        ProfileEvent::TargetHandoff,
        ProfileEvent::FeatureQWait,
        ProfileEvent::DrafterAnchors,
        ProfileEvent::DrafterForward,
        ProfileEvent::DrafterLoss,
        ProfileEvent::DrafterBackward,
        ProfileEvent::GradSync,
        ProfileEvent::OptimStep,
        ProfileEvent::CheckpointSave,
        ProfileEvent::ValidationPass,
        ProfileEvent::EvalPass,
        ProfileEvent::StepTotal,
    ];

    /// The spec's name, as in metrics.jsonl and on the screen.
    pub fn name(self) -> &'static str {
        match self {
            ProfileEvent::LoaderFetch => "loader.fetch",
            ProfileEvent::LoaderPack => "loader.pack",
            ProfileEvent::BatchQWait => "batch_q.wait",
            ProfileEvent::TargetH2d => "target.h2d",
            ProfileEvent::TargetForward => "target.forward",
            ProfileEvent::TargetHandoff => "target.handoff",
            ProfileEvent::FeatureQWait => "feature_q.wait",
            ProfileEvent::DrafterAnchors => "drafter.anchors",
            ProfileEvent::DrafterForward => "drafter.forward",
            ProfileEvent::DrafterLoss => "drafter.loss",
            ProfileEvent::DrafterBackward => "drafter.backward",
            ProfileEvent::GradSync => "grad.sync",
            ProfileEvent::OptimStep => "optim.step",
            ProfileEvent::CheckpointSave => "checkpoint.save",
            ProfileEvent::ValidationPass => "validation.pass",
            ProfileEvent::EvalPass => "eval.pass",
            ProfileEvent::StepTotal => "step.total",
        }
    }

    /// The event of a spec name.
    pub fn named(name: &str) -> Option<ProfileEvent> {
        ProfileEvent::ALL.into_iter().find(|e| e.name() == name)
    }

    /// The stage whose threads' wall time the event's share is of (with two target workers,
    /// target.forward was 122 % of the interval). None for `step.total`: it spans overlapping
    /// steps (the next begins before the last is read), no stage's time, so no share.
    pub fn stage(self) -> Option<Stage> {
        use ProfileEvent::*;
        match self {
            LoaderFetch | LoaderPack => Some(Stage::Loader),
            BatchQWait | TargetH2d | TargetForward | TargetHandoff => Some(Stage::Target),
            // The coordinator is drafter worker 0: it syncs, steps, checkpoints, validates and
            // evaluates.
            FeatureQWait | DrafterAnchors | DrafterForward | DrafterLoss | DrafterBackward
            | GradSync | OptimStep | CheckpointSave | ValidationPass | EvalPass => {
                Some(Stage::Drafter)
            }
            StepTotal => None,
        }
    }

    /// What the event's time is.
    pub fn kind(self) -> TimingKind {
        use ProfileEvent::*;
        match self {
            BatchQWait | TargetHandoff | FeatureQWait => TimingKind::Wait,
            StepTotal => TimingKind::Span,
            LoaderFetch | LoaderPack | TargetH2d | TargetForward | DrafterAnchors
            | DrafterForward | DrafterLoss | DrafterBackward | GradSync | OptimStep
            | CheckpointSave | ValidationPass | EvalPass => TimingKind::Work,
        }
    }

    /// The event's slot in a recorder.
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for ProfileEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A pipeline stage: a group of threads whose wall time the shares of its events are of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Loader,
    Target,
    Drafter,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Loader => "loader",
            Stage::Target => "target",
            Stage::Drafter => "drafter",
        }
    }
}

/// What an event's time is: a span over other events, work, or a wait on a queue (in the
/// order reports list them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TimingKind {
    /// `step.total`: a step from its start to its numbers read, overlapping the next one.
    Span,
    Work,
    /// A stage idle: waiting for its input queue, or handing off to a full one.
    Wait,
}

impl TimingKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TimingKind::Work => "work",
            TimingKind::Wait => "wait",
            TimingKind::Span => "span",
        }
    }
}
