//! A tiny target with a fresh drafter, in f32 on the CPU, for the decoding and validation tests.

use std::path::Path;

use dflash_tui::model::{Drafter, DrafterConfig, DrafterShape, FrozenHead, TargetModel};
use tch::{Device, Kind};

/// The tiny random Qwen3 target (seed 21) in a temporary folder (its `t`), with
/// [`models_of`]'s drafter.
pub fn tiny_models(block: i64) -> (tempfile::TempDir, TargetModel, Drafter, FrozenHead) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = super::tiny_target_dir(&tmp.path().join("t"), "qwen3", false, None, 21);
    let (target, drafter, head) = models_of(&dir, block);
    (tmp, target, drafter, head)
}

/// The target in `dir` (f32) and a freshly initialised drafter for it: one layer, blocks of
/// `block`, mask token 1, two taps (seed 3).
pub fn models_of(dir: &Path, block: i64) -> (TargetModel, Drafter, FrozenHead) {
    let target = TargetModel::load(dir, Device::Cpu, Kind::Float).unwrap();
    let config = DrafterConfig::for_target(
        &target.config,
        &DrafterShape {
            layers: 1,
            block_size: block,
            mask_token_id: 1,
            target_layer_ids: None,
            num_taps: 2,
        },
    )
    .unwrap();
    let drafter = Drafter::init(config, Device::Cpu, Kind::Float, 3).unwrap();
    let head = FrozenHead::from_target(&target, Device::Cpu, Kind::Float);
    (target, drafter, head)
}
