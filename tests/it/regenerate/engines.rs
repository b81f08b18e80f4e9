//! regenerate's decoding: the continuous engine against the plain path, a batch that drains
//! without waiting for every answer, and the trace of the decoding steps.

use super::*;

#[test]
fn the_continuous_engine_gives_the_tokens_of_the_plain_path() {
    // Greedy and sampled, f32: the continuous engine (slots refilled as answers end, later
    // turns continuing in their slot's cache, packed prefills) writes exactly what the plain
    // rounds-based path writes. One slot and two slots exercise refills across chunks.
    let f = fixture();
    for (name, extra) in [
        ("greedy", vec![]),
        (
            "sampled",
            vec!["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"],
        ),
    ] {
        let plain = f.tmp.path().join(format!("plain-{name}"));
        let mut args = extra.clone();
        args.extend(["--engine", "plain", "--log-level", "info"]);
        let (ok, _, stderr) = regenerate(&f, &plain, &args);
        assert!(ok, "{stderr}");
        // every answer asked for is counted once, generated or left out by a row that ended
        let ((answers, all), rows) = progress_end(&stderr);
        assert_eq!((answers, rows), (all, (12, 12)), "{stderr}");
        for slots in ["1", "2", "5"] {
            let fast = f.tmp.path().join(format!("fast-{name}-{slots}"));
            let mut args = extra.clone();
            args.extend(["--engine", "continuous", "--batch-size", slots]);
            args.extend(["--log-level", "info"]);
            let (ok, stdout, stderr) = regenerate(&f, &fast, &args);
            assert!(ok, "{stderr}");
            assert_eq!(progress_end(&stderr), ((all, all), (12, 12)), "{stderr}");
            assert!(stdout.contains("12 rows in, 9 out, 3 skipped"), "{stdout}");
            for (split, _) in &f.splits {
                assert_eq!(
                    read_split(&fast, split),
                    read_split(&plain, split),
                    "{name}, {slots} slot(s), split {split}"
                );
            }
        }
    }
}

#[test]
fn a_next_turn_does_not_wait_for_every_other_answer_when_the_batch_drains() {
    // 32 slots, three conversations: one answer of 40 tokens, and two conversations of three
    // turns of 5 tokens each. Their later turns are prefilled as soon as they wait (an eighth
    // of the occupied slots), not once the long answer ended: every turn is done within the
    // long answer's 39 decoding steps (its first token comes from the prefill).
    use dflash_tui::model::generate::{
        Answer, ContinuousGenerator, ContinuousLimits, Next, Request,
    };
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_llama(tmp.path(), 5);
    let limits = ContinuousLimits {
        slots: 32,
        max_len: 96,
        prefill_tokens: 1024,
    };
    let mut engine = ContinuousGenerator::new(&m, limits, None, None).unwrap();
    let request = |key: usize, max_new: usize| Request {
        tokens: tokens(key, 4),
        max_new,
        seed: 0,
    };
    let mut fresh = vec![
        (0usize, request(0, 40)),
        (1, request(1, 5)),
        (2, request(2, 5)),
    ];
    fresh.reverse();
    let mut turns = [0usize; 3];
    let mut lengths: Vec<(usize, usize)> = Vec::new();
    // no end-of-sequence token: every answer runs to its max_new
    engine
        .run(
            &Sampling::GREEDY,
            &[],
            || fresh.pop(),
            |key: usize, answer: Answer| {
                lengths.push((key, answer.tokens.len()));
                turns[key] += 1;
                if key > 0 && turns[key] < 3 {
                    Next::Continue(Request {
                        tokens: tokens(key + 10 * turns[key], 2),
                        max_new: 5,
                        seed: 0,
                    })
                } else {
                    Next::Done
                }
            },
            |_| {},
        )
        .unwrap();
    assert_eq!(turns, [1, 3, 3]);
    lengths.sort_unstable();
    assert_eq!(
        lengths,
        [(0, 40), (1, 5), (1, 5), (1, 5), (2, 5), (2, 5), (2, 5)]
    );
    assert_eq!(engine.stats.generated_tokens, 70);
    assert_eq!(engine.stats.decode_steps, 39, "{:?}", engine.stats);
}

#[test]
fn regenerate_trace_records_the_decoding_steps_asked_for() {
    let f = fixture();
    let trace = f.tmp.path().join("trace.json");
    let out = f.tmp.path().join("traced");
    let (ok, _, stderr) = regenerate(
        &f,
        &out,
        &["--trace", trace.to_str().unwrap(), "--trace-steps", "2:3"],
    );
    assert!(ok, "{stderr}");
    let ops = common::trace_events(&trace, "cpu_op");
    // three decoding forwards of the tiny 4-layer target, each with its LM head
    let linears = ops.iter().filter(|e| e["name"] == "aten::linear").count();
    assert!(linears >= 3 * 5, "{linears} linear operators");
    // the output is the same as without the trace
    let plain = f.tmp.path().join("untraced");
    let (ok, _, stderr) = regenerate(&f, &plain, &[]);
    assert!(ok, "{stderr}");
    for (split, _) in &f.splits {
        assert_eq!(
            read_split(&out, split),
            read_split(&plain, split),
            "{split}"
        );
    }

    // A window the run never reaches: the output is written, the trace is not, and stderr
    // says why.
    let late = f.tmp.path().join("late.json");
    let (ok, _, stderr) = regenerate(
        &f,
        &f.tmp.path().join("late"),
        &[
            "--trace",
            late.to_str().unwrap(),
            "--trace-steps",
            "100000:5",
        ],
    );
    assert!(ok, "{stderr}");
    assert!(!late.exists());
    assert!(stderr.contains("no profiler trace"), "{stderr}");

    // Bad windows and the plain engine: one clear error each.
    for (extra, expect) in [
        (vec!["--trace-steps", "5"], "expected FIRST:COUNT"),
        (vec!["--trace-steps", "5:0"], "COUNT must be at least 1"),
        (vec!["--engine", "plain"], "not with --engine plain"),
    ] {
        let mut args = vec!["--trace", trace.to_str().unwrap()];
        args.extend(extra);
        let (ok, _, stderr) = regenerate(&f, &f.tmp.path().join("bad"), &args);
        assert!(!ok);
        assert!(stderr.contains(expect), "{expect:?} not in {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
