//! The control socket of a run: a Unix socket `RUN_DIR/control.sock` (mode 0600) taking
//! newline-delimited JSON requests `{"command": "pause"}` (or the bare words) and answering
//! `{"ok": true, "message": "..."}` (queries, `status` and `snapshot`, add `"data": {...}`).
//! `dflash-tui ctl RUN_DIR COMMAND`, `dflash-tui attach RUN_DIR` and the trainer's own screen
//! are its clients.
//!
//! A client cannot take the run down ([`Limits`]): at most 16 connections are open at once
//! (600 idle ones exhausted the file descriptors and the next checkpoint failed). When a 17th
//! arrives, the connection that has waited longest for a complete line is answered with an error
//! and closed to make room; when all 16 wait for the trainer's answer, the newcomer gets one
//! error line and is closed. A connection without a complete line for 10 s is closed, a line
//! over 64 KiB gets an error and closes its connection, a line that is not UTF-8 gets an error,
//! errors quote at most 40 characters of the request, and failing accepts (EMFILE) back off.
//! A client waits [`CLIENT_TIMEOUT`] for an answer, then says that the trainer did not answer
//! ([`NoAnswer`]) instead of hanging with it.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use crossbeam_channel::{Receiver, Sender};
use serde::{Deserialize, Serialize};

use crate::pipeline::command::{quote, Command};

pub const SOCKET_NAME: &str = "control.sock";
/// The socket's name until its mode is set (as long as [`SOCKET_NAME`]: the same paths fit).
const FRESH_SOCKET_NAME: &str = ".control.new";

/// Bytes of a Unix socket address's path (`sun_path`), the terminating NUL included.
pub(crate) const SOCKET_PATH_MAX: usize = 108;

/// How long a command waits for the trainer's answer.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a client waits for the trainer's answer: a trainer that answers does so in
/// milliseconds (its loop answers between ticks); one that does not is stopped or hung, and a
/// client that waited for [`REPLY_TIMEOUT`] left a blank screen or a silent `ctl` for 40 s.
pub(crate) const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// A trainer that took a request and did not answer within [`CLIENT_TIMEOUT`].
#[derive(Debug, thiserror::Error)]
#[error(
    "the trainer at {} did not answer within {} s; it may be busy or hung: its train.log says \
     what it did last, `dflash-tui attach --read-only {}` shows its records, and a stopped one \
     (kill -STOP) goes on with kill -CONT",
    socket.display(),
    CLIENT_TIMEOUT.as_secs(),
    run_dir.display()
)]
pub struct NoAnswer {
    pub socket: PathBuf,
    pub run_dir: PathBuf,
}

impl NoAnswer {
    /// `e` as a [`NoAnswer`] when it is a timeout of the socket of `run_dir`.
    fn or_io(run_dir: &Path, e: std::io::Error) -> anyhow::Error {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow::Error::new(NoAnswer {
                socket: run_dir.join(SOCKET_NAME),
                run_dir: run_dir.to_path_buf(),
            }),
            _ => anyhow::Error::new(e),
        }
    }
}

/// How long a reply may take to write before its connection is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest pause between accept attempts after failures (EMFILE, ENFILE, ...).
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What one client may take of the run.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub connections: usize,
    /// Time to send a complete line; a connection that takes longer is closed.
    pub line_timeout: Duration,
    /// Bytes of a request line, its newline excluded.
    pub line_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connections: 16,
            line_timeout: Duration::from_secs(10),
            line_bytes: 64 * 1024,
        }
    }
}

