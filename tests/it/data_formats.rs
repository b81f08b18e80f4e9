//! Token columns from every supported layout: Arrow IPC file and stream, a `datasets`
//! save_to_disk folder, Parquet; int32, int64 and uint32 items; errors naming file and row.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Int32Builder, Int64Builder, LargeListBuilder, ListBuilder, RecordBatch, UInt32Builder,
};
use dflash_tui::data::arrow_io::read_token_column;

fn seqs() -> Vec<Vec<u32>> {
    vec![vec![1, 2, 3], vec![], vec![40000, 5], (0..100).collect()]
}

fn list_i32(seqs: &[Vec<u32>]) -> ArrayRef {
    let mut b = ListBuilder::new(Int32Builder::new());
    for s in seqs {
        s.iter().for_each(|&t| b.values().append_value(t as i32));
        b.append(true);
    }
    Arc::new(b.finish())
}

fn large_list_i64(seqs: &[Vec<u32>]) -> ArrayRef {
    let mut b = LargeListBuilder::new(Int64Builder::new());
    for s in seqs {
        s.iter().for_each(|&t| b.values().append_value(t as i64));
        b.append(true);
    }
    Arc::new(b.finish())
}

fn list_u32(seqs: &[Vec<u32>]) -> ArrayRef {
    let mut b = ListBuilder::new(UInt32Builder::new());
    for s in seqs {
        s.iter().for_each(|&t| b.values().append_value(t));
        b.append(true);
    }
    Arc::new(b.finish())
}

fn batch(col: ArrayRef) -> RecordBatch {
    RecordBatch::try_from_iter([("input_ids", col)]).unwrap()
}

fn write_ipc_file(path: &Path, b: &RecordBatch) {
    let mut w =
        arrow::ipc::writer::FileWriter::try_new(std::fs::File::create(path).unwrap(), &b.schema())
            .unwrap();
    w.write(b).unwrap();
    w.finish().unwrap();
}

fn write_ipc_stream(path: &Path, batches: &[RecordBatch]) {
    let mut w = arrow::ipc::writer::StreamWriter::try_new(
        std::fs::File::create(path).unwrap(),
        &batches[0].schema(),
    )
    .unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

fn collected(path: &Path) -> Vec<Vec<u32>> {
    read_token_column(path, "input_ids")
        .unwrap()
        .iter()
        .map(|s| s.to_vec())
        .collect()
}

#[test]
fn every_layout_reads_the_same_sequences() {
    let tmp = tempfile::tempdir().unwrap();
    let want = seqs();

    let file = tmp.path().join("a.arrow");
    write_ipc_file(&file, &batch(list_i32(&want)));
    assert_eq!(collected(&file), want);

    let stream = tmp.path().join("b.arrow");
    write_ipc_stream(
        &stream,
        &[
            batch(large_list_i64(&want[..2])),
            batch(large_list_i64(&want[2..])),
        ],
    );
    assert_eq!(collected(&stream), want);

    // save_to_disk layout: stream shards listed in state.json
    let ds = tmp.path().join("ds");
    std::fs::create_dir(&ds).unwrap();
    write_ipc_stream(
        &ds.join("data-00000-of-00002.arrow"),
        &[batch(list_u32(&want[..3]))],
    );
    write_ipc_stream(
        &ds.join("data-00001-of-00002.arrow"),
        &[batch(list_u32(&want[3..]))],
    );
    std::fs::write(
        ds.join("state.json"),
        r#"{"_data_files": [{"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}], "_split": "train"}"#,
    )
    .unwrap();
    std::fs::write(ds.join("dataset_info.json"), "{}").unwrap();
    assert_eq!(collected(&ds), want);

    let pq = tmp.path().join("c.parquet");
    let b = batch(large_list_i64(&want));
    let mut w =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&pq).unwrap(), b.schema(), None)
            .unwrap();
    w.write(&b).unwrap();
    w.close().unwrap();
    assert_eq!(collected(&pq), want);
}

#[test]
fn bad_columns_and_values_name_file_and_row() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("neg.arrow");
    let mut b = ListBuilder::new(Int32Builder::new());
    b.values().append_value(3);
    b.append(true);
    b.values().append_value(-4);
    b.append(true);
    write_ipc_file(&file, &batch(Arc::new(b.finish())));
    let msg = format!("{:#}", read_token_column(&file, "input_ids").unwrap_err());
    assert!(msg.contains("neg.arrow") && msg.contains("row 1"), "{msg}");

    let msg = format!("{:#}", read_token_column(&file, "tokens").unwrap_err());
    assert!(
        msg.contains("no column \"tokens\"") && msg.contains("input_ids"),
        "{msg}"
    );

    let text = tmp.path().join("x.arrow");
    std::fs::write(&text, b"not arrow at all").unwrap();
    let msg = format!("{:#}", read_token_column(&text, "input_ids").unwrap_err());
    assert!(msg.contains("x.arrow"), "{msg}");
    let msg = format!(
        "{:#}",
        read_token_column(&tmp.path().join("nothing"), "input_ids").unwrap_err()
    );
    assert!(msg.contains("no such file"), "{msg}");
}
