//! The readers: RMM logs, PyTorch snapshots, PyTorch profiler traces and steppool traces, their
//! odd records (counted warnings) and bad ones (errors with the file and line), and steppool's
//! format round trip.

use std::path::{Path, PathBuf};

use steppool::Scope;
use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_cli::synth::{Shape, training_trace};
use steppool_trace::analysis::{Op, analyse};
use steppool_trace::jsonl;
use steppool_trace::read::{detect, read_bytes, read_trace};
use steppool_trace::{Event, EventKind, Location, Trace, TraceError, TraceFormat, TracePhase, WarningKind};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn rmm(text: &str) -> Result<Trace, TraceError> {
    read_bytes(Path::new("log.csv"), text.as_bytes())
}

const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream\n";

#[test]
fn rmm_logs_with_clock_times_threads_and_streams() {
    let log = format!(
        "{HEADER}140,12:00:00.000001,allocate,0x7f0000000000,1048576,0x0\n\
         141,12:00:00.000002,allocate,0x7f0000100000,2097152,0x5a\n\
         140,12:00:00.000003,allocate failure,0x0,1099511627776,0x0\n\
         141,12:00:00.000004,free,0x7f0000100000,2097152,0x5a\n\
         140,12:00:00.000005,free,0x7f0000000000,1048576,0x0\n"
    );
    let trace = rmm(&log).unwrap();
    assert_eq!(trace.format, TraceFormat::Rmm);
    assert_eq!(trace.threads, vec!["140", "141"]);
    assert_eq!(trace.events.len(), 5);
    assert_eq!(trace.events[1].stream, 0x5a);
    assert_eq!(trace.events[2].kind, EventKind::AllocFailure);
    assert_eq!(trace.events[4].t_ns - trace.events[0].t_ns, 4_000);
    let analysis = analyse(&trace).unwrap();
    assert_eq!(analysis.peak_live_bytes, 3 << 20);
    assert_eq!(analysis.failures, 1);
    assert_eq!(analysis.streams, vec![(0, 0), (0, 0x5a)]);
}

#[test]
fn odd_rmm_records_are_counted_warnings() {
    let log = format!(
        "{HEADER}1,0,allocate,0x10,512,0x0\n\
         1,1,reallocate,0x10,512,0x0\n\
         1,2,free,0x99,512,0x0\n\
         1,3,allocate,0x10,1024,0x0\n\
         1,2,free,0x10,4096,0x0\n\
         1,5,allocate,0x20,0,0x0\n\
         1,6,free,0x20,0,0x0\n\
         1,7,allocate,0x30,8,0x0\n\
         1,8,free,0x99,512,0x0\n"
    );
    let trace = rmm(&log).unwrap();
    assert_eq!(trace.warnings.count(WarningKind::UnknownAction), 1);
    assert_eq!(trace.warnings.count(WarningKind::TimeBackwards), 1);
    // 0x99 is freed at line 4 but never allocated: made before the log began, it is replayed
    // as allocated at the start. Its second free is of a pointer no longer live.
    assert_eq!(trace.warnings.count(WarningKind::HeldBeforeRecording), 1);
    let lines = trace.warnings.lines().join("\n");
    assert!(lines.contains("line 4") && lines.contains("512 bytes at 0x99"), "{lines}");
    assert_eq!((trace.events[0].kind, trace.events[0].ptr, trace.events[0].t_ns), (EventKind::Alloc, 0x99, 0));
    let analysis = analyse(&trace).unwrap();
    let w = &analysis.warnings;
    assert_eq!(w.count(WarningKind::UnknownPointerFree), 1);
    assert_eq!(w.count(WarningKind::PointerReused), 1);
    assert_eq!(w.count(WarningKind::SizeMismatch), 1);
    assert_eq!(w.count(WarningKind::ZeroBytes), 1);
    let lines = w.lines().join("\n");
    assert!(lines.contains("line 10") && lines.contains("0x99"), "{lines}");
    // The reused pointer's first allocation is freed before the second one is made.
    let ops: Vec<Op> = analysis.ops.iter().map(|&(_, op)| op).collect();
    assert_eq!(&ops[..5], &[Op::Alloc(0), Op::Alloc(1), Op::Free(0), Op::Free(1), Op::Alloc(2)]);
    assert_eq!(analysis.peak_live_bytes, 512 + 512, "0x99 and the first 0x10");
    // Still replayable.
    let results = replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    assert!(results.iter().all(|r| r.run.completed()));
}

