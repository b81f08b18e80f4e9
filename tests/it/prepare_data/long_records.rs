//! Long records are cut before they are tokenised: the ids and loss masks are those of
//! tokenising the whole record and cutting after, and an 8 MB record takes little memory.

use std::path::Path;

use dflash_tui::text::{Message, TextTokenizer};

use super::{prepare, rows, tokenizer_dir, Row};

/// Pseudo-random text (a fixed linear congruential generator) of about `bytes` bytes: words,
/// numbers, punctuation, runs of spaces, line breaks and non-ASCII letters, so that cuts land
/// in every kind of pre-tokenizer chunk.
fn text(seed: u64, bytes: usize) -> String {
    const WORDS: [&str; 16] = [
        "the",
        "answer",
        "is",
        "12345",
        ",",
        ".",
        "  ",
        "\n",
        "\n\n",
        "déjà",
        "中文",
        "🙂",
        "don't",
        "x=y+1;",
        "    indented",
        "<|im",
    ];
    let mut state = seed;
    let mut out = String::with_capacity(bytes + 16);
    while out.len() < bytes {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out += WORDS[(state >> 60) as usize];
        if state & 3 != 0 {
            out.push(' ');
        }
    }
    out
}

fn chat_line(id: &str, turns: &[(&str, String)]) -> String {
    let messages: Vec<_> = turns
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    serde_json::json!({"id": id, "messages": messages}).to_string() + "\n"
}

/// A long answer, a long question before a short answer, many short turns (cuts land near the
/// special tokens between them), an answer that is one pre-tokenizer chunk (no cut settles
/// before its end), and plain text.
fn records() -> (String, Vec<(String, Vec<Message>)>) {
    let mut turns = vec![("user", "Tell me a lot.".to_string())];
    turns.push(("assistant", text(1, 60_000)));
    let mut convs = vec![("long-answer".to_string(), turns)];
    convs.push((
        "long-question".into(),
        vec![("user", text(2, 20_000)), ("assistant", text(3, 300))],
    ));
    let many = (0..400)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            (role, text(10 + i as u64, 1 + i % 7 * 9))
        })
        .collect();
    convs.push(("many-turns".into(), many));
    convs.push((
        "one-chunk".into(),
        vec![("user", "Say a.".into()), ("assistant", "a".repeat(30_000))],
    ));
    let mut lines: String = convs.iter().map(|(id, t)| chat_line(id, t)).collect();
    lines += &(serde_json::json!({"id": "plain", "text": text(4, 30_000)}).to_string() + "\n");
    let messages = convs
        .into_iter()
        .map(|(id, t)| (id, t.iter().map(|(r, c)| Message::new(r, c)).collect()))
        .collect();
    (lines, messages)
}

fn prepared(input: &Path, out: &Path, max_len: usize) -> (Vec<Row>, String) {
    let max_len = max_len.to_string();
    let args = ["--val-fraction", "0", "--max-len", &max_len];
    let (ok, stdout, stderr) = prepare(&[input], out, &args);
    assert!(ok, "--max-len {max_len}: {stderr}");
    (rows(&out.join("train")), stdout)
}

#[test]
fn records_cut_before_tokenising_get_the_ids_and_masks_of_the_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("long.jsonl");
    let (lines, conversations) = records();
    std::fs::write(&input, lines).unwrap();
    // Longer than every record: each is tokenised whole, as the tokenizer does it.
    let (whole, _) = prepared(&input, &tmp.path().join("whole"), 1 << 30);
    assert_eq!(whole.len(), 5);
    let tok = TextTokenizer::from_model_dir(&tokenizer_dir()).unwrap();
    for (id, messages) in &conversations {
        let row = whole.iter().find(|r| &r.0 == id).unwrap();
        assert_eq!(
            row.1,
            tok.apply_chat_template(messages, false).unwrap(),
            "{id}"
        );
    }
    for max_len in [40, 333, 1000, 2500, 9000] {
        let (cut, stdout) = prepared(&input, &tmp.path().join(format!("cut{max_len}")), max_len);
        let mut kept = 0;
        let mut longer = 0;
        for (id, ids, mask) in &whole {
            let n = ids.len().min(max_len);
            if !mask[..n].contains(&1) {
                assert!(cut.iter().all(|r| &r.0 != id), "{id} at {max_len}");
                continue;
            }
            kept += 1;
            longer += (ids.len() > max_len) as usize;
            let row = cut.iter().find(|r| &r.0 == id).unwrap();
            assert_eq!(row.1, ids[..n], "{id}: ids at --max-len {max_len}");
            assert_eq!(row.2, mask[..n], "{id}: loss mask at --max-len {max_len}");
        }
        assert_eq!(cut.len(), kept, "--max-len {max_len}");
        assert!(
            stdout.contains(&format!("{longer} samples were cut to {max_len} tokens")),
            "{stdout}"
        );
    }
}

/// The peak resident memory (kB) of `dflash-tui ARGS`. A child started by exec from this
/// test process is charged this process's own peak (Linux keeps the larger of the two across
/// exec), which grows with the tests running beside it; so a small Python process starts the
/// command and reports its reaped child's peak alone.
fn peak_rss_kb(args: &[&str]) -> i64 {
    const MEASURE: &str = "import resource, subprocess, sys\n\
        r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n\
        print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)";
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(MEASURE)
        .arg(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(args)
        .env("DFLASH_LOG", "warn")
        .output()
        .expect("python3 (make setup needs it too)");
    let report = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<i64> = report
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    assert!(
        out.status.success() && fields.len() == 2 && fields[0] == 0,
        "{args:?}: {report} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    fields[1]
}

#[test]
fn an_8_mb_record_is_prepared_in_little_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let small = tmp.path().join("small.jsonl");
    let big = tmp.path().join("big.jsonl");
    std::fs::write(
        &small,
        chat_line(
            "s",
            &[("user", "Hi".into()), ("assistant", "Hello.".into())],
        ),
    )
    .unwrap();
    let answer = text(5, 8 << 20);
    std::fs::write(
        &big,
        chat_line("b", &[("user", "Talk.".into()), ("assistant", answer)]),
    )
    .unwrap();
    let tok = tokenizer_dir();
    let run = |input: &Path, out: &str| {
        let out = tmp.path().join(out);
        let args = [
            "prepare-data",
            "--tokenizer",
            tok.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--max-len",
            "512",
            "--val-fraction",
            "0",
        ];
        peak_rss_kb(&args)
    };
    let base = run(&small, "small");
    let peak = run(&big, "big");
    // Tokenised whole, the record took 1 GB more than the small one (the tokenizer keeps a
    // string, offsets and a word id per token); the record and its rendering take about 50 MB.
    let growth_mb = (peak - base) / 1024;
    assert!(
        growth_mb < 150,
        "an 8 MB record took {growth_mb} MB more than a small one"
    );
}
