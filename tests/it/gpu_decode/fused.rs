//! The fused kernels on a GPU against the libtorch operations they replace: the kernels alone,
//! a drafter block, the target's steps, the loss (ignored here: they need a CUDA device).

use super::*;

/// Whether `got` equals `want` up to bf16 rounding: every element within `rel` of the reference
/// (relative, plus a tiny absolute floor), and at least `exact` of them bit for bit. The fused
/// kernels round where libtorch's operations round; only the order of a norm's float sum
/// differs, which moves a rounding now and then.
pub(super) fn assert_close(what: &str, got: &Tensor, want: &Tensor, rel: f64, exact: f64) {
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

/// The drafter's training forward and backward with the fused rotary embedding and SwiGLU (an
/// autograd node each, a kernel a pass) equal the ones with libtorch's operations: the hidden
/// states and every parameter's gradient, in float32 within float32 rounding and in bf16
/// within bf16 rounding.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_drafter_training_with_fused_kernels_equals_the_plain_one() {
    use dflash_tui::model::drafter::AnchorBatch;
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    let tmp = tempfile::tempdir().unwrap();
    for (kind, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 0.03)] {
        let (target, drafter, _) = models(&tmp.path().join(format!("{kind:?}")), dev, kind, 8);
        tch::manual_seed(9);
        let (b, s) = (2i64, 40i64);
        let batch = AnchorBatch {
            input_ids: Tensor::randint(50, [b, s], (Kind::Int64, Device::Cpu)),
            anchors: Tensor::from_slice(&[2i64, 7, 15, 22, 30, 1, 4, 9, 20, 28]).view([b, 5]),
            valid: Tensor::ones([b, 5], (Kind::Bool, Device::Cpu)),
        };
        let features = Tensor::randn([b, s, 2 * 32], (Kind::Float, dev)).to_kind(kind);
        let params: Vec<Tensor> = drafter
            .named_parameters()
            .into_iter()
            .map(|(_, p)| p.shallow_clone())
            .collect();
        let g = Tensor::randn([b, 5, 8, 32], (Kind::Float, dev));
        let run = |fused: bool| {
            let head = FrozenHead::from_target(&target, dev, kind)
                .with_loss_kernels(fused.then_some(kernels));
            let hidden = drafter.forward_train(&head, &features, &batch);
            let loss = (hidden.to_kind(Kind::Float) * &g).sum(Kind::Float);
            let grads = Tensor::run_backward(&[loss], &params, false, false);
            (hidden, grads)
        };
        let ((plain, plain_grads), (fused, fused_grads)) = (run(false), run(true));
        let close = |what: &str, got: &Tensor, want: &Tensor| {
            let scale = want.abs().max().double_value(&[]);
            let diff = max_diff(got, want);
            assert!(
                diff <= tol * scale,
                "{kind:?} {what}: {diff} off a scale of {scale}"
            );
        };
        close("hidden states", &fused, &plain);
        for (i, (got, want)) in fused_grads.iter().zip(&plain_grads).enumerate() {
            close(&format!("gradient {i}"), got, want);
        }
    }
}

