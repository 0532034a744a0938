//! `steppool-bench-report`: the end of a benchmark run, shared by `cargo xtask bench` and the GPU
//! bundle's `run.sh` so that both write the same files.
//!
//! ```text
//! steppool-bench-report export-sequences DIR
//!     writes every sequence the fragmentation benchmark replays (traces from STEPPOOL_TRACES or
//!     cli/tests/data, and the synthetic transformer) as DIR/<name>.json for the peer harness,
//!     and DIR/latency.json with the sizes of the latency benchmark
//! steppool-bench-report collect --out DIR --mode smoke|full [--criterion DIR] [--records FILE]...
//!     gathers criterion's estimates and the records files into DIR/<date>-<device>.json, .md
//!     and SVG plots
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use steppool_benches::record::{Line, criterion_records, read_lines};
use steppool_benches::report::{Results, today};
use steppool_benches::sequence::{Sequence, traces, varlen_transformer};
use steppool_benches::{BenchError, SIZES, SMOKE_SIZES, traces_dir};

const USAGE: &str = "usage:
  steppool-bench-report export-sequences DIR [--smoke]
  steppool-bench-report collect --out DIR --mode smoke|full [--criterion DIR] [--records FILE]...";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("export-sequences") => export(&args[1..]),
        Some("collect") => collect(&args[1..]),
        Some("--help" | "-h" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("steppool-bench-report: {error}");
            ExitCode::FAILURE
        }
    }
}

fn usage_error(message: &str) -> BenchError {
    BenchError::Sequence { sequence: "arguments".to_owned(), index: 0, reason: format!("{message}\n{USAGE}") }
}

fn export(args: &[String]) -> Result<(), BenchError> {
    let smoke = args.iter().any(|a| a == "--smoke");
    let dir = args.iter().find(|a| !a.starts_with("--")).map(PathBuf::from).ok_or_else(|| usage_error("no DIR"))?;
    std::fs::create_dir_all(&dir).map_err(|source| BenchError::Io { path: dir.display().to_string(), source })?;
    let mut sequences = Vec::new();
    for csv in traces(&traces_dir()) {
        sequences.push(Sequence::read(&csv)?);
    }
    sequences.push(varlen_transformer(smoke));
    for sequence in &sequences {
        sequence.validate()?;
        sequence.export(&dir)?;
        println!("{}: {} operations, peak live {} bytes", sequence.name, sequence.ops.len(), sequence.peak_live());
    }
    let sizes: Vec<u64> = if smoke { SMOKE_SIZES.to_vec() } else { SIZES.to_vec() };
    let latency =
        serde_json::json!({ "sizes": sizes, "sequences": sequences.iter().map(|s| &s.name).collect::<Vec<_>>() });
    let path = dir.join("latency.json");
    std::fs::write(&path, latency.to_string())
        .map_err(|source| BenchError::Io { path: path.display().to_string(), source })
}

fn collect(args: &[String]) -> Result<(), BenchError> {
    let (mut out, mut mode, mut criterion, mut records) = (None, None, None, Vec::new());
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().cloned().ok_or_else(|| usage_error(&format!("{arg} needs a value")));
        match arg.as_str() {
            "--out" => out = Some(PathBuf::from(value()?)),
            "--mode" => mode = Some(value()?),
            "--criterion" => criterion = Some(PathBuf::from(value()?)),
            "--records" => records.push(PathBuf::from(value()?)),
            other => return Err(usage_error(&format!("unknown argument `{other}`"))),
        }
    }
    let out = out.ok_or_else(|| usage_error("--out is required"))?;
    let mode = mode.ok_or_else(|| usage_error("--mode is required"))?;
    if mode != "smoke" && mode != "full" {
        return Err(usage_error(&format!("--mode {mode}: use smoke or full")));
    }
    let mut lines: Vec<Line> = Vec::new();
    for path in &records {
        if path.is_file() {
            lines.extend(read_lines(path)?);
        } else {
            eprintln!("steppool-bench-report: no records at {}, skipped", path.display());
        }
    }
    let criterion = match criterion {
        Some(dir) if dir.is_dir() => criterion_records(&dir)?,
        _ => Vec::new(),
    };
    let results = Results::collect(lines, criterion, &mode, today())?;
    for path in results.write(&out)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}