/// A command from any control path, with where to send the reply.
pub struct Request {
    pub command: Command,
    pub reply: Option<Sender<Result<String, String>>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireRequest {
    pub command: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WireReply {
    pub ok: bool,
    pub message: String,
    /// The answer to a query (`status`, `snapshot`) as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

impl WireReply {
    fn error(message: String) -> Self {
        WireReply {
            ok: false,
            message,
            data: None,
        }
    }

    /// A front end's reply: a query's answer is JSON text, carried as JSON.
    fn from_reply(command: Option<&Command>, reply: Result<String, String>) -> Self {
        match reply {
            Ok(text) if command.is_some_and(Command::is_query) => {
                match serde_json::from_str(&text) {
                    Ok(data) => WireReply {
                        ok: true,
                        message: command.map(|c| c.to_string()).unwrap_or_default(),
                        data: Some(data),
                    },
                    Err(e) => WireReply::error(format!("the front end's answer is not JSON: {e}")),
                }
            }
            Ok(message) => WireReply {
                ok: true,
                message,
                data: None,
            },
            Err(message) => WireReply::error(message),
        }
    }
}

/// Checks that `RUN_DIR/control.sock` fits a Unix socket address, before anything is loaded
/// (a socket that cannot be created left `ctl` saying no trainer runs while it trained).
pub(crate) fn check_socket_path(run_dir: &Path) -> Result<()> {
    let path = run_dir.join(SOCKET_NAME);
    let len = path.as_os_str().len();
    if len < SOCKET_PATH_MAX {
        return Ok(());
    }
    bail!(
        "{}: the control socket's path is {len} bytes, over the {} bytes a Unix socket path may \
         have ({SOCKET_PATH_MAX} with its terminating NUL); use a shorter --run-dir (at most {} \
         bytes)",
        path.display(),
        SOCKET_PATH_MAX - 1,
        SOCKET_PATH_MAX - 2 - SOCKET_NAME.len()
    )
}

/// The listening socket; stops serving and is removed when dropped.
pub struct ControlSocket {
    path: PathBuf,
    closing: Arc<AtomicBool>,
    open: Arc<Connections>,
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees `closing`.
        let _ = UnixStream::connect(&self.path);
        self.open.shut_all();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds `RUN_DIR/control.sock` and serves it on a background thread, forwarding requests.
pub(crate) fn serve(run_dir: &Path, requests: Sender<Request>) -> Result<ControlSocket> {
    serve_with(run_dir, requests, Limits::default())
}

/// [`serve`] with other limits (tests).
pub fn serve_with(
    run_dir: &Path,
    requests: Sender<Request>,
    limits: Limits,
) -> Result<ControlSocket> {
    check_socket_path(run_dir)?;
    let path = run_dir.join(SOCKET_NAME);
    // Bound under a name of the same length, restricted to mode 0600, then renamed: the socket
    // never appears under its own name with the umask's wider mode.
    let fresh = run_dir.join(FRESH_SOCKET_NAME);
    let _ = std::fs::remove_file(&fresh);
    let listener = UnixListener::bind(&fresh)
        .with_context(|| format!("{}: cannot listen", fresh.display()))?;
    std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("{}: cannot restrict to mode 0600", fresh.display()))?;
    std::fs::rename(&fresh, &path)
        .with_context(|| format!("cannot move {} to {}", fresh.display(), path.display()))?;
    let closing = Arc::new(AtomicBool::new(false));
    let open = Arc::new(Connections::default());
    let server = Server {
        limits,
        requests,
        open: open.clone(),
        closing: closing.clone(),
    };
    std::thread::Builder::new()
        .name("control-socket".into())
        .spawn(move || server.accept_loop(listener))
        .context("cannot start the control socket thread")?;
    Ok(ControlSocket {
        path,
        closing,
        open,
    })
}

/// One accepted connection, shared by its thread and the list of open connections.
struct Connection {
    stream: UnixStream,
    /// When it began to wait for a line; None while its command is with the trainer.
    waiting_since: Mutex<Option<Instant>>,
    evicted: AtomicBool,
}

impl Connection {
    fn waiting(&self) -> MutexGuard<'_, Option<Instant>> {
        self.waiting_since.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The open connections.
#[derive(Default)]
struct Connections(Mutex<Vec<Arc<Connection>>>);

impl Connections {
    fn list(&self) -> MutexGuard<'_, Vec<Arc<Connection>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `conn`, first closing the connection that has waited longest for a line when
    /// `limit` are open; false when every open connection is busy with a command.
    fn admit(&self, conn: &Arc<Connection>, limit: usize) -> bool {
        let mut list = self.list();
        if list.len() >= limit {
            let oldest = list
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.waiting().map(|t| (t, i)))
                .min();
            let Some((_, i)) = oldest else { return false };
            let evicted = list.swap_remove(i);
            evicted.evicted.store(true, Ordering::SeqCst);
            // Its thread's read returns end-of-file; what it already read is still answered.
            let _ = evicted.stream.shutdown(std::net::Shutdown::Read);
        }
        list.push(conn.clone());
        true
    }

    fn remove(&self, conn: &Arc<Connection>) {
        self.list().retain(|c| !Arc::ptr_eq(c, conn));
    }

    fn shut_all(&self) {
        for c in self.list().drain(..) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

struct Server {
    limits: Limits,
    requests: Sender<Request>,
    open: Arc<Connections>,
    closing: Arc<AtomicBool>,
}

impl Server {
    fn accept_loop(self, listener: UnixListener) {
        let mut backoff = Backoff::default();
        for stream in listener.incoming() {
            if self.closing.load(Ordering::SeqCst) {
                return;
            }
            match stream {
                Ok(stream) => {
                    backoff.succeeded();
                    self.admit(stream);
                }
                Err(e) => backoff.failed(&e),
            }
        }
    }

    fn admit(&self, stream: UnixStream) {
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let conn = Arc::new(Connection {
            stream,
            waiting_since: Mutex::new(Some(Instant::now())),
            evicted: AtomicBool::new(false),
        });
        if !self.open.admit(&conn, self.limits.connections) {
            let busy = format!(
                "busy: {} connections are waiting for the trainer (the limit); try again",
                self.limits.connections
            );
            refuse(&conn.stream, busy);
            return;
        }
        let (open, requests, limits) = (self.open.clone(), self.requests.clone(), self.limits);
        let worker = conn.clone();
        let spawned = std::thread::Builder::new()
            .name("control-conn".into())
            .spawn(move || {
                serve_connection(&worker, &requests, &limits);
                open.remove(&worker);
            });
        if let Err(e) = spawned {
            self.open.remove(&conn);
            refuse(&conn.stream, format!("cannot serve this connection: {e}"));
        }
    }
}

/// Answers with one error line without waiting for the client, then closes.
fn refuse(stream: &UnixStream, message: String) {
    let _ = stream.set_nonblocking(true);
    let _ = write_reply(stream, &WireReply::error(message));
}

/// Pauses between failing accepts (EMFILE would otherwise spin a core) and logs once a streak.
#[derive(Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    fn failed(&mut self, e: &std::io::Error) {
        if self.failures == 0 {
            log::warn!(
                "control socket: cannot accept a connection ({e}); retrying with pauses of up to \
                 {} s",
                ACCEPT_BACKOFF_MAX.as_secs_f64()
            );
        }
        self.failures = self.failures.saturating_add(1);
        let pause = Duration::from_millis(10).saturating_mul(1 << self.failures.min(10));
        std::thread::sleep(pause.min(ACCEPT_BACKOFF_MAX));
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            log::info!(
                "control socket: accepting again after {} failed attempts",
                self.failures
            );
            self.failures = 0;
        }
    }
}

/// What reading one request line gave.
#[derive(Debug, PartialEq)]
enum LineRead {
    Line(Vec<u8>),
    TooLong,
    TimedOut,
    /// The client closed its side; what it sent after its last newline.
    End(Vec<u8>),
    Failed,
}

/// Reads newline-terminated lines of at most `max` bytes, each before a deadline.
struct LineReader<'a> {
    stream: &'a UnixStream,
    buf: Vec<u8>,
    chunk: Vec<u8>,
    max: usize,
}

impl<'a> LineReader<'a> {
    fn new(stream: &'a UnixStream, max: usize) -> Self {
        LineReader {
            stream,
            buf: Vec::new(),
            chunk: vec![0; 8192],
            max,
        }
    }

