//! Tests of the gated delta rule: the reference against transformers' numbers, the shape
//! checks, the kernels' source through NVRTC (on the CPU), and the kernels against the
//! reference on a GPU:
//!   cargo test --release --locked --lib aten_ext::gdn -- --include-ignored
//! (the GPU tests are in gdn_gpu_tests.rs)

use super::chunked::GdnChunkParams;
use super::conv::GdnConvParams;
use super::*;
use crate::aten_ext::nvrtc::nvrtc_for_tests;

/// The source compiles for a Hopper GPU; every kernel the loader looks up is in the PTX, each
/// taking one parameter of the size of the Rust `GdnParams` (the layout both sides share). It
/// also compiles for a Turing GPU (compute capability 7.5), where the tensor-core form's
/// entries are empty: the module loads there too.
#[test]
fn the_gdn_source_compiles_with_a_kernel_per_type_and_key_size() {
    let Some(nvrtc) = nvrtc_for_tests() else {
        return;
    };
    let turing = nvrtc.compile_named(SOURCE, "gdn_kernels.cu", 75).unwrap();
    let turing = turing.to_str().unwrap();
    for entry in [
        "gdn_tc_prep_bf16",
        "gdn_tc_scan_f16",
        "gdn_tc_scan_narrow_bf16",
        "gdn_recurrent_bf16_k128",
    ] {
        assert!(
            turing.contains(&format!(".entry {entry}(")),
            "compute_75: no {entry}"
        );
    }
    assert!(!turing.contains("mma.sync"), "compute_75 PTX with mma.sync");
    let ptx = nvrtc.compile_named(SOURCE, "gdn_kernels.cu", 90).unwrap();
    let text = ptx.to_str().unwrap();
    for instruction in [
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        "cvt.rna.tf32.f32",
        "cp.async.cg.shared.global",
    ] {
        assert!(text.contains(instruction), "compute_90: no {instruction}");
    }
    let size = std::mem::size_of::<GdnParams>();
    assert_eq!(size, 200);
    let chunk_size = std::mem::size_of::<GdnChunkParams>();
    assert_eq!(chunk_size, 240);
    let conv_size = std::mem::size_of::<GdnConvParams>();
    assert_eq!(conv_size, 72);
    for kind in ["bf16", "f16", "f32"] {
        let recurrent = KEY_DIMS.map(|dim| (kernel_name(kind, dim), size));
        let chunked = ["prep", "scan"].map(|part| (format!("gdn_chunk_{part}_{kind}"), chunk_size));
        let conv = (format!("gdn_causal_conv_{kind}"), conv_size);
        let tensor_cores = ["prep", "scan", "scan_narrow"]
            .map(|part| (format!("gdn_tc_{part}_{kind}"), chunk_size))
            .into_iter()
            .filter(|_| kind != "f32");
        for (name, size) in recurrent
            .into_iter()
            .chain(chunked)
            .chain([conv])
            .chain(tensor_cores)
        {
            let entry = format!(".entry {name}(");
            let at = text
                .find(&entry)
                .unwrap_or_else(|| panic!("no {entry} in the PTX"));
            let param = format!(".param .align 8 .b8 {name}_param_0[{size}]");
            let head = &text[at..at + 300.min(text.len() - at)];
            assert!(head.contains(&param), "{name}: no {param} in {head}");
            assert!(
                !head.contains("_param_1"),
                "{name} takes more than one parameter"
            );
        }
    }
}

/// The kernels' source run on the CPU (tests/cuda_emulation: one host thread per CUDA thread,
/// barriers for __syncthreads and the warp shuffles) computes the rule as a double-precision
/// loop does, over cases that reach every part of it (see gdn_emulation.cpp): the indexing,
/// tiling and reductions checked where there is no GPU. Needs a C++20 compiler (`$CXX`, else
/// `c++`), as the build does for its C++ shims.
#[test]
fn the_kernel_source_run_on_the_cpu_matches_the_rule() {
    crate::aten_ext::nvrtc::run_cuda_emulation("gdn_emulation", 17);
}

