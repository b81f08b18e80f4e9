//! `regenerate`: batched, left-padded generation equals plain greedy decoding; the command keeps
//! every context segment, replaces every assistant segment by the target's own answer, resumes
//! from finished chunks, and refuses bad input with one clear error.

use crate::common;

use std::path::{Path, PathBuf};

use common::{dflash, tiny_target_dir, write_token_dataset};
use dflash_tui::data::arrow_io::{write_split, TokenRow};
use dflash_tui::data::store::{DataColumns, StoreOptions, TokenStore};
use dflash_tui::model::generate::{
    generate_all, generate_batch, greedy_generate, BatchLimits, Prompt, Sampling,
};
use dflash_tui::model::{ForwardRequest, KvCache, TargetModel};
use tch::{Device, Kind, Tensor};

fn load(dir: &Path) -> TargetModel {
    TargetModel::load(dir, Device::Cpu, Kind::Float).unwrap()
}

/// A tiny random Llama target (untied), written under `dir` and loaded in f32.
fn tiny_llama(dir: &Path, seed: i64) -> TargetModel {
    load(&common::tiny_llama_dir(&dir.join("t"), false, seed))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Deterministic token lists (ids 3..49 of the tiny 50-token vocabulary).
fn tokens(seed: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|k| ((seed * 31 + k * 17 + k * k * 7) % 47 + 3) as u32)
        .collect()
}

fn left_padded(rows: &[Vec<u32>]) -> (Tensor, Tensor, i64) {
    let longest = rows.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut real = Vec::new();
    for r in rows {
        let pad = longest - r.len();
        ids.extend(std::iter::repeat_n(0i64, pad));
        ids.extend(r.iter().map(|&t| t as i64));
        real.extend(std::iter::repeat_n(0u8, pad));
        real.extend(std::iter::repeat_n(1u8, r.len()));
    }
    let n = rows.len() as i64;
    let l = longest as i64;
    (
        Tensor::from_slice(&ids).view([n, l]),
        Tensor::from_slice(&real).view([n, l]).to_kind(Kind::Bool),
        l,
    )
}

#[test]
fn padding_masked_run_equals_the_unpadded_run() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, tied) in [("llama", false), ("qwen2", true), ("qwen3", false)] {
        let m = load(&tiny_target_dir(
            &tmp.path().join(family),
            family,
            tied,
            None,
            11,
        ));
        let rows = vec![tokens(1, 9), tokens(2, 4), tokens(3, 1), tokens(4, 7)];
        let (ids, mask, l) = left_padded(&rows);
        let req = ForwardRequest {
            logits: true,
            tap_layers: vec![1],
            ..Default::default()
        };
        // one padded forward, then two decode steps through a preallocated cache
        let mut cache = KvCache::with_capacity(l + 2);
        let out = m.run_padded(&ids, Some(&mut cache), &req, Some(&mask));
        let logits = out.logits.unwrap();
        let feats = out.features.unwrap();
        let step1: Vec<i64> = (0..rows.len() as i64).map(|r| 5 + r).collect();
        let mask1 = Tensor::cat(
            &[&mask, &Tensor::ones([4, 1], (Kind::Bool, Device::Cpu))],
            1,
        );
        let dec1 = m
            .run_padded(
                &Tensor::from_slice(&step1).view([4, 1]),
                Some(&mut cache),
                &req,
                Some(&mask1),
            )
            .logits
            .unwrap();
        // drop rows 0 and 2 from the batch, decode one more step for rows 1 and 3
        let keep = Tensor::from_slice(&[3i64, 1]);
        cache.select_rows(&keep);
        let mask2 = Tensor::cat(
            &[
                mask1.index_select(0, &keep),
                Tensor::ones([2, 1], (Kind::Bool, Device::Cpu)),
            ],
            1,
        );
        let dec2 = m
            .run_padded(
                &Tensor::from_slice(&[9i64, 8]).view([2, 1]),
                Some(&mut cache),
                &req,
                Some(&mask2),
            )
            .logits
            .unwrap();
        assert_eq!(cache.len(), l + 2);
        for (r, row) in rows.iter().enumerate() {
            let n = row.len() as i64;
            let mut full: Vec<i64> = row.iter().map(|&t| t as i64).collect();
            full.push(step1[r]);
            let alone = m.run(&Tensor::from_slice(&full).unsqueeze(0), None, &req);
            let a_logits = alone.logits.unwrap();
            let a_feats = alone.features.unwrap();
            let got = logits.narrow(0, r as i64, 1).narrow(1, l - n, n);
            assert!(
                max_diff(&got, &a_logits.narrow(1, 0, n)) < 1e-4,
                "{family} row {r}"
            );
            let got_f = feats.narrow(0, r as i64, 1).narrow(1, l - n, n);
            assert!(max_diff(&got_f, &a_feats.narrow(1, 0, n)) < 1e-4);
            let got_d = dec1.narrow(0, r as i64, 1);
            assert!(max_diff(&got_d, &a_logits.narrow(1, n, 1)) < 1e-4);
        }
        for (slot, r) in [(0i64, 3usize), (1, 1)] {
            let mut full: Vec<i64> = rows[r].iter().map(|&t| t as i64).collect();
            full.push(step1[r]);
            full.push([9i64, 8][slot as usize]);
            let alone = m.forward(&Tensor::from_slice(&full).unsqueeze(0), None);
            let got = dec2.narrow(0, slot, 1);
            assert!(
                max_diff(&got, &alone.narrow(1, full.len() as i64 - 1, 1)) < 1e-4,
                "{family} after select_rows, row {r}"
            );
        }
        // without a mask, run is the plain causal forward (padding would be visible)
        let plain = m.run(&ids, None, &req).logits.unwrap();
        assert!(max_diff(&plain, &logits) > 1e-3);
    }
}

