//! regenerate resumes: an interrupted run ends with the same output, and a partial run over
//! changed input is refused until restarted.

use super::*;

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
    write_rows(&f.input.join("train"), "train", rows, &flat);
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
