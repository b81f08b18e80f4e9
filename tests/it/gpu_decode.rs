//! The GPU paths of decoding, checked against the paths the CPU tests check: the flash kernel's
//! variable-length mode against dense attention over the same cache, and CUDA-graph replays
//! against eager steps. Run on a machine with a GPU:
//!   cargo test --release --test gpu_decode -- --ignored gpu
//! (or the carried test binary: `.carry/tests/gpu_decode --ignored gpu`).

use crate::common;

mod fused;
mod fused_norms;

use common::tiny_target_dir;
use dflash_tui::eval::speculative::{
    capacity_for, evaluate, greedy, speculative_decode_with, EvalOptions,
};
use dflash_tui::model::decode::{DrafterDecoder, TargetDecoder};
use dflash_tui::model::{
    Drafter, DrafterConfig, DrafterShape, FrozenHead, SeqSpan, SlotAttention, SlotBatch, SlotCache,
    TargetModel,
};
use dflash_tui::runtime::TorchRuntime;
use tch::{Device, Kind, Tensor};

/// One test at a time on the GPU: a CUDA graph capture in one test thread puts the device's
/// random generator in capture mode, and another thread's `randn` then fails.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpu() -> (TorchRuntime, Device, std::sync::MutexGuard<'static, ()>) {
    let turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let runtime = TorchRuntime::init();
    assert!(
        runtime.cuda_devices() > 0,
        "no CUDA device: {:?}",
        runtime.cuda
    );
    (runtime, Device::Cuda(0), turn)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