#[test]
fn batched_greedy_generation_equals_unbatched_greedy_decoding() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_llama(tmp.path(), 5);
    let prompts_ids: Vec<Vec<u32>> = [3usize, 9, 1, 14, 6]
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(i + 10, n))
        .collect();
    let max_new = [12usize, 5, 12, 8, 12];
    // An EOS token that some rows produce early, so rows finish at different steps.
    let free = greedy_generate(&m, &prompts_ids[0], 12, &[]);
    let eos = vec![free[3]];
    let expected: Vec<Vec<u32>> = prompts_ids
        .iter()
        .zip(max_new)
        .map(|(p, n)| greedy_generate(&m, p, n, &eos))
        .collect();
    assert!(expected.iter().any(|e| e.last() == Some(&eos[0])));
    assert!(expected.iter().any(|e| !e.contains(&eos[0])));
    let prompts: Vec<Prompt<'_>> = prompts_ids
        .iter()
        .zip(max_new)
        .map(|(p, n)| Prompt {
            ids: p,
            max_new: n,
            seed: 0,
        })
        .collect();
    for prefill_tokens in [16_384, 7] {
        let got = generate_batch(&m, &prompts, &eos, &Sampling::GREEDY, prefill_tokens).unwrap();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(&g.tokens, e, "prompt {i}, prefill {prefill_tokens}");
            assert_eq!(g.eos, e.last() == Some(&eos[0]));
        }
    }
    let limits = BatchLimits {
        batch_size: 2,
        prefill_tokens: 64,
    };
    let got = generate_all(&m, &prompts, &eos, &Sampling::GREEDY, &limits, |_, _| {}).unwrap();
    let got: Vec<Vec<u32>> = got.into_iter().map(|a| a.tokens).collect();
    assert_eq!(got, expected);

    // Sampling is seeded per prompt: the same tokens however the prompts are batched, and not
    // simply the greedy ones.
    let sampling = Sampling {
        temperature: 1.5,
        top_p: 0.9,
    };
    let seeded: Vec<Prompt<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Prompt {
            seed: 100 + i as u64,
            max_new: 12,
            ..*p
        })
        .collect();
    let together = generate_batch(&m, &seeded, &[], &sampling, 16_384).unwrap();
    let apart: Vec<_> = seeded
        .iter()
        .map(|p| generate_batch(&m, &[*p], &[], &sampling, 16_384).unwrap()[0].clone())
        .collect();
    assert_eq!(together, apart);
    let greedy_all: Vec<Vec<u32>> = prompts_ids
        .iter()
        .map(|p| greedy_generate(&m, p, 12, &[]))
        .collect();
    assert!(together
        .iter()
        .zip(&greedy_all)
        .any(|(s, g)| &s.tokens != g));
}

