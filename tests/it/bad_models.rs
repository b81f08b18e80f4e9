//! Bad model input: missing or mismatched tensors (name, shape, dtype), unsupported
//! architectures, drafters that do not fit their target, mask tokens outside the vocabulary.
//! Each gets one error naming the file and the tensor or field.

use crate::common;

use std::path::Path;

use common::tiny_target_dir;
use dflash_tui::model::{Drafter, DrafterConfig, DrafterShape, TargetModel};
use tch::{Device, Kind, Tensor};

fn err_of<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.unwrap_err())
}

fn rewrite_tensors(file: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let mut tensors = Tensor::read_safetensors(file).unwrap();
    edit(&mut tensors);
    Tensor::write_safetensors(&tensors, file).unwrap();
}

fn load_target(dir: &Path) -> String {
    err_of(TargetModel::load(dir, Device::Cpu, Kind::Float))
}

#[test]
fn target_with_a_missing_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("m"), "qwen3", false, None, 1);
    rewrite_tensors(&dir.join("model.safetensors"), |t| {
        t.retain(|(n, _)| n != "model.layers.2.self_attn.k_norm.weight")
    });
    let msg = load_target(&dir);
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    assert!(
        msg.contains("model.layers.2.self_attn.k_norm.weight"),
        "{msg}"
    );
}

#[test]
fn target_with_a_mismatched_shape_or_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("m"), "llama", false, None, 1);
    let file = dir.join("model.safetensors");
    rewrite_tensors(&file, |t| {
        for (n, x) in t.iter_mut() {
            if n == "model.layers.1.mlp.up_proj.weight" {
                *x = Tensor::zeros([64, 31], (Kind::Float, Device::Cpu));
            }
        }
    });
    let msg = load_target(&dir);
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert!(
        msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("[64, 31]"),
        "{msg}"
    );

    rewrite_tensors(&file, |t| {
        for (n, x) in t.iter_mut() {
            if n == "model.layers.1.mlp.up_proj.weight" {
                *x = Tensor::zeros([64, 32], (Kind::Int64, Device::Cpu));
            }
        }
    });
    let msg = load_target(&dir);
    assert!(
        msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("I64"),
        "{msg}"
    );
}

#[test]
fn unsupported_architecture_names_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("m"), "gpt2", false, None, 1);
    let msg = load_target(&dir);
    assert!(
        msg.contains("config.json") && msg.contains("model_type") && msg.contains("gpt2"),
        "{msg}"
    );
    // an unsupported rope scaling is a config error too
    let dir = tiny_target_dir(
        &tmp.path().join("y"),
        "llama",
        false,
        Some(serde_json::json!({"rope_type": "yarn", "factor": 4.0})),
        1,
    );
    let msg = load_target(&dir);
    assert!(
        msg.contains("config.json") && msg.contains("rope_scaling") && msg.contains("yarn"),
        "{msg}"
    );
}

fn drafter_for(target_dir: &Path, out: &Path, mask: i64) -> anyhow::Result<std::path::PathBuf> {
    let target = TargetModel::load(target_dir, Device::Cpu, Kind::Float).unwrap();
    let config = DrafterConfig::for_target(
        &target.config,
        &DrafterShape {
            layers: 1,
            block_size: 4,
            mask_token_id: mask,
            target_layer_ids: None,
            num_taps: 2,
        },
    )?;
    Drafter::init(config, Device::Cpu, Kind::Float, 0)?.save(out)
}

#[test]
fn drafter_that_does_not_fit_the_target() {
    let tmp = tempfile::tempdir().unwrap();
    let small = tiny_target_dir(&tmp.path().join("small"), "llama", false, None, 1);
    let drafter = drafter_for(&small, &tmp.path().join("d"), 3).unwrap();
    // another target with a different hidden size
    let other = tmp.path().join("other");
    tiny_target_dir(&other, "llama", false, None, 1);
    let cfg_path = other.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["hidden_size"] = 48.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let target_cfg = dflash_tui::model::TargetConfig::from_model_dir(&other).unwrap();
    let msg = err_of(Drafter::load_for_target(
        &drafter,
        &target_cfg,
        Device::Cpu,
        Kind::Float,
    ));
    assert!(
        msg.contains(&drafter.join("config.json").display().to_string()),
        "{msg}"
    );
    assert!(
        msg.contains("hidden_size = 32") && msg.contains("48"),
        "{msg}"
    );
}

