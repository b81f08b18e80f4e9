//! `dflash-tui bench` on the cpu-tiny profile (the real pipeline on a random tiny target and
//! the demo chat data): every field of the benchmarks spec, consistent with each other; and
//! random-initialised targets of a shape.

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use dflash_tui::model::TargetModel;
use tch::{Device, Kind};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .arg("bench")
        .args(args)
        .current_dir(root())
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn cpu_tiny_bench_reports_every_field_consistently() {
    common::require_demo(&common::demo_dir().join("sharegpt-smollm2"));
    // (with a profiler trace: one run checks both)
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace.json");
    let pipeline_trace = tmp.path().join("pipeline.json");
    let out = bench(&[
        "--profile",
        "cpu-tiny",
        "--warmup-steps",
        "2",
        "--steps",
        "4",
        "--trace",
        trace.to_str().unwrap(),
        "--trace-pipeline",
        pipeline_trace.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "tokens_per_s",
        "samples_per_s",
        "draft_positions_per_s",
        "step_ms",
        "stage_busy",
        "gpu_util",
        "gpu_clocks",
        "mfu",
        "pipeline_efficiency",
        "peak_mem_gb",
    ] {
        assert!(r.get(field).is_some(), "missing {field}: {r}");
    }
    let f = |k: &str| r[k].as_f64().unwrap();
    let window = f("window_s");
    assert!(window > 0.0);
    // rates are the window's counts over its duration
    assert!(
        (f("tokens_per_s") - r["tokens"].as_f64().unwrap() / window).abs()
            < 1e-6 * f("tokens_per_s")
    );
    assert!(
        (f("samples_per_s") - r["samples"].as_f64().unwrap() / window).abs()
            < 1e-6 * f("samples_per_s").max(1.0)
    );
    // 16 positions per trained block; 4 sequences of 32 anchors at most per step
    let blocks = r["draft_blocks"].as_f64().unwrap();
    assert!(
        (f("draft_positions_per_s") - blocks * 16.0 / window).abs()
            < 1e-6 * f("draft_positions_per_s")
    );
    assert!(blocks > 0.0 && blocks <= 4.0 * 4.0 * 32.0, "{blocks}");
    assert!((f("step_ms") - window * 1e3 / 4.0).abs() < 1e-6 * f("step_ms"));
    // at most budget 1024 tokens per step
    assert!(r["tokens"].as_u64().unwrap() <= 4 * 1024);
    for stage in ["loader", "target", "drafter"] {
        let busy = r["stage_busy"][stage].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&busy), "{stage}: {busy}");
        assert!(r["stage_alone_tokens_per_s"][stage].as_f64().unwrap() > 0.0);
    }
    // efficiency against the slowest stage alone; target and drafter share the CPU here, so
    // they count together, one after the other
    let alone = r["stage_alone_tokens_per_s"].as_object().unwrap();
    let rate = |k: &str| alone[k].as_f64().unwrap();
    let both = 1.0 / (1.0 / rate("target") + 1.0 / rate("drafter"));
    assert!((rate("target+drafter") - both).abs() < 1e-9 * both);
    assert_eq!(r["slowest_stage"], "target+drafter");
    // host time per profiled event over the window
    let steps = &r["profile_ms"]["step.total"];
    // (the two snapshots are taken as the window's first and last steps end, give or take one)
    assert!((3..=5).contains(&steps[1].as_u64().unwrap()), "{steps}");
    assert!(steps[0].as_f64().unwrap() > 0.0);
    let slowest = alone
        .values()
        .map(|v| v.as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    assert!((f("pipeline_efficiency") - f("tokens_per_s") / slowest).abs() < 1e-9);
    assert_eq!(
        alone[r["slowest_stage"].as_str().unwrap()]
            .as_f64()
            .unwrap(),
        slowest
    );
    // on the CPU there is no peak FLOP rate, no NVML reading and no CUDA allocator
    assert!(r["mfu"].is_null());
    assert_eq!(r["allocator"], serde_json::json!({}));
    assert_eq!(r["gpu_clocks"], serde_json::json!({}));
    // the pipeline's trace was taken after the window (2 more steps) and written whole
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&pipeline_trace).unwrap()).unwrap();
    assert!(written["traceEvents"].is_array(), "{written}");
    assert!(f("model_flops_per_s") > 0.0);
    drafter_parts_add_up(&r);
    trace_holds_the_traced_steps(&trace);
}

