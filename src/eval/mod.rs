//! Evaluation: perplexity of a target model (and, later, acceptance length of a drafter).

pub mod perplexity;
pub mod speculative;
