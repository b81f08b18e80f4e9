//! Passes that stop when asked: the periodic evaluation and validation look at a flag shared
//! with whoever may stop them (the trainer's stop-at-once flag, set by a second SIGINT/SIGTERM)
//! between units of work (sequences, prompts, decoding steps) and end with [`Cancelled`]. A
//! pass on a real target runs for minutes; a scheduler's grace period after SIGTERM is often
//! 30 s.

use std::sync::atomic::{AtomicBool, Ordering};

/// A pass stopped because its cancel flag was set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cancelled: the run is stopping at once")]
pub struct Cancelled;

/// `Err(Cancelled)` once `flag` is set.
pub fn check(flag: &AtomicBool) -> Result<(), Cancelled> {
    if flag.load(Ordering::Relaxed) {
        Err(Cancelled)
    } else {
        Ok(())
    }
}

/// Whether `error`, or one of its causes, is a [`Cancelled`].
pub fn is_cancelled(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| cause.is::<Cancelled>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn a_set_flag_cancels_and_is_recognised_under_context() {
        let flag = AtomicBool::new(false);
        assert_eq!(check(&flag), Ok(()));
        flag.store(true, Ordering::Relaxed);
        let e = check(&flag)
            .context("after 3 of 10 sequences")
            .context("validation at step 4")
            .unwrap_err();
        assert!(is_cancelled(&e), "{e:#}");
        assert_eq!(
            format!("{e:#}"),
            "validation at step 4: after 3 of 10 sequences: cancelled: the run is stopping at once"
        );
        assert!(!is_cancelled(&anyhow::anyhow!("disk full")));
    }
}
