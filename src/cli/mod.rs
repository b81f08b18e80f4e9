//! The command line: argument parsing and one function per subcommand.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::gguf::OutputDtype;
use crate::runtime::TorchRuntime;

mod data;
mod doctor;
mod eval;
mod generate;
mod import;
mod models;
mod regenerate;
mod train;

#[derive(Debug, Parser)]
#[command(
    name = "dflash-tui",
    version,
    about = "Train DFlash speculative-decoding drafters and steer the training live"
)]
pub struct Cli {
    /// Log level for messages on stderr (error, warn, info, debug, trace).
    #[arg(long, global = true, default_value = "info", env = "DFLASH_LOG")]
    pub log_level: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Report libtorch, CUDA devices, NVML and where models, data and runs are looked for.
    Doctor,
    /// Convert a GGUF (llama.cpp) Llama-family model into a Hugging Face model folder.
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// The model folder to create (must not exist yet, or be empty).
        out_dir: PathBuf,
        /// Element type of the written weights.
        #[arg(long, value_enum, default_value = "f32")]
        dtype: OutputDtype,
    },
    /// Recover every complete conversation from a (possibly cut-off) ShareGPT JSON file and
    /// write them as JSON lines.
    ImportSharegpt {
        /// The ShareGPT .json file (a JSON array of {"id", "conversations"} records).
        file: PathBuf,
        /// The .jsonl file to write.
        out: PathBuf,
    },
    /// Answer a prompt with a model: renders the chat template, then decodes greedily.
    Generate {
        /// Hugging Face model folder (default: the demo model).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The user message.
        #[arg(long)]
        prompt: String,
        /// A system message (otherwise the template's default, if any).
        #[arg(long)]
        system: Option<String>,
        #[arg(long, default_value_t = 128)]
        max_new_tokens: usize,
        /// auto, cpu, cuda or cuda:N.
        #[arg(long, default_value = "auto")]
        device: String,
        /// Compute dtype: auto (bf16 on GPU, f32 on CPU), f32, bf16, f16.
        #[arg(long, default_value = "auto")]
        dtype: String,
        /// Use the prompt text as is, without the chat template.
        #[arg(long)]
        raw: bool,
    },
    /// Write a freshly initialised, servable DFlash drafter for a target model.
    InitDrafter {
        /// The target's Hugging Face model folder.
        #[arg(long)]
        target: PathBuf,
        /// The drafter folder to create.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 5)]
        layers: i64,
        #[arg(long, default_value_t = 16)]
        block_size: i64,
        /// Token id fed in the masked block slots; its embedding row stays frozen. Pick a
        /// token that never occurs in the data (SmolLM2: 16, `<empty_output>`; Qwen3: 151669).
        #[arg(long)]
        mask_token_id: i64,
        /// Tapped target layers, comma separated (default: the DFlash formula).
        #[arg(long, value_delimiter = ',')]
        target_layer_ids: Option<Vec<usize>>,
        /// Number of tapped layers when --target-layer-ids is not given.
        #[arg(long, default_value_t = 5)]
        num_taps: usize,
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// A prepared dataset (prepare-data output; its train split) to check the mask token
        /// against: refused when the loss trains on it there (loss_mask 1).
        #[arg(long)]
        data: Option<PathBuf>,
    },
    /// Tokenise chat data (ShareGPT JSON/JSONL, {"messages"} JSONL, {"text"} JSONL) with a
    /// model's chat template into a Hugging Face dataset (save_to_disk layout, train and
    /// validation splits) with input_ids and loss_mask.
    PrepareData {
        /// Model folder whose tokenizer.json and chat template are used.
        #[arg(long)]
        tokenizer: PathBuf,
        /// Input files (several allowed).
        #[arg(long, num_args = 1.., required = true)]
        input: Vec<PathBuf>,
        /// The dataset folder to create.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 3072)]
        max_len: usize,
        /// Rows per Arrow shard.
        #[arg(long, default_value_t = 50_000)]
        shard_rows: usize,
        /// Share of conversations held out for validation.
        #[arg(long, default_value_t = 0.01)]
        val_fraction: f64,
        /// Seed of the validation split.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep only the first N usable conversations (in input order); reading and
        /// tokenising stop once N are kept.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Replace every assistant answer of a tokenised dataset (prepare-data output) by the
    /// target's own answer, generated from the conversation so far; resumable.
    Regenerate(regenerate::RegenerateArgs),
    /// Counts, length histogram, loss-mask share and one decoded sample of a dataset.
    InspectData {
        path: PathBuf,
        /// Split of a dataset with splits (default: train).
        #[arg(long)]
        split: Option<String>,
        /// Model folder to decode the sample with.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Which sample to show.
        #[arg(long, default_value_t = 0)]
        sample: usize,
    },
    /// Benchmark of the data loader: random access per sample, batches per second, and the
    /// same access through pyarrow.
    BenchData {
        path: PathBuf,
        #[arg(long, default_value_t = 1_000_000)]
        samples: usize,
        #[arg(long, default_value_t = 2_000)]
        batches: usize,
        /// Python with pyarrow, for the comparison.
        #[arg(long, default_value = "python3")]
        python: String,
    },
    /// Train a DFlash drafter (staged pipeline in background threads).
    Train {
        /// The TOML configuration (see configs/).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override a config field, e.g. --set train.lr=1e-4 (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// The run directory (default: RUNS_DIR/NAME-DATE-TIME).
        #[arg(long)]
        run_dir: Option<PathBuf>,
        /// Continue the run in this directory from its newest checkpoint. Fields that change
        /// the model or the data stream cannot change on a resume.
        #[arg(long)]
        resume: Option<PathBuf>,
        /// On --resume: allow changes of the schedule (train.total_steps, epochs, lr,
        /// warmup_ratio, min_lr_ratio, clip_grad_norm); they are logged.
        #[arg(long, requires = "resume")]
        allow_schedule_change: bool,
        /// Headless: human lines and metrics.jsonl, commands from stdin.
        #[arg(long)]
        no_tui: bool,
    },
    /// Send a command to a running trainer through RUN_DIR/control.sock and print the reply.
    Ctl {
        run_dir: PathBuf,
        /// pause, resume, queue NAME DEPTH, checkpoint, profile SECONDS, stop
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Benchmark of the training pipeline (benchmarks spec): the real pipeline for a warm-up
    /// and a measured window, every stage alone on the same batches, one JSON object.
    Bench(crate::bench::BenchOptions),
    /// Benchmark of the control room: time to render one 120x40 frame with a full chart
    /// history, and the UI thread's CPU use at 10 frames per second.
    BenchUi {
        /// Steps of chart history.
        #[arg(long, default_value_t = 20_000)]
        history: usize,
        /// Frames timed back to back.
        #[arg(long, default_value_t = 500)]
        frames: usize,
        /// Seconds of the 10 fps loop whose CPU time is measured.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
    /// Acceptance length (tau) of a drafter by real greedy speculative decoding, speed-up over
    /// plain greedy decoding, and the check that both produce the same tokens.
    Eval(eval::EvalArgs),
    /// Perplexity of a model over a tokenised dataset (Arrow IPC, save_to_disk folder or
    /// Parquet with an input_ids column); prints one JSON object.
    Perplexity {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        data: PathBuf,
        /// The token column.
        #[arg(long, default_value = "input_ids")]
        column: String,
        /// Use at most this many sequences.
        #[arg(long)]
        limit: Option<usize>,
        /// Cut sequences to this many tokens.
        #[arg(long, default_value_t = 1024)]
        max_len: usize,
        /// Padded tokens per forward batch.
        #[arg(long, default_value_t = 8192)]
        batch_tokens: usize,
        #[arg(long, default_value = "auto")]
        device: String,
        #[arg(long, default_value = "auto")]
        dtype: String,
    },
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    // Batches change shape at every step: growable segments keep the CUDA caching allocator
    // from fragmenting into many fixed blocks (PyTorch's own advice for this case). Set here,
    // while the process has one thread and before libtorch reads it; a user's setting wins.
    const ALLOC_CONF: &str = "PYTORCH_CUDA_ALLOC_CONF";
    if std::env::var_os(ALLOC_CONF).is_none() && std::env::var_os("PYTORCH_ALLOC_CONF").is_none() {
        std::env::set_var(ALLOC_CONF, "expandable_segments:True");
    }
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Train { .. }) {
        init_logging(&cli.log_level, None);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line naming what went wrong, with its causes.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Log lines go to stderr, and to `log_file` as well when given (a run's train.log).
fn init_logging(level: &str, log_file: Option<&std::path::Path>) {
    let mut builder = env_logger::Builder::new();
    builder.parse_filters(level).format_timestamp_secs();
    match log_file.and_then(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .ok()
    }) {
        Some(file) => {
            builder.target(env_logger::Target::Pipe(Box::new(Tee { file })));
        }
        None => {
            builder.target(env_logger::Target::Stderr);
        }
    }
    let _ = builder.try_init();
}

/// The control room's logger: tui-logger (shown in the screen's log pane) and the run log.
fn init_tui_logging(level: &str, log_file: Option<&std::path::Path>) {
    let filter = level
        .parse::<log::LevelFilter>()
        .unwrap_or(log::LevelFilter::Info);
    if tui_logger::init_logger(log::LevelFilter::Trace).is_ok() {
        tui_logger::set_default_level(filter);
        if let Some(path) = log_file.and_then(|p| p.to_str()) {
            tui_logger::set_log_file(tui_logger::TuiLoggerFile::new(path));
        }
    }
}

/// Writes to a file and to stderr.
struct Tee {
    file: std::fs::File,
}

impl std::io::Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        self.file.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        self.file.flush()
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let level = cli.log_level.clone();
    match cli.command {
        Command::Train {
            config,
            set,
            run_dir,
            resume,
            allow_schedule_change,
            no_tui,
        } => train::run(
            train::TrainArgs {
                config,
                set,
                run_dir,
                resume,
                allow_schedule_change,
                no_tui,
            },
            |log_file, tui| {
                if tui {
                    init_tui_logging(&level, log_file)
                } else {
                    init_logging(&level, log_file)
                }
            },
        ),
        Command::Doctor => {
            let runtime = TorchRuntime::init();
            doctor::run(&runtime)
        }
        Command::ImportGguf {
            file,
            out_dir,
            dtype,
        } => import::import_gguf(&file, &out_dir, dtype),
        Command::ImportSharegpt { file, out } => import::import_sharegpt(&file, &out),
        Command::InitDrafter {
            target,
            out,
            layers,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_taps,
            seed,
            data,
        } => models::init_drafter(models::InitDrafterArgs {
            target,
            out,
            layers,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_taps,
            seed,
            data,
        }),
        Command::Perplexity {
            model,
            data,
            column,
            limit,
            max_len,
            batch_tokens,
            device,
            dtype,
        } => {
            let runtime = TorchRuntime::init();
            models::run_perplexity(
                &runtime,
                models::PerplexityArgs {
                    model,
                    data,
                    column,
                    limit,
                    max_len,
                    batch_tokens,
                    device,
                    dtype,
                },
            )
        }
        Command::Eval(args) => eval::run(&TorchRuntime::init(), args),
        Command::BenchUi {
            history,
            frames,
            seconds,
        } => bench_ui(history, frames, seconds),
        Command::Bench(opts) => {
            let report = crate::bench::run(&TorchRuntime::init(), &opts)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Ctl { run_dir, command } => {
            let reply = crate::pipeline::control::send(&run_dir, &command.join(" "))?;
            if reply.ok {
                println!("{}", reply.message);
                Ok(())
            } else {
                anyhow::bail!("{}", reply.message)
            }
        }
        Command::PrepareData {
            tokenizer,
            input,
            out,
            max_len,
            shard_rows,
            val_fraction,
            seed,
            limit,
        } => data::prepare(
            &tokenizer,
            &input,
            &out,
            &crate::data::prepare_run::PrepareOptions {
                max_len,
                shard_rows,
                val_fraction,
                seed,
                limit,
                progress: true,
            },
        ),
        Command::Regenerate(args) => regenerate::run(&TorchRuntime::init(), args),
        Command::InspectData {
            path,
            split,
            tokenizer,
            sample,
        } => data::inspect(&path, split.as_deref(), tokenizer.as_deref(), sample),
        Command::BenchData {
            path,
            samples,
            batches,
            python,
        } => data::bench(&path, samples, batches, &python),
        Command::Generate {
            model,
            prompt,
            system,
            max_new_tokens,
            device,
            dtype,
            raw,
        } => {
            let runtime = TorchRuntime::init();
            generate::run(
                &runtime,
                generate::GenerateArgs {
                    model,
                    prompt,
                    system,
                    max_new_tokens,
                    device,
                    dtype,
                    raw,
                },
            )
        }
    }
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

fn bench_ui(history: usize, frames: usize, seconds: f64) -> anyhow::Result<()> {
    use ratatui::backend::TestBackend;
    use std::time::{Duration, Instant};
    let mut state = crate::ui::sample::synthetic_state(history, 2);
    let mut terminal = ratatui::Terminal::new(TestBackend::new(120, 40))?;
    terminal.draw(|f| crate::ui::render::render(f, &state))?;
    let mut times = Vec::with_capacity(frames);
    for _ in 0..frames.max(1) {
        let t = Instant::now();
        terminal.draw(|f| crate::ui::render::render(f, &state))?;
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
        terminal.draw(|f| crate::ui::render::render(f, &state))?;
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
