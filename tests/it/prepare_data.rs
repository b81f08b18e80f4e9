//! prepare-data against Hugging Face: token ids equal `apply_chat_template` for every
//! conversation of the committed fixture, loss masks equal transformers' assistant masks, and
//! `datasets.load_from_disk` reads the output. Bad input gets one message naming file and row.

use crate::common;
mod long_records;
mod messages;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{bench_dir, demo_dir, dflash, require_bench, require_demo};
use dflash_tui::data::arrow_io::read_token_data;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tokenizer_dir() -> PathBuf {
    require_demo(&demo_dir().join("SmolLM2-135M-Instruct"))
}

fn prepare(inputs: &[&Path], out: &Path, extra: &[&str]) -> (bool, String, String) {
    prepare_with(&tokenizer_dir(), inputs, out, extra)
}

fn prepare_with(
    tok: &Path,
    inputs: &[&Path],
    out: &Path,
    extra: &[&str],
) -> (bool, String, String) {
    let mut args = vec![
        "prepare-data",
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--input",
    ];
    args.extend(inputs.iter().map(|p| p.to_str().unwrap()));
    args.extend(extra);
    dflash(&args)
}

#[derive(serde::Deserialize)]
struct Expected {
    id: String,
    input_ids: Vec<u32>,
    assistant_mask: Vec<u8>,
}

/// (id, input_ids, loss_mask)
type Row = (String, Vec<u32>, Vec<u8>);

/// Rows of a split.
fn rows(split: &Path) -> Vec<Row> {
    common::split_rows(split)
}

/// prepare-data on `NAME.jsonl` with `tok` equals `NAME.expected.json` (made by transformers).
fn check_fixture(tok: &Path, name: &str, n: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join(name);
    let (ok, stdout, stderr) = prepare_with(
        tok,
        &[&fixtures().join(format!("{name}.jsonl"))],
        &out,
        &["--val-fraction", "0"],
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains(&format!("{n} records in, {n} kept")),
        "{stdout}"
    );
    let expected: Vec<Expected> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(format!("{name}.expected.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(expected.len(), n);
    let got = rows(&out.join("train"));
    assert_eq!(got.len(), n);
    for (e, (id, ids, mask)) in expected.iter().zip(&got) {
        assert_eq!(&e.id, id);
        assert_eq!(
            &e.input_ids, ids,
            "conversation {id}: token ids differ from apply_chat_template"
        );
        assert_eq!(
            &e.assistant_mask, mask,
            "conversation {id}: loss mask differs from the assistant mask"
        );
    }
    assert!(read_token_data(&out.join("validation"), "input_ids", None)
        .unwrap()
        .ids
        .is_empty());
}

#[test]
fn token_ids_and_masks_equal_hugging_face_for_the_fixture() {
    check_fixture(&tokenizer_dir(), "chat20", 20);
}

/// Qwen3's template (messages[0] read at the top, `messages[::-1]`, `namespace`, string
/// methods, the empty think block before the last assistant turn) on conversations that start
/// with an assistant turn, end with a user turn, have many turns or non-ASCII text: token ids
/// equal transformers' apply_chat_template, loss masks equal its assistant mask (content and
/// <|im_end|>; header and think block not trained). Made by tests/fixtures/make_qwen3_chat10.py.
#[test]
fn qwen3_template_equals_hugging_face_for_the_fixture() {
    let tok = require_bench(&bench_dir().join("qwen3-tokenizer"));
    check_fixture(&tok, "qwen3_chat10", 10);
}

/// A copy of the model folder `from` whose chat template is only in `chat_template.jinja`, as
/// transformers >= 4.43 saves it (`tokenizer_config.json` without `chat_template`); the other
/// files are linked, not copied.
fn with_template_in_jinja_file(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "tokenizer_config.json" {
            std::os::unix::fs::symlink(&path, to.join(name)).unwrap();
        }
    }
    let text = std::fs::read_to_string(from.join("tokenizer_config.json")).unwrap();
    let mut config: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).unwrap();
    let template = config.remove("chat_template").unwrap();
    std::fs::write(to.join("chat_template.jinja"), template.as_str().unwrap()).unwrap();
    std::fs::write(
        to.join("tokenizer_config.json"),
        serde_json::Value::Object(config).to_string(),
    )
    .unwrap();
    to.to_path_buf()
}

