//! The gated delta rule kernels against the reference on a GPU (ignored without one):
//!   cargo test --release --locked --lib aten_ext::gdn -- --include-ignored

use super::*;
use crate::aten_ext::graph::CudaGraph;
use crate::runtime::TorchRuntime;

/// One test at a time on the GPU (a CUDA graph capture in one thread breaks another's work).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpu() -> (GdnKernels, Device, std::sync::MutexGuard<'static, ()>) {
    let turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let runtime = TorchRuntime::init();
    assert!(
        runtime.cuda_devices() > 0,
        "no CUDA device: {:?}",
        runtime.cuda
    );
    let device = Device::Cuda(0);
    let loader = runtime
        .fused_kernel_loader(true)
        .unwrap_or_else(|| panic!("no CUDA graph library: {:?}", runtime.graphs));
    (loader.load_gdn(device).unwrap(), device, turn)
}

fn run(kernels: &GdnKernels, x: &Made, l2norm: bool) -> (Tensor, Tensor) {
    kernels.forward(&x.inputs(), l2norm).unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, tolerance: f64, what: &str) {
    let e = relative_error(got, want);
    assert!(
        e <= tolerance,
        "{what}: relative error {e:e} > {tolerance:e}"
    );
}

/// float32: output and final state within 1e-4 of the reference, for every key head size,
/// grouped heads, token counts that are no multiple of a tile (32 steps at K = 128), value
/// columns that are no multiple of a block's 16, several batch rows, one token.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_kernel_matches_the_reference_in_f32() {
    let (kernels, device, _turn) = gpu();
    let cases = [
        (2, 37, 2, 4, 128, 40, false, true),
        (2, 37, 2, 4, 128, 40, true, true),
        (1, 70, 3, 3, 64, 16, true, false),
        (2, 5, 1, 2, 32, 8, true, true),
        (1, 150, 1, 1, 32, 3, false, true),
        (1, 20, 2, 2, 256, 20, true, true),
        (3, 1, 2, 6, 128, 128, true, true),
        (1, 300, 2, 4, 128, 128, true, true),
    ];
    assert_f32_cases(&cases, 0, device, |x, l2norm| run(&kernels, x, l2norm));
}

/// (batch, steps, key heads, value heads, key head size, value head size, initial state, l2norm)
type CaseRow = (i64, i64, i64, i64, i64, i64, bool, bool);

/// Each case in float32 (seeded `first_seed`, the next, ...) through `forward`: output and
/// final state within 1e-4 of the reference.
fn assert_f32_cases(
    cases: &[CaseRow],
    first_seed: i64,
    device: Device,
    forward: impl Fn(&Made, bool) -> (Tensor, Tensor),
) {
    for (seed, &(batch, steps, key_heads, value_heads, key_dim, value_dim, initial, l2norm)) in
        (first_seed..).zip(cases)
    {
        let case = Case {
            batch,
            steps,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            initial,
            l2norm,
        };
        let x = case.make(seed, device, Kind::Float);
        let (out, state) = forward(&x, l2norm);
        let (want_out, want_state) = x.reference(l2norm);
        let what = format!("B {batch} T {steps} Hk {key_heads} Hv {value_heads} K {key_dim} V {value_dim} initial {initial} l2norm {l2norm}");
        assert_close(&out, &want_out, 1e-4, &format!("output, {what}"));
        assert_close(&state, &want_state, 1e-4, &format!("final state, {what}"));
    }
}

/// bf16 and f16 inputs (beta in the storage type, g float32): the final state (float32, from
/// the same inputs) within 1e-4 of the reference's, the output within its own rounding.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_half_types_match_the_reference() {
    let (kernels, device, _turn) = gpu();
    let case = Case {
        batch: 2,
        steps: 45,
        key_heads: 2,
        value_heads: 4,
        key_dim: 128,
        value_dim: 64,
        initial: true,
        l2norm: true,
    };
    for kind in [Kind::BFloat16, Kind::Half] {
        let x = case.make(11, device, kind);
        assert_eq!((x.beta.kind(), x.g.kind()), (kind, Kind::Float));
        let (out, state) = run(&kernels, &x, true);
        let (want_out, want_state) = x.reference(true);
        assert_eq!(out.kind(), kind);
        assert_close(&out, &want_out, 1e-2, &format!("{kind:?} output"));
        assert_close(&state, &want_state, 1e-4, &format!("{kind:?} final state"));
    }
}

