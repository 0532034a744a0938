//! Inputs built to break the readers and the replay: nesting and marks that would exhaust the
//! stack or the memory, a gzip file that inflates a thousandfold, sizes past any device and times that overflow, a `--json` aimed at the step sidecar,
//! and boundary releases a persistent strategy must still free. Each gets a clear error or the
//! right numbers, never a panic.

use std::path::Path;
use std::process::Command;

use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_trace::analysis::analyse;
use steppool_trace::read::read_bytes;

const MIB: u64 = 1 << 20;

#[test]
fn deeply_nested_pickles_and_mark_floods_are_refused_before_parsing() {
    let mut deep = b"\x80\x02".to_vec();
    deep.extend(std::iter::repeat_n(b']', 8000));
    deep.extend(std::iter::repeat_n(b'a', 7999));
    deep.push(b'.');
    let error = read_bytes(Path::new("deep.pickle"), &deep).unwrap_err().to_string();
    assert!(error.contains("nested deeper than 256"), "{error}");

    let mut marks = b"\x80\x02".to_vec();
    marks.extend(std::iter::repeat_n(b'(', 1_000_000));
    marks.push(b'.');
    // The scan's own message: the parser's path (seconds and gigabytes on this input) never ran.
    let error = read_bytes(Path::new("marks.pickle"), &marks).unwrap_err().to_string();
    assert!(error.contains("marks open"), "{error}");
}

#[test]
fn gzip_bombs_and_deep_json_are_refused() {
    use std::io::Write;
    // 256 MiB of zeros deflate to about 256 KiB: past 256 times the file, refused before the
    // memory is taken.
    let mut bomb = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; MIB as usize];
    for _ in 0..256 {
        bomb.write_all(&zeros).unwrap();
    }
    let bomb = bomb.finish().unwrap();
    let error = read_bytes(Path::new("bomb.json.gz"), &bomb).unwrap_err().to_string();
    assert!(error.contains(&format!("a gzip file of {} bytes that inflates past", bomb.len())), "{error}");
    // Gzipped again, the outer layer inflates within its limit and the inner one would get a
    // limit of its own: a gzip inside a gzip is refused.
    let mut twice = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    twice.write_all(&bomb).unwrap();
    let error = read_bytes(Path::new("bomb.json.gz.gz"), &twice.finish().unwrap()).unwrap_err().to_string();
    assert!(error.contains("a gzip file inside a gzip file"), "{error}");

    // Nesting where the reader reads a value is refused at serde_json's depth limit; inside
    // arguments it skips unread, it is skipped without recursion, closed or not.
    let mut deep = b"{\"traceEvents\": [{\"ts\": ".to_vec();
    deep.extend(std::iter::repeat_n(b'[', 100_000));
    let error = read_bytes(Path::new("deep.json"), &deep).unwrap_err().to_string();
    assert!(error.contains("deep.json") && error.contains("recursion limit"), "{error}");
    let mut skipped = b"{\"traceEvents\": [{\"args\": {\"Input Dims\": ".to_vec();
    skipped.extend(std::iter::repeat_n(b'[', 100_000));
    let error = read_bytes(Path::new("deep.json"), &skipped).unwrap_err().to_string();
    assert!(error.contains("deep.json") && error.contains("EOF while parsing"), "{error}");
    skipped.extend(std::iter::repeat_n(b']', 100_000));
    skipped.extend(b"}}]}");
    let trace = read_bytes(Path::new("deep.json"), &skipped).unwrap();
    assert!(trace.events.is_empty(), "an event with no memory in it");
}

#[test]
fn sizes_past_any_device_are_an_error_naming_them() {
    // Just past the cap, and the largest size a field holds: rounding either would overflow.
    for huge in [steppool_trace::analysis::MAX_ALLOCATION_BYTES + 1, u64::MAX] {
        let log =
            format!("Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,8,0x0\n1,1,allocate,0x20,{huge},0x0\n");
        let trace = read_bytes(Path::new("huge.csv"), log.as_bytes()).unwrap();
        let error = analyse(&trace).unwrap_err().to_string();
        assert!(error.contains("line 3") && error.contains(&huge.to_string()) && error.contains("1 PiB"), "{error}");
    }
}

#[test]
fn clock_times_that_count_past_u64_days_are_an_error() {
    let mut log = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for _ in 0..214_000 {
        log += "1,12:00:01,allocate,0x10,8,0x0\n1,00:00:00,free,0x10,8,0x0\n";
    }
    let error = read_bytes(Path::new("days.csv"), log.as_bytes()).unwrap_err().to_string();
    assert!(error.contains("clock time past"), "{error}");
}

#[test]
fn boundary_releases_after_the_step_end_are_freed_under_a_persistent_strategy() {
    let mut trace = String::from(
        r#"{"format":"steppool-trace","version":1,"devices":[{"ordinal":0,"total_bytes":1073741824}],"phases":[{"name":"act","scope":"step"}]}"#,
    );
    trace.push('\n');
    for step in 0..3 {
        let t = 10 * step;
        trace += &format!(
            "{{\"t_ns\":{},\"event\":\"step_begin\",\"step\":{step}}}\n\
             {{\"t_ns\":{},\"event\":\"alloc\",\"ptr\":16,\"bytes\":{},\"phase\":\"act\"}}\n\
             {{\"t_ns\":{},\"event\":\"step_end\",\"step\":{step}}}\n\
             {{\"t_ns\":{},\"event\":\"free\",\"ptr\":16,\"bytes\":{},\"phase\":\"act\",\"release\":true}}\n",
            t + 1,
            t + 2,
            160 * MIB,
            t + 3,
            t + 4,
            160 * MIB
        );
    }
    let trace = read_bytes(Path::new("released.jsonl"), trace.as_bytes()).unwrap();
    let analysis = analyse(&trace).unwrap();
    let results = replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    // 160 MiB: whole 32 MiB pool units, 20 MiB expandable pages and 2 MiB granules alike.
    for result in &results {
        assert_eq!(result.run.peak_reserved_bytes, 160 * MIB, "{}", result.run.strategy);
    }
}

#[test]
fn the_json_report_may_not_overwrite_the_step_sidecar() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("job.csv");
    std::fs::write(&csv, "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,512,0x0\n1,1,free,0x10,512,0x0\n")
        .unwrap();
    let sidecar = dir.path().join("job.json");
    std::fs::write(&sidecar, r#"{"steps_start_ns": [0]}"#).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_steppool"))
        .args(["replay", csv.to_str().unwrap(), "--no-bisect", "--json", sidecar.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("step sidecar"));
    assert_eq!(std::fs::read_to_string(&sidecar).unwrap(), r#"{"steps_start_ns": [0]}"#);
}

#[test]
fn a_run_that_stops_short_prints_no_ratios() {
    let log = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,{},0x0\n1,1,free,0x10,{},0x0\n",
        300 * MIB,
        300 * MIB
    );
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("big.csv");
    std::fs::write(&csv, log).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_steppool"))
        .args(["replay", csv.to_str().unwrap(), "--no-bisect", "--capacity", "256MiB", "--strategy", "phase-pools"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    // Table rows begin with the recommended marker's column.
    let row = text.lines().find(|l| l.starts_with("  phase-pools")).expect("a row");
    assert!(row.contains("OOM") || row.contains("larger than"), "{text}");
    assert!(!row.contains('×') && !row.contains('%'), "{row}");
}