/// The drafter alone, per step: each part timed (host clock on the CPU), their sum within the
/// stage's own time.
fn drafter_parts_add_up(r: &serde_json::Value) {
    let ms = &r["drafter_step_ms"];
    let part = |k: &str| ms[k].as_f64().unwrap();
    assert_eq!(ms["clock"], "host", "{ms}");
    assert_eq!(ms["steps"], 4, "{ms}");
    let parts = [
        "anchors",
        "forward",
        "loss",
        "backward",
        "grad_sync",
        "optimizer",
    ];
    for k in &parts[1..] {
        assert!(part(k) > 0.0, "{k}: {ms}");
    }
    let sum: f64 = parts.iter().map(|k| part(k)).sum();
    assert!((part("total") - sum).abs() < 1e-9 * sum, "{ms}");
    assert!((part("forward_over_backward") - part("forward") / part("backward")).abs() < 1e-9);
    // the parts are inside the stage's timed steps (the measured window's batches): those take
    // at least their sum
    let rate = r["stage_alone_tokens_per_s"]["drafter"].as_f64().unwrap();
    let stage_ms = 1e3 * r["tokens"].as_f64().unwrap() / rate;
    assert!(
        4.0 * sum <= stage_ms * 1.001,
        "{sum} ms x 4 > {stage_ms} ms"
    );
}

