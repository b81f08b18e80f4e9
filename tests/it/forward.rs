//! The target forward pass on tiny random models: causality, batching, the KV cache.

use crate::common;

use common::tiny_llama_dir;
use dflash_tui::model::{KvCache, TargetModel};
use tch::{Device, Kind, Tensor};

fn model(tied: bool) -> (tempfile::TempDir, TargetModel) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_llama_dir(&tmp.path().join("m"), tied, 42);
    let model = TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    (tmp, model)
}

fn ids(v: &[i64]) -> Tensor {
    Tensor::from_slice(v).unsqueeze(0)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn changing_a_later_token_leaves_earlier_logits_unchanged() {
    for tied in [true, false] {
        let (_tmp, m) = model(tied);
        let a = m.forward(&ids(&[5, 9, 13, 17, 21, 25]), None);
        let b = m.forward(&ids(&[5, 9, 13, 40, 21, 25]), None);
        assert!(max_diff(&a.narrow(1, 0, 3), &b.narrow(1, 0, 3)) < 1e-6);
        // ... and does change the logits from that position on (the test can fail).
        assert!(max_diff(&a.narrow(1, 3, 3), &b.narrow(1, 3, 3)) > 1e-4);
    }
}

#[test]
fn batch_of_two_equals_two_single_runs() {
    let (_tmp, m) = model(true);
    let first = [3i64, 7, 11, 19, 23, 29, 31];
    let second = [4i64, 8, 15, 16];
    // right-padded batch: padding after the real tokens is never visible to them (causal)
    let mut padded = second.to_vec();
    padded.resize(first.len(), 0);
    let batch = Tensor::stack(
        &[Tensor::from_slice(&first), Tensor::from_slice(&padded)],
        0,
    );
    let together = m.forward(&batch, None);
    let alone_1 = m.forward(&ids(&first), None);
    let alone_2 = m.forward(&ids(&second), None);
    assert!(max_diff(&together.narrow(0, 0, 1), &alone_1) < 1e-5);
    assert!(max_diff(&together.narrow(0, 1, 1).narrow(1, 0, 4), &alone_2) < 1e-5);
}

#[test]
fn kv_cache_continuation_and_rollback_match_the_full_forward() {
    let (_tmp, m) = model(false);
    let seq = [1i64, 6, 12, 18, 24, 30, 36, 42, 48];
    let full = m.forward(&ids(&seq), None);
    let mut cache = KvCache::new();
    let head = m.forward(&ids(&seq[..4]), Some(&mut cache));
    let tail = m.forward(&ids(&seq[4..]), Some(&mut cache)); // several tokens at once
    assert_eq!(cache.len(), 9);
    assert!(max_diff(&head, &full.narrow(1, 0, 4)) < 1e-5);
    assert!(max_diff(&tail, &full.narrow(1, 4, 5)) < 1e-5);
    // roll back to 6 tokens, then feed other tokens: must equal a fresh forward of that text
    cache.truncate(6).unwrap();
    let other = m.forward(&ids(&[2, 3]), Some(&mut cache));
    let fresh = m.forward(&ids(&[1, 6, 12, 18, 24, 30, 2, 3]), None);
    assert!(max_diff(&other, &fresh.narrow(1, 6, 2)) < 1e-5);
}

#[test]
fn weights_are_frozen() {
    let (_tmp, m) = model(true);
    let out = m.forward(&ids(&[1, 2, 3]), None);
    assert!(!out.requires_grad());
    // embedding + final norm + 4 layers of (2 norms, q, o, k, v, gate, up, down)
    assert_eq!(
        m.parameter_count(),
        50 * 32 + 32 + 4 * (2 * 32 + 32 * 32 * 2 + 16 * 32 * 2 + 3 * 64 * 32)
    );
}
