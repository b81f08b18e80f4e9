//! Speculative decoding with a DFlash drafter is lossless: its output equals plain greedy
//! decoding token for token, and its step accounting is consistent.

use crate::common;

use common::{models_of, tiny_models};
use dflash_tui::eval::speculative::{dflash, evaluate, greedy, Decoded, EvalOptions, EvalReport};
use dflash_tui::model::{Drafter, FrozenHead, TargetModel};

mod reports;

/// The tiny Qwen3.5 hybrid checkpoint transformers wrote (Gated DeltaNet and gated attention
/// layers; tests/fixtures/make_qwen35_targets.py).
fn hybrid_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen35_targets/conditional")
}

/// Three prompts, one of a single token.
fn short_prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 9, 13], vec![2, 4, 8, 16, 32, 11, 7], vec![40]]
}

/// Decodes each of `prompts` greedily and with DFlash (30 new tokens), asserting the same
/// tokens, then `evaluate`s them (20 new tokens), asserting no mismatch: the DFlash decodings
/// and the report.
fn assert_dflash_equals_greedy(
    target: &TargetModel,
    drafter: &Drafter,
    head: &FrozenHead,
    prompts: &[Vec<u32>],
) -> (Vec<Decoded>, EvalReport) {
    let decoded = prompts
        .iter()
        .map(|p| {
            let plain = tch::no_grad(|| greedy(target, p, 30, &[])).unwrap();
            let fast = tch::no_grad(|| dflash(target, drafter, head, p, 30, &[])).unwrap();
            assert_eq!(fast.output_ids, plain.output_ids, "prompt {p:?}");
            fast
        })
        .collect();
    let options = EvalOptions::default();
    let report = evaluate(target, drafter, head, prompts, 20, &[], &options).unwrap();
    assert_eq!(report.mismatches, 0);
    (decoded, report)
}

#[test]
fn dflash_output_equals_greedy_decoding() {
    let (_tmp, target, drafter, head) = tiny_models(4);
    let prompts = short_prompts();
    let (decoded, report) = assert_dflash_equals_greedy(&target, &drafter, &head, &prompts);
    for fast in decoded {
        assert_eq!(fast.output_ids.len(), 30);
        // each step emits a + 1 tokens after the prefill's first one
        let emitted: usize = fast.accept_lengths.iter().sum();
        assert!(
            1 + emitted >= 30 && emitted < 30 + 4,
            "{:?}",
            fast.accept_lengths
        );
        assert!(fast.accept_lengths.iter().all(|&a| (1..=4).contains(&a)));
    }
    // an EOS stops both the same way
    let p = &prompts[1];
    let plain = tch::no_grad(|| greedy(&target, p, 30, &[])).unwrap();
    let eos = plain.output_ids[6];
    let with_eos = tch::no_grad(|| greedy(&target, p, 30, &[eos])).unwrap();
    let fast = tch::no_grad(|| dflash(&target, &drafter, &head, p, 30, &[eos])).unwrap();
    assert_eq!(fast.output_ids, with_eos.output_ids);
    assert_eq!(fast.output_ids.last(), Some(&eos));

    assert!(report.tau >= 1.0 && report.tau <= 4.0);
    let steps: usize = report.prompts.iter().map(|p| p.accept_lengths.len()).sum();
    assert_eq!(report.accepted_by_slot[0], steps as u64);
    assert!(
        report.accepted_by_slot.windows(2).all(|w| w[0] >= w[1]),
        "a slot is only accepted after the ones before it"
    );
}

