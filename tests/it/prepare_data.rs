//! prepare-data against Hugging Face: token ids equal `apply_chat_template` for every
//! conversation of the committed fixture, loss masks equal transformers' assistant masks, and
//! `datasets.load_from_disk` reads the output. Bad input gets one message naming file and row.

use crate::common;
mod long_records;

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

/// The trained text of a row: its runs of loss-mask 1, decoded.
fn trained_text(tok: &dflash_tui::text::TextTokenizer, ids: &[u32], mask: &[u8]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j < ids.len() && mask[j] == mask[i] {
            j += 1;
        }
        if mask[i] == 1 {
            out += &tok.decode(&ids[i..j]).unwrap();
        }
        i = j;
    }
    out
}

/// A user question, the assistant's tool call (`content` as given), the tool's answer, the
/// final answer: an OpenAI-style conversation with tools.
fn tool_row(id: &str, content: &str) -> String {
    format!(
        r#"{{"id": "{id}", "messages": [{{"role": "user", "content": "Weather in Paris?"}}, {{"role": "assistant", "content": {content}, "tool_calls": [{{"id": "c1", "type": "function", "function": {{"name": "weather", "arguments": {{"city": "Paris"}}}}}}]}}, {{"role": "tool", "tool_call_id": "c1", "content": "22 C"}}, {{"role": "assistant", "content": "It is 22 C in Paris."}}]}}"#
    ) + "\n"
}

#[test]
fn openai_style_messages_are_read_and_tool_rows_skipped_without_tool_support() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("openai.jsonl");
    let mut text = String::new();
    // Content as a list of parts: the text parts joined by a newline.
    text += r#"{"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}, {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}], "tool_calls": null, "refusal": null}]}"#;
    text += "\n";
    // The same conversation with plain strings.
    text += r#"{"id": "plain", "messages": [{"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Hi!"}]}"#;
    text += "\n";
    // SmolLM2's template knows no tools: counted and skipped.
    text += &tool_row("tools", "null");
    text +=
        r#"{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}"#;
    text += "\n";
    text += r#"{"messages": [{"role": "user", "content": [{"text": "no type"}]}, {"role": "assistant", "content": "x"}]}"#;
    text += "\n";
    text += r#"{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "x"}]}"#;
    text += "\n";
    // Tool definitions must be a list of objects; SmolLM2's template does not show them.
    text += r#"{"tools": "[{\"type\": \"function\"}]", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#;
    text += "\n";
    text += r#"{"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#;
    text += "\n";
    std::fs::write(&input, text).unwrap();
    let out = tmp.path().join("out");
    let (ok, stdout, stderr) = prepare(&[&input], &out, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("8 records in, 2 kept"), "{stdout}");
    assert!(
        stdout.contains(
            r#"openai.jsonl:7: bad tools: "tools" is a string, expected a list of tool definitions"#
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("openai.jsonl:8: the chat template does not show tool definitions: the record defines 1 tool(s)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("the chat template does not support tool calls: 1"),
        "{stdout}"
    );
    assert!(stdout.contains("bad message: 2"), "{stdout}");
    assert!(stdout.contains("no content: 1"), "{stdout}");
    assert!(
        stdout.contains("openai.jsonl:3: the chat template does not support tool calls: messages[1] calls tools"),
        "{stdout}"
    );
    assert!(
        stdout.contains(r#"openai.jsonl:4: bad message: messages[0] "content" is a number, expected a string, null or a list of parts"#),
        "{stdout}"
    );
    // One example of every reason: the second "bad message" (a part without "type") is
    // counted, not shown.
    assert!(!stdout.contains("openai.jsonl:5:"), "{stdout}");
    let got = rows(&out.join("train"));
    assert_eq!(got[0].0, "parts");
    assert_eq!(got[1].0, "plain");
    assert_eq!((&got[0].1, &got[0].2), (&got[1].1, &got[1].2));
}

#[test]
fn image_content_parts_are_refused_by_row_and_part() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("images.jsonl");
    let text = concat!(
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}"#,
        "\n",
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}, {"role": "assistant", "content": "A cat."}]}"#,
        "\n",
    );
    std::fs::write(&input, text).unwrap();
    let out = tmp.path().join("out");
    let (ok, stdout, stderr) = prepare(&[&input], &out, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("2 records in, 1 kept"), "{stdout}");
    // one line naming the row, the message and the part
    let line = stdout
        .lines()
        .find(|l| l.contains("images.jsonl:2:"))
        .unwrap_or_else(|| panic!("no line for row 2: {stdout}"));
    assert!(
        line.ends_with(r#"images.jsonl:2: bad message: messages[0] "content"[1] is an "image_url" part: image, audio and file inputs are not supported (text only)"#),
        "{line}"
    );
    assert_eq!(rows(&out.join("train")).len(), 1);
}