/// The RMSNorm node on its kernels (`scaled_rms_norm` forward, `rms_norm_backward`) against
/// libtorch's `rms_norm` and its autograd, at the drafter's shapes: rows of 4,096 (the hidden
/// states) and heads of 128 (the q/k norms), bf16 and f32, an output gradient in another layout.
/// Values and the input's gradient within a rounding of the type; the weight's gradient (a sum
/// over every row, in float32 in both) within float32 summation order, then a rounding.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_rms_norm_node_equals_libtorch() {
    use dflash_tui::aten_ext::fused::rms_norm_autograd;
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    tch::manual_seed(5);
    for (kind, rel, exact) in [(Kind::BFloat16, 1e-2, 0.97), (Kind::Float, 1e-4, 0.0)] {
        for (rows, width) in [(3001, 4096), (40_000, 128), (7, 5120)] {
            let what = format!("{kind:?} {rows} rows of {width}");
            let x = (Tensor::randn([rows, width], (Kind::Float, dev)) * 2.0)
                .to_kind(kind)
                .set_requires_grad(true);
            let w = (Tensor::randn([width], (Kind::Float, dev)) * 0.3 + 1.0)
                .to_kind(kind)
                .set_requires_grad(true);
            let g = Tensor::randn([width, rows], (Kind::Float, dev))
                .to_kind(kind)
                .tr();
            let grads = |y: &Tensor| {
                let gs =
                    Tensor::run_backward(&[(y * &g).sum(Kind::Float)], &[&x, &w], false, false);
                (gs[0].copy(), gs[1].copy())
            };
            let got = rms_norm_autograd(&x, &w, 1e-6, Some(&kernels)).unwrap();
            let want = x.rms_norm([width], Some(&w), 1e-6);
            assert_close(&format!("{what}: values"), &got, &want, rel, exact);
            let (dx, dw) = grads(&got);
            let (want_dx, want_dw) = grads(&want);
            assert_close(
                &format!("{what}: x's gradient"),
                &dx,
                &want_dx,
                rel,
                exact * 0.9,
            );
            // the weight's gradient: float32 sums over every row in another order
            let scale = want_dw.to_kind(Kind::Float).abs().max().double_value(&[]);
            let off = max_diff(&dw.to_kind(Kind::Float), &want_dw.to_kind(Kind::Float));
            let bound = if kind == Kind::Float { 1e-4 } else { 1e-2 } * scale;
            assert!(
                off <= bound,
                "{what}: the weight's gradient {off} off (scale {scale})"
            );
        }
    }
}

/// The residual norm node on its kernels (`add_rms_norm` forward, `rms_norm_backward` with the
/// residual's gradient) against libtorch's addition, `rms_norm` and their autograd, at the
/// drafter's shapes (rows of 4,096 and 5,120), bf16 and f32: the sum bit for bit (libtorch's
/// addition in the type); the norm's output and the inputs' gradient against the same
/// operations in float32 on the same values, within a rounding of the type (the kernels round
/// once where libtorch's bf16 operations round the norm's gradient before adding s's); the
/// weight's gradient within float32 summation order; also with s's own gradient absent (the last
/// layer's).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_residual_norm_node_equals_libtorch() {
    use dflash_tui::aten_ext::fused::add_rms_norm_autograd;
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    tch::manual_seed(6);
    for (kind, rel) in [(Kind::BFloat16, 1e-2), (Kind::Float, 1e-4)] {
        for (rows, width, with_sum) in [(3001, 4096, true), (7, 5120, true), (300, 4096, false)] {
            let what = format!("{kind:?} {rows} rows of {width}, sum used {with_sum}");
            let randn = |shape: &[i64], scale: f64, shift: f64| {
                (Tensor::randn(shape, (Kind::Float, dev)) * scale + shift).to_kind(kind)
            };
            let (h0, a0) = (
                randn(&[rows, width], 2.0, 0.0),
                randn(&[rows, width], 1.0, 0.0),
            );
            let w0 = randn(&[width], 0.3, 1.0);
            let gy = randn(&[rows, width], 1.0, 0.0).to_kind(Kind::Float);
            let gs = randn(&[rows, width], 1.0, 0.0).to_kind(Kind::Float);
            // the leaves, in the type under test and in float32 (the same values)
            let leaves = |k: Kind| [&h0, &a0, &w0].map(|t| t.to_kind(k).set_requires_grad(true));
            let grads = |s: &Tensor, y: &Tensor, at: &[Tensor; 3]| {
                let mut loss = (y.to_kind(Kind::Float) * &gy).sum(Kind::Float);
                if with_sum {
                    loss += (s.to_kind(Kind::Float) * &gs).sum(Kind::Float);
                }
                let at: Vec<&Tensor> = at.iter().collect();
                Tensor::run_backward(&[loss], &at, false, false)
            };
            let got_at = leaves(kind);
            let (s, y) =
                add_rms_norm_autograd(&got_at[0], &got_at[1], &got_at[2], 1e-6, Some(&kernels))
                    .unwrap();
            assert_close(&format!("{what}: the sum"), &s, &(&h0 + &a0), 0.0, 1.0);
            let ref_at = leaves(Kind::Float);
            // s in float32 with the rounded sum's value (as the kernels and libtorch normalise
            // it) and the sum's gradient: x + (round(x) - x), the difference exact
            let sum = &ref_at[0] + &ref_at[1];
            let s32 = &sum + (sum.to_kind(kind).to_kind(Kind::Float) - &sum).detach();
            let y32 = s32.rms_norm([width], Some(&ref_at[2]), 1e-6);
            assert_close(&format!("{what}: the norm"), &y, &y32, rel, 0.0);
            let got = grads(&s, &y, &got_at);
            let want = grads(&s32, &y32, &ref_at);
            for (i, name) in ["h", "a"].iter().enumerate() {
                assert_close(
                    &format!("{what}: {name}'s gradient"),
                    &got[i],
                    &want[i],
                    rel,
                    0.0,
                );
            }
            let scale = want[2].abs().max().double_value(&[]);
            let off = max_diff(&got[2].to_kind(Kind::Float), &want[2]);
            let bound = if kind == Kind::Float { 1e-4 } else { 1e-2 } * scale;
            assert!(
                off <= bound,
                "{what}: the weight's gradient {off} off (scale {scale})"
            );
        }
    }
}