// ---- the command ----

/// A source row: alternating (mask, tokens) segments.
type Segments = Vec<(u8, Vec<u32>)>;

fn row_of(segs: &Segments) -> (Vec<u32>, Vec<u8>) {
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for (m, t) in segs {
        ids.extend(t);
        mask.extend(std::iter::repeat_n(*m, t.len()));
    }
    (ids, mask)
}

/// Runs of equal mask value: (mask, tokens).
fn split_runs(ids: &[u32], mask: &[u8]) -> Segments {
    let mut out: Segments = Vec::new();
    for (&t, &m) in ids.iter().zip(mask) {
        match out.last_mut() {
            Some((lm, ts)) if *lm == m => ts.push(t),
            _ => out.push((m, vec![t])),
        }
    }
    out
}

const MAX_NEW: usize = 6;
const MAX_LEN: usize = 64;

struct Fixture {
    tmp: tempfile::TempDir,
    target: PathBuf,
    input: PathBuf,
    eos: Vec<u32>,
    /// split -> (id, segments)
    splits: Vec<(String, Vec<(String, Segments)>)>,
}

/// A tiny target whose generation_config.json names EOS tokens the model often produces (so
/// that answers end and later turns are reached), and a prepare-data style dataset (train and
/// validation) with multi-turn rows and rows to skip.
fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("target"), "llama", false, None, 9);
    let m = load(&target);
    let ctx = |s: usize, n: usize| (0u8, tokens(s, n));
    let ans = |s: usize, n: usize| (1u8, tokens(s + 500, n));
    let train: Vec<Segments> = vec![
        vec![
            ctx(1, 5),
            ans(1, 4),
            ctx(2, 3),
            ans(2, 5),
            ctx(3, 2),
            ans(3, 3),
        ],
        vec![ctx(4, 8), ans(4, 6)],
        vec![ctx(5, 3), ans(5, 2), ctx(6, 4), ans(6, 3), ctx(7, 1)],
        vec![ctx(8, 10)],                       // no assistant answer
        vec![ans(9, 3), ctx(9, 4), ans(10, 2)], // starts with an answer
        vec![ctx(11, 70), ans(11, 3)],          // prompt longer than --max-len
        vec![
            ctx(12, 2),
            ans(12, 7),
            ctx(13, 6),
            ans(13, 4),
            ctx(14, 5),
            ans(14, 2),
        ],
        vec![ctx(15, 40), ans(15, 3), ctx(16, 20), ans(16, 3)],
        vec![
            ctx(17, 1),
            ans(17, 1),
            ctx(18, 1),
            ans(18, 1),
            ctx(19, 1),
            ans(19, 1),
        ],
        // room for only 4 answer tokens
        vec![ctx(20, 60), ans(20, 3), ctx(21, 2), ans(21, 2)],
    ];
    let validation: Vec<Segments> = vec![
        vec![ctx(30, 6), ans(30, 2), ctx(31, 5), ans(31, 4)],
        vec![ctx(32, 3), ans(32, 9)],
    ];
    // EOS: the two tokens greedy decoding produces most often after the first contexts.
    let mut counts = [0usize; 50];
    for segs in train.iter().chain(&validation) {
        if segs[0].0 == 0 && segs[0].1.len() < MAX_LEN {
            for t in greedy_generate(&m, &segs[0].1, 2 * MAX_NEW, &[]) {
                counts[t as usize] += 1;
            }
        }
    }
    let mut by_count: Vec<u32> = (0..50).collect();
    by_count.sort_by_key(|&t| std::cmp::Reverse(counts[t as usize]));
    let gen_eos = vec![by_count[0], by_count[1]];
    std::fs::write(
        target.join("generation_config.json"),
        serde_json::json!({"eos_token_id": gen_eos}).to_string(),
    )
    .unwrap();
    // ... together with config.json's eos_token_id (2)
    let mut eos = gen_eos;
    eos.push(2);
    let input = tmp.path().join("data");
    std::fs::create_dir(&input).unwrap();
    let mut splits = Vec::new();
    for (name, rows) in [("train", train), ("validation", validation)] {
        let named: Vec<(String, Segments)> = rows
            .into_iter()
            .enumerate()
            .map(|(i, s)| (format!("{name}-conv-{i}"), s))
            .collect();
        let flat: Vec<(Vec<u32>, Vec<u8>)> = named.iter().map(|(_, s)| row_of(s)).collect();
        let token_rows: Vec<TokenRow<'_>> = named
            .iter()
            .zip(&flat)
            .map(|((id, _), (ids, mask))| TokenRow {
                id,
                input_ids: ids,
                loss_mask: mask,
            })
            .collect();
        let dir = input.join(name);
        std::fs::create_dir(&dir).unwrap();
        write_split(&dir, name, &token_rows, 4).unwrap();
        splits.push((name.to_string(), named));
    }
    std::fs::write(
        input.join("dataset_dict.json"),
        r#"{"splits": ["train", "validation"]}"#,
    )
    .unwrap();
    Fixture {
        tmp,
        target,
        input,
        eos,
        splits,
    }
}