#[test]
fn inspect_data_names_the_models_family_and_checks_its_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("chat.jsonl");
    std::fs::write(
        &input,
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]}"#,
    )
    .unwrap();
    let out = tmp.path().join("out");
    let (ok, _, stderr) = prepare(&[&input], &out, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    let inspect = |model: &Path| {
        let (ok, stdout, stderr) = dflash(&[
            "inspect-data",
            out.to_str().unwrap(),
            "--tokenizer",
            model.to_str().unwrap(),
        ]);
        assert!(ok, "{stderr}");
        stdout
    };
    let stdout = inspect(&tokenizer_dir());
    assert!(
        stdout.contains(": llama (Llama): 30 decoder layers; vocabulary 49152 holds every id\n"),
        "{stdout}"
    );
    // SmolLM2's tokenizer beside a tiny Qwen3.5 config of 128 tokens: named, and warned about
    let hybrid = tmp.path().join("hybrid");
    std::fs::create_dir(&hybrid).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir().join(file), hybrid.join(file)).unwrap();
    }
    let config = fixtures().join("qwen35_targets/conditional/config.json");
    std::fs::copy(config, hybrid.join("config.json")).unwrap();
    let stdout = inspect(&hybrid);
    let line = stdout
        .lines()
        .find(|l| l.contains("(Qwen3.5 hybrid)"))
        .unwrap_or_else(|| panic!("no model line: {stdout}"));
    assert!(
        line.contains(": qwen3_5_text (Qwen3.5 hybrid): 2 Gated DeltaNet + 2 gated attention layers; WARNING: token id ")
            && line.ends_with(" is outside its vocabulary of 128 (tokenised for another model?)"),
        "{line}"
    );
}

#[test]
fn tool_calls_are_rendered_and_trained_with_a_template_that_supports_them() {
    let tmp = tempfile::tempdir().unwrap();
    // SmolLM2's tokenizer with a ChatML template that renders tools as Qwen2.5's does.
    let tok_dir = tmp.path().join("tok");
    std::fs::create_dir(&tok_dir).unwrap();
    std::fs::copy(
        tokenizer_dir().join("tokenizer.json"),
        tok_dir.join("tokenizer.json"),
    )
    .unwrap();
    let template = concat!(
        "{%- for message in messages %}",
        "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}",
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}",
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
        "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}",
        "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}",
        "{%- endfor %}{{- '<|im_end|>\\n' }}",
        "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}",
        "{%- endif %}{%- endfor %}"
    );
    std::fs::write(
        tok_dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>"}).to_string(),
    )
    .unwrap();
    let input = tmp.path().join("tools.jsonl");
    std::fs::write(
        &input,
        tool_row("null-content", "null") + &tool_row("with-content", "\"Let me check.\""),
    )
    .unwrap();
    let out = tmp.path().join("out");
    let (ok, stdout, stderr) = prepare_with(&tok_dir, &[&input], &out, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("2 records in, 2 kept"), "{stdout}");
    let tok = dflash_tui::text::TextTokenizer::from_model_dir(&tok_dir).unwrap();
    let got = rows(&out.join("train"));
    let call = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>";
    for ((id, ids, mask), before_call) in got.iter().zip(["", "Let me check.\n"]) {
        let all = tok.decode(ids).unwrap();
        // The arguments are written as Python's json.dumps writes them, like transformers.
        assert!(all.contains(call), "{id}: {all}");
        // The tool call (and the content before it) and the final answer are trained; the
        // question and the tool's answer are not.
        assert_eq!(
            trained_text(&tok, ids, mask),
            format!("{before_call}{call}It is 22 C in Paris.<|im_end|>"),
            "{id}: {all}"
        );
    }
}

