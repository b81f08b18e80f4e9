//! Data: chat datasets and their readers.

pub mod arrow_io;
pub mod sharegpt;
