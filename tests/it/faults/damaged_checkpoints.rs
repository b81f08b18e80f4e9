//! Damaged and false checkpoints: a flipped bit or a non-finite weight, a cut or lost servable
//! drafter, a false trainer state; each found, named, and resumed from the one before.

use super::*;

/// A run of 8 steps killed while it writes its checkpoint of step 6: complete checkpoints of
/// steps 2 and 4 (each with its manifest), the run unfinished.
fn killed_at_step_6(i: &common::TinyRun) -> PathBuf {
    let run_dir = i.tmp.path().join("run");
    let set = [
        "train.total_steps=8",
        "checkpoint.save_every_steps=2",
        "debug.fail_stage=checkpoint",
        "debug.fail_mode=hold-drafter",
        "debug.fail_at_step=6",
    ];
    let mut run = Run::start(&train_args(i, &run_dir, &set));
    run.wait_for("held", 1, LIMIT);
    run.kill9();
    let steps: Vec<u64> = list_checkpoints(&run_dir.join("checkpoints"))
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, [2, 4]);
    run_dir
}

fn step_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join(format!("checkpoints/step-{step:06}"))
}

/// The byte range of tensor `name` in a safetensors file's bytes.
fn tensor_bytes(file: &[u8], name: &str) -> std::ops::Range<usize> {
    let (header, meta) = safetensors::SafeTensors::read_metadata(file).unwrap();
    let (start, end) = meta.info(name).unwrap().data_offsets;
    8 + header + start..8 + header + end
}

/// A resume that stops for good at its first checkpoint from step `hold_at` on; the output up
/// to the hold (the resume's checks all lie before it).
fn resume_until_held(run_dir: &Path, hold_at: u64) -> String {
    let mut run = Run::start(&resume_holding(run_dir, Some(("hold-drafter", hold_at))));
    run.wait_for("held", 1, LIMIT);
    let out = run.lines.seen.join("\n");
    run.kill9();
    out
}

/// The fp32 tensors of a safetensors file whose names start with `prefix`, by name (prefix cut).
fn tensors(path: &Path, prefix: &str) -> Vec<(String, tch::Tensor)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, tch::Tensor)> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, view)| {
            let rest = name.strip_prefix(prefix)?.to_string();
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let t = tch::Tensor::from_data_size(view.data(), &shape, tch::Kind::Float);
            Some((rest, t))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The servable drafter of `ckpt` loads and holds its master weights in bf16.
fn drafter_is_the_master_in_bf16(ckpt: &Path) {
    let d = dflash_tui::model::Drafter::load(
        &ckpt.join("drafter"),
        tch::Device::Cpu,
        tch::Kind::BFloat16,
    )
    .unwrap();
    let master = tensors(&ckpt.join("optimizer.safetensors"), "master.");
    let mut saved: Vec<(String, &tch::Tensor)> = d.named_parameters();
    saved.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(saved.len(), master.len());
    for ((name, w), (m_name, m)) in saved.iter().zip(&master) {
        assert_eq!(name, m_name);
        assert!(
            w.equal(&m.to_kind(tch::Kind::BFloat16)),
            "{name} differs from the master weights in bf16"
        );
    }
}

#[test]
fn a_flipped_bit_or_a_non_finite_weight_in_the_newest_checkpoint_resumes_from_the_previous_one() {
    let i = common::tiny_run(32, 3);
    let run_dir = killed_at_step_6(&i);
    // One flipped bit (the exponent's highest) turns a weight of about 0.02 into about 7e36:
    // finite, so only the checksum can tell.
    let opt = step_dir(&run_dir, 4).join("optimizer.safetensors");
    let mut bytes = std::fs::read(&opt).unwrap();
    let at = tensor_bytes(&bytes, "master.fc.weight").start + 3;
    bytes[at] ^= 0x40;
    std::fs::write(&opt, &bytes).unwrap();
    let (code, out) = Run::start(&resume_holding(&run_dir, None)).finish(LIMIT);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("step-000004 fails its verification")
            && out.contains("step-000004/optimizer.safetensors: checksum (xxh3-128)"),
        "{out}"
    );
    let line = out.lines().find(|l| l.contains("resuming from")).unwrap();
    assert!(
        line.contains("step-000002 at step 2") && line.contains("1 newer failed"),
        "{line}"
    );
    // the run went on from step 2 to its end; no weight of the last checkpoint is huge
    let last = newest_checkpoint(&run_dir).unwrap();
    assert!(last.ends_with("step-000008"), "{}", last.display());
    for (name, t) in tensors(&last.join("optimizer.safetensors"), "master.") {
        let max = t.abs().max().double_value(&[]);
        assert!(max.is_finite() && max < 100.0, "{name}: max |w| = {max}");
    }
    drafter_is_the_master_in_bf16(&last);
    // A NaN in a checkpoint without a manifest (written before manifests): the finite check
    // names the tensor, and the one before is resumed from.
    std::fs::remove_file(last.join("manifest.json")).unwrap();
    let opt = last.join("optimizer.safetensors");
    let mut bytes = std::fs::read(&opt).unwrap();
    let at = tensor_bytes(&bytes, "exp_avg_sq.hidden_norm.weight").start;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&opt, &bytes).unwrap();
    let out = resume_until_held(&run_dir, 8);
    assert!(
        out.contains("no manifest.json")
            && out.contains("tensor \"exp_avg_sq.hidden_norm.weight\" holds a non-finite value"),
        "{out}"
    );
    assert!(out.contains("step-000006 at step 6"), "{out}");
    eprintln!("bit flip in step 4's optimizer state: checksum mismatch named, resumed from step 2, run finished at step 8 with finite weights (max |w| < 100); a NaN in step 8 (no manifest): tensor named, resumed from step 6");
}

