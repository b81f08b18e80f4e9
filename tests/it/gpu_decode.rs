//! The GPU paths of decoding, checked against the paths the CPU tests check: the flash kernel's
//! variable-length mode against dense attention over the same cache, and CUDA-graph replays
//! against eager steps. Run on a machine with a GPU:
//!   cargo test --release --test gpu_decode -- --ignored gpu
//! (or the carried test binary: `.carry/tests/gpu_decode --ignored gpu`).

use crate::common;

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

/// Whether `got` equals `want` up to bf16 rounding: every element within `rel` of the reference
/// (relative, plus a tiny absolute floor), and at least `exact` of them bit for bit. The fused
/// kernels round where libtorch's operations round; only the order of a norm's float sum
/// differs, which moves a rounding now and then.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, rel: f64, exact: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shapes");
    let (g, w) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
    let diff = (&g - &w).abs();
    let bound = w.abs() * rel + 1e-4;
    let over = diff.gt_tensor(&bound).sum(Kind::Int64).int64_value(&[]);
    let n = w.numel() as f64;
    let same = diff.eq(0.0).sum(Kind::Int64).int64_value(&[]) as f64 / n;
    assert_eq!(
        over,
        0,
        "{what}: {over} elements off by more than {rel} (max {})",
        max_diff(&g, &w)
    );
    assert!(
        same >= exact,
        "{what}: only {same:.4} of the elements are equal"
    );
}

/// cos and the sign-folded sin of positions `start..start + n` for head size `d`, as
/// `Rope::cos_sin` makes them ([n, d]).
fn rotary(start: i64, n: i64, d: i64, kind: Kind, dev: Device) -> (Tensor, Tensor) {
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let pos = Tensor::arange_start(start, start + n, (Kind::Float, dev)).unsqueeze(-1);
    let freqs = pos * Tensor::from_slice(&inv).to_device(dev);
    let (c, s) = (freqs.cos(), freqs.sin());
    (
        Tensor::cat(&[&c, &c], -1).to_kind(kind),
        Tensor::cat(&[&s.neg(), &s], -1).to_kind(kind),
    )
}

