//! `doctor`: what this installation can use.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::model::{describe_target, TargetConfig};
use crate::paths::Locations;
use crate::runtime::{libtorch_version, CudaSupport, TorchRuntime};
use crate::telemetry::gpu::{nvml_status, NvmlStatus};

const GIB: f64 = (1u64 << 30) as f64;

fn presence(path: &std::path::Path) -> &'static str {
    if path.exists() {
        "present"
    } else {
        "missing"
    }
}

/// What a model folder holds as a target: its family and layers, or why it is not usable.
fn model_summary(dir: &Path) -> String {
    match TargetConfig::from_model_dir(dir) {
        Ok(c) => format!(
            "{}, hidden {}, vocabulary {}",
            describe_target(&c),
            c.hidden_size,
            c.vocab_size
        ),
        Err(e) => format!("not usable as a target: {e:#}"),
    }
}

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Also name this model folder's family and layers, or why it cannot be a target.
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub(super) fn run(runtime: &TorchRuntime, args: &DoctorArgs) -> Result<()> {
    println!("dflash-tui {}", env!("CARGO_PKG_VERSION"));
    let dir = runtime.libtorch_dir.as_deref();
    println!(
        "libtorch: {} at {}",
        libtorch_version(dir).unwrap_or_else(|| "version unknown".into()),
        dir.map(|d| d.display().to_string())
            .unwrap_or_else(|| "(not found in this process)".into())
    );
    println!("  CPU threads: {}", tch::get_num_threads());
    match &runtime.cuda {
        CudaSupport::Loaded { library, devices } => {
            println!("CUDA: {devices} device(s) ({} loaded)", library.display());
            for i in 0..*devices {
                println!("  cuda:{i}");
            }
            match &runtime.graphs {
                Ok(_) => println!("  CUDA graphs: available (decoding steps are replayed graphs)"),
                Err(why) => println!("  CUDA graphs: not available ({why}); decoding runs eagerly"),
            }
            if *devices > 0 {
                let started = std::time::Instant::now();
                match runtime.load_fused_kernels(tch::Device::Cuda(0)) {
                    Ok(_) => println!(
                        "  fused kernels: available (compiled for cuda:0 in {:.0} ms)",
                        started.elapsed().as_secs_f64() * 1e3
                    ),
                    Err(why) => println!(
                        "  fused kernels: not available ({why:#}); decoding and the targets' \
                         norms, SwiGLU and experts run libtorch's operations"
                    ),
                }
                let started = std::time::Instant::now();
                let gdn = runtime
                    .fused_kernel_loader(true)
                    .ok_or_else(|| anyhow::anyhow!("no CUDA graph library"))
                    .and_then(|loader| loader.load_gdn(tch::Device::Cuda(0)));
                match gdn {
                    Ok(kernels) => println!(
                        "  gated delta rule kernels (Qwen3.5 / Qwen3-Next): available (compiled \
                         for cuda:0 in {:.0} ms): {}",
                        started.elapsed().as_secs_f64() * 1e3,
                        kernels.prefill_forms()
                    ),
                    Err(why) => println!(
                        "  gated delta rule kernels: not available ({why:#}); hybrid targets run \
                         libtorch's operations"
                    ),
                }
            }
        }
        CudaSupport::LibraryNotFound => {
            println!("CUDA: not available (libtorch_cuda.so not found beside libtorch or on LD_LIBRARY_PATH); running on CPU")
        }
        CudaSupport::LoadFailed { library, error } => println!(
            "CUDA: not available ({} failed to load: {error}); running on CPU",
            library.display()
        ),
    }
    match nvml_status() {
        NvmlStatus::Available {
            driver_version,
            gpus,
        } => {
            println!("NVML: driver {driver_version}, {} GPU(s)", gpus.len());
            for g in gpus {
                println!(
                    "  GPU {}: {}, memory {:.1}/{:.1} GiB, utilisation {}%",
                    g.index,
                    g.name,
                    g.memory_used_bytes.unwrap_or(0) as f64 / GIB,
                    g.memory_total_bytes.unwrap_or(0) as f64 / GIB,
                    g.utilization_pct
                        .map(|u| u.to_string())
                        .unwrap_or_else(|| "?".into())
                );
            }
        }
        NvmlStatus::Unavailable { reason } => println!("NVML: unavailable ({reason})"),
    }
    let loc = Locations::from_env();
    println!("Locations:");
    println!(
        "  demo assets: {} ({})",
        loc.demo_dir.display(),
        presence(&loc.demo_dir)
    );
    let demo_model = loc.demo_model();
    match presence(&demo_model) {
        "present" => println!(
            "    demo model: {} (present: {})",
            demo_model.display(),
            model_summary(&demo_model)
        ),
        missing => println!("    demo model: {} ({missing})", demo_model.display()),
    }
    println!(
        "    demo conversations: {} ({})",
        loc.demo_conversations().display(),
        presence(&loc.demo_conversations())
    );
    println!("  models: {}", loc.models_dir.display());
    println!("  datasets: {}", loc.datasets_dir.display());
    println!("  runs: {}", loc.runs_dir.display());
    if let Some(dir) = &args.model {
        println!("Model {}: {}", dir.display(), model_summary(dir));
        // every expert of a mixture counts: all are held in memory
        if let Ok(c) = TargetConfig::from_model_dir(dir) {
            println!("  weights: {}", crate::model::memory::describe_weights(&c));
        }
    }
    Ok(())
}
