//! The slot cache of a hybrid target: committing a verify step's accepted prefix.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::model::decode::TargetDecoder;
use crate::model::{SeqSpan, SlotBatch, SlotCache, SlotLogits, TargetModel};

fn hybrid() -> TargetModel {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen35_targets/conditional");
    TargetModel::load(&dir, Device::Cpu, Kind::Float).unwrap()
}

fn ids(t: &[i64]) -> Tensor {
    Tensor::from_slice(t)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The largest difference between two caches' states of `slot`, over every layer.
fn states_diff(a: &SlotCache, b: &SlotCache, slot: i64) -> f64 {
    let (a, b) = (a.states().unwrap(), b.states().unwrap());
    (0..a.layers())
        .map(|l| {
            let (x, y) = (a.slot_state(l, slot), b.slot_state(l, slot));
            max_diff(&x.conv, &y.conv).max(max_diff(&x.recurrent, &y.recurrent))
        })
        .fold(0.0, f64::max)
}

/// Two sequences verify a block of 4 each in one uniform step; committing 2 and 3 accepted
/// tokens leaves each slot's conv and recurrent states (every Gated DeltaNet layer) those of a
/// fresh prefill of the prompt and the accepted tokens, and the next step's logits those of a
/// full forward. (Without the commit the states are off by more than 1e-2.)
#[test]
fn committing_an_accepted_prefix_gives_a_fresh_forwards_states() {
    let m = hybrid();
    let prompts: [Vec<i64>; 2] = [
        (0..10).map(|i| (i * 7 + 3) % 128).collect(),
        (0..10).map(|i| (i * 11 + 5) % 128).collect(),
    ];
    let blocks: [[i64; 4]; 2] = [[9, 40, 2, 77], [13, 100, 64, 5]];
    let accepted = [2i64, 3];
    tch::no_grad(|| {
        // the verify path: uniform prefill, one kept step of 4, the commit
        let mut cache = m.slot_cache(2, 32).unwrap();
        let start = Tensor::from_slice(&[0i64, 0]);
        let batch = SlotBatch::uniform(&cache, &start, 10);
        let both = Tensor::cat(&[ids(&prompts[0]), ids(&prompts[1])], 0);
        m.forward_slots(&both, &batch, &mut cache, &[], SlotLogits::Last)
            .unwrap();
        cache.states_mut().unwrap().keep_steps(4).unwrap();
        let start = Tensor::from_slice(&[10i64, 10]);
        let batch = SlotBatch::uniform(&cache, &start, 4);
        let block = Tensor::cat(&[ids(&blocks[0]), ids(&blocks[1])], 0);
        m.forward_slots(&block, &batch, &mut cache, &[], SlotLogits::All)
            .unwrap();

        // fresh: the prompts and accepted tokens prefilled in one packed batch
        let mut fresh = m.slot_cache(2, 32).unwrap();
        let mut seqs = Vec::new();
        let mut spans = Vec::new();
        for s in 0..2 {
            let n = accepted[s] as usize;
            seqs.extend_from_slice(&prompts[s]);
            seqs.extend_from_slice(&blocks[s][..n]);
            spans.push(SeqSpan {
                slot: s as i64,
                start: 0,
                len: 10 + n as i64,
            });
        }
        let batch = SlotBatch::packed(&fresh, &spans).unwrap();
        m.forward_slots(&ids(&seqs), &batch, &mut fresh, &[], SlotLogits::Last)
            .unwrap();

        let before = states_diff(&cache, &fresh, 0).max(states_diff(&cache, &fresh, 1));
        assert!(
            before > 1e-2,
            "the uncommitted states already agree: {before}"
        );
        let slots = Tensor::from_slice(&[0i64, 1]);
        let taken = Tensor::from_slice(&accepted);
        cache
            .states()
            .unwrap()
            .commit_accepted(&slots, &taken)
            .unwrap();
        for s in 0..2 {
            let d = states_diff(&cache, &fresh, s);
            assert!(d < 1e-5, "slot {s}: committed states off by {d}");
        }

        // decoding on from the accepted prefixes: the full forward's logits
        let start = Tensor::from_slice(&[10 + accepted[0], 10 + accepted[1]]);
        let batch = SlotBatch::uniform(&cache, &start, 1);
        let next = [blocks[0][2], blocks[1][3]];
        let out = m
            .forward_slots(&ids(&next), &batch, &mut cache, &[], SlotLogits::All)
            .unwrap();
        let logits = out.logits.unwrap();
        for s in 0..2 {
            let n = accepted[s] as usize;
            let mut seq = prompts[s].clone();
            seq.extend_from_slice(&blocks[s][..=n]);
            let full = m.forward(&ids(&seq).unsqueeze(0), None);
            let d = max_diff(&logits.get(s as i64), &full.get(0).get(-1));
            assert!(d < 1e-4, "slot {s}: logits after the commit off by {d}");
        }
    });
}

/// The decoding engine commits by itself when a step starts within the latest multi-token
/// step, and refuses a position its states cannot return to.
#[test]
fn the_engine_rolls_hybrid_states_back_only_within_the_latest_step() {
    let m = hybrid();
    tch::no_grad(|| {
        let mut engine = TargetDecoder::new(&m, 40, &[], None, None).unwrap();
        let prompt: Vec<u32> = (0..8).map(|i| (i * 5 + 1) % 128).collect();
        let _ = engine.prefill(&prompt).unwrap();
        let _ = engine.step(&ids(&[4, 8, 15, 16]), 8).unwrap();
        // 2 of the 4 accepted: fine
        let (logits, _) = engine.step(&ids(&[23, 42, 7]), 10).unwrap();
        let mut seq: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
        seq.extend_from_slice(&[4, 8, 23, 42, 7]);
        let full = m.forward(&ids(&seq).unsqueeze(0), None);
        let d = max_diff(&logits, &full.get(0).narrow(0, 10, 3));
        assert!(d < 1e-4, "logits after the roll-back off by {d}");
        // back before the latest step: refused
        let e = format!("{:#}", engine.step(&ids(&[1]), 9).unwrap_err());
        assert!(
            e.starts_with("cannot roll a hybrid target's recurrent states to position 9"),
            "{e}"
        );
    });
}

/// A CUDA graph capture runs a step eagerly twice (warm-ups) and the replay runs it once more:
/// run under `SlotCache::keeping_states`, the warm-up runs leave the Gated DeltaNet states where
/// the step starts, so the run after them gives the eager step's logits and states exactly.
/// Without it each run advances the states again.
#[test]
fn warm_up_runs_kept_off_the_states_leave_the_step_to_the_next_run() {
    let m = hybrid();
    let prompt: Vec<i64> = (0..10).map(|i| (i * 7 + 3) % 128).collect();
    let block = ids(&[9, 40, 2, 77]);
    tch::no_grad(|| {
        let prefilled = || {
            let mut cache = m.slot_cache(1, 32).unwrap();
            let batch = SlotBatch::uniform(&cache, &Tensor::from_slice(&[0i64]), 10);
            m.forward_slots(&ids(&prompt), &batch, &mut cache, &[], SlotLogits::Last)
                .unwrap();
            cache.states_mut().unwrap().keep_steps(4).unwrap();
            cache
        };
        let step = |cache: &mut SlotCache| {
            let batch = SlotBatch::uniform(cache, &Tensor::from_slice(&[10i64]), 4);
            let out = m.forward_slots(&block, &batch, cache, &[], SlotLogits::All);
            out.unwrap().logits.unwrap()
        };
        let mut eager = prefilled();
        let want = step(&mut eager);

        let mut kept = prefilled();
        kept.keeping_states(|cache| {
            for _ in 0..2 {
                let _ = step(cache);
            }
        })
        .unwrap();
        assert_eq!(max_diff(&step(&mut kept), &want), 0.0);
        assert_eq!(states_diff(&kept, &eager, 0), 0.0);

        let mut unkept = prefilled();
        for _ in 0..2 {
            let _ = step(&mut unkept);
        }
        let off = max_diff(&step(&mut unkept), &want);
        assert!(
            off > 1e-2,
            "the warm-up runs did not move the states: {off}"
        );
    });
}