#[test]
fn drafter_with_missing_extra_or_misshapen_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 1);
    let drafter = drafter_for(&target, &tmp.path().join("d"), 3).unwrap();
    let file = drafter.join("model.safetensors");
    let original = std::fs::read(&file).unwrap();

    rewrite_tensors(&file, |t| t.retain(|(n, _)| n != "hidden_norm.weight"));
    let msg = err_of(Drafter::load(&drafter, Device::Cpu, Kind::Float));
    assert!(
        msg.contains("model.safetensors") && msg.contains("\"hidden_norm.weight\" is missing"),
        "{msg}"
    );

    std::fs::write(&file, &original).unwrap();
    rewrite_tensors(&file, |t| {
        t.push((
            "model.layers.0.self_attn.q_proj.weight".into(),
            Tensor::zeros([2], (Kind::Float, Device::Cpu)),
        ))
    });
    let msg = err_of(Drafter::load(&drafter, Device::Cpu, Kind::Float));
    assert!(
        msg.contains("unexpected tensor \"model.layers.0.self_attn.q_proj.weight\""),
        "{msg}"
    );

    std::fs::write(&file, &original).unwrap();
    rewrite_tensors(&file, |t| {
        for (n, x) in t.iter_mut() {
            if n == "fc.weight" {
                *x = Tensor::zeros([32, 96], (Kind::BFloat16, Device::Cpu));
            }
        }
    });
    let msg = err_of(Drafter::load(&drafter, Device::Cpu, Kind::Float));
    assert!(
        msg.contains("\"fc.weight\"") && msg.contains("[32, 96]") && msg.contains("[32, 64]"),
        "{msg}"
    );
}

#[test]
fn mask_token_outside_the_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 1);
    let msg = err_of(drafter_for(&target, &tmp.path().join("d"), 50));
    assert!(
        msg.contains("mask_token_id = 50") && msg.contains("vocabulary"),
        "{msg}"
    );
    assert!(!tmp.path().join("d").exists());

    // through the command line, and in an existing drafter's config.json
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args([
            "init-drafter",
            "--target",
            target.to_str().unwrap(),
            "--out",
        ])
        .arg(tmp.path().join("d2"))
        .args(["--mask-token-id", "500", "--num-taps", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("mask_token_id = 500") && stderr.contains("config.json"),
        "{stderr}"
    );
    assert!(!tmp.path().join("d2").exists());

    let drafter = drafter_for(&target, &tmp.path().join("d3"), 3).unwrap();
    let cfg_path = drafter.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("\"mask_token_id\": 3", "\"mask_token_id\": 77");
    std::fs::write(&cfg_path, text).unwrap();
    let msg = err_of(Drafter::load(&drafter, Device::Cpu, Kind::Float));
    assert!(
        msg.contains(&cfg_path.display().to_string()) && msg.contains("mask_token_id = 77"),
        "{msg}"
    );
}

/// `dflash-tui eval` of `drafter` against `target` on the CPU, two prompts, 8 new tokens:
/// (success, stdout, stderr).
fn eval(target: &Path, drafter: &Path, extra: &[&str]) -> (bool, String, String) {
    let prompts = drafter.with_extension("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [5, 9, 13]}\n{\"prompt_ids\": [40, 2, 7]}\n",
    )
    .unwrap();
    let (t, d, p) = (
        target.to_str().unwrap(),
        drafter.to_str().unwrap(),
        prompts.to_str().unwrap(),
    );
    let mut args = vec!["eval", "--device", "cpu", "--target", t, "--drafter", d];
    args.extend(["--prompts", p, "--max-new-tokens", "8", "--warmup", "0"]);
    args.extend_from_slice(extra);
    common::dflash(&args)
}

