#![cfg_attr(not(test), deny(clippy::unwrap_used))]
// Items are visible to the crate unless the binary, tests or examples use them (`pub`).
#![warn(unreachable_pub)]
//! dflash-tui: train DFlash speculative-decoding drafters and steer the training live.

pub mod aten_ext;
pub(crate) mod bench;
pub mod cli;
pub mod config;
pub mod data;
pub(crate) mod device_event;
pub mod eval;
pub mod frontend;
pub(crate) mod fsutil;
pub mod gguf;
pub mod model;
pub(crate) mod paths;
pub mod pipeline;
pub mod runtime;
pub(crate) mod seed;
pub mod telemetry;
pub mod text;
pub mod train;
