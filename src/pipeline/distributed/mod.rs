//! Data-parallel runs of several processes joined through torch.distributed's c10d (see
//! docs/distributed.md): the launcher's settings ([`settings`]), the process group
//! ([`group`]: rank 0's `TCPStore`, Gloo collectives; [`nccl_peer`]: NCCL between the GPUs
//! of the processes), and what the trainer exchanges at each
//! step ([`step`]: the summed gradient bucket and step numbers, rank 0's control word).

pub mod group;
pub mod nccl_peer;
pub mod settings;
pub mod step;

use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use group::ProcessGroup;
pub use settings::{DistSettings, Launcher};

/// How often each rank stamps its heartbeat in the store.
const HEARTBEAT: Duration = Duration::from_secs(1);

fn alive_key(rank: usize) -> String {
    format!("dflash/alive/{rank}")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

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
        let d = Arc::new(Distributed { settings, group });
        d.start_heartbeat();
        Ok(Some(d))
    }

    /// Stamps this rank's key in the store every [`HEARTBEAT`] for as long as it lives, so that
    /// when a collective fails the survivors can tell which rank went silent.
    fn start_heartbeat(self: &Arc<Self>) {
        let me: Weak<Distributed> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                while let Some(d) = me.upgrade() {
                    if d.group
                        .store_set(&alive_key(d.rank()), &now_ms().to_le_bytes())
                        .is_err()
                    {
                        return;
                    }
                    drop(d);
                    std::thread::sleep(HEARTBEAT);
                }
            });
        if let Err(e) = spawned {
            log::warn!("no heartbeat thread ({e}): a lost rank will not be named");
        }
    }

    /// The ranks whose heartbeat stopped, looking for up to `grace` (a rank that died a moment
    /// ago still has a fresh stamp). An error when the store is gone: rank 0, which hosts it.
    pub fn silent_ranks(&self, grace: Duration) -> anyhow::Result<Vec<usize>> {
        let until = std::time::Instant::now() + grace;
        loop {
            let mut silent = Vec::new();
            for r in (0..self.world()).filter(|&r| r != self.rank()) {
                let bytes = self
                    .group
                    .store_get(&alive_key(r), Duration::from_millis(500))?;
                let stamp = bytes
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_le_bytes);
                if now_ms().saturating_sub(stamp) > 3 * HEARTBEAT.as_millis() as u64 {
                    silent.push(r);
                }
            }
            if !silent.is_empty() || std::time::Instant::now() >= until {
                return Ok(silent);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
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
