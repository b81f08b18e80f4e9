//! A reader for GGUF files (the llama.cpp model format): header, metadata and tensor table,
//! with the tensor data memory-mapped.
//!
//! Layout (little endian): magic "GGUF", version u32, tensor count u64, metadata count u64,
//! metadata entries (key string, value type u32, value), tensor infos (name, n_dims u32,
//! dims u64 each with the fastest-varying dimension first, ggml type u32, offset u64), padding to
//! `general.alignment` (default 32), then the tensor data.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Guards against absurd counts in a corrupt header before anything is allocated.
const MAX_ENTRIES: u64 = 1 << 24;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (starts with {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: String },
    #[error("{path}: unsupported GGUF version {version} (supported: 2 and 3)")]
    BadVersion { path: PathBuf, version: u32 },
    #[error("{path}: file is truncated: needed {needed} bytes at offset {offset} for {what}, but the file has {len} bytes")]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("{path}: corrupt header: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: metadata key {key:?} {reason}")]
    Metadata {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("{path}: tensor {tensor:?}: {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            // Through the shortest decimal form, so 1e-5 stored as f32 reads as 1e-5.
            MetaValue::F32(v) => v.to_string().parse().ok(),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest (the columns of a row-major matrix).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub(crate) fn element_count(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in PyTorch / safetensors order (slowest dimension first).
    pub(crate) fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
    map: Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let len = self.bytes.len() as u64;
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= len);
        match end {
            Some(end) => {
                let slice = &self.bytes[self.pos..end as usize];
                self.pos = end as usize;
                Ok(slice)
            }
            None => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                len,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        // Token strings in some files are not valid UTF-8 (byte tokens); keep them lossless-ish.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn corrupt(&self, reason: String) -> GgufError {
        GgufError::Corrupt {
            path: self.path.to_path_buf(),
            reason,
        }
    }

    fn value(&mut self, value_type: u32, key: &str, depth: u32) -> Result<MetaValue, GgufError> {
        let what = format!("metadata value of {key:?}");
        Ok(match value_type {
            0 => MetaValue::U8(self.array::<1>(&what)?[0]),
            1 => MetaValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => MetaValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => MetaValue::String(self.string(&what)?),
            9 => {
                if depth > 4 {
                    return Err(self.corrupt(format!("arrays nested too deeply in {key:?}")));
                }
                let item_type = self.u32(&what)?;
                let len = self.u64(&what)?;
                if len > MAX_ENTRIES * 4 {
                    return Err(self.corrupt(format!("array {key:?} claims {len} items")));
                }
                let mut items = Vec::with_capacity(len.min(1 << 20) as usize);
                for _ in 0..len {
                    items.push(self.value(item_type, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            other => {
                return Err(self.corrupt(format!(
                    "metadata key {key:?} has unknown value type {other}"
                )))
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses the header; tensor data stays on disk (memory-mapped).
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = File::open(path).map_err(|source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only; a file changed underneath by another process can at
        // worst yield wrong values, which the import reports as such.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cur = Cursor {
            bytes: &map,
            pos: 0,
            path,
        };
        if map.len() < 4 || &map[..4] != MAGIC {
            let found = String::from_utf8_lossy(&map[..map.len().min(4)]).into_owned();
            return Err(GgufError::BadMagic {
                path: path.to_path_buf(),
                found,
            });
        }
        cur.take(4, "magic")?;
        let version = cur.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::BadVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let tensor_count = cur.u64("tensor count")?;
        let kv_count = cur.u64("metadata count")?;
        if tensor_count > MAX_ENTRIES || kv_count > MAX_ENTRIES {
            return Err(cur.corrupt(format!(
                "implausible counts: {tensor_count} tensors, {kv_count} metadata entries"
            )));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = cur.string("metadata key")?;
            let value_type = cur.u32("metadata value type")?;
            let value = cur.value(value_type, &key, 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = cur.string("tensor name")?;
            let what = format!("tensor info of {name:?}");
            let n_dims = cur.u32(&what)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(cur.corrupt(format!("tensor {name:?} has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(cur.u64(&what)?);
            }
            let ggml_type = GgmlType::from_id(cur.u32(&what)?);
            let offset = cur.u64(&what)?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Metadata {
                        path: path.to_path_buf(),
                        key: "general.alignment".into(),
                        reason: format!("must be a power of two, found {v:?}"),
                    })
                }
            },
        };
        let data_start = (cur.pos as u64).div_ceil(alignment) * alignment;
        let gguf = GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data_start,
            map,
        };
        for info in &gguf.tensors {
            gguf.check_extent(info)?;
        }
        Ok(gguf)
    }

    fn check_extent(&self, info: &TensorInfo) -> Result<(), GgufError> {
        let Some(size) = info.ggml_type.byte_size(info.element_count()) else {
            // Unknown or unsupported types are reported by whoever wants the data.
            return Ok(());
        };
        let start = self.data_start + info.offset;
        let len = self.map.len() as u64;
        if start.checked_add(size).is_none_or(|end| end > len) {
            return Err(GgufError::Truncated {
                path: self.path.clone(),
                what: format!("the data of tensor {:?}", info.name),
                offset: start,
                needed: size,
                len,
            });
        }
        Ok(())
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (possibly quantised) bytes of a tensor.
    pub(crate) fn tensor_bytes(&self, info: &TensorInfo) -> Result<&[u8], GgufError> {
        let size = info
            .ggml_type
            .byte_size(info.element_count())
            .ok_or_else(|| self.unsupported(info))?;
        let start = (self.data_start + info.offset) as usize;
        Ok(&self.map[start..start + size as usize])
    }

    /// The tensor's values as f32, in row-major order of [`TensorInfo::torch_shape`].
    pub fn dequantize(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let bytes = self.tensor_bytes(info)?;
        info.ggml_type
            .dequantize(bytes, info.element_count() as usize)
            .ok_or_else(|| self.unsupported(info))
    }

    pub fn unsupported(&self, info: &TensorInfo) -> GgufError {
        GgufError::Tensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            reason: format!(
                "uses ggml type {}, which is not supported (supported: {})",
                info.ggml_type,
                GgmlType::SUPPORTED_NAMES
            ),
        }
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn missing(&self, key: &str, reason: &str) -> GgufError {
        GgufError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn require_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self
            .get(key)
            .ok_or_else(|| self.missing(key, "is missing"))?;
        v.as_u64()
            .ok_or_else(|| self.missing(key, &format!("must be an unsigned integer, found {v:?}")))
    }

    pub(crate) fn optional_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.require_u64(key).map(Some),
        }
    }

    pub(crate) fn optional_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.missing(key, &format!("must be a number, found {v:?}"))),
        }
    }

    pub(crate) fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self
            .get(key)
            .ok_or_else(|| self.missing(key, "is missing"))?;
        v.as_str()
            .ok_or_else(|| self.missing(key, "must be a string"))
    }

    pub(crate) fn string_array(&self, key: &str) -> Result<Vec<String>, GgufError> {
        let v = self
            .get(key)
            .ok_or_else(|| self.missing(key, "is missing"))?;
        let items = v
            .as_array()
            .ok_or_else(|| self.missing(key, "must be an array of strings"))?;
        items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.missing(key, "must be an array of strings"))
            })
            .collect()
    }

    pub(crate) fn i64_array(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let items = v
            .as_array()
            .ok_or_else(|| self.missing(key, "must be an array of integers"))?;
        items
            .iter()
            .map(|i| {
                i.as_i64()
                    .ok_or_else(|| self.missing(key, "must be an array of integers"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