fn models(
    dir: &std::path::Path,
    device: Device,
    kind: Kind,
    block: i64,
) -> (TargetModel, Drafter, FrozenHead) {
    let t = tiny_target_dir(&dir.join("t"), "qwen3", false, None, 21);
    let target = TargetModel::load(&t, device, kind).unwrap();
    let config = DrafterConfig::for_target(
        &target.config,
        &DrafterShape {
            layers: 2,
            block_size: block,
            mask_token_id: 1,
            target_layer_ids: None,
            num_taps: 2,
        },
    )
    .unwrap();
    let drafter = Drafter::init(config, device, kind, 3).unwrap();
    let head = FrozenHead::from_target(&target, device, kind);
    (target, drafter, head)
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_flash_varlen_attention_equals_dense_attention_over_the_cache() {
    let (_rt, dev, _turn) = gpu();
    let (heads, kv, d, slots, cap) = (6i64, 2i64, 64i64, 3i64, 40i64);
    let kind = Kind::BFloat16;
    let mut flash = SlotCache::new(1, slots, cap, kv, d, kind, dev, SlotAttention::Flash).unwrap();
    let mut dense = SlotCache::new(1, slots, cap, kv, d, kind, dev, SlotAttention::Dense).unwrap();
    let rand = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, dev)).to_kind(kind);
    // history in every slot
    let history = SlotBatch::packed(
        &flash,
        &[
            SeqSpan {
                slot: 0,
                start: 0,
                len: 20,
            },
            SeqSpan {
                slot: 1,
                start: 0,
                len: 7,
            },
            SeqSpan {
                slot: 2,
                start: 0,
                len: 30,
            },
        ],
    )
    .unwrap();
    let n = history.tokens();
    let (q, k, v) = (
        rand(&[1, heads, n, d]),
        rand(&[1, kv, n, d]),
        rand(&[1, kv, n, d]),
    );
    let a = flash.attend(0, &q, &k, &v, &history, true).unwrap();
    let b = dense.attend(0, &q, &k, &v, &history, true).unwrap();
    assert!(
        max_diff(&a, &b) < 2e-2,
        "packed prefill: {}",
        max_diff(&a, &b)
    );
    // packed continuation in another slot order
    let more = SlotBatch::packed(
        &flash,
        &[
            SeqSpan {
                slot: 2,
                start: 30,
                len: 5,
            },
            SeqSpan {
                slot: 0,
                start: 20,
                len: 3,
            },
        ],
    )
    .unwrap();
    let n = more.tokens();
    let (q, k, v) = (
        rand(&[1, heads, n, d]),
        rand(&[1, kv, n, d]),
        rand(&[1, kv, n, d]),
    );
    let a = flash.attend(0, &q, &k, &v, &more, true).unwrap();
    let b = dense.attend(0, &q, &k, &v, &more, true).unwrap();
    assert!(
        max_diff(&a, &b) < 2e-2,
        "packed continuation: {}",
        max_diff(&a, &b)
    );
    // uniform steps over all slots: one token (decoding), a block causal (verify), a block
    // not causal (the drafter)
    let start = Tensor::from_slice(&[23i64, 7, 35]).to_device(dev);
    for (per_seq, causal) in [(1i64, true), (4, true), (4, false)] {
        let batch = SlotBatch::uniform(&flash, &start, per_seq);
        let n = batch.tokens();
        let (q, k, v) = (
            rand(&[1, heads, n, d]),
            rand(&[1, kv, n, d]),
            rand(&[1, kv, n, d]),
        );
        let a = flash.attend(0, &q, &k, &v, &batch, causal).unwrap();
        let b = dense.attend(0, &q, &k, &v, &batch, causal).unwrap();
        assert!(
            max_diff(&a, &b) < 2e-2,
            "uniform {per_seq} causal {causal}: {}",
            max_diff(&a, &b)
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_graph_replays_equal_eager_steps() {
    let (rt, dev, _turn) = gpu();
    let graphs = rt.graphs(true);
    assert!(graphs.is_some(), "CUDA graphs unavailable: {:?}", rt.graphs);
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter, head) = models(tmp.path(), dev, Kind::BFloat16, 4);
    let taps = drafter.config.target_layer_ids().to_vec();
    // the fused kernels, launched inside the graphs too
    let kernels = rt.fused_kernels(true, dev);
    assert!(kernels.is_some(), "the fused kernels did not load");
    tch::no_grad(|| {
        let mut eager = TargetDecoder::new(&target, 64, &taps, None, kernels).unwrap();
        let mut graphed = TargetDecoder::new(&target, 64, &taps, graphs, kernels).unwrap();
        assert!(graphed.uses_fused_kernels());
        let prompt = [5u32, 9, 13, 2, 7];
        let (la, fa) = eager.prefill(&prompt).unwrap();
        let (lb, fb) = graphed.prefill(&prompt).unwrap();
        assert_eq!(max_diff(&la, &lb), 0.0);
        assert_eq!(max_diff(&fa.unwrap(), &fb.unwrap()), 0.0);
        // steps of 1 and of 4 tokens, rolled back and forth
        for (i, (q, start)) in [(1i64, 5i64), (4, 6), (4, 8), (1, 9), (4, 7), (1, 11)]
            .into_iter()
            .enumerate()
        {
            let ids =
                Tensor::from_slice(&(0..q).map(|j| (7 * i as i64 + j) % 50).collect::<Vec<_>>())
                    .to_device(dev);
            let (la, fa) = eager.step(&ids, start).unwrap();
            let (lb, fb) = graphed.step(&ids, start).unwrap();
            assert_eq!(max_diff(&la, &lb), 0.0, "step {i}");
            assert_eq!(max_diff(&fa.unwrap(), &fb.unwrap()), 0.0, "step {i}");
        }
        assert!(graphed.uses_graphs());
        // the drafter: proposals after prompts and after accepted tokens
        let mut eager = DrafterDecoder::new(&drafter, &head, 64, None, kernels).unwrap();
        let mut graphed = DrafterDecoder::new(&drafter, &head, 64, graphs, kernels).unwrap();
        assert!(graphed.uses_fused_kernels());
        let features = Tensor::randn([9, 2 * 32], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let x = Tensor::from_slice(&[3i64]).to_device(dev);
        let mut pos = 9;
        let mut ctx = features.shallow_clone();
        for step in 0..5 {
            let a = eager.draft(&ctx, &x, pos).unwrap();
            let b = graphed.draft(&ctx, &x, pos).unwrap();
            assert_eq!(
                Vec::<i64>::try_from(&a.to_device(Device::Cpu)).unwrap(),
                Vec::<i64>::try_from(&b.to_device(Device::Cpu)).unwrap(),
                "proposal {step}"
            );
            let accepted = 1 + step % 3;
            ctx = features.narrow(0, 0, accepted);
            pos += accepted;
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_dflash_with_graphs_is_lossless_in_f32_and_equals_eager_in_bf16() {
    let (rt, dev, _turn) = gpu();
    let graphs = rt.graphs(true);
    let tmp = tempfile::tempdir().unwrap();
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 13], vec![2, 4, 8, 16, 32, 11, 7], vec![40]];
    // f32 on the GPU: dense attention, graphs; the output equals greedy decoding exactly.
    let (target, drafter, head) = models(tmp.path(), dev, Kind::Float, 4);
    let trace = tmp.path().join("trace.json");
    let kernels = rt.fused_kernels(true, dev);
    let opts = EvalOptions {
        graphs,
        kernels,
        warmup_prompts: 1,
        progress: None,
        trace: Some(trace.clone()),
    };
    let report = evaluate(&target, &drafter, &head, &prompts, 40, &[], &opts).unwrap();
    // The profiler trace of the extra decoding holds the device's kernels.
    let traced = common::trace_events(&trace, "kernel").len();
    assert!(traced > 100, "{traced} kernels in the trace");
    assert_eq!(
        report.mismatches, 0,
        "f32 DFlash must equal greedy decoding"
    );
    assert!(report.cuda_graphs);
    for (p, r) in prompts.iter().zip(&report.prompts) {
        let plain = tch::no_grad(|| greedy(&target, p, 40, &[])).unwrap();
        assert_eq!(plain.output_ids, r.output_ids);
    }
    // bf16: flash attention; graphs and eager engines agree step for step.
    let (target, drafter, head) = models(&tmp.path().join("b"), dev, Kind::BFloat16, 4);
    let taps = drafter.config.target_layer_ids().to_vec();
    for p in &prompts {
        let cap = capacity_for(p.len(), 40, 4);
        let run = |g| {
            let mut engine = TargetDecoder::new(&target, cap, &taps, g, kernels).unwrap();
            let mut proposer = DrafterDecoder::new(&drafter, &head, cap, g, kernels).unwrap();
            tch::no_grad(|| speculative_decode_with(&mut engine, &mut proposer, p, 40, &[]))
                .unwrap()
        };
        let (a, b) = (run(None), run(graphs));
        assert_eq!(a.output_ids, b.output_ids);
        assert_eq!(a.accept_lengths, b.accept_lengths);
        assert_eq!(a.drafts, b.drafts);
    }
}

/// A hybrid target (Qwen3.5: Gated DeltaNet and gated attention) decoded on the GPU: in f32
/// with CUDA graphs the transformers fixture gives its greedy tokens and DFlash equals greedy;
/// a random hybrid with key heads of 32 (the gated delta rule's CUDA kernels serve it) gives
/// the CPU's logits (1e-4) with a CPU argmax at every token, and lossless DFlash with graphs; in bf16 (flash attention) graphs
/// and eager engines agree step for step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_hybrid_decoding_with_graphs_and_kernels_is_lossless_in_f32() {
    let (rt, dev, _turn) = gpu();
    let graphs = rt.graphs(true);
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen35_targets");
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 13], vec![2, 4, 8, 16, 32, 11, 7], vec![40]];
    let drafter_for = |target: &TargetModel, kind: Kind| {
        let config = DrafterConfig::for_target(
            &target.config,
            &DrafterShape {
                layers: 1,
                block_size: 4,
                mask_token_id: 1,
                target_layer_ids: None,
                num_taps: 2,
            },
        )
        .unwrap();
        let drafter = Drafter::init(config, dev, kind, 3).unwrap();
        let head = FrozenHead::from_target(target, dev, kind);
        (drafter, head)
    };
    let opts = EvalOptions {
        graphs,
        warmup_prompts: 1,
        ..Default::default()
    };
    // the fixture: transformers' greedy tokens through graphs
    let conditional = fixtures.join("conditional");
    let target = TargetModel::load(&conditional, dev, Kind::Float).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(conditional.join("reference.json")).unwrap())
            .unwrap();
    let ids = |key: &str| -> Vec<u32> {
        let list = json[key].as_array().unwrap();
        list.iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let want = ids("greedy");
    let eos = target.config.eos_ids();
    let (drafter, head) = drafter_for(&target, Kind::Float);
    let mut with_fixture = prompts.clone();
    with_fixture.push(ids("prompt"));
    let report = evaluate(
        &target,
        &drafter,
        &head,
        &with_fixture,
        want.len(),
        &eos,
        &opts,
    )
    .unwrap();
    assert_eq!(report.mismatches, 0);
    assert!(report.cuda_graphs);
    assert_eq!(
        report.prompts[3].output_ids, want,
        "transformers' greedy tokens"
    );

    // key heads of 32: the rule's kernels; the CPU's logits
    let tmp = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(conditional.join("config.json")).unwrap())
            .unwrap();
    config["text_config"]["linear_key_head_dim"] = 32.into();
    config["text_config"]["linear_value_head_dim"] = 32.into();
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let cpu = TargetModel::random(tmp.path(), Device::Cpu, Kind::Float, 7).unwrap();
    // drawn by the CPU: CUDA's generator would give another model
    let gpu = TargetModel::random_drawn_on_cpu(tmp.path(), dev, Kind::Float, 7).unwrap();
    let (drafter, head) = drafter_for(&gpu, Kind::Float);
    let report = evaluate(&gpu, &drafter, &head, &prompts, 30, &[], &opts).unwrap();
    assert_eq!(report.mismatches, 0);
    // A random model's logits are close together, so the CPU's and the GPU's roundings can pick
    // different tokens where two are within them: the GPU's tokens, read back by both devices'
    // forwards, get the same logits (1e-4), and each is a CPU argmax within that.
    for (p, r) in prompts.iter().zip(&report.prompts) {
        let seq: Vec<i64> = p.iter().chain(&r.output_ids).map(|&t| t as i64).collect();
        let ids = Tensor::from_slice(&seq).unsqueeze(0);
        let on_cpu = tch::no_grad(|| cpu.forward(&ids, None)).squeeze_dim(0);
        let on_gpu = tch::no_grad(|| gpu.forward(&ids.to_device(dev), None))
            .squeeze_dim(0)
            .to_device(Device::Cpu);
        let diff = (&on_cpu - &on_gpu).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "prompt {p:?}: GPU logits {diff} off the CPU's");
        for (i, &token) in r.output_ids.iter().enumerate() {
            let row = on_cpu.get(p.len() as i64 - 1 + i as i64);
            let best = row.max().double_value(&[]);
            let chosen = row.double_value(&[token as i64]);
            assert!(
                best - chosen < 1e-4,
                "prompt {p:?}, token {i}: the GPU's {token} is {} below the CPU's best",
                best - chosen
            );
        }
    }

    // bf16: flash attention over the gated attention layers; graphs equal eager
    let target = TargetModel::load(&conditional, dev, Kind::BFloat16).unwrap();
    let (drafter, head) = drafter_for(&target, Kind::BFloat16);
    let taps = drafter.config.target_layer_ids().to_vec();
    for p in &prompts {
        let cap = capacity_for(p.len(), 30, 4);
        let run = |g| {
            let mut engine = TargetDecoder::new(&target, cap, &taps, g, None).unwrap();
            let mut proposer = DrafterDecoder::new(&drafter, &head, cap, g, None).unwrap();
            tch::no_grad(|| speculative_decode_with(&mut engine, &mut proposer, p, 30, &[]))
                .unwrap()
        };
        let (a, b) = (run(None), run(graphs));
        assert_eq!(a.output_ids, b.output_ids);
        assert_eq!(a.accept_lengths, b.accept_lengths);
    }
}
