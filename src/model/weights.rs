//! Reading Hugging Face safetensors weights (single file or sharded with an index) into tch
//! tensors of a chosen dtype and device.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};
use tch::{Device, Kind, Tensor};

/// The weight files of one model folder, memory-mapped, their headers parsed once: a mixture
/// of experts stores thousands of tensors (Qwen3-30B-A3B 18k experts' products). Measured on
/// one file of 18,432 tiny tensors: a header parse takes 23 ms, so parsing it per tensor took
/// 7 minutes; opened once (48 ms), all the loads take 25 ms.
pub(crate) struct WeightFiles {
    dir: PathBuf,
    /// Each file's path, map, and where its data starts (after the header).
    files: Vec<(PathBuf, Mmap, usize)>,
    /// tensor name, as the causal LM names it -> where it is stored
    index: HashMap<String, Stored>,
}

/// One tensor of a weight file: the file (index into `files`), its name there, its dtype,
/// shape and byte range within the file's data.
struct Stored {
    file: usize,
    name: String,
    info: TensorInfo,
}

/// Where multimodal checkpoints keep their text model, as (prefix in the file, prefix of the
/// causal LM): transformers 5's `model.language_model.*` (LM head at `lm_head.weight`) and the
/// older `language_model.model.*` (LM head at `language_model.lm_head.weight`).
const TEXT_MODEL_PREFIXES: [(&str, &str); 3] = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];

/// Whether the tensor names are a multimodal model's: no `model.embed_tokens.weight`, but a
/// text model's under one of [`TEXT_MODEL_PREFIXES`].
fn text_model_nested<'a>(mut names: impl Iterator<Item = &'a str> + Clone) -> bool {
    !names.clone().any(|n| n == "model.embed_tokens.weight")
        && names.any(|n| {
            n == "model.language_model.embed_tokens.weight"
                || n == "language_model.model.embed_tokens.weight"
        })
}

/// The causal LM's name of a stored tensor (in a nested file, the text model's tensors lose
/// their prefix; the others, e.g. the vision tower's, keep their names and are never asked for).
fn causal_lm_name(stored: &str, nested: bool) -> String {
    TEXT_MODEL_PREFIXES
        .iter()
        .filter(|_| nested)
        .find_map(|(from, to)| stored.strip_prefix(from).map(|rest| format!("{to}{rest}")))
        .unwrap_or_else(|| stored.to_string())
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if single.is_file() {
            vec!["model.safetensors".into()]
        } else if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("{}: cannot read", index_path.display()))?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no \"weight_map\" object", index_path.display()))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            bail!(
                "{}: no model.safetensors or model.safetensors.index.json",
                dir.display()
            );
        };

        let mut files = Vec::new();
        let mut stored = Vec::new();
        for name in shard_names {
            let path = dir.join(&name);
            let file =
                File::open(&path).with_context(|| format!("{}: cannot open", path.display()))?;
            // SAFETY: read-only map of a weights file that is not modified while we run.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("{}: cannot map", path.display()))?;
            let (header, metadata) = SafeTensors::read_metadata(&map)
                .with_context(|| format!("{}: not a valid safetensors file", path.display()))?;
            let file = files.len();
            stored.extend(metadata.tensors().into_iter().map(|(name, info)| Stored {
                file,
                name,
                info: info.clone(),
            }));
            files.push((path, map, 8 + header));
        }
        let nested = text_model_nested(stored.iter().map(|t| t.name.as_str()));
        let index = stored
            .into_iter()
            .map(|t| (causal_lm_name(&t.name, nested), t))
            .collect();
        Ok(WeightFiles {
            dir: dir.to_path_buf(),
            files,
            index,
        })
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Loads one tensor, checks its shape, converts it to `kind` on `device`.
    pub(crate) fn load(
        &self,
        name: &str,
        shape: &[i64],
        kind: Kind,
        device: Device,
    ) -> Result<Tensor> {
        let stored = self.index.get(name).with_context(|| {
            format!(
                "{}: the weights have no tensor {name:?}",
                self.dir.display()
            )
        })?;
        let (path, map, data_start) = &self.files[stored.file];
        let name = stored.name.as_str();
        let info = &stored.info;
        let (from, to) = info.data_offsets;
        let bytes = map
            .get(data_start + from..data_start + to)
            .with_context(|| format!("{}: tensor {name:?} lies past the end", path.display()))?;
        let view = safetensors::tensor::TensorView::new(info.dtype, info.shape.clone(), bytes)
            .with_context(|| format!("{}: cannot read tensor {name:?}", path.display()))?;
        let found: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        if found != shape {
            bail!(
                "{}: tensor {name:?} has shape {found:?}, the config implies {shape:?}",
                path.display()
            );
        }
        let src_kind = match view.dtype() {
            Dtype::F32 => Kind::Float,
            Dtype::F16 => Kind::Half,
            Dtype::BF16 => Kind::BFloat16,
            Dtype::F64 => Kind::Double,
            other => bail!(
                "{}: tensor {name:?} has dtype {other:?}; weights must be floating point",
                path.display()
            ),
        };
        let tensor = Tensor::f_from_data_size(view.data(), &found, src_kind)
            .with_context(|| format!("{}: tensor {name:?}", path.display()))?;
        Ok(tensor.to_device(device).to_kind(kind))
    }
}

