//! `train` and `init-drafter` check before they work, through the real binary on the CPU with
//! tiny random models and data: a run directory holding a run is refused and left byte for
//! byte as it was; a bad data path, column or token is refused before any model loads; a mask
//! token the loss trains on is refused naming the token, its count and an unused one. Each
//! case prints what it measured (`--nocapture`).

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant, SystemTime};

fn tiny_config() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml")
}

/// `train` headless on the tiny config with the given target, data and run directory.
fn train_args(target: &Path, data: &Path, run_dir: &Path, set: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "train".into(),
        "--config".into(),
        tiny_config().display().to_string(),
        "--set".into(),
        format!("model.target={}", target.display()),
        "--set".into(),
        format!("data.path={}", data.display()),
        "--run-dir".into(),
        run_dir.display().to_string(),
        "--no-tui".into(),
    ];
    for s in set {
        args.extend(["--set".into(), (*s).into()]);
    }
    args
}

/// A process of the binary; killed when dropped, so that a failing test leaves none behind.
struct Proc {
    child: Child,
    stdout: common::Lines,
    stderr: common::Lines,
}

struct Ended {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Proc {
    fn start(args: &[String]) -> Proc {
        let mut child = common::spawn_dflash(args, Stdio::null());
        let stdout = common::Lines::read(child.stdout.take().unwrap());
        let stderr = common::Lines::read(child.stderr.take().unwrap());
        Proc {
            child,
            stdout,
            stderr,
        }
    }

    /// Waits (up to `limit`) for both streams to end, then for the exit status.
    fn finish(mut self, limit: Duration) -> Ended {
        let t = Instant::now();
        let stdout = self.stdout.all(limit);
        let stderr = self.stderr.all(limit.saturating_sub(t.elapsed()));
        let code = self.child.wait().unwrap().code();
        Ended {
            code,
            stdout,
            stderr,
            took: t.elapsed(),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(args: &[String]) -> Ended {
    Proc::start(args).finish(Duration::from_secs(120))
}

/// Every entry under `dir`: its kind and bytes (a link: its target) and its modification time.
type Tree = BTreeMap<PathBuf, (String, Vec<u8>, Option<SystemTime>)>;

fn tree(dir: &Path) -> Tree {
    let mut out = Tree::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let meta = p.symlink_metadata().unwrap();
            let rel = p.strip_prefix(dir).unwrap().to_path_buf();
            let mtime = meta.modified().ok();
            let entry = if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&p).unwrap();
                (
                    "link".into(),
                    target.display().to_string().into_bytes(),
                    mtime,
                )
            } else if meta.is_dir() {
                todo.push(p);
                ("dir".into(), Vec::new(), mtime)
            } else {
                ("file".into(), std::fs::read(&p).unwrap(), mtime)
            };
            out.insert(rel, entry);
        }
    }
    out
}

fn assert_unchanged(before: &Tree, dir: &Path, case: &str) {
    let after = tree(dir);
    let added: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    let removed: Vec<_> = before.keys().filter(|k| !after.contains_key(*k)).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "{case}: added {added:?}, removed {removed:?}"
    );
    for (path, entry) in before {
        assert!(
            after[path] == *entry,
            "{case}: {} changed (bytes or modification time)",
            path.display()
        );
    }
}

