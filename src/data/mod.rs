//! Data: chat datasets and their readers.

pub mod sharegpt;