/// `tools/trace_summary.py TRACE --json ARGS`'s object.
fn trace_summary(trace: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new("python3")
        .arg(root().join("tools/trace_summary.py"))
        .arg(trace)
        .arg("--json")
        .args(args)
        .output()
        .expect("python3 (make setup needs it too)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The trace: the two steps (the default --trace-steps) and their parts as named ranges, the
/// operators inside them, and tools/trace_summary.py's totals per range.
fn trace_holds_the_traced_steps(trace: &std::path::Path) {
    let ranges = common::trace_events(trace, "user_annotation");
    let count = |name: &str| ranges.iter().filter(|e| e["name"] == name).count();
    assert_eq!(count("training step"), 2, "{ranges:?}");
    for part in [
        "drafter.forward",
        "drafter.loss",
        "drafter.backward",
        "optim.step",
    ] {
        assert_eq!(count(part), 2, "{part}");
    }
    let ops = common::trace_events(trace, "cpu_op");
    assert!(ops.iter().filter(|e| e["name"] == "aten::mm").count() > 10);
    let s = trace_summary(trace, &[]);
    let stages = &s["stages"];
    let host = |k: &str| stages[k]["host_ms"].as_f64().unwrap();
    for part in ["drafter.forward", "drafter.loss", "drafter.backward"] {
        let own = stages[part]["cpu_self_ms"].as_f64().unwrap();
        // the operators' own time is inside the range's time, and most of it
        assert!(
            own > 0.0 && own <= host(part) * 1.001,
            "{part}: {}",
            stages[part]
        );
        assert!(!stages[part]["top_cpu_ops"].as_array().unwrap().is_empty());
    }
    let parts: f64 = [
        "drafter.forward",
        "drafter.loss",
        "drafter.backward",
        "optim.step",
    ]
    .iter()
    .map(|k| host(k))
    .sum();
    assert!(parts <= host("training step") * 1.001, "{stages}");
}

/// `trace_summary.py --gaps` on a trace of two threads: a kernel, 200 us of idle device while
/// one thread waits in a synchronisation and the other launches the next kernel late, then a
/// gap the next kernel (the other thread's) was queued for before it began.
#[test]
fn trace_summary_puts_the_device_gaps_down_to_the_threads() {
    let kernel = |ts: f64, dur: f64, corr: i64| {
        serde_json::json!({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7,
            "ts": ts, "dur": dur, "args": {"correlation": corr}})
    };
    let call = |tid: i64, name: &str, ts: f64, dur: f64, corr: i64| {
        serde_json::json!({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid,
            "ts": ts, "dur": dur, "args": {"correlation": corr}})
    };
    let name = |tid: i64, n: &str| {
        serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
            "args": {"name": n}})
    };
    let events = serde_json::json!({"traceEvents": [
        name(11, "drafter"), name(12, "coordinator"),
        call(11, "cudaLaunchKernel", 0.0, 5.0, 1), kernel(10.0, 90.0, 1),
        call(12, "cudaEventSynchronize", 90.0, 170.0, 50),
        call(11, "cudaLaunchKernel", 250.0, 6.0, 2), kernel(300.0, 100.0, 2),
        call(12, "cudaLaunchKernel", 260.0, 6.0, 3), kernel(430.0, 10.0, 3),
        call(11, "cudaLaunchKernel", 270.0, 6.0, 4), kernel(440.0, 10.0, 4),
    ]});
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("two-threads.json");
    std::fs::write(&path, events.to_string()).unwrap();
    let s = trace_summary(&path, &["--gaps", "--gap-us", "20"]);
    let g = &s["gaps"];
    // 100..300 and 400..430; 440 follows 430..440 without a gap
    assert_eq!(g["gaps"], 2, "{g}");
    assert!((g["idle_ms"].as_f64().unwrap() - 0.230).abs() < 1e-9, "{g}");
    let ended = &g["ended_by"];
    let late = &ended["launched during the gap by drafter 11"];
    assert_eq!(late["gaps"], 1, "{g}");
    assert!((late["ms"].as_f64().unwrap() - 0.2).abs() < 1e-9, "{g}");
    let early = &ended["launched before the gap by coordinator 12"];
    assert_eq!(early["gaps"], 1, "{g}");
    let during: Vec<(String, f64)> = g["runtime_during"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap().to_owned(),
                r["ms"].as_f64().unwrap(),
            )
        })
        .collect();
    let ms = |n: &str| during.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
    // the synchronisation covers 100..260 of the first gap; the launches 250..256, 270..276
    // (drafter) and 260..266 (coordinator)
    assert!((ms("coordinator 12: cudaEventSynchronize").unwrap() - 0.160).abs() < 1e-9);
    assert!((ms("drafter 11: cudaLaunchKernel").unwrap() - 0.012).abs() < 1e-9);
    assert!((ms("coordinator 12: cudaLaunchKernel").unwrap() - 0.006).abs() < 1e-9);
    // the third kernel is the coordinator's: two switches between threads
    let by_thread = &g["device_ms_by_thread"];
    assert!(
        (by_thread["drafter 11"].as_f64().unwrap() - 0.2).abs() < 1e-9,
        "{g}"
    );
    assert!((by_thread["coordinator 12"].as_f64().unwrap() - 0.01).abs() < 1e-9);
    assert_eq!(g["thread_switches"], 2, "{g}");
}