/// The fused kernels against the libtorch operations they replace: the q/k norm, rotation and
/// cache writes of one layer (with norms and without; head sizes 64 and 16, the latter with
/// idle threads in the block), of several layers' context keys at once, and SwiGLU's product;
/// in bf16 (up to rounding) and f32.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_fused_kernels_equal_the_libtorch_operations() {
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    let eps = 1e-6;
    for kind in [Kind::BFloat16, Kind::Float] {
        let (rel, exact) = if kind == Kind::Float {
            (1e-5, 0.0)
        } else {
            (2e-2, 0.95)
        };
        let rand = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, dev)).to_kind(kind);
        for (heads, kv, d, norms) in [
            (9i64, 3i64, 64i64, true),
            (4, 2, 16, true),
            (9, 3, 64, false),
        ] {
            let (n, cache_rows) = (16i64, 40i64);
            let what = format!("{kind:?} {heads}x{kv}x{d} norms {norms}");
            let y = rand(&[1, n, (heads + 2 * kv) * d]);
            let q_norm = (rand(&[d]) * 0.1 + 1.0).to_kind(kind);
            let k_norm = (rand(&[d]) * 0.1 + 1.0).to_kind(kind);
            let (cos, sin) = rotary(5, n, d, kind, dev);
            let rows = Tensor::randperm(cache_rows, (Kind::Int64, dev)).narrow(0, 0, n);
            let k_cache = Tensor::zeros([cache_rows, kv, d], (kind, dev));
            let v_cache = Tensor::zeros([cache_rows, kv, d], (kind, dev));
            let q = kernels
                .rotate_write(
                    &y,
                    1,
                    heads,
                    norms.then_some(&q_norm),
                    norms.then_some(&k_norm),
                    eps,
                    &cos,
                    &sin,
                    &rows,
                    &k_cache,
                    &v_cache,
                )
                .unwrap()
                .unwrap();
            // libtorch: normalised, times the weight, then x * cos + roll(x) * sin
            let yv = y.view([n, heads + 2 * kv, d]);
            let qk = yv.narrow(1, 0, heads + kv);
            let qk = if norms {
                let w = Tensor::cat(
                    &[
                        q_norm.expand([heads, d], false),
                        k_norm.expand([kv, d], false),
                    ],
                    0,
                );
                qk.rms_norm([d], None::<&Tensor>, eps) * w
            } else {
                qk.copy()
            };
            let (c, s) = (cos.unsqueeze(1), sin.unsqueeze(1));
            let mut want = &qk * &c;
            let _ = want.addcmul_(&qk.roll([d / 2], [-1]), &s);
            assert_close(
                &format!("{what}: queries"),
                &q.view([n, heads, d]),
                &want.narrow(1, 0, heads),
                rel,
                exact,
            );
            assert_close(
                &format!("{what}: keys"),
                &k_cache.index_select(0, &rows),
                &want.narrow(1, heads, kv),
                rel,
                exact,
            );
            assert_eq!(
                max_diff(
                    &v_cache.index_select(0, &rows),
                    &yv.narrow(1, heads + kv, kv)
                ),
                0.0,
                "{what}: values"
            );
            // rows not written stay as they were
            let written = k_cache
                .abs()
                .sum_dim_intlist([1, 2].as_slice(), false, Kind::Float)
                .gt(0.0);
            assert_eq!(
                written.sum(Kind::Int64).int64_value(&[]),
                n,
                "{what}: rows written"
            );
        }
        // the context of 3 layers at once: keys normalised per layer, no queries
        let (layers, kv, d, n, cache_rows) = (3i64, 2i64, 64i64, 5i64, 24i64);
        let y = rand(&[n, layers, 2, kv, d]);
        let k_norm = (rand(&[layers, 1, d]) * 0.1 + 1.0).to_kind(kind);
        let (cos, sin) = rotary(7, n, d, kind, dev);
        let rows = Tensor::arange_start(7, 7 + n, (Kind::Int64, dev));
        let k_cache = Tensor::zeros([layers, cache_rows, kv, d], (kind, dev));
        let v_cache = Tensor::zeros([layers, cache_rows, kv, d], (kind, dev));
        let q = kernels
            .rotate_write(
                &y,
                layers,
                0,
                None,
                Some(&k_norm),
                eps,
                &cos,
                &sin,
                &rows,
                &k_cache,
                &v_cache,
            )
            .unwrap();
        assert!(q.is_none());
        let k = y.select(2, 0).rms_norm([d], None::<&Tensor>, eps) * &k_norm;
        let (c, s) = (cos.view([n, 1, 1, d]), sin.view([n, 1, 1, d]));
        let mut want = &k * &c;
        let _ = want.addcmul_(&k.roll([d / 2], [-1]), &s);
        for l in 0..layers {
            let what = format!("{kind:?} context layer {l}");
            assert_close(
                &format!("{what}: keys"),
                &k_cache.get(l).index_select(0, &rows),
                &want.select(1, l),
                rel,
                exact,
            );
            assert_eq!(
                max_diff(
                    &v_cache.get(l).index_select(0, &rows),
                    &y.select(2, 1).select(1, l)
                ),
                0.0,
                "{what}: values"
            );
        }
        // SwiGLU
        let both = rand(&[1, 16, 2 * 48]);
        let got = kernels.silu_mul(&both).unwrap();
        let want = both.narrow(-1, 0, 48).silu() * both.narrow(-1, 48, 48);
        assert_close(
            &format!("{kind:?} silu(gate) * up"),
            &got,
            &want,
            rel,
            if kind == Kind::Float { 0.0 } else { 0.99 },
        );
    }
}

/// A drafter's block forward over its cache with the fused kernels equals the one with
/// libtorch's operations up to bf16 rounding (the context written by both paths, then a block).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_drafter_block_with_fused_kernels_equals_the_plain_one() {
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    let tmp = tempfile::tempdir().unwrap();
    let (_target, drafter, head) = models(tmp.path(), dev, Kind::BFloat16, 8);
    let copy = drafter.decode_copy().unwrap();
    let features = Tensor::randn([11, 2 * 32], (Kind::Float, dev)).to_kind(Kind::BFloat16);
    let ids = Tensor::from_slice(&[3i64, 1, 1, 1, 1, 1, 1, 1]).to_device(dev);
    let run = |fused: bool| {
        let mut cache = copy
            .slot_cache(40)
            .unwrap()
            .with_kernels(fused.then_some(kernels));
        let start = Tensor::zeros([1], (Kind::Int64, dev));
        let ctx = SlotBatch::uniform(&cache, &start, 11);
        copy.append_context_slots(&features, &ctx, &mut cache)
            .unwrap();
        let start = Tensor::full([1], 11, (Kind::Int64, dev));
        let blk = SlotBatch::uniform(&cache, &start, 8);
        copy.block_slots(&head, &ids, &blk, &mut cache).unwrap()
    };
    let (plain, fused) = (run(false), run(true));
    let scale = plain.abs().max().double_value(&[]);
    let diff = max_diff(&plain, &fused);
    assert!(diff <= 0.05 * scale, "fused {diff} off a scale of {scale}");
}