fn regenerate(f: &Fixture, out: &Path, extra: &[&str]) -> (bool, String, String) {
    let (max_new, max_len) = (MAX_NEW.to_string(), MAX_LEN.to_string());
    let mut args = vec![
        "regenerate",
        "--target",
        f.target.to_str().unwrap(),
        "--input",
        f.input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-new-tokens",
        &max_new,
        "--max-len",
        &max_len,
        "--device",
        "cpu",
        "--dtype",
        "f32",
        "--chunk-rows",
        "2",
    ];
    if !extra.contains(&"--batch-size") {
        args.extend(["--batch-size", "3"]);
    }
    args.extend_from_slice(extra);
    dflash(&args)
}

/// Rows of one split of an output dataset: (id, ids, mask).
fn read_split(out: &Path, split: &str) -> Vec<(String, Vec<u32>, Vec<u8>)> {
    common::split_rows(&out.join(split))
}

/// Checks one split of an output against the source and the target's greedy decoding: context
/// segments kept in order, each answer exactly the greedy continuation of what precedes it,
/// and the row continued exactly as far as the rules allow.
fn check_split(
    m: &TargetModel,
    eos: &[u32],
    source: &[(String, Segments)],
    out: &[(String, Vec<u32>, Vec<u8>)],
    max_turns: Option<usize>,
) -> Counts {
    let usable: Vec<&(String, Segments)> = source
        .iter()
        .filter(|(_, s)| s[0].0 == 0 && s.len() > 1 && s[0].1.len() < MAX_LEN)
        .collect();
    assert_eq!(out.len(), usable.len());
    let mut c = Counts::default();
    for ((id, src), (out_id, ids, mask)) in usable.iter().zip(out) {
        assert_eq!(id, out_id);
        assert_eq!(ids.len(), mask.len());
        assert!(ids.len() <= MAX_LEN, "{id}: {} tokens", ids.len());
        let runs = split_runs(ids, mask);
        assert_eq!(runs[0].0, 0, "{id}");
        let mut pos = 0;
        let mut answers = 0;
        for (k, (mk, toks)) in runs.iter().enumerate() {
            if *mk == 0 {
                assert_eq!(toks, &src[k].1, "{id}: context segment {k}");
            } else {
                let limit = MAX_NEW.min(MAX_LEN - pos);
                let expect = greedy_generate(m, &ids[..pos], limit, eos);
                assert_eq!(toks, &expect, "{id}: answer {k}");
                answers += 1;
                c.turns += 1;
                c.tokens += toks.len();
            }
            pos += toks.len();
        }
        // Where the row ends: after an answer (or the trailing context after the last one).
        let last_answer = runs.iter().rposition(|(mk, _)| *mk == 1).unwrap();
        let ended_eos = eos.contains(runs[last_answer].1.last().unwrap());
        let src_answers = src.iter().filter(|(mk, _)| *mk == 1).count();
        let after_answer: usize = runs[..=last_answer].iter().map(|r| r.1.len()).sum();
        let next_ctx = src.get(last_answer + 1);
        let next_fits = next_ctx.is_some_and(|c| after_answer + c.1.len() < MAX_LEN);
        let turns_left = answers < src_answers && max_turns.is_none_or(|t| answers < t);
        assert!(
            !(ended_eos && turns_left && next_fits),
            "{id}: stopped after {answers} answers though it could go on"
        );
        if answers == src_answers && ended_eos {
            // the trailing context, if any, is kept when it fits
            match (runs.get(last_answer + 1), next_ctx) {
                (Some(r), Some(c)) => assert_eq!(r.1, c.1),
                (None, Some(c)) => assert!(after_answer + c.1.len() > MAX_LEN, "{id}"),
                _ => {}
            }
        } else {
            assert_eq!(
                runs.len(),
                last_answer + 1,
                "{id}: tokens after a last answer"
            );
        }
        if let Some(t) = max_turns {
            assert!(answers <= t);
        }
        c.multi += (answers > 1) as usize;
        if !ended_eos {
            if runs[last_answer].1.len() == MAX_NEW {
                c.at_max_new += 1;
            } else {
                c.at_max_len += 1;
            }
        }
    }
    c
}

