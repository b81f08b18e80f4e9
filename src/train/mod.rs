//! Training: the DFlash loss, the optimizer, checkpoints.

pub mod checkpoint;
pub mod loss;
pub mod optim;
