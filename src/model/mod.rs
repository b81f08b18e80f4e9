//! Models: the frozen target (Llama family) and what it needs (config, weights, decoding).

pub mod config;
pub mod generate;
pub mod llama;
pub mod weights;

pub use config::TargetConfig;
pub use llama::{KvCache, LlamaModel};