#[test]
fn a_cut_or_lost_servable_drafter_is_rewritten_from_the_master_weights() {
    let i = common::tiny_run(32, 3);
    let run_dir = killed_at_step_6(&i);
    let ckpt = step_dir(&run_dir, 4);
    let model = ckpt.join("drafter/model.safetensors");
    let whole = std::fs::read(&model).unwrap();
    std::fs::write(&model, &whole[..whole.len() / 2]).unwrap();
    let out = resume_until_held(&run_dir, 6);
    assert!(out.contains("at step 4"), "{out}");
    assert!(
        out.contains(&format!(
            "drafter/model.safetensors: {} bytes expected, {} found",
            whole.len(),
            whole.len() / 2
        )) && out.contains("rewritten from the checkpoint's master weights"),
        "{out}"
    );
    drafter_is_the_master_in_bf16(&ckpt);
    assert_eq!(
        std::fs::read(&model).unwrap(),
        whole,
        "not the bytes first written"
    );
    match dflash_tui::train::manifest::verify(&ckpt).unwrap() {
        ManifestCheck::Checked { mismatches, .. } => assert!(mismatches.is_empty()),
        ManifestCheck::Absent => panic!("the manifest is gone"),
    }
    // A checkpoint of the old format (no manifest) resumes; its intact drafter is kept as is.
    std::fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let out = resume_until_held(&run_dir, 6);
    assert!(
        out.contains("no manifest.json") && out.contains("step-000004 at step 4"),
        "{out}"
    );
    assert!(!out.contains("rewritten"), "{out}");
    // Its drafter/ folder lost: rewritten too (no manifest is written for it).
    std::fs::remove_dir_all(ckpt.join("drafter")).unwrap();
    let out = resume_until_held(&run_dir, 6);
    assert!(
        out.contains("drafter/ was damaged") && out.contains("at step 4"),
        "{out}"
    );
    drafter_is_the_master_in_bf16(&ckpt);
    assert!(!ckpt.join("manifest.json").exists());
    eprintln!("servable drafter of step 4: cut in half -> rewritten byte-identical, manifest verifies; no manifest -> resumed, kept; deleted -> rewritten, equal to the master weights in bf16");
}

#[test]
fn a_false_trainer_state_is_refused_naming_the_field_and_the_one_before_resumed() {
    let i = common::tiny_run(32, 3);
    let run_dir = killed_at_step_6(&i);
    let (two, four) = (step_dir(&run_dir, 2), step_dir(&run_dir, 4));
    let original = std::fs::read(four.join("trainer_state.json")).unwrap();
    edit_state(&four, |s| s["step"] = serde_json::json!(99));
    let out = resume_until_held(&run_dir, 4);
    assert!(
        out.contains(
            "step-000004/trainer_state.json: field step = 99 does not match its folder step-000004"
        ) && out.contains("step-000002 at step 2"),
        "{out}"
    );
    assert!(!step_dir(&run_dir, 99).exists());
    std::fs::write(four.join("trainer_state.json"), &original).unwrap();
    edit_state(&four, |s| {
        s["packer"]["window_start"]["position"] = serde_json::json!(999_999_999u64)
    });
    let out = resume_until_held(&run_dir, 4);
    assert!(
        out.contains("field packer.window_start.position = 999999999 is past the data: an epoch holds 32 samples")
            && out.contains("step-000002 at step 2"),
        "{out}"
    );
    // none verifies: refused, each checkpoint named with its failure, nothing resumed
    edit_state(&two, |s| s["step"] = serde_json::json!(u64::MAX));
    let (code, out) = Run::start(&resume_holding(&run_dir, None)).finish(LIMIT);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("no checkpoint verifies")
            && out.contains("step-000004: ")
            && out.contains("field packer.window_start.position = 999999999")
            && out.contains("step-000002: ")
            && out.contains(
                "field step = 18446744073709551615 does not match its folder step-000002"
            ),
        "{out}"
    );
    assert!(!out.contains("resuming from"), "{out}");
    eprintln!("false trainer states: step 99 in step-000004 and position 999999999 each refused by field name, step 2 resumed; with step u64::MAX in step-000002 too, refused listing both");
}
