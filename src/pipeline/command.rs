//! Runtime commands: one type for every control path (keys, the `:` line, stdin, the control
//! socket, signals), parsed from the same words everywhere.

use std::fmt;

use super::queue::QueueName;
use crate::config::{check_queue_depth, BadQueueDepth, MAX_QUEUE_DEPTH};

/// The shortest non-zero ProfileStats interval: a report is a table in the log, and 0.001 s
/// would write a thousand a second.
pub(crate) const MIN_PROFILE_INTERVAL_S: f64 = 1.0;

/// Characters of a user's text quoted back in an error (a 10 MB line was echoed whole).
const QUOTE_CHARS: usize = 40;

/// A command to the running trainer (control-room spec §2).
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Pause,
    Resume,
    /// Set a queue's capacity (1..=[`MAX_QUEUE_DEPTH`]).
    Queue {
        name: QueueName,
        depth: usize,
    },
    /// Write a checkpoint at the next step boundary.
    Checkpoint,
    /// ProfileStats report interval in seconds (0 = off, else >= [`MIN_PROFILE_INTERVAL_S`]).
    Profile {
        seconds: f64,
    },
    /// Checkpoint (unless `checkpoint` is false), drain, exit 0.
    Stop {
        checkpoint: bool,
    },
    /// Read-only: the run's state as one JSON object (`ctl status`).
    Status,
    /// Read-only: everything a screen shows as JSON, with the step records after `since`
    /// (all when None); what `attach` polls.
    Snapshot {
        since: Option<u64>,
    },
}

impl Command {
    /// Queries read the run's state and change nothing: a read-only viewer may send them.
    pub(crate) fn is_query(&self) -> bool {
        matches!(self, Command::Status | Command::Snapshot { .. })
    }
}

impl Command {
    /// Parses a command line such as `queue feature_q 2`. Errors quote at most
    /// [`QUOTE_CHARS`] characters of what was sent.
    pub fn parse(line: &str) -> Result<Command, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let usage =
            "commands: pause, resume, queue NAME DEPTH, checkpoint, profile SECONDS, stop, \
                     status";
        match words.as_slice() {
            ["pause"] => Ok(Command::Pause),
            ["resume"] => Ok(Command::Resume),
            ["checkpoint"] => Ok(Command::Checkpoint),
            ["stop"] => Ok(Command::Stop { checkpoint: true }),
            ["stop", "--no-checkpoint"] | ["stop-now"] => Ok(Command::Stop { checkpoint: false }),
            ["queue", name, depth] => parse_queue(name, depth),
            ["queue", ..] => Err("usage: queue NAME DEPTH".into()),
            ["profile", secs] => parse_profile(secs),
            ["profile", ..] => Err("usage: profile SECONDS".into()),
            ["status"] => Ok(Command::Status),
            ["snapshot"] => Ok(Command::Snapshot { since: None }),
            ["snapshot", since] => match since.parse::<u64>() {
                Ok(step) => Ok(Command::Snapshot { since: Some(step) }),
                Err(_) => Err(format!("snapshot: {} is not a step number", quote(since))),
            },
            [] => Err(format!("empty command; {usage}")),
            [other, ..] => Err(format!("unknown command {}; {usage}", quote(other))),
        }
    }
}

fn parse_queue(name: &str, depth: &str) -> Result<Command, String> {
    let name_q = quote(name);
    if name.chars().count() > QUOTE_CHARS {
        return Err(format!("queue {name_q}: no such queue"));
    }
    let depth = match depth.parse::<usize>().map(check_queue_depth) {
        Ok(Ok(d)) => d,
        Ok(Err(e @ BadQueueDepth::AboveLimit(_))) => {
            return Err(format!("queue {name}: {e} (as pipeline.*_queue_depth)"))
        }
        _ => {
            return Err(format!(
                "queue {name}: depth {} must be a whole number >= 1 and <= {MAX_QUEUE_DEPTH}",
                quote(depth)
            ))
        }
    };
    // (the name is at most QUOTE_CHARS characters here: the error may show it whole)
    let name = name.parse::<QueueName>().map_err(|e| e.to_string())?;
    Ok(Command::Queue { name, depth })
}

