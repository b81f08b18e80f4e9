//! Periodic evaluation and validation during training: tau, the best drafter, patience, and the
//! training attention's formulations on the demo data.

use super::*;

#[test]
fn periodic_evaluation_records_tau_and_keeps_the_best_drafter() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=35",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
            "eval.every_steps=10",
            "eval.prompts=3",
            "eval.max_new_tokens=9",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    let out = join_within(h, Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    let evals: Vec<_> = read_metrics(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Eval(e) => Some(e),
            _ => None,
        })
        .collect();
    // every 10 steps, and the last weights at the end of the run
    assert_eq!(
        evals.iter().map(|e| e.step).collect::<Vec<_>>(),
        vec![10, 20, 30, 35]
    );
    let block = cfg.model.block_size as u64;
    for e in &evals {
        assert_eq!(e.prompts, 3);
        assert_eq!(e.accepted_by_slot.len() as u64, block);
        // every step takes the bonus token; the slots sum to the accepted tokens
        assert_eq!(e.accepted_by_slot[0], e.decode_steps);
        let accepted: u64 = e.accepted_by_slot.iter().sum();
        assert!((e.tau - accepted as f64 / e.decode_steps as f64).abs() < 1e-9);
        assert!(e.tau >= 1.0 && e.tau <= block as f64);
        // 9 tokens per prompt: the prefill's first plus at least one per step
        assert!(e.generated_tokens <= 27 && e.decode_steps >= 3);
    }
    // "best" marks each new maximum; best/ holds the drafter of the highest tau
    let mut best = f64::NEG_INFINITY;
    for e in &evals {
        assert_eq!(e.best, e.tau > best, "step {}", e.step);
        best = best.max(e.tau);
    }
    let top = evals.iter().rfind(|e| e.best).unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/eval.json")).unwrap())
            .unwrap();
    assert_eq!(saved["step"], top.step);
    assert!((saved["tau"].as_f64().unwrap() - top.tau).abs() < 1e-12);
    let target = dflash_tui::model::TargetConfig::from_model_dir(&s.target).unwrap();
    dflash_tui::model::Drafter::load_for_target(
        &run.join("best/drafter"),
        &target,
        tch::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap();
}

#[test]
fn validation_records_the_walk_tau_and_keeps_the_best_drafter() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=20",
            "train.lr=1e-2",
            "checkpoint.save_every_steps=0",
            "eval.every_steps=10",
            "eval.prompts=2",
            "eval.max_new_tokens=9",
            "validation.every_steps=4",
            "validation.sequences=5",
            "validation.max_new_tokens=16",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    wait_for(&h, "the end of the run", Duration::from_secs(240), |h| {
        h.is_finished()
    });
    // The passes are the drafter worker's time: rows of their own in ProfileStats.
    let report = h.profile_report();
    let count = |e: &str| {
        let row = report.rows.iter().find(|r| r.event.name() == e);
        row.map_or(0, |r| r.cumulative.count)
    };
    assert_eq!((count("validation.pass"), count("eval.pass")), (6, 2));
    let out = join_within(h, Duration::from_secs(60));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    assert_eq!(out.stop_reason, None);
    let vals = validations(&run);
    // every 4 steps and at every evaluation (10, 20)
    assert_eq!(
        vals.iter().map(|v| v.step).collect::<Vec<_>>(),
        vec![4, 8, 10, 12, 16, 20]
    );
    let block = cfg.model.block_size as f64;
    let mut best = f64::NEG_INFINITY;
    for v in &vals {
        assert_eq!(v.sequences, 5);
        assert!(v.answers >= 5 && v.answer_steps >= v.answers, "{v:?}");
        assert!(v.loss.is_finite() && v.loss > 0.0, "{v:?}");
        assert!((0.0..=1.0).contains(&v.accuracy), "{v:?}");
        assert!((1.0..=block).contains(&v.accept_mean), "{v:?}");
        assert!((1.0..=block).contains(&v.tau), "{v:?}");
        assert_eq!(v.tau, v.tokens as f64 / v.answer_steps as f64);
        // at most 16 tokens into each answer
        assert!(v.tokens <= 16 * v.answers, "{v:?}");
        assert_eq!(v.best, v.tau > best, "step {}", v.step);
        best = best.max(v.tau);
    }
    // with validation on, best/ follows the walk tau, not the decoded one
    let evals: Vec<_> = records(&run, |r| match r {
        MetricsRecord::Eval(e) => Some(e),
        _ => None,
    });
    assert_eq!(
        evals.iter().map(|e| e.step).collect::<Vec<_>>(),
        vec![10, 20]
    );
    assert!(evals.iter().all(|e| !e.best));
    let top = vals.iter().rfind(|v| v.best).unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/eval.json")).unwrap())
            .unwrap();
    assert_eq!(saved["rule"], "validation_walk_tau");
    assert_eq!(saved["step"], top.step);
    assert_eq!(saved["sequences"], 5);
    assert!((saved["tau"].as_f64().unwrap() - top.tau).abs() < 1e-12);
    // the log line says what was measured
    let events: Vec<String> = records(&run, |r| match r {
        MetricsRecord::Event {
            kind: EventKind::Validation,
            message,
            ..
        } => Some(message),
        _ => None,
    });
    assert_eq!(events.len(), vals.len());
    assert!(
        events[0].starts_with("validation at step 4: loss ") && events[0].contains("tau(walk)"),
        "{}",
        events[0]
    );
}

