//! `import-gguf`: a GGUF Llama-family model -> a Hugging Face model directory
//! (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
//! generation_config.json).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, View};

use super::quant::GgmlType;
use super::reader::{GgufFile, TensorInfo};
use super::vocab::{self, VocabInfo};
use crate::fsutil::{write_json, StagedDir};

/// Element type of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputDtype {
    /// float32: exact for every supported GGUF type (dequantised values are exact in f32).
    F32,
    Bf16,
    F16,
}

impl OutputDtype {
    fn safetensors(self) -> Dtype {
        match self {
            OutputDtype::F32 => Dtype::F32,
            OutputDtype::Bf16 => Dtype::BF16,
            OutputDtype::F16 => Dtype::F16,
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            OutputDtype::F32 => "float32",
            OutputDtype::Bf16 => "bfloat16",
            OutputDtype::F16 => "float16",
        }
    }

    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            OutputDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            OutputDtype::Bf16 => values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            OutputDtype::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }
}

/// Model hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaHparams {
    pub layers: u64,
    pub hidden: u64,
    pub intermediate: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub context_length: u64,
    pub vocab_size: u64,
    pub tied_embeddings: bool,
}

impl LlamaHparams {
    pub fn read(gguf: &GgufFile, vocab_len: usize) -> Result<Self> {
        let arch = gguf.require_str("general.architecture")?;
        if arch != "llama" {
            bail!(
                "{}: general.architecture is {arch:?}; import-gguf converts Llama-architecture models (SmolLM, Llama, Mistral-style)",
                gguf.path.display()
            );
        }
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = gguf.require_u64(&key("embedding_length"))?;
        let heads = gguf.require_u64(&key("attention.head_count"))?;
        if heads == 0 || hidden % heads != 0 {
            bail!(
                "{}: {} = {heads} does not divide the hidden size {hidden}",
                gguf.path.display(),
                key("attention.head_count")
            );
        }
        let kv_heads = gguf
            .optional_u64(&key("attention.head_count_kv"))?
            .unwrap_or(heads);
        if kv_heads == 0 || heads % kv_heads != 0 {
            bail!(
                "{}: {} = {kv_heads} must divide the head count {heads}",
                gguf.path.display(),
                key("attention.head_count_kv")
            );
        }
        Ok(LlamaHparams {
            layers: gguf.require_u64(&key("block_count"))?,
            hidden,
            intermediate: gguf.require_u64(&key("feed_forward_length"))?,
            heads,
            kv_heads,
            head_dim: gguf
                .optional_u64(&key("attention.key_length"))?
                .unwrap_or(hidden / heads),
            rms_eps: gguf
                .optional_f64(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope_theta: gguf
                .optional_f64(&key("rope.freq_base"))?
                .unwrap_or(10_000.0),
            context_length: gguf.optional_u64(&key("context_length"))?.unwrap_or(2048),
            vocab_size: gguf
                .optional_u64(&key("vocab_size"))?
                .unwrap_or(vocab_len as u64),
            tied_embeddings: gguf.tensor("output.weight").is_none(),
        })
    }
}

/// How a GGUF tensor becomes a Hugging Face tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mapping {
    hf_name: String,
    /// Undo llama.cpp's RoPE row permutation with this many heads.
    unpermute_heads: Option<u64>,
}

fn map_name(name: &str, hp: &LlamaHparams) -> Option<Mapping> {
    let plain = |n: &str| {
        Some(Mapping {
            hf_name: n.to_string(),
            unpermute_heads: None,
        })
    };
    match name {
        "token_embd.weight" => return plain("model.embed_tokens.weight"),
        "output_norm.weight" => return plain("model.norm.weight"),
        "output.weight" => return plain("lm_head.weight"),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: u64 = layer.parse().ok()?;
    if layer >= hp.layers {
        return None;
    }
    let (module, suffix) = part.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let (hf, unpermute) = match module {
        "attn_norm" => ("input_layernorm", None),
        "ffn_norm" => ("post_attention_layernorm", None),
        "attn_q" => ("self_attn.q_proj", Some(hp.heads)),
        "attn_k" => ("self_attn.k_proj", Some(hp.kv_heads)),
        "attn_v" => ("self_attn.v_proj", None),
        "attn_output" => ("self_attn.o_proj", None),
        "ffn_gate" => ("mlp.gate_proj", None),
        "ffn_up" => ("mlp.up_proj", None),
        "ffn_down" => ("mlp.down_proj", None),
        _ => return None,
    };
    Some(Mapping {
        hf_name: format!("model.layers.{layer}.{hf}.{suffix}"),
        unpermute_heads: unpermute,
    })
}

/// Inverts llama.cpp's permutation of Q/K rows: the rows of each head were reordered from
/// [2, head_dim/2] (rotate-half layout) to [head_dim/2, 2] (interleaved pairs).
pub(crate) fn unpermute_rows(values: &[f32], rows: usize, heads: usize) -> Option<Vec<f32>> {
    if heads == 0
        || !rows.is_multiple_of(heads)
        || !(rows / heads).is_multiple_of(2)
        || !values.len().is_multiple_of(rows)
    {
        return None;
    }
    let cols = values.len() / rows;
    let half = rows / heads / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for pair in 0..half {
            for which in 0..2 {
                let src_row = h * 2 * half + pair * 2 + which;
                let dst_row = h * 2 * half + which * half + pair;
                out[dst_row * cols..(dst_row + 1) * cols]
                    .copy_from_slice(&values[src_row * cols..(src_row + 1) * cols]);
            }
        }
    }
    Some(out)
}