/// One layer of the grouped block attention (`grouped_block_attention_autograd`: per group,
/// cuDNN's fused attention over a view of its sequence's context, the own-block kernel and the
/// merge) against the attention written out in float32: two sequences of 200 context positions,
/// blocks of 16 rows, 32 query heads over 8 of 128 (the 8B drafter's heads), in three groups of
/// 4, 2 and 3 blocks whose contexts end at their last anchor; a block anchored at 0 sees no
/// context (its context part is all masked: cuDNN's output there must not be read). Output and
/// the gradients of the queries, the context keys and values and the blocks' own keys and
/// values, within bf16 rounding of each tensor's scale.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_grouped_block_attention_equals_the_attention_written_out() {
    use dflash_tui::aten_ext::fused::{grouped_block_attention_autograd, BlockGroup};
    let (rt, dev, _turn) = gpu();
    let kernels = rt.fused_kernels(true, dev).expect("the fused kernels load");
    tch::manual_seed(21);
    let (b, s, bs, heads, kv, d) = (2i64, 200i64, 16i64, 32i64, 8i64, 128i64);
    let kind = Kind::BFloat16;
    // (sequence, anchors) of each group
    let spans: [(i64, &[i64]); 3] = [(0, &[0, 9, 40, 77]), (0, &[90, 151]), (1, &[5, 6, 199])];
    let anchors: Vec<i64> = spans.iter().flat_map(|(_, a)| a.iter().copied()).collect();
    let blocks = anchors.len() as i64;
    let t = blocks * bs;
    let leaf = |shape: &[i64]| {
        Tensor::randn(shape, (Kind::Float, dev))
            .to_kind(kind)
            .set_requires_grad(true)
    };
    let q = leaf(&[t, heads, d]);
    let kc = leaf(&[b, s, kv, d]);
    let vc = leaf(&[b, s, kv, d]);
    let kb = leaf(&[t, kv, d]);
    let vb = leaf(&[t, kv, d]);
    let anchors_dev = Tensor::from_slice(&anchors).to_device(dev);
    // each query row's sequence and anchor; it sees the context positions p < its anchor
    let row_seq: Vec<i64> = spans
        .iter()
        .flat_map(|(seq, a)| std::iter::repeat_n(*seq, a.len() * bs as usize))
        .collect();
    let row_seq = Tensor::from_slice(&row_seq).to_device(dev);
    let row_anchor = anchors_dev.repeat_interleave_self_int(bs, None, None);
    let sees = Tensor::arange(s, (Kind::Int64, dev))
        .view([1, s])
        .lt_tensor(&row_anchor.view([t, 1]));
    let mut masks = Vec::new();
    let mut first = 0;
    for (_, a) in &spans {
        let rows = a.len() as i64 * bs;
        let len = (*a.iter().max().unwrap()).max(1);
        let part = sees.narrow(0, first, rows).narrow(1, 0, len);
        // rows padded in memory to 16 elements, as the product's masks (cuDNN's alignment)
        let mut mask =
            Tensor::zeros([1, 1, rows, (len + 15) / 16 * 16], (kind, dev)).narrow(3, 0, len);
        let _ = mask.masked_fill_(
            &part.logical_not().view([1, 1, rows, len]),
            f64::NEG_INFINITY,
        );
        masks.push(mask);
        first += rows;
    }
    let mut groups = Vec::new();
    let mut first = 0;
    for ((seq, a), mask) in spans.iter().zip(&masks) {
        let rows = a.len() as i64 * bs;
        groups.push(BlockGroup {
            seq: *seq,
            first_row: first,
            rows,
            mask,
        });
        first += rows;
    }
    let got = grouped_block_attention_autograd(
        &q,
        (&kc, &vc),
        (&kb, &vb),
        &anchors_dev,
        &groups,
        bs,
        &kernels,
    )
    .expect("the grouped attention takes the layer");
    // written out in float32: per row, keys [its sequence's context; the blocks' own keys]
    let f = |x: &Tensor| x.to_kind(Kind::Float);
    let g = heads / kv;
    let ctx_keys = f(&kc).index_select(0, &row_seq); // [t, s, kv, d]
    let ctx_values = f(&vc).index_select(0, &row_seq);
    let own_keys = f(&kb).view([blocks, bs, kv, d]);
    let own_values = f(&vb).view([blocks, bs, kv, d]);
    let block_of = Tensor::arange(t, (Kind::Int64, dev)).divide_scalar_mode(bs, "floor");
    let keys = Tensor::cat(&[ctx_keys, own_keys.index_select(0, &block_of)], 1)
        .repeat_interleave_self_int(g, 2, None);
    let values = Tensor::cat(&[ctx_values, own_values.index_select(0, &block_of)], 1)
        .repeat_interleave_self_int(g, 2, None);
    let visible = Tensor::cat(&[sees, Tensor::ones([t, bs], (Kind::Bool, dev))], 1);
    let scores = Tensor::einsum("thd,tkhd->thk", &[f(&q), keys], None::<i64>) / (d as f64).sqrt();
    let p = scores
        .masked_fill(&visible.logical_not().unsqueeze(1), f64::NEG_INFINITY)
        .softmax(-1, Kind::Float);
    let want = Tensor::einsum("thk,tkhd->thd", &[p, values], None::<i64>);
    let close = |what: &str, got: &Tensor, want: &Tensor| {
        let scale = want.abs().max().double_value(&[]);
        let diff = max_diff(&got.to_kind(Kind::Float), want);
        assert!(
            diff <= 0.02 * scale,
            "{what}: {diff} off a scale of {scale}"
        );
        assert!(
            got.isfinite().all().int64_value(&[]) == 1,
            "{what}: not finite"
        );
    };
    close("output", &got, &want);
    let dout = Tensor::randn([t, heads, d], (Kind::Float, dev));
    let inputs = [&q, &kc, &vc, &kb, &vb];
    let grads = |y: &Tensor| {
        Tensor::run_backward(&[(f(y) * &dout).sum(Kind::Float)], &inputs, false, false)
    };
    let got_grads = grads(&got);
    let want_grads = grads(&want);
    for (name, (g, w)) in [
        "q",
        "context keys",
        "context values",
        "own keys",
        "own values",
    ]
    .iter()
    .zip(got_grads.iter().zip(&want_grads))
    {
        close(&format!("the gradient of the {name}"), g, &f(w));
    }
}