#[test]
fn patience_stops_a_run_that_no_longer_improves_with_a_checkpoint() {
    // A learning rate too small to move an fp32 weight: every pass measures the same tau, so
    // after the first (the best) two more without a new best end the run at step 6 of 200.
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=200",
            "train.lr=1e-12",
            "checkpoint.save_every_steps=0",
            "validation.every_steps=2",
            "validation.sequences=3",
            "validation.patience=2",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(240));
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert_eq!(out.steps, 6);
    let reason = out.stop_reason.clone().unwrap();
    assert!(
        reason.starts_with("early stop at step 6: no new best validation tau in 2 passes"),
        "{reason}"
    );
    assert!(reason.contains("validation.patience = 2"), "{reason}");
    let ckpt = out.last_checkpoint.unwrap();
    assert!(ckpt.ends_with("step-000006"), "{}", ckpt.display());
    assert_eq!(
        std::fs::read_link(run.join("checkpoints/latest")).unwrap(),
        PathBuf::from("step-000006")
    );
    let vals = validations(&run);
    assert_eq!(
        vals.iter().map(|v| (v.step, v.best)).collect::<Vec<_>>(),
        vec![(2, true), (4, false), (6, false)]
    );
    let summary = records(&run, |r| match r {
        MetricsRecord::Summary {
            phase, stop_reason, ..
        } => Some((phase, stop_reason)),
        _ => None,
    });
    assert_eq!(summary, vec![(Phase::Stopped, Some(reason.clone()))]);
    let early: Vec<String> = records(&run, |r| match r {
        MetricsRecord::Event {
            kind: EventKind::EarlyStop,
            message,
            ..
        } => Some(message),
        _ => None,
    });
    assert_eq!(early, vec![reason]);
}

#[test]
fn chunked_and_dense_attention_give_the_same_loss_curve_on_the_demo_data() {
    // The real SmolLM2 target on the demo chat data, 50 steps with each exact formulation of
    // the training attention (same seeds, same batches, same anchors).
    let data = common::require_demo(&common::demo_dir().join("sharegpt-smollm2"));
    let target = common::require_demo(&common::demo_dir().join("SmolLM2-135M-Instruct"));
    let tmp = tempfile::tempdir().unwrap();
    let run = |attention: &str| -> Vec<StepRecord> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/demo-cpu.toml");
        let cfg = config::load(
            &path,
            &[
                format!("model.target={}", target.display()),
                format!("data.path={}", data.display()),
                "train.total_steps=50".into(),
                "checkpoint.save_every_steps=0".into(),
                "eval.every_steps=0".into(),
                "validation.every_steps=0".into(),
                format!("train.attention={attention}"),
            ],
        )
        .unwrap();
        let dir = tmp.path().join(attention.replace(':', "-"));
        let out = join_within(start(&cfg, &dir, false), Duration::from_secs(900));
        assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
        steps(&dir)
    };
    // the two runs side by side: independent trainers, and this test is often the suite's last
    let (dense, chunked) = std::thread::scope(|s| {
        let dense = s.spawn(|| run("dense"));
        let chunked = s.spawn(|| run("chunked:2"));
        (dense.join(), chunked.join())
    });
    let (dense, chunked) = (
        dense.expect("the dense run"),
        chunked.expect("the chunked run"),
    );
    assert_eq!(dense.len(), 50);
    assert_eq!(chunked.len(), 50);
    let mut worst = 0.0f64;
    for (d, c) in dense.iter().zip(&chunked) {
        assert_eq!(d.tokens, c.tokens, "same batches");
        assert_eq!(d.blocks, c.blocks, "same anchors");
        let rel = (d.loss - c.loss).abs() / d.loss.abs();
        worst = worst.max(rel);
        assert!(
            rel < 1e-3,
            "step {}: loss {} (dense) vs {} (chunked)",
            d.step,
            d.loss,
            c.loss
        );
    }
    eprintln!(
        "loss {:.4} -> {:.4} (dense), {:.4} -> {:.4} (chunked); largest relative difference {worst:.2e}",
        dense[0].loss, dense[49].loss, chunked[0].loss, chunked[49].loss
    );
    assert!(dense[49].loss < dense[0].loss, "it learns");
}
