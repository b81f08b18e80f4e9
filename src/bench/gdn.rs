//! `dflash-tui bench-gdn`: the gated delta rule kernels ([`crate::aten_ext::gdn`]) timed alone
//! on a GPU, at the shape of one Gated DeltaNet layer (by default Qwen3.5-27B's: 48 value heads,
//! q / k repeated to 48 heads, head size 128, 3072 tokens, bf16): a prefill, a single decoding
//! step and a 16-token verification writing every state, each as one JSON line with the mean
//! milliseconds per call (the prefill as `forward` takes it, through the recurrent kernel, and
//! at key heads of 128 through the chunked form); with `--reference` also the libtorch loop over the tokens once, and
//! how far the kernel's prefill is from it.

use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::aten_ext::gdn::{reference, GdnInputs, GdnKernels, ScanColumns, CHUNKED_KEY_DIM};
use crate::runtime::TorchRuntime;

/// The storage type of q, k, v and the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GdnDtype {
    Bf16,
    F16,
    F32,
}

impl GdnDtype {
    fn kind(self) -> Kind {
        match self {
            GdnDtype::Bf16 => Kind::BFloat16,
            GdnDtype::F16 => Kind::Half,
            GdnDtype::F32 => Kind::Float,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct GdnBenchArgs {
    /// The CUDA device.
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Sequences per call.
    #[arg(long, default_value_t = 1)]
    pub batch: i64,
    /// Tokens of the prefill.
    #[arg(long, default_value_t = 3072)]
    pub tokens: i64,
    /// Value heads (the state's count).
    #[arg(long, default_value_t = 48)]
    pub value_heads: i64,
    /// Key heads (q and k; value heads are a multiple of them).
    #[arg(long, default_value_t = 48)]
    pub key_heads: i64,
    /// Head size of keys and values.
    #[arg(long, default_value_t = 128)]
    pub head_dim: i64,
    /// Storage type of q, k, v and the output (g float32, beta this type).
    #[arg(long, value_enum, default_value_t = GdnDtype::Bf16)]
    pub dtype: GdnDtype,
    /// Timed calls per case (after 3 untimed ones).
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Also run the libtorch reference (a loop over the tokens) once on the prefill.
    #[arg(long)]
    pub reference: bool,
}

/// Random inputs of one call: q, k, v, g (float32, <= 0), beta (storage type), a state.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
}

impl Inputs {
    /// The rule's inputs, from the state or from zeros.
    fn rule(&self, from_state: bool) -> GdnInputs<'_> {
        GdnInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            initial_state: from_state.then_some(&self.state),
        }
    }
}

fn inputs(args: &GdnBenchArgs, tokens: i64, device: Device) -> Inputs {
    let kind = args.dtype.kind();
    let (b, hk, hv, d) = (args.batch, args.key_heads, args.value_heads, args.head_dim);
    let opts = (Kind::Float, device);
    Inputs {
        q: Tensor::randn([b, tokens, hk, d], opts).to_kind(kind),
        k: Tensor::randn([b, tokens, hk, d], opts).to_kind(kind),
        v: Tensor::randn([b, tokens, hv, d], opts).to_kind(kind),
        g: -Tensor::randn([b, tokens, hv], opts).softplus(),
        beta: Tensor::randn([b, tokens, hv], opts).sigmoid().to_kind(kind),
        state: Tensor::randn([b, hv, d, d], opts) * 0.1,
    }
}

/// Mean milliseconds of `call` over `iters` calls after 3 untimed ones, the device drained
/// before and after.
fn time_ms(index: usize, iters: usize, mut call: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        call()?;
    }
    tch::Cuda::synchronize(index as i64);
    let start = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    tch::Cuda::synchronize(index as i64);
    Ok(start.elapsed().as_secs_f64() * 1e3 / iters.max(1) as f64)
}

