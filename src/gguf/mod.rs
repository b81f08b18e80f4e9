//! GGUF (llama.cpp) models: reading, dequantising, and importing as Hugging Face folders.

pub(crate) mod import;
pub(crate) mod quant;
pub(crate) mod reader;
pub(crate) mod vocab;

pub use import::{import_gguf, ImportSummary, OutputDtype};
pub use quant::GgmlType;
pub use reader::{GgufError, GgufFile, MetaValue, TensorInfo};