/// A tensor of the fixture: {"shape": [...], "values": [...]}.
fn fixture_tensor(x: &serde_json::Value) -> Tensor {
    let shape: Vec<i64> = serde_json::from_value(x["shape"].clone()).unwrap();
    let values: Vec<f32> = serde_json::from_value(x["values"].clone()).unwrap();
    Tensor::from_slice(&values).reshape(shape)
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

/// The largest difference relative to the largest magnitude of `want`.
fn relative_error(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
    max_abs(&(&got - &want)) / max_abs(&want).max(1e-30)
}

/// The reference computes what transformers' chunked (and recurrent) gated delta rule
/// computes, with grouped heads, an initial state and l2 norms, and without.
#[test]
fn the_reference_matches_transformers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gdn_rule.expected.json");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for case in cases {
        let t = |name: &str| fixture_tensor(&case[name]);
        let initial = case.get("initial_state").map(fixture_tensor);
        let l2norm = case["l2norm"].as_bool().unwrap();
        let [q, k, v, g, beta] = ["q", "k", "v", "g", "beta"].map(t);
        let (out, state) =
            reference(&rule([&q, &k, &v, &g, &beta], initial.as_ref()), l2norm).unwrap();
        let (e_out, e_state) = (
            relative_error(&out, &t("out")),
            relative_error(&state, &t("final_state")),
        );
        assert!(
            e_out < 1e-5 && e_state < 1e-5,
            "l2norm {l2norm}: {e_out} {e_state}"
        );
    }
}

/// Random inputs of one case, made on the CPU (the same numbers on any device) and moved.
struct Case {
    batch: i64,
    steps: i64,
    key_heads: i64,
    value_heads: i64,
    key_dim: i64,
    value_dim: i64,
    initial: bool,
    l2norm: bool,
}

struct Made {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial: Option<Tensor>,
}

impl Case {
    fn make(&self, seed: i64, device: Device, kind: Kind) -> Made {
        tch::manual_seed(seed);
        let (b, t) = (self.batch, self.steps);
        let opts = (Kind::Float, Device::Cpu);
        let qk = [b, t, self.key_heads, self.key_dim];
        let mut q = Tensor::randn(qk, opts);
        let mut k = Tensor::randn(qk, opts);
        if !self.l2norm {
            // keeps the state bounded without the normalisation
            q /= (self.key_dim as f64).sqrt();
            k /= (self.key_dim as f64).sqrt();
        }
        let v = Tensor::randn([b, t, self.value_heads, self.value_dim], opts);
        let g = -Tensor::randn([b, t, self.value_heads], opts).softplus();
        let beta = Tensor::randn([b, t, self.value_heads], opts).sigmoid();
        let state = [b, self.value_heads, self.key_dim, self.value_dim];
        let initial = self
            .initial
            .then(|| (Tensor::randn(state, opts) * 0.5).to_device(device));
        let to = |x: Tensor| x.to_kind(kind).to_device(device);
        Made {
            q: to(q),
            k: to(k),
            v: to(v),
            g: g.to_device(device),
            beta: to(beta),
            initial,
        }
    }
}

/// The rule's inputs q, k, v, g, beta from `initial_state`.
fn rule<'a>(x: [&'a Tensor; 5], initial_state: Option<&'a Tensor>) -> GdnInputs<'a> {
    let [q, k, v, g, beta] = x;
    GdnInputs {
        q,
        k,
        v,
        g,
        beta,
        initial_state,
    }
}

impl Made {
    fn tensors(&self) -> [&Tensor; 5] {
        [&self.q, &self.k, &self.v, &self.g, &self.beta]
    }

    /// The inputs from the case's initial state.
    fn inputs(&self) -> GdnInputs<'_> {
        rule(self.tensors(), self.initial.as_ref())
    }

    fn reference(&self, l2norm: bool) -> (Tensor, Tensor) {
        reference(&self.inputs(), l2norm).unwrap()
    }
}