#[test]
fn a_directory_holding_a_run_is_refused_and_left_byte_for_byte_as_it_was() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let set = ["train.total_steps=4", "checkpoint.save_every_steps=2"];
    let args = train_args(&i.target, &i.data, &run_dir, &set);
    let first = run(&args);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    // the start-up says what it checked and where its time goes, in that order
    let at = |pattern: &str| {
        first
            .stderr
            .find(pattern)
            .unwrap_or_else(|| panic!("no {pattern:?} in:\n{}", first.stderr))
    };
    assert!(
        at("checked ") < at("loading target ") && at("loading target ") < at("target loaded in ")
    );
    assert!(
        first
            .stderr
            .contains("(4 layers, 0.00 GB of files, 0.0 GiB in memory)"),
        "{}",
        first.stderr
    );
    let before = tree(&run_dir);
    assert!(before.contains_key(Path::new("checkpoints/step-000004/trainer_state.json")));
    assert!(before.contains_key(Path::new(".lock")));

    let again = run(&args);
    assert_eq!(again.code, Some(1), "{}", again.stderr);
    let err = again.stderr.trim();
    let expected = format!("continue it with --resume {}", run_dir.display());
    assert!(
        err.contains(&expected) && err.contains("another --run-dir") && err.contains("config.toml"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "one line, nothing loaded: {err}");
    assert_unchanged(&before, &run_dir, "train --run-dir on a finished run");

    // a run that never reached a checkpoint: --resume could not continue it, so it says so
    let early = i.tmp.path().join("early");
    std::fs::create_dir(&early).unwrap();
    std::fs::write(early.join("config.toml"), "# a run's config\n").unwrap();
    std::fs::write(early.join("train.log"), "a run's log\n").unwrap();
    let early_before = tree(&early);
    let out = run(&train_args(&i.target, &i.data, &early, &set));
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("no checkpoint yet, so --resume")
            && out.stderr.contains("another --run-dir"),
        "{}",
        out.stderr
    );
    assert_unchanged(
        &early_before,
        &early,
        "train --run-dir on a run without a checkpoint",
    );

    // an empty directory is a fine place for a new run; --resume of the finished run still works
    let empty = i.tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let fresh = run(&train_args(&i.target, &i.data, &empty, &set));
    assert_eq!(fresh.code, Some(0), "{}", fresh.stderr);
    let resumed = run(&[
        "train".into(),
        "--resume".into(),
        run_dir.display().to_string(),
        "--no-tui".into(),
        "--allow-schedule-change".into(),
        "--set".into(),
        "train.total_steps=6".into(),
    ]);
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    eprintln!(
        "train --run-dir on a run: exit 1 in {:.2} s, {} entries byte- and mtime-identical, none added: {err}; \
         on a run without a checkpoint: refused, unchanged; an empty directory: trained; --resume: trained",
        again.took.as_secs_f64(),
        before.len()
    );
}

