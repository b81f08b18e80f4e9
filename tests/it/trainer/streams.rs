//! `devices.concurrent_target`: a target sharing its GPU with the drafter runs its forwards on
//! a stream of its own (ignored here: it needs a CUDA device).

use super::*;

/// `cargo test --release --test it -- --ignored concurrent_target` on a GPU: with the target
/// on a side stream the drafter trains on the same features as with one stream. The first
/// step's loss (the initial weights on the first batch) is the same bit for bit: the drafter's
/// stream waited for the forward that made its features. Later steps agree to float32
/// rounding (the GPU's backward passes may add in another order from run to run).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_concurrent_target_trains_on_the_same_features_as_one_stream() {
    let runtime = TorchRuntime::init();
    assert!(runtime.cuda_devices() >= 1, "this test needs a CUDA device");
    let s = setup(24);
    let run = |concurrent: bool| {
        let cfg = tiny_config(
            &s,
            &[
                "train.total_steps=30",
                "train.lr=1e-2",
                "model.dtype=f32",
                "checkpoint.save_every_steps=0",
                "devices.target_devices=cuda:0",
                "devices.drafter_devices=cuda:0",
                "pipeline.feature_queue_depth=4",
                &format!("devices.concurrent_target={concurrent}"),
            ],
        );
        let dir = s.tmp.path().join(format!("concurrent-{concurrent}"));
        let out = join_within(start(&cfg, &dir, false), Duration::from_secs(300));
        assert_eq!(out.phase, Phase::Finished, "{concurrent}: {:?}", out.error);
        steps(&dir)
    };
    let (side, one) = (run(true), run(false));
    assert_eq!(side.len(), 30);
    assert_eq!(one.len(), 30);
    assert_eq!(side[0].loss.to_bits(), one[0].loss.to_bits(), "{side:?}");
    for (a, b) in side.iter().zip(&one) {
        assert_eq!(a.step, b.step);
        let tol = 1e-3 * b.loss.abs().max(1.0);
        assert!(
            (a.loss - b.loss).abs() <= tol,
            "step {}: loss {} with the side stream, {} with one",
            a.step,
            a.loss,
            b.loss
        );
    }
    let mean = |st: &[StepRecord]| st.iter().map(|r| r.loss).sum::<f64>() / st.len() as f64;
    assert!(mean(&side[25..]) < 0.7 * mean(&side[..5]));
}
