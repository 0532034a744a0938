//! The readers never panic: arbitrary bytes, and valid traces of every format mutated (bytes
//! flipped, inserted, deleted, the file cut short), give a trace or an error. A trace that reads
//! also analyses and replays without a panic.
//!
//! Byte mutations mostly fail at the first line. The structured test builds traces by their
//! structure instead (steps of allocations and frees, in each format) and mutates that structure
//! (frees swapped or missing, pointers allocated twice, negative or huge sizes, unknown actions)
//! or the rendered bytes (invalid UTF-8, very long lines, truncation, deep nesting), then counts
//! how many reach replay, and checks that every refusal is a typed error naming where. Set
//! `STEPPOOL_FUZZ_CASES` to run more cases than CI's.

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;
use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_cli::synth::{Shape, training_trace};
use steppool_trace::TraceError;
use steppool_trace::analysis::analyse;
use steppool_trace::jsonl;
use steppool_trace::read::read_bytes;
use steppool_trace::steps::infer;

fn samples() -> &'static [Vec<u8>] {
    static SAMPLES: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    SAMPLES.get_or_init(read_samples)
}

fn read_samples() -> Vec<Vec<u8>> {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let csv = std::fs::read_to_string(data.join("vit_static_train.csv")).unwrap();
    let head: String = csv.lines().take(60).map(|line| format!("{line}\n")).collect();
    let mut shape = Shape::with_events(300);
    shape.boundaries = true;
    let mut jsonl = Vec::new();
    jsonl::write(&training_trace(shape), &mut jsonl).unwrap();
    vec![
        head.into_bytes(),
        jsonl,
        std::fs::read(data.join("snapshot_p2.pickle")).unwrap(),
        std::fs::read(data.join("snapshot_p4.pickle")).unwrap(),
        std::fs::read(data.join("snapshot_notime.pickle")).unwrap(),
    ]
}

/// How far an input got.
#[derive(Debug)]
enum Outcome {
    /// It read, analysed and replayed under every strategy.
    Replayed,
    /// It read and analysed, but is too long to replay here.
    TooLong,
    /// A reader or the analysis refused it.
    Refused(TraceError),
}

/// Reads `bytes`; when they form a trace, analyses it and replays it (small device, no bisection).
fn exercise(bytes: &[u8]) -> Outcome {
    let mut trace = match read_bytes(Path::new("fuzz"), bytes) {
        Ok(trace) => trace,
        Err(error) => return Outcome::Refused(error),
    };
    if !trace.has_steps() {
        infer(&mut trace);
    }
    let analysis = match analyse(&trace) {
        Ok(analysis) => analysis,
        Err(error) => return Outcome::Refused(error),
    };
    if analysis.ops.len() > 5_000 {
        return Outcome::TooLong;
    }
    let mut options = ReplayOptions::new(1 << 30);
    options.timeline_points = 16;
    options.bisect = false;
    // Out-of-memory is a result; any other refusal (by the runtime, or a breakdown whose second
    // run differs) would be a replay bug. Every strategy and model, each with its breakdown.
    match replay(&trace, &analysis, &select("all").unwrap(), &options, &Silent) {
        Ok(_) => {}
        Err(error) => panic!("{error}"),
    }
    if let Err(error) = steppool_cli::limit::limit(&analysis) {
        panic!("{error}");
    }
    Outcome::Replayed
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
    /// Line-level edits keep a text trace readable but odd: frees of unknown pointers, pointers
    /// allocated twice, boundaries out of order.
    DeleteLine(usize),
    DuplicateLine(usize),
    SwapLines(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Flip(at, byte)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert(at, byte)),
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Truncate),
        line_edit(),
    ]
}

