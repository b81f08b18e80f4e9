//! `regenerate`: batched, left-padded generation equals plain greedy decoding; the command keeps
//! every context segment, replaces every assistant segment by the target's own answer, resumes
//! from finished chunks, and refuses bad input with one clear error.

use crate::common;

mod bad_input;
mod engines;
mod resume;

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

/// Writes split `name` into `dir`: the rows' ids with their token ids and loss masks `flat`.
fn write_rows(dir: &Path, name: &str, rows: &[(String, Segments)], flat: &[(Vec<u32>, Vec<u8>)]) {
    let token_rows: Vec<TokenRow<'_>> = rows
        .iter()
        .zip(flat)
        .map(|((id, _), (ids, mask))| TokenRow {
            id,
            input_ids: ids,
            loss_mask: mask,
        })
        .collect();
    write_split(dir, name, &token_rows, 4).unwrap();
}

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
        let dir = input.join(name);
        std::fs::create_dir(&dir).unwrap();
        write_rows(&dir, name, &named, &flat);
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
