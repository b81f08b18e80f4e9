//! Speculative decoding with a DFlash drafter is lossless: its output equals plain greedy
//! decoding token for token, and its step accounting is consistent.

mod common;

use common::tiny_target_dir;
use dflash_tui::eval::speculative::{dflash, evaluate, greedy};
use dflash_tui::model::{Drafter, DrafterConfig, DrafterShape, FrozenHead, TargetModel};
use tch::{Device, Kind};

fn models(block: i64) -> (tempfile::TempDir, TargetModel, Drafter, FrozenHead) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("t"), "qwen3", false, None, 21);
    let target = TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let config = DrafterConfig::for_target(
        &target.config,
        &DrafterShape {
            layers: 1,
            block_size: block,
            mask_token_id: 1,
            target_layer_ids: None,
            num_taps: 2,
        },
    )
    .unwrap();
    let drafter = Drafter::init(config, Device::Cpu, Kind::Float, 3).unwrap();
    let head = FrozenHead::from_target(&target, Device::Cpu, Kind::Float);
    (tmp, target, drafter, head)
}

#[test]
fn dflash_output_equals_greedy_decoding() {
    let (_tmp, target, drafter, head) = models(4);
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 13], vec![2, 4, 8, 16, 32, 11, 7], vec![40]];
    for p in &prompts {
        let plain = tch::no_grad(|| greedy(&target, p, 30, &[])).unwrap();
        let fast = tch::no_grad(|| dflash(&target, &drafter, &head, p, 30, &[])).unwrap();
        assert_eq!(plain.output_ids.len(), 30);
        assert_eq!(fast.output_ids, plain.output_ids, "prompt {p:?}");
        // each step emits a + 1 tokens after the prefill's first one
        let emitted: usize = fast.accept_lengths.iter().sum();
        assert!(
            1 + emitted >= 30 && emitted < 30 + 4,
            "{:?}",
            fast.accept_lengths
        );
        assert!(fast.accept_lengths.iter().all(|&a| (1..=4).contains(&a)));
    }
    // an EOS stops both the same way
    let p = &prompts[1];
    let plain = tch::no_grad(|| greedy(&target, p, 30, &[])).unwrap();
    let eos = plain.output_ids[6];
    let with_eos = tch::no_grad(|| greedy(&target, p, 30, &[eos])).unwrap();
    let fast = tch::no_grad(|| dflash(&target, &drafter, &head, p, 30, &[eos])).unwrap();
    assert_eq!(fast.output_ids, with_eos.output_ids);
    assert_eq!(fast.output_ids.last(), Some(&eos));

    let report = evaluate(&target, &drafter, &head, &prompts, 20, &[]).unwrap();
    assert_eq!(report.mismatches, 0);
    assert!(report.tau >= 1.0 && report.tau <= 4.0);
    let steps: usize = report.prompts.iter().map(|p| p.accept_lengths.len()).sum();
    assert_eq!(report.accepted_by_slot[0], steps as u64);
    assert!(
        report.accepted_by_slot.windows(2).all(|w| w[0] >= w[1]),
        "a slot is only accepted after the ones before it"
    );
}

#[test]
fn eval_command_prints_json_with_tau_speedup_and_outputs() {
    let (tmp, target, drafter, _head) = models(4);
    let _ = target;
    let target_dir = tmp.path().join("t");
    let drafter_dir = drafter.save(&tmp.path().join("d")).unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [5, 9, 13]}\n\n{\"prompt_ids\": [40, 2]}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args([
            "eval",
            "--device",
            "cpu",
            "--max-new-tokens",
            "12",
            "--json",
            "--target",
        ])
        .arg(&target_dir)
        .arg("--drafter")
        .arg(&drafter_dir)
        .arg("--prompts")
        .arg(&prompts)
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mismatches"], 0);
    let tau = v["tau"].as_f64().unwrap();
    assert!((1.0..=4.0).contains(&tau), "{tau}");
    assert!(v["speedup"].as_f64().unwrap() > 0.0);
    let ps = v["prompts"].as_array().unwrap();
    assert_eq!(ps.len(), 2);
    for p in ps {
        // 12 tokens, or fewer ending with the tiny target's EOS (id 2, from its config.json)
        let ids = p["output_ids"].as_array().unwrap();
        assert!(
            ids.len() == 12 || (ids.len() < 12 && ids.last() == Some(&2.into())),
            "{ids:?}"
        );
        assert!(!p["accept_lengths"].as_array().unwrap().is_empty());
    }
    // a bad prompts file names the line
    std::fs::write(&prompts, "{\"prompt_ids\": [5]}\n{\"nothing\": 1}\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(["eval", "--device", "cpu", "--target"])
        .arg(&target_dir)
        .arg("--drafter")
        .arg(&drafter_dir)
        .arg("--prompts")
        .arg(&prompts)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prompts.jsonl: line 2"), "{err}");
}
