//! Runtime commands: one type for every control path (keys, the `:` line, stdin, the control
//! socket, signals), parsed from the same words everywhere.

use std::fmt;

/// A command to the running trainer (control-room spec §2).
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Pause,
    Resume,
    /// Set a queue's capacity (>= 1).
    Queue {
        name: String,
        depth: usize,
    },
    /// Write a checkpoint at the next step boundary.
    Checkpoint,
    /// ProfileStats report interval in seconds (0 = off).
    Profile {
        seconds: f64,
    },
    /// Checkpoint (unless `checkpoint` is false), drain, exit 0.
    Stop {
        checkpoint: bool,
    },
}

impl Command {
    /// Parses a command line such as `queue feature_q 2`.
    pub fn parse(line: &str) -> Result<Command, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let usage = "commands: pause, resume, queue NAME DEPTH, checkpoint, profile SECONDS, stop";
        match words.as_slice() {
            ["pause"] => Ok(Command::Pause),
            ["resume"] => Ok(Command::Resume),
            ["checkpoint"] => Ok(Command::Checkpoint),
            ["stop"] => Ok(Command::Stop { checkpoint: true }),
            ["stop", "--no-checkpoint"] | ["stop-now"] => Ok(Command::Stop { checkpoint: false }),
            ["queue", name, depth] => match depth.parse::<usize>() {
                Ok(d) if d >= 1 => Ok(Command::Queue {
                    name: name.to_string(),
                    depth: d,
                }),
                _ => Err(format!(
                    "queue {name}: depth {depth:?} must be a whole number >= 1"
                )),
            },
            ["queue", ..] => Err("usage: queue NAME DEPTH".into()),
            ["profile", secs] => match secs.parse::<f64>() {
                Ok(s) if s >= 0.0 && s.is_finite() => Ok(Command::Profile { seconds: s }),
                _ => Err(format!(
                    "profile: {secs:?} must be a number of seconds >= 0 (0 = off)"
                )),
            },
            ["profile", ..] => Err("usage: profile SECONDS".into()),
            [] => Err(format!("empty command; {usage}")),
            [other, ..] => Err(format!("unknown command {other:?}; {usage}")),
        }
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
            "checkpoint",
            "profile 10",
            "stop",
            "stop --no-checkpoint",
        ] {
            assert_eq!(Command::parse(line).unwrap().to_string(), line);
        }
        assert!(Command::parse("queue batch_q 0")
            .unwrap_err()
            .contains(">= 1"));
        assert!(Command::parse("profile -3").is_err());
        assert!(Command::parse("explode")
            .unwrap_err()
            .contains("unknown command"));
        assert!(Command::parse("   ").is_err());
    }
}
