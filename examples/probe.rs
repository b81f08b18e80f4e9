//! Where the time of one training batch goes on a GPU: each part of the target forward and of
//! the drafter step timed alone, with a wait for the device around each, on a random-weight
//! target of a model shape. A diagnostic for tuning, not a benchmark of the pipeline (that is
//! `dflash-tui bench`).
//!
//!   cargo run --release --example probe -- configs/shapes/qwen3-8b [rows] [len] [anchors] [drafter layers]

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use dflash_tui::model::drafter::TrainAttention;
use dflash_tui::model::layers::{attention_with_bias, rms_norm, Rope};
use dflash_tui::model::{AnchorBatch, Drafter, DrafterConfig, DrafterShape, FrozenHead};
use dflash_tui::model::{ForwardRequest, TargetModel};
use dflash_tui::runtime::TorchRuntime;
use dflash_tui::train::loss::LossOptions;
use dflash_tui::train::loss::{block_targets, loss_and_backward_deferred, sample_anchors};
use dflash_tui::train::optim::{AdamW, AdamWConfig};
use tch::{Device, Kind, Tensor};

/// Mean ms per call of `f` with one wait for the device at the end.
fn time_ms(dev: Device, iters: usize, f: impl FnMut()) -> f64 {
    host_and_device_ms(dev, iters, f).1
}

/// (host ms, wall ms) per call of `f`: the time to queue the calls, and the time until the
/// device has run them. Host close to wall means the host is the bottleneck (launch-bound).
fn host_and_device_ms(dev: Device, iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    let sync = || {
        if let Device::Cuda(i) = dev {
            tch::Cuda::synchronize(i as i64);
        }
    };
    f();
    sync();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    let host = t.elapsed().as_secs_f64();
    sync();
    let per = |s: f64| s * 1e3 / iters as f64;
    (per(host), per(t.elapsed().as_secs_f64()))
}

