//! The staged trainer: loader -> batch_q -> target workers -> feature_q -> drafter workers ->
//! gradient averaging and AdamW, in background threads joined by resizable queues, steered by
//! commands.

pub mod collective;
pub mod command;
pub mod control;
/// CUDA events live below the pipeline (eval times with them too).
pub use crate::device_event;
pub mod headless;
mod held_out;
pub mod nccl;
pub mod queue;
pub mod signals;
pub mod trainer;