#[derive(Debug, Default)]
struct Counts {
    /// rows with more than one answer
    multi: usize,
    turns: usize,
    tokens: usize,
    at_max_new: usize,
    at_max_len: usize,
}

#[test]
fn regenerate_replaces_answers_by_the_targets_greedy_answers() {
    let f = fixture();
    let m = load(&f.target);
    let out = f.tmp.path().join("regen");
    let (ok, stdout, stderr) = regenerate(&f, &out, &[]);
    assert!(ok, "{stderr}");
    assert!(!f.tmp.path().join("regen.partial").exists());
    for file in [
        "dataset_dict.json",
        "train/state.json",
        "train/dataset_info.json",
        "validation/state.json",
    ] {
        assert!(out.join(file).is_file(), "{file}");
    }
    let mut c = Counts::default();
    for (name, source) in &f.splits {
        let rows = read_split(&out, name);
        let one = check_split(&m, &f.eos, source, &rows, None);
        c.multi += one.multi;
        c.turns += one.turns;
        c.tokens += one.tokens;
        c.at_max_new += one.at_max_new;
        c.at_max_len += one.at_max_len;
    }
    // The fixture exercises every way an answer ends, and later turns.
    assert!(c.multi >= 2, "{c:?}");
    assert!(c.at_max_new >= 1 && c.at_max_len >= 1, "{c:?}");
    let counts = format!(
        "assistant turns regenerated: {}; generated tokens: {}; answers that hit --max-new-tokens: {}, --max-len: {}",
        c.turns, c.tokens, c.at_max_new, c.at_max_len
    );
    assert!(stdout.contains(&counts), "{counts:?} not in {stdout}");
    // The summary names the skips with split:row, and the counts.
    for s in [
        "12 rows in, 9 out, 3 skipped",
        "no assistant answer: 1",
        "train:3",
        "train:4",
        "train:5",
        "prompt longer than --max-len: 1",
    ] {
        assert!(stdout.contains(s), "{s:?} not in {stdout}");
    }
    // The trainer's loader reads it.
    let (store, report) = TokenStore::load(
        &out,
        &DataColumns::default(),
        &StoreOptions {
            vocab_size: 50,
            max_len: MAX_LEN,
            min_loss_tokens: 1,
            max_samples: 0,
        },
    )
    .unwrap();
    assert_eq!(store.len(), 7);
    assert_eq!(report.cut, 0);

    // --max-turns 1: only the first answer of each row, the rest dropped.
    let out1 = f.tmp.path().join("regen-1");
    let (ok, _, stderr) = regenerate(&f, &out1, &["--max-turns", "1", "--log-level", "info"]);
    assert!(ok, "{stderr}");
    // one answer asked of each row that has one (all but the row without an answer)
    assert_eq!(progress_end(&stderr), ((11, 11), (12, 12)), "{stderr}");
    for (name, source) in &f.splits {
        let full = read_split(&out, name);
        let one = read_split(&out1, name);
        check_split(&m, &f.eos, source, &one, Some(1));
        for (a, b) in full.iter().zip(&one) {
            let runs = split_runs(&b.1, &b.2);
            assert_eq!(runs.len(), 2, "{}: {runs:?}", b.0);
            let full_runs = split_runs(&a.1, &a.2);
            assert_eq!(runs[..], full_runs[..2]);
        }
    }
}