fn main() -> Result<()> {
    let rt = TorchRuntime::init();
    let args: Vec<String> = std::env::args().collect();
    let dir = Path::new(
        args.get(1)
            .context("usage: probe SHAPE_DIR [rows] [len] [anchors] [drafter layers]")?,
    );
    let rows: i64 = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let len: i64 = args.get(3).map_or(Ok(1500), |s| s.parse())?;
    let anchors: usize = args.get(4).map_or(Ok(434), |s| s.parse())?;
    let drafter_layers: i64 = args.get(5).map_or(Ok(5), |s| s.parse())?;
    let dev = Device::cuda_if_available();
    let kind = if dev.is_cuda() {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    let target = TargetModel::random(dir, dev, kind, 0)?;
    let cfg = target.config.clone();
    let shape = DrafterShape {
        layers: drafter_layers,
        block_size: 16,
        mask_token_id: cfg.vocab_size - 1,
        target_layer_ids: None,
        num_taps: 5,
    };
    let dcfg = DrafterConfig::for_target(&cfg, &shape)?;
    let taps = dcfg.target_layer_ids().to_vec();
    let (h, heads, kvh, d) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.head_dim(),
    );
    let inter = cfg.drafter_intermediate_size();
    let n = rows * len;
    println!(
        "shape {} rows {rows} len {len} anchors {anchors} drafter layers {drafter_layers}",
        dir.display()
    );
    let ids = Tensor::randint(cfg.vocab_size - 2, [rows, len], (Kind::Int64, dev));
    let req = ForwardRequest {
        tap_layers: taps.clone(),
        final_hidden: false,
        logits: false,
    };
    let run_layers = taps.iter().max().map_or(0, |l| l + 1) as f64;
    let (fwd_host, fwd) = host_and_device_ms(dev, 5, || {
        let _ = target.run(&ids, None, &req);
    });
    let per_layer_flop = 2.0
        * n as f64
        * (h as f64 * (heads * d) as f64 * 2.0
            + h as f64 * (kvh * d) as f64 * 2.0
            + 3.0 * h as f64 * inter as f64);
    println!(
        "target forward ({run_layers} layers): {fwd:.2} ms (queued in {fwd_host:.2} ms), {:.0} TFLOP/s on the projections",
        per_layer_flop * run_layers / fwd / 1e9
    );

    // One layer's parts, each alone.
    let x = Tensor::randn([rows, len, h], (kind, dev));
    let w = |o: i64, i: i64| Tensor::randn([o, i], (kind, dev)) * 0.02;
    let (wq, wk, wv, wo) = (
        w(heads * d, h),
        w(kvh * d, h),
        w(kvh * d, h),
        w(h, heads * d),
    );
    let (wg, wu, wd) = (w(inter, h), w(inter, h), w(h, inter));
    let wqkv = Tensor::cat(&[&wq, &wk, &wv], 0);
    let wgu = Tensor::cat(&[&wg, &wu], 0);
    let norm_w = Tensor::ones([h], (kind, dev));
    let it = 20;
    let report = |name: &str, ms: f64, flop: f64| {
        if flop > 0.0 {
            println!("  {name:<28} {ms:8.3} ms  {:6.0} TFLOP/s", flop / ms / 1e9);
        } else {
            println!("  {name:<28} {ms:8.3} ms");
        }
    };
    let g = |o: i64, i: i64| 2.0 * n as f64 * o as f64 * i as f64;
    report(
        "q proj",
        time_ms(dev, it, || drop(x.linear::<&Tensor>(&wq, None))),
        g(heads * d, h),
    );
    report(
        "k proj",
        time_ms(dev, it, || drop(x.linear::<&Tensor>(&wk, None))),
        g(kvh * d, h),
    );
    report(
        "qkv fused",
        time_ms(dev, it, || drop(x.linear::<&Tensor>(&wqkv, None))),
        g((heads + 2 * kvh) * d, h),
    );
    let xo = Tensor::randn([rows, len, heads * d], (kind, dev));
    report(
        "o proj",
        time_ms(dev, it, || drop(xo.linear::<&Tensor>(&wo, None))),
        g(h, heads * d),
    );
    report(
        "gate proj",
        time_ms(dev, it, || drop(x.linear::<&Tensor>(&wg, None))),
        g(inter, h),
    );
    report(
        "gate+up fused",
        time_ms(dev, it, || drop(x.linear::<&Tensor>(&wgu, None))),
        g(2 * inter, h),
    );
    let a = Tensor::randn([rows, len, inter], (kind, dev));
    report(
        "down proj",
        time_ms(dev, it, || drop(a.linear::<&Tensor>(&wd, None))),
        g(h, inter),
    );
    report("silu(g)*u", time_ms(dev, it, || drop(a.silu() * &a)), 0.0);
    report(
        "rms_norm (ours)",
        time_ms(dev, it, || drop(rms_norm(&x, &norm_w, 1e-6))),
        0.0,
    );
    report(
        "rms_norm (aten)",
        time_ms(dev, it, || drop(x.rms_norm([h], Some(&norm_w), 1e-6))),
        0.0,
    );
    let q = Tensor::randn([rows, heads, len, d], (kind, dev));
    let k = Tensor::randn([rows, kvh, len, d], (kind, dev));
    let rope = Rope::new(&cfg, dev)?;
    let pos = Tensor::arange(len, (Kind::Int64, dev));
    let (cos, sin) = rope.cos_sin(&pos, kind);
    report(
        "rope q",
        time_ms(dev, it, || drop(Rope::apply(&q, &cos, &sin))),
        0.0,
    );
    let hn = Tensor::ones([d], (kind, dev));
    let qn = Tensor::randn([rows, len, heads, d], (kind, dev));
    report(
        "q_norm (ours)",
        time_ms(dev, it, || drop(rms_norm(&qn, &hn, 1e-6))),
        0.0,
    );
    report(
        "sdpa causal gqa",
        time_ms(dev, it, || {
            drop(Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &k,
                None::<&Tensor>,
                0.0,
                true,
                None,
                true,
            ))
        }),
        4.0 * rows as f64 * heads as f64 * (len * len) as f64 / 2.0 * d as f64,
    );
    let sdpa_out =
        Tensor::scaled_dot_product_attention(&q, &k, &k, None::<&Tensor>, 0.0, true, None, true);
    match dflash_tui::aten_ext::flash_attention(&q, &k, &k, true) {
        Ok(flash_out) => {
            let diff = (&flash_out - &sdpa_out).abs().max().double_value(&[]);
            report(
                &format!("flash causal gqa (diff {diff:.1e})"),
                time_ms(dev, it, || {
                    drop(dflash_tui::aten_ext::flash_attention(&q, &k, &k, true))
                }),
                4.0 * rows as f64 * heads as f64 * (len * len) as f64 / 2.0 * d as f64,
            );
        }
        Err(e) => println!("  flash attention refused: {e:#}"),
    }
    report("residual add", time_ms(dev, it, || drop(&x + &x)), 0.0);

    // The drafter step.
    let drafter = Drafter::init(dcfg.clone(), dev, kind, 0)?;
    let head = FrozenHead::from_target(&target, dev, kind);
    let features = target
        .run(&ids, None, &req)
        .features
        .context("no features")?;
    let mask: Vec<i64> = (0..n).map(|i| i64::from(i % len >= len / 10)).collect();
    let lengths = vec![len as usize; rows as usize];
    let host_ids: Vec<i64> = Vec::<i64>::try_from(ids.to_device(Device::Cpu).reshape([-1]))?;
    let plan = sample_anchors(&mask, &lengths, len as usize, 16, anchors, 0);
    let targets = block_targets(&host_ids, &mask, &lengths, len as usize, &plan, 16, 7.0);
    let batch = AnchorBatch {
        input_ids: ids.shallow_clone(),
        anchors: Tensor::from_slice(&plan.anchors).view([rows, plan.per_row as i64]),
        valid: Tensor::from_slice(&plan.valid).view([rows, plan.per_row as i64]),
    };
    let opts = LossOptions {
        kl_weight: 0.0,
        kl_temperature: 1.0,
        streak_alpha: 0.0,
        streak_tau_power: 0.0,
        chunk_rows: LossOptions::chunk_rows_for_vocab(cfg.vocab_size),
        kernels: None,
    };
    // the same loss with the fused kernel (cross-entropy, argmax and gradient in one kernel)
    let fused_opts = LossOptions {
        kernels: rt.fused_kernels(true, dev),
        ..opts.clone()
    };
    let params = drafter.named_parameters();
    let mut optimizer = AdamW::new(
        &params,
        dev,
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    );
    println!(
        "drafter {:.1} M parameters, {} blocks",
        drafter.parameter_count() as f64 / 1e6,
        plan.valid.iter().filter(|v| **v).count()
    );
    let positions = plan.valid.iter().filter(|v| **v).count() as f64 * 16.0;
    let dflop = 6.0 * drafter.parameter_count() as f64 * positions;
    let hflop = 4.0 * (h * cfg.vocab_size) as f64 * positions * 15.0 / 16.0;
    let fw = time_ms(dev, 3, || {
        tch::no_grad(|| drop(drafter.forward_train(&head, &features, &batch)));
    });
    println!("  drafter forward (no grad)    {fw:8.2} ms");
    // forward, then the loss and its backward through the LM head; the rest of the backward
    // is what the returned value runs
    let loss_of = |hidden: &Tensor, opts: &LossOptions| {
        let (_, pending) = loss_and_backward_deferred(
            hidden,
            &head.lm_head,
            &targets,
            &plan.valid,
            None,
            opts,
            1.0,
        );
        pending
    };
    // the whole step of a drafter: forward, loss, backward
    let step_of = |d: &Drafter, opts: &LossOptions| {
        if let Some(p) = loss_of(&d.forward_train(&head, &features, &batch), opts) {
            p.run();
        }
    };
    let forward_and_loss = || loss_of(&drafter.forward_train(&head, &features, &batch), &opts);
    let fl = time_ms(dev, 3, || drop(forward_and_loss()));
    println!("  forward + loss (head bwd)    {fl:8.2} ms");
    // the hidden states the loss alone is timed on (one forward for both losses)
    let hidden_leaf = tch::no_grad(|| drafter.forward_train(&head, &features, &batch))
        .detach()
        .set_requires_grad(true);
    for (name, o) in [("", &opts), (" fused", &fused_opts)] {
        if name == " fused" && o.kernels.is_none() {
            println!("  (no fused kernels on {dev:?})");
            continue;
        }
        let (full_host, full) = host_and_device_ms(dev, 3, || step_of(&drafter, o));
        println!(
            "  forward + loss + backward{name:<6} {full:8.2} ms  (queued in {full_host:.2} ms)  {:.0} TFLOP/s (drafter {:.1} + head {:.1} TFLOP)",
            (dflop + hflop) / full / 1e9,
            dflop / 1e12,
            hflop / 1e12
        );
        // The loss alone (LM head, log-softmax, its backward into the hidden states).
        let (loss_host, loss_ms) = host_and_device_ms(dev, 3, || {
            if let Some(p) = loss_of(&hidden_leaf, o) {
                p.run();
            }
        });
        println!(
            "  loss + its backward{name:<6}       {loss_ms:8.2} ms  (queued in {loss_host:.2} ms)  {:.0} TFLOP/s on the head",
            hflop / loss_ms / 1e9
        );
    }
    // The chunked attention of one layer alone, as the drafter calls it.
    let per_row = plan.per_row as i64;
    let cpc = TrainAttention::AUTO
        .blocks_per_chunk(
            16,
            dflash_tui::model::drafter::context_bucket(len),
            heads,
            kvh,
        )
        .unwrap_or(1);
    let chunks = (per_row + cpc - 1) / cpc;
    let qrows = cpc * 16;
    let keys = len + qrows;
    let nb = rows * chunks;
    let aq = Tensor::randn([nb, heads, qrows, d], (kind, dev)).set_requires_grad(true);
    let ak = Tensor::randn([nb, kvh, keys, d], (kind, dev)).set_requires_grad(true);
    let av = Tensor::randn([nb, kvh, keys, d], (kind, dev)).set_requires_grad(true);
    let bias = Tensor::zeros([nb, 1, qrows, (keys + 15) / 16 * 16], (kind, dev)).narrow(3, 0, keys);
    let choice = |k: &Tensor, gqa: bool| {
        Tensor::f_internal_fused_sdp_choice(&aq, k, k, Some(&bias), 0.0, false, None, gqa)
            .unwrap_or(-1)
    };
    let ake = ak
        .detach()
        .repeat_interleave_self_int(heads / kvh, 1, None)
        .set_requires_grad(true);
    println!(
        "  chunked attention: {chunks} chunks of {cpc} blocks per row; kernel (0 math, 1 flash, 2 efficient, 3 cudnn) grouped {} expanded {}",
        choice(&ak, true),
        choice(&ake, false)
    );
    let attn_flop = 4.0 * (nb * heads * qrows * keys * d) as f64 * 3.5;
    for (name, k) in [("grouped", &ak), ("expanded", &ake)] {
        let v = if name == "grouped" {
            av.shallow_clone()
        } else {
            ake.shallow_clone()
        };
        let ms = time_ms(dev, 3, || {
            let o = attention_with_bias(&aq, k, &v, &bias);
            o.sum(Kind::Float).backward();
        });
        println!(
            "  one layer's attention fwd+bwd ({name}) {ms:8.2} ms  {:.0} TFLOP/s",
            attn_flop / ms / 1e9
        );
    }
    // The whole step at other chunk sizes ($PROBE_CHUNKS: a comma-separated list).
    let sizes: Vec<usize> = std::env::var("PROBE_CHUNKS")
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![4, 8, 16, 32]);
    for c in sizes {
        let d = Drafter::init(dcfg.clone(), dev, kind, 0)?.with_train_attention(
            TrainAttention::Chunked {
                blocks_per_chunk: c,
            },
        );
        let ms = time_ms(dev, 3, || step_of(&d, &opts));
        let fused_ms = time_ms(dev, 3, || step_of(&d, &fused_opts));
        println!("  step with chunked:{c:<3}         {ms:8.2} ms  (fused loss {fused_ms:8.2} ms)");
    }
    // $PROBE_TRACE=FILE: a profiler trace of two whole steps at 64 blocks per chunk with the
    // fused loss where it loads (the recipe trains at 32), the parts in named ranges
    // (tools/trace_summary.py totals the device time per range; the backward pass runs on
    // autograd's own thread, outside them)
    if let Some(path) = std::env::var_os("PROBE_TRACE").map(std::path::PathBuf::from) {
        let d = Drafter::init(dcfg.clone(), dev, kind, 0)?.with_train_attention(
            TrainAttention::Chunked {
                blocks_per_chunk: 64,
            },
        );
        step_of(&d, &fused_opts);
        if let Device::Cuda(i) = dev {
            tch::Cuda::synchronize(i as i64);
        }
        let trace = dflash_tui::aten_ext::ProfilerTrace::start(dev.is_cuda())?;
        for _ in 0..2 {
            let hidden = {
                let _r = dflash_tui::aten_ext::ProfilerRange::new(c"drafter forward");
                d.forward_train(&head, &features, &batch)
            };
            let pending = {
                let _r = dflash_tui::aten_ext::ProfilerRange::new(c"loss");
                loss_of(&hidden, &fused_opts)
            };
            if let Some(p) = pending {
                let _r = dflash_tui::aten_ext::ProfilerRange::new(c"drafter backward");
                p.run();
            }
        }
        if let Device::Cuda(i) = dev {
            tch::Cuda::synchronize(i as i64);
        }
        trace.save(&path)?;
        println!("  trace of two steps: {}", path.display());
    }
    // the trainer's step: flatten, then clip + AdamW in one fused kernel, then the weights back
    let mut failed = None;
    let opt = time_ms(dev, 3, || {
        let mut grad = AdamW::flatten_grads(&params);
        let step = optimizer
            .update_clipped(&mut grad, 1e-6, 1.0)
            .and_then(|_| optimizer.write_params(&params));
        if let Err(e) = step {
            failed.get_or_insert(e);
        }
    });
    if let Some(e) = failed {
        return Err(e.context("optimizer step"));
    }
    println!("  optimizer (flatten+clip+adamw+write) {opt:8.2} ms");
    Ok(())
}