    fn next_line(&mut self, deadline: Instant) -> LineRead {
        let mut scanned = 0;
        loop {
            if let Some(i) = self.buf[scanned..].iter().position(|&b| b == b'\n') {
                let end = scanned + i;
                if end > self.max {
                    return LineRead::TooLong;
                }
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return LineRead::Line(line);
            }
            if self.buf.len() > self.max {
                return LineRead::TooLong;
            }
            scanned = self.buf.len();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return LineRead::TimedOut;
            }
            if self.stream.set_read_timeout(Some(left)).is_err() {
                return LineRead::Failed;
            }
            let mut stream = self.stream;
            match stream.read(&mut self.chunk) {
                Ok(0) => return LineRead::End(std::mem::take(&mut self.buf)),
                Ok(n) => self.buf.extend_from_slice(&self.chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                Err(_) => return LineRead::Failed,
            }
        }
    }
}

/// Serves one connection: a reply per non-blank line, until the client closes, a limit is
/// passed or it is evicted.
fn serve_connection(conn: &Connection, requests: &Sender<Request>, limits: &Limits) {
    let mut reader = LineReader::new(&conn.stream, limits.line_bytes);
    loop {
        *conn.waiting() = Some(Instant::now());
        let read = reader.next_line(Instant::now() + limits.line_timeout);
        *conn.waiting() = None;
        let (reply, more) = match read {
            LineRead::Line(bytes) => (answer(&bytes, requests), true),
            LineRead::TooLong => (
                Some(WireReply::error(format!(
                    "request line over {} bytes; connection closed",
                    limits.line_bytes
                ))),
                false,
            ),
            LineRead::TimedOut => (
                Some(WireReply::error(format!(
                    "no complete line within {} s; connection closed",
                    limits.line_timeout.as_secs_f64()
                ))),
                false,
            ),
            LineRead::End(_) if conn.evicted.load(Ordering::SeqCst) => (
                Some(WireReply::error(format!(
                    "no complete line while {} connections were open (the limit): closed to \
                     make room",
                    limits.connections
                ))),
                false,
            ),
            LineRead::End(rest) => (answer(&rest, requests), false),
            LineRead::Failed => (None, false),
        };
        let written = reply.is_none_or(|r| write_reply(&conn.stream, &r).is_ok());
        if !(more && written) {
            return;
        }
    }
}

/// The reply to one request line; None for a blank line.
fn answer(bytes: &[u8], requests: &Sender<Request>) -> Option<WireReply> {
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            return Some(WireReply::error(format!(
                "request is not UTF-8 text (invalid byte at offset {}): {}",
                e.valid_up_to(),
                quote(&String::from_utf8_lossy(bytes))
            )))
        }
    };
    if text.trim().is_empty() {
        return None;
    }
    let words = serde_json::from_str::<WireRequest>(text).map_or(text.to_string(), |r| r.command);
    let command = Command::parse(&words);
    let reply = command
        .clone()
        .and_then(|command| forward(command, requests));
    Some(WireReply::from_reply(command.as_ref().ok(), reply))
}

