//! `ctl` and `attach`: a run's control socket and its control room, from another process.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use anyhow::Result;

use crate::frontend::tui::state::Viewer;

#[derive(Debug, clap::Args)]
pub struct CtlArgs {
    /// The run directory of the running trainer (it holds control.sock).
    pub run_dir: PathBuf,
    /// pause, resume, queue NAME DEPTH, checkpoint, profile SECONDS, stop, status
    #[arg(required = true, num_args = 1.., allow_hyphen_values = true)]
    pub command: Vec<String>,
}

pub(super) fn ctl(args: &CtlArgs) -> Result<()> {
    crate::frontend::ctl::run(&args.run_dir, &args.command)
}

#[derive(Debug, clap::Args)]
pub struct AttachArgs {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Look only: keys that would change the run are refused.
    #[arg(long)]
    pub read_only: bool,
}

pub(super) fn attach(args: &AttachArgs) -> Result<()> {
    let close = AtomicBool::new(false);
    let viewer = Viewer::Attached {
        read_only: args.read_only,
    };
    crate::frontend::tui::app::run(&args.run_dir, viewer, &close)
}
