//! Helpers shared by the integration tests: a GGUF writer and a tiny random Llama model.
#![allow(dead_code)]

mod lines;
mod models;
pub mod proposers;
mod tmux;

pub use lines::{spawn_dflash, Lines};
pub use models::{models_of, tiny_models};
pub use tmux::Tmux;

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use tch::{Kind, Tensor};

/// A metadata value to write.
pub enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// A tensor to write: name, ggml dims (fastest first), ggml type id, raw bytes.
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Serialises a GGUF v3 file.
pub fn gguf_bytes(meta: &[(&str, Meta)], tensors: &[RawTensor]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        put_str(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Bool(v) => {
                out.extend(7u32.to_le_bytes());
                out.push(*v as u8);
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(&mut out, s);
                }
            }
            Meta::I32s(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend(v.to_le_bytes());
                }
            }
        }
    }
    let align = |n: u64| n.div_ceil(32) * 32;
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ggml_type.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset = align(offset + t.data.len() as u64);
    }
    out.resize(align(out.len() as u64) as usize, 0);
    for t in tensors {
        out.extend(&t.data);
        out.resize(align(out.len() as u64) as usize, 0);
    }
    out
}

/// A small deterministic pseudo-random sequence (the tests must not depend on a seed service).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }

    /// A value in [-1, 1) on a grid of 1/64, exact in f16 and bf16.
    pub fn grid(&mut self) -> f32 {
        (self.next_u32() % 128) as f32 / 64.0 - 1.0
    }
}

/// A float tensor of `shape` with N(0, 1) values drawn from a generator of its own seeded by
/// `seed` (Box-Muller): the tests run in threads of one process, and libtorch's global
/// generator (`tch::manual_seed`, `Tensor::randn`) is shared by all of them.
pub fn randn(shape: &[i64], seed: u64) -> Tensor {
    let mut rng = Lcg(seed ^ 0x9E37_79B9_7F4A_7C15);
    let n: i64 = shape.iter().product();
    let mut uniform = || (rng.next_u32() as f64 + 0.5) / (1u64 << 31) as f64;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect();
    Tensor::from_slice(&values).view(shape)
}

