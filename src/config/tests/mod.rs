use std::path::{Path, PathBuf};

use super::*;

mod validation;

/// The smallest file that validates: the three required fields.
const MINIMAL: &str = r#"
[model]
target = "models/target"
mask_token_id = 3

[data]
path = "data/set"
"#;

fn minimal(overrides: &[&str]) -> Result<TrainConfig> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    from_toml_str(MINIMAL, "test.toml", &overrides)
}

fn err_text(r: Result<TrainConfig>) -> String {
    match r {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => format!("{e:#}"),
    }
}

/// A valid configuration with one field changed, and the validation message it gives.
fn invalid(change: impl FnOnce(&mut TrainConfig)) -> String {
    let mut c = minimal(&[]).expect("minimal config");
    change(&mut c);
    match c.validate() {
        Ok(()) => panic!("expected a validation error for {c:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn defaults() {
    let c = TrainConfig::default();
    assert_eq!(c.run.name, "dflash");
    assert_eq!(c.run.runs_dir, None);
    assert_eq!(c.run.seed, 0);
    assert_eq!(c.model.target, "");
    assert_eq!(c.model.drafter_init, None);
    assert_eq!(c.model.drafter_layers, 5);
    assert_eq!(c.model.block_size, 16);
    assert_eq!(c.model.mask_token_id, -1);
    assert!(c.model.target_layer_ids.is_empty());
    assert_eq!(c.model.num_taps, 5);
    assert_eq!(c.model.dtype, Dtype::Auto);
    assert_eq!(c.data.path, "");
    assert_eq!(c.data.split, "train");
    assert_eq!(c.data.input_ids_column, "input_ids");
    assert_eq!(c.data.loss_mask_column, "loss_mask");
    assert_eq!(
        (
            c.data.max_len,
            c.data.token_budget,
            c.data.max_batch,
            c.data.bucket_window
        ),
        (3072, 8192, 64, 1024)
    );
    let t = &c.train;
    assert_eq!(
        (t.total_steps, t.epochs, t.num_anchors, t.grad_accum),
        (0, 6.0, 512, 1)
    );
    assert_eq!((t.lr, t.beta1, t.beta2, t.eps), (6e-4, 0.9, 0.999, 1e-8));
    assert_eq!(
        (t.weight_decay, t.warmup_ratio, t.min_lr_ratio),
        (0.0, 0.04, 0.0)
    );
    assert_eq!((t.clip_grad_norm, t.loss_decay_gamma), (1.0, 0.0));
    assert_eq!(
        (
            t.kl_weight,
            t.kl_temperature,
            t.streak_alpha,
            t.streak_tau_power
        ),
        (0.0, 1.0, 0.0, 0.0)
    );
    assert_eq!(c.devices.target_devices, vec![DeviceSpec::Auto]);
    assert_eq!(c.devices.drafter_devices, vec![DeviceSpec::Auto]);
    assert_eq!(c.devices.grad_sync, GradSync::Auto);
    assert_eq!(
        (c.pipeline.batch_queue_depth, c.pipeline.feature_queue_depth),
        (4, 2)
    );
    assert_eq!(c.checkpoint.save_every_steps, 500);
    assert_eq!(c.checkpoint.save_every_minutes, 30.0);
    assert_eq!(c.checkpoint.keep_checkpoints, 3);
    let v = &c.validation;
    assert_eq!((v.every_steps, v.split.as_str()), (0, "validation"));
    assert_eq!((v.sequences, v.max_new_tokens, v.patience), (64, 128, 0));
    assert_eq!(c.telemetry.log_every_steps, 10);
    assert_eq!(c.telemetry.profile_interval_s, 30.0);
    assert_eq!(c.telemetry.gpu_sample_interval_s, 1.0);
    assert_eq!(c.debug.fail_at_step, 0);
    assert_eq!(c.debug.fail_stage, FailStage::Drafter);

    // Missing sections and fields take their defaults.
    let m = minimal(&[]).unwrap();
    let mut expected = TrainConfig::default();
    expected.model.target = "models/target".into();
    expected.model.mask_token_id = 3;
    expected.data.path = "data/set".into();
    assert_eq!(m, expected);
}

#[test]
fn defaults_alone_need_the_required_fields() {
    let e = TrainConfig::default().validate().unwrap_err().to_string();
    assert!(e.contains("model.target is required"), "{e}");
    let e = err_text(from_toml_str("", "empty.toml", &[]));
    assert!(e.contains("model.target is required"), "{e}");
}

#[test]
fn effective_gamma() {
    let mut t = TrainSection::default();
    assert_eq!(t.effective_gamma(16), 7.0);
    assert_eq!(t.effective_gamma(10), 5.0);
    assert_eq!(t.effective_gamma(8), 4.0);
    assert_eq!(t.effective_gamma(4), 1.75);
    assert_eq!(t.effective_gamma(32), 14.0);
    t.loss_decay_gamma = 2.5;
    assert_eq!(t.effective_gamma(16), 2.5);
}

#[test]
fn unknown_field_is_rejected_with_its_name() {
    let text = format!("{MINIMAL}\n[train]\nlr = 1e-4\nlearning_rate = 1e-4\n");
    let e = err_text(from_toml_str(&text, "cfg.toml", &[]));
    assert!(e.contains("cfg.toml"), "{e}");
    assert!(e.contains("learning_rate"), "{e}");
    assert!(e.contains("train"), "{e}");
    assert!(e.contains("line 11"), "{e}");

    let text = format!("{MINIMAL}\n[trian]\nlr = 1e-4\n");
    let e = err_text(from_toml_str(&text, "cfg.toml", &[]));
    assert!(e.contains("trian"), "{e}");
}

#[test]
fn wrong_type_names_the_field() {
    let text = format!("{MINIMAL}\n[train]\nlr = \"fast\"\n");
    let e = err_text(from_toml_str(&text, "cfg.toml", &[]));
    assert!(e.contains("cfg.toml"), "{e}");
    assert!(e.contains("train.lr"), "{e}");
    assert!(e.contains("line 10"), "{e}");

    let e = err_text(minimal(&["data.max_len=-5"]));
    assert!(e.contains("override `data.max_len=-5`"), "{e}");
    assert!(e.contains("data.max_len"), "{e}");

    // Two bad values: the position is that of the field the message names.
    let text = format!("{MINIMAL}\n[train]\nlr = \"a\"\nbeta1 = \"b\"\n");
    let e = err_text(from_toml_str(&text, "cfg.toml", &[]));
    let line = if e.contains("train.lr") {
        "line 10"
    } else {
        "line 11"
    };
    assert!(e.contains(line), "{e}");
}

#[test]
fn invalid_toml_names_the_file_and_position() {
    let e = err_text(from_toml_str("[model]\ntarget = \n", "broken.toml", &[]));
    assert!(e.contains("broken.toml is not valid TOML"), "{e}");
    assert!(e.contains("line 2"), "{e}");
}

#[test]
fn missing_file_is_named() {
    let e = load(Path::new("/nonexistent/dflash/cfg.toml"), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/dflash/cfg.toml"), "{e}");
    assert!(e.contains("cannot read"), "{e}");
}

#[test]
fn load_reads_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, MINIMAL).unwrap();
    let c = load(&path, &["run.seed=7".to_string()]).unwrap();
    assert_eq!(c.run.seed, 7);
    assert_eq!(c.model.target, "models/target");
}

#[test]
fn overrides_of_numbers_strings_and_arrays() {
    let c = minimal(&[
        "train.lr=1e-4",
        "train.epochs=2",
        "train.total_steps = 100",
        "model.block_size=8",
        "run.name=foo",
        "run.runs_dir=\"/tmp/my runs\"",
        "model.dtype=bf16",
        "devices.drafter_devices=[\"cpu\",\"cpu\"]",
        "devices.target_devices=cuda:0,cuda:1",
        "model.target_layer_ids=[1, 8, 15]",
        "checkpoint.save_every_minutes=0",
        "data.loss_mask_column=",
    ])
    .unwrap();
    assert_eq!(c.train.lr, 1e-4);
    assert_eq!(c.train.epochs, 2.0);
    assert_eq!(c.train.total_steps, 100);
    assert_eq!(c.model.block_size, 8);
    assert_eq!(c.run.name, "foo");
    assert_eq!(c.run.runs_dir, Some(PathBuf::from("/tmp/my runs")));
    assert_eq!(c.model.dtype, Dtype::Bf16);
    assert_eq!(
        c.devices.drafter_devices,
        vec![DeviceSpec::Cpu, DeviceSpec::Cpu]
    );
    assert_eq!(
        c.devices.target_devices,
        vec![DeviceSpec::Cuda(0), DeviceSpec::Cuda(1)]
    );
    assert_eq!(c.model.target_layer_ids, vec![1, 8, 15]);
    assert_eq!(c.checkpoint.save_every_minutes, 0.0);
    assert_eq!(c.data.loss_mask_column, "");

    // Strings are taken literally, lists also comma-separated, later overrides win.
    let c = minimal(&[
        "run.name=123",
        "model.target_layer_ids=2,9",
        "model.target=a=b",
        "train.lr=0.5",
        "train.lr=0.25",
    ])
    .unwrap();
    assert_eq!(c.run.name, "123");
    assert_eq!(c.model.target_layer_ids, vec![2, 9]);
    assert_eq!(c.model.target, "a=b");
    assert_eq!(c.train.lr, 0.25);

    // The required fields can come from overrides alone.
    let c = from_toml_str(
        "",
        "empty.toml",
        &[
            "model.target=t".to_string(),
            "model.mask_token_id=0".to_string(),
            "data.path=d".to_string(),
            "model.target_layer_ids=".to_string(),
        ],
    )
    .unwrap();
    assert_eq!(c.model.target, "t");
    assert!(c.model.target_layer_ids.is_empty());
}

#[test]
fn validation_section_errors_name_the_field() {
    let text = format!("{MINIMAL}\n[validation]\nevery_steps = 10\nsequences = \"many\"\n");
    let e = err_text(from_toml_str(&text, "v.toml", &[]));
    assert!(e.contains("validation.sequences"), "{e}");
    assert!(e.contains("v.toml (line"), "{e}");
    let text = format!("{MINIMAL}\n[validation]\nevery_step = 10\n");
    let e = err_text(from_toml_str(&text, "v.toml", &[]));
    assert!(e.contains("unknown field `every_step`"), "{e}");
    let e = err_text(minimal(&["validation.max_new_tokens=0"]));
    assert_eq!(
        e,
        "config: validation.max_new_tokens = 0 is out of range (must be between 1 and 65536)"
    );
    let c = minimal(&["validation.every_steps=50", "validation.patience=4"]).unwrap();
    assert_eq!((c.validation.every_steps, c.validation.patience), (50, 4));
}

#[test]
fn unknown_override_key_is_rejected() {
    let e = err_text(minimal(&["train.learning_rate=1e-4"]));
    assert!(e.contains("train.learning_rate"), "{e}");
    assert!(e.contains("lr"), "{e}");
    assert!(e.contains("warmup_ratio"), "{e}");
    assert!(e.contains("streak_alpha"), "{e}");

    let e = err_text(minimal(&["trainer.lr=1e-4"]));
    assert!(e.contains("trainer.lr"), "{e}");
    assert!(e.contains("telemetry"), "{e}");

    let e = err_text(minimal(&["lr=1e-4"]));
    assert!(e.contains("`lr`"), "{e}");
    assert!(e.contains("section.field"), "{e}");

    let e = err_text(minimal(&["train.lr"]));
    assert!(e.contains("key=value"), "{e}");

    let e = err_text(minimal(&["train.lr.x=1"]));
    assert!(e.contains("train.lr.x"), "{e}");
}

#[test]
fn round_trip() {
    let mut c = minimal(&[
        "train.lr=3e-3",
        "train.eps=1e-12",
        "train.warmup_ratio=0.1",
        "model.target_layer_ids=[1,4,7]",
        "devices.drafter_devices=[\"cuda:0\",\"cuda:1\"]",
        "devices.grad_sync=nccl",
        "run.name=round \"trip\"",
        "run.seed=12345",
    ])
    .unwrap();
    c.train.kl_temperature = 0.1 + 0.2;
    c.checkpoint.save_every_minutes = 1.0 / 3.0;
    let text = c.to_toml_string().unwrap();
    for section in [
        "[run]",
        "[model]",
        "[data]",
        "[train]",
        "[devices]",
        "[pipeline]",
        "[checkpoint]",
        "[eval]",
        "[validation]",
        "[telemetry]",
        "[debug]",
    ] {
        assert!(text.contains(section), "{section} missing in\n{text}");
    }
    assert!(text.contains("drafter_init = \"\""), "{text}");
    assert!(text.contains("min_lr_ratio = 0"), "{text}");
    assert!(text.contains("grad_sync = \"nccl\""), "{text}");
    let back = from_toml_str(&text, "resolved.toml", &[]).unwrap();
    assert_eq!(back, c);

    let mut tiny = TrainConfig::default();
    tiny.model.target = "t".into();
    tiny.model.mask_token_id = 0;
    tiny.data.path = "d".into();
    let back = from_toml_str(&tiny.to_toml_string().unwrap(), "x", &[]).unwrap();
    assert_eq!(back, tiny);
}

/// Every field of every section, as the defaults' TOML table lists them.
fn all_fields() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (section, fields) in schema().unwrap() {
        let fields = fields.as_table().expect("section table").clone();
        for field in fields.keys() {
            out.push((section.clone(), field.clone()));
        }
    }
    out
}

