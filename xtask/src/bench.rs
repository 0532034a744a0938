//! `cargo xtask bench [--smoke]`: runs the benchmark suite and the peer harness, and writes
//! `benches/results/<date>-<device>.{json,md}` with SVG plots.
//!
//! The steps, each also what the GPU bundle's `run.sh` does with prebuilt binaries:
//! 1. `cargo bench -p steppool-benches`, with `STEPPOOL_BENCH_RECORDS` and `CRITERION_HOME`
//!    pointing into `target/steppool-bench/` (and `STEPPOOL_BENCH_SMOKE=1` for `--smoke`);
//! 2. `steppool-bench-report export-sequences`, then `benches/peers/peers.py` on them (a missing
//!    `python3` is recorded as a skipped peer, not a failure);
//! 3. `steppool-bench-report collect` into `benches/results/`.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::{project_root, target_dir};

/// Runs the suite.
pub(crate) fn run(smoke: bool) -> Result<()> {
    let root = project_root();
    let work = target_dir().join("steppool-bench");
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clearing {}", work.display()))?;
    }
    std::fs::create_dir_all(&work)?;
    let records = work.join("records.jsonl");
    let criterion = work.join("criterion");
    let sequences = work.join("sequences");
    let peers = work.join("peers.jsonl");
    let mode = if smoke { "smoke" } else { "full" };
    let started = Instant::now();

    let mut bench = Command::new(cargo());
    bench
        .current_dir(&root)
        .args(["bench", "-p", "steppool-benches", "--benches"])
        .env("STEPPOOL_BENCH_RECORDS", &records)
        .env("CRITERION_HOME", &criterion);
    if smoke {
        bench.env("STEPPOOL_BENCH_SMOKE", "1");
    }
    status(&mut bench, "the benchmarks")?;

    let report = |args: &[&str]| -> Result<()> {
        let mut command = Command::new(cargo());
        command
            .current_dir(&root)
            .args(["run", "--quiet", "--release", "-p", "steppool-benches", "--bin", "steppool-bench-report", "--"])
            .args(args);
        status(&mut command, "steppool-bench-report")
    };
    let sequences_arg = sequences.to_string_lossy().into_owned();
    let mut export = vec!["export-sequences", sequences_arg.as_str()];
    if smoke {
        export.push("--smoke");
    }
    report(&export)?;

    run_peers(&root.join("benches/peers/peers.py"), &sequences, &peers, smoke)?;

    let out = root.join("benches/results");
    let (out, criterion, records, peers) = (lossy(&out), lossy(&criterion), lossy(&records), lossy(&peers));
    report(&[
        "collect",
        "--out",
        &out,
        "--mode",
        mode,
        "--criterion",
        &criterion,
        "--records",
        &records,
        "--records",
        &peers,
    ])?;
    eprintln!("xtask bench: done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Runs the peer harness; where Python is missing, writes the skip it would have written.
fn run_peers(script: &Path, sequences: &Path, out: &Path, smoke: bool) -> Result<()> {
    let mut command = Command::new("python3");
    command.arg(script).arg("--sequences").arg(sequences).arg("--out").arg(out);
    if smoke {
        command.arg("--smoke");
    }
    match command.status() {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => bail!("the peer harness failed ({status})"),
        Err(error) => {
            eprintln!("xtask bench: python3 did not start ({error}); the peers are recorded as skipped");
            let line = format!(
                "{{\"line\":\"skipped\",\"allocator\":\"all peers\",\"reason\":\"python3 did not start: {}\",\"source\":\"python\"}}\n",
                error.to_string().replace(['"', '\\'], "'")
            );
            std::fs::write(out, line).with_context(|| format!("writing {}", out.display()))
        }
    }
}

/// The cargo that runs xtask.
pub(crate) fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Runs `command`, failing with `what` unless it succeeds.
pub(crate) fn status(command: &mut Command, what: &str) -> Result<()> {
    let status = command.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

fn lossy(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}