/// A tensor converted when the safetensors writer asks for its bytes, so that only one tensor
/// is held in memory at a time. Everything that can fail is checked before writing starts.
struct PendingTensor<'a> {
    gguf: &'a GgufFile,
    info: &'a TensorInfo,
    unpermute_heads: Option<u64>,
    shape: Vec<usize>,
    dtype: OutputDtype,
    /// A conversion failure inside `View::data` (which cannot return errors), checked after
    /// writing so that the staged output is discarded.
    failure: std::cell::RefCell<Option<anyhow::Error>>,
}

impl PendingTensor<'_> {
    fn convert(&self) -> Result<Vec<u8>> {
        let mut values = self.gguf.dequantize(self.info)?;
        if let Some(heads) = self.unpermute_heads {
            values = unpermute_rows(&values, self.shape[0], heads as usize).with_context(|| {
                format!(
                    "{}: tensor {:?} with shape {:?} cannot be split into {heads} heads",
                    self.gguf.path.display(),
                    self.info.name,
                    self.shape
                )
            })?;
        }
        Ok(self.dtype.encode(&values))
    }
}

impl View for &PendingTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.convert() {
            Ok(bytes) => Cow::Owned(bytes),
            Err(e) => {
                let zeros = vec![0u8; self.data_len()];
                *self.failure.borrow_mut() = Some(e);
                Cow::Owned(zeros)
            }
        }
    }

    fn data_len(&self) -> usize {
        let bytes = match self.dtype {
            OutputDtype::F32 => 4,
            OutputDtype::Bf16 | OutputDtype::F16 => 2,
        };
        self.shape.iter().product::<usize>() * bytes
    }
}

/// What an import did.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub out_dir: PathBuf,
    pub tensors: usize,
    pub parameters: u64,
    pub source_types: BTreeMap<String, usize>,
    pub hparams: LlamaHparams,
    pub vocab_size: usize,
}

/// Converts `gguf_path` into a Hugging Face model directory at `out_dir`. The directory appears
/// only when everything was written.
pub fn import_gguf(gguf_path: &Path, out_dir: &Path, dtype: OutputDtype) -> Result<ImportSummary> {
    let gguf = GgufFile::open(gguf_path)?;
    let (tokenizer, vocab_info) = vocab::build_tokenizer(&gguf)?;
    let hp = LlamaHparams::read(&gguf, vocab_info.tokens.len())?;

    // Check every tensor before anything is written.
    let plan = TensorPlan::check(&gguf, gguf_path, &hp, dtype)?;

    let staged = StagedDir::create(out_dir)?;
    let dir = staged.path();
    plan.write_safetensors(&dir.join("model.safetensors"), out_dir)?;
    write_json(
        &dir.join("config.json"),
        &hf_config(&hp, &vocab_info, dtype, gguf_path),
    )?;
    write_json(
        &dir.join("generation_config.json"),
        &generation_config(&vocab_info),
    )?;
    vocab::save_tokenizer(&tokenizer, &dir.join("tokenizer.json"))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &vocab::tokenizer_config(&vocab_info, hp.context_length),
    )?;
    let out_dir = staged.commit()?;
    Ok(ImportSummary {
        out_dir,
        tensors: plan.pending.len(),
        parameters: plan.parameters,
        source_types: plan.source_types,
        hparams: hp,
        vocab_size: vocab_info.tokens.len(),
    })
}

/// Every tensor of a GGUF file to write, checked, under its Hugging Face name, and what they
/// hold.
struct TensorPlan<'a> {
    pending: Vec<(String, PendingTensor<'a>)>,
    /// Tensors per GGUF element type.
    source_types: BTreeMap<String, usize>,
    parameters: u64,
}