/// The counts of the last progress line (`--log-level info`, stderr not a terminal):
/// ((answers done, answers in all), (rows done, rows in all)).
fn progress_end(stderr: &str) -> ((usize, usize), (usize, usize)) {
    let line = stderr
        .lines()
        .filter_map(|l| l.split("regenerate: ").nth(1))
        .rfind(|l| l.contains(" answers, "))
        .unwrap_or_else(|| panic!("no progress line in {stderr}"));
    let pair = |text: &str| {
        let (done, all) = text.split_once('/').unwrap();
        (done.parse().unwrap(), all.parse().unwrap())
    };
    let mut words = line.split(' ');
    let answers = pair(words.next().unwrap());
    let rows = pair(words.nth(1).unwrap());
    (answers, rows)
}

#[test]
fn an_interrupted_run_resumes_to_the_same_output() {
    let f = fixture();
    let whole = f.tmp.path().join("whole");
    let (ok, _, stderr) = regenerate(&f, &whole, &[]);
    assert!(ok, "{stderr}");

    let out = f.tmp.path().join("resumed");
    let partial = f.tmp.path().join("resumed.partial");
    let (ok, stdout, stderr) = regenerate(
        &f,
        &out,
        &["--stop-after-chunks", "2", "--log-level", "info"],
    );
    assert!(ok, "{stderr}");
    // the progress counts answers: 2 of 6 chunks (4 of 12 rows) done, their answers with them
    let ((answers, all), rows) = progress_end(&stderr);
    assert_eq!(rows, (4, 12), "{stderr}");
    assert!(0 < answers && answers < all, "{stderr}");
    assert!(stdout.contains("2 of 6 chunks done"), "{stdout}");
    assert!(!out.exists());
    let chunks: Vec<String> = std::fs::read_dir(partial.join("train"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".arrow"))
        .collect();
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    assert!(partial.join("manifest.json").is_file());

    // Other options on the same partial output: refused, naming what changed.
    let (ok, _, stderr) = regenerate(&f, &out, &["--max-turns", "2"]);
    assert!(!ok);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains("--max-turns") && errors[0].contains("resumed.partial"),
        "{stderr}"
    );
    // A run that is killed leaves its finished chunks; a chunk file half-written is ignored.
    std::fs::write(partial.join("train/chunk-00002.arrow.tmp"), b"half").unwrap();
    // The temporary files and staging folders of killed writers are removed by the next run
    // (no PID exceeds the kernel's PID_MAX_LIMIT, 2^22); a live writer's (PID 1) are kept.
    let dead_chunk = partial.join("train/.chunk-00002.arrow.partial-4194305");
    let live_chunk = partial.join("train/.chunk-00004.arrow.partial-1");
    for file in [&dead_chunk, &live_chunk] {
        std::fs::write(file, b"half").unwrap();
    }
    let dead_staging = f.tmp.path().join(".resumed.partial-4194305");
    let live_staging = f.tmp.path().join(".resumed.partial-1");
    for dir in [&dead_staging, &live_staging] {
        std::fs::create_dir(dir).unwrap();
        std::fs::write(dir.join("dataset_dict.json"), b"{").unwrap();
    }
    let (ok, stdout, stderr) = regenerate(
        &f,
        &out,
        &["--stop-after-chunks", "1", "--log-level", "info"],
    );
    assert!(ok, "{stderr}");
    assert!(stdout.contains("3 of 6 chunks done"), "{stdout}");
    for gone in [&dead_chunk, &dead_staging] {
        assert!(!gone.exists(), "{} left", gone.display());
        let line = format!("removed {}, left by a writer that is gone", gone.display());
        assert!(stderr.contains(&line), "{line:?} not in {stderr}");
    }
    assert!(live_chunk.exists() && live_staging.exists());

    let (ok, stdout, stderr) = regenerate(&f, &out, &["--log-level", "info"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("3 chunk(s) resumed"), "{stdout}");
    assert!(
        live_staging.exists(),
        "a live writer's staging folder is kept"
    );
    // the resumed run counts the earlier answers too, and ends with all of them
    assert_eq!(progress_end(&stderr), ((all, all), (12, 12)), "{stderr}");
    assert!(!partial.exists());
    for (name, _) in &f.splits {
        assert_eq!(read_split(&out, name), read_split(&whole, name), "{name}");
    }
    // The summary counts every chunk, resumed or not.
    assert!(stdout.contains("12 rows in, 9 out, 3 skipped"), "{stdout}");
}