/// The chunked form (long calls with key heads of 128): float32 within 1e-4 of the reference
/// (whole and partial chunks, grouped heads, partial column blocks, with and without the
/// normalisation and an initial state). bf16 and f16 on tensor cores (value heads of 128 and
/// 64, q, k, v as views of one projection as the model splits it, and dense) and bf16 in
/// float32: the output within its rounding of the reference and of the recurrent kernel; the
/// final state within 1e-4 in float32, 2e-3 on tensor cores (TF32 products).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_chunked_form_matches_the_reference() {
    let (kernels, device, _turn) = gpu();
    let k = CHUNKED_KEY_DIM;
    let cases = [
        (1, 64, 1, 2, k, 32, true, true),
        (2, 130, 1, 2, k, 40, true, true),
        (1, 300, 2, 6, k, 128, false, false),
        (1, 1000, 2, 4, k, 96, true, true),
    ];
    assert_f32_cases(&cases, 20, device, |x, l2norm| {
        kernels.forward_chunked(&x.inputs(), l2norm).unwrap()
    });
    let float32_form = kernels.with_tensor_cores(false);
    let wide = kernels.with_scan_columns(ScanColumns::Wide);
    let narrow = kernels.with_scan_columns(ScanColumns::Narrow);
    let forms = [
        (Kind::BFloat16, 128, true, wide, 2e-3),
        (Kind::BFloat16, 128, false, narrow, 2e-3),
        (Kind::Half, 64, true, wide, 2e-3),
        (Kind::Half, 64, false, narrow, 2e-3),
        (Kind::BFloat16, 128, true, kernels, 2e-3),
        (Kind::BFloat16, 128, true, float32_form, 1e-4),
    ];
    for (seed, (kind, value_dim, projection, kernels, state_tolerance)) in (30..).zip(forms) {
        let case = Case {
            batch: 2,
            steps: 200,
            key_heads: 2,
            value_heads: 4,
            key_dim: CHUNKED_KEY_DIM,
            value_dim,
            initial: true,
            l2norm: true,
        };
        let x = case.make(seed, device, kind);
        // q | k | v side by side in one [B, T, 2 Hk K + Hv V] tensor, split into views
        let joined = Tensor::cat(
            &[x.q.flatten(2, 3), x.k.flatten(2, 3), x.v.flatten(2, 3)],
            2,
        );
        let split = joined.split_with_sizes([2 * k, 2 * k, 4 * value_dim], 2);
        let viewed = [
            split[0].view([2, 200, 2, k]),
            split[1].view([2, 200, 2, k]),
            split[2].view([2, 200, 4, value_dim]),
        ];
        let inputs = if projection {
            rule(
                [&viewed[0], &viewed[1], &viewed[2], &x.g, &x.beta],
                x.initial.as_ref(),
            )
        } else {
            x.inputs()
        };
        let tensor_cores = state_tolerance > 1e-4;
        let what = format!(
            "{kind:?} V {value_dim}, {}, {}",
            if projection { "views" } else { "dense" },
            match kernels.tensor_core_scan_columns(&inputs).unwrap() {
                Some(columns) => format!("tensor cores, scan blocks of {columns} columns"),
                None => "float32".to_string(),
            }
        );
        assert_eq!(
            kernels.chunked_on_tensor_cores(&inputs).unwrap(),
            tensor_cores,
            "{what}: not the form asked for"
        );
        let (out, state) = kernels.forward_chunked(&inputs, true).unwrap();
        let (want_out, want_state) = x.reference(true);
        let (recurrent_out, _) = kernels.forward_recurrent(&inputs, true).unwrap();
        assert_eq!(out.kind(), kind);
        assert_close(&out, &want_out, 1e-2, &format!("{what}: output"));
        assert_close(
            &out,
            &recurrent_out,
            1e-2,
            &format!("{what}: output against the recurrent kernel"),
        );
        assert_close(
            &state,
            &want_state,
            state_tolerance,
            &format!("{what}: final state"),
        );
    }
}