fn line_edit() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::DeleteLine),
        any::<usize>().prop_map(Mutation::DuplicateLine),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    match *mutation {
        Mutation::Flip(at, byte) => {
            let at = at % bytes.len();
            bytes[at] ^= byte | 1;
        }
        Mutation::Insert(at, byte) => bytes.insert(at % (bytes.len() + 1), byte),
        Mutation::Delete(at) => {
            bytes.remove(at % bytes.len());
        }
        Mutation::Truncate(at) => bytes.truncate(at % bytes.len()),
        Mutation::DeleteLine(_) | Mutation::DuplicateLine(_) | Mutation::SwapLines(..) => {
            let mut lines: Vec<Vec<u8>> = bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
            // Keep the header: the edits are about records.
            if lines.len() < 3 {
                return;
            }
            let pick = |at: usize| 1 + at % (lines.len() - 1);
            match *mutation {
                Mutation::DeleteLine(at) => {
                    lines.remove(pick(at));
                }
                Mutation::DuplicateLine(at) => {
                    let at = pick(at);
                    lines.insert(at, lines[at].clone());
                }
                Mutation::SwapLines(a, b) => {
                    let (a, b) = (pick(a), pick(b));
                    lines.swap(a, b);
                }
                _ => unreachable!("matched above"),
            }
            *bytes = lines.join(&b'\n');
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = exercise(&bytes);
    }

    #[test]
    fn arbitrary_bytes_behind_each_format_prefix_never_panic(
        prefix in 0usize..4,
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut input = match prefix {
            0 => b"Thread,Time,Action,Pointer,Size,Stream\n".to_vec(),
            1 => br#"{"format":"steppool-trace","version":1}"#.to_vec(),
            2 => vec![0x80, 0x04, 0x95],
            _ => vec![0x80, 0x02],
        };
        input.push(b'\n');
        input.extend(bytes);
        let _ = exercise(&input);
    }

    #[test]
    fn line_edits_of_text_traces_read_and_replay(
        sample in 0usize..2,
        edits in proptest::collection::vec(line_edit(), 1..12),
    ) {
        let mut bytes = samples()[sample].clone();
        for edit in &edits {
            apply(&mut bytes, edit);
        }
        // Records moved, doubled or dropped are odd, not malformed: the trace still reads.
        prop_assert!(read_bytes(Path::new("edited"), &bytes).is_ok());
        let _ = exercise(&bytes);
    }

    #[test]
    fn mutated_valid_traces_never_panic(
        sample in 0usize..5,
        mutations in proptest::collection::vec(mutation(), 1..8),
    ) {
        let mut bytes = samples()[sample].clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        let _ = exercise(&bytes);
    }
}

// ----- traces built by structure -------------------------------------------------------------

/// A size as a record spells it.
#[derive(Clone, Copy, Debug)]
enum Size {
    Bytes(u64),
    Negative,
    Huge,
}

/// One record of a trace, before it is written in a format.
#[derive(Clone, Debug)]
struct Row {
    /// `alloc`, `free`, `step_begin`, `step_end`, or an unknown action.
    action: &'static str,
    ptr: u64,
    size: Size,
    step: u64,
    persistent: bool,
}

/// A training-like program: some persistent allocations, then steps whose allocations are freed
/// in the step, in an order the generator picks.
fn program() -> impl Strategy<Value = Vec<Row>> {
    let step = proptest::collection::vec((1u64..64 << 20, any::<prop::sample::Index>()), 1..12);
    (proptest::collection::vec(1u64..256 << 20, 0..4), proptest::collection::vec(step, 1..6)).prop_map(
        |(persistent, steps)| {
            let mut rows = Vec::new();
            let mut next = 0x7f00_0000_0000u64;
            let mut pointer = || {
                next += 1 << 30;
                next
            };
            for size in persistent {
                rows.push(Row { action: "alloc", ptr: pointer(), size: Size::Bytes(size), step: 0, persistent: true });
            }
            for (n, allocations) in steps.into_iter().enumerate() {
                let n = n as u64;
                rows.push(Row { action: "step_begin", ptr: 0, size: Size::Bytes(0), step: n, persistent: false });
                let mut live: Vec<Row> = Vec::new();
                for (size, free_at) in allocations {
                    let row =
                        Row { action: "alloc", ptr: pointer(), size: Size::Bytes(size), step: n, persistent: false };
                    rows.push(row.clone());
                    live.push(row);
                    // Free one live allocation, picked by the generator, now and then.
                    if free_at.index(3) == 0 {
                        let freed = live.remove(free_at.index(live.len()));
                        rows.push(Row { action: "free", ..freed });
                    }
                }
                rows.extend(live.into_iter().rev().map(|row| Row { action: "free", ..row }));
                rows.push(Row { action: "step_end", ptr: 0, size: Size::Bytes(0), step: n, persistent: false });
            }
            rows
        },
    )
}

/// The formats a structured trace is written in.
#[derive(Clone, Copy, Debug)]
enum Format {
    Rmm,
    Steppool,
    PyTorch,
}

/// A change to a structured trace: to its records, or to the bytes written.
#[derive(Clone, Debug)]
enum Edit {
    SwapFrees(prop::sample::Index, prop::sample::Index),
    DropFree(prop::sample::Index),
    ReusePointer(prop::sample::Index, prop::sample::Index),
    NegativeSize(prop::sample::Index),
    HugeSize(prop::sample::Index),
    UnknownAction(prop::sample::Index),
    NonUtf8(prop::sample::Index),
    LongLine(prop::sample::Index),
    Truncate(prop::sample::Index),
    DeepNesting,
}

