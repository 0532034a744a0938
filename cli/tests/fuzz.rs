//! The readers never panic: arbitrary bytes, and valid traces of every format mutated (bytes
//! flipped, inserted, deleted, the file cut short), give a trace or an error. A trace that reads
//! also analyses and replays without a panic.

use std::path::Path;

use proptest::prelude::*;
use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_cli::synth::{Shape, training_trace};
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

/// Reads `bytes`; when they form a trace, analyses it and replays it (small device, no bisection).
fn exercise(bytes: &[u8]) {
    let Ok(mut trace) = read_bytes(Path::new("fuzz"), bytes) else { return };
    if !trace.has_steps() {
        infer(&mut trace);
    }
    let Ok(analysis) = analyse(&trace) else { return };
    if analysis.ops.len() > 5_000 {
        return;
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
        exercise(&bytes);
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
        exercise(&input);
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
        exercise(&bytes);
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
        exercise(&bytes);
    }
}
