//! The loader: token store validation and rules, packer budgets, coverage, padding and resume,
//! and bad Arrow / Parquet input named by file and row.

use crate::common;

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringBuilder};
use dflash_tui::data::packer::{collate, Packer, PackerConfig};
use dflash_tui::data::store::{DataColumns, StoreOptions, TokenStore};

fn write_dataset(path: &Path, rows: &[(Vec<i32>, Vec<i8>)]) {
    common::write_token_dataset(path, rows)
}

/// Every sample of a test data set, up to 512 tokens, none dropped.
fn load_all(path: &Path) -> Arc<TokenStore> {
    let o = StoreOptions {
        vocab_size: 1000,
        max_len: 512,
        min_loss_tokens: 0,
        max_samples: 0,
    };
    Arc::new(
        TokenStore::load(path, &DataColumns::default(), &o)
            .unwrap()
            .0,
    )
}

fn opts() -> StoreOptions {
    StoreOptions {
        vocab_size: 1000,
        max_len: 64,
        min_loss_tokens: 8,
        max_samples: 0,
    }
}

/// Samples of lengths 10..=200 with the second half of each in the loss.
fn many(n: usize) -> Vec<(Vec<i32>, Vec<i8>)> {
    (0..n)
        .map(|i| {
            let len = 10 + (i * 37) % 191;
            let ids = (0..len).map(|k| ((i + k) % 1000) as i32).collect();
            let mask = (0..len).map(|k| (k >= len / 2) as i8).collect();
            (ids, mask)
        })
        .collect()
}

#[test]
fn store_cuts_drops_and_gives_o1_access() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("d.arrow");
    let rows = vec![
        ((0..100).collect::<Vec<i32>>(), vec![1i8; 100]), // cut to 64
        ((0..20).collect(), [vec![0i8; 15], vec![1i8; 5]].concat()), // 5 loss tokens < 8: dropped
        ((5..25).collect(), vec![1i8; 20]),
    ];
    write_dataset(&path, &rows);
    let (store, report) = TokenStore::load(&path, &DataColumns::default(), &opts()).unwrap();
    assert_eq!(
        (report.rows, report.kept, report.cut, report.dropped_short),
        (3, 2, 1, 1)
    );
    assert_eq!(store.len(), 2);
    assert_eq!(store.get(0).input_ids.len(), 64);
    assert_eq!(store.get(1).input_ids, &(5..25).collect::<Vec<u32>>()[..]);
    assert_eq!(store.source_row(1), 2);
    assert_eq!(report.loss_tokens, 64 + 20);
}

#[test]
fn packer_respects_the_budget_covers_each_epoch_and_buckets() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("d.arrow");
    write_dataset(&path, &many(500));
    let store = load_all(&path);
    let config = PackerConfig {
        token_budget: 1024,
        max_batch: 16,
        window: 128,
        seed: 3,
    };
    let mut packer = Packer::new(store.clone(), config.clone());
    let mut seen = vec![0usize; store.len()];
    while seen.iter().sum::<usize>() < store.len() {
        let b = packer.next().unwrap();
        assert_eq!(b.epoch, 0);
        assert!(b.indices.len() <= 16);
        assert!(b.padded_tokens() <= 1024 || b.indices.len() == 1);
        for &i in &b.indices {
            seen[i] += 1;
        }
        let c = collate(&store, &b);
        assert_eq!(
            c.input_ids.size(),
            vec![b.indices.len() as i64, b.max_len as i64]
        );
    }
    assert!(
        seen.iter().all(|&n| n == 1),
        "every sample exactly once per epoch"
    );
    assert_eq!(packer.next().unwrap().epoch, 1);
    // bucketing beats batches of the same sizes in sampler order
    let bucketed = packer.stats.padding_fraction();
    let unsorted = {
        let mut s = dflash_tui::data::sampler::EpochSampler::new(store.len(), 3);
        let order: Vec<usize> = std::iter::from_fn(|| s.next_in_epoch()).collect();
        let (mut real, mut padded) = (0usize, 0usize);
        for chunk in order.chunks(6) {
            let lens: Vec<usize> = chunk.iter().map(|&i| store.sample_len(i)).collect();
            real += lens.iter().sum::<usize>();
            padded += lens.iter().max().unwrap() * lens.len();
        }
        1.0 - real as f64 / padded as f64
    };
    assert!(
        bucketed < unsorted / 3.0,
        "padding {bucketed:.3} vs {unsorted:.3} unbucketed"
    );
}

