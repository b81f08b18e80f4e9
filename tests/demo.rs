//! The real demo assets (made by `make setup`): SmolLM2-135M-Instruct imported from its GGUF,
//! and the ShareGPT conversations recovered from the cut-off file.

mod common;

use common::{demo_dir, require_demo};
use dflash_tui::data::sharegpt;
use dflash_tui::model::generate::greedy_generate;
use dflash_tui::model::LlamaModel;
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
    let model = LlamaModel::load(&dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
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