/// Held while a test draws from libtorch's global generator (`TargetModel::random` seeds it
/// per tensor): a draw of another thread in between would change the seeded values.
pub static TORCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// [`TORCH_RNG`], also after a test that held it failed.
pub fn torch_rng() -> std::sync::MutexGuard<'static, ()> {
    TORCH_RNG.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn f32_tensor(name: &str, rows: u64, cols: u64, values: &[f32]) -> RawTensor {
    assert_eq!(values.len() as u64, rows * cols);
    let dims = if rows == 1 {
        vec![cols]
    } else {
        vec![cols, rows]
    };
    RawTensor {
        name: name.into(),
        dims,
        ggml_type: 0,
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

pub fn f16_tensor(name: &str, rows: u64, cols: u64, values: &[f32]) -> RawTensor {
    RawTensor {
        name: name.into(),
        dims: vec![cols, rows],
        ggml_type: 1,
        data: values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

pub fn bf16_tensor(name: &str, rows: u64, cols: u64, values: &[f32]) -> RawTensor {
    RawTensor {
        name: name.into(),
        dims: vec![cols, rows],
        ggml_type: 30,
        data: values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// A quantised tensor with random blocks, and the values ggml defines for them.
/// Types: 2 = Q4_0 (x = (q - 8) d), 3 = Q4_1 (x = q d + m), 8 = Q8_0 (x = q d).
pub fn quantised_tensor(
    name: &str,
    rows: u64,
    cols: u64,
    ggml_type: u32,
    rng: &mut Lcg,
) -> (RawTensor, Vec<f32>) {
    assert_eq!(cols % 32, 0);
    let mut data = Vec::new();
    let mut values = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32((1 + rng.next_u32() % 16) as f32 / 256.0);
        let m = f16::from_f32(rng.grid());
        data.extend(d.to_le_bytes());
        match ggml_type {
            2 | 3 => {
                if ggml_type == 3 {
                    data.extend(m.to_le_bytes());
                }
                let q: Vec<u8> = (0..32).map(|_| (rng.next_u32() % 16) as u8).collect();
                // byte j holds value j (low nibble) and value j + 16 (high nibble)
                data.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
                for &qi in &q {
                    values.push(if ggml_type == 2 {
                        (qi as f32 - 8.0) * d.to_f32()
                    } else {
                        qi as f32 * d.to_f32() + m.to_f32()
                    });
                }
            }
            8 => {
                for _ in 0..32 {
                    let q = (rng.next_u32() % 256) as u8 as i8;
                    data.push(q as u8);
                    values.push(q as f32 * d.to_f32());
                }
            }
            other => panic!("no test quantiser for type {other}"),
        }
    }
    (
        RawTensor {
            name: name.into(),
            dims: vec![cols, rows],
            ggml_type,
            data,
        },
        values,
    )
}

/// llama.cpp's conversion permutes Q/K rows per head: view [heads, 2, head_dim/2, cols],
/// swap axes 1 and 2.
pub fn llama_cpp_permute(values: &[f32], rows: i64, cols: i64, heads: i64) -> Vec<f32> {
    let t = Tensor::from_slice(values)
        .view([heads, 2, rows / heads / 2, cols])
        .transpose(1, 2)
        .contiguous()
        .view([-1]);
    Vec::<f32>::try_from(&t).unwrap()
}

/// Shape of the tiny GGUF Llama the tests build.
pub const HIDDEN: u64 = 32;
pub const HEADS: u64 = 4;
pub const KV_HEADS: u64 = 2;
pub const HEAD_DIM: u64 = 8;
pub const FFN: u64 = 64;

pub fn tiny_vocab() -> Vec<String> {
    [
        "<|endoftext|>",
        "<|im_end|>",
        "a",
        "b",
        "ab",
        "Ġ",
        "c",
        "Ġab",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The expected Hugging Face tensors of [`tiny_gguf`]: name -> (shape, values).
pub type Expected = Vec<(String, Vec<usize>, Vec<f32>)>;

/// A one-layer Llama GGUF using every supported type; returns the file bytes and what the
/// import must produce.
pub fn tiny_gguf(extra_tensor: Option<RawTensor>) -> (Vec<u8>, Expected) {
    let mut rng = Lcg(7);
    let vocab = tiny_vocab();
    let v = vocab.len() as u64;
    let mut tensors = Vec::new();
    let mut expected: Expected = Vec::new();
    let grid = |n: u64, rng: &mut Lcg| (0..n).map(|_| rng.grid()).collect::<Vec<f32>>();

    let embd = grid(v * HIDDEN, &mut rng);
    tensors.push(f16_tensor("token_embd.weight", v, HIDDEN, &embd));
    expected.push((
        "model.embed_tokens.weight".into(),
        vec![v as usize, HIDDEN as usize],
        embd,
    ));

    let norm = grid(HIDDEN, &mut rng);
    tensors.push(f32_tensor("blk.0.attn_norm.weight", 1, HIDDEN, &norm));
    expected.push((
        "model.layers.0.input_layernorm.weight".into(),
        vec![HIDDEN as usize],
        norm,
    ));

    let q_rows = HEADS * HEAD_DIM;
    let q_hf = grid(q_rows * HIDDEN, &mut rng);
    let q_gguf = llama_cpp_permute(&q_hf, q_rows as i64, HIDDEN as i64, HEADS as i64);
    tensors.push(f32_tensor("blk.0.attn_q.weight", q_rows, HIDDEN, &q_gguf));
    expected.push((
        "model.layers.0.self_attn.q_proj.weight".into(),
        vec![q_rows as usize, HIDDEN as usize],
        q_hf,
    ));

    let kv_rows = KV_HEADS * HEAD_DIM;
    let k_hf = grid(kv_rows * HIDDEN, &mut rng);
    let k_gguf = llama_cpp_permute(&k_hf, kv_rows as i64, HIDDEN as i64, KV_HEADS as i64);
    tensors.push(bf16_tensor("blk.0.attn_k.weight", kv_rows, HIDDEN, &k_gguf));
    expected.push((
        "model.layers.0.self_attn.k_proj.weight".into(),
        vec![kv_rows as usize, HIDDEN as usize],
        k_hf,
    ));

    let mut quant = |gguf: &str, hf: &str, rows: u64, cols: u64, ty: u32, rng: &mut Lcg| {
        let (t, values) = quantised_tensor(gguf, rows, cols, ty, rng);
        tensors.push(t);
        expected.push((hf.into(), vec![rows as usize, cols as usize], values));
    };
    quant(
        "blk.0.attn_v.weight",
        "model.layers.0.self_attn.v_proj.weight",
        kv_rows,
        HIDDEN,
        8,
        &mut rng,
    );
    quant(
        "blk.0.attn_output.weight",
        "model.layers.0.self_attn.o_proj.weight",
        HIDDEN,
        q_rows,
        2,
        &mut rng,
    );
    quant(
        "blk.0.ffn_gate.weight",
        "model.layers.0.mlp.gate_proj.weight",
        FFN,
        HIDDEN,
        3,
        &mut rng,
    );
    quant(
        "blk.0.ffn_up.weight",
        "model.layers.0.mlp.up_proj.weight",
        FFN,
        HIDDEN,
        3,
        &mut rng,
    );
    quant(
        "blk.0.ffn_down.weight",
        "model.layers.0.mlp.down_proj.weight",
        HIDDEN,
        FFN,
        8,
        &mut rng,
    );

    let ffn_norm = grid(HIDDEN, &mut rng);
    tensors.push(f32_tensor("blk.0.ffn_norm.weight", 1, HIDDEN, &ffn_norm));
    expected.push((
        "model.layers.0.post_attention_layernorm.weight".into(),
        vec![HIDDEN as usize],
        ffn_norm,
    ));
    let out_norm = grid(HIDDEN, &mut rng);
    tensors.push(f32_tensor("output_norm.weight", 1, HIDDEN, &out_norm));
    expected.push(("model.norm.weight".into(), vec![HIDDEN as usize], out_norm));
    if let Some(extra) = extra_tensor {
        tensors.push(extra);
    }

    let meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("general.name", Meta::Str("tiny".into())),
        ("llama.block_count", Meta::U32(1)),
        ("llama.context_length", Meta::U32(256)),
        ("llama.embedding_length", Meta::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Meta::U32(FFN as u32)),
        ("llama.attention.head_count", Meta::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Meta::U32(KV_HEADS as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.rope.freq_base", Meta::F32(100000.0)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(vocab)),
        (
            "tokenizer.ggml.token_type",
            Meta::I32s(vec![3, 3, 1, 1, 1, 1, 1, 1]),
        ),
        (
            "tokenizer.ggml.merges",
            Meta::Strs(vec!["a b".into(), "Ġ ab".into()]),
        ),
        ("tokenizer.ggml.bos_token_id", Meta::U32(0)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.padding_token_id", Meta::U32(1)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(false)),
        (
            "tokenizer.chat_template",
            Meta::Str("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}".into()),
        ),
    ];
    (gguf_bytes(&meta, &tensors), expected)
}

/// Writes bytes to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A tiny random Llama model folder (config.json + model.safetensors), as a test fixture.
pub fn tiny_llama_dir(dir: &Path, tied: bool, seed: i64) -> PathBuf {
    tiny_target_dir(dir, "llama", tied, None, seed)
}

/// A tiny random target of a family ("llama", "qwen2" with q/k/v biases, "qwen3" with q/k
/// norms), optionally with a `rope_scaling` entry.
pub fn tiny_target_dir(
    dir: &Path,
    model_type: &str,
    tied: bool,
    rope_scaling: Option<serde_json::Value>,
    seed: i64,
) -> PathBuf {
    let (h, i, layers, heads, kv, d, v) = (32i64, 64i64, 4i64, 4i64, 2i64, 8i64, 50i64);
    let config = serde_json::json!({
        "architectures": ["TinyForCausalLM"], "model_type": model_type,
        "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": v,
        "tie_word_embeddings": tied, "max_position_embeddings": 128, "hidden_act": "silu",
        "eos_token_id": 2, "rope_scaling": rope_scaling
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let cpu = (Kind::Float, tch::Device::Cpu);
    // A generator of its own: libtorch's global one is shared by the tests running in parallel.
    let rng = std::cell::RefCell::new(Lcg(seed as u64 ^ 0x5DEECE66D));
    let randn = |shape: &[i64]| {
        let n: i64 = shape.iter().product();
        let values: Vec<f32> = (0..n)
            // next_u32 gives 31 random bits: uniform in [-0.35, 0.35) (std 0.2)
            .map(|_| (rng.borrow_mut().next_u32() as f32 / (1u64 << 31) as f32 - 0.5) * 0.7)
            .collect();
        Tensor::from_slice(&values).view(shape)
    };
    let mut tensors: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".into(), randn(&[v, h])),
        (
            "model.norm.weight".into(),
            Tensor::ones([h], cpu) + randn(&[h]),
        ),
    ];
    if !tied {
        tensors.push(("lm_head.weight".into(), randn(&[v, h])));
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let mut parts = vec![
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![heads * d, h]),
            ("self_attn.k_proj.weight", vec![kv * d, h]),
            ("self_attn.v_proj.weight", vec![kv * d, h]),
            ("self_attn.o_proj.weight", vec![h, heads * d]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ];
        if model_type == "qwen2" {
            parts.push(("self_attn.q_proj.bias", vec![heads * d]));
            parts.push(("self_attn.k_proj.bias", vec![kv * d]));
            parts.push(("self_attn.v_proj.bias", vec![kv * d]));
        }
        if model_type == "qwen3" {
            parts.push(("self_attn.q_norm.weight", vec![d]));
            parts.push(("self_attn.k_norm.weight", vec![d]));
        }
        for (name, shape) in parts {
            let t = if name.ends_with("norm.weight") {
                Tensor::ones(&shape[..], cpu) + randn(&shape)
            } else {
                randn(&shape)
            };
            tensors.push((format!("{p}.{name}"), t));
        }
    }
    Tensor::write_safetensors(&tensors, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

/// The demo assets that `make setup` creates; tests that need real numbers use them.
pub fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/demo")
}

pub fn require_demo(path: &Path) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: run `make setup` (scripts/setup-demo.sh) first",
        path.display()
    );
    path.to_path_buf()
}

/// Writes token lists and loss masks as an Arrow IPC stream with `input_ids` (list<int32>) and
/// `loss_mask` (list<int8>) columns.
pub fn write_token_dataset(path: &Path, rows: &[(Vec<i32>, Vec<i8>)]) {
    use arrow::array::{ArrayRef, Int32Builder, Int8Builder, ListBuilder, RecordBatch};
    use std::sync::Arc;
    let mut ids = ListBuilder::new(Int32Builder::new());
    let mut masks = ListBuilder::new(Int8Builder::new());
    for (i, m) in rows {
        i.iter().for_each(|&t| ids.values().append_value(t));
        ids.append(true);
        m.iter().for_each(|&t| masks.values().append_value(t));
        masks.append(true);
    }
    let batch = RecordBatch::try_from_iter([
        ("input_ids", Arc::new(ids.finish()) as ArrayRef),
        ("loss_mask", Arc::new(masks.finish()) as ArrayRef),
    ])
    .unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = arrow::ipc::writer::StreamWriter::try_new(file, &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
}

/// A tiny random target and a small data set with a learnable rule (each token follows from
/// the previous one; tokens 3..48, never the tiny config's mask token 1; loss from token 4 on).
pub struct TinyRun {
    pub tmp: tempfile::TempDir,
    pub target: PathBuf,
    pub data: PathBuf,
}

/// `train --config configs/tiny.toml` on `i` into `run_dir`, without the screen, with `--set`
/// overrides.
pub fn tiny_train_args(i: &TinyRun, run_dir: &Path, set: &[&str]) -> Vec<String> {
    let mut args = tiny_screen_train_args(i, run_dir, set);
    args.push("--no-tui".into());
    args
}

/// [`tiny_train_args`] with the control room on the terminal.
pub fn tiny_screen_train_args(i: &TinyRun, run_dir: &Path, set: &[&str]) -> Vec<String> {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let mut args: Vec<String> = vec![
        "train".into(),
        "--config".into(),
        config.display().to_string(),
        "--set".into(),
        format!("model.target={}", i.target.display()),
        "--set".into(),
        format!("data.path={}", i.data.display()),
        "--run-dir".into(),
        run_dir.display().to_string(),
    ];
    for s in set {
        args.push("--set".into());
        args.push((*s).into());
    }
    args
}

pub fn tiny_run(rows: usize, seed: i64) -> TinyRun {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("target"), "llama", false, None, seed);
    let data = tmp.path().join("data.arrow");
    let rows: Vec<(Vec<i32>, Vec<i8>)> = (0..rows)
        .map(|r| {
            let len = 24 + (r * 7) % 40;
            let mut t = (r * 11 % 45 + 3) as i32;
            let mut ids = Vec::with_capacity(len);
            for _ in 0..len {
                ids.push(t);
                t = (t * 7 + 3) % 45 + 3;
            }
            let mask = (0..len).map(|k| (k >= 4) as i8).collect();
            (ids, mask)
        })
        .collect();
    write_token_dataset(&data, &rows);
    TinyRun { tmp, target, data }
}

/// The benchmark assets that `make setup` creates (`scripts/setup-bench-data.sh`): Qwen3's
/// tokenizer in `qwen3-tokenizer/` and the tokenised ShareGPT sample.
pub fn bench_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/bench")
}

pub fn require_bench(path: &Path) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: run `make setup` (scripts/setup-bench-data.sh) first",
        path.display()
    );
    path.to_path_buf()
}

/// The events of category `cat` ("cpu_op", "kernel", ...) of a profiler trace (Chrome trace
/// JSON, as `--trace` writes it).
pub fn trace_events(path: &Path, cat: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().cloned().unwrap_or_default();
    events.into_iter().filter(|e| e["cat"] == cat).collect()
}

/// Rows (id, input_ids, loss_mask) of a dataset split folder or file written by prepare-data or
/// regenerate.
#[allow(dead_code)]
pub fn split_rows(split: &Path) -> Vec<(String, Vec<u32>, Vec<u8>)> {
    use dflash_tui::data::arrow_io::{read_string_column, read_token_data};
    let data = read_token_data(split, "input_ids", Some("loss_mask")).unwrap();
    let ids = read_string_column(split, "id").unwrap().unwrap();
    let masks = data.masks.unwrap();
    (0..data.ids.len())
        .map(|r| {
            let (s, e) = (data.ids.offsets[r], data.ids.offsets[r + 1]);
            (
                ids[r].clone(),
                data.ids.get(r).to_vec(),
                masks[s..e].to_vec(),
            )
        })
        .collect()
}

/// Runs the binary (its log at warn); (success, stdout, stderr).
pub fn dflash<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(args)
        .env("DFLASH_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the binary (its log at warn) and fails the test with its stderr unless it succeeds;
/// its stdout.
#[track_caller]
pub fn dflash_ok<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let (ok, stdout, stderr) = dflash(args);
    assert!(ok, "{stderr}");
    stdout
}

/// `dflash-tui ctl RUN_DIR WORDS...`: (success, stdout and stderr).
pub fn ctl(run_dir: &Path, words: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .arg("ctl")
        .arg(run_dir)
        .args(words)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Polls `f` (a screen or a file: nothing to wait on) every 100 ms until it gives a value.
pub fn wait_until<T>(
    what: &str,
    limit: std::time::Duration,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let t = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