/// Bytes of a tensor for writing, with its safetensors dtype.
struct TensorBytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &TensorBytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Where a model's tensors come from: weight files, or a seeded random initialisation.
pub(crate) trait WeightSource {
    fn contains(&self, name: &str) -> bool;
    fn load(&self, name: &str, shape: &[i64], kind: Kind, device: Device) -> Result<Tensor>;
}

impl WeightSource for WeightFiles {
    fn contains(&self, name: &str) -> bool {
        WeightFiles::contains(self, name)
    }
    fn load(&self, name: &str, shape: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
        WeightFiles::load(self, name, shape, kind, device)
    }
}

/// A seed for the tensor `name` of a model drawn with `seed`: FNV-1a of the name, mixed with
/// the seed (the same name and seed always give the same value).
pub(crate) fn name_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Random weights of a model's shape, for benchmarks that need no trained model: norms are
/// the identity (weight 1, or 0 where norms are zero-centred, `x * (1 + w)`), everything else
/// is drawn from N(0, std) on the device (seeded per tensor name, so a shape always gets the
/// same weights). Gated DeltaNet layers get what transformers initialises: `A_log` = log A
/// with A log-uniform in [1, 16], `dt_bias` 1, the convolution U(-1/sqrt(width), 1/sqrt(width)).
pub(crate) struct RandomWeights {
    pub seed: u64,
    pub std: f64,
    /// Names that exist besides the ones every model has (e.g. an untied `lm_head.weight`).
    pub present: Box<dyn Fn(&str) -> bool>,
    /// The model's RMSNorms are zero-centred (the Qwen3.5 hybrids'; their Gated DeltaNet
    /// output norm is not).
    pub zero_centred_norms: bool,
    /// Where the numbers are drawn: `None` on the model's device (fast, but each device's
    /// generator gives other numbers), `Some(Device::Cpu)` for the same weights on every device.
    pub draw_on: Option<Device>,
}

impl WeightSource for RandomWeights {
    fn contains(&self, name: &str) -> bool {
        (self.present)(name)
    }
    fn load(&self, name: &str, shape: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
        let gated_norm = name.ends_with("linear_attn.norm.weight");
        if name.ends_with("norm.weight") && !gated_norm && self.zero_centred_norms {
            return Ok(Tensor::zeros(shape, (kind, device)));
        }
        if name.ends_with("norm.weight") || name.ends_with("dt_bias") {
            return Ok(Tensor::ones(shape, (kind, device)));
        }
        // one reproducible stream per tensor
        tch::manual_seed((name_seed(self.seed, name) >> 1) as i64);
        Ok(tch::no_grad(|| {
            let mut t = Tensor::empty(shape, (kind, self.draw_on.unwrap_or(device)));
            let drawn = if name.ends_with("A_log") {
                t.uniform_(0.0, 16f64.ln())
            } else if name.ends_with("conv1d.weight") {
                let bound = 1.0 / (*shape.last().unwrap_or(&1) as f64).sqrt();
                t.uniform_(-bound, bound)
            } else {
                t.normal_(0.0, self.std)
            };
            drawn.to_device(device)
        }))
    }
}

/// Writes tensors to a safetensors file with the `{"format": "pt"}` metadata that
/// `transformers` expects.
pub(crate) fn save_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut prepared = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let dtype = match t.kind() {
            Kind::Float => Dtype::F32,
            Kind::BFloat16 => Dtype::BF16,
            Kind::Half => Dtype::F16,
            Kind::Double => Dtype::F64,
            Kind::Int64 => Dtype::I64,
            Kind::Int => Dtype::I32,
            other => bail!("tensor {name:?}: cannot save dtype {other:?}"),
        };
        let cpu = t.detach().to_device(Device::Cpu).contiguous();
        let numel = cpu.numel();
        let mut data = vec![0u8; numel * dtype.bitsize() / 8];
        cpu.f_copy_data_u8(&mut data, numel)
            .with_context(|| format!("tensor {name:?}: cannot copy to host"))?;
        let shape = cpu.size().iter().map(|&d| d as usize).collect();
        prepared.push((name.as_str(), TensorBytes { dtype, shape, data }));
    }
    safetensors::serialize_to_file(
        prepared.iter().map(|(n, t)| (*n, t)),
        Some(HashMap::from([("format".to_string(), "pt".to_string())])),
        path,
    )
    .with_context(|| format!("{}: cannot write", path.display()))
}
