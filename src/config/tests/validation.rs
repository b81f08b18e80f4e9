//! Range checks: every refused value is named with its field, the first problem wins, and edge
//! values pass.

use super::*;

type Change = Box<dyn FnOnce(&mut TrainConfig)>;

/// Each change alone makes a valid configuration invalid, with a message naming `expected`.
fn assert_refused(cases: Vec<(&str, Change)>) {
    for (expected, change) in cases {
        let e = invalid(change);
        assert!(e.starts_with("config: "), "{e}");
        assert!(e.contains(expected), "expected {expected:?} in {e:?}");
    }
}

#[test]
fn overrides_are_validated() {
    let e = err_text(minimal(&["train.lr=2"]));
    assert!(e.contains("train.lr = 2 is out of range"), "{e}");
}

#[test]
fn validation_errors_name_their_field() {
    let e = invalid(|c| c.train.lr = -1.0);
    assert_eq!(
        e,
        "config: train.lr = -1 is out of range (must be > 0 and <= 1)"
    );
    let e = invalid(|c| c.model.target.clear());
    assert_eq!(
        e,
        "config: model.target is required (a Hugging Face model folder)"
    );

    assert_refused(vec![
        ("run.name", Box::new(|c| c.run.name = "a/b".into())),
        (
            "model.drafter_layers = 0",
            Box::new(|c| c.model.drafter_layers = 0),
        ),
        (
            "model.drafter_layers = 65",
            Box::new(|c| c.model.drafter_layers = 65),
        ),
        (
            "model.drafter_added_layers = 64",
            Box::new(|c| {
                c.model.drafter_init = Some("d".into());
                c.model.drafter_added_layers = 64
            }),
        ),
        (
            "model.drafter_added_layers = 2 needs model.drafter_init",
            Box::new(|c| c.model.drafter_added_layers = 2),
        ),
        ("model.block_size = 1", Box::new(|c| c.model.block_size = 1)),
        (
            "model.mask_token_id = -1",
            Box::new(|c| c.model.mask_token_id = -1),
        ),
        ("model.num_taps = 17", Box::new(|c| c.model.num_taps = 17)),
        ("data.path is required", Box::new(|c| c.data.path.clear())),
        ("data.max_len = 7", Box::new(|c| c.data.max_len = 7)),
        (
            "data.token_budget = 0",
            Box::new(|c| c.data.token_budget = 0),
        ),
        ("data.max_batch = 0", Box::new(|c| c.data.max_batch = 0)),
        (
            "data.bucket_window = 0",
            Box::new(|c| c.data.bucket_window = 0),
        ),
        ("train.epochs = 0", Box::new(|c| c.train.epochs = 0.0)),
        (
            "train.epochs = NaN",
            Box::new(|c| c.train.epochs = f64::NAN),
        ),
        (
            "train.num_anchors = 0",
            Box::new(|c| c.train.num_anchors = 0),
        ),
        (
            "train.grad_accum = 1025",
            Box::new(|c| c.train.grad_accum = 1025),
        ),
        ("train.beta1 = 1", Box::new(|c| c.train.beta1 = 1.0)),
        ("train.beta2 = -0.1", Box::new(|c| c.train.beta2 = -0.1)),
        ("train.eps = 0", Box::new(|c| c.train.eps = 0.0)),
        (
            "train.weight_decay = -1",
            Box::new(|c| c.train.weight_decay = -1.0),
        ),
        (
            "train.warmup_ratio = 1",
            Box::new(|c| c.train.warmup_ratio = 1.0),
        ),
        (
            "train.min_lr_ratio = 1.5",
            Box::new(|c| c.train.min_lr_ratio = 1.5),
        ),
        (
            "train.clip_grad_norm = -1",
            Box::new(|c| c.train.clip_grad_norm = -1.0),
        ),
        (
            "train.loss_decay_gamma = -2",
            Box::new(|c| c.train.loss_decay_gamma = -2.0),
        ),
        ("train.kl_weight = 2", Box::new(|c| c.train.kl_weight = 2.0)),
        (
            "train.kl_temperature = 0",
            Box::new(|c| c.train.kl_temperature = 0.0),
        ),
        (
            "train.streak_alpha = inf",
            Box::new(|c| c.train.streak_alpha = f64::INFINITY),
        ),
        (
            "train.streak_tau_power = 3",
            Box::new(|c| {
                c.train.streak_alpha = 0.1;
                c.train.streak_tau_power = 3.0
            }),
        ),
        (
            "train.streak_tau_power = 2 has no effect",
            Box::new(|c| c.train.streak_tau_power = 2.0),
        ),
    ]);
}

