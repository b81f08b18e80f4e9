//! The terminal loop of the control room: an input thread (crossterm), the trainer's
//! telemetry, NVML readings, requests from the control socket and signals, all turned into
//! `Action`s for the pure `update`; the screen is redrawn from the state about ten times a
//! second. While the screen is up, whatever libtorch or CUDA write to fd 2 goes to the run log.

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

use super::render::render;
use super::state::AppState;
use super::update::{update, Action, Effect, Key};
use crate::pipeline::control::{self, Request};
use crate::pipeline::signals::{SignalFlags, SignalRequest};
use crate::pipeline::trainer::{RunOutcome, TrainerHandle};
use crate::telemetry::gpu::GpuMonitor;

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

/// Runs the control room until the run has ended and a key was pressed. A control socket
/// that cannot be served stops the run before the screen opens.
pub fn run(
    handle: TrainerHandle,
    mut signals: SignalFlags,
    gpu_interval_s: f64,
) -> Result<RunOutcome> {
    signals.running();
    let run_dir = handle.shared.run_dir.clone();
    let (req_tx, req_rx) = control::channel();
    let _socket = match control::serve(&run_dir, req_tx) {
        Ok(socket) => socket,
        Err(e) => {
            handle.abort();
            let _ = handle.join();
            return Err(e.context(
                "the run is stopped: without its control socket, ctl could not reach it",
            ));
        }
    };

    crossterm::terminal::enable_raw_mode().context("cannot put the terminal in raw mode")?;
    let _guard = TerminalGuard;
    crossterm::execute!(std::io::stdout(), crossterm::terminal::EnterAlternateScreen)?;
    let _stderr = StderrRedirect::to_file(&run_dir.join("train.log")).ok();
    let mut terminal: Terminal<CrosstermBackend<Stdout>> =
        Terminal::new(CrosstermBackend::new(std::io::stdout()))?;
    terminal.clear()?;

    // Input thread: keys become actions.
    let (act_tx, act_rx) = crossbeam_channel::unbounded::<Action>();
    let input_stop = Arc::new(AtomicBool::new(false));
    {
        let stop = input_stop.clone();
        let tx = act_tx.clone();
        std::thread::Builder::new()
            .name("input".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(true) = event::poll(Duration::from_millis(50)) {
                        if let Ok(Event::Key(k)) = event::read() {
                            if k.kind != KeyEventKind::Release {
                                if let Some(key) = map_key(k.code, k.modifiers) {
                                    if tx.send(Action::Key(key)).is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                    }
                }
            })?;
    }

    let gpu = GpuMonitor::open();
    let mut gpus = None;
    let gpu_error = gpu.as_ref().err().cloned();
    let mut last_gpu = Instant::now() - Duration::from_secs(3600);
    let mut last_profile = Instant::now();
    let mut state = AppState::new(handle.snapshot());
    let mut pending_requests: Vec<Request> = Vec::new();
    let first_step = handle.progress().0;

    while !state.quit {
        let frame_start = Instant::now();
        // Merge bursts: everything that arrived since the last frame.
        let mut actions: Vec<Action> = act_rx.try_iter().collect();
        pending_requests.extend(req_rx.try_iter());
        let trained = handle.progress().0 > first_step;
        actions.extend(
            signals
                .take(trained)
                .into_iter()
                .map(|request| match request {
                    SignalRequest::Command(command) => Action::Command(command),
                    SignalRequest::Abort => Action::Abort,
                }),
        );
        // Socket requests are answered directly; the reply is also shown.
        for req in pending_requests.drain(..) {
            let reply = handle.command(&req.command);
            if let Some(tx) = req.reply {
                let _ = tx.send(reply.clone());
            }
            actions.push(Action::Reply(reply));
        }
        if let Ok(g) = &gpu {
            if last_gpu.elapsed().as_secs_f64() >= gpu_interval_s {
                last_gpu = Instant::now();
                gpus = g.sample().ok();
            }
        }
        let interval = handle.profile_interval_s();
        if interval > 0.0 && last_profile.elapsed().as_secs_f64() >= interval {
            last_profile = Instant::now();
            let _ = handle.profile_report();
        }
        let mut snap = handle.snapshot();
        snap.gpus = gpus.clone();
        snap.gpu_error = gpu_error.clone();
        actions.push(Action::Telemetry(Box::new(snap)));
        for action in actions {
            for effect in update(&mut state, action) {
                match effect {
                    Effect::Send(cmd) => {
                        let reply = handle.command(&cmd);
                        update(&mut state, Action::Reply(reply));
                    }
                    Effect::Abort => handle.abort(),
                }
            }
        }
        tui_logger::move_events();
        terminal.draw(|f| render(f, &state))?;
        if let Some(rest) = FRAME.checked_sub(frame_start.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    input_stop.store(true, Ordering::Relaxed);
    if !handle.is_finished() {
        // Leaving before the end (second signal): stop every stage now.
        handle.abort();
    }
    drop(terminal);
    Ok(handle.join())
}
