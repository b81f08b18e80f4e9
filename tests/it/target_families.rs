//! Tiny random targets of each family: causality, KV-cache decoding against the full forward,
//! tapped features, and the family-specific weights; the Qwen3.5 hybrids ([`qwen35`]) and the
//! mixtures of experts ([`moe`]) against transformers.

use crate::common;
mod moe;
mod qwen35;

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
        cache.truncate(35).unwrap();
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

/// Tiny checkpoints written by transformers 5 itself, with its reference outputs
/// (tests/fixtures/make_hf5_targets.py).
const HF5: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf5_targets");

struct Reference {
    ids: Tensor,
    logits: Tensor,
    layer0: Tensor,
    final_hidden: Tensor,
    perplexity: f64,
    perplexity_theta_1e4: f64,
}

fn reference(dir: &std::path::Path) -> Reference {
    let tensors: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("reference.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let t = |name: &str| tensors[name].shallow_clone();
    Reference {
        ids: t("input_ids"),
        logits: t("logits"),
        layer0: t("layer0"),
        final_hidden: t("final_hidden"),
        perplexity: json["perplexity"].as_f64().unwrap(),
        perplexity_theta_1e4: json["perplexity_theta_1e4"].as_f64().unwrap(),
    }
}

/// exp of the mean next-token cross entropy, as transformers' causal-LM loss.
fn perplexity(logits: &Tensor, ids: &Tensor) -> f64 {
    let s = ids.size()[1];
    let logp = logits.narrow(1, 0, s - 1).log_softmax(-1, Kind::Double);
    let next = ids.narrow(1, 1, s - 1).unsqueeze(-1);
    (-logp.gather(-1, &next, false).mean(Kind::Double))
        .exp()
        .double_value(&[])
}

/// Logits, layer-0 output, final hidden state and perplexity of the model in `dir` against the
/// reference; returns the perplexity.
fn check_against_reference(dir: &std::path::Path, r: &Reference) -> f64 {
    let m = TargetModel::load(dir, Device::Cpu, Kind::Float).unwrap();
    let out = m.run(
        &r.ids,
        None,
        &ForwardRequest {
            tap_layers: vec![0],
            final_hidden: true,
            logits: true,
        },
    );
    let name = dir.display();
    let logits = out.logits.unwrap();
    for (what, ours, theirs) in [
        ("logits", &logits, &r.logits),
        ("layer 0", &out.features.unwrap(), &r.layer0),
        ("final hidden", &out.final_hidden.unwrap(), &r.final_hidden),
    ] {
        let d = max_diff(ours, theirs);
        assert!(d < 1e-4, "{name}: {what} differ from transformers' by {d}");
    }
    let ppl = perplexity(&logits, &r.ids);
    let rel = (ppl - r.perplexity).abs() / r.perplexity;
    assert!(
        rel < 1e-4,
        "{name}: perplexity {ppl} vs transformers' {}",
        r.perplexity
    );
    ppl
}

#[test]
fn transformers_5_checkpoints_give_transformers_outputs() {
    for name in [
        "llama_theta1e6",
        "llama_llama3",
        "qwen3_theta1e6",
        "mistral3_nested",
    ] {
        let dir = std::path::Path::new(HF5).join(name);
        let r = reference(&dir);
        check_against_reference(&dir, &r);
    }
}

/// The text model's settings of a config: its `text_config`, or the config itself.
fn text_section(c: &mut serde_json::Value) -> &mut serde_json::Value {
    if c.get("text_config").is_some() {
        &mut c["text_config"]
    } else {
        c
    }
}

/// A copy of fixture `name` whose config.json is changed by `edit`.
fn edited_copy(name: &str, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let from = std::path::Path::new(HF5).join(name);
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&config_path, config.to_string()).unwrap();
    tmp
}

