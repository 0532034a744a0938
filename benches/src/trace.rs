//! A minimal reader of RMM allocation logs (`Thread,Time,Action,Pointer,Size,Stream`, as RMM's
//! `logging_resource_adaptor` writes them) with the JSON sidecar of `../shared/traces/`, which
//! gives each step's start time (`steps_start_ns`). It turns a log into a [`Sequence`]:
//!
//! - allocations get dense ids; a free finds its allocation by pointer (a pointer may be reused
//!   once freed); frees of pointers the log never allocated are dropped and counted;
//! - step boundaries go where an event's time reaches the next step's start;
//! - an allocation freed in the step that made it gets the `step` lifetime, any other one
//!   `persistent`; allocations never freed stay live to the end.
//!
//! `Time` is nanoseconds from the start or a clock time `HH:MM:SS.ffffff` (real RMM logs), taken
//! relative to the first event. Threads and streams are not distinguished: the replay runs on
//! one stream.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::sequence::{Lifetime, Op, Sequence};

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The header is not RMM's.
    #[error("{path}: the header is `{header}`, expected `Thread,Time,Action,Pointer,Size,Stream`")]
    Header {
        /// The file.
        path: PathBuf,
        /// The header found.
        header: String,
    },
    /// A line could not be read.
    #[error("{path}:{line}: {reason}")]
    Line {
        /// The file.
        path: PathBuf,
        /// The line number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The sidecar could not be read.
    #[error("{path}: {reason}")]
    Sidecar {
        /// The sidecar file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// What reading a trace found besides its sequence.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceSummary {
    /// Frees of pointers the log never allocated (made before it started), dropped.
    pub unmatched_frees: usize,
    /// Allocations never freed.
    pub never_freed: usize,
}

#[derive(Deserialize)]
struct Sidecar {
    steps_start_ns: Vec<i64>,
}

/// The traces in `dir`: every `*.csv` with a `*.json` sidecar beside it, by name.
pub fn find(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.path())
                .filter(|path| path.extension().is_some_and(|e| e == "csv") && path.with_extension("json").is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// Reads the log at `csv` and its sidecar (`csv` with the extension `.json`; without one, the
/// whole log is one step).
pub fn read(csv: &Path) -> Result<(Sequence, TraceSummary), TraceError> {
    let text = std::fs::read_to_string(csv).map_err(|source| TraceError::Io { path: csv.to_owned(), source })?;
    let sidecar = csv.with_extension("json");
    let starts = if sidecar.is_file() {
        let json =
            std::fs::read_to_string(&sidecar).map_err(|source| TraceError::Io { path: sidecar.clone(), source })?;
        let parsed: Sidecar = serde_json::from_str(&json)
            .map_err(|error| TraceError::Sidecar { path: sidecar.clone(), reason: error.to_string() })?;
        parsed.steps_start_ns
    } else {
        Vec::new()
    };
    let name = csv.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "trace".to_owned());
    parse(csv, &name, &text, &starts)
}

struct Event {
    time: i64,
    allocate: bool,
    pointer: u64,
    size: u64,
}

fn parse(path: &Path, name: &str, text: &str, starts: &[i64]) -> Result<(Sequence, TraceSummary), TraceError> {
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, line)| line.trim()).unwrap_or_default();
    let columns: Vec<&str> = header.split(',').map(str::trim).collect();
    if columns != ["Thread", "Time", "Action", "Pointer", "Size", "Stream"] {
        return Err(TraceError::Header { path: path.to_owned(), header: header.to_owned() });
    }
    let mut events = Vec::new();
    for (index, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| TraceError::Line { path: path.to_owned(), line: index + 1, reason };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != 6 {
            return Err(bad(format!("{} fields, expected 6", fields.len())));
        }
        let allocate = match fields[2] {
            "allocate" => true,
            "free" => false,
            "allocate failure" => continue,
            other => return Err(bad(format!("unknown action `{other}`"))),
        };
        let time =
            parse_time(fields[1]).ok_or_else(|| bad(format!("time `{}` is not ns or HH:MM:SS.ffffff", fields[1])))?;
        let pointer = parse_pointer(fields[3]).ok_or_else(|| bad(format!("pointer `{}` is not hex", fields[3])))?;
        let size = fields[4].parse().map_err(|_| bad(format!("size `{}` is not a byte count", fields[4])))?;
        events.push(Event { time, allocate, pointer, size });
    }
    // Clock times are taken relative to the first event, like nanosecond offsets.
    if fields_are_clock_times(text) {
        let first = events.first().map(|e| e.time).unwrap_or(0);
        events.iter_mut().for_each(|e| e.time -= first);
    }

    let mut summary = TraceSummary::default();
    // Per id: bytes, the step it was made in, the step it was freed in.
    let mut allocations: Vec<(u64, usize, Option<usize>)> = Vec::new();
    let mut live: HashMap<u64, u32> = HashMap::new();
    let mut raw_ops: Vec<Op> = Vec::with_capacity(events.len());
    // Step `k` starts at starts[k]; events before starts[1] are in step 0.
    let mut step = 0usize;
    for event in &events {
        while step + 1 < starts.len() && event.time >= starts[step + 1] {
            step += 1;
            raw_ops.push(Op::Step);
        }
        if event.allocate {
            let id = allocations.len() as u32;
            allocations.push((event.size, step, None));
            // A pointer allocated again without a free in the log: the old one stays live.
            live.insert(event.pointer, id);
            raw_ops.push(Op::Alloc { id, bytes: event.size, lifetime: Lifetime::Persistent });
        } else if let Some(id) = live.remove(&event.pointer) {
            allocations[id as usize].2 = Some(step);
            raw_ops.push(Op::Free { id });
        } else {
            summary.unmatched_frees += 1;
        }
    }
    summary.never_freed = allocations.iter().filter(|a| a.2.is_none()).count();
    let ops = raw_ops
        .into_iter()
        .map(|op| match op {
            Op::Alloc { id, bytes, .. } => {
                let (_, made, freed) = allocations[id as usize];
                let lifetime = if freed == Some(made) { Lifetime::Step } else { Lifetime::Persistent };
                Op::Alloc { id, bytes, lifetime }
            }
            other => other,
        })
        .collect();
    let description = format!(
        "RMM log {} ({} allocations, {} steps, {} unmatched frees dropped, {} never freed)",
        path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        allocations.len(),
        starts.len().max(1),
        summary.unmatched_frees,
        summary.never_freed
    );
    Ok((Sequence { name: name.to_owned(), description, ops }, summary))
}

