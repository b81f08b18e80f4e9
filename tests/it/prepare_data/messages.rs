//! prepare-data on chat formats: OpenAI-style messages and tool rows, image parts refused by row
//! and part, tool calls with a template that supports them, inspect-data, the progress bar.

use super::*;

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