/// OpenAI-style conversations with tools for Qwen3: tool definitions (the "# Tools" system
/// block), assistant turns that call tools with null, empty or some content (one or two calls,
/// arguments as a JSON string or an object), tool answers, system prompts, several rounds,
/// lists of parts, null fields: token ids equal transformers'
/// `apply_chat_template(messages, tools=tools)`, loss masks its assistant mask (content, tool
/// calls and <|im_end|>). Made by tests/fixtures/make_qwen3_tools.py.
#[test]
fn qwen3_tools_equal_hugging_face_for_the_fixture() {
    let tok = require_bench(&bench_dir().join("qwen3-tokenizer"));
    check_fixture(&tok, "qwen3_tools", 10);
}

/// A model saved by transformers >= 4.43 keeps its template in `chat_template.jinja`: read,
/// with the same ids and masks as from `tokenizer_config.json`.
#[test]
fn a_template_in_chat_template_jinja_renders_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = with_template_in_jinja_file(
        &require_bench(&bench_dir().join("qwen3-tokenizer")),
        &tmp.path().join("qwen3"),
    );
    check_fixture(&tok, "qwen3_tools", 10);
    check_fixture(&tok, "qwen3_chat10", 10);
}

/// `generate` reads the template from `chat_template.jinja` too (the same answer as with the
/// template in tokenizer_config.json); a folder with no template anywhere says where it looked.
#[test]
fn generate_reads_chat_template_jinja() {
    let tmp = tempfile::tempdir().unwrap();
    let model = with_template_in_jinja_file(&tokenizer_dir(), &tmp.path().join("smol"));
    let generate = |dir: &Path| {
        dflash(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "What is the capital of France?",
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--dtype",
            "f32",
        ])
    };
    let (ok, from_jinja, stderr) = generate(&model);
    assert!(ok, "{stderr}");
    let (ok, from_config, stderr) = generate(&tokenizer_dir());
    assert!(ok, "{stderr}");
    assert_eq!(from_jinja, from_config);
    assert!(!from_jinja.trim().is_empty());

    std::fs::remove_file(model.join("chat_template.jinja")).unwrap();
    let (ok, _, stderr) = generate(&model);
    assert!(!ok);
    assert!(
        stderr.contains("no chat template (looked for chat_template.jinja, additional_chat_templates/*.jinja, the chat_template field of tokenizer_config.json and chat_template.json)"),
        "{stderr}"
    );
}

fn python_with_datasets() -> Option<(String, String)> {
    let tools = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".deps/pytools");
    let path = std::env::var("PYTHONPATH").unwrap_or_default();
    let pythonpath = format!("{}:{path}", tools.display());
    let ok = Command::new("python3")
        .args(["-c", "import datasets"])
        .env("PYTHONPATH", &pythonpath)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok.then(|| ("python3".to_string(), pythonpath))
}

