//! regenerate refuses bad input (arguments, data, models) with one clear error naming what is
//! wrong.

use super::*;

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