/// Runs the benchmark and prints its JSON lines.
pub(crate) fn run(runtime: &TorchRuntime, args: &GdnBenchArgs) -> Result<()> {
    let device = runtime.device(&args.device)?;
    let Device::Cuda(index) = device else {
        bail!(
            "bench-gdn times CUDA kernels: --device {} is not a GPU",
            args.device
        );
    };
    let Some(loader) = runtime.fused_kernel_loader(true) else {
        bail!("the CUDA graph library did not load: {:?}", runtime.graphs);
    };
    let kernels = loader.load_gdn(device)?;
    let line = |case: &str, tokens: i64, ms: f64| {
        json!({
            "bench": "gdn", "case": case, "batch": args.batch, "tokens": tokens,
            "key_heads": args.key_heads, "value_heads": args.value_heads,
            "head_dim": args.head_dim, "dtype": format!("{:?}", args.dtype).to_lowercase(),
            "ms": ms,
        })
    };
    let prefill = inputs(args, args.tokens, device);
    let ms = time_ms(index, args.iters, || {
        forward(&kernels, &prefill, false).map(drop)
    })?;
    let mut record = line("prefill", args.tokens, ms);
    record["form"] = json!(if kernels.takes_chunked(&prefill.rule(false))? {
        "chunked"
    } else {
        "recurrent"
    });
    println!("{record}");
    let ms = time_ms(index, args.iters, || {
        kernels
            .forward_recurrent(&prefill.rule(false), true)
            .map(drop)
    })?;
    println!("{}", line("prefill_recurrent", args.tokens, ms));
    if args.head_dim == CHUNKED_KEY_DIM {
        let ms = time_ms(index, args.iters, || {
            kernels
                .forward_chunked(&prefill.rule(false), true)
                .map(drop)
        })?;
        let mut record = line("prefill_chunked", args.tokens, ms);
        record["tensor_cores"] = json!(kernels.chunked_on_tensor_cores(&prefill.rule(false))?);
        let columns = kernels.tensor_core_scan_columns(&prefill.rule(false))?;
        record["scan_columns"] = json!(columns);
        println!("{record}");
        if let Some(columns) = columns {
            // the other width of the scan's blocks, for comparison
            let (other, width) = if columns == 64 {
                (ScanColumns::Narrow, 32)
            } else {
                (ScanColumns::Wide, 64)
            };
            let other = kernels.with_scan_columns(other);
            let ms = time_ms(index, args.iters, || {
                other.forward_chunked(&prefill.rule(false), true).map(drop)
            })?;
            let mut record = line("prefill_chunked_other_scan_width", args.tokens, ms);
            record["scan_columns"] = json!(width);
            println!("{record}");
        }
        if kernels.chunked_on_tensor_cores(&prefill.rule(false))? {
            let float32 = kernels.with_tensor_cores(false);
            let ms = time_ms(index, args.iters, || {
                float32
                    .forward_chunked(&prefill.rule(false), true)
                    .map(drop)
            })?;
            println!("{}", line("prefill_chunked_float32", args.tokens, ms));
        }
    }
    let step = inputs(args, 1, device);
    let ms = time_ms(index, args.iters, || {
        forward(&kernels, &step, true).map(drop)
    })?;
    println!("{}", line("step", 1, ms));
    let verify = inputs(args, 16, device);
    let (b, hv, d) = (args.batch, args.value_heads, args.head_dim);
    let states = Tensor::empty([b, 16, hv, d, d], (Kind::Float, device));
    let ms = time_ms(index, args.iters, || {
        kernels
            .forward_with_states(&verify.rule(true), true, &states)
            .map(drop)
    })?;
    println!("{}", line("verify_states", 16, ms));
    if args.reference {
        let p = &prefill;
        let start = Instant::now();
        let (want_out, want_state) = reference(&p.rule(false), true)?;
        tch::Cuda::synchronize(index as i64);
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let (out, state) = forward(&kernels, p, false)?;
        let (recurrent_out, recurrent_state) = kernels.forward_recurrent(&p.rule(false), true)?;
        let chunked = (args.head_dim == CHUNKED_KEY_DIM)
            .then(|| kernels.forward_chunked(&p.rule(false), true))
            .transpose()?;
        let diff = |a: &Tensor, b: &Tensor| -> f64 {
            (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
                .abs()
                .max()
                .double_value(&[])
        };
        let mut record = line("prefill_reference_loop", args.tokens, ms);
        record["max_abs_diff_out"] = json!(diff(&out, &want_out));
        record["max_abs_diff_state"] = json!(diff(&state, &want_state));
        record["recurrent_max_abs_diff_out"] = json!(diff(&recurrent_out, &want_out));
        record["recurrent_max_abs_diff_state"] = json!(diff(&recurrent_state, &want_state));
        if let Some((out, state)) = &chunked {
            record["chunked_max_abs_diff_out"] = json!(diff(out, &want_out));
            record["chunked_max_abs_diff_state"] = json!(diff(state, &want_state));
        }
        if chunked.is_some() && kernels.chunked_on_tensor_cores(&p.rule(false))? {
            let (out, state) = kernels
                .with_tensor_cores(false)
                .forward_chunked(&p.rule(false), true)?;
            record["chunked_float32_max_abs_diff_out"] = json!(diff(&out, &want_out));
            record["chunked_float32_max_abs_diff_state"] = json!(diff(&state, &want_state));
            for (name, width) in [("wide", ScanColumns::Wide), ("narrow", ScanColumns::Narrow)] {
                let (out, state) = kernels
                    .with_scan_columns(width)
                    .forward_chunked(&p.rule(false), true)?;
                record[format!("chunked_{name}_scan_max_abs_diff_out")] =
                    json!(diff(&out, &want_out));
                record[format!("chunked_{name}_scan_max_abs_diff_state")] =
                    json!(diff(&state, &want_state));
            }
        }
        record["max_abs_state"] = json!(want_state.abs().max().double_value(&[]));
        println!("{record}");
    }
    Ok(())
}

/// One call of the kernel on `x`, from its state or from zeros.
fn forward(kernels: &GdnKernels, x: &Inputs, from_state: bool) -> Result<(Tensor, Tensor)> {
    kernels.forward(&x.rule(from_state), true)
}