#[test]
fn eval_command_prints_json_with_tau_speedup_and_outputs() {
    let (tmp, target, drafter, _head) = tiny_models(4);
    let _ = target;
    let target_dir = tmp.path().join("t");
    let drafter_dir = drafter.save(&tmp.path().join("d")).unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [5, 9, 13]}\n\n{\"prompt_ids\": [40, 2]}\n",
    )
    .unwrap();
    let out = eval_command(&target_dir, &drafter_dir, &prompts)
        .args(["--max-new-tokens", "12", "--json"])
        .output()
        .unwrap();
    let v = json_of_success(&out);
    assert_eq!(v["mismatches"], 0);
    // Two prompts of 12 tokens on the CPU: the speed-up is flagged, with the reasons, in the
    // JSON and on stderr.
    let warnings: Vec<&str> = v["speedup_warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert!(
        warnings.iter().any(|w| w.contains("on the CPU")),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(|w| w.contains("only 2 prompt(s)")),
        "{warnings:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("is not a trustworthy measurement"),
        "{stderr}"
    );
    assert!(stderr.contains(warnings[0]), "{stderr}");
    let tau = v["tau"].as_f64().unwrap();
    assert!((1.0..=4.0).contains(&tau), "{tau}");
    // two prompts: tau's interval over prompts is there, around it
    let ci = &v["tau_ci95"];
    let (low, high) = (ci["low"].as_f64().unwrap(), ci["high"].as_f64().unwrap());
    assert!(low <= tau && tau <= high, "{ci} around {tau}");
    assert!(v["speedup"].as_f64().unwrap() > 0.0);
    let ps = v["prompts"].as_array().unwrap();
    assert_eq!(ps.len(), 2);
    for p in ps {
        // 12 tokens, or fewer ending with the tiny target's EOS (id 2, from its config.json)
        let ids = p["output_ids"].as_array().unwrap();
        assert!(
            ids.len() == 12 || (ids.len() < 12 && ids.last() == Some(&2.into())),
            "{ids:?}"
        );
        assert!(!p["accept_lengths"].as_array().unwrap().is_empty());
    }
    // a bad prompts file names the line
    std::fs::write(&prompts, "{\"prompt_ids\": [5]}\n{\"nothing\": 1}\n").unwrap();
    let out = eval_command(&target_dir, &drafter_dir, &prompts)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prompts.jsonl: line 2"), "{err}");
}

