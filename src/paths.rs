//! Where dflash-tui looks for models, datasets, runs and the demo assets.

use std::path::PathBuf;

/// Name of the demo model folder inside the demo directory.
pub(crate) const DEMO_MODEL: &str = "SmolLM2-135M-Instruct";
/// Name of the recovered ShareGPT conversations inside the demo directory.
pub(crate) const DEMO_CONVERSATIONS: &str = "sharegpt.jsonl";

/// The directories dflash-tui uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Locations {
    /// Demo assets made by `scripts/setup-demo.sh`.
    pub demo_dir: PathBuf,
    /// Root of user data (platform data directory, or `DFLASH_HOME`).
    pub data_dir: PathBuf,
    pub models_dir: PathBuf,
    pub datasets_dir: PathBuf,
    pub runs_dir: PathBuf,
}

impl Locations {
    /// Resolves the locations from the environment: `DFLASH_HOME` overrides the platform data
    /// directory, `DFLASH_DEMO_DIR` the demo assets (default `./assets/demo`, else the one of
    /// the source checkout this binary was built from).
    pub(crate) fn from_env() -> Self {
        let data_dir = std::env::var_os("DFLASH_HOME")
            .map(PathBuf::from)
            .or_else(|| {
                directories::ProjectDirs::from("", "", "dflash-tui")
                    .map(|d| d.data_dir().to_path_buf())
            })
            .unwrap_or_else(|| PathBuf::from(".dflash-tui"));
        let demo_dir = std::env::var_os("DFLASH_DEMO_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let local = PathBuf::from("assets/demo");
                if local.is_dir() {
                    local
                } else {
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/demo")
                }
            });
        Locations {
            demo_dir,
            models_dir: data_dir.join("models"),
            datasets_dir: data_dir.join("datasets"),
            runs_dir: data_dir.join("runs"),
            data_dir,
        }
    }

    pub(crate) fn demo_model(&self) -> PathBuf {
        self.demo_dir.join(DEMO_MODEL)
    }

    pub(crate) fn demo_conversations(&self) -> PathBuf {
        self.demo_dir.join(DEMO_CONVERSATIONS)
    }
}