#[test]
fn shipped_configs_parse_validate_and_list_every_field() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    for name in ["tiny.toml", "demo-cpu.toml", "gpu-smollm2.toml"] {
        let path = dir.join(name);
        let c = load(&path, &[]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let text = std::fs::read_to_string(&path).unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap();
        for (section, field) in all_fields() {
            let present = table
                .get(&section)
                .and_then(|s| s.as_table())
                .is_some_and(|s| s.contains_key(&field));
            assert!(present, "{name}: {section}.{field} is not written out");
        }
        assert_eq!(c.debug.fail_at_step, 0, "{name}");
    }

    let tiny = load(&dir.join("tiny.toml"), &[]).unwrap();
    assert_eq!(tiny.run.name, "tiny");
    assert_eq!(tiny.model.target, "tests/tiny-target");
    assert_eq!(
        (
            tiny.model.drafter_layers,
            tiny.model.block_size,
            tiny.model.mask_token_id
        ),
        (1, 4, 1)
    );
    assert_eq!((tiny.model.num_taps, tiny.model.dtype.as_str()), (2, "f32"));
    assert_eq!(tiny.data.path, "tests/tiny-data");
    assert_eq!(
        (
            tiny.data.max_len,
            tiny.data.token_budget,
            tiny.data.max_batch,
            tiny.data.bucket_window
        ),
        (64, 256, 8, 64)
    );
    assert_eq!((tiny.train.total_steps, tiny.train.num_anchors), (30, 8));
    assert_eq!((tiny.train.lr, tiny.train.warmup_ratio), (3e-3, 0.1));
    assert_eq!(tiny.devices.target_devices, vec![DeviceSpec::Cpu]);
    assert_eq!(tiny.devices.drafter_devices, vec![DeviceSpec::Cpu]);
    assert_eq!(tiny.devices.grad_sync, GradSync::Auto);
    assert_eq!(tiny.checkpoint.save_every_steps, 10);
    assert_eq!(tiny.checkpoint.save_every_minutes, 0.0);
    assert_eq!(tiny.telemetry.log_every_steps, 5);
    assert_eq!(tiny.telemetry.profile_interval_s, 5.0);

    let demo = load(&dir.join("demo-cpu.toml"), &[]).unwrap();
    assert_eq!(demo.model.target, "assets/demo/SmolLM2-135M-Instruct");
    assert_eq!(demo.data.path, "assets/demo/sharegpt-smollm2");
    assert_eq!(demo.model.mask_token_id, 16);
    assert_eq!((demo.model.drafter_layers, demo.model.block_size), (2, 16));
    // the CPU demo must stay small enough to show progress within a minute
    assert!(demo.data.max_len <= 512 && demo.train.num_anchors <= 32);
    assert_eq!(demo.devices.drafter_devices, vec![DeviceSpec::Cpu]);
    assert_eq!(
        (
            demo.checkpoint.save_every_steps,
            demo.checkpoint.save_every_minutes
        ),
        (200, 10.0)
    );
    assert_eq!(demo.telemetry.log_every_steps, 1);
    // validation on, measuring as far into the answers as the periodic eval decodes
    assert_eq!(demo.validation.every_steps, 100);
    assert_eq!(demo.validation.max_new_tokens, demo.eval.max_new_tokens);

    let gpu = load(&dir.join("gpu-smollm2.toml"), &[]).unwrap();
    assert_eq!(gpu.model.mask_token_id, 16);
    assert_eq!(
        (gpu.model.drafter_layers, gpu.model.dtype.as_str()),
        (5, "auto")
    );
    assert_eq!(
        (gpu.data.max_len, gpu.data.token_budget, gpu.data.max_batch),
        (3072, 16384, 16)
    );
    assert_eq!((gpu.train.total_steps, gpu.train.epochs), (0, 1.0));
    assert_eq!(gpu.devices.target_devices, vec![DeviceSpec::Cuda(0)]);
    assert_eq!(gpu.devices.drafter_devices, vec![DeviceSpec::Cuda(0)]);
    assert_eq!(gpu.devices.grad_sync, GradSync::Auto);
    assert_eq!(
        (gpu.validation.every_steps, gpu.validation.sequences),
        (100, 64)
    );
    assert_eq!(gpu.validation.max_new_tokens, gpu.eval.max_new_tokens);

    // Tests point the tiny config at their own files.
    let c = load(
        &dir.join("tiny.toml"),
        &[
            "model.target=/tmp/t".to_string(),
            "data.path=/tmp/d".to_string(),
        ],
    )
    .unwrap();
    assert_eq!(
        (c.model.target.as_str(), c.data.path.as_str()),
        ("/tmp/t", "/tmp/d")
    );
}