#[test]
fn bad_rmm_records_name_the_file_and_line() {
    let cases = [
        (format!("{HEADER}1,0,allocate,0x10,512,0x0\n1,1,allocate,0xZZ,5,0x0\n"), "line 3", "Pointer `0xZZ`"),
        (format!("{HEADER}1,0,allocate,0x10,-5,0x0\n"), "line 2", "Size `-5`"),
        (format!("{HEADER}1,0,allocate,0x10,5\n"), "line 2", "expected 6"),
        (format!("{HEADER}1,noon,allocate,0x10,5,0x0\n"), "line 2", "Time `noon`"),
        ("Thread,Time,Action,Size\n".to_owned(), "", ""),
    ];
    for (text, line, what) in cases {
        let error = rmm(&text).unwrap_err();
        let message = error.to_string();
        assert!(message.starts_with("log.csv"), "{message}");
        assert!(message.contains(line) && message.contains(what), "{message}");
    }
}

#[test]
fn formats_are_recognized_by_content() {
    assert_eq!(detect(HEADER.as_bytes()), Some(TraceFormat::Rmm));
    assert_eq!(detect(b"\n\n{\"format\":\"steppool-trace\",\"version\":1}\n"), Some(TraceFormat::Steppool));
    assert_eq!(detect(&std::fs::read(data("snapshot_p4.pickle")).unwrap()), Some(TraceFormat::PyTorch));
    let profiler = std::fs::read(data("profiler/llama_accum_chrome.pt.trace.json.gz")).unwrap();
    assert_eq!(detect(&profiler), None, "gzipped: recognized once decompressed");
    assert_eq!(read_bytes(Path::new("t.json.gz"), &profiler).unwrap().format, TraceFormat::Profiler);
    assert_eq!(detect(b"  {\"schemaVersion\": 1, \"traceEvents\": []}"), Some(TraceFormat::Profiler));
    assert_eq!(detect(b"{\"steps_start_ns\": [0, 100]}"), None, "a step sidecar");
    let error = read_bytes(Path::new("t.json.gz"), &profiler[..profiler.len() / 2]).unwrap_err().to_string();
    assert!(error.contains("t.json.gz") && error.contains("gzip"), "{error}");
    assert_eq!(detect(b"hello,world\n"), None);
    assert_eq!(detect(b""), None);
    let error = read_bytes(Path::new("notes.txt"), b"just text").unwrap_err();
    assert!(matches!(error, TraceError::UnknownFormat { .. }), "{error}");
}