#[test]
fn rope_parameters_theta_is_honoured() {
    // The same weights with theta 10000 (what ignoring rope_parameters gives) have another
    // perplexity, far outside the tolerance of the comparison above.
    for name in ["llama_theta1e6", "qwen3_theta1e6", "mistral3_nested"] {
        let dir = std::path::Path::new(HF5).join(name);
        let r = reference(&dir);
        let gap = (r.perplexity - r.perplexity_theta_1e4).abs() / r.perplexity;
        assert!(gap > 1e-2, "{name}: theta barely matters ({gap})");
        let config = dflash_tui::model::TargetConfig::from_model_dir(&dir).unwrap();
        assert_eq!(config.rope_theta, 1e6, "{name}");
        // without rope_parameters the model runs with theta 10000, as transformers then does
        let old = edited_copy(name, |c| {
            let text = text_section(c);
            text.as_object_mut().unwrap().remove("rope_parameters");
        });
        let m = TargetModel::load(old.path(), Device::Cpu, Kind::Float).unwrap();
        let ppl = perplexity(&m.forward(&r.ids, None), &r.ids);
        let rel = (ppl - r.perplexity_theta_1e4).abs() / r.perplexity_theta_1e4;
        assert!(
            rel < 1e-4,
            "{name}: theta 10000 gives {ppl}, transformers {}",
            r.perplexity_theta_1e4
        );
        // the old keys alone read the same as rope_parameters
        let legacy = edited_copy(name, |c| {
            let text = text_section(c);
            let map = text.as_object_mut().unwrap();
            map.remove("rope_parameters");
            map.insert("rope_theta".into(), serde_json::json!(1e6));
        });
        check_against_reference(legacy.path(), &r);
        // both forms, disagreeing: refused naming both
        let both = edited_copy(name, |c| {
            let text = text_section(c);
            text["rope_theta"] = serde_json::json!(10000.0);
        });
        let e = format!(
            "{:#}",
            TargetModel::load(both.path(), Device::Cpu, Kind::Float).unwrap_err()
        );
        assert!(
            e.contains("rope_parameters.rope_theta = 1000000 and rope_theta = 10000 disagree"),
            "{e}"
        );
    }
}

#[test]
fn llama3_scaling_in_rope_parameters_is_honoured() {
    let dir = std::path::Path::new(HF5).join("llama_llama3");
    let r = reference(&dir);
    let config = dflash_tui::model::TargetConfig::from_model_dir(&dir).unwrap();
    assert!(
        format!("{:?}", config.rope_scaling).starts_with("Llama3"),
        "{config:?}"
    );
    // with the scaling dropped the outputs move: the comparison above would fail
    let plain = edited_copy("llama_llama3", |c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 10000.0});
    });
    let m = TargetModel::load(plain.path(), Device::Cpu, Kind::Float).unwrap();
    assert!(max_diff(&m.forward(&r.ids, None), &r.logits) > 1e-2);
    // a type transformers supports and this project does not is refused by name
    let yarn = edited_copy("llama_llama3", |c| {
        c["rope_parameters"]["rope_type"] = serde_json::json!("yarn");
    });
    let e = format!(
        "{:#}",
        TargetModel::load(yarn.path(), Device::Cpu, Kind::Float).unwrap_err()
    );
    assert!(
        e.contains("config.json")
            && e.contains(
                "rope_parameters.rope_type = \"yarn\" is not supported (default, linear, llama3)"
            ),
        "{e}"
    );
}

#[test]
fn multimodal_text_models_load_from_either_weight_layout() {
    // transformers 5 saves language_model.model.* and language_model.lm_head.weight (the hub's
    // layout); transformers 4.52 to 4.57 saved model.language_model.* and lm_head.weight.
    let dir = std::path::Path::new(HF5).join("mistral3_nested");
    let r = reference(&dir);
    let other = edited_copy("mistral3_nested", |_| {});
    let file = other.path().join("model.safetensors");
    let renamed: Vec<(String, Tensor)> = Tensor::read_safetensors(&file)
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let name = if let Some(rest) = name.strip_prefix("language_model.model.") {
                format!("model.language_model.{rest}")
            } else if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
                format!("lm_head.{rest}")
            } else {
                format!("model.{name}")
            };
            (name, t)
        })
        .collect();
    assert!(renamed
        .iter()
        .any(|(n, _)| n.starts_with("model.vision_tower.")));
    Tensor::write_safetensors(&renamed, &file).unwrap();
    check_against_reference(other.path(), &r);
    // a multimodal model whose text model is of another family is refused in one line
    let gemma = edited_copy("mistral3_nested", |c| {
        c["architectures"] = serde_json::json!(["Gemma3ForConditionalGeneration"]);
        c["model_type"] = serde_json::json!("gemma3");
        c["text_config"]["model_type"] = serde_json::json!("gemma3_text");
    });
    let e = format!(
        "{:#}",
        TargetModel::load(gemma.path(), Device::Cpu, Kind::Float).unwrap_err()
    );
    assert!(
        e.ends_with("config.json: architectures[0] = \"Gemma3ForConditionalGeneration\" (model_type \"gemma3\", text_config.model_type \"gemma3_text\") is not supported: the text model must be one of llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next"),
        "{e}"
    );
    assert!(!e.contains('\n'));
}

#[test]
fn the_shipped_model_shapes_read() {
    // configs/shapes holds the config.json of the targets the benchmark profiles use (real
    // Qwen3 and SmolLM2 configs among them): none trips a refusal.
    let shapes = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/shapes");
    let mut read = 0;
    for entry in std::fs::read_dir(&shapes).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            // the script that wrote some of them
            continue;
        }
        let config = dflash_tui::model::TargetConfig::from_model_dir(&dir);
        assert!(
            config.is_ok(),
            "{}: {:#}",
            dir.display(),
            config.unwrap_err()
        );
        read += 1;
    }
    assert!(read >= 4, "{read}");
}
