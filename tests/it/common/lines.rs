//! The binary under test as a child process, and a child's output lines, read on threads of
//! their own and awaited with a deadline.

use std::io::{BufRead, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};

/// The binary under test on `args`, its log at info, stdout and stderr piped (for [`Lines`]).
pub fn spawn_dflash(args: &[String], stdin: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(args)
        .env("DFLASH_LOG", "info")
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The lines a child writes to its pipes, read on threads of their own so that a test waits
/// for a line with a deadline instead of sleeping and hoping.
pub struct Lines {
    rx: crossbeam_channel::Receiver<String>,
    /// Every line read so far, in order.
    pub seen: Vec<String>,
}

/// Sends each line of `pipe` until it closes (bytes that are not UTF-8 replaced, so that one
/// bad byte does not stop the reading).
fn forward(pipe: impl Read + Send + 'static, tx: Sender<String>) {
    std::thread::spawn(move || {
        let mut pipe = std::io::BufReader::new(pipe);
        let mut line = Vec::new();
        while matches!(pipe.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            let text = String::from_utf8_lossy(&line);
            let text = text.strip_suffix('\n').unwrap_or(&text);
            if tx
                .send(text.strip_suffix('\r').unwrap_or(text).into())
                .is_err()
            {
                return;
            }
            line.clear();
        }
    });
}

impl Lines {
    pub fn read(pipe: impl Read + Send + 'static) -> Lines {
        let (tx, rx) = crossbeam_channel::unbounded();
        forward(pipe, tx);
        Lines {
            rx,
            seen: Vec::new(),
        }
    }

    /// The lines of `child`'s stdout and stderr in one stream, in the order they arrive.
    pub fn merged(child: &mut Child) -> Lines {
        let (tx, rx) = crossbeam_channel::unbounded();
        forward(child.stdout.take().expect("stdout piped"), tx.clone());
        forward(child.stderr.take().expect("stderr piped"), tx);
        Lines {
            rx,
            seen: Vec::new(),
        }
    }

    /// The next line for which `want` holds (the lines before it are kept in `seen`); fails
    /// the test naming `what` when none comes within `limit` or the pipes close first.
    pub fn next_with(
        &mut self,
        what: &str,
        limit: Duration,
        mut want: impl FnMut(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if want(&line) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!(
                    "no line with {what} within {limit:?}; the lines so far:\n{}",
                    self.seen.join("\n")
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "the output ended before a line with {what}; the lines:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Every line (those in `seen` first) once the pipes are closed, waiting at most `limit`.
    pub fn all(&mut self, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(RecvTimeoutError::Disconnected) => return self.seen.join("\n"),
                Err(RecvTimeoutError::Timeout) => panic!(
                    "the output stayed open after {limit:?}; the lines so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }
}
