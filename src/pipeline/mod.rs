//! The staged trainer: loader -> batch_q -> target workers -> feature_q -> drafter workers ->
//! gradient averaging and AdamW, in background threads joined by resizable queues, steered by
//! commands ([`command`]: the type and its parser live here, with the trainer that consumes
//! them; the inputs that send them, the run loop and the screen are in `crate::frontend`).

pub(crate) mod collective;
pub mod command;
pub mod distributed;
mod held_out;
pub(crate) mod nccl;
pub mod queue;
pub mod trainer;
