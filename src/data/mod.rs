//! Data: chat datasets in, tokenised datasets out, and the loader that feeds the trainer
//! (in-memory token store, resumable sampler, token-budget packer).

pub mod arrow_io;
pub(crate) mod chat;
pub mod check;
pub mod packer;
pub(crate) mod prepare_data;
pub(crate) mod regenerate;
pub mod sampler;
pub mod sharegpt;
pub mod store;
pub(crate) mod token_prefix;
pub(crate) mod tokenise_chat;