/// (file name, size) of every file of a split folder, sorted.
fn file_sizes(dir: &Path) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, e.metadata().unwrap().len())
        })
        .collect();
    out.sort();
    out
}

/// Rewrites the fixture's train split in place as a re-tokenisation would: other token ids in
/// row 0, a fixed mask in row 1, the same number of tokens (so the same file sizes).
fn retokenise_train(f: &Fixture) {
    let (_, rows) = &f.splits[0];
    let mut flat: Vec<(Vec<u32>, Vec<u8>)> = rows.iter().map(|(_, s)| row_of(s)).collect();
    flat[0].0[0] = if flat[0].0[0] == 7 { 8 } else { 7 };
    let last = flat[1].1.len() - 1;
    flat[1].1[last] = 0;
    let token_rows: Vec<TokenRow<'_>> = rows
        .iter()
        .zip(&flat)
        .map(|((id, _), (ids, mask))| TokenRow {
            id,
            input_ids: ids,
            loss_mask: mask,
        })
        .collect();
    write_split(&f.input.join("train"), "train", &token_rows, 4).unwrap();
}

#[test]
fn a_partial_run_over_changed_input_of_the_same_size_is_refused_until_restart() {
    let f = fixture();
    let out = f.tmp.path().join("regen");
    let partial = f.tmp.path().join("regen.partial");
    let (ok, _, stderr) = regenerate(&f, &out, &["--stop-after-chunks", "2"]);
    assert!(ok, "{stderr}");
    let before = file_sizes(&f.input.join("train"));
    retokenise_train(&f);
    assert_eq!(file_sizes(&f.input.join("train")), before);

    // Continuing would mix answers to the old rows with the new: refused, naming the way out.
    let (ok, _, stderr) = regenerate(&f, &out, &[]);
    assert!(!ok, "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    for part in [
        "regen.partial",
        "the input's content changed",
        "split(s) train differ",
        "--restart",
        "--out",
    ] {
        assert!(errors[0].contains(part), "{part:?} not in {stderr}");
    }
    assert!(!errors[0].contains("validation"), "{stderr}");
    assert!(
        partial.join("train/chunk-00001.json").is_file(),
        "nothing discarded"
    );

    // --restart discards the partial run and gives what a fresh run on the new input gives.
    let (ok, stdout, stderr) = regenerate(&f, &out, &["--restart", "--log-level", "info"]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("(--restart)"), "{stderr}");
    assert!(!stdout.contains("resumed"), "{stdout}");
    let fresh = f.tmp.path().join("fresh");
    let (ok, _, stderr) = regenerate(&f, &fresh, &[]);
    assert!(ok, "{stderr}");
    for (name, _) in &f.splits {
        assert_eq!(read_split(&out, name), read_split(&fresh, name), "{name}");
    }
    let old_first = row_of(&f.splits[0].1[0].1).0[0];
    assert_ne!(
        read_split(&out, "train")[0].1[0],
        old_first,
        "the new tokens"
    );

    // A partial run of the earlier version, whose manifest has no fingerprint, is continued on
    // the files' paths and sizes (what it was checked by), with a warning naming --restart.
    let old = f.tmp.path().join("old");
    let (ok, _, stderr) = regenerate(&f, &old, &["--stop-after-chunks", "2"]);
    assert!(ok, "{stderr}");
    let manifest_path = f.tmp.path().join("old.partial/manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    assert!(
        manifest["input_xxh3_128"]["train"].is_string(),
        "{manifest}"
    );
    manifest.as_object_mut().unwrap().remove("input_xxh3_128");
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    let (ok, stdout, stderr) = regenerate(&f, &old, &[]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("2 chunk(s) resumed"), "{stdout}");
    let warning = stderr
        .lines()
        .find(|l| l.contains("did not record the input's content"))
        .unwrap_or_else(|| panic!("no warning in {stderr}"));
    assert!(warning.contains("--restart"), "{warning}");
    for (name, _) in &f.splits {
        assert_eq!(read_split(&old, name), read_split(&fresh, name), "{name}");
    }
}

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