fn parse_profile(secs: &str) -> Result<Command, String> {
    match secs.parse::<f64>() {
        Ok(s) if s == 0.0 || (s >= MIN_PROFILE_INTERVAL_S && s.is_finite()) => {
            Ok(Command::Profile { seconds: s })
        }
        Ok(s) if s > 0.0 && s < MIN_PROFILE_INTERVAL_S => Err(format!(
            "profile: {s} s is below the {MIN_PROFILE_INTERVAL_S} s minimum (0 = off)"
        )),
        _ => Err(format!(
            "profile: {} must be a number of seconds >= {MIN_PROFILE_INTERVAL_S} (0 = off)",
            quote(secs)
        )),
    }
}

/// `text` in quotes, cut after [`QUOTE_CHARS`] characters with "…" (for error messages).
pub(crate) fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE_CHARS) {
        Some((cut, _)) => format!("{:?}…", &text[..cut]),
        None => format!("{text:?}"),
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Pause => write!(f, "pause"),
            Command::Resume => write!(f, "resume"),
            Command::Queue { name, depth } => write!(f, "queue {name} {depth}"),
            Command::Checkpoint => write!(f, "checkpoint"),
            Command::Profile { seconds } => write!(f, "profile {seconds}"),
            Command::Stop { checkpoint: true } => write!(f, "stop"),
            Command::Stop { checkpoint: false } => write!(f, "stop --no-checkpoint"),
            Command::Status => write!(f, "status"),
            Command::Snapshot { since: None } => write!(f, "snapshot"),
            Command::Snapshot { since: Some(step) } => write!(f, "snapshot {step}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_parse_and_print_back() {
        for line in [
            "pause",
            "resume",
            "queue feature_q 2",
            "queue batch_q 1024",
            "checkpoint",
            "profile 10",
            "profile 1",
            "profile 0",
            "stop",
            "stop --no-checkpoint",
        ] {
            assert_eq!(Command::parse(line).unwrap().to_string(), line);
        }
        assert!(Command::parse("queue batch_q 0")
            .unwrap_err()
            .contains(">= 1"));
        assert!(Command::parse("profile -3").is_err());
        assert!(Command::parse("profile NaN").is_err());
        assert!(Command::parse("profile inf").is_err());
        assert!(Command::parse("explode")
            .unwrap_err()
            .contains("unknown command"));
        assert!(Command::parse("   ").is_err());
    }

    #[test]
    fn queue_depth_and_profile_interval_have_limits() {
        assert_eq!(
            Command::parse("queue batch_q 1000000").unwrap_err(),
            "queue batch_q: depth 1000000 is above the limit of 1024 (as pipeline.*_queue_depth)"
        );
        assert_eq!(
            Command::parse("profile 0.001").unwrap_err(),
            "profile: 0.001 s is below the 1 s minimum (0 = off)"
        );
        assert!(Command::parse("queue batch_q 99999999999999999999999")
            .unwrap_err()
            .contains("<= 1024"));
    }

    #[test]
    fn errors_quote_a_short_prefix_of_what_was_sent() {
        let long = "x".repeat(10_000_000);
        for line in [
            long.clone(),
            format!("queue {long} 2"),
            format!("queue batch_q {long}"),
            format!("profile {long}"),
        ] {
            let e = Command::parse(&line).unwrap_err();
            assert!(e.len() < 200, "{} bytes: {}", e.len(), &e[..200]);
            assert!(e.contains(&format!("\"{}\"…", "x".repeat(40))), "{e}");
        }
        assert_eq!(quote("ünïcödé"), "\"ünïcödé\"");
        assert_eq!(quote(&"é".repeat(41)), format!("\"{}\"…", "é".repeat(40)));
    }
}
