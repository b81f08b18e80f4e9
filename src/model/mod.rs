//! Models: the frozen target (Llama, Qwen2, Qwen3, Qwen3.5 hybrid families, their
//! mixtures of experts) and what it needs (config,
//! weights, decoding), and the DFlash drafter.

pub(crate) mod config;
mod config_checks;
pub mod decode;
pub(crate) mod describe;
pub mod drafter;
pub(crate) mod drafter_config;
pub(crate) mod drafter_layout;
pub(crate) mod feed_forward;
pub(crate) mod gated_delta;
pub mod generate;
pub(crate) mod hybrid;
pub(crate) mod hybrid_config;
mod hybrid_slots;
pub(crate) mod kv_cache;
pub mod layers;
pub(crate) mod mask_token;
pub mod memory;
pub(crate) mod moe;
pub(crate) mod rope_scaling;
pub(crate) mod slot_states;
pub(crate) mod slots;
pub(crate) mod target;
pub(crate) mod weights;

pub use config::{Family, TargetConfig};
pub use describe::describe_target;
pub use drafter::{AnchorBatch, Drafter, FrozenHead};
pub use drafter_config::{default_target_layer_ids, DrafterConfig, DrafterShape};
pub(crate) use drafter_config::{MAX_BLOCK_SIZE, MAX_DRAFTER_LAYERS};
pub use drafter_layout::LayerType;
pub use gated_delta::{gated_delta_rule, gated_delta_rule_steps, GdnState};
pub use generate::model_eos_ids;
pub use hybrid_config::{GdnLayout, GdnShape, HybridSettings, LayerKind};
pub use slot_states::SlotStates;
pub use slots::{SeqSpan, SlotAttention, SlotBatch, SlotCache};
pub use target::{ForwardRequest, KvCache, SharedTarget, SlotLogits, TargetModel, TargetOutput};
