//! GGUF (llama.cpp) models: reading, dequantising, and importing as Hugging Face folders.

pub mod import;
pub mod quant;
pub mod reader;
pub mod vocab;

pub use import::{import_gguf, ImportSummary, OutputDtype};
pub use quant::GgmlType;
pub use reader::{GgufError, GgufFile, MetaValue, TensorInfo};
