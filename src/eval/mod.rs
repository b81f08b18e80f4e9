//! Evaluation: perplexity of a target model, and acceptance length of a drafter by real
//! speculative decoding.

pub mod acceptance;
pub mod cancel;
pub mod perplexity;
pub(crate) mod prompts;
pub mod speculative;
