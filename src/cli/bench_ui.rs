//! `bench-ui`: the control room's frame time and the UI thread's CPU use.

use std::time::{Duration, Instant};

use ratatui::backend::TestBackend;

#[derive(Debug, clap::Args)]
pub struct BenchUiArgs {
    /// Steps of chart history.
    #[arg(long, default_value_t = 20_000)]
    pub history: usize,
    /// Frames timed back to back.
    #[arg(long, default_value_t = 500)]
    pub frames: usize,
    /// Seconds of the 10 fps loop whose CPU time is measured.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
}

/// CPU time of the calling thread, in seconds (CLOCK_THREAD_CPUTIME_ID: precise, unlike
/// getrusage's tick-based accounting).
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

pub(super) fn run(args: &BenchUiArgs) -> anyhow::Result<()> {
    let &BenchUiArgs {
        history,
        frames,
        seconds,
    } = args;
    let mut state = crate::frontend::tui::sample::synthetic_state(history, 2);
    let mut terminal = ratatui::Terminal::new(TestBackend::new(120, 40))?;
    terminal.draw(|f| crate::frontend::tui::render::render(f, &state))?;
    let mut times = Vec::with_capacity(frames);
    for _ in 0..frames.max(1) {
        let t = Instant::now();
        terminal.draw(|f| crate::frontend::tui::render::render(f, &state))?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    // The UI loop at 10 fps: a frame every 100 ms, with new telemetry each time.
    let cpu0 = thread_cpu_s();
    let wall0 = Instant::now();
    let mut drawn = 0u64;
    let mut draw_s = 0.0;
    while wall0.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        state.snapshot.step += 1;
        terminal.draw(|f| crate::frontend::tui::render::render(f, &state))?;
        draw_s += t.elapsed().as_secs_f64();
        drawn += 1;
        if let Some(rest) = Duration::from_millis(100).checked_sub(t.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    let cpu = thread_cpu_s() - cpu0;
    let wall = wall0.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "size": "120x40",
            "history_steps": history,
            "frames": times.len(),
            "frame_ms_mean": mean,
            "frame_ms_p50": times[times.len() / 2],
            "frame_ms_p99": times[(times.len() - 1) * 99 / 100],
            "frame_ms_max": times[times.len() - 1],
            "loop_fps": drawn as f64 / wall,
            "loop_frame_ms_mean": draw_s * 1e3 / drawn.max(1) as f64,
            "loop_seconds": wall,
            "ui_thread_cpu_percent_of_a_core": 100.0 * cpu / wall,
        }))?
    );
    Ok(())
}
