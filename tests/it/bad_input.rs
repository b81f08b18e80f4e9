//! Bad input through the real binary: one clear error naming the file and the reason, a
//! non-zero exit, and no half-written output left behind.

use crate::common;

use std::path::Path;
use std::process::Command;

use common::*;

fn dflash(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(args)
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Nothing named like the output (or its staging folder) exists in `parent`.
fn assert_no_output(parent: &Path, name: &str) {
    let leftovers: Vec<String> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(name))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

fn import_fails(gguf: &Path, out_parent: &Path, expect: &[&str]) {
    let out = out_parent.join("model-out");
    let (ok, stderr) = dflash(&["import-gguf", gguf.to_str().unwrap(), out.to_str().unwrap()]);
    assert!(!ok, "import of {} succeeded", gguf.display());
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "{stderr}"
    );
    for e in expect {
        assert!(stderr.contains(e), "{e:?} not in {stderr:?}");
    }
    assert_no_output(out_parent, "model-out");
}

#[test]
fn truncated_gguf_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, _) = tiny_gguf(None);
    // cut inside the tensor data, and inside the header
    let in_data = write_file(tmp.path(), "cut-data.gguf", &bytes[..bytes.len() - 100]);
    import_fails(&in_data, tmp.path(), &["cut-data.gguf", "truncated"]);
    let in_header = write_file(tmp.path(), "cut-header.gguf", &bytes[..200]);
    import_fails(&in_header, tmp.path(), &["cut-header.gguf", "truncated"]);
}

#[test]
fn non_gguf_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_file(tmp.path(), "notes.txt", b"hello, this is not a model\n");
    import_fails(&path, tmp.path(), &["notes.txt", "not a GGUF file"]);
    let missing = tmp.path().join("missing.gguf");
    import_fails(&missing, tmp.path(), &["missing.gguf", "cannot open"]);
}

#[test]
fn unsupported_quantisation_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // A Q5_K (ggml type 13) tensor: 256 values in one 176-byte super-block.
    let q5k = RawTensor {
        name: "output.weight".into(),
        dims: vec![256, 1],
        ggml_type: 13,
        data: vec![0u8; 176],
    };
    let (bytes, _) = tiny_gguf(Some(q5k));
    let path = write_file(tmp.path(), "q5k.gguf", &bytes);
    import_fails(
        &path,
        tmp.path(),
        &["q5k.gguf", "output.weight", "Q5_K", "not supported"],
    );
}

#[test]
fn unwritable_output_folder_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, _) = tiny_gguf(None);
    let gguf = write_file(tmp.path(), "tiny.gguf", &bytes);
    // The parent of the output is a regular file: no one, not even root, can create it.
    let blocker = write_file(tmp.path(), "blocker", b"");
    let out = blocker.join("model-out");
    let (ok, stderr) = dflash(&["import-gguf", gguf.to_str().unwrap(), out.to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("blocker"), "{stderr}");
    assert!(stderr.contains("cannot create"), "{stderr}");
    assert!(!out.exists());

    // An existing non-empty output folder is never overwritten.
    let existing = tmp.path().join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("keep.txt"), b"saved").unwrap();
    let (ok, stderr) = dflash(&[
        "import-gguf",
        gguf.to_str().unwrap(),
        existing.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(stderr.contains("already exists"), "{stderr}");
    assert_eq!(std::fs::read(existing.join("keep.txt")).unwrap(), b"saved");
}

#[test]
fn model_folder_without_config_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_llama_dir(&tmp.path().join("m"), true, 1);
    std::fs::remove_file(model.join("config.json")).unwrap();
    let (ok, stderr) = dflash(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--device",
        "cpu",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(&model.join("config.json").display().to_string()),
        "{stderr}"
    );
    assert!(stderr.contains("not found"), "{stderr}");
}

#[test]
fn config_without_tokenizer_or_with_bad_fields_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_llama_dir(&tmp.path().join("m"), true, 1);
    let err = dflash_tui::model::TargetModel::load(
        &model.join("nope"),
        tch::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("model folder not found"),
        "{err:#}"
    );
    std::fs::write(model.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let err = dflash_tui::model::TargetModel::load(&model, tch::Device::Cpu, tch::Kind::Float)
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("config.json") && msg.contains("hidden_size"),
        "{msg}"
    );
}

#[test]
fn a_config_size_beyond_its_bound_is_refused_before_anything_is_allocated() {
    // data.bucket_window = 2^40 passed validation and ended train in an allocation of 8 TiB
    // (exit 134); it is refused by name, with the range, and nothing is created.
    let tmp = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let run_dir = tmp.path().join("run");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(["train", "--config", config.to_str().unwrap(), "--no-tui"])
        .args(["--set", "data.bucket_window=1099511627776", "--run-dir"])
        .arg(&run_dir)
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(
        errors,
        ["error: config: data.bucket_window = 1099511627776 is out of range (must be between 1 and 1048576)"],
        "{stderr}"
    );
    assert!(!run_dir.exists());
}

#[test]
fn generate_refuses_a_token_count_beyond_its_bound_before_loading() {
    // greedy decoding reserves room for every new token up front
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args([
            "generate",
            "--model",
            "/nonexistent-model",
            "--prompt",
            "hi",
        ])
        .args(["--max-new-tokens", "1099511627776"])
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "--max-new-tokens = 1099511627776 is out of range (must be between 1 and 65536)"
        ),
        "{stderr}"
    );
}