/// The causal convolution kernel gives what libtorch's conv1d over the conv state and the new
/// inputs, then silu, give (f32 within 1e-6, bf16 within its rounding), and the next conv
/// state exactly: a prefill from a strided projection, a one-token step from a state, no state.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_conv_matches_libtorch() {
    let (kernels, device, _turn) = gpu();
    for (kind, tolerance) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1e-2)] {
        for (batch, tokens, channels, with_state) in
            [(2, 300, 520, true), (3, 1, 130, true), (1, 37, 64, false)]
        {
            tch::manual_seed(tokens);
            let opts = (Kind::Float, device);
            // the projection: q, k, v columns first, then others
            let projection = Tensor::randn([batch, tokens, channels + 24], opts).to_kind(kind);
            let x = projection.narrow(2, 0, channels);
            let weight = (Tensor::randn([channels, 1, CONV_WIDTH], opts) * 0.5).to_kind(kind);
            let state = with_state
                .then(|| Tensor::randn([batch, channels, CONV_WIDTH - 1], opts).to_kind(kind));
            let (out, next) = kernels
                .causal_conv_silu(&x, &weight, state.as_ref())
                .unwrap();
            let prev = state.unwrap_or_else(|| {
                Tensor::zeros([batch, channels, CONV_WIDTH - 1], (kind, device))
            });
            let history = Tensor::cat(&[prev, x.transpose(1, 2)], 2);
            let want = history
                .conv1d::<&Tensor>(&weight, None, [1], [0], [1], channels)
                .silu()
                .transpose(1, 2);
            let what = format!("{kind:?} B {batch} T {tokens} C {channels} state {with_state}");
            assert_close(&out, &want, tolerance, &format!("output, {what}"));
            let last = history.narrow(2, tokens, CONV_WIDTH - 1);
            assert!(next.equal(&last), "next conv state, {what}");
        }
    }
}

/// The state after every token of a verification step: the reference's, the last one the final
/// state of `forward`, and the same output.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_states_after_every_token() {
    let (kernels, device, _turn) = gpu();
    let case = Case {
        batch: 2,
        steps: 16,
        key_heads: 2,
        value_heads: 6,
        key_dim: 128,
        value_dim: 128,
        initial: true,
        l2norm: true,
    };
    let x = case.make(5, device, Kind::Float);
    let shape = GdnShape::of(&x.inputs()).unwrap();
    let states = Tensor::full(shape.states_size(), f64::NAN, (Kind::Float, device));
    let out = kernels
        .forward_with_states(&x.inputs(), true, &states)
        .unwrap();
    let (want_out, want_states) = reference_with_states(&x.inputs(), true).unwrap();
    assert_close(&out, &want_out, 1e-4, "output");
    assert_close(&states, &want_states, 1e-4, "states");
    let (plain_out, final_state) = run(&kernels, &x, true);
    assert!(
        plain_out.equal(&out),
        "forward and forward_with_states differ"
    );
    assert!(
        final_state.equal(&states.select(1, 15)),
        "the last state is not the final one"
    );
    // a draft accepted up to token 8: the run continued from the state kept there (a strided
    // view of the buffer) is the rest of the whole run
    let rest = x.tensors().map(|t| t.narrow(1, 8, 8));
    let kept = states.select(1, 7);
    assert!(!kept.is_contiguous());
    let (rest_out, rest_state) = kernels
        .forward(&rule(rest.each_ref(), Some(&kept)), true)
        .unwrap();
    assert_close(
        &rest_out,
        &out.narrow(1, 8, 8),
        1e-5,
        "output after the kept state",
    );
    assert_close(
        &rest_state,
        &final_state,
        1e-5,
        "final state after the kept state",
    );
    let wrong = states.narrow(1, 0, 15).contiguous();
    let e = kernels
        .forward_with_states(&rule(x.tensors(), None), true, &wrong)
        .unwrap_err();
    assert!(e.to_string().contains("the states buffer"), "{e}");
}

