//! The control room: a ratatui screen over a run, a viewer of it through its control socket
//! (the trainer's own screen and `attach` alike): the terminal loop (`app`), what it reads of
//! the run (`feed`: the socket, the run log, the records, which `recorded` follows), the state, the pure update, the pure
//! render (`render/`, one file per panel, and the number formats the panels share), and a
//! synthetic state for the render benchmark (`sample`).

pub(crate) mod app;
pub(crate) mod feed;
pub(crate) mod recorded;
pub mod render;
pub(crate) mod sample;
pub mod state;
pub(crate) mod update;