#[test]
fn bench_rejects_unknown_profiles_and_zero_steps() {
    let out = bench(&["--profile", "nonesuch"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("configs/bench-nonesuch.toml"), "{err}");
    assert!(err.contains("qwen3-8b-shape"), "{err}");
    let out = bench(&["--profile", "cpu-tiny", "--steps", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--steps"));
    // a trace into a folder that does not exist, or of no step: refused before anything runs
    let out = bench(&["--profile", "cpu-tiny", "--trace", "no/such/trace.json"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no/such/trace.json") && err.contains("does not exist"),
        "{err}"
    );
    let out = bench(&["--trace", "t.json", "--trace-steps", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--trace-steps"));
    let out = bench(&["--trace-pipeline", "no/such/p.json"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no/such/p.json"));
}

#[test]
fn random_targets_of_a_shape_are_seeded_and_run() {
    let dir = root().join("configs/shapes/tiny-llama");
    let rng = crate::common::torch_rng();
    let a = TargetModel::random(&dir, Device::Cpu, Kind::Float, 7).unwrap();
    let b = TargetModel::random(&dir, Device::Cpu, Kind::Float, 7).unwrap();
    let c = TargetModel::random(&dir, Device::Cpu, Kind::Float, 8).unwrap();
    drop(rng);
    assert_eq!(a.config.vocab_size, 49152);
    let ids = tch::Tensor::from_slice(&[1i64, 500, 9000, 49151]).unsqueeze(0);
    let (la, lb, lc) = (
        a.forward(&ids, None),
        b.forward(&ids, None),
        c.forward(&ids, None),
    );
    assert!(la.isfinite().all().int64_value(&[]) == 1);
    assert_eq!(
        f64::try_from((&la - &lb).abs().max()).unwrap(),
        0.0,
        "same seed, same model"
    );
    assert!(
        f64::try_from((&la - &lc).abs().max()).unwrap() > 0.0,
        "another seed, another model"
    );
    // the shape files of the published models parse
    for shape in ["qwen3-0.6b", "qwen3-8b"] {
        let c = dflash_tui::model::TargetConfig::from_model_dir(
            &root().join("configs/shapes").join(shape),
        )
        .unwrap();
        assert_eq!(c.vocab_size, 151936);
        assert!(151669 < c.vocab_size, "the bench mask token has a row");
    }
}

#[test]
fn bench_forward_times_a_hybrid_target_with_every_hidden_state() {
    let target = root().join("tests/fixtures/qwen35_targets/conditional");
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("forward.json");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(["bench-forward", "--target"])
        .arg(&target)
        .args(["--tokens", "24", "--batch", "2", "--dtype", "f32"])
        .args(["--iters", "2", "--random-weights", "--device", "cpu"])
        .args(["--gdn-prefill", "chunked", "--trace"])
        .arg(&trace)
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        r["model"],
        "qwen3_5_text (Qwen3.5 hybrid): 2 Gated DeltaNet + 2 gated attention layers"
    );
    // every layer run, and a hidden state back from each
    assert_eq!(
        (r["layers_run"].as_u64(), r["hidden_states"].as_u64()),
        (Some(4), Some(4))
    );
    assert_eq!(
        (r["device"].as_str(), r["dtype"].as_str()),
        (Some("cpu"), Some("f32"))
    );
    let seconds: Vec<f64> = r["seconds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_f64().unwrap())
        .collect();
    assert_eq!(seconds.len(), 2);
    let best = r["best_s"].as_f64().unwrap();
    assert_eq!(best, seconds.iter().copied().fold(f64::INFINITY, f64::min));
    let f = |k: &str| r[k].as_f64().unwrap();
    assert!((f("tokens_per_s") - 48.0 / best).abs() < 1e-9 * f("tokens_per_s"));
    // the fixture's 4 layers (hidden 32, ffn 64, 2 heads of 32 / 1 kv; GDN 4 value / 2 key heads
    // of 8, conv 4), by hand: MLP 6,144; gated attention 32*128 + 2*32*32 + 64*32 = 8,192 +
    // 6,144; Gated DeltaNet 32*64 + 32*32 + 2*32*4 + 64*4 + 32*32 = 4,608 (rule 6*4*8*8 =
    // 1,536 FLOPs per token) + 6,144.
    let per_token = 2.0 * (2.0 * 14_336.0 + 2.0 * 10_752.0) + 2.0 * 1536.0;
    assert!((f("forward_tflop") * 1e12 - 48.0 * per_token).abs() < 1e-3);
    assert!((f("tflop_per_s") - f("forward_tflop") / best).abs() < 1e-9 * f("tflop_per_s"));
    assert!(r["peak_mem_gb"].is_null());
    assert_eq!(r["gdn_prefill"], "chunked");
    // the traced extra call: a Chrome trace naming the forward's operators
    let events: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let names: Vec<&str> = events["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(
        names.contains(&"aten::mm") || names.contains(&"aten::matmul"),
        "{names:?}"
    );
}
