//! A tmux session (120x40) running a command, for the control room's end-to-end tests: its
//! screen, keys and the step in its header. Killed with the test, and with it the trainer that
//! holds the run given to [`Tmux::holding`] (a trainer outlives its terminal by design, so a
//! test that fails half-way must stop it itself).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub struct Tmux {
    pub session: String,
    run_dir: Option<PathBuf>,
}

impl Tmux {
    /// A detached session named after `name` and this process, running `cmd`.
    pub fn start(name: &str, cmd: &str) -> Tmux {
        let t = Tmux {
            session: format!("dflash-{name}-{}", std::process::id()),
            run_dir: None,
        };
        let ok = Command::new("tmux")
            .args(["new-session", "-d", "-s", &t.session])
            .args(["-x", "120", "-y", "40", cmd])
            .status()
            .expect("tmux is installed (make setup installs it)");
        assert!(ok.success());
        t
    }

    /// The session, stopping the trainer that holds `run_dir` when it is dropped.
    pub fn holding(mut self, run_dir: PathBuf) -> Tmux {
        self.run_dir = Some(run_dir);
        self
    }

    fn tmux(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .args(args)
            .output()
            .expect("tmux runs (make setup installs it)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn screen(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-t", &self.session])
    }

    pub fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", &self.session];
        args.extend(keys);
        self.tmux(&args);
    }

    /// The step number in the header ("step N / M").
    pub fn step(&self) -> Option<u64> {
        let screen = self.screen();
        let at = screen.find("step ")?;
        screen[at + 5..].split_whitespace().next()?.parse().ok()
    }

    /// Polls the screen every 100 ms until `f` finds what it looks for; a timeout shows the
    /// screen it last saw.
    pub fn wait_for<T>(
        &self,
        what: &str,
        limit: Duration,
        mut f: impl FnMut(&str) -> Option<T>,
    ) -> T {
        let started = std::time::Instant::now();
        loop {
            let screen = self.screen();
            if let Some(v) = f(&screen) {
                return v;
            }
            assert!(
                started.elapsed() < limit,
                "timed out after {limit:?} waiting for {what}; the screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Closes the window as a dropped SSH connection does: its processes get SIGHUP.
    pub fn kill(&self) {
        self.tmux(&["kill-session", "-t", &self.session]);
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.session])
            .output();
        let holder = self
            .run_dir
            .as_deref()
            .and_then(dflash_tui::train::run_lock::RunLock::holder);
        if let Some(pid) = holder {
            // SAFETY: the trainer this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}
