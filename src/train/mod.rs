//! Training: the DFlash loss, the optimizer, checkpoints, held-out validation.

pub mod checkpoint;
pub mod loss;
pub mod manifest;
pub mod optim;
pub mod resume;
pub mod run_lock;
pub mod validation;