#[test]
fn bad_inputs_are_refused_before_any_model_loads() {
    let i = common::tiny_run(32, 3);
    // Weights that cannot load: a check that came after loading would fail on them instead.
    let broken = i.tmp.path().join("broken-target");
    std::fs::create_dir(&broken).unwrap();
    std::fs::copy(i.target.join("config.json"), broken.join("config.json")).unwrap();
    std::fs::write(broken.join("model.safetensors"), b"not safetensors").unwrap();
    let run_dir = i.tmp.path().join("run");

    // a token id outside the target's vocabulary of 50, in row 2 of the file
    let bad_ids = i.tmp.path().join("bad-ids.arrow");
    let mut rows: Vec<(Vec<i32>, Vec<i8>)> = (0..4)
        .map(|_| ((3..40).collect(), (0..37).map(|k| (k >= 4) as i8).collect()))
        .collect();
    rows[2].0[5] = 77;
    common::write_token_dataset(&bad_ids, &rows);
    // a loss mask of 2
    let bad_mask = i.tmp.path().join("bad-mask.arrow");
    rows[2].0[5] = 7;
    rows[1].1[9] = 2;
    common::write_token_dataset(&bad_mask, &rows);

    // control: with good inputs the broken weights are reached, and refused
    let out = run(&train_args(&broken, &i.data, &run_dir, &[]));
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("model.safetensors"), "{}", out.stderr);
    std::fs::remove_dir_all(&run_dir).unwrap();

    let missing = i.tmp.path().join("no-such-data");
    let dir = i.tmp.path().join("not-a-dataset");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "hello").unwrap();
    let cases: Vec<(String, PathBuf, Vec<&str>, Vec<String>)> = vec![
        (
            "no such data".into(),
            missing.clone(),
            vec![],
            vec![
                missing.display().to_string(),
                "no such file or folder".into(),
            ],
        ),
        (
            "a folder that is no dataset".into(),
            dir.clone(),
            vec![],
            vec![dir.display().to_string(), "not a dataset folder".into()],
        ),
        (
            "a missing column".into(),
            i.data.clone(),
            vec!["data.loss_mask_column=labels"],
            vec![
                i.data.display().to_string(),
                "no column \"labels\"".into(),
                "input_ids, loss_mask".into(),
            ],
        ),
        (
            "a token outside the vocabulary".into(),
            bad_ids.clone(),
            vec![],
            vec![
                format!("{}: row 2: token 5 has id 77", bad_ids.display()),
                "vocabulary of 50".into(),
            ],
        ),
        (
            "a loss mask of 2".into(),
            bad_mask.clone(),
            vec![],
            vec![format!(
                "{}: row 1, column \"loss_mask\": item 9 is 2, expected 0 or 1",
                bad_mask.display()
            )],
        ),
    ];
    let mut seen = Vec::new();
    for (case, data, set, expect) in cases {
        let out = run(&train_args(&broken, &data, &run_dir, &set));
        let err = out.stderr.trim();
        assert_eq!(out.code, Some(1), "{case}: {err}");
        for e in &expect {
            assert!(err.contains(e.as_str()), "{case}: {e:?} not in {err}");
        }
        assert!(
            !err.contains("safetensors"),
            "{case}: the target was loaded: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{case}: one line: {err}");
        assert!(!run_dir.exists(), "{case}: the run directory was created");
        seen.push(format!("{case}: {:.2} s", out.took.as_secs_f64()));
    }
    // the split a held-out pass needs, in a dataset with splits
    let dict = i.tmp.path().join("dict");
    std::fs::create_dir_all(dict.join("train")).unwrap();
    std::fs::copy(&i.data, dict.join("train/data.arrow")).unwrap();
    std::fs::write(dict.join("dataset_dict.json"), r#"{"splits": ["train"]}"#).unwrap();
    for (set, field) in [
        ("validation.every_steps=5", "config: validation"),
        ("eval.every_steps=5", "config: eval"),
    ] {
        let out = run(&train_args(&broken, &dict, &run_dir, &[set]));
        let err = out.stderr.trim();
        assert_eq!(out.code, Some(1), "{err}");
        assert!(
            err.contains(field) && err.contains("no split \"validation\" (splits: train)"),
            "{err}"
        );
        assert!(!run_dir.exists());
        seen.push(format!(
            "{set} without the split: {:.2} s",
            out.took.as_secs_f64()
        ));
    }
    eprintln!(
        "refused before the (broken) target loads, nothing created: {}",
        seen.join("; ")
    );
}

/// The tiny data with the mask token 1 written over position `at` of every third row (loss
/// from position 4 on); returns the data and the count of trained positions holding it.
fn data_with_mask_token(dir: &Path, name: &str, at: usize) -> (PathBuf, u64) {
    let path = dir.join(name);
    let mut trained = 0;
    let rows: Vec<(Vec<i32>, Vec<i8>)> = (0..32usize)
        .map(|r| {
            let len = 24 + (r * 7) % 40;
            let mut ids: Vec<i32> = (0..len)
                .map(|k| (3 + (r * 5 + k * 3) % 45) as i32)
                .collect();
            let mask: Vec<i8> = (0..len).map(|k| (k >= 4) as i8).collect();
            if r % 3 == 0 {
                ids[at] = 1;
                trained += u64::from(mask[at] == 1);
            }
            (ids, mask)
        })
        .collect();
    common::write_token_dataset(&path, &rows);
    (path, trained)
}

#[test]
fn train_refuses_a_mask_token_the_loss_trains_on() {
    let i = common::tiny_run(32, 3);
    let run_dir = i.tmp.path().join("run");
    let (trained_data, count) = data_with_mask_token(i.tmp.path(), "trained.arrow", 10);
    assert_eq!(count, 11);
    let out = run(&train_args(&i.target, &trained_data, &run_dir, &[]));
    let err = out.stderr.trim();
    assert_eq!(out.code, Some(1), "{err}");
    let expected = format!(
        "config: model.mask_token_id = 1 occurs at {count} trained positions (loss_mask 1) of {} (the first: {}: row 0, position 10)",
        trained_data.display(),
        trained_data.display()
    );
    assert!(err.contains(&expected), "{err}");
    // the suggestion: the highest id the data never holds (the tiny target has no tokenizer)
    assert!(
        err.contains("e.g. --set model.mask_token_id=49: token 49 never occurs in this data"),
        "{err}"
    );
    assert!(!run_dir.exists(), "nothing written: {err}");

    // the same token only where the loss is off (positions 0..4): accepted, and the run trains
    let (context_data, count) = data_with_mask_token(i.tmp.path(), "context.arrow", 2);
    assert_eq!(count, 0);
    let out = run(&train_args(
        &i.target,
        &context_data,
        &run_dir,
        &["train.total_steps=2"],
    ));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("mask token 1 not trained (11 times in the context)"),
        "{}",
        out.stderr
    );
    eprintln!(
        "mask token 1 at {} trained positions: refused; only in loss_mask 0 positions: trained (run finished: {})",
        11,
        out.stdout.trim()
    );
}