#[test]
fn drafter_config_sizes_are_bounded_in_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 1);
    let drafter = drafter_for(&target, &tmp.path().join("d"), 3).unwrap();
    let cfg_path = drafter.join("config.json");
    let good = std::fs::read_to_string(&cfg_path).unwrap();
    for (field, value, range) in [
        ("num_hidden_layers", 1_000_000_000i64, "between 1 and 64"),
        ("block_size", 100_000, "between 2 and 64"),
        ("intermediate_size", 1 << 40, "between 1 and 262144"),
    ] {
        let mut cfg: serde_json::Value = serde_json::from_str(&good).unwrap();
        cfg[field] = value.into();
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        let expected = format!("field {field} = {value} is out of range (must be {range})");
        // every reader goes through the same check: a plain load, and the eval command (which
        // grew memory without end on 10^9 layers), refused before any weight is read
        let msg = err_of(Drafter::load(&drafter, Device::Cpu, Kind::Float));
        assert!(msg.contains(&expected), "{msg}");
        assert!(msg.contains(&cfg_path.display().to_string()), "{msg}");
        let started = std::time::Instant::now();
        let (ok, _, stderr) = eval(&target, &drafter, &[]);
        assert!(!ok, "{stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(errors[0].contains(&expected), "{stderr}");
        assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
    }
}

#[test]
fn eval_of_a_drafter_with_weights_that_are_not_finite_warns() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 1);
    let drafter = drafter_for(&target, &tmp.path().join("d"), 3).unwrap();
    let warnings = |json: &str| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        serde_json::from_value(v["drafter_warnings"].clone()).unwrap()
    };
    let (ok, stdout, stderr) = eval(&target, &drafter, &["--json"]);
    assert!(ok, "{stderr}");
    assert_eq!(warnings(&stdout), Vec::<String>::new());

    rewrite_tensors(&drafter.join("model.safetensors"), |t| {
        for (n, x) in t.iter_mut() {
            if n == "layers.0.mlp.up_proj.weight" {
                *x = x.full_like(f64::NAN);
            }
        }
    });
    let (ok, stdout, stderr) = eval(&target, &drafter, &["--json"]);
    assert!(ok, "{stderr}");
    let w = warnings(&stdout);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("not finite") && w[0].contains("layers.0.mlp.up_proj.weight"),
        "{w:?}"
    );
    assert!(stderr.contains(&w[0]), "{stderr}");
    // the text report says it beside tau
    let (ok, stdout, stderr) = eval(&target, &drafter, &[]);
    assert!(ok, "{stderr}");
    let tau = stdout.lines().position(|l| l.starts_with("tau ")).unwrap();
    let warning = stdout.lines().position(|l| l.starts_with("WARNING: "));
    assert_eq!(warning, Some(tau + 1), "{stdout}");
}

#[test]
fn doctor_names_a_models_family_or_why_it_cannot_be_a_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let hybrid = root.join("configs/shapes/qwen3.5-27b");
    let (ok, stdout, stderr) = common::dflash(&["doctor", "--model", hybrid.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("qwen3.5-27b: qwen3_5_text (Qwen3.5 hybrid): 48 Gated DeltaNet + 16 gated attention layers, hidden 5120, vocabulary 248320\n"),
        "{stdout}"
    );
    // an FP8 checkpoint: one line naming the field
    let tmp = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hybrid.join("config.json")).unwrap())
            .unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3"});
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let (ok, stdout, stderr) = common::dflash(&["doctor", "--model", tmp.path().to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let line = stdout.lines().last().unwrap();
    assert!(
        line.contains(": not usable as a target: ")
            && line.ends_with(r#"field quantization_config (quant_method "fp8"): quantized checkpoints are not supported (weights must be f32, f16 or bf16)"#),
        "{line}"
    );
}