#[test]
fn pytorch_snapshots_of_every_protocol_read_the_same() {
    let mut seen = Vec::new();
    // `snapshot_shared` shares one frames list among its entries, as PyTorch 2.11 writes them.
    for name in [
        "snapshot_p2.pickle",
        "snapshot_p4.pickle",
        "snapshot_p5.pickle",
        "snapshot_notime.pickle",
        "snapshot_shared.pickle",
    ] {
        let trace = read_trace(data(name)).unwrap();
        assert_eq!(trace.format, TraceFormat::PyTorch);
        assert!(trace.warnings.is_empty(), "{name}: {:?}", trace.warnings);
        let analysis = analyse(&trace).unwrap();
        // Weights (8 MiB) + a 4 MiB activation + a 2 MiB side-stream buffer.
        assert_eq!(analysis.peak_live_bytes, 14 << 20, "{name}");
        assert_eq!(analysis.allocations.len(), 7, "{name}");
        assert_eq!(analysis.failures, 1, "{name}");
        assert_eq!(analysis.streams, vec![(0, 0), (0, 0x5555)], "{name}");
        assert_eq!(analysis.steps, 3, "{name}: steps inferred");
        let kinds: Vec<(EventKind, u64, u64)> =
            trace.events.iter().filter(|e| !e.kind.is_boundary()).map(|e| (e.kind, e.ptr, e.bytes)).collect();
        seen.push(kinds);
        let results =
            replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
        assert!(results.iter().all(|r| r.run.completed()), "{name}");
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn a_snapshot_recorded_after_the_model_was_built_replays_the_memory_held_before() {
    // History recorded from after the weights (8 MiB, a block still allocated in `segments`) and
    // an optimizer buffer (4 MiB, freed in the trace) were made, and two small blocks of a
    // segment whose blocks carry no address: all replayed as allocated at the trace's start.
    let trace = read_trace(data("snapshot_late.pickle")).unwrap();
    assert_eq!(trace.warnings.count(WarningKind::HeldBeforeRecording), 4, "{:?}", trace.warnings.lines());
    let lines = trace.warnings.lines().join("\n");
    assert!(lines.contains("segments[0].blocks[0]: 8388608 bytes at 0x7f0000000000"), "{lines}");
    let records: Vec<&Event> = trace.events.iter().filter(|e| !e.kind.is_boundary()).collect();
    let held: Vec<(u64, u64)> = records[..4].iter().map(|e| (e.ptr, e.bytes)).collect();
    assert_eq!(
        held,
        [
            (0x7F00_0000_0000, 8 << 20),
            (0x7F00_1000_0000, 500_000),
            (0x7F00_1018_0000, 512 << 10),
            (0x7F00_0080_0000, 4 << 20)
        ],
        "the blocks in segment order (the third after the first two), then the freed buffer"
    );
    assert!(records[..4].iter().all(|e| e.kind == EventKind::Alloc && e.t_ns == records[4].t_ns));
    let analysis = analyse(&trace).unwrap();
    assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings.lines());
    assert_eq!(analysis.peak_live_bytes, (12 << 20) + 500_000 + (512 << 10));
    assert_eq!(analysis.allocations.iter().filter(|a| a.free.is_none()).count(), 3, "the blocks are never freed");
    let results = replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    assert!(results.iter().all(|r| r.run.completed() && r.run.peak_reserved_bytes >= analysis.peak_live_bytes));
}

#[test]
fn truncated_and_foreign_pickles_are_errors() {
    let bytes = std::fs::read(data("snapshot_p4.pickle")).unwrap();
    for cut in [1, 2, 10, bytes.len() / 2, bytes.len() - 1] {
        let error = read_bytes(Path::new("snap.pickle"), &bytes[..cut]).unwrap_err();
        let message = error.to_string();
        assert!(message.contains("snap.pickle"), "{message}");
    }
    // A pickled list is no snapshot.
    let list = serde_pickle::to_vec(&vec![1u32, 2, 3], Default::default()).unwrap();
    let message = read_bytes(Path::new("list.pickle"), &list).unwrap_err().to_string();
    assert!(message.contains("not a dict"), "{message}");
    // A snapshot without device_traces says how to record them.
    let mut map = std::collections::BTreeMap::new();
    map.insert("segments".to_owned(), Vec::<u32>::new());
    let empty = serde_pickle::to_vec(&map, Default::default()).unwrap();
    let message = read_bytes(Path::new("s.pickle"), &empty).unwrap_err().to_string();
    assert!(message.contains("_record_memory_history"), "{message}");
}

const STEPPOOL_HEADER: &str = r#"{"format":"steppool-trace","version":1,"driver":"simulated device","devices":[{"ordinal":0,"total_bytes":1073741824}],"phases":[{"name":"weights","scope":"persistent"},{"name":"activations","scope":"step"},{"name":"micro_activations","scope":"micro_step"}]}"#;

fn steppool_trace(lines: &[&str]) -> Result<Trace, TraceError> {
    let text = std::iter::once(STEPPOOL_HEADER).chain(lines.iter().copied()).collect::<Vec<_>>().join("\n");
    read_bytes(Path::new("run.jsonl"), text.as_bytes())
}

#[test]
fn steppool_traces_keep_their_phases_steps_and_releases() {
    let trace = steppool_trace(&[
        r#"{"t_ns":0,"event":"alloc","ptr":4096,"bytes":1048576,"device":0,"stream":1,"phase":"weights","step":null,"thread":7}"#,
        r#"{"t_ns":10,"event":"step_begin","step":0}"#,
        r#"{"t_ns":11,"event":"alloc","ptr":8192,"bytes":4194304,"device":0,"stream":1,"phase":"activations","step":0,"thread":7,"extra":"ignored"}"#,
        r#"{"t_ns":12,"event":"micro_begin","step":0,"micro":0}"#,
        r#"{"t_ns":13,"event":"alloc","ptr":65536,"bytes":2097152,"device":0,"stream":1,"phase":"micro_activations","step":0,"thread":7}"#,
        r#"{"t_ns":14,"event":"free","ptr":65536,"bytes":2097152,"device":0,"stream":1,"phase":"micro_activations","step":0,"thread":7}"#,
        r#"{"t_ns":15,"event":"micro_end","step":0,"micro":0}"#,
        r#"{"t_ns":16,"event":"step_end","step":0}"#,
        r#"{"t_ns":16,"event":"free","ptr":8192,"bytes":4194304,"device":0,"stream":1,"phase":"activations","step":0,"thread":7,"release":true}"#,
        r#"{"t_ns":17,"event":"oom","bytes":99,"device":0,"stream":1,"phase":"activations"}"#,
        r#"{"t_ns":18,"event":"checkpoint"}"#,
    ])
    .unwrap();
    assert_eq!(trace.format, TraceFormat::Steppool);
    assert_eq!(trace.devices[0].total_bytes, Some(1 << 30));
    assert_eq!(trace.warnings.count(WarningKind::UnknownAction), 1);
    let analysis = analyse(&trace).unwrap();
    assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings);
    let scopes: Vec<(Scope, &str, bool)> = analysis
        .allocations
        .iter()
        .map(|a| (a.scope, analysis.phases[usize::from(a.phase)].name.as_str(), a.released_at_boundary))
        .collect();
    assert_eq!(
        scopes,
        vec![
            (Scope::Persistent, "weights", false),
            (Scope::Step, "activations", true),
            (Scope::MicroStep, "micro_activations", false)
        ]
    );
    assert_eq!((analysis.steps, analysis.micro_steps, analysis.failures), (1, 1, 1));
    let results = replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    for result in &results {
        assert!(result.run.completed(), "{}: {:?}", result.run.strategy, result.run.failure);
    }
}