#[test]
fn datasets_load_from_disk_reads_the_same_rows() {
    let Some((python, pythonpath)) = python_with_datasets() else {
        // CI runs `make test`, whose set-up installs it: there a missing tool is a failure
        assert!(
            std::env::var_os("CI").is_none(),
            "Python `datasets` is not installed in .deps/pytools (make setup installs it)"
        );
        eprintln!("Python `datasets` is not installed (make setup installs it into .deps/pytools): not run");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let (ok, _, stderr) = prepare(
        &[&fixtures().join("chat20.jsonl")],
        &out,
        &["--val-fraction", "0.2", "--shard-rows", "7"],
    );
    assert!(ok, "{stderr}");
    let script = r#"
import json, sys, datasets
d = datasets.load_from_disk(sys.argv[1])
print(json.dumps({s: [[r["id"], r["input_ids"], r["loss_mask"]] for r in d[s]] for s in d}))
"#;
    let res = Command::new(&python)
        .args(["-c", script, out.to_str().unwrap()])
        .env("PYTHONPATH", &pythonpath)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let py: std::collections::BTreeMap<String, Vec<Row>> =
        serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(py.keys().collect::<Vec<_>>(), ["train", "validation"]);
    assert_eq!(py["train"], rows(&out.join("train")));
    assert_eq!(py["validation"], rows(&out.join("validation")));
    assert_eq!(py["train"].len(), 16);
    assert_eq!(py["validation"].len(), 4);
}

#[test]
fn skippable_rows_are_counted_with_file_and_row() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("mixed.jsonl");
    std::fs::write(
        &input,
        concat!(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello there, how can I help?\"}]}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"only a question\"}]}\n",
            "{\"messages\": [{\"role\": \"user\"\n",
            "{\"text\": \"Plain text trains on every token.\"}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"\"}, {\"role\": \"assistant\", \"content\": \"Hm?\"}, {\"role\": \"user\", \"content\": \" \"}, {\"role\": \"assistant\", \"content\": \"Hello?\"}]}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"second question\"}]}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"third question\"}]}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"fourth question\"}]}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"fifth question\"}]}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"sixth question\"}]}\n",
            "{\"other\": 1}\n",
        ),
    )
    .unwrap();
    let out = tmp.path().join("out");
    let (ok, stdout, stderr) = prepare(&[&input], &out, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("11 records in, 3 kept"), "{stdout}");
    assert!(stdout.contains("no assistant turn: 6"), "{stdout}");
    assert!(stdout.contains("malformed JSON line: 1"), "{stdout}");
    // Every reason has an example with the start of its record: the first of each, then the
    // first skips up to five in all, in input order.
    let examples: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("    e.g. "))
        .collect();
    let origins: Vec<&str> = examples
        .iter()
        .map(|l| {
            l.split("mixed.jsonl:")
                .nth(1)
                .unwrap()
                .split(':')
                .next()
                .unwrap()
        })
        .collect();
    assert_eq!(origins, ["2", "3", "6", "7", "11"], "{stdout}");
    assert!(
        stdout.contains("mixed.jsonl:2: no assistant turn\n         {\"messages\": [{\"role\": \"user\", \"content\": \"only a question\"}]}\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("mixed.jsonl:3: malformed JSON line"),
        "{stdout}"
    );
    assert!(
        stdout.contains("         {\"messages\": [{\"role\": \"user\"\n"),
        "{stdout}"
    );
    // Turns with empty content are kept, and counted.
    assert!(
        stdout.contains(
            "2 turn(s) with empty content in 1 kept record(s), rendered as they are (e.g. "
        ),
        "{stdout}"
    );
    assert!(stdout.contains("mixed.jsonl:5)"), "{stdout}");
    let r = rows(&out.join("train"));
    // the plain text row is all loss
    assert!(r[1].2.iter().all(|&m| m == 1));
    // the chat row: system prompt and user turn are not trained, the answer is
    let mask = &r[0].2;
    assert_eq!(mask[0], 0);
    assert!(mask.contains(&1));
}