/// The target's forwards over its cache with the fused kernels (a prompt, then steps of 1 and
/// of 4 tokens) equal the ones with libtorch's operations up to bf16 rounding, for a model with
/// q/k norms (Qwen3) and one without (Llama).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_target_steps_with_fused_kernels_equal_the_plain_ones() {
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev);
    assert!(kernels.is_some(), "the fused kernels did not load");
    let tmp = tempfile::tempdir().unwrap();
    for family in ["qwen3", "llama"] {
        let dir = tiny_target_dir(&tmp.path().join(family), family, false, None, 5);
        let target = TargetModel::load(&dir, dev, Kind::BFloat16).unwrap();
        let taps = [0usize, 1];
        tch::no_grad(|| {
            let mut plain = TargetDecoder::new(&target, 64, &taps, None, None).unwrap();
            let mut fused = TargetDecoder::new(&target, 64, &taps, None, kernels).unwrap();
            assert!(fused.uses_fused_kernels() && !plain.uses_fused_kernels());
            let close = |what: &str, a: &Tensor, b: &Tensor| {
                let scale = a.abs().max().double_value(&[]);
                let diff = max_diff(a, b);
                assert!(
                    diff <= 0.05 * scale,
                    "{family} {what}: {diff} off a scale of {scale}"
                );
            };
            let prompt = [5u32, 9, 13, 2, 7, 11, 3];
            let (la, fa) = plain.prefill(&prompt).unwrap();
            let (lb, fb) = fused.prefill(&prompt).unwrap();
            close("prompt logits", &la, &lb);
            close("prompt features", &fa.unwrap(), &fb.unwrap());
            for (i, (q, start)) in [(1i64, 7i64), (4, 8), (1, 12)].into_iter().enumerate() {
                let ids = Tensor::from_slice(
                    &(0..q).map(|j| (3 * i as i64 + j) % 50).collect::<Vec<_>>(),
                )
                .to_device(dev);
                let (la, fa) = plain.step(&ids, start).unwrap();
                let (lb, fb) = fused.step(&ids, start).unwrap();
                close(&format!("step {i} logits"), &la, &lb);
                close(&format!("step {i} features"), &fa.unwrap(), &fb.unwrap());
            }
        });
    }
}

