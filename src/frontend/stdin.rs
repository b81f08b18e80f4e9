//! Commands typed on stdin, one a line, when no screen owns the terminal (the run loop starts
//! the reader then): each line is parsed as every command is and sent to the run loop as a
//! [`Request`] without a reply channel, so the loop prints its answer on stdout (`ok: ...` or
//! `error: ...`, through `say`); a line that does not parse gets its `error: ...` here.

use std::io::{BufRead, Write};

use super::socket::Request;
use crate::pipeline::command::Command;

/// Prints a line on stdout; a terminal that is gone (SIGHUP) is not an error.
pub(super) fn say(line: &str) {
    let _ = writeln!(std::io::stdout(), "{line}");
}

/// Reads commands from stdin lines until EOF (no stdin, as in CI, ends it at once).
pub(crate) fn spawn_stdin_reader(requests: crossbeam_channel::Sender<Request>) {
    let _ = std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                let Ok(line) = line else { break };
                if line.trim().is_empty() {
                    continue;
                }
                match Command::parse(&line) {
                    Ok(command) => {
                        if requests
                            .send(Request {
                                command,
                                reply: None,
                            })
                            .is_err()
                        {
                            break;
                        }
                    }
                    Err(e) => say(&format!("error: {e}")),
                }
            }
        });
}