/// `init-drafter` of one layer and two taps (the tiny target has 4 layers); `mask` `None`
/// leaves the mask token to be chosen.
fn init_drafter(target: &Path, out: &Path, mask: Option<&str>, data: Option<&Path>) -> Ended {
    let mut args: Vec<String> = vec![
        "init-drafter".into(),
        "--target".into(),
        target.display().to_string(),
        "--out".into(),
        out.display().to_string(),
        "--layers".into(),
        "1".into(),
        "--num-taps".into(),
        "2".into(),
    ];
    if let Some(mask) = mask {
        args.extend(["--mask-token-id".into(), mask.into()]);
    }
    if let Some(d) = data {
        args.extend(["--data".into(), d.display().to_string()]);
    }
    run(&args)
}

#[test]
fn init_drafter_with_data_refuses_a_mask_token_the_loss_trains_on() {
    let i = common::tiny_run(32, 3);
    let (trained_data, count) = data_with_mask_token(i.tmp.path(), "trained.arrow", 10);
    let (context_data, _) = data_with_mask_token(i.tmp.path(), "context.arrow", 2);
    let out_dir = i.tmp.path().join("drafter");
    let out = init_drafter(&i.target, &out_dir, Some("1"), Some(&trained_data));
    let err = out.stderr.trim();
    assert_eq!(out.code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "--mask-token-id = 1 occurs at {count} trained positions (loss_mask 1)"
        )) && err.contains("e.g. --mask-token-id 49"),
        "{err}"
    );
    assert!(!out_dir.exists(), "nothing written");
    let out = init_drafter(&i.target, &out_dir, Some("1"), Some(&context_data));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out_dir.join("model.safetensors").is_file());
    // without --data nothing is checked, as before
    let unchecked = i.tmp.path().join("unchecked");
    let out = init_drafter(&i.target, &unchecked, Some("1"), None);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(unchecked.join("config.json").is_file());
}

#[test]
fn init_drafter_without_a_mask_token_chooses_one_and_says_why() {
    let i = common::tiny_run(32, 3);
    let (trained_data, _) = data_with_mask_token(i.tmp.path(), "trained.arrow", 10);
    let out_dir = i.tmp.path().join("drafter");
    let out = init_drafter(&i.target, &out_dir, None, Some(&trained_data));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // the tiny target has no tokenizer: the highest id the data never holds
    assert!(
        out.stdout
            .contains("mask token 49: the highest id that never occurs in the data"),
        "{}",
        out.stdout
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["dflash_config"]["mask_token_id"], 49);
    // sizes as saved: bf16 on disk, f32 in memory (twice as large)
    assert!(
        out.stdout.contains("MiB as bf16 on disk (")
            && out.stdout.contains("MiB as f32 in memory)"),
        "{}",
        out.stdout
    );
    // with neither a tokenizer nor data nothing is safe to choose
    let none = i.tmp.path().join("none");
    let out = init_drafter(&i.target, &none, None, None);
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("tokenizer.json: cannot read")
            && out.stderr.contains("give --mask-token-id ID or --data DIR"),
        "{}",
        out.stderr
    );
    assert!(!none.exists());
}

