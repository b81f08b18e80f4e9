//! The front ends of a training run: the inputs that steer it, the run loop and the screen.
//!
//! Three inputs, one command type ([`Command`](crate::pipeline::command::Command), parsed from
//! the same words everywhere; the trainer below consumes it):
//! - [`signals`]: SIGINT/SIGTERM (stop), SIGUSR1 (checkpoint), SIGHUP (the terminal is gone),
//!   counted from start-up and taken by the run loop at each tick;
//! - [`socket`]: the control socket `RUN_DIR/control.sock`, for `ctl` ([`ctl`], which reads an
//!   ended run's status from its records), `attach` and the screen;
//! - [`stdin`]: command lines typed on stdin when no screen owns the terminal.
//!
//! The socket and stdin send [`socket::Request`]s down one channel to the run loop,
//! [`run_loop`], which runs under either front end: it hands the commands to the trainer,
//! answers the queries, acts on the signals, and writes the records and progress lines. The
//! screen, [`tui`] (the control room), is a viewer of the run through its socket like `attach`:
//! its keys and `:` line reach the run loop as socket requests.

pub(crate) mod ctl;
pub(crate) mod ranks;
pub(crate) mod run_loop;
pub(crate) mod signals;
pub mod socket;
pub(crate) mod stdin;
pub mod tui;