fn edit() -> impl Strategy<Value = Edit> {
    let at = || any::<prop::sample::Index>();
    prop_oneof![
        3 => (at(), at()).prop_map(|(a, b)| Edit::SwapFrees(a, b)),
        3 => at().prop_map(Edit::DropFree),
        2 => (at(), at()).prop_map(|(a, b)| Edit::ReusePointer(a, b)),
        1 => at().prop_map(Edit::NegativeSize),
        1 => at().prop_map(Edit::HugeSize),
        1 => at().prop_map(Edit::UnknownAction),
        1 => at().prop_map(Edit::NonUtf8),
        1 => at().prop_map(Edit::LongLine),
        1 => at().prop_map(Edit::Truncate),
        1 => Just(Edit::DeepNesting),
    ]
}

/// Applies the record-level edits; the byte-level ones are left for [`edit_bytes`].
fn edit_rows(rows: &mut Vec<Row>, edit: &Edit) {
    let of = |rows: &[Row], action: &str| -> Vec<usize> {
        rows.iter().enumerate().filter(|(_, r)| r.action == action).map(|(i, _)| i).collect()
    };
    let allocs = of(rows, "alloc");
    let frees = of(rows, "free");
    match edit {
        Edit::SwapFrees(a, b) if !frees.is_empty() => {
            rows.swap(frees[a.index(frees.len())], frees[b.index(frees.len())])
        }
        Edit::DropFree(a) if !frees.is_empty() => {
            rows.remove(frees[a.index(frees.len())]);
        }
        Edit::ReusePointer(a, b) if !allocs.is_empty() => {
            let ptr = rows[allocs[b.index(allocs.len())]].ptr;
            rows[allocs[a.index(allocs.len())]].ptr = ptr;
        }
        Edit::NegativeSize(a) if !allocs.is_empty() => rows[allocs[a.index(allocs.len())]].size = Size::Negative,
        Edit::HugeSize(a) if !allocs.is_empty() => rows[allocs[a.index(allocs.len())]].size = Size::Huge,
        Edit::UnknownAction(a) if !allocs.is_empty() => rows[allocs[a.index(allocs.len())]].action = "reallocate",
        _ => {}
    }
}