#[test]
fn inspect_data_on_chat_data_names_prepare_data() {
    let tmp = tempfile::tempdir().unwrap();
    let chat = tmp.path().join("chat.jsonl");
    std::fs::write(
        &chat,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}\n",
    )
    .unwrap();
    let (ok, _, stderr) = dflash(&["inspect-data", chat.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "chat.jsonl: not a prepared dataset (a JSON file, which looks like chat data)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("dflash-tui prepare-data --tokenizer MODEL_DIR"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");

    // A folder of chat files.
    let (ok, _, stderr) = dflash(&["inspect-data", tmp.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains("not a prepared dataset (a folder without dataset_dict.json, state.json or .arrow/.parquet files; it holds chat.jsonl)"),
        "{stderr}"
    );
    assert!(stderr.contains("prepare-data"), "{stderr}");

    // Arrow data without an input_ids column.
    let other = tmp.path().join("other.arrow");
    {
        use arrow::array::{ArrayRef, Int32Array, RecordBatch};
        let col: ArrayRef = std::sync::Arc::new(Int32Array::from(vec![1, 2]));
        let batch = RecordBatch::try_from_iter([("label", col)]).unwrap();
        let file = std::fs::File::create(&other).unwrap();
        let mut w = arrow::ipc::writer::StreamWriter::try_new(file, &batch.schema()).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
    }
    let (ok, _, stderr) = dflash(&["inspect-data", other.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains("other.arrow: not a prepared dataset (no input_ids column)")
            && stderr.contains("prepare-data")
            && stderr.contains("no column \"input_ids\" (columns: label)"),
        "{stderr}"
    );

    // A path that is not there is just that.
    let (ok, _, stderr) = dflash(&["inspect-data", tmp.path().join("nope").to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("nope: no such file or folder"), "{stderr}");
}

/// On a terminal (a pty made by `script`) prepare-data draws a progress bar on stderr with its
/// rate and ETA; with stderr a pipe (every other test here) nothing but the summary appears.
#[test]
fn progress_bar_on_a_terminal_only() {
    let tmp = tempfile::tempdir().unwrap();
    let input = fixtures().join("chat20.jsonl");
    let out = tmp.path().join("out");
    let summary = tmp.path().join("summary.txt");
    let command = format!(
        "{} prepare-data --tokenizer {} --input {} --out {} --val-fraction 0 > {}",
        env!("CARGO_BIN_EXE_dflash-tui"),
        tokenizer_dir().display(),
        input.display(),
        out.display(),
        summary.display()
    );
    let typescript = tmp.path().join("typescript");
    let status = Command::new("script")
        .args(["-qec", &command, typescript.to_str().unwrap()])
        .env("DFLASH_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("script (util-linux) runs");
    assert!(status.success());
    let screen = String::from_utf8_lossy(&std::fs::read(&typescript).unwrap()).into_owned();
    assert!(screen.contains("prepare-data ["), "{screen:?}");
    assert!(screen.contains("/20 rows ("), "{screen:?}");
    assert!(screen.contains(" rows/s, ETA "), "{screen:?}");
    let text = std::fs::read_to_string(&summary).unwrap();
    assert!(text.contains("20 records in, 20 kept"), "{text}");

    // Not a terminal: no bar, no cursor movement, the summary on stdout as always.
    let out2 = tmp.path().join("out2");
    let (ok, stdout, stderr) = prepare(&[&input], &out2, &["--val-fraction", "0"]);
    assert!(ok, "{stderr}");
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "{stderr:?}"
    );
    assert!(!stderr.contains("rows/s"), "{stderr:?}");
    assert!(
        stdout.starts_with("prepare-data: 20 records in, 20 kept"),
        "{stdout}"
    );
}
