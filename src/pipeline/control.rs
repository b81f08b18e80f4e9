//! The control socket of a run: a Unix socket `RUN_DIR/control.sock` (mode 0600) taking
//! newline-delimited JSON requests `{"command": "pause"}` and answering
//! `{"ok": true, "message": "..."}`. `dflash-tui ctl RUN_DIR COMMAND` is its client.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use crossbeam_channel::{Receiver, Sender};
use serde::{Deserialize, Serialize};

use super::command::Command;

pub const SOCKET_NAME: &str = "control.sock";

/// A command from any control path, with where to send the reply.
pub struct Request {
    pub command: Command,
    pub reply: Option<Sender<Result<String, String>>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WireRequest {
    pub command: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WireReply {
    pub ok: bool,
    pub message: String,
}

/// The listening socket; removed when dropped.
pub struct ControlSocket {
    path: PathBuf,
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds `RUN_DIR/control.sock` and serves it on a background thread, forwarding requests.
pub fn serve(run_dir: &Path, requests: Sender<Request>) -> Result<ControlSocket> {
    let path = run_dir.join(SOCKET_NAME);
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("{}: cannot listen", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("{}: cannot restrict to mode 0600", path.display()))?;
    std::thread::Builder::new()
        .name("control-socket".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let requests = requests.clone();
                let _ = std::thread::Builder::new()
                    .name("control-conn".into())
                    .spawn(move || handle_connection(stream, requests));
            }
        })
        .context("cannot start the control socket thread")?;
    Ok(ControlSocket { path })
}

fn handle_connection(stream: UnixStream, requests: Sender<Request>) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let reader = BufReader::new(stream);
    for line in reader.lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let text = serde_json::from_str::<WireRequest>(&line)
            .map(|r| r.command)
            .unwrap_or(line);
        let reply = match Command::parse(&text) {
            Err(e) => Err(e),
            Ok(command) => {
                let (tx, rx) = crossbeam_channel::bounded(1);
                if requests
                    .send(Request {
                        command,
                        reply: Some(tx),
                    })
                    .is_err()
                {
                    Err("the run is ending".to_string())
                } else {
                    rx.recv_timeout(Duration::from_secs(30))
                        .unwrap_or_else(|_| Err("no reply from the trainer".to_string()))
                }
            }
        };
        let wire = match reply {
            Ok(message) => WireReply { ok: true, message },
            Err(message) => WireReply { ok: false, message },
        };
        let Ok(json) = serde_json::to_string(&wire) else {
            return;
        };
        if writeln!(writer, "{json}").is_err() {
            return;
        }
    }
}

/// The client: sends one command, returns the reply.
pub fn send(run_dir: &Path, command: &str) -> Result<WireReply> {
    let path = run_dir.join(SOCKET_NAME);
    let mut stream = UnixStream::connect(&path).with_context(|| {
        format!(
            "{}: no running trainer to talk to (cannot connect)",
            path.display()
        )
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(40)))?;
    let request = serde_json::to_string(&WireRequest {
        command: command.to_string(),
    })?;
    writeln!(stream, "{request}")?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .with_context(|| format!("{}: no reply", path.display()))?;
    serde_json::from_str(&line)
        .with_context(|| format!("{}: unreadable reply {line:?}", path.display()))
}

/// A receiver and its sender, for the front ends.
pub fn channel() -> (Sender<Request>, Receiver<Request>) {
    crossbeam_channel::unbounded()
}