#[test]
fn every_shipped_config_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            if let Err(e) = super::load(&path, &[]) {
                panic!("{}: {e:#}", path.display());
            }
            seen += 1;
        }
    }
    assert!(seen >= 8, "{seen} configs");
}

#[test]
fn a_resume_may_change_paths_devices_and_measurement_not_the_model_or_the_data_stream() {
    let base = minimal(&[]).unwrap();
    let with = |sets: &[&str]| minimal(sets).unwrap();
    let changes = super::resume_changes(
        &base,
        &with(&[
            "model.block_size=8",
            "data.token_budget=4096",
            "train.num_anchors=7",
            "train.total_steps=99",
            "train.lr=1e-4",
            "data.path=elsewhere",
            "eval.every_steps=7",
            "pipeline.batch_queue_depth=9",
        ]),
    );
    let names = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|l| l.split(':').next().unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(
        names(&changes.refused),
        ["data.token_budget", "model.block_size", "train.num_anchors"]
    );
    assert_eq!(names(&changes.schedule), ["train.lr", "train.total_steps"]);
    assert_eq!(
        names(&changes.free),
        [
            "data.path",
            "eval.every_steps",
            "pipeline.batch_queue_depth"
        ]
    );
    assert!(
        changes.refused[1].contains("model.block_size: 16 -> 8"),
        "{:?}",
        changes.refused
    );
    let same = super::resume_changes(&base, &base);
    assert!(same.refused.is_empty() && same.schedule.is_empty() && same.free.is_empty());
}