#[test]
fn validation_errors_of_devices_and_stages_name_their_field() {
    assert_refused(vec![
        (
            "devices.target_devices is empty",
            Box::new(|c| c.devices.target_devices.clear()),
        ),
        (
            "pipeline.batch_queue_depth = 0",
            Box::new(|c| c.pipeline.batch_queue_depth = 0),
        ),
        (
            "pipeline.feature_queue_depth = 2000",
            Box::new(|c| c.pipeline.feature_queue_depth = 2000),
        ),
        (
            "checkpoint.save_every_minutes = -1",
            Box::new(|c| c.checkpoint.save_every_minutes = -1.0),
        ),
        (
            "checkpoint.keep_checkpoints = 0",
            Box::new(|c| c.checkpoint.keep_checkpoints = 0),
        ),
        (
            "validation.split is required",
            Box::new(|c| c.validation.split = " ".into()),
        ),
        (
            "validation.sequences = 0",
            Box::new(|c| c.validation.sequences = 0),
        ),
        (
            "validation.max_new_tokens = 0",
            Box::new(|c| c.validation.max_new_tokens = 0),
        ),
        (
            "validation.patience = 3 needs validation.every_steps > 0",
            Box::new(|c| c.validation.patience = 3),
        ),
        (
            "telemetry.log_every_steps = 0",
            Box::new(|c| c.telemetry.log_every_steps = 0),
        ),
        (
            "telemetry.profile_interval_s = -1",
            Box::new(|c| c.telemetry.profile_interval_s = -1.0),
        ),
        (
            "telemetry.gpu_sample_interval_s = 0",
            Box::new(|c| c.telemetry.gpu_sample_interval_s = 0.0),
        ),
    ]);
}

/// Every setting that sizes memory has a finite upper bound, named in the message with the
/// allowed range: a typo is refused before anything is allocated (data.bucket_window = 2^40
/// passed and ended the process in an allocation of 8 TiB).
#[test]
fn settings_that_size_memory_are_bounded() {
    let e = err_text(minimal(&["data.bucket_window=1099511627776"]));
    assert_eq!(
        e,
        "config: data.bucket_window = 1099511627776 is out of range (must be between 1 and 1048576)"
    );
    assert_refused(vec![
        (
            "data.max_len = 1048577 is out of range (must be between 8 and 1048576)",
            Box::new(|c| c.data.max_len = (1 << 20) + 1),
        ),
        (
            "data.token_budget = 16777217 is out of range (must be between 1 and 16777216)",
            Box::new(|c| c.data.token_budget = (1 << 24) + 1),
        ),
        (
            "data.max_batch = 65537 is out of range (must be between 1 and 65536)",
            Box::new(|c| c.data.max_batch = 65_537),
        ),
        (
            "train.num_anchors = 18446744073709551615 is out of range (must be between 1 and 1048576)",
            Box::new(|c| c.train.num_anchors = usize::MAX),
        ),
        (
            "eval.prompts = 100001 is out of range (must be between 1 and 100000)",
            Box::new(|c| c.eval.prompts = 100_001),
        ),
        (
            "validation.sequences = 100001 is out of range (must be between 1 and 100000)",
            Box::new(|c| c.validation.sequences = 100_001),
        ),
        (
            "model.target_layer_ids lists 17 layers (must list at most 16",
            Box::new(|c| c.model.target_layer_ids = (1..=17).collect()),
        ),
    ]);
    // the upper edges pass
    let c = minimal(&[
        "data.max_len=1048576",
        "data.token_budget=16777216",
        "data.max_batch=65536",
        "data.bucket_window=1048576",
        "train.num_anchors=1048576",
        "eval.prompts=100000",
        "validation.sequences=100000",
        "model.drafter_layers=64",
    ]);
    assert!(c.is_ok(), "{c:?}");
}

/// A word that is none of a setting's values cannot be put into a [`TrainConfig`] (the
/// settings are enums): it is refused as the configuration is read, naming the field.
#[test]
fn bad_words_name_their_field() {
    for (set, expected) in [
        ("model.dtype=f16", "model.dtype = \"f16\""),
        ("devices.grad_sync=mpi", "devices.grad_sync = \"mpi\""),
        (
            "debug.fail_stage=optimizer",
            "debug.fail_stage = \"optimizer\"",
        ),
        ("debug.fail_mode=hold", "debug.fail_mode = \"hold\""),
    ] {
        let e = err_text(minimal(&[set]));
        assert!(e.starts_with("config: "), "{e}");
        assert!(e.contains(expected), "expected {expected:?} in {e:?}");
    }
    let e = err_text(from_toml_str(
        &format!("{MINIMAL}\n[debug]\nfail_stage = \"optimizer\"\n"),
        "test.toml",
        &[],
    ));
    assert_eq!(
        e,
        "config: debug.fail_stage = \"optimizer\" is not allowed (must be one of loader, target, \
         drafter, checkpoint)"
    );
}

