//! The control socket against a stand-in front end (no model: exact and fast): idle connections,
//! the connection limit, long lines and bytes that are not text.

use super::*;

/// A control socket whose front end answers "did COMMAND"; while `holding`, requests wait
/// until `release` is sent. Each request received is announced on `seen`.
struct FakeRun {
    dir: tempfile::TempDir,
    _socket: ControlSocket,
    seen: Receiver<()>,
    release: Sender<()>,
}

fn fake_run(limits: Limits, holding: bool) -> FakeRun {
    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = control::channel();
    let socket = control::serve_with(dir.path(), tx, limits).unwrap();
    let (seen_tx, seen) = crossbeam_channel::unbounded();
    let (release, release_rx) = crossbeam_channel::unbounded::<()>();
    std::thread::spawn(move || front_end(rx, seen_tx, release_rx, holding));
    FakeRun {
        dir,
        _socket: socket,
        seen,
        release,
    }
}

fn front_end(rx: Receiver<Request>, seen: Sender<()>, release: Receiver<()>, mut holding: bool) {
    let answer = |r: Request| {
        let _ = r.reply.unwrap().send(Ok(format!("did {}", r.command)));
    };
    let mut held = Vec::new();
    loop {
        crossbeam_channel::select! {
            recv(rx) -> req => {
                let Ok(req) = req else { return };
                let _ = seen.send(());
                if holding { held.push(req) } else { answer(req) }
            }
            recv(release) -> _ => {
                holding = false;
                held.drain(..).for_each(answer);
            }
        }
    }
}

impl FakeRun {
    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn raw(&self) -> UnixStream {
        UnixStream::connect(self.path().join(control::SOCKET_NAME)).unwrap()
    }
}

#[test]
fn idle_connections_make_room_for_commands_and_time_out() {
    let limits = Limits {
        line_timeout: Duration::from_secs(1),
        ..Limits::default()
    };
    let run = fake_run(limits, false);
    let silent = run.raw();
    let t = Instant::now();
    let reply = reply_within(&silent, Duration::from_secs(5)).expect("an error line");
    let silent_after = t.elapsed().as_secs_f64();
    assert_eq!(
        reply.message,
        "no complete line within 1 s; connection closed"
    );
    assert!(closed_within(&silent, Duration::from_secs(1)));
    assert!((1.0..3.0).contains(&silent_after), "{silent_after}");

    let t_idle = Instant::now();
    let idle: Vec<UnixStream> = (0..100)
        .map(|_| {
            let mut s = run.raw();
            s.write_all(b"{\"command\": \"pau").unwrap();
            s
        })
        .collect();
    let watcher = watch_idle(idle, t_idle);
    let mut latencies = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let reply = control::send(run.path(), "pause").unwrap();
        latencies.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(reply.ok && reply.message == "did pause", "{reply:?}");
    }
    let end = watcher.join().unwrap();
    eprintln!(
        "fake run, limit 16, line timeout 1 s: a silent connection got its error line and was \
         closed after {silent_after:.2} s; 100 idle connections (half a command) + 50 commands: \
         50/50 answered ({}); the idle ones were closed with an error line, {} to make room \
         and {} at the timeout, the last {:.1} s after they were opened",
        latency_summary(latencies),
        end.evicted,
        end.timed_out,
        end.last_s
    );
    assert_eq!(end.evicted + end.timed_out, 100);
}