#[test]
fn unusable_inputs_fail_without_output() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let out = tmp.path().join("out");
    let (ok, _, stderr) = prepare(&[&empty], &out, &[]);
    assert!(!ok);
    assert!(
        stderr.contains("empty.jsonl: the file is empty"),
        "{stderr}"
    );
    assert!(!out.exists());

    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"x\": 1}\nnot json\n").unwrap();
    let (ok, _, stderr) = prepare(&[&bad], &out, &[]);
    assert!(!ok);
    assert!(
        stderr.contains("bad.jsonl") && stderr.contains("no usable records"),
        "{stderr}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("out"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn demo_dataset_was_prepared_by_the_setup() {
    let ds = require_demo(&demo_dir().join("sharegpt-smollm2"));
    let (ok, stdout, stderr) = dflash(&[
        "inspect-data",
        ds.to_str().unwrap(),
        "--tokenizer",
        tokenizer_dir().to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("rows"), "{stdout}");
    assert!(stdout.contains("loss-mask share"), "{stdout}");
    assert!(
        stdout.contains("\u{27e6}"),
        "no trained part marked: {stdout}"
    );
    let train = read_token_data(&ds.join("train"), "input_ids", Some("loss_mask")).unwrap();
    let val = read_token_data(&ds.join("validation"), "input_ids", Some("loss_mask")).unwrap();
    assert!(train.ids.len() > 17_000, "{}", train.ids.len());
    assert!(!val.ids.is_empty());
    assert!(train.ids.iter().all(|s| s.len() <= 3072));
}

#[test]
fn limit_keeps_the_first_n_usable_rows_in_input_order() {
    let tmp = tempfile::tempdir().unwrap();
    let chat = |q: &str, a: &str| {
        format!(
            "{{\"id\": \"{q}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{q}\"}}, {{\"role\": \"assistant\", \"content\": \"{a}\"}}]}}\n"
        )
    };
    let mut text = String::new();
    text += &chat("q1", "first answer");
    text += "{\"messages\": [{\"role\": \"user\", \"content\": \"no answer\"}]}\n";
    text += "not json\n";
    text += &chat("q2", "second answer");
    text += &chat("q3", "third answer");
    text += "also not json\n";
    text += &chat("q4", "fourth answer");
    let input = tmp.path().join("in.jsonl");
    std::fs::write(&input, text).unwrap();
    // A second input that cannot be read: with the limit reached in the first it is not read.
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();

    let all = tmp.path().join("all");
    let (ok, stdout, stderr) = prepare(&[&input], &all, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("7 records in, 4 kept"), "{stdout}");
    let all_rows = rows(&all.join("train"));

    let three = tmp.path().join("three");
    let (ok, stdout, stderr) = prepare(
        &[&input, &empty],
        &three,
        &["--val-fraction", "0", "--limit", "3"],
    );
    assert!(ok, "{stderr}");
    // Records up to the third usable one: q1, the two skips, q2, q3.
    assert!(
        stdout.contains("5 records in, 3 kept (the first 3 usable: --limit 3)"),
        "{stdout}"
    );
    assert!(stdout.contains("no assistant turn: 1"), "{stdout}");
    assert!(stdout.contains("malformed JSON line: 1"), "{stdout}");
    let got = rows(&three.join("train"));
    let ids: Vec<&str> = got.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(ids, ["q1", "q2", "q3"]);
    assert_eq!(got[..], all_rows[..3]);

    // A validation split is taken from the kept rows.
    let split = tmp.path().join("split");
    let (ok, _, stderr) = prepare(
        &[&input],
        &split,
        &["--val-fraction", "0.4", "--limit", "3"],
    );
    assert!(ok, "{stderr}");
    let n = rows(&split.join("train")).len() + rows(&split.join("validation")).len();
    assert_eq!(n, 3);

    // More than there is: everything usable, and the summary says so.
    let many = tmp.path().join("many");
    let (ok, stdout, stderr) = prepare(&[&input], &many, &["--val-fraction", "0", "--limit", "10"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("7 records in, 4 kept (fewer than --limit 10"),
        "{stdout}"
    );
    assert_eq!(rows(&many.join("train")), all_rows);

    let (ok, _, stderr) = prepare(&[&input], &tmp.path().join("zero"), &["--limit", "0"]);
    assert!(!ok);
    assert!(stderr.contains("--limit must be at least 1"), "{stderr}");
}

#[test]
fn bench_dataset_was_prepared_by_the_setup() {
    let ds = require_bench(&bench_dir().join("sharegpt-qwen3-3000"));
    let train = read_token_data(&ds.join("train"), "input_ids", Some("loss_mask")).unwrap();
    let val = read_token_data(&ds.join("validation"), "input_ids", None).unwrap();
    assert_eq!(train.ids.len(), 3000);
    assert!(val.ids.is_empty());
    let lengths: Vec<usize> = (0..3000).map(|i| train.ids.get(i).len()).collect();
    assert!(lengths.iter().all(|&l| l <= 3072));
    let mean = lengths.iter().sum::<usize>() as f64 / 3000.0;
    assert!((1300.0..1700.0).contains(&mean), "mean length {mean}");
    // Qwen3 ids: below the 151,936-row embedding, and the mask token 151669 is not in the data.
    assert!(train.ids.tokens.iter().all(|&t| t < 151_669));
}
