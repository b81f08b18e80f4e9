//! The command line: argument parsing and one function per subcommand.

use std::process::ExitCode;

use clap::Parser;

use crate::runtime::TorchRuntime;

mod acceptance;
mod bench_ui;
mod control;
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
    pub command: Subcommand,
}

/// One variant per subcommand, each with its arguments as one `clap::Args` struct beside the
/// function that runs it.
#[derive(Debug, clap::Subcommand)]
pub enum Subcommand {
    /// Report libtorch, CUDA devices, NVML and where models, data and runs are looked for.
    Doctor(doctor::DoctorArgs),
    /// Convert a GGUF (llama.cpp) Llama-family model into a Hugging Face model folder.
    ImportGguf(import::ImportGgufArgs),
    /// Recover every complete conversation from a (possibly cut-off) ShareGPT JSON file and
    /// write them as JSON lines.
    ImportSharegpt(import::ImportSharegptArgs),
    /// Answer a prompt with a model: renders the chat template, then decodes greedily.
    Generate(generate::GenerateArgs),
    /// Write a freshly initialised, servable DFlash drafter for a target model.
    InitDrafter(models::InitDrafterArgs),
    /// Tokenise chat data (ShareGPT JSON/JSONL, {"messages"} JSONL, {"text"} JSONL) with a
    /// model's chat template into a Hugging Face dataset (save_to_disk layout, train and
    /// validation splits) with input_ids and loss_mask.
    PrepareData(data::PrepareDataArgs),
    /// Replace every assistant answer of a tokenised dataset (prepare-data output) by the
    /// target's own answer, generated from the conversation so far; resumable.
    Regenerate(regenerate::RegenerateArgs),
    /// Counts, length histogram, loss-mask share and one decoded sample of a dataset.
    InspectData(data::InspectDataArgs),
    /// Benchmark of the data loader: random access per sample, batches per second, and the
    /// same access through pyarrow.
    BenchData(data::BenchDataArgs),
    /// Train a DFlash drafter (staged pipeline in background threads).
    Train(train::TrainArgs),
    /// Send a command to a running trainer through RUN_DIR/control.sock and print the reply
    /// (`status`: the run's state as one JSON object).
    Ctl(control::CtlArgs),
    /// Write the TensorBoard event files of a run (RUN_DIR/tensorboard/) from its
    /// metrics.jsonl, in place of those there: for runs made before training wrote them.
    ExportTensorboard(tensorboard::ExportTensorboardArgs),
    /// Open the control room of a run: a running one (started with or without the screen,
    /// several screens at once) through its control socket, or a finished one from its
    /// records. Leaving the screen (q, Ctrl-C) never stops the run.
    Attach(control::AttachArgs),
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
    BenchUi(bench_ui::BenchUiArgs),
    /// Acceptance length (tau) of a drafter by real greedy speculative decoding, speed-up over
    /// plain greedy decoding, and the check that both produce the same tokens.
    Eval(eval::EvalArgs),
    /// Where the drafts of an `eval --json` report were accepted and rejected, by the target's
    /// confidence (its top-1 probability) in the token it picked there: one teacher-forced
    /// forward of the target per prompt, nothing decoded again.
    Acceptance(acceptance::AcceptanceArgs),
    /// Perplexity of a model over a tokenised dataset (Arrow IPC, save_to_disk folder or
    /// Parquet with an input_ids column); prints one JSON object.
    Perplexity(models::PerplexityArgs),
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
        Subcommand::Doctor(_) | Subcommand::InspectData(_) | Subcommand::BenchData(_)
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
    if !matches!(cli.command, Subcommand::Train(_)) {
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
    let level = cli.log_level;
    match cli.command {
        Subcommand::Train(args) => {
            train::run(args, |log_file| logging::init(&level, Some(log_file), true))
        }
        Subcommand::Doctor(args) => doctor::run(&TorchRuntime::init(), &args),
        Subcommand::ImportGguf(args) => import::import_gguf(&args),
        Subcommand::ImportSharegpt(args) => import::import_sharegpt(&args),
        Subcommand::Generate(args) => generate::run(&TorchRuntime::init(), args),
        Subcommand::InitDrafter(args) => models::init_drafter(args),
        Subcommand::PrepareData(args) => data::prepare(args, bars),
        Subcommand::Regenerate(args) => regenerate::run(&TorchRuntime::init(), args, bars),
        Subcommand::InspectData(args) => data::inspect(&args),
        Subcommand::BenchData(args) => data::bench(&args),
        Subcommand::Ctl(args) => control::ctl(&args),
        Subcommand::ExportTensorboard(args) => tensorboard::export(&args),
        Subcommand::Attach(args) => control::attach(&args),
        Subcommand::Bench(opts) => print_json(&crate::bench::run(&TorchRuntime::init(), &opts)?),
        Subcommand::BenchGdn(args) => crate::bench::gdn::run(&TorchRuntime::init(), &args),
        Subcommand::BenchForward(args) => {
            print_json(&crate::bench::forward::run(&TorchRuntime::init(), &args)?)
        }
        Subcommand::BenchUi(args) => bench_ui::run(&args),
        Subcommand::Eval(args) => eval::run(&TorchRuntime::init(), args, bars),
        Subcommand::Acceptance(args) => acceptance::run(&TorchRuntime::init(), args, bars),
        Subcommand::Perplexity(args) => models::run_perplexity(&TorchRuntime::init(), args, bars),
    }
}

/// A report as one pretty-printed JSON object on stdout.
fn print_json(report: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(report)?);
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