/// The state after every token ends in the final state; a run split in two, the second part
/// from the first's final state, is the whole run.
#[test]
fn the_reference_runs_on_from_its_own_state() {
    let case = Case {
        batch: 2,
        steps: 6,
        key_heads: 1,
        value_heads: 2,
        key_dim: 4,
        value_dim: 3,
        initial: true,
        l2norm: true,
    };
    let x = case.make(3, Device::Cpu, Kind::Float);
    let (out, state) = x.reference(true);
    let (out_s, states) = reference_with_states(&x.inputs(), true).unwrap();
    assert_eq!(states.size(), [2, 6, 2, 4, 3]);
    assert!(out_s.equal(&out) && states.select(1, 5).equal(&state));
    let part = |s: i64, n: i64| x.tensors().map(|t| t.narrow(1, s, n));
    let run = |part: &[Tensor; 5], initial| reference(&rule(part.each_ref(), initial), true);
    let (first, mid) = run(&part(0, 4), x.initial.as_ref()).unwrap();
    assert!(mid.equal(&states.select(1, 3)));
    let (second, last) = run(&part(4, 2), Some(&mid)).unwrap();
    assert!(Tensor::cat(&[first, second], 1).equal(&out) && last.equal(&state));
    // no tokens: no output, the state as it was
    let (none, kept) = run(&part(0, 0), x.initial.as_ref()).unwrap();
    assert_eq!(none.size(), [2, 0, 2, 3]);
    assert!(kept.equal(x.initial.as_ref().unwrap()));
}

/// Every mismatch of shape, type or device is refused with a message naming the tensor.
#[test]
fn shapes_are_read_and_mismatches_named() {
    let case = Case {
        batch: 2,
        steps: 3,
        key_heads: 2,
        value_heads: 4,
        key_dim: 8,
        value_dim: 5,
        initial: true,
        l2norm: true,
    };
    let x = case.make(4, Device::Cpu, Kind::Float);
    let of = |q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, s: Option<&Tensor>| {
        GdnShape::of(&rule([q, k, v, g, beta], s)).map_err(|e| e.to_string())
    };
    let shape = of(&x.q, &x.k, &x.v, &x.g, &x.beta, x.initial.as_ref()).unwrap();
    assert_eq!(
        shape,
        GdnShape {
            batch: 2,
            steps: 3,
            key_heads: 2,
            value_heads: 4,
            key_dim: 8,
            value_dim: 5
        }
    );
    assert_eq!(shape.states_size(), [2, 3, 4, 8, 5]);
    let s = x.initial.as_ref();
    let err = |e: std::result::Result<GdnShape, String>, want: &str| {
        let e = e.unwrap_err();
        assert!(e.contains(want), "{e:?} does not say {want:?}");
    };
    err(
        of(&x.q, &x.k.narrow(2, 0, 1), &x.v, &x.g, &x.beta, s),
        "k [2, 3, 1, 8]",
    );
    err(
        of(&x.q, &x.k, &x.v.narrow(1, 0, 2), &x.g, &x.beta, s),
        "v [2, 2, 4, 5]",
    );
    err(
        of(&x.q, &x.k, &x.v.narrow(2, 0, 3), &x.g, &x.beta, s),
        "multiple of the key heads",
    );
    err(
        of(&x.q, &x.k, &x.v, &x.g.narrow(2, 0, 3), &x.beta, s),
        "g [2, 3, 3]",
    );
    err(
        of(&x.q, &x.k, &x.v, &x.g, &x.beta.unsqueeze(0), s),
        "beta [1, 2, 3, 4]",
    );
    err(
        of(&x.q.flatten(0, 1), &x.k, &x.v, &x.g, &x.beta, s),
        "[batch, tokens, heads",
    );
    let half = x.q.to_kind(Kind::Half);
    err(
        of(&half, &x.k, &x.v, &x.g, &x.beta, s),
        "q is Half, v Float",
    );
    let int = x.g.to_kind(Kind::Int64);
    err(of(&x.q, &x.k, &x.v, &int, &x.beta, s), "g is Int64");
    let wrong = x.initial.as_ref().unwrap().narrow(3, 0, 4);
    err(
        of(&x.q, &x.k, &x.v, &x.g, &x.beta, Some(&wrong)),
        "the initial state",
    );
    err(
        of(
            &x.q,
            &x.k,
            &x.v,
            &x.g,
            &x.beta,
            Some(&wrong.to_kind(Kind::Double)),
        ),
        "expected Float [2, 4, 8, 5]",
    );
}

// ---- on a GPU ----

#[path = "gdn_gpu_tests.rs"]
mod gpu;
