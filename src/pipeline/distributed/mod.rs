//! Data-parallel runs of several processes joined through torch.distributed's c10d (see
//! docs/distributed.md): the launcher's settings ([`settings`]), the process group
//! ([`group`]: rank 0's `TCPStore`, Gloo collectives), and what the trainer exchanges at each
//! step ([`step`]: the summed gradient bucket and step numbers, rank 0's control word).

pub mod group;
pub mod settings;
pub mod step;

use std::sync::Arc;

pub use group::ProcessGroup;
pub use settings::{DistSettings, Launcher};

/// A process's part in a multi-process run: where it stands and its process group.
pub struct Distributed {
    pub settings: DistSettings,
    pub group: ProcessGroup,
}

impl Distributed {
    /// Reads the launcher's settings from the environment and joins the group; `None` for a
    /// plain single-process run.
    pub fn from_env() -> anyhow::Result<Option<Arc<Distributed>>> {
        let Some(settings) = DistSettings::from_env(|k| std::env::var(k).ok())? else {
            return Ok(None);
        };
        let group = ProcessGroup::connect(&settings)?;
        Ok(Some(Arc::new(Distributed { settings, group })))
    }

    pub fn rank(&self) -> usize {
        self.settings.rank
    }

    pub fn world(&self) -> usize {
        self.settings.world
    }

    /// Rank 0: it writes the checkpoints and records, hosts the control room, and decides.
    pub fn is_leader(&self) -> bool {
        self.settings.rank == 0
    }
}