impl<'a> TensorPlan<'a> {
    /// Maps and checks every tensor of `gguf` (read from `gguf_path`), and that the model has
    /// an embedding and a final norm.
    fn check(
        gguf: &'a GgufFile,
        gguf_path: &Path,
        hp: &LlamaHparams,
        dtype: OutputDtype,
    ) -> Result<TensorPlan<'a>> {
        let mut pending = Vec::new();
        let mut source_types = BTreeMap::new();
        let mut parameters = 0u64;
        for info in &gguf.tensors {
            if info.name == "rope_freqs.weight" {
                continue; // derived from the rope settings, not a weight
            }
            let (hf_name, tensor) = pending_tensor(gguf, gguf_path, info, hp, dtype)?;
            *source_types.entry(info.ggml_type.to_string()).or_insert(0) += 1;
            parameters += info.element_count();
            pending.push((hf_name, tensor));
        }
        for required in ["model.embed_tokens.weight", "model.norm.weight"] {
            if !pending.iter().any(|(n, _)| n == required) {
                bail!(
                    "{}: the model has no tensor for {required}",
                    gguf_path.display()
                );
            }
        }
        Ok(TensorPlan {
            pending,
            source_types,
            parameters,
        })
    }

    /// Writes the tensors to `path` (in the staged copy of `out_dir`), converting one at a
    /// time; a conversion failure is returned after writing.
    fn write_safetensors(&self, path: &Path, out_dir: &Path) -> Result<()> {
        safetensors::serialize_to_file(
            self.pending.iter().map(|(n, p)| (n.as_str(), p)),
            Some(std::collections::HashMap::from([(
                "format".to_string(),
                "pt".to_string(),
            )])),
            path,
        )
        .with_context(|| format!("{}: cannot write model.safetensors", out_dir.display()))?;
        for (_, p) in &self.pending {
            if let Some(e) = p.failure.borrow_mut().take() {
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The Hugging Face name of one GGUF tensor and its conversion, once checked: it has a
/// counterpart, a supported element type, and (for Q and K) rows that split into heads.
fn pending_tensor<'a>(
    gguf: &'a GgufFile,
    gguf_path: &Path,
    info: &'a TensorInfo,
    hp: &LlamaHparams,
    dtype: OutputDtype,
) -> Result<(String, PendingTensor<'a>)> {
    let mapping = map_name(&info.name, hp).with_context(|| {
        format!(
            "{}: tensor {:?} has no Hugging Face Llama counterpart",
            gguf_path.display(),
            info.name
        )
    })?;
    if matches!(info.ggml_type, GgmlType::Unsupported(_)) {
        return Err(gguf.unsupported(info).into());
    }
    let shape = info.torch_shape();
    if let Some(heads) = mapping.unpermute_heads {
        let rows = shape[0] as u64;
        if !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
            bail!(
                "{}: tensor {:?} has {rows} rows, which do not split into {heads} heads of even size",
                gguf_path.display(),
                info.name
            );
        }
    }
    Ok((
        mapping.hf_name,
        PendingTensor {
            gguf,
            info,
            unpermute_heads: mapping.unpermute_heads,
            shape,
            dtype,
            failure: Default::default(),
        },
    ))
}

/// config.json of the imported model.
fn hf_config(
    hp: &LlamaHparams,
    vocab_info: &VocabInfo,
    dtype: OutputDtype,
    gguf_path: &Path,
) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hp.hidden,
        "intermediate_size": hp.intermediate,
        "num_hidden_layers": hp.layers,
        "num_attention_heads": hp.heads,
        "num_key_value_heads": hp.kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hp.context_length,
        "rms_norm_eps": hp.rms_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": null,
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": hp.tied_embeddings,
        "vocab_size": hp.vocab_size,
        "bos_token_id": vocab_info.bos_id,
        "eos_token_id": vocab_info.eos_id,
        "pad_token_id": vocab_info.pad_id,
        "torch_dtype": dtype.torch_name(),
        "imported_from": gguf_path.file_name().map(|n| n.to_string_lossy().into_owned()),
    })
}

/// generation_config.json of the imported model: greedy, with its special tokens.
fn generation_config(vocab_info: &VocabInfo) -> serde_json::Value {
    serde_json::json!({
        "bos_token_id": vocab_info.bos_id,
        "eos_token_id": vocab_info.eos_id,
        "pad_token_id": vocab_info.pad_id,
        "do_sample": false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        // 2 heads of head_dim 4, 1 column: HF rows [h0: a0 a1 b0 b1 | h1: ...] are stored by
        // llama.cpp as [a0 b0 a1 b1 | ...].
        let hf: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let gguf = [0., 2., 1., 3., 4., 6., 5., 7.];
        assert_eq!(unpermute_rows(&gguf, 8, 2).unwrap(), hf);
        assert!(unpermute_rows(&gguf, 8, 3).is_none());
    }

    #[test]
    fn names_map_to_hugging_face_llama() {
        let hp = LlamaHparams {
            layers: 2,
            hidden: 8,
            intermediate: 16,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            rms_eps: 1e-5,
            rope_theta: 1e4,
            context_length: 64,
            vocab_size: 10,
            tied_embeddings: true,
        };
        let k = map_name("blk.1.attn_k.weight", &hp).unwrap();
        assert_eq!(k.hf_name, "model.layers.1.self_attn.k_proj.weight");
        assert_eq!(k.unpermute_heads, Some(1));
        assert_eq!(
            map_name("blk.0.ffn_norm.weight", &hp).unwrap().hf_name,
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert!(map_name("blk.2.attn_q.weight", &hp).is_none());
        assert!(map_name("blk.0.attn_q.scale", &hp).is_none());
    }
}