#[test]
fn grad_sync_values() {
    for value in ["auto", "nccl", "copy"] {
        let c = minimal(&[
            &format!("devices.grad_sync={value}"),
            "devices.drafter_devices=cuda:0,cuda:1",
        ])
        .unwrap();
        assert_eq!(c.devices.grad_sync, value.parse().unwrap());
    }
    // "copy" and "auto" work with any devices
    for value in ["auto", "copy"] {
        let c = minimal(&[
            &format!("devices.grad_sync=\"{value}\""),
            "devices.drafter_devices=[\"cpu\", \"cpu\"]",
        ]);
        assert!(c.is_ok(), "{c:?}");
    }

    let e = err_text(minimal(&["devices.grad_sync=NCCL"]));
    assert_eq!(
        e,
        "config: devices.grad_sync = \"NCCL\" is not allowed (must be one of auto, nccl, copy)"
    );
    let e = err_text(minimal(&["devices.grad_sync=5"]));
    assert!(e.contains("devices.grad_sync = \"5\""), "{e}");
    let e = err_text(from_toml_str(
        &format!("{MINIMAL}\n[devices]\ngrad_sync = true\n"),
        "test.toml",
        &[],
    ));
    assert!(
        e.contains("devices.grad_sync") && e.contains("test.toml"),
        "{e}"
    );

    // NCCL runs between GPUs: a CPU drafter device is refused before anything loads.
    let e = err_text(minimal(&[
        "devices.grad_sync=nccl",
        "devices.drafter_devices=cuda:0,cpu",
    ]));
    assert_eq!(
        e,
        "config: devices.grad_sync = \"nccl\" needs CUDA drafter devices, but \
         devices.drafter_devices[1] = \"cpu\" (use \"copy\" or \"auto\")"
    );
    let e = invalid(|c| {
        c.devices.grad_sync = GradSync::Nccl;
        c.devices.drafter_devices = vec![DeviceSpec::Cpu];
    });
    assert!(e.contains("devices.grad_sync") && e.contains("cpu"), "{e}");
}

#[test]
fn device_words_are_read_with_the_file_and_named() {
    for (set, expected) in [
        (
            "devices.drafter_devices=cpu,gpu",
            "config: devices.drafter_devices[1] = \"gpu\" is not a device (must be auto, cpu, cuda or cuda:N)",
        ),
        (
            "devices.target_devices=[\"cuda:x\"]",
            "config: devices.target_devices[0] = \"cuda:x\" is not a device (must be auto, cpu, cuda or cuda:N)",
        ),
        (
            "devices.target_devices=[0]",
            "config: devices.target_devices[0] = 0 is not a device (must be auto, cpu, cuda or cuda:N)",
        ),
    ] {
        assert_eq!(err_text(minimal(&[set])), expected, "{set}");
    }
    // A field that is not a list is named by serde, with the file.
    let e = err_text(from_toml_str(
        &format!("{MINIMAL}\n[devices]\ntarget_devices = \"cuda:0\"\n"),
        "test.toml",
        &[],
    ));
    assert!(
        e.contains("devices.target_devices") && e.contains("test.toml"),
        "{e}"
    );
    // Written back as the same words.
    let c = minimal(&["devices.drafter_devices=[\" cuda \", \"cuda:1\"]"]).unwrap();
    assert_eq!(
        c.devices.drafter_devices,
        [DeviceSpec::Cuda(0), DeviceSpec::Cuda(1)]
    );
    let text = c.to_toml_string().unwrap();
    assert!(
        text.contains("drafter_devices = [\"cuda:0\", \"cuda:1\"]"),
        "{text}"
    );
}

#[test]
fn valid_edge_values_pass() {
    let c = minimal(&[
        "devices.target_devices=[\"auto\", \"cpu\", \"cuda\", \"cuda:12\"]",
        "train.lr=1",
        "train.min_lr_ratio=1",
        "train.clip_grad_norm=0",
        "model.block_size=64",
        "model.mask_token_id=0",
        "data.max_len=8",
        "debug.fail_at_step=3",
        "debug.fail_stage=checkpoint",
    ]);
    assert!(c.is_ok(), "{c:?}");
}

#[test]
fn the_first_error_is_reported() {
    let e = invalid(|c| {
        c.train.lr = 5.0;
        c.model.block_size = 0;
        c.telemetry.log_every_steps = 0;
    });
    assert!(e.contains("model.block_size"), "{e}");
}

#[test]
fn drafter_batches_per_device() {
    // default: train.grad_accum on each drafter device
    let c = minimal(&[
        "train.grad_accum=3",
        "devices.drafter_devices=cuda:0,cuda:1",
    ])
    .unwrap();
    assert!(c.devices.drafter_batches.is_empty());
    assert_eq!((c.replica_batches(0), c.replica_batches(1)), (3, 3));
    assert_eq!(c.step_batches(), 6);
    // unequal counts: the device that also runs the target trains fewer batches
    let c = minimal(&[
        "devices.drafter_devices=cuda:0,cuda:1",
        "devices.drafter_batches=[1, 2]",
    ])
    .unwrap();
    assert_eq!((c.replica_batches(0), c.replica_batches(1)), (1, 2));
    assert_eq!(c.step_batches(), 3);

    let e = err_text(minimal(&[
        "devices.drafter_devices=cuda:0,cuda:1",
        "devices.drafter_batches=[1]",
    ]));
    assert!(
        e.contains("devices.drafter_batches has 1 entries but devices.drafter_devices has 2"),
        "{e}"
    );
    let e = err_text(minimal(&[
        "devices.drafter_devices=cuda:0,cuda:1",
        "devices.drafter_batches=[1, 0]",
    ]));
    assert!(e.contains("devices.drafter_batches[1]"), "{e}");
}