/// Hands a command to the front end and waits for the trainer's answer.
fn forward(command: Command, requests: &Sender<Request>) -> Result<String, String> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let request = Request {
        command,
        reply: Some(tx),
    };
    if requests.send(request).is_err() {
        return Err("the run is ending".to_string());
    }
    rx.recv_timeout(REPLY_TIMEOUT)
        .unwrap_or_else(|_| Err("no reply from the trainer".to_string()))
}

fn write_reply(mut stream: &UnixStream, reply: &WireReply) -> std::io::Result<()> {
    let json = serde_json::to_string(reply).map_err(std::io::Error::other)?;
    stream.write_all(format!("{json}\n").as_bytes())
}

/// The client: sends one command, returns the reply (a [`NoAnswer`] error after
/// [`CLIENT_TIMEOUT`]).
pub fn send(run_dir: &Path, command: &str) -> Result<WireReply> {
    let mut client = ControlClient::connect(run_dir)?;
    client.request(command)
}

/// A connection kept open for many requests (a screen polls the run several times a second).
pub(crate) struct ControlClient {
    run_dir: PathBuf,
    reader: BufReader<UnixStream>,
}

impl ControlClient {
    /// Connects to the run's socket; fails when no trainer serves it.
    pub(crate) fn connect(run_dir: &Path) -> Result<Self> {
        check_socket_path(run_dir)?;
        let path = run_dir.join(SOCKET_NAME);
        let stream = UnixStream::connect(&path).with_context(|| {
            format!(
                "{}: no running trainer to talk to (cannot connect)",
                path.display()
            )
        })?;
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(ControlClient {
            run_dir: run_dir.to_path_buf(),
            reader: BufReader::new(stream),
        })
    }

