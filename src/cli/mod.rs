//! The command line: argument parsing and one function per subcommand.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Dtype;
use crate::gguf::OutputDtype;
use crate::runtime::{DeviceSpec, TorchRuntime};

mod acceptance;
mod data;
mod doctor;
mod eval;
mod generate;
mod import;
mod logging;
mod models;
pub(crate) mod progress;
mod regenerate;
mod tensorboard;
mod train;
mod train_ranks;

#[derive(Debug, Parser)]
#[command(
    name = "dflash-tui",
    version,
    about = "Train DFlash speculative-decoding drafters and steer the training live"
)]
pub(crate) struct Cli {
    /// Log level for messages on stderr (error, warn, info, debug, trace).
    #[arg(long, global = true, default_value = "info", env = "DFLASH_LOG")]
    pub log_level: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Report libtorch, CUDA devices, NVML and where models, data and runs are looked for.
    Doctor {
        /// Also name this model folder's family and layers, or why it cannot be a target.
        #[arg(long)]
        model: Option<PathBuf>,
    },
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
        /// Most tokens generated after the prompt (fewer when the model ends its answer).
        #[arg(long, default_value_t = 128)]
        max_new_tokens: usize,
        /// auto, cpu, cuda or cuda:N.
        #[arg(long, default_value_t = DeviceSpec::Auto)]
        device: DeviceSpec,
        /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU).
        #[arg(long, value_enum, default_value_t = Dtype::Auto)]
        dtype: Dtype,
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
        /// Transformer layers of the drafter.
        #[arg(long, default_value_t = 5)]
        layers: i64,
        /// Tokens per drafted block (the token after the last accepted one + block_size - 1
        /// drafts).
        #[arg(long, default_value_t = 16)]
        block_size: i64,
        /// Token id fed in the masked block slots; its embedding row stays frozen. Pick a
        /// token that never occurs in the data (SmolLM2: 16, `<empty_output>`; Qwen3: 151669).
        /// Left out: one is chosen from the target's tokenizer (and --data), and said why.
        #[arg(long)]
        mask_token_id: Option<i64>,
        /// Tapped target layers, comma separated (default: the DFlash formula).
        #[arg(long, value_delimiter = ',')]
        target_layer_ids: Option<Vec<usize>>,
        /// Number of tapped layers when --target-layer-ids is not given.
        #[arg(long, default_value_t = 5)]
        num_taps: usize,
        /// Seed of the random initialisation (the same seed gives the same weights).
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// A prepared dataset (prepare-data output; its train split) to check the mask token
        /// against: refused when the loss trains on it there (loss_mask 1).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Sliding-window attention of N positions in every layer but those of
        /// --full-attention-layers (the layer_types / sliding_window of Qwen3.6-27B's drafter:
        /// --sliding-window 2048 with 5 layers, the last full). A sliding layer's block slot at
        /// position p sees the keys at positions p - N < k <= p (its block causally). Left out:
        /// every layer full.
        #[arg(long, value_name = "N")]
        sliding_window: Option<i64>,
        /// With --sliding-window: the layers (0-based, comma separated) that keep full
        /// attention [default: the last one].
        #[arg(long, value_delimiter = ',', requires = "sliding_window")]
        full_attention_layers: Option<Vec<usize>>,
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
        /// Longest sample in tokens; longer conversations are cut to it (and counted).
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
        /// A prepare-data output folder, one split folder, or an Arrow / Parquet file.
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
        /// A prepared dataset (folder, split folder or Arrow / Parquet file).
        path: PathBuf,
        /// Random single-row reads timed.
        #[arg(long, default_value_t = 1_000_000)]
        samples: usize,
        /// Packed training batches timed.
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
    /// Send a command to a running trainer through RUN_DIR/control.sock and print the reply
    /// (`status`: the run's state as one JSON object).
    Ctl {
        /// The run directory of the running trainer (it holds control.sock).
        run_dir: PathBuf,
        /// pause, resume, queue NAME DEPTH, checkpoint, profile SECONDS, stop, status
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Write the TensorBoard event files of a run (RUN_DIR/tensorboard/) from its
    /// metrics.jsonl, in place of those there: for runs made before training wrote them.
    ExportTensorboard {
        /// The run directory (it holds metrics.jsonl).
        run_dir: PathBuf,
    },
    /// Open the control room of a run: a running one (started with or without the screen,
    /// several screens at once) through its control socket, or a finished one from its
    /// records. Leaving the screen (q, Ctrl-C) never stops the run.
    Attach {
        /// The run directory.
        run_dir: PathBuf,
        /// Look only: keys that would change the run are refused.
        #[arg(long)]
        read_only: bool,
    },
    /// Benchmark of the training pipeline (benchmarks spec): the real pipeline for a warm-up
    /// and a measured window, every stage alone on the same batches, one JSON object.
    Bench(crate::bench::BenchOptions),
    /// Benchmark of the gated delta rule kernels alone on a GPU (Gated DeltaNet layers of
    /// Qwen3.5): ms per call of a prefill, a decoding step and a verification, JSON lines.
    BenchGdn(crate::bench::gdn::GdnBenchArgs),
    /// Benchmark of the target's forward alone (no autograd, every layer's hidden state
    /// returned, as training runs it) on random token ids: best-of-N seconds, tokens/s, model
    /// TFLOP and TFLOP/s, GPU memory; one JSON object.
    BenchForward(crate::bench::forward::ForwardBenchArgs),
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
    /// Where the drafts of an `eval --json` report were accepted and rejected, by the target's
    /// confidence (its top-1 probability) in the token it picked there: one teacher-forced
    /// forward of the target per prompt, nothing decoded again.
    Acceptance(acceptance::AcceptanceArgs),
    /// Perplexity of a model over a tokenised dataset (Arrow IPC, save_to_disk folder or
    /// Parquet with an input_ids column); prints one JSON object.
    Perplexity {
        /// Hugging Face model folder.
        #[arg(long)]
        model: PathBuf,
        /// The tokenised dataset: a folder, split folder, Arrow or Parquet file.
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
        /// auto, cpu, cuda or cuda:N.
        #[arg(long, default_value_t = DeviceSpec::Auto)]
        device: DeviceSpec,
        /// Compute dtype (auto: bf16 on a GPU, f32 on the CPU).
        #[arg(long, value_enum, default_value_t = Dtype::Auto)]
        dtype: Dtype,
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
    if matches!(
        cli.command,
        Command::Doctor { .. } | Command::InspectData { .. } | Command::BenchData { .. }
    ) {
        // Report printers end quietly when their reader goes away (`inspect-data DIR | head`),
        // as Unix tools do, instead of failing on the write. Rust ignores SIGPIPE so that a
        // closed socket is an error, not death: the trainer and the control room keep that.
        // SAFETY: setting a signal's disposition to the default, before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // One set of progress bars, shared with the logger so that log lines do not cut into them.
    let bars = progress::Bars::stderr();
    if !matches!(cli.command, Command::Train { .. }) {
        logging::init_with(
            &cli.log_level,
            None,
            true,
            Some(Box::new(bars.log_writer())),
        );
    }
    match run(cli, &bars) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line naming what went wrong, with its causes.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, bars: &progress::Bars) -> anyhow::Result<()> {
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
            |log_file| logging::init(&level, Some(log_file), true),
        ),
        Command::Doctor { model } => {
            let runtime = TorchRuntime::init();
            doctor::run(&runtime, model.as_deref())
        }
        Command::ImportGguf {
            file,
            out_dir,
            dtype,
        } => import::import_gguf(&file, &out_dir, dtype),
        Command::ImportSharegpt { file, out } => import::import_sharegpt(&file, &out),
        Command::Eval(args) => eval::run(&TorchRuntime::init(), args, bars),
        Command::Acceptance(args) => acceptance::run(&TorchRuntime::init(), args, bars),
        Command::BenchUi {
            history,
            frames,
            seconds,
        } => bench_ui(history, frames, seconds),
        Command::BenchGdn(args) => crate::bench::gdn::run(&TorchRuntime::init(), &args),
        Command::BenchForward(args) => {
            let report = crate::bench::forward::run(&TorchRuntime::init(), &args)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Bench(opts) => {
            let report = crate::bench::run(&TorchRuntime::init(), &opts)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Attach { run_dir, read_only } => {
            let close = std::sync::atomic::AtomicBool::new(false);
            crate::frontend::tui::app::run(
                &run_dir,
                crate::frontend::tui::state::Viewer::Attached { read_only },
                &close,
            )
        }
        Command::Ctl { run_dir, command } => crate::frontend::ctl::run(&run_dir, &command),
        Command::ExportTensorboard { run_dir } => tensorboard::export(&run_dir),
        command @ (Command::InitDrafter { .. }
        | Command::Perplexity { .. }
        | Command::PrepareData { .. }
        | Command::Generate { .. }) => run_model_or_data(command, bars),
        Command::Regenerate(args) => regenerate::run(&TorchRuntime::init(), args, bars),
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
    }
}

/// The commands that make models and data (their arguments passed on as structs).
fn run_model_or_data(command: Command, bars: &progress::Bars) -> anyhow::Result<()> {
    match command {
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
            sliding_window,
            full_attention_layers,
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
            sliding_window,
            full_attention_layers,
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
                bars,
            )
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
            crate::data::prepare_data::PrepareOptions {
                max_len,
                shard_rows,
                val_fraction,
                seed,
                limit,
                progress: None,
            },
            bars,
        ),
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
        other => anyhow::bail!("{other:?} is not a model or data command"),
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every option and positional of every subcommand, with the path of subcommands to it,
    /// that has no help text (clap's own --help and --version aside).
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            let help = arg.get_help().or(arg.get_long_help());
            if help.is_none_or(|h| h.to_string().trim().is_empty()) {
                out.push(format!("{path} {id}"));
            }
        }
        for sub in cmd.get_subcommands() {
            undocumented(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_option_and_positional_has_help() {
        let cli = Cli::command();
        let mut missing = Vec::new();
        undocumented(&cli, cli.get_name(), &mut missing);
        assert!(
            missing.is_empty(),
            "arguments without help text:\n{}",
            missing.join("\n")
        );
        // The walk does see the subcommands' arguments.
        let eval = cli.find_subcommand("eval").expect("an eval subcommand");
        assert!(eval.get_arguments().any(|a| a.get_id() == "max_new_tokens"));
    }
}
