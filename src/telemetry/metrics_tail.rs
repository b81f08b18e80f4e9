//! The one reader of a run's `metrics.jsonl`: it reads the file as it grows, parsing only the
//! bytes written since the last look (a screen on a finished 200 MB run re-read it whole four
//! times a second: 67 % of a core, 540 MB, seconds from a key to its answer). A last line not
//! yet ended by a newline waits for its end; a file that shrank or was replaced (a resumed run
//! rewrites it) is read again from its start. Lines that are not records (bytes that are not
//! UTF-8, a cut or foreign line) are skipped and counted, never fatal: one bad byte must not
//! hide a run.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::records::MetricsRecord;

/// Bytes read at a time: what the first read of a long file holds in memory at once.
const CHUNK: usize = 1 << 20;

/// What a read of the file gives, in order.
pub(crate) enum Seen<'a> {
    /// The file shrank or was replaced: what was read of it before is void.
    Restart,
    /// One record and its line (without the newline).
    Record {
        record: MetricsRecord,
        line: &'a [u8],
    },
}

/// Lines that were not records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BadLines {
    pub count: u64,
    /// The first one: its line number (from 1) and what is wrong with it.
    pub first: Option<(u64, String)>,
}

impl BadLines {
    /// "2 unreadable lines skipped (the first, line 7: not UTF-8 at byte 37)"; None when
    /// there are none.
    pub(crate) fn describe(&self) -> Option<String> {
        let (line, why) = self.first.as_ref()?;
        Some(match self.count {
            1 => format!("1 unreadable line skipped (line {line}: {why})"),
            n => format!("{n} unreadable lines skipped (the first, line {line}: {why})"),
        })
    }
}

/// Where a reader of one `metrics.jsonl` stands.
pub(crate) struct MetricsTail {
    path: PathBuf,
    /// The file read (device and inode), to notice a replaced one.
    identity: Option<(u64, u64)>,
    pos: u64,
    /// The start of a line not yet ended by a newline.
    partial: Vec<u8>,
    /// Complete lines read so far.
    lines: u64,
    bad: BadLines,
}

impl MetricsTail {
    pub(crate) fn new(path: &Path) -> Self {
        MetricsTail {
            path: path.to_path_buf(),
            identity: None,
            pos: 0,
            partial: Vec::new(),
            lines: 0,
            bad: BadLines::default(),
        }
    }

    pub(crate) fn bad_lines(&self) -> &BadLines {
        &self.bad
    }