/// Writes the records in `format`. Step boundaries go where the format has them (not in RMM
/// logs, whose steps are inferred).
fn render(format: Format, rows: &[Row]) -> Vec<u8> {
    let size_text = |size: Size| match size {
        Size::Bytes(bytes) => bytes.to_string(),
        Size::Negative => "-4096".to_owned(),
        Size::Huge => u64::MAX.to_string(),
    };
    match format {
        Format::Rmm => {
            let mut out = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
            for (t, row) in rows.iter().enumerate() {
                let action = match row.action {
                    "alloc" => "allocate",
                    "step_begin" | "step_end" => continue,
                    other => other,
                };
                out += &format!("1,{},{action},{:#x},{},0x0\n", t * 1000, row.ptr, size_text(row.size));
            }
            out.into_bytes()
        }
        Format::Steppool => {
            let header = r#"{"format":"steppool-trace","version":1,"devices":[{"ordinal":0,"total_bytes":85899345920}],"phases":[{"name":"weights","scope":"persistent"},{"name":"activations","scope":"step"}]}"#;
            let mut out = format!("{header}\n");
            for (t, row) in rows.iter().enumerate() {
                let t_ns = t * 1000;
                out += &match row.action {
                    "step_begin" | "step_end" => {
                        format!(r#"{{"t_ns":{t_ns},"event":"{}","step":{}}}"#, row.action, row.step)
                    }
                    action => {
                        let phase = if row.persistent { "weights" } else { "activations" };
                        let step = if row.persistent { "null".to_owned() } else { row.step.to_string() };
                        format!(
                            r#"{{"t_ns":{t_ns},"event":"{action}","ptr":{},"bytes":{},"device":0,"stream":0,"phase":"{phase}","step":{step},"thread":1}}"#,
                            row.ptr,
                            size_text(row.size)
                        )
                    }
                };
                out.push('\n');
            }
            out.into_bytes()
        }
        Format::PyTorch => {
            use serde_pickle::{HashableValue as Key, Value};
            let text = |s: &str| Value::String(s.to_owned());
            let mut entries = Vec::new();
            for (t, row) in rows.iter().enumerate() {
                let actions: &[&str] = match row.action {
                    "step_begin" | "step_end" => continue,
                    "free" => &["free_requested", "free_completed"],
                    other => &[other],
                };
                let size = match row.size {
                    Size::Bytes(bytes) => Value::I64(bytes as i64),
                    Size::Negative => Value::I64(-4096),
                    Size::Huge => Value::I64(i64::MAX),
                };
                for action in actions {
                    let entry: BTreeMap<Key, Value> = [
                        ("action", text(action)),
                        ("addr", Value::I64(row.ptr as i64)),
                        ("size", size.clone()),
                        ("stream", Value::I64(0)),
                        ("time_us", Value::I64(t as i64)),
                        ("frames", Value::List(Vec::new())),
                    ]
                    .into_iter()
                    .map(|(k, v)| (Key::String(k.to_owned()), v))
                    .collect();
                    entries.push(Value::Dict(entry));
                }
            }
            let snapshot: BTreeMap<Key, Value> = [
                (Key::String("segments".to_owned()), Value::List(Vec::new())),
                (Key::String("device_traces".to_owned()), Value::List(vec![Value::List(entries)])),
            ]
            .into_iter()
            .collect();
            serde_pickle::value_to_vec(&Value::Dict(snapshot), serde_pickle::SerOptions::new()).unwrap()
        }
    }
}

/// Applies the byte-level edits.
fn edit_bytes(format: Format, bytes: &mut Vec<u8>, edit: &Edit) {
    let text = !matches!(format, Format::PyTorch);
    match edit {
        Edit::NonUtf8(at) if text && !bytes.is_empty() => {
            let at = at.index(bytes.len());
            bytes.splice(at..at, [0xff, 0xfe]);
        }
        Edit::LongLine(at) if text => {
            let newlines: Vec<usize> = bytes.iter().enumerate().filter(|&(_, &b)| b == b'\n').map(|(i, _)| i).collect();
            let at = newlines.get(at.index(newlines.len().max(1))).map_or(bytes.len(), |&i| i + 1);
            let line: Vec<u8> = std::iter::repeat_n(b'x', 1 << 20).chain([b'\n']).collect();
            bytes.splice(at..at, line);
        }
        Edit::Truncate(at) if !bytes.is_empty() => bytes.truncate(at.index(bytes.len())),
        Edit::DeepNesting if text => {
            let deep: Vec<u8> = std::iter::repeat_n(b'[', 100_000).chain(*b"\n").collect();
            let end = bytes.len();
            bytes.splice(end..end, deep);
        }
        Edit::DeepNesting => {
            // PROTO 2, then a hundred thousand MARKs: nesting no snapshot has.
            *bytes = [0x80, 0x02].into_iter().chain(std::iter::repeat_n(b'(', 100_000)).chain(*b".").collect();
        }
        _ => {}
    }
}

/// Whether an error says where: a line, a snapshot entry, a byte offset, or that the file as a
/// whole is not a trace.
fn says_where(error: &TraceError) -> bool {
    let text = error.to_string();
    let located = ["line ", "device_traces[", "offset", "byte ", "the file as a whole", "not a trace steppool reads"];
    located.iter().any(|place| text.contains(place))
}

#[test]
fn structured_traces_reach_replay_and_every_refusal_says_where() {
    use std::cell::RefCell;

    use proptest::test_runner::{Config, TestRunner};

    let cases = std::env::var("STEPPOOL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(160);
    let formats = prop_oneof![Just(Format::Rmm), Just(Format::Steppool), Just(Format::PyTorch)];
    // Half the cases unedited: a structured trace that is valid must replay.
    let edits = prop_oneof![Just(Vec::new()), proptest::collection::vec(edit(), 1..4)];
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let tally: RefCell<BTreeMap<String, usize>> = RefCell::new(BTreeMap::new());
    runner
        .run(&(formats, program(), edits), |(format, mut rows, edits)| {
            for edit in &edits {
                edit_rows(&mut rows, edit);
            }
            let mut bytes = render(format, &rows);
            for edit in &edits {
                edit_bytes(format, &mut bytes, edit);
            }
            let outcome = exercise(&bytes);
            let kind = match &outcome {
                Outcome::Replayed => "replayed",
                Outcome::TooLong => "too long",
                Outcome::Refused(error) => {
                    prop_assert!(says_where(error), "{format:?} {edits:?}: an error that does not say where: {error}");
                    prop_assert!(!edits.is_empty(), "{format:?}: a valid structured trace was refused: {error}");
                    "refused"
                }
            };
            *tally.borrow_mut().entry(kind.to_owned()).or_default() += 1;
            Ok(())
        })
        .unwrap();
    let tally = tally.into_inner();
    let replayed = tally.get("replayed").copied().unwrap_or(0);
    let total: usize = tally.values().sum();
    println!("structured fuzzing: {tally:?} of {total}");
    // The point of building by structure: most inputs get past the readers into replay.
    assert!(replayed * 10 >= total * 6, "only {replayed} of {total} reached replay: {tally:?}");
    assert!(tally.get("refused").is_some_and(|&n| n > 0), "no mutant was refused: {tally:?}");
}