/// The training loss with the fused kernel (cross-entropy, argmax check and gradient of each
/// chunk of logits in one kernel) against libtorch's operations, on random hidden states and a
/// random LM head: the same loss, accuracy and acceptance sums, and the same gradient into the
/// hidden states up to rounding, in float32 and bf16, for a vocabulary the kernel reads in
/// 16-byte vectors (1,024) and one it reads element by element (1,003), with one chunk and
/// several. A soft-label loss keeps libtorch's operations (same numbers with the kernels on).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_fused_loss_equals_the_libtorch_operations() {
    use dflash_tui::train::loss::{
        block_targets, loss_and_backward, sample_anchors, LossOptions, LossSums,
    };
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    let (rows, len, block, h) = (3usize, 90usize, 8usize, 64i64);
    let lengths = [90usize, 61, 37];
    let mask: Vec<i64> = (0..rows * len).map(|i| i64::from(i % len >= 5)).collect();
    for vocab in [1024i64, 1003] {
        let ids: Vec<i64> = (0..rows * len)
            .map(|i| (i as i64 * 7919 + 13) % vocab)
            .collect();
        let plan = sample_anchors(&mask, &lengths, len, block, 12, 5);
        let targets = block_targets(&ids, &mask, &lengths, len, &plan, block, 7.0);
        for kind in [Kind::Float, Kind::BFloat16] {
            tch::manual_seed(vocab + 1);
            let lm_head = (Tensor::randn([vocab, h], (Kind::Float, dev)) * 0.3).to_kind(kind);
            let per_row = plan.per_row as i64;
            // about half the slots pointed at their label, so that the argmax check counts
            let slots = rows as i64 * per_row * block as i64;
            let labels = Tensor::from_slice(&targets.labels).to_device(dev);
            let hint = lm_head.to_kind(Kind::Float).index_select(0, &labels)
                * (Tensor::rand([slots, 1], (Kind::Float, dev)).gt(0.5) * 3.0);
            let hidden0 = (Tensor::randn([slots, h], (Kind::Float, dev)) + hint)
                .view([rows as i64, per_row, block as i64, h])
                .to_kind(kind);
            let teacher = Tensor::randn([rows as i64, len as i64, h], (kind, dev));
            let run = |fused: bool, chunk_rows: i64, kl_weight: f64| -> (LossSums, Tensor) {
                let hidden = hidden0.detach().set_requires_grad(true);
                let opts = LossOptions {
                    kl_weight,
                    kl_temperature: 1.0,
                    streak_alpha: 0.0,
                    streak_tau_power: 0.0,
                    chunk_rows,
                    kernels: fused.then_some(kernels),
                };
                let (sums, pending) = loss_and_backward(
                    &hidden,
                    &lm_head,
                    &targets,
                    &plan.valid,
                    (kl_weight > 0.0).then_some(&teacher),
                    &opts,
                    0.5,
                );
                pending.expect("a backward pass").run();
                (sums, hidden.grad())
            };
            for chunk_rows in [100_000, 37] {
                let what = format!("vocab {vocab} {kind:?} chunks of {chunk_rows}");
                let (want, want_grad) = run(false, chunk_rows, 0.0);
                let (got, got_grad) = run(true, chunk_rows, 0.0);
                let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
                assert!(
                    rel(got.loss(), want.loss()) < 1e-5,
                    "{what}: {got:?} {want:?}"
                );
                assert_eq!(got.weight, want.weight, "{what}");
                assert_eq!(got.weighted_correct, want.weighted_correct, "{what}");
                assert_eq!(got.accepted, want.accepted, "{what}");
                assert!(want.weighted_correct > 0.0, "{what}: no argmax hit");
                let (rel_grad, exact) = if kind == Kind::Float {
                    (1e-4, 0.0)
                } else {
                    (1e-2, 0.95)
                };
                assert_close(&what, &got_grad, &want_grad, rel_grad, exact);
                assert!(max_diff(&want_grad, &Tensor::zeros_like(&want_grad)) > 0.0);
            }
            let (want, want_grad) = run(false, 37, 0.5);
            let (got, got_grad) = run(true, 37, 0.5);
            assert_eq!(got, want, "soft labels");
            assert_eq!(max_diff(&got_grad, &want_grad), 0.0, "soft labels");
        }
    }
}

/// A hybrid target (Qwen3.5: Gated DeltaNet and gated attention) decoded on the GPU: in f32
/// with CUDA graphs the transformers fixture gives its greedy tokens and DFlash equals greedy;
/// a random hybrid with key heads of 32 (the gated delta rule's CUDA kernels serve it) gives
/// the CPU's greedy tokens and lossless DFlash with graphs; in bf16 (flash attention) graphs
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

    // key heads of 32: the rule's kernels; the CPU's greedy tokens
    let tmp = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(conditional.join("config.json")).unwrap())
            .unwrap();
    config["text_config"]["linear_key_head_dim"] = 32.into();
    config["text_config"]["linear_value_head_dim"] = 32.into();
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let cpu = TargetModel::random(tmp.path(), Device::Cpu, Kind::Float, 7).unwrap();
    let gpu = TargetModel::random(tmp.path(), dev, Kind::Float, 7).unwrap();
    let (drafter, head) = drafter_for(&gpu, Kind::Float);
    let report = evaluate(&gpu, &drafter, &head, &prompts, 30, &[], &opts).unwrap();
    assert_eq!(report.mismatches, 0);
    for (p, r) in prompts.iter().zip(&report.prompts) {
        let plain = tch::no_grad(|| greedy(&cpu, p, 30, &[])).unwrap();
        assert_eq!(
            plain.output_ids, r.output_ids,
            "prompt {p:?}: GPU against CPU"
        );
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