#[test]
fn a_seventeenth_connection_is_refused_while_sixteen_wait_for_the_trainer() {
    let run = fake_run(Limits::default(), true);
    let path = run.path().to_path_buf();
    let waiting: Vec<_> = (0..16)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || control::send(&path, "checkpoint").unwrap())
        })
        .collect();
    for _ in 0..16 {
        run.seen
            .recv_timeout(Duration::from_secs(10))
            .expect("16 commands reach the front end");
    }
    let t = Instant::now();
    let refused = control::send(&path, "pause").unwrap();
    let refused_ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(!refused.ok, "{refused:?}");
    assert!(
        refused.message.contains("busy: 16 connections"),
        "{refused:?}"
    );
    run.release.send(()).unwrap();
    for w in waiting {
        let reply = w.join().unwrap();
        assert!(reply.ok && reply.message == "did checkpoint", "{reply:?}");
    }
    assert!(control::send(&path, "resume").unwrap().ok);
    eprintln!(
        "fake run: 16 connections waiting for the trainer, a 17th answered \"busy\" in \
         {refused_ms:.1} ms; after the trainer answered, 16/16 got their reply and a new \
         command was served"
    );
}

#[test]
fn long_lines_and_bytes_that_are_not_text_get_short_errors() {
    let run = fake_run(Limits::default(), false);

    let mut s = run.raw();
    s.write_all(&vec![b'a'; 70 * 1024]).unwrap();
    let reply = reply_within(&s, Duration::from_secs(5)).unwrap();
    assert!(!reply.ok);
    assert_eq!(
        reply.message,
        "request line over 65536 bytes; connection closed"
    );
    assert!(closed_within(&s, Duration::from_secs(5)));

    // 10 MB in one line: refused after 64 KiB, the reply stays short.
    let s = run.raw();
    let mut writer = s.try_clone().unwrap();
    let flood = std::thread::spawn(move || {
        let chunk = vec![b'b'; 64 * 1024];
        let sent = (0..160)
            .take_while(|_| writer.write_all(&chunk).is_ok())
            .count();
        let _ = writer.write_all(b"\n");
        sent * 64
    });
    let reply = reply_within(&s, Duration::from_secs(5)).unwrap();
    assert!(!reply.ok && reply.message.contains("over 65536 bytes"));
    assert!(closed_within(&s, Duration::from_secs(5)));
    let kib_sent = flood.join().unwrap();
    let flood_reply_len = reply.message.len();

    // Not UTF-8: an error, and the connection goes on.
    let mut s = run.raw();
    s.write_all(b"pa\xff\xfeuse\npause\n").unwrap();
    let reply = reply_within(&s, Duration::from_secs(5)).unwrap();
    assert!(!reply.ok);
    assert!(
        reply
            .message
            .starts_with("request is not UTF-8 text (invalid byte at offset 2): \"pa"),
        "{reply:?}"
    );
    let reply = reply_within(&s, Duration::from_secs(5)).unwrap();
    assert!(reply.ok && reply.message == "did pause", "{reply:?}");

    // A long unknown command inside the limit is quoted by its first 40 characters.
    let word = "z".repeat(60_000);
    let reply = control::send(run.path(), &word).unwrap();
    assert!(!reply.ok);
    assert!(
        reply
            .message
            .starts_with(&format!("unknown command \"{}\"…;", "z".repeat(40))),
        "{}",
        &reply.message[..100]
    );
    let long_reply_len = reply.message.len();

    for (command, expected) in [
        (
            "queue batch_q 1000000",
            "queue batch_q: depth 1000000 is above the limit of 1024 (as pipeline.*_queue_depth)",
        ),
        (
            "profile 0.001",
            "profile: 0.001 s is below the 1 s minimum (0 = off)",
        ),
    ] {
        let reply = control::send(run.path(), command).unwrap();
        assert!(!reply.ok && reply.message == expected, "{reply:?}");
    }
    assert!(
        run.seen.try_recv().is_ok() && run.seen.try_recv().is_err(),
        "only the valid pause reached the front end"
    );
    eprintln!(
        "fake run: a 70 KiB line and a 10 MB line (whose writer got through {kib_sent} KiB \
         before the close) got one error line each ({flood_reply_len} bytes) and were closed; invalid UTF-8 got an \
         error and the connection served the next line; a 60,000-character unknown command got a \
         {long_reply_len}-byte error; queue batch_q 1000000 and profile 0.001 were refused"
    );
}
