//! Drafter replicas: gradients averaged in one process, NCCL refused where it cannot work, and the
//! two-GPU NCCL run (ignored here: it needs 2 CUDA devices).

use super::*;

#[test]
fn two_drafter_replicas_average_gradients_and_learn() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=40",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
            "devices.drafter_devices=[\"cpu\", \"cpu\"]",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let st = steps(&run);
    assert_eq!(st.len(), 40);
    let first: f64 = st[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    let last: f64 = st[35..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    assert!(last < 0.7 * first, "loss {first} -> {last}");
    // devices.grad_sync = "auto" (the default) takes the copy path on CPU devices
    assert_eq!(cfg.devices.grad_sync, GradSync::Auto);
    let sync = grad_sync_events(&run);
    assert_eq!(sync.len(), 1, "{sync:?}");
    assert!(sync[0].starts_with("gradient sync: copy ("), "{sync:?}");
    assert!(sync[0].contains("the CPU"), "{sync:?}");
}

/// The messages of the `grad_sync` events (what gradient synchronisation a run uses, and why).
fn grad_sync_events(run_dir: &Path) -> Vec<String> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Event {
                kind: EventKind::GradSync,
                message,
                ..
            } => Some(message),
            _ => None,
        })
        .collect()
}

#[test]
fn nccl_gradient_sync_is_refused_before_training_where_it_cannot_work() {
    let s = setup(24);
    // "cpu" is refused when the configuration is read ...
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let e = config::load(
        &path,
        &[
            "devices.grad_sync=nccl".to_string(),
            "devices.drafter_devices=cpu,cpu".to_string(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("devices.grad_sync = \"nccl\" needs CUDA drafter devices")
            && e.contains("devices.drafter_devices[0] = \"cpu\""),
        "{e}"
    );
    // ... and "auto" devices when they resolve: to the CPU here, or twice to one GPU.
    let cfg = tiny_config(
        &s,
        &[
            "devices.grad_sync=nccl",
            "devices.drafter_devices=auto,auto",
            "train.total_steps=5",
        ],
    );
    let run = s.tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let e = match trainer::start(&TorchRuntime::init(), &cfg, &run, false) {
        Ok(h) => {
            h.abort();
            panic!(
                "the run started: {:?}",
                join_within(h, Duration::from_secs(60))
            );
        }
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.starts_with("config: devices.grad_sync = \"nccl\" needs")
            && e.contains("devices.drafter_devices[")
            && e.contains("\"auto\""),
        "{e}"
    );
    // nothing was written: the configuration was refused before the run started
    assert!(!run.join("metrics.jsonl").exists());
}

/// `cargo test --release -- --ignored nccl` on a machine with two GPUs: two replicas whose
/// gradients are summed and weights handed back by NCCL learn like the copy path, and a pause,
/// a resume and a stop in the middle of training end cleanly.
#[test]
#[ignore = "needs 2 CUDA devices and libnccl"]
fn nccl_two_gpu_replicas_learn_pause_and_stop_cleanly() {
    let runtime = TorchRuntime::init();
    assert!(
        runtime.cuda_devices() >= 2,
        "this test needs 2 CUDA devices ({} usable)",
        runtime.cuda_devices()
    );
    let s = setup(24);
    let run = |sync: &str, dtype: &str, dir: &str| {
        let cfg = tiny_config(
            &s,
            &[
                "train.total_steps=40",
                "train.lr=1e-2",
                "checkpoint.save_every_steps=0",
                "devices.target_devices=cuda:0",
                "devices.drafter_devices=cuda:0,cuda:1",
                &format!("devices.grad_sync={sync}"),
                &format!("model.dtype={dtype}"),
            ],
        );
        let run = s.tmp.path().join(dir);
        let out = join_within(start(&cfg, &run, false), Duration::from_secs(300));
        assert_eq!(
            out.phase,
            Phase::Finished,
            "{sync} {dtype}: {:?}",
            out.error
        );
        let events = grad_sync_events(&run);
        assert_eq!(events.len(), 1, "{events:?}");
        assert!(
            events[0].starts_with(&format!("gradient sync: {sync} (")),
            "{events:?}"
        );
        let st = steps(&run);
        assert_eq!(st.len(), 40);
        let first: f64 = st[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
        let last: f64 = st[35..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
        eprintln!("{sync} {dtype}: loss {first:.3} -> {last:.3}");
        assert!(last < 0.7 * first, "{sync} {dtype}: loss {first} -> {last}");
    };
    run("nccl", "f32", "nccl-f32");
    run("nccl", "bf16", "nccl-bf16");
    run("copy", "bf16", "copy-bf16");

    // pause, resume and stop between and during collectives
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=100000",
            "checkpoint.save_every_steps=0",
            "devices.target_devices=cuda:0",
            "devices.drafter_devices=cuda:0,cuda:1",
            "devices.grad_sync=nccl",
        ],
    );
    let dir = s.tmp.path().join("nccl-stop");
    let h = start(&cfg, &dir, false);
    wait_for(&h, "step 5", Duration::from_secs(120), |h| {
        h.snapshot().step >= 5
    });
    h.command(&Command::Pause).unwrap();
    wait_for(
        &h,
        "the pause to take hold",
        Duration::from_secs(120),
        |h| h.snapshot().phase == Phase::Paused,
    );
    h.command(&Command::Resume).unwrap();
    let at = h.snapshot().step;
    wait_for(&h, "progress after resume", Duration::from_secs(120), |h| {
        h.snapshot().step >= at + 3
    });
    h.command(&Command::Stop { checkpoint: true }).unwrap();
    let out = join_within(h, Duration::from_secs(120));
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert!(out.last_checkpoint.is_some());
}