#[test]
fn eval_trace_writes_a_profiler_trace_of_one_more_decoding() {
    // The Chrome trace JSON of libtorch's profiler: on the CPU, the operators of one decoding
    // of the first prompt (greedy, then DFlash), with their input shapes; the measured pass
    // is unchanged (two prompts in the report).
    let (tmp, _target, drafter, _head) = tiny_models(4);
    let drafter_dir = drafter.save(&tmp.path().join("d")).unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [5, 9, 13]}\n{\"prompt_ids\": [40, 2]}\n",
    )
    .unwrap();
    let trace = tmp.path().join("trace.json");
    let target_dir = tmp.path().join("t");
    let out = eval_command(&target_dir, &drafter_dir, &prompts)
        .args(["--max-new-tokens", "8", "--json", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    let v = json_of_success(&out);
    assert_eq!(v["prompts"].as_array().unwrap().len(), 2);
    let ops = common::trace_events(&trace, "cpu_op");
    let named = |name: &str| ops.iter().filter(|e| e["name"] == name).count();
    // one forward per decoding step at least: the target's layers and the LM head
    assert!(named("aten::linear") > 10, "{} cpu ops", ops.len());
    assert!(named("aten::argmax") > 0);
    assert!(ops.iter().any(|e| e["args"]["Input Dims"].is_array()));

    // A folder that does not exist: one clear error, nothing measured.
    let out = eval_command(&target_dir, &drafter_dir, &prompts)
        .args(["--max-new-tokens", "8", "--trace"])
        .arg(tmp.path().join("no/such/trace.json"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(
        errors[0].contains("no/such/trace.json") && errors[0].contains("does not exist"),
        "{err}"
    );
}

use common::proposers::{ids_tensor, ids_vec, AlwaysProposes, Oracle};
use dflash_tui::eval::speculative::{speculative_decode, BlockDrafter};
use dflash_tui::model::decode::DrafterDecoder;
use tch::Tensor;

#[test]
fn a_drafter_that_is_always_wrong_gives_tau_one_and_greedy_output() {
    let (_tmp, target, drafter, _head) = tiny_models(4);
    let taps = drafter.config.target_layer_ids().to_vec();
    let prompts = short_prompts();
    let plain: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            tch::no_grad(|| greedy(&target, p, 40, &[]))
                .unwrap()
                .output_ids
        })
        .collect();
    // a token the target never picks after any of these prompts
    let never = (0..50u32)
        .find(|t| plain.iter().all(|o| !o.contains(t)))
        .expect("a tiny target with 50 tokens leaves some unused in 120 outputs");
    for (p, expected) in prompts.iter().zip(&plain) {
        let mut wrong = AlwaysProposes {
            block: 4,
            token: never,
        };
        let d =
            tch::no_grad(|| speculative_decode(&target, &mut wrong, &taps, p, 40, &[])).unwrap();
        assert_eq!(&d.output_ids, expected);
        assert!(d.accept_lengths.iter().all(|&a| a == 1));
        // one token per step after the prefill's first one
        assert_eq!(d.accept_lengths.len(), 39);
    }
}

#[test]
fn a_drafter_given_the_targets_answer_reaches_tau_equal_to_block_size() {
    let (_tmp, target, drafter, _head) = tiny_models(4);
    let taps = drafter.config.target_layer_ids().to_vec();
    for block in [4usize, 6] {
        for p in [vec![5u32, 9, 13], vec![2, 4, 8, 16, 32, 11, 7]] {
            let steps = 7;
            let max_new = 1 + steps * block;
            let answer = tch::no_grad(|| greedy(&target, &p, max_new + block, &[]))
                .unwrap()
                .output_ids;
            let mut oracle = Oracle {
                block,
                prompt_len: p.len() as i64,
                answer: answer.clone(),
                wrong: vec![],
                step: 0,
                context_len: 0,
            };
            let d =
                tch::no_grad(|| speculative_decode(&target, &mut oracle, &taps, &p, max_new, &[]))
                    .unwrap();
            assert_eq!(d.output_ids, answer[..max_new]);
            assert_eq!(d.accept_lengths, vec![block; steps], "tau == block size");
        }
    }
}

#[test]
fn rejected_drafts_roll_both_caches_back() {
    // The oracle errs at a random slot in most steps: each step must accept exactly the slots
    // before the error (the target's cache rolled back past the rejected tokens, so the next
    // verify sees the right history), and the output stays the greedy answer.
    let (_tmp, target, drafter, _head) = tiny_models(4);
    let taps = drafter.config.target_layer_ids().to_vec();
    let block = 5usize;
    let p = vec![3u32, 1, 4, 1, 5, 9, 2, 6];
    let mut state = 0x2545F4914F6CDD1Du64;
    let wrong: Vec<Option<usize>> = (0..60)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let k = (state % block as u64) as usize;
            (k > 0).then_some(k) // 0: no error this step
        })
        .collect();
    let expected = decode_with_oracle(&target, &taps, &p, &wrong, block);
    assert!(expected.iter().any(|&a| a < block) && expected.contains(&block));
}

/// DFlash decoding of a hybrid target (Qwen3.5: Gated DeltaNet and gated attention layers) in
/// f32 is lossless: with a fresh drafter (whose drafts are mostly rejected) and with an oracle
/// that errs at random slots (partial acceptances), the output is greedy decoding's, token for
/// token: a rejected draft never advances the recurrent states. (Committing the states after
/// the whole block instead of the accepted prefix: the first mismatch within a few tokens.)
#[test]
fn dflash_on_a_hybrid_target_equals_greedy_decoding() {
    let (target, drafter, head) = models_of(&hybrid_dir(), 4);
    assert_dflash_equals_greedy(&target, &drafter, &head, &short_prompts());

    let taps = drafter.config.target_layer_ids().to_vec();
    let block = 5usize;
    let p = vec![3u32, 1, 4, 1, 5, 9, 2, 6];
    let wrong: Vec<Option<usize>> = (0..40)
        .map(|i| [Some(1), Some(3), None, Some(2), Some(4)][i % 5])
        .collect();
    decode_with_oracle(&target, &taps, &p, &wrong, block);
}

