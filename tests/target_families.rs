//! Tiny random targets of each family: causality, KV-cache decoding against the full forward,
//! tapped features, and the family-specific weights.

mod common;

use common::tiny_target_dir;
use dflash_tui::model::{ForwardRequest, KvCache, TargetModel};
use tch::{Device, Kind, Tensor};

/// Largest absolute difference allowed between the cached and the full forward (fp32).
const CACHE_TOLERANCE: f64 = 1e-5;

fn llama3_scaling() -> serde_json::Value {
    serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
}

fn families() -> Vec<(&'static str, Option<serde_json::Value>)> {
    vec![
        ("llama", None),
        ("llama", Some(llama3_scaling())),
        ("qwen2", None),
        ("qwen3", None),
    ]
}

fn load(
    model_type: &str,
    scaling: Option<serde_json::Value>,
    seed: i64,
) -> (tempfile::TempDir, TargetModel) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("m"), model_type, false, scaling, seed);
    let m = TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    (tmp, m)
}

fn ids(v: &[i64]) -> Tensor {
    Tensor::from_slice(v).unsqueeze(0)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn every_family_is_causal() {
    for (family, scaling) in families() {
        let (_t, m) = load(family, scaling, 3);
        let a = m.forward(&ids(&[5, 9, 13, 17, 21, 25, 29]), None);
        let b = m.forward(&ids(&[5, 9, 13, 17, 40, 25, 29]), None);
        assert!(
            max_diff(&a.narrow(1, 0, 4), &b.narrow(1, 0, 4)) < 1e-6,
            "{family}"
        );
        assert!(
            max_diff(&a.narrow(1, 4, 3), &b.narrow(1, 4, 3)) > 1e-4,
            "{family}"
        );
    }
}

#[test]
fn kv_cache_decoding_equals_the_full_forward() {
    let seq: Vec<i64> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
    for (family, scaling) in families() {
        let (_t, m) = load(family, scaling, 4);
        let full = m.forward(&ids(&seq), None);
        let mut cache = KvCache::new();
        let mut worst = 0f64;
        // prefill 10, then one token at a time
        let pre = m.forward(&ids(&seq[..10]), Some(&mut cache));
        worst = worst.max(max_diff(&pre, &full.narrow(1, 0, 10)));
        for (i, &t) in seq.iter().enumerate().skip(10) {
            let step = m.forward(&ids(&[t]), Some(&mut cache));
            worst = worst.max(max_diff(&step, &full.narrow(1, i as i64, 1)));
        }
        assert!(worst < CACHE_TOLERANCE, "{family}: max abs diff {worst}");
        // roll back 5 positions and decode them again
        cache.truncate(35);
        let again = m.forward(&ids(&seq[35..]), Some(&mut cache));
        assert!(
            max_diff(&again, &full.narrow(1, 35, 5)) < CACHE_TOLERANCE,
            "{family}"
        );
    }
}

#[test]
fn slot_cache_decoding_equals_the_full_forward() {
    // The decoding engine's path (a slot cache of fixed shape, the rotary table, blocks of
    // several tokens verified at once and rolled back by position) gives the full forward's
    // logits and tapped features for every family.
    use dflash_tui::model::decode::TargetDecoder;
    let seq: Vec<i64> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
    let taps = [0usize, 2];
    let req = ForwardRequest {
        tap_layers: taps.to_vec(),
        logits: true,
        ..Default::default()
    };
    for (family, scaling) in families() {
        let (_t, m) = load(family, scaling, 4);
        let full = m.run(&ids(&seq), None, &req);
        let (logits, feats) = (
            full.logits.unwrap().squeeze_dim(0),
            full.features.unwrap().squeeze_dim(0),
        );
        let mut engine = TargetDecoder::new(&m, 48, &taps, None, None).unwrap();
        let prompt: Vec<u32> = seq[..10].iter().map(|&t| t as u32).collect();
        let (last, pre_feats) = engine.prefill(&prompt).unwrap();
        let mut worst = max_diff(&last, &logits.narrow(0, 9, 1));
        worst = worst.max(max_diff(&pre_feats.unwrap(), &feats.narrow(0, 0, 10)));
        // blocks of 4 from position 10, each accepting 2 (the next block starts 2 later and
        // overwrites the rest), then single tokens
        let mut pos = 10i64;
        while pos + 4 <= 30 {
            let (l, f) = engine
                .step(
                    &Tensor::from_slice(&seq[pos as usize..pos as usize + 4]),
                    pos,
                )
                .unwrap();
            worst = worst.max(max_diff(&l, &logits.narrow(0, pos, 4)));
            worst = worst.max(max_diff(&f.unwrap(), &feats.narrow(0, pos, 4)));
            pos += 2;
        }
        while pos < 40 {
            let (l, _) = engine
                .step(
                    &Tensor::from_slice(&seq[pos as usize..pos as usize + 1]),
                    pos,
                )
                .unwrap();
            worst = worst.max(max_diff(&l, &logits.narrow(0, pos, 1)));
            pos += 1;
        }
        assert!(worst < CACHE_TOLERANCE, "{family}: max abs diff {worst}");
    }
}

#[test]
fn tapped_features_are_layer_outputs_and_skip_the_rest() {
    for (family, scaling) in families() {
        let (_t, m) = load(family, scaling, 5);
        let x = ids(&[1, 2, 3, 4, 5, 6]);
        let taps_only = m.run(
            &x,
            None,
            &ForwardRequest {
                tap_layers: vec![0, 2],
                ..Default::default()
            },
        );
        let all = m.run(
            &x,
            None,
            &ForwardRequest {
                tap_layers: vec![0, 2, 3],
                final_hidden: true,
                logits: true,
            },
        );
        let f = taps_only.features.unwrap();
        assert_eq!(f.size(), vec![1, 6, 64]);
        assert!(taps_only.logits.is_none() && taps_only.final_hidden.is_none());
        let g = all.features.unwrap();
        assert!(max_diff(&f, &g.narrow(2, 0, 64)) < 1e-6, "{family}");
        // The last layer's output, normed, is the final hidden state: the tap is pre-norm.
        let last = g.narrow(2, 64, 32);
        let fin = all.final_hidden.unwrap();
        assert!(
            max_diff(&last, &fin) > 1e-3,
            "{family}: tap must be before the final norm"
        );
        let var = last.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = &last * (var + 1e-5).rsqrt();
        // fin = normed * weight: their ratio is the same for every position
        let ratio = &fin / &normed;
        assert!(max_diff(&ratio, &ratio.narrow(1, 0, 1)) < 1e-3, "{family}");
        assert_eq!(all.logits.unwrap().size(), vec![1, 6, 50]);
    }
}

#[test]
fn family_specific_weights_are_used() {
    // Qwen2 loads q/k/v biases, Qwen3 per-head norms: counted in the parameters.
    let (_a, llama) = load("llama", None, 6);
    let (_b, qwen2) = load("qwen2", None, 6);
    let (_c, qwen3) = load("qwen3", None, 6);
    let layers = 4;
    assert_eq!(
        qwen2.parameter_count() - llama.parameter_count(),
        layers * (32 + 16 + 16)
    );
    assert_eq!(
        qwen3.parameter_count() - llama.parameter_count(),
        layers * (8 + 8)
    );
    // Llama 3 rope scaling changes positions beyond the original context only slightly, but it
    // does change the logits.
    let (_d, scaled) = load("llama", Some(llama3_scaling()), 6);
    let x = ids(&(0..30).collect::<Vec<i64>>());
    assert!(max_diff(&llama.forward(&x, None), &scaled.forward(&x, None)) > 1e-4);
}

#[test]
fn bf16_forward_runs_on_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_target_dir(&tmp.path().join("m"), "qwen3", true, None, 9);
    let f32m = TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let bf16m = TargetModel::load(&dir, Device::Cpu, Kind::BFloat16).unwrap();
    let x = ids(&[1, 2, 3, 4, 5]);
    let a = f32m.forward(&x, None);
    let b = bf16m.forward(&x, None);
    assert_eq!(b.kind(), Kind::Float);
    assert!(max_diff(&a, &b) < 0.1, "bf16 drifted {}", max_diff(&a, &b));
}
