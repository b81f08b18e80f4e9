//! The real demo assets (made by `make setup`): SmolLM2-135M-Instruct imported from its GGUF,
//! and the ShareGPT conversations recovered from the cut-off file.

use crate::common;

use common::{demo_dir, require_demo};
use dflash_tui::data::sharegpt;
use dflash_tui::model::generate::greedy_generate;
use dflash_tui::model::TargetModel;
use dflash_tui::text::{Message, TextTokenizer};

fn demo_model() -> std::path::PathBuf {
    require_demo(&demo_dir().join("SmolLM2-135M-Instruct"))
}

#[test]
fn tokenizer_round_trip_is_the_identity() {
    let tok = TextTokenizer::from_model_dir(&demo_model()).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let samples = [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "digits 0123456789 and 3.14159 and 1,000,000",
        "emoji: 🚀🔥😀 👩‍💻",
        "CJK: 你好，世界。日本語のテキスト。한국어",
        "tabs\tand\nnewlines\r\n  indented\t\tcode",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ];
    for text in samples {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // digits are split one at a time, special tokens are single ids
    let ids = tok.encode("2024").unwrap();
    assert_eq!(ids.len(), 4);
    let ids = tok.encode("<|im_start|>user").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.encode("<|im_end|>").unwrap(), vec![2]);
}

#[test]
fn demo_model_answers_paris() {
    let dir = demo_model();
    let model = TargetModel::load(&dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    assert_eq!(model.num_layers(), 30);
    let params = model.parameter_count();
    assert!((134_000_000..135_000_000).contains(&params), "{params}");
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let prompt = tok
        .apply_chat_template(
            &[Message::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    let out = greedy_generate(&model, &prompt, 48, &model.config.eos_ids());
    let answer = tok.decode_skip_special(&out).unwrap();
    assert!(answer.contains("Paris"), "answer: {answer:?}");
}

#[test]
fn sharegpt_recovers_every_complete_record() {
    let path = require_demo(&demo_dir().join("sharegpt.jsonl"));
    let text = std::fs::read_to_string(path).unwrap();
    let records: Vec<sharegpt::Conversation> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 17_671);
    assert!(records.iter().all(|r| r.id.is_some()));
    assert!(records[0].conversations.iter().any(|t| t.from == "human"));
}

/// Writes token lists as an Arrow IPC file with an `input_ids` list<int32> column.
fn write_arrow_ids(path: &std::path::Path, seqs: &[Vec<u32>]) {
    use arrow::array::{Int32Builder, ListBuilder, RecordBatch};
    use std::sync::Arc;
    let mut builder = ListBuilder::new(Int32Builder::new());
    for s in seqs {
        for &t in s {
            builder.values().append_value(t as i32);
        }
        builder.append(true);
    }
    let array = Arc::new(builder.finish());
    let batch =
        RecordBatch::try_from_iter([("input_ids", array as arrow::array::ArrayRef)]).unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = arrow::ipc::writer::FileWriter::try_new(file, &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
}

/// Reference: Hugging Face transformers (fp32) measures perplexity 5.337 over 17,309 predicted
/// tokens on records 0-19 (chat template, first 1024 tokens of each).
#[test]
fn demo_perplexity_matches_transformers() {
    let dir = demo_model();
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let text = std::fs::read_to_string(require_demo(&demo_dir().join("sharegpt.jsonl"))).unwrap();
    let seqs: Vec<Vec<u32>> = text
        .lines()
        .take(20)
        .map(|l| {
            let c: sharegpt::Conversation = serde_json::from_str(l).unwrap();
            tok.apply_chat_template(&c.to_messages().unwrap(), false)
                .unwrap()
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("records-0-19.arrow");
    write_arrow_ids(&path, &seqs);
    let data = dflash_tui::data::arrow_io::read_token_column(&path, "input_ids").unwrap();
    assert_eq!(data.len(), 20);
    let model = TargetModel::load(&dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    // A hidden bar still counts: every input token of the 20 sequences went through.
    let bar = indicatif::ProgressBar::hidden();
    let report = dflash_tui::eval::perplexity::perplexity(
        &model,
        &data,
        &dflash_tui::eval::perplexity::PerplexityOptions {
            limit: None,
            max_len: 1024,
            batch_tokens: 4096,
            progress: Some(bar.clone()),
        },
    )
    .unwrap();
    assert_eq!(bar.position(), report.tokens + report.sequences as u64);
    assert_eq!(bar.length(), Some(bar.position()));
    eprintln!("demo perplexity: {report:?}");
    assert_eq!(report.tokens, 17_309, "predicted tokens: {report:?}");
    assert_eq!(report.sequences, 20);
    let rel = (report.ppl - 5.337).abs() / 5.337;
    assert!(
        rel < 0.015,
        "perplexity {} is {:.2}% off 5.337",
        report.ppl,
        rel * 100.0
    );
}
