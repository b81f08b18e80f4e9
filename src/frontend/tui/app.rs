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
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;

use super::feed::RunFeed;
use super::recorded::base_snapshot;
use super::render::render;
use super::state::{AppState, Viewer};
use super::update::{update, Action, Effect, Key};
use crate::frontend::socket::SOCKET_NAME;
use crate::pipeline::command::Command;

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
/// How often a screen with nothing new is drawn again anyway (a resized terminal).
const REDRAW: Duration = Duration::from_secs(1);

/// Runs the control room of the run in `run_dir` until the operator leaves it, the run has
/// ended and a key was pressed, or `close` is set (the trainer's terminal is gone, or a signal
/// stopped the run). The screen is drawn at once: the run is read by a thread of its own, so a
/// trainer that does not answer (or a long record to read) never holds the screen or the keys.
pub(crate) fn run(run_dir: &Path, viewer: Viewer, close: &AtomicBool) -> Result<()> {
    let socket = run_dir.join(SOCKET_NAME);
    let has_socket = socket.exists();
    if viewer != Viewer::Trainer && !has_socket && !run_dir.join("metrics.jsonl").exists() {
        anyhow::bail!(
            "{}: no trainer runs there and it has no metrics.jsonl (not a run directory?)",
            run_dir.display()
        );
    }
    let mut state = AppState::new(base_snapshot(run_dir, true));
    state.viewer = viewer;
    state.offline = Some(if has_socket {
        format!("connecting to the trainer at {} ...", socket.display())
    } else {
        "reading the run's records ...".to_string()
    });

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

    let (act_tx, act_rx) = crossbeam_channel::unbounded::<Action>();
    let input_stop = Arc::new(AtomicBool::new(false));
    spawn_input(act_tx.clone(), input_stop.clone())?;
    let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded::<Command>();
    spawn_feed(RunFeed::new(run_dir), act_tx, cmd_rx)?;

    let mut last_draw: Option<Instant> = None;
    let drawn = loop {
        if state.quit || close.load(Ordering::SeqCst) {
            break Ok(());
        }
        let frame_start = Instant::now();
        let actions: Vec<Action> = act_rx.try_iter().collect();
        let fresh = !actions.is_empty();
        for action in actions {
            for effect in update(&mut state, action) {
                let Effect::Send(cmd) = effect;
                // the reply comes back as an action
                let _ = cmd_tx.send(cmd);
            }
        }
        if fresh || last_draw.is_none_or(|t| t.elapsed() >= REDRAW) {
            if let Err(e) = terminal.draw(|f| render(f, &state)) {
                break Err(anyhow::Error::new(e).context("the terminal is gone"));
            }
            last_draw = Some(Instant::now());
        }
        if let Some(rest) = FRAME.checked_sub(frame_start.elapsed()) {
            std::thread::sleep(rest);
        }
    };
    input_stop.store(true, Ordering::Relaxed);
    drawn
}

/// Input thread: keys become actions. It ends with the screen, or when the terminal fails.
fn spawn_input(tx: Sender<Action>, stop: Arc<AtomicBool>) -> Result<()> {
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
    Ok(())
}

/// Feed thread: polls the run every [`POLL`] and sends the operator's commands, both becoming
/// actions (what changed only). It ends when the screen is gone.
fn spawn_feed(mut feed: RunFeed, tx: Sender<Action>, commands: Receiver<Command>) -> Result<()> {
    std::thread::Builder::new()
        .name("feed".into())
        .spawn(move || {
            let mut next_poll = Instant::now();
            let mut offline: Option<Option<String>> = None;
            loop {
                let mut out = Vec::new();
                match commands.recv_deadline(next_poll) {
                    Ok(cmd) => out.push(Action::Reply(feed.send(&cmd))),
                    Err(RecvTimeoutError::Timeout) => {
                        let seen = feed.poll();
                        next_poll = Instant::now() + POLL;
                        if !seen.log.is_empty() {
                            out.push(Action::Log(seen.log));
                        }
                        if offline.as_ref() != Some(&seen.offline) {
                            offline = Some(seen.offline.clone());
                            out.push(Action::Offline(seen.offline));
                        }
                        if let Some(snap) = seen.snapshot {
                            out.push(Action::Telemetry(Box::new(snap)));
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
                if out.into_iter().any(|a| tx.send(a).is_err()) {
                    return;
                }
            }
        })?;
    Ok(())
}
