//! Failures and storms: a failing stage, failing checkpoints, random commands; each run ends cleanly
//! with its last good checkpoint.

use super::*;

#[test]
fn a_failing_stage_stops_cleanly_and_keeps_the_last_checkpoint() {
    // The loader runs ahead of training by the queue depths: it fails at a later batch.
    for (stage, at) in [("target", 12), ("drafter", 8), ("loader", 24)] {
        let s = setup(24);
        let cfg = tiny_config(
            &s,
            &[
                "train.total_steps=1000",
                "checkpoint.save_every_steps=3",
                &format!("debug.fail_at_step={at}"),
                &format!("debug.fail_stage={stage}"),
            ],
        );
        let run = s.tmp.path().join("run");
        let out = join_within(start(&cfg, &run, false), Duration::from_secs(120));
        assert_eq!(out.phase, Phase::Failed, "{stage}");
        let err = out.error.unwrap();
        assert!(
            err.contains("injected failure") && err.contains(stage),
            "{err}"
        );
        let latest = dflash_tui::train::checkpoint::latest_checkpoint(&run).unwrap();
        let state = dflash_tui::train::checkpoint::read_state(&latest).unwrap();
        assert!(
            state.step >= 3 && state.step.is_multiple_of(3),
            "{stage}: {state:?}"
        );
        dflash_tui::model::Drafter::load(
            &latest.join("drafter"),
            tch::Device::Cpu,
            tch::Kind::Float,
        )
        .unwrap();
    }
}

#[test]
fn a_failed_checkpoint_keeps_the_previous_one_and_training_goes_on() {
    // Two checkpoints fail (a full disk after the drafter is written): the run goes on, the
    // previous checkpoint stays, the checkpoint is tried again 1 and then 2 steps later and
    // works on the third try.
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=14",
            "checkpoint.save_every_steps=4",
            "debug.fail_at_step=6",
            "debug.fail_stage=checkpoint",
            "debug.fail_count=2",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(120));
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
    assert_eq!(out.steps, 14);
    let failed = checkpoint_events(&run, EventKind::CheckpointFailed);
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed[0].contains("step 8")
            && failed[0].contains("No space left on device")
            && failed[0].contains("previous checkpoint is kept")
            && failed[0].contains("tried again at step 9"),
        "{failed:?}"
    );
    assert!(failed[1].contains("tried again at step 11"), "{failed:?}");
    let saved = checkpoint_events(&run, EventKind::Checkpoint);
    assert!(
        saved.iter().any(|m| m.contains("(retry) at step 11")),
        "{saved:?}"
    );
    let latest = dflash_tui::train::checkpoint::latest_checkpoint(&run).unwrap();
    assert!(latest.ends_with("step-000014"), "{}", latest.display());
    let leftovers: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_final_checkpoint_that_fails_fails_the_run_and_keeps_the_previous_one() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=10",
            "checkpoint.save_every_steps=4",
            "debug.fail_at_step=6",
            "debug.fail_stage=checkpoint",
        ],
    );
    let run = s.tmp.path().join("run");
    let out = join_within(start(&cfg, &run, false), Duration::from_secs(120));
    assert_eq!(out.phase, Phase::Failed);
    let err = out.error.unwrap();
    assert!(
        err.contains("No space left on device")
            && err.contains("the final checkpoint failed")
            && err.contains("step-000004"),
        "{err}"
    );
    let latest = dflash_tui::train::checkpoint::latest_checkpoint(&run).unwrap();
    assert!(latest.ends_with("step-000004"), "{}", latest.display());
    // and the run resumes from it
    let out = join_within(
        start(&cfg_without_faults(&s), &run, true),
        Duration::from_secs(120),
    );
    assert_eq!(out.phase, Phase::Finished, "{:?}", out.error);
}

fn cfg_without_faults(s: &Setup) -> TrainConfig {
    tiny_config(
        s,
        &["train.total_steps=10", "checkpoint.save_every_steps=4"],
    )
}

#[test]
fn a_storm_of_random_commands_ends_without_deadlock() {
    let s = setup(24);
    let cfg = tiny_config(
        &s,
        &[
            "train.total_steps=1000000",
            "checkpoint.save_every_steps=0",
            "checkpoint.keep_checkpoints=2",
        ],
    );
    let run = s.tmp.path().join("run");
    let h = start(&cfg, &run, false);
    let mut rng = common::Lcg(99);
    let t = Instant::now();
    let mut sent = 0;
    while t.elapsed() < Duration::from_secs(30) {
        let cmd = match rng.next_u32() % 9 {
            0 | 1 => Command::Pause,
            2 | 3 => Command::Resume,
            4 => Command::Queue {
                name: QueueName::Batch,
                depth: 1 + (rng.next_u32() % 6) as usize,
            },
            5 => Command::Queue {
                name: QueueName::Feature,
                depth: 1 + (rng.next_u32() % 6) as usize,
            },
            6 => Command::Checkpoint,
            7 => Command::Profile {
                seconds: (rng.next_u32() % 3) as f64,
            },
            // refused (a queue name that is none is refused as the command is parsed)
            _ => Command::Queue {
                name: QueueName::Batch,
                depth: 0,
            },
        };
        let _ = h.command(&cmd);
        if rng.next_u32().is_multiple_of(10) {
            let _ = h.profile_report();
            let _ = h.snapshot();
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis((rng.next_u32() % 20) as u64));
    }
    assert!(h.snapshot().step > 0, "training advanced during the storm");
    h.command(&Command::Stop { checkpoint: true }).unwrap();
    let out = join_within(h, Duration::from_secs(60));
    assert_eq!(out.phase, Phase::Stopped, "{:?}", out.error);
    assert!(sent > 500);
}