#[test]
fn steppool_scopes_that_do_not_fit_are_inferred_and_counted() {
    let trace = steppool_trace(&[
        r#"{"t_ns":1,"event":"alloc","ptr":1,"bytes":512,"phase":"activations"}"#,
        r#"{"t_ns":2,"event":"step_begin","step":0}"#,
        r#"{"t_ns":3,"event":"alloc","ptr":2,"bytes":512,"phase":"activations"}"#,
        r#"{"t_ns":4,"event":"step_end","step":0}"#,
        r#"{"t_ns":5,"event":"free","ptr":2,"bytes":512,"phase":"activations"}"#,
        r#"{"t_ns":6,"event":"alloc","ptr":3,"bytes":512,"phase":"gradients"}"#,
        r#"{"t_ns":7,"event":"step_end","step":0}"#,
    ])
    .unwrap();
    assert_eq!(trace.warnings.count(WarningKind::UnknownPhase), 1);
    let analysis = analyse(&trace).unwrap();
    assert_eq!(analysis.warnings.count(WarningKind::ScopeMismatch), 2);
    assert_eq!(analysis.warnings.count(WarningKind::BoundaryOrder), 1);
    assert!(analysis.allocations.iter().all(|a| a.scope == Scope::Persistent));
    let results =
        replay(&trace, &analysis, &select("phase-pools").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    assert!(results[0].run.completed());
}

#[test]
fn bad_steppool_records_name_the_line() {
    let cases: [(&[&str], &str); 4] = [
        (&[r#"{"t_ns":1,"event":"alloc","bytes":5}"#], "line 2: `alloc` event without `ptr`"),
        (&[r#"{"t_ns":1,"event":"alloc","ptr":1,"bytes":5}"#, "{not json"], "line 3: not an event object"),
        (&[r#"{"t_ns":-1,"event":"alloc","ptr":1,"bytes":5}"#], "line 2"),
        (&[r#"{"t_ns":1,"event":"alloc","ptr":1,"bytes":5,"device":900}"#], "device 900"),
    ];
    for (lines, expected) in cases {
        let message = steppool_trace(lines).unwrap_err().to_string();
        assert!(message.starts_with("run.jsonl") && message.contains(expected), "{message}");
    }
    let message =
        read_bytes(Path::new("v2.jsonl"), br#"{"format":"steppool-trace","version":2}"#).unwrap_err().to_string();
    assert!(message.contains("version 2"), "{message}");
}

#[test]
fn steppool_traces_round_trip() {
    let mut shape = Shape::with_events(5_000);
    shape.boundaries = true;
    let mut original = training_trace(shape);
    original.phases.push(TracePhase { name: "weights".into(), scope: Scope::Persistent });
    for event in original.events.iter_mut().take(10) {
        event.phase = Some(0);
        event.stream = 3;
    }
    let mut text = Vec::new();
    jsonl::write(&original, &mut text).unwrap();
    let back = read_bytes(Path::new("round.jsonl"), &text).unwrap();
    assert_eq!(back.phases, original.phases);
    assert_eq!(back.events.len(), original.events.len());
    for (a, b) in original.events.iter().zip(&back.events) {
        assert_eq!(
            (a.t_ns, a.kind, a.ptr, a.bytes, a.device, a.stream, a.phase),
            (b.t_ns, b.kind, b.ptr, b.bytes, b.device, b.stream, b.phase)
        );
        assert!(matches!(b.location, Location::Line(_)));
    }
    // And an RMM log converts to a steppool trace with its sidecar steps.
    let rmm = read_trace(data("vit_static_train.csv")).unwrap();
    let mut text = Vec::new();
    jsonl::write(&rmm, &mut text).unwrap();
    let converted = read_bytes(Path::new("vit.jsonl"), &text).unwrap();
    assert_eq!(converted.step_count(), 5);
    let (a, b) = (analyse(&rmm).unwrap(), analyse(&converted).unwrap());
    assert_eq!((a.peak_live_bytes, a.steps, a.allocations.len()), (b.peak_live_bytes, b.steps, b.allocations.len()));
}

/// The manifest entries of recorded traces that keep the profiler's own trace beside the
/// recorder's conversion: (conversion, profiler trace).
fn with_profiler_traces() -> Vec<(PathBuf, PathBuf)> {
    let text = std::fs::read_to_string(data("profiler/manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entries = manifest["traces"].as_object().unwrap().values();
    entries
        .filter_map(|entry| {
            let chrome = entry.get("chrome")?.as_str().unwrap();
            Some((data("profiler").join(entry["file"].as_str().unwrap()), data("profiler").join(chrome)))
        })
        .collect()
}

#[test]
fn a_profiler_trace_replays_as_the_recorders_conversion_of_the_same_run() {
    let pairs = with_profiler_traces();
    assert!(!pairs.is_empty(), "the manifest keeps a profiler trace");
    for (converted, profiler) in pairs {
        let (ours, theirs) = (read_trace(&profiler).unwrap(), read_trace(&converted).unwrap());
        assert_eq!(ours.format, TraceFormat::Profiler);
        assert!(ours.warnings.is_empty(), "{:?}", ours.warnings.lines());
        let count =
            |trace: &Trace, boundary: fn(&EventKind) -> bool| trace.events.iter().filter(|e| boundary(&e.kind)).count();
        for boundary in [
            (|k: &EventKind| matches!(k, EventKind::StepBegin(_))) as fn(&EventKind) -> bool,
            |k| matches!(k, EventKind::MicroBegin(..)),
            |k| matches!(k, EventKind::Alloc),
        ] {
            assert_eq!(count(&ours, boundary), count(&theirs, boundary), "{}", profiler.display());
        }
        let (a, b) = (analyse(&ours).unwrap(), analyse(&theirs).unwrap());
        assert_eq!(a.peak_live_bytes, b.peak_live_bytes);
        assert!(a.allocations.iter().zip(&b.allocations).all(|(x, y)| (x.bytes, x.scope) == (y.bytes, y.scope)));
        let options = ReplayOptions::new(80 << 30);
        let all = select("all").unwrap();
        let (ours, theirs) = (
            replay(&ours, &a, &all, &options, &Silent).unwrap(),
            replay(&theirs, &b, &all, &options, &Silent).unwrap(),
        );
        for (x, y) in ours.iter().zip(&theirs) {
            assert_eq!(
                (x.run.strategy, x.run.peak_reserved_bytes, x.run.steady_peak_reserved_bytes),
                (y.run.strategy, y.run.peak_reserved_bytes, y.run.steady_peak_reserved_bytes)
            );
        }
    }
}

#[test]
fn a_scheduled_profiler_trace_has_its_profiler_steps_and_the_profilers_own_peak() {
    use std::io::Read;
    let path = data("profiler/profiler_schedule.pt.trace.json.gz");
    let trace = read_trace(&path).unwrap();
    assert_eq!((trace.format, trace.step_count()), (TraceFormat::Profiler, 3), "the schedule's three active steps");
    assert_eq!(trace.steps, steppool_trace::StepSource::Trace);
    // On a single profiling session of a CPU run, the profiler's own running total is the live
    // memory it saw: its largest value is the peak the analysis must find.
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&path).unwrap()).read_to_string(&mut text).unwrap();
    let chrome: serde_json::Value = serde_json::from_str(&text).unwrap();
    let totals = chrome["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "[memory]");
    let peak = totals.map(|e| e["args"]["Total Allocated"].as_u64().unwrap()).max().unwrap();
    assert_eq!(analyse(&trace).unwrap().peak_live_bytes, peak);
}

#[test]
fn a_cuda_profiler_trace_from_a_gpu_has_pytorchs_own_peak() {
    // Recorded on an H200 by `record.py --device cuda --chrome`, after another workload in the same
    // process: cuBLAS's workspaces were allocated before the recording began. The manifest keeps
    // what PyTorch's allocator itself counted over the run (`torch.cuda.max_memory_allocated()`).
    let text = std::fs::read_to_string(data("profiler/h200/manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entry = &manifest["traces"]["train_eval"];
    let profiler = read_trace(data("profiler/h200").join(entry["chrome"].as_str().unwrap())).unwrap();
    let converted = read_trace(data("profiler/h200").join(entry["file"].as_str().unwrap())).unwrap();
    assert_eq!(profiler.format, TraceFormat::Profiler);
    assert_eq!(profiler.step_count() as u64, entry["steps"].as_u64().unwrap());
    assert_eq!(profiler.warnings.count(WarningKind::HeldBeforeRecording), 1, "{:?}", profiler.warnings.lines());
    // The host's own tensors (a loss read back with `.item()`) are left out, counted.
    assert!(profiler.warnings.count(WarningKind::OtherDevice) > 0);
    let peak = analyse(&profiler).unwrap().peak_live_bytes;
    assert_eq!(peak, entry["torch_cuda"]["peak_allocated_bytes"].as_u64().unwrap(), "PyTorch's own peak, to the byte");
    // The recorder's conversion leaves out the memory from before the recording.
    let without = analyse(&converted).unwrap().peak_live_bytes;
    assert_eq!(without, entry["peak_live_bytes"].as_u64().unwrap());
    assert!(peak > without, "{peak} > {without}");
}