fn fails(args: &[&str], expect: &[&str]) {
    let (ok, _, stderr) = dflash(args);
    assert!(!ok, "{args:?} succeeded");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    for e in expect {
        assert!(errors[0].contains(e), "{e:?} not in {stderr:?}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_input_is_refused_with_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tiny_target_dir(&tmp.path().join("t"), "llama", false, None, 3);
    let t = target.to_str().unwrap();
    let good = tmp.path().join("good.arrow");
    write_token_dataset(&good, &[(vec![5, 6, 7, 8], vec![0, 0, 1, 1])]);
    let g = good.to_str().unwrap();
    let out = tmp.path().join("out");
    let o = out.to_str().unwrap();
    // --device cpu unless the case sets it
    let run = |input: &str, out: &str, extra: &[&str], expect: &[&str]| {
        let mut args = vec!["regenerate", "--target", t, "--input", input, "--out", out];
        if !extra.contains(&"--device") {
            args.extend_from_slice(&["--device", "cpu"]);
        }
        args.extend_from_slice(extra);
        fails(&args, expect);
    };

    let missing = tmp.path().join("missing-data");
    run(
        missing.to_str().unwrap(),
        o,
        &[],
        &["missing-data", "no such file or folder"],
    );

    // a dataset without loss_mask
    let no_mask = tmp.path().join("no-mask.arrow");
    {
        use arrow::array::{ArrayRef, Int32Builder, ListBuilder, RecordBatch};
        let mut ids = ListBuilder::new(Int32Builder::new());
        ids.values().append_slice(&[5, 6, 7]);
        ids.append(true);
        let batch = RecordBatch::try_from_iter([(
            "input_ids",
            std::sync::Arc::new(ids.finish()) as ArrayRef,
        )])
        .unwrap();
        let file = std::fs::File::create(&no_mask).unwrap();
        let mut w = arrow::ipc::writer::StreamWriter::try_new(file, &batch.schema()).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
    }
    run(
        no_mask.to_str().unwrap(),
        o,
        &[],
        &["no-mask.arrow", "loss_mask"],
    );

    // a token outside the target's vocabulary of 50
    let big = tmp.path().join("big.arrow");
    write_token_dataset(
        &big,
        &[(vec![5, 6], vec![0, 1]), (vec![5, 70, 8], vec![0, 0, 1])],
    );
    run(
        big.to_str().unwrap(),
        o,
        &[],
        &["big.arrow", "row 1", "70", "vocabulary"],
    );

    // a loss mask that is not 0/1, shown as the number it is (it was "Some(7)")
    let bad_mask = tmp.path().join("bad-mask.arrow");
    write_token_dataset(&bad_mask, &[(vec![5, 6, 7], vec![0, 7, 1])]);
    run(
        bad_mask.to_str().unwrap(),
        o,
        &[],
        &["bad-mask.arrow", "item 1 is 7, expected 0 or 1"],
    );

    run(g, o, &["--max-new-tokens", "0"], &["--max-new-tokens"]);
    // sizes beyond their bounds, named with the range, before anything is allocated
    run(
        g,
        o,
        &["--batch-size", "1099511627776"],
        &["--batch-size = 1099511627776 is out of range (must be between 1 and 65536)"],
    );
    run(
        g,
        o,
        &["--max-new-tokens", "1099511627776"],
        &["--max-new-tokens = 1099511627776 is out of range (must be between 1 and 1048576)"],
    );
    run(g, o, &["--top-p", "0"], &["--top-p"]);
    run(g, o, &["--device", "cpu,cpu"], &["--device"]);

    // an output folder that exists and is not empty
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    run(g, o, &[], &["out", "already exists"]);
    assert_eq!(std::fs::read(out.join("keep.txt")).unwrap(), b"mine");
    assert!(!tmp.path().join("out.partial").exists());

    // nothing left behind by the failures, and a good run still works
    let fresh = tmp.path().join("fresh");
    let (ok, stdout, stderr) = dflash(&[
        "regenerate",
        "--target",
        t,
        "--input",
        g,
        "--out",
        fresh.to_str().unwrap(),
        "--device",
        "cpu",
        "--max-new-tokens",
        "3",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("1 rows in, 1 out"), "{stdout}");
    let rows = read_split(&fresh, "train");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, "0");
    assert_eq!(rows[0].1[..2], [5, 6]);
    assert_eq!(rows[0].2[..2], [0, 0]);
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