fn fields_are_clock_times(text: &str) -> bool {
    text.lines().nth(1).and_then(|line| line.split(',').nth(1)).is_some_and(|time| time.contains(':'))
}

/// Nanoseconds: an integer, or `HH:MM:SS.ffffff` as nanoseconds since midnight.
fn parse_time(field: &str) -> Option<i64> {
    if let Ok(ns) = field.parse::<i64>() {
        return Some(ns);
    }
    let mut parts = field.split(':');
    let (h, m, s) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
    let (whole, fraction) = s.split_once('.').unwrap_or((s, ""));
    let whole: i64 = whole.parse().ok()?;
    if fraction.len() > 9 || !fraction.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let fraction: i64 = format!("{fraction:0<9}").parse().ok()?;
    Some(((h * 60 + m) * 60 + whole) * 1_000_000_000 + fraction)
}

fn parse_pointer(field: &str) -> Option<u64> {
    let hex = field.strip_prefix("0x").or_else(|| field.strip_prefix("0X")).unwrap_or(field);
    u64::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream\n";

    #[test]
    fn steps_and_lifetimes_follow_the_sidecar() {
        let log = format!(
            "{HEADER}1,0,allocate,0x10,100,0x0\n1,5,allocate,0x20,50,0x0\n1,6,free,0x20,50,0x0\n\
             1,10,allocate,0x20,70,0x0\n1,11,free,0x999,1,0x0\n1,12,free,0x10,100,0x0\n1,13,free,0x20,70,0x0\n"
        );
        let (sequence, summary) = parse(Path::new("t.csv"), "t", &log, &[-5, 10]).unwrap();
        sequence.validate().unwrap();
        assert_eq!(summary, TraceSummary { unmatched_frees: 1, never_freed: 0 });
        assert_eq!(
            sequence.ops,
            vec![
                Op::Alloc { id: 0, bytes: 100, lifetime: Lifetime::Persistent },
                Op::Alloc { id: 1, bytes: 50, lifetime: Lifetime::Step },
                Op::Free { id: 1 },
                Op::Step,
                Op::Alloc { id: 2, bytes: 70, lifetime: Lifetime::Step },
                Op::Free { id: 0 },
                Op::Free { id: 2 },
            ]
        );
        assert_eq!(sequence.peak_live(), 170);
    }

    #[test]
    fn clock_times_and_bad_lines() {
        assert_eq!(parse_time("01:00:00.5"), Some(3_600_500_000_000));
        assert_eq!(parse_time("00:00:01.000001"), Some(1_000_001_000));
        assert_eq!(parse_time("1:2"), None);
        let log = format!("{HEADER}1,00:00:01.000000,allocate,0x10,1,0\n1,00:00:01.000010,free,0x10,1,0\n");
        let (sequence, _) = parse(Path::new("t.csv"), "t", &log, &[0, 5_000]).unwrap();
        assert_eq!(sequence.ops.len(), 3, "the free lands 10 µs after the first event, in step 1");
        let error = parse(Path::new("t.csv"), "t", &format!("{HEADER}1,0,allocate,zz,1,0\n"), &[]).unwrap_err();
        assert_eq!(error.to_string(), "t.csv:2: pointer `zz` is not hex");
        let error = parse(Path::new("t.csv"), "t", "a,b\n", &[]).unwrap_err();
        assert!(error.to_string().contains("expected `Thread,Time"), "{error}");
    }

    #[test]
    fn the_shared_traces_read() {
        let dir = crate::traces_dir();
        for csv in find(&dir) {
            let (sequence, summary) = read(&csv).unwrap();
            sequence.validate().unwrap();
            assert!(sequence.steps() > 1 && sequence.peak_live() > 0, "{}: {summary:?}", csv.display());
        }
    }
}