/// DFlash decoding of `p` (one new token per entry of `wrong`) with an oracle that drafts
/// greedy's answer in blocks of `block` and errs at `wrong[step]`: the output is the answer, and
/// each step accepts up to its error (a whole block without one). Returns those acceptance
/// lengths.
fn decode_with_oracle(
    target: &TargetModel,
    taps: &[usize],
    p: &[u32],
    wrong: &[Option<usize>],
    block: usize,
) -> Vec<usize> {
    let max_new = wrong.len();
    let answer = tch::no_grad(|| greedy(target, p, max_new + block, &[]))
        .unwrap()
        .output_ids;
    let mut oracle = Oracle {
        block,
        prompt_len: p.len() as i64,
        answer: answer.clone(),
        wrong: wrong.to_vec(),
        step: 0,
        context_len: 0,
    };
    let d =
        tch::no_grad(|| speculative_decode(target, &mut oracle, taps, p, max_new, &[])).unwrap();
    assert_eq!(d.output_ids, answer[..max_new]);
    let expected: Vec<usize> = wrong
        .iter()
        .take(d.accept_lengths.len())
        .map(|w| w.unwrap_or(block))
        .collect();
    assert_eq!(d.accept_lengths, expected);
    expected
}

/// Records what the real drafter proposed and from which state.
struct Recording<'a> {
    inner: DrafterDecoder<'a>,
    calls: Vec<(u32, i64, Vec<u32>)>,
}

impl BlockDrafter for Recording<'_> {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn propose(
        &mut self,
        ctx: &Tensor,
        x: u32,
        x_dev: &Tensor,
        pos: i64,
    ) -> anyhow::Result<Tensor> {
        let out = self.inner.propose(ctx, x, x_dev, pos)?;
        self.calls.push((x, pos, ids_vec(&out)));
        Ok(out)
    }
}

#[test]
fn each_draft_equals_a_fresh_forward_over_the_accepted_tokens() {
    // After any number of rolled-back steps, the drafter's proposal equals one computed from
    // scratch: a fresh target forward over prompt + accepted tokens for the context features,
    // and a fresh drafter cache.
    let (_tmp, target, drafter, head) = tiny_models(4);
    let taps = drafter.config.target_layer_ids().to_vec();
    let p = vec![7u32, 3, 12, 30, 8];
    let capacity = dflash_tui::eval::speculative::capacity_for(p.len(), 40, 4);
    let mut rec = Recording {
        inner: DrafterDecoder::new(&drafter, &head, capacity, None, None).unwrap(),
        calls: vec![],
    };
    let d = tch::no_grad(|| speculative_decode(&target, &mut rec, &taps, &p, 40, &[])).unwrap();
    assert!(rec.calls.len() > 5);
    let req = dflash_tui::model::ForwardRequest {
        tap_layers: taps.clone(),
        final_hidden: false,
        logits: false,
    };
    for (x, pos, proposed) in &rec.calls {
        // the tokens before x: prompt + the output up to x
        let n_out = (*pos as usize) - p.len();
        let mut seq: Vec<i64> = p.iter().map(|&t| t as i64).collect();
        seq.extend(d.output_ids[..n_out].iter().map(|&t| t as i64));
        assert_eq!(d.output_ids[n_out], *x);
        let fresh = tch::no_grad(|| {
            let feats = target
                .run(&Tensor::from_slice(&seq).unsqueeze(0), None, &req)
                .features
                .unwrap()
                .squeeze_dim(0);
            let mut fresh = DrafterDecoder::new(&drafter, &head, capacity, None, None)?;
            fresh.propose(&feats, *x, &ids_tensor(&[*x]), *pos)
        })
        .unwrap();
        assert_eq!(&ids_vec(&fresh), proposed, "draft at position {pos}");
    }
}