#[test]
fn packer_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("d.arrow");
    write_dataset(&path, &many(300));
    let store = load_all(&path);
    let config = PackerConfig {
        token_budget: 800,
        max_batch: 8,
        window: 64,
        seed: 9,
    };
    let mut a = Packer::new(store.clone(), config.clone());
    for _ in 0..37 {
        a.next();
    }
    let state = a.state();
    let rest: Vec<_> = (0..200).map(|_| a.next().unwrap()).collect();
    let mut b = Packer::resume(store, config, state).unwrap();
    let again: Vec<_> = (0..200).map(|_| b.next().unwrap()).collect();
    assert_eq!(rest, again);
    assert!(
        rest.iter().any(|x| x.epoch > 0),
        "the test crosses an epoch boundary"
    );
}

fn load_err(path: &Path) -> String {
    format!(
        "{:#}",
        TokenStore::load(path, &DataColumns::default(), &opts()).unwrap_err()
    )
}

#[test]
fn bad_arrow_and_parquet_input_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.arrow");
    write_dataset(&good, &many(50));
    let bytes = std::fs::read(&good).unwrap();

    let cut = tmp.path().join("cut.arrow");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let msg = load_err(&cut);
    assert!(msg.contains("cut.arrow"), "{msg}");

    let corrupt = tmp.path().join("corrupt.arrow");
    let mut c = bytes.clone();
    for b in c.iter_mut().skip(8).take(64) {
        *b = 0xAB;
    }
    std::fs::write(&corrupt, &c).unwrap();
    assert!(load_err(&corrupt).contains("corrupt.arrow"));

    // Parquet cut in the middle
    let pq = tmp.path().join("t.parquet");
    let batch = dflash_tui::data::arrow_io::read_batches(&good)
        .unwrap()
        .remove(0);
    let mut w = parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(&pq).unwrap(),
        batch.schema(),
        None,
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let pbytes = std::fs::read(&pq).unwrap();
    let pcut = tmp.path().join("cut.parquet");
    std::fs::write(&pcut, &pbytes[..pbytes.len() / 2]).unwrap();
    let msg = load_err(&pcut);
    assert!(msg.contains("cut.parquet"), "{msg}");

    // wrong column type, missing column
    let mut names = StringBuilder::new();
    names.append_value("x");
    let wrong = tmp.path().join("wrong.arrow");
    let b =
        RecordBatch::try_from_iter([("input_ids", Arc::new(names.finish()) as ArrayRef)]).unwrap();
    let mut w = arrow::ipc::writer::FileWriter::try_new(
        std::fs::File::create(&wrong).unwrap(),
        &b.schema(),
    )
    .unwrap();
    w.write(&b).unwrap();
    w.finish().unwrap();
    let msg = load_err(&wrong);
    assert!(
        msg.contains("wrong.arrow") && msg.contains("\"input_ids\"") && msg.contains("Utf8"),
        "{msg}"
    );
    let msg = format!(
        "{:#}",
        TokenStore::load(
            &good,
            &DataColumns {
                input_ids: "tokens".into(),
                loss_mask: None
            },
            &opts()
        )
        .unwrap_err()
    );
    assert!(
        msg.contains("good.arrow") && msg.contains("no column \"tokens\""),
        "{msg}"
    );

    // ids outside the vocabulary, loss mask of the wrong length
    let big = tmp.path().join("big.arrow");
    write_dataset(
        &big,
        &[
            (vec![1, 2, 3], vec![1, 1, 1]),
            (vec![4, 1000, 6], vec![1, 1, 1]),
        ],
    );
    let msg = load_err(&big);
    assert!(
        msg.contains("big.arrow: row 1") && msg.contains("1000") && msg.contains("vocabulary"),
        "{msg}"
    );
    let short = tmp.path().join("short.arrow");
    write_dataset(&short, &[(vec![1, 2, 3], vec![1, 1])]);
    let msg = load_err(&short);
    assert!(
        msg.contains("short.arrow: row 0") && msg.contains("\"loss_mask\" has 2 items"),
        "{msg}"
    );
}

#[test]
fn max_samples_keeps_the_first_usable_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("d.arrow");
    common::write_token_dataset(&path, &many(50));
    let all = TokenStore::load(&path, &DataColumns::default(), &opts()).unwrap();
    let limited = TokenStore::load(
        &path,
        &DataColumns::default(),
        &StoreOptions {
            max_samples: 7,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(limited.0.len(), 7);
    assert!(limited.1.not_read > 0);
    for i in 0..7 {
        assert_eq!(limited.0.get(i).input_ids, all.0.get(i).input_ids);
    }
}
