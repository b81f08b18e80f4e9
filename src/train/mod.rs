//! Training: the DFlash loss, the optimizer, checkpoints, held-out validation.

pub mod checkpoint;
pub mod loss;
pub mod optim;
pub mod run_lock;
pub mod validation;
