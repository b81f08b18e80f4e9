//! GGUF import: tensor names, shapes, dtypes and values (every supported type), the Q/K
//! un-permutation, the tokenizer files, and that the result loads and runs as a model.

use crate::common;

use std::collections::BTreeSet;

use common::*;
use dflash_tui::gguf::{import_gguf, GgufFile, OutputDtype};
use dflash_tui::model::TargetModel;
use dflash_tui::text::{Message, TextTokenizer};
use safetensors::{Dtype, SafeTensors};

fn values_of(st: &SafeTensors, name: &str) -> (Dtype, Vec<usize>, Vec<f32>) {
    let view = st.tensor(name).unwrap();
    let values = match view.dtype() {
        Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => view
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    };
    (view.dtype(), view.shape().to_vec(), values)
}

#[test]
fn import_writes_hugging_face_names_shapes_dtypes_and_exact_values() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, expected) = tiny_gguf(None);
    let gguf = write_file(tmp.path(), "tiny.gguf", &bytes);
    let out = tmp.path().join("tiny-hf");
    let summary = import_gguf(&gguf, &out, OutputDtype::F32).unwrap();
    assert_eq!(summary.tensors, expected.len());
    assert!(summary.hparams.tied_embeddings);

    let files: BTreeSet<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(files.contains(f), "{f} missing from {files:?}");
    }

    let data = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    let names: BTreeSet<String> = st.names().into_iter().map(str::to_string).collect();
    let want: BTreeSet<String> = expected.iter().map(|(n, _, _)| n.clone()).collect();
    assert_eq!(names, want);
    for (name, shape, values) in &expected {
        let (dtype, got_shape, got) = values_of(&st, name);
        assert_eq!(dtype, Dtype::F32, "{name}");
        assert_eq!(&got_shape, shape, "{name}");
        assert_eq!(&got, values, "{name}: values differ");
    }

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["num_attention_heads"], HEADS);
    assert_eq!(config["num_key_value_heads"], KV_HEADS);
    assert_eq!(config["head_dim"], HEAD_DIM);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["rope_theta"], 100000.0);
    assert_eq!(config["vocab_size"], tiny_vocab().len());
    assert_eq!(config["eos_token_id"], 1);
}

#[test]
fn un_permuted_projections_differ_from_the_stored_rows() {
    // Guard against a test that passes because the permutation is the identity for this shape.
    let (bytes, expected) = tiny_gguf(None);
    let tmp = tempfile::tempdir().unwrap();
    let path = write_file(tmp.path(), "tiny.gguf", &bytes);
    let gguf = GgufFile::open(&path).unwrap();
    let stored = gguf
        .dequantize(gguf.tensor("blk.0.attn_q.weight").unwrap())
        .unwrap();
    let hf = &expected
        .iter()
        .find(|(n, _, _)| n.ends_with("q_proj.weight"))
        .unwrap()
        .2;
    assert_ne!(&stored, hf);
    assert_eq!(
        llama_cpp_permute(hf, (HEADS * HEAD_DIM) as i64, HIDDEN as i64, HEADS as i64),
        stored
    );
}

#[test]
fn bf16_output_and_tokenizer_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, expected) = tiny_gguf(None);
    let gguf = write_file(tmp.path(), "tiny.gguf", &bytes);
    let out = tmp.path().join("tiny-bf16");
    import_gguf(&gguf, &out, OutputDtype::Bf16).unwrap();
    let data = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    let (dtype, _, values) = values_of(&st, "model.layers.0.self_attn.k_proj.weight");
    assert_eq!(dtype, Dtype::BF16);
    let want = &expected
        .iter()
        .find(|(n, _, _)| n.ends_with("k_proj.weight"))
        .unwrap()
        .2;
    assert_eq!(&values, want); // grid values are exact in bf16

    let tok = TextTokenizer::from_model_dir(&out).unwrap();
    assert_eq!(tok.encode("ab").unwrap(), vec![4]);
    assert_eq!(tok.encode("ab ab<|im_end|>").unwrap(), vec![4, 7, 1]);
    assert_eq!(tok.decode(&[4, 7, 1]).unwrap(), "ab ab<|im_end|>");
    assert_eq!(tok.eos_token.as_deref(), Some("<|im_end|>"));
    let ids = tok
        .apply_chat_template(&[Message::new("user", "ab")], true)
        .unwrap();
    assert_eq!(ids, vec![4, 1]);
}

#[test]
fn imported_model_loads_and_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, _) = tiny_gguf(None);
    let gguf = write_file(tmp.path(), "tiny.gguf", &bytes);
    let out = tmp.path().join("tiny-hf");
    import_gguf(&gguf, &out, OutputDtype::F32).unwrap();
    let model = TargetModel::load(&out, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let logits = model.forward(&tch::Tensor::from_slice(&[2i64, 3, 4]).unsqueeze(0), None);
    assert_eq!(logits.size(), vec![1, 3, tiny_vocab().len() as i64]);
    assert!(bool::try_from(logits.isfinite().all()).unwrap());
}
