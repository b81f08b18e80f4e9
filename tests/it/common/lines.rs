//! A child's output lines, read on a thread of their own, awaited with a deadline.

/// The lines a child writes to a pipe, read on a thread of their own so that a test waits for
/// a reply with a deadline instead of sleeping and hoping.
pub struct Lines {
    rx: crossbeam_channel::Receiver<String>,
    /// Every line read so far, in order.
    pub seen: Vec<String>,
}

impl Lines {
    pub fn read(pipe: impl std::io::Read + Send + 'static) -> Lines {
        use std::io::BufRead;
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Lines {
            rx,
            seen: Vec::new(),
        }
    }

    /// The next line for which `want` holds (the lines before it are kept in `seen`); fails
    /// the test naming `what` when none comes within `limit` or the pipe closes first.
    pub fn next_with(
        &mut self,
        what: &str,
        limit: std::time::Duration,
        want: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if want(&line) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "no line with {what} ({e}) within {limit:?}; the lines so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Every line (those in `seen` first) once the pipe is closed, waiting at most `limit`.
    pub fn all(mut self, limit: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    return self.seen.join("\n")
                }
                Err(e) => panic!("the pipe stayed open ({e}) after {limit:?}"),
            }
        }
    }
}
