//! Log lines: compact (`14:03:07 I message`: local time, level letter, message) on stderr and,
//! for a training run, in its `train.log`. A run's terminal output can be switched off while it
//! runs: while its screen is up (the screen shows train.log) and after its terminal is gone
//! (SIGHUP), when train.log goes on alone.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The letter of a level in a log line.
fn letter(level: log::Level) -> char {
    match level {
        log::Level::Error => 'E',
        log::Level::Warn => 'W',
        log::Level::Info => 'I',
        log::Level::Debug => 'D',
        log::Level::Trace => 'T',
    }
}

/// Where lines go: the run log, and the terminal while `to_terminal` is set (through
/// `terminal`, e.g. the progress bars' writer, or stderr).
struct Sink {
    file: Option<File>,
    to_terminal: Arc<AtomicBool>,
    terminal: Option<Box<dyn Write + Send>>,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.to_terminal.load(Ordering::Relaxed) {
            // A terminal that is gone must not stop the logging to the file.
            let _ = match &mut self.terminal {
                Some(terminal) => terminal.write_all(buf),
                None => std::io::stderr().write_all(buf),
            };
        }
        if let Some(file) = &mut self.file {
            file.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = match &mut self.terminal {
            Some(terminal) => terminal.flush(),
            None => std::io::stderr().flush(),
        };
        match &mut self.file {
            Some(file) => file.flush(),
            None => Ok(()),
        }
    }
}

/// Installs the logger at `level` (a filter such as `info` or `dflash_tui=debug`). Lines go to
/// `log_file` when given (appended) and to stderr while the returned switch is on.
pub(super) fn init(level: &str, log_file: Option<&Path>, to_terminal: bool) -> Arc<AtomicBool> {
    init_with(level, log_file, to_terminal, None)
}

/// [`init`], writing the terminal's lines through `terminal` (the progress bars' writer,
/// which clears the bars around each line) instead of stderr.
pub(super) fn init_with(
    level: &str,
    log_file: Option<&Path>,
    to_terminal: bool,
    terminal: Option<Box<dyn Write + Send>>,
) -> Arc<AtomicBool> {
    let switch = Arc::new(AtomicBool::new(to_terminal));
    let file = log_file.and_then(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .map_err(|e| eprintln!("warning: {}: cannot write the log: {e}", p.display()))
            .ok()
    });
    let mut builder = env_logger::Builder::new();
    builder
        .parse_filters(level)
        .format(|buf, record| {
            let time = jiff::Zoned::now().strftime("%H:%M:%S");
            writeln!(buf, "{time} {} {}", letter(record.level()), record.args())
        })
        .target(env_logger::Target::Pipe(Box::new(Sink {
            file,
            to_terminal: switch.clone(),
            terminal,
        })));
    let _ = builder.try_init();
    switch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_has_its_letter() {
        let letters: String = [
            log::Level::Error,
            log::Level::Warn,
            log::Level::Info,
            log::Level::Debug,
            log::Level::Trace,
        ]
        .into_iter()
        .map(letter)
        .collect();
        assert_eq!(letters, "EWIDT");
    }
}