/// The demo's SmolLM2 and its prepared ShareGPT data (`make setup`): token 2 `<|im_end|>` ends
/// every answer, so it is refused; the suggestion, 16 `<empty_output>`, is accepted. Prints
/// how long the check of the ~17k rows takes.
#[test]
fn the_demo_data_refuses_im_end_and_takes_empty_output() {
    let demo = common::demo_dir();
    let target = common::require_demo(&demo.join("SmolLM2-135M-Instruct"));
    let data = common::require_demo(&demo.join("sharegpt-smollm2"));
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("drafter");
    let out = init_drafter(&target, &out_dir, Some("2"), Some(&data));
    let err = out.stderr.trim();
    assert_eq!(out.code, Some(1), "{err}");
    assert!(
        err.contains("--mask-token-id = 2 (\"<|im_end|>\") occurs at ")
            && err.contains(
                "e.g. --mask-token-id 16: token 16 (\"<empty_output>\") never occurs in this data"
            ),
        "{err}"
    );
    assert!(!out_dir.exists());
    let refused = out.took;

    let t = Instant::now();
    let scan = dflash_tui::data::check::scan_tokens(
        &data.join("train"),
        &dflash_tui::data::store::DataColumns::default(),
        49152,
        16,
    )
    .unwrap();
    let scan_s = t.elapsed().as_secs_f64();
    assert_eq!(scan.mask_trained, 0);
    assert_eq!(scan.counts[16], 0);

    let out = init_drafter(&target, &out_dir, Some("16"), Some(&data));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // left out, the mask token is chosen from the tokenizer and the data: the same 16
    let chosen = tmp.path().join("chosen");
    let picked = init_drafter(&target, &chosen, None, Some(&data));
    assert_eq!(picked.code, Some(0), "{}", picked.stderr);
    assert!(
        picked.stdout.contains(
            "mask token 16 (\"<empty_output>\"): a special token named \"empty\"; never occurs in the data"
        ),
        "{}",
        picked.stdout
    );
    eprintln!(
        "demo data ({} rows, {} tokens, {} trained): the scan takes {scan_s:.2} s; init-drafter --mask-token-id 2 refused in {:.2} s: {err}; 16 accepted in {:.2} s",
        scan.rows,
        scan.tokens,
        scan.trained,
        refused.as_secs_f64(),
        out.took.as_secs_f64()
    );
}

#[test]
fn init_drafter_makes_the_sliding_window_layer_mix() {
    let i = common::tiny_run(32, 3);
    let with = |dir: &str, extra: &[&str]| {
        let out_dir = i.tmp.path().join(dir);
        let mut args: Vec<String> = [
            "init-drafter",
            "--target",
            &i.target.display().to_string(),
            "--out",
            &out_dir.display().to_string(),
            "--layers",
            "3",
            "--num-taps",
            "2",
            "--mask-token-id",
            "49",
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        (run(&args), out_dir)
    };
    let config = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    // all sliding but the last, as Qwen3.6-27B's drafter
    let (out, dir) = with("mix", &["--sliding-window", "2048"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let c = config(&dir);
    assert_eq!(
        c["layer_types"],
        serde_json::json!(["sliding_attention", "sliding_attention", "full_attention"])
    );
    assert_eq!(
        (c["use_sliding_window"].clone(), c["sliding_window"].clone()),
        (true.into(), 2048.into())
    );
    assert!(
        out.stdout
            .contains("3 layers (2 sliding (window 2048), 1 full)"),
        "{}",
        out.stdout
    );
    // the full layers chosen
    let (out, dir) = with(
        "first",
        &["--sliding-window", "8", "--full-attention-layers", "0,2"],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        config(&dir)["layer_types"],
        serde_json::json!(["full_attention", "sliding_attention", "full_attention"])
    );
    // refused, by option, before anything is written
    for (extra, message) in [
        (
            &["--sliding-window", "0"][..],
            "a sliding window of 0 positions: it must be at least 1",
        ),
        (
            &["--sliding-window", "4", "--full-attention-layers", "3"],
            "full-attention layer 3: the drafter has layers 0 to 2",
        ),
    ] {
        let (out, dir) = with("refused", extra);
        assert_eq!(out.code, Some(1), "{}", out.stderr);
        assert!(
            out.stderr
                .contains("--sliding-window / --full-attention-layers")
                && out.stderr.contains(message),
            "{}",
            out.stderr
        );
        assert!(!dir.exists());
    }
    // without --sliding-window: the spec's config.json, no layout keys
    let (out, dir) = with("plain", &[]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(config(&dir).get("layer_types").is_none());
}