    /// Sends one command line and reads its reply.
    pub(crate) fn request(&mut self, command: &str) -> Result<WireReply> {
        let path = self.run_dir.join(SOCKET_NAME);
        let request = serde_json::to_string(&WireRequest {
            command: command.to_string(),
        })?;
        let sent = writeln!(self.reader.get_ref(), "{request}");
        let mut line = String::new();
        let read = self.reader.read_line(&mut line);
        if line.is_empty() {
            // A refused connection is answered and closed before the request is read: the
            // reply, when there is one, matters more than the failed write.
            if let Err(e) = sent {
                let e = NoAnswer::or_io(&self.run_dir, e);
                return Err(e.context(format!("{}: cannot send the command", path.display())));
            }
            read.map_err(|e| NoAnswer::or_io(&self.run_dir, e))?;
            bail!("{}: no reply (the connection was closed)", path.display());
        }
        serde_json::from_str(&line)
            .with_context(|| format!("{}: unreadable reply {line:?}", path.display()))
    }
}

/// A receiver and its sender, for the front ends.
pub fn channel() -> (Sender<Request>, Receiver<Request>) {
    crossbeam_channel::unbounded()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader_on(bytes: &[u8]) -> (UnixStream, UnixStream) {
        let (mut client, server) = UnixStream::pair().unwrap();
        client.write_all(bytes).unwrap();
        (client, server)
    }

    #[test]
    fn lines_are_bounded_in_length_and_time() {
        let soon = || Instant::now() + Duration::from_millis(50);
        let (client, server) = reader_on(b"pause\r\nresume\nhalf");
        let mut r = LineReader::new(&server, 8);
        assert_eq!(r.next_line(soon()), LineRead::Line(b"pause".to_vec()));
        assert_eq!(r.next_line(soon()), LineRead::Line(b"resume".to_vec()));
        assert_eq!(r.next_line(soon()), LineRead::TimedOut);
        client.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(r.next_line(soon()), LineRead::End(b"half".to_vec()));

        let (_client, server) = reader_on(b"12345678\n123456789\n");
        let mut r = LineReader::new(&server, 8);
        assert_eq!(r.next_line(soon()), LineRead::Line(b"12345678".to_vec()));
        assert_eq!(r.next_line(soon()), LineRead::TooLong);
        let (_client, server) = reader_on(&[b'y'; 100]);
        let mut r = LineReader::new(&server, 8);
        assert_eq!(r.next_line(soon()), LineRead::TooLong, "no newline needed");
    }

    #[test]
    fn socket_paths_over_the_address_limit_are_refused_with_the_fix() {
        let fits = PathBuf::from("/").join("d".repeat(94 - 1));
        assert!(check_socket_path(&fits).is_ok());
        let over = PathBuf::from("/").join("d".repeat(94));
        let e = check_socket_path(&over).unwrap_err().to_string();
        assert!(e.contains("is 108 bytes, over the 107 bytes"), "{e}");
        assert!(e.contains("shorter --run-dir (at most 94 bytes)"), "{e}");
    }

    #[test]
    fn invalid_utf8_and_blank_lines() {
        let (tx, _rx) = channel();
        let reply = answer(b"pa\xffuse", &tx).unwrap();
        assert!(!reply.ok);
        assert!(reply
            .message
            .contains("not UTF-8 text (invalid byte at offset 2)"));
        assert!(answer(b"  ", &tx).is_none());
        let reply = answer(&[b'z'; 60_000], &tx).unwrap();
        assert!(reply.message.len() < 200, "{}", reply.message);
    }
}