    /// Hands `each` the records written since the last read ([`Seen::Restart`] first when the
    /// file must be read again from its start). Ok(false): there is no such file.
    pub(crate) fn read_new(&mut self, mut each: impl FnMut(Seen<'_>)) -> std::io::Result<bool> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        let identity = Some((meta.dev(), meta.ino()));
        if meta.len() < self.pos || (self.identity.is_some() && identity != self.identity) {
            *self = MetricsTail::new(&self.path);
            each(Seen::Restart);
        }
        self.identity = identity;
        if meta.len() == self.pos {
            return Ok(true);
        }
        file.seek(SeekFrom::Start(self.pos))?;
        let mut chunk = vec![0u8; CHUNK];
        loop {
            let n = file.read(&mut chunk)?;
            if n == 0 {
                return Ok(true);
            }
            self.pos += n as u64;
            self.take_lines(&chunk[..n], &mut each);
        }
    }

    /// Also hands over a last line without its newline when it is a whole record (a file read
    /// once, not followed); true when one was there and was not (a run killed mid-write
    /// leaves half a line, which is not counted as bad).
    pub(crate) fn finish(&mut self, mut each: impl FnMut(Seen<'_>)) -> bool {
        let rest = std::mem::take(&mut self.partial);
        if rest.iter().all(u8::is_ascii_whitespace) {
            return false;
        }
        match parse_line(&rest) {
            Ok(record) => {
                self.lines += 1;
                each(Seen::Record {
                    record,
                    line: &rest,
                });
                false
            }
            Err(_) => true,
        }
    }

    fn take_lines(&mut self, bytes: &[u8], each: &mut impl FnMut(Seen<'_>)) {
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = (&rest[..end], &rest[end + 1..]);
            rest = tail;
            if self.partial.is_empty() {
                self.line(head, each);
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(head);
                self.line(&line, each);
            }
        }
        self.partial.extend_from_slice(rest);
    }

    fn line(&mut self, line: &[u8], each: &mut impl FnMut(Seen<'_>)) {
        self.lines += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        match parse_line(line) {
            Ok(record) => each(Seen::Record { record, line }),
            Err(why) => {
                self.bad.count += 1;
                self.bad.first.get_or_insert((self.lines, why));
            }
        }
    }
}

/// One line as a record, or what is wrong with it.
fn parse_line(line: &[u8]) -> Result<MetricsRecord, String> {
    let text = std::str::from_utf8(line)
        .map_err(|e| format!("not UTF-8 at byte {}", e.valid_up_to() + 1))?;
    serde_json::from_str(text).map_err(|e| e.to_string())
}

/// What [`read_all`] found besides the records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ReadAll {
    /// There is such a file.
    pub exists: bool,
    pub bad: BadLines,
    /// The last line had no newline and was not a record (cut short by a kill); not in `bad`.
    pub cut_last_line: bool,
}

/// Every record of the file at `path` once, with its line.
pub(crate) fn read_all(
    path: &Path,
    mut each: impl FnMut(&MetricsRecord, &[u8]),
) -> std::io::Result<ReadAll> {
    let mut tail = MetricsTail::new(path);
    let mut on = |seen: Seen<'_>| {
        if let Seen::Record { record, line } = seen {
            each(&record, line);
        }
    };
    let exists = tail.read_new(&mut on)?;
    let cut_last_line = tail.finish(&mut on);
    Ok(ReadAll {
        exists,
        bad: tail.bad,
        cut_last_line,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::records::MetricsRecord;
    use std::io::Write;

    fn event(i: u64) -> String {
        serde_json::to_string(&MetricsRecord::Event {
            elapsed_s: i as f64,
            kind: crate::telemetry::records::EventKind::Other("k".into()),
            message: format!("m{i}"),
        })
        .unwrap()
    }

    /// The elapsed_s of the records seen, with -1 for a restart.
    fn seen(tail: &mut MetricsTail) -> Vec<i64> {
        let mut out = Vec::new();
        tail.read_new(|s| match s {
            Seen::Restart => out.push(-1),
            Seen::Record {
                record: MetricsRecord::Event { elapsed_s, .. },
                ..
            } => out.push(elapsed_s as i64),
            Seen::Record { .. } => out.push(-2),
        })
        .unwrap();
        out
    }

    #[test]
    fn only_new_complete_lines_are_read_and_a_replaced_file_again_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut tail = MetricsTail::new(&path);
        assert!(seen(&mut tail).is_empty(), "no file yet");
        let mut f = File::create(&path).unwrap();
        writeln!(f, "{}\n{}", event(1), event(2)).unwrap();
        assert_eq!(seen(&mut tail), vec![1, 2]);
        assert_eq!(seen(&mut tail), Vec::<i64>::new(), "nothing new");
        let third = event(3);
        f.write_all(&third.as_bytes()[..10]).unwrap();
        assert_eq!(seen(&mut tail), Vec::<i64>::new(), "half a line waits");
        writeln!(f, "{}", &third[10..]).unwrap();
        assert_eq!(seen(&mut tail), vec![3]);
        // a bad byte and a foreign line: skipped, counted, the first one named
        f.write_all(b"{\"type\":\"event\",\"elapsed_s\":4,\"kind\":\"\xff\"}\n")
            .unwrap();
        writeln!(f, "not json\n{}", event(5)).unwrap();
        assert_eq!(seen(&mut tail), vec![5]);
        assert_eq!(tail.bad_lines().count, 2);
        assert_eq!(
            tail.bad_lines().describe().unwrap(),
            "2 unreadable lines skipped (the first, line 4: not UTF-8 at byte 39)"
        );
        // rewritten beside and renamed (what a resumed run does): read again
        let tmp = dir.path().join("tmp");
        std::fs::write(&tmp, format!("{}\n", event(7))).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert_eq!(seen(&mut tail), vec![-1, 7]);
        assert_eq!(tail.bad_lines().count, 0);
        // cut back in place: read again
        std::fs::write(&path, "").unwrap();
        assert_eq!(seen(&mut tail), vec![-1]);
    }

    #[test]
    fn lines_across_chunks_are_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let n = 3 * CHUNK as u64 / event(0).len() as u64;
        let text: String = (0..n).map(|i| event(i) + "\n").collect();
        std::fs::write(&path, text + &event(n)).unwrap();
        let mut count = 0;
        let read = read_all(&path, |r, _| {
            assert!(
                matches!(r, MetricsRecord::Event { elapsed_s, .. } if *elapsed_s == count as f64)
            );
            count += 1;
        })
        .unwrap();
        assert!(read.exists && !read.cut_last_line);
        assert_eq!(
            (count, read.bad.count),
            (n + 1, 0),
            "the unended last line is read whole"
        );
        // half a line at the end: left out, and said so, not counted as bad
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"\n{\"type\":\"ev").unwrap();
        let read = read_all(&path, |_, _| {}).unwrap();
        assert!(read.cut_last_line && read.bad.count == 0, "{read:?}");
    }
}