/// q, k and v as views of one projection (strided heads and tokens) give what dense copies
/// give; tokens whose k and g are zero (the model's padding) leave the state as it was.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_strided_inputs_and_padding_tokens() {
    let (kernels, device, _turn) = gpu();
    let (b, t, hk, hv, d) = (2, 9, 2, 4, 128);
    tch::manual_seed(7);
    let mixed = Tensor::randn([b, t, (2 * hk + hv) * d], (Kind::Float, device));
    let q = mixed.narrow(2, 0, hk * d).view([b, t, hk, d]);
    let k = mixed.narrow(2, hk * d, hk * d).view([b, t, hk, d]);
    let v = mixed.narrow(2, 2 * hk * d, hv * d).view([b, t, hv, d]);
    assert!(!q.is_contiguous());
    let g = -Tensor::rand([b, t, hv], (Kind::Float, device));
    let beta = Tensor::rand([b, t, hv], (Kind::Float, device));
    let state = Tensor::randn([b, hv, d, d], (Kind::Float, device));
    let (out, last) = kernels
        .forward(&rule([&q, &k, &v, &g, &beta], Some(&state)), true)
        .unwrap();
    let [dq, dk, dv] = [&q, &k, &v].map(Tensor::contiguous);
    let (dense_out, dense_last) = kernels
        .forward(&rule([&dq, &dk, &dv, &g, &beta], Some(&state)), true)
        .unwrap();
    assert!(out.equal(&dense_out) && last.equal(&dense_last));
    let (k0, g0) = (k.zeros_like(), g.zeros_like());
    let (_, kept) = kernels
        .forward(&rule([&q, &k0, &v, &g0, &beta], Some(&state)), true)
        .unwrap();
    assert!(kept.equal(&state), "padding tokens changed the state");
}

/// One decoding step captured in a CUDA graph and replayed on new inputs computes what an
/// eager call on those inputs does: the launch is on libtorch's current stream and reads its
/// arguments from device memory only.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_a_step_replays_in_a_cuda_graph() {
    let (kernels, device, _turn) = gpu();
    let graphs = TorchRuntime::init()
        .graphs(true)
        .expect("the CUDA graph library");
    let case = Case {
        batch: 2,
        steps: 1,
        key_heads: 2,
        value_heads: 4,
        key_dim: 128,
        value_dim: 128,
        initial: true,
        l2norm: true,
    };
    let x = case.make(8, device, Kind::BFloat16);
    let (graph, (out, state)) =
        CudaGraph::capture(graphs, device, 2, || run(&kernels, &x, true)).unwrap();
    let fresh = case.make(9, device, Kind::BFloat16);
    for (slot, new) in [
        (&x.q, &fresh.q),
        (&x.k, &fresh.k),
        (&x.v, &fresh.v),
        (&x.g, &fresh.g),
        (&x.beta, &fresh.beta),
    ] {
        slot.shallow_clone().copy_(new);
    }
    x.initial
        .as_ref()
        .unwrap()
        .shallow_clone()
        .copy_(fresh.initial.as_ref().unwrap());
    graph.replay().unwrap();
    let (want_out, want_state) = run(&kernels, &fresh, true);
    assert!(out.equal(&want_out) && state.equal(&want_state));
}

/// Inputs on another device, or a key head size without a kernel, are refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_inputs_without_a_kernel_are_refused() {
    let (kernels, device, _turn) = gpu();
    let case = |key_dim| Case {
        batch: 1,
        steps: 2,
        key_heads: 1,
        value_heads: 1,
        key_dim,
        value_dim: 4,
        initial: false,
        l2norm: true,
    };
    let on_cpu = case(32).make(1, Device::Cpu, Kind::Float);
    let e = kernels.forward(&rule(on_cpu.tensors(), None), true);
    assert!(e.unwrap_err().to_string().contains("the inputs are on Cpu"));
    let odd = case(48).make(1, device, Kind::Float);
    let e = kernels.forward(&rule(odd.tensors(), None), true);
    assert!(e.unwrap_err().to_string().contains("key head size of 48"));
}
