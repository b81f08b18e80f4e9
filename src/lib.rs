#![cfg_attr(not(test), deny(clippy::unwrap_used))]
//! dflash-tui: train DFlash speculative-decoding drafters and steer the training live.

pub mod aten_ext;
pub mod bench;
pub mod cli;
pub mod config;
pub mod data;
pub mod device_event;
pub mod eval;
pub mod frontend;
pub mod fsutil;
pub mod gguf;
pub mod model;
pub mod paths;
pub mod pipeline;
pub mod runtime;
pub mod seed;
pub mod telemetry;
pub mod text;
pub mod train;
