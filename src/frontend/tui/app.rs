//! The terminal loop of the control room: an input thread (crossterm) and the run as
//! [`RunFeed`] reads it (its state through the control socket, its log, its records) become
//! `Action`s for the pure `update`; the screen is redrawn from the state about ten times a
//! second. The same loop is the trainer's own screen and `attach`: it is a viewer of the run,
//! and leaving it (a key, a terminal that is gone) never stops the run. On the trainer's own
//! screen, whatever libtorch or CUDA write to fd 2 goes to the run log while it is up.

use std::io::Stdout;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;

use super::feed::{recorded_snapshot, RunFeed};
use super::render::render;
use super::state::{AppState, Viewer};
use super::update::{update, Action, Effect, Key};

const FRAME: Duration = Duration::from_millis(100);

fn map_key(code: KeyCode, mods: KeyModifiers) -> Option<Key> {
    Some(match code {
        KeyCode::Char('c') if mods.contains(KeyModifiers::CONTROL) => Key::Interrupt,
        KeyCode::Char(c) => Key::Char(c),
        KeyCode::Enter => Key::Enter,
        KeyCode::Esc => Key::Esc,
        KeyCode::Backspace => Key::Backspace,
        KeyCode::Tab => Key::Tab,
        KeyCode::BackTab => Key::BackTab,
        KeyCode::Up => Key::Up,
        KeyCode::Down => Key::Down,
        KeyCode::Left => Key::Left,
        KeyCode::Right => Key::Right,
        _ => return None,
    })
}

/// Sends fd 2 to a file while alive; restores it when dropped.
struct StderrRedirect {
    saved: i32,
}

impl StderrRedirect {
    fn to_file(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        // SAFETY: plain descriptor duplication; `saved` is restored in Drop.
        let saved = unsafe { libc::dup(2) };
        if saved < 0 || unsafe { libc::dup2(file.as_raw_fd(), 2) } < 0 {
            anyhow::bail!("cannot redirect stderr to {}", path.display());
        }
        Ok(StderrRedirect { saved })
    }
}

impl Drop for StderrRedirect {
    fn drop(&mut self) {
        // SAFETY: restores the descriptor saved in `to_file`.
        unsafe {
            libc::dup2(self.saved, 2);
            libc::close(self.saved);
        }
    }
}

/// Puts the terminal back however the loop ends.
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        let _ = crossterm::terminal::disable_raw_mode();
        let _ = crossterm::execute!(
            std::io::stdout(),
            crossterm::terminal::LeaveAlternateScreen,
            crossterm::cursor::Show
        );
    }
}

/// How often the screen asks the run for its state.
const POLL: Duration = Duration::from_millis(250);

/// Runs the control room of the run in `run_dir` until the operator leaves it, the run has
/// ended and a key was pressed, or `close` is set (the trainer's terminal is gone, or a signal
/// stopped the run).
pub(crate) fn run(run_dir: &Path, viewer: Viewer, close: &AtomicBool) -> Result<()> {
    let mut feed = RunFeed::new(run_dir);
    let first = feed.poll();
    let snapshot = first
        .snapshot
        .clone()
        .or_else(|| recorded_snapshot(run_dir, true))
        .with_context(|| {
            format!(
                "{}: no trainer runs there and it has no metrics.jsonl (not a run directory?)",
                run_dir.display()
            )
        })?;

    crossterm::terminal::enable_raw_mode().context("cannot put the terminal in raw mode")?;
    let _guard = TerminalGuard;
    crossterm::execute!(std::io::stdout(), crossterm::terminal::EnterAlternateScreen)?;
    let _stderr = match viewer {
        Viewer::Trainer => StderrRedirect::to_file(&run_dir.join("train.log")).ok(),
        Viewer::Attached { .. } => None,
    };
    let mut terminal: Terminal<CrosstermBackend<Stdout>> =
        Terminal::new(CrosstermBackend::new(std::io::stdout()))?;
    terminal.clear()?;

    // Input thread: keys become actions. It ends with the screen, or when the terminal fails.
    let (act_tx, act_rx) = crossbeam_channel::unbounded::<Action>();
    let input_stop = Arc::new(AtomicBool::new(false));
    {
        let stop = input_stop.clone();
        let tx = act_tx.clone();
        std::thread::Builder::new()
            .name("input".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match event::poll(Duration::from_millis(50)) {
                        Ok(true) => {}
                        Ok(false) => continue,
                        Err(_) => break,
                    }
                    let key = match event::read() {
                        Ok(Event::Key(k)) if k.kind != KeyEventKind::Release => {
                            map_key(k.code, k.modifiers)
                        }
                        Ok(_) => None,
                        Err(_) => break,
                    };
                    if let Some(key) = key {
                        if tx.send(Action::Key(key)).is_err() {
                            break;
                        }
                    }
                }
            })?;
    }

    let mut state = AppState::new(snapshot);
    state.viewer = viewer;
    let mut pending = vec![Action::Log(first.log), Action::Offline(first.offline)];
    let mut last_poll = Instant::now();
    let drawn = loop {
        if state.quit || close.load(Ordering::SeqCst) {
            break Ok(());
        }
        let frame_start = Instant::now();
        let mut actions: Vec<Action> = std::mem::take(&mut pending);
        actions.extend(act_rx.try_iter());
        if last_poll.elapsed() >= POLL {
            last_poll = Instant::now();
            let seen = feed.poll();
            actions.push(Action::Log(seen.log));
            actions.push(Action::Offline(seen.offline));
            if let Some(snap) = seen.snapshot {
                actions.push(Action::Telemetry(Box::new(snap)));
            }
        }
        for action in actions {
            for effect in update(&mut state, action) {
                let Effect::Send(cmd) = effect;
                let reply = feed.send(&cmd);
                update(&mut state, Action::Reply(reply));
            }
        }
        if let Err(e) = terminal.draw(|f| render(f, &state)) {
            break Err(anyhow::Error::new(e).context("the terminal is gone"));
        }
        if let Some(rest) = FRAME.checked_sub(frame_start.elapsed()) {
            std::thread::sleep(rest);
        }
    };
    input_stop.store(true, Ordering::Relaxed);
    drawn
}