/// `dflash-tui eval` on the CPU with these models and prompts (warnings only on stderr); the
/// caller adds the rest.
fn eval_command(
    target: &std::path::Path,
    drafter: &std::path::Path,
    prompts: &std::path::Path,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"));
    cmd.args(["eval", "--device", "cpu", "--target"])
        .arg(target)
        .arg("--drafter")
        .arg(drafter)
        .arg("--prompts")
        .arg(prompts)
        .env("DFLASH_LOG", "warn");
    cmd
}

/// The JSON on stdout of a command that must have succeeded (else its stderr is shown).
fn json_of_success(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn eval_cli(
    target: &std::path::Path,
    drafter: &std::path::Path,
    prompts: &std::path::Path,
) -> (bool, String) {
    let out = eval_command(target, drafter, prompts)
        .args(["--max-new-tokens", "12"])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn eval_rejects_drafters_that_do_not_fit_and_bad_prompt_sets() {
    let (tmp, _target, drafter, _head) = tiny_models(4);
    let target_dir = tmp.path().join("t");
    let good = drafter.save(&tmp.path().join("d")).unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt_ids\": [5, 9, 13]}\n").unwrap();
    let (ok, err) = eval_cli(&target_dir, &good, &prompts);
    assert!(ok, "{err}");

    // drafters edited not to fit: each message names the drafter's config.json and the field
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(good.join("config.json")).unwrap()).unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "hidden",
            Box::new(|c| c["hidden_size"] = 48.into()),
            "hidden_size = 48 differs from the target's 32",
        ),
        (
            "vocab",
            Box::new(|c| c["vocab_size"] = 64.into()),
            "vocab_size = 64 differs from the target's 50",
        ),
        (
            "layers",
            Box::new(|c| c["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 4])),
            "target_layer_ids contains 4, but the target has 4 layers",
        ),
    ];
    for (name, edit, expected) in cases {
        let dir = tmp.path().join(format!("bad-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            good.join("model.safetensors"),
            dir.join("model.safetensors"),
        )
        .unwrap();
        let mut c = config.clone();
        edit(&mut c);
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        let (ok, err) = eval_cli(&target_dir, &dir, &prompts);
        assert!(!ok, "{name}: {err}");
        assert!(err.contains(expected), "{name}: {err}");
        assert!(
            err.contains(&format!("bad-{name}/config.json")),
            "{name}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line: {err}");
    }

    // an empty prompt set
    std::fs::write(&prompts, "\n\n").unwrap();
    let (ok, err) = eval_cli(&target_dir, &good, &prompts);
    assert!(!ok && err.contains("no prompts"), "{err}");
    // a prompt longer than the context (128 positions): 120 + 12 new + a block of 4
    let long: Vec<u32> = (0..120).map(|i| 3 + i % 40).collect();
    std::fs::write(
        &prompts,
        format!(
            "{{\"prompt_ids\": [5]}}\n{}\n",
            serde_json::json!({ "prompt_ids": long })
        ),
    )
    .unwrap();
    let (ok, err) = eval_cli(&target_dir, &good, &prompts);
    assert!(!ok, "{err}");
    assert!(
        err.contains("prompts.jsonl: line 2: the prompt has 120 tokens"),
        "{err}"
    );
    assert!(err.contains("context of 128"), "{err}");
    // a token outside the vocabulary
    std::fs::write(&prompts, "{\"prompt_ids\": [5, 77]}\n").unwrap();
    let (ok, err) = eval_cli(&target_dir, &good, &prompts);
    assert!(
        !ok && err.contains("line 1: token id 77 is outside"),
        "{err}"
    );
}
