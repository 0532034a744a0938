//! `cargo xtask gpu-bundle DIR`: everything a GPU host without a Rust toolchain or a network
//! needs to run steppool's GPU checks, in one folder of at most 64 MiB:
//!
//! ```text
//! DIR/run.sh            runs it all: ./run.sh [--smoke] [--out DIR]
//! DIR/bin/              device-probe, pool-probe, steppool-bench-report, steppool (the CLI: `calibrate`)
//! DIR/tests/            the device tests: conformance, runtime, cudarc, capture (the same bodies CI runs on
//!                       the simulated device), and the libcuda stand-in the cudarc tests load without a GPU
//! DIR/benches/          the criterion benchmarks
//! DIR/examples/         training_loop, cudarc_trainer, torch_gpt.py
//! DIR/peers/            the Python peer harness
//! DIR/lib/              libsteppool_torch.so, steppool as PyTorch's allocator
//! DIR/python/           the `steppool` Python package (without its library: `STEPPOOL_TORCH_LIBRARY`
//!                       names the one in lib/) and its pytest suite, whose CUDA tests run there
//! DIR/traces/           the recorded traces the fragmentation benchmark replays and `steppool
//!                       calibrate` replays on the GPU beside the simulated device; recorded/ the
//!                       nine recorded workloads too, where they fit the 64 MiB; record.py, which
//!                       records the workloads on the GPU under PyTorch's allocator in both modes
//! ```
//!
//! Binaries are x86-64 Linux release builds (`--target x86_64-unknown-linux-gnu` on other hosts),
//! stripped.
//! `run.sh` writes `results/<date>-<device>.{json,md,svg}`, the files `cargo xtask bench` writes
//! into `benches/results/`: copy them there and commit them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::bench::cargo;
use crate::project_root;

/// The largest bundle that can be carried to a GPU host in one go.
const MAX_BYTES: u64 = 64 << 20;
const TARGET: &str = "x86_64-unknown-linux-gnu";

/// Builds the bundle into `dir`.
pub(crate) fn run(dir: &Path) -> Result<()> {
    let started = Instant::now();
    let root = project_root();
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    for sub in ["bin", "tests", "benches", "examples", "peers", "traces", "lib", "python"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }

    let benches = executables(&root, &["bench", "--no-run", "-p", "steppool-benches", "--benches"], "bench")?;
    copy_all(&benches, &dir.join("benches"))?;
    let tests = executables(
        &root,
        &[
            "test",
            "--release",
            "--no-run",
            "-p",
            "steppool-tests",
            "--test",
            "conformance",
            "--test",
            "runtime",
            "--test",
            "cudarc",
            "--test",
            "capture",
        ],
        "test",
    )?;
    copy_all(&tests, &dir.join("tests"))?;
    // The libcuda stand-in, beside the cudarc tests that load it when no GPU answers: the bundle
    // then also runs whole on the simulated device (`STEPPOOL_DEVICE=sim STEPPOOL_REQUIRE_GPU=0`),
    // a check of the bundle before device time is spent on it.
    let stand_in = executables(&root, &["build", "--release", "-p", "steppool-libcuda-sim"], "cdylib")?;
    copy_all(&stand_in, &dir.join("tests"))?;
    // And beside the examples: `cudarc_trainer` looks for it next to itself.
    copy_all(&stand_in, &dir.join("examples"))?;
    let examples = executables(&root, &["build", "--release", "-p", "steppool-examples", "--examples"], "example")?;
    copy_all(&examples, &dir.join("examples"))?;
    let torch = executables(&root, &["build", "--release", "-p", "steppool-torch", "--lib"], "cdylib")?;
    copy_all(&torch, &dir.join("lib"))?;
    copy_tree(&root.join("runtime/torch/python/steppool"), &dir.join("python/steppool"))?;
    copy_tree(&root.join("runtime/torch/python/tests"), &dir.join("python/tests"))?;
    copy(&root.join("examples/torch_gpt.py"), &dir.join("examples/torch_gpt.py"))?;
    copy(&root.join("benches/traces/record.py"), &dir.join("traces/record.py"))?;
    let mut bins = executables(&root, &["build", "--release", "-p", "steppool-benches", "--bins"], "bin")?;
    bins.extend(executables(
        &root,
        &["build", "--release", "-p", "steppool-tests", "--bin", "device-probe", "--bin", "pool-probe"],
        "bin",
    )?);
    bins.extend(executables(&root, &["build", "--release", "-p", "steppool-cli", "--bin", "steppool"], "bin")?);
    copy_all(&bins, &dir.join("bin"))?;

    for name in ["peers.py", "requirements.txt"] {
        copy(&root.join("benches/peers").join(name), &dir.join("peers").join(name))?;
    }
    let traces = root.join("cli/tests/data");
    if let Ok(entries) = std::fs::read_dir(&traces) {
        // The training traces and their step sidecars; the test-only fixtures stay behind.
        for entry in entries.flatten() {
            let name = entry.file_name();
            let is_trace = name.to_str().is_some_and(|n| n.ends_with("_train.csv") || n.ends_with("_train.json"));
            if is_trace {
                copy(&entry.path(), &dir.join("traces").join(name))?;
            }
        }
    } else {
        eprintln!(
            "xtask gpu-bundle: no traces at {}; the fragmentation benchmark will replay the transformer only",
            traces.display()
        );
    }
    // The nine recorded workloads (`cli/tests/data/recorded`), for the calibration, where they fit.
    let recorded = traces.join("recorded");
    let recorded_size = folder_size(&recorded).unwrap_or(0);
    if recorded_size > 0 && folder_size(dir)? + recorded_size + RUN_SH.len() as u64 <= MAX_BYTES {
        std::fs::create_dir_all(dir.join("traces/recorded"))?;
        for entry in std::fs::read_dir(&recorded)?.flatten() {
            copy(&entry.path(), &dir.join("traces/recorded").join(entry.file_name()))?;
        }
    } else if recorded_size > 0 {
        eprintln!(
            "xtask gpu-bundle: the recorded workloads do not fit; the calibration replays the shared traces only"
        );
    }
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH)?;
    set_executable(&script)?;

    let size = folder_size(dir)?;
    eprintln!(
        "xtask gpu-bundle: {} ({:.1} MiB, built in {:.0} s)",
        dir.display(),
        size as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    if size > MAX_BYTES {
        bail!("the bundle is {size} bytes, over the {MAX_BYTES} bytes that can be carried to a GPU host");
    }
    Ok(())
}

/// Builds with `cargo <args> --target x86_64-unknown-linux-gnu --message-format=json` and
/// returns the executables of targets of kind `kind` (for `cdylib`, the shared libraries).
fn executables(root: &Path, args: &[&str], kind: &str) -> Result<Vec<PathBuf>> {
    let mut command = Command::new(cargo());
    command.current_dir(root).args(args).arg("--message-format=json-render-diagnostics");
    // On an x86-64 Linux host the native build is the target one, and shares `target/release`
    // with `cargo xtask bench`.
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        command.args(["--target", TARGET]);
    }
    command.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let output = command.output().with_context(|| format!("starting cargo {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("cargo {} failed ({})", args.join(" "), output.status);
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let kinds = message["target"]["kind"].as_array().cloned().unwrap_or_default();
        let test_kind = kind == "test" && message["profile"]["test"] == true;
        if !(kinds.iter().any(|k| k == kind) || test_kind) {
            continue;
        }
        if let Some(path) = message["executable"].as_str() {
            found.push(PathBuf::from(path));
        } else if kind == "cdylib" {
            // A shared library has no executable: its files are the library and its metadata.
            let files = message["filenames"].as_array().cloned().unwrap_or_default();
            found.extend(files.iter().filter_map(|f| f.as_str()).filter(|f| f.ends_with(".so")).map(PathBuf::from));
        }
    }
    if found.is_empty() {
        bail!("cargo {} produced no {kind} executable", args.join(" "));
    }
    Ok(found)
}

/// Copies each executable into `dir` under its target name (cargo's hash suffix dropped) and
/// strips it.
fn copy_all(executables: &[PathBuf], dir: &Path) -> Result<()> {
    for path in executables {
        let stem = path.file_name().and_then(|n| n.to_str()).unwrap_or("binary");
        // Test and bench executables are named `<target>-<16 hex digits>`.
        let name = match stem.rsplit_once('-') {
            Some((name, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => name,
            _ => stem,
        };
        let to = dir.join(name);
        copy(path, &to)?;
        match Command::new("strip").arg(&to).status() {
            Ok(status) if status.success() => {}
            _ => eprintln!("xtask gpu-bundle: could not strip {}; kept it whole", to.display()),
        }
    }
    Ok(())
}

/// Copies the plain files of `from` into `to` (made if missing), leaving out caches.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        if entry.file_type()?.is_file() && !name.to_str().is_some_and(|n| n.ends_with(".pyc")) {
            copy(&entry.path(), &to.join(name))?;
        }
    }
    Ok(())
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut permissions = std::fs::metadata(path)?.permissions();
    permissions.set_mode(0o755);
    std::fs::set_permissions(path, permissions)?;
    Ok(())
}

fn folder_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { folder_size(&entry.path())? } else { meta.len() };
    }
    Ok(total)
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# steppool on a GPU host, most needed first: device probe, conformance tests, the calibration of
# the simulated device (`steppool calibrate`), the examples, steppool as PyTorch's allocator (its
# pytest suite, examples/torch_gpt.py) and record.py's workloads recorded on the GPU under
# PyTorch's own allocator in both its modes (then calibrated too), the benchmarks and the peer
# harness, then the results as `cargo xtask bench` writes them.
#   ./run.sh [--smoke] [--out DIR]     (results go to DIR, default ./results)
# Needs no Rust toolchain and no network. Python peers (PyTorch, CuPy, RMM) are measured where
# python3 has them and recorded as skipped otherwise. Every step runs even if one before failed;
# the exit status says whether all succeeded.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode=full
out="$here/results"
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) mode=smoke ;;
        --out) out="$2"; shift ;;
        *) echo "usage: $0 [--smoke] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
work="$here/work"
rm -rf "$work"
mkdir -p "$work" "$out"
export STEPPOOL_DEVICE="${STEPPOOL_DEVICE:-cuda}"
export STEPPOOL_REQUIRE_GPU="${STEPPOOL_REQUIRE_GPU:-1}"
export STEPPOOL_TRACES="$here/traces"
export STEPPOOL_BENCH_RECORDS="$work/records.jsonl"
# What the device tests observe of the driver (return codes under capture, addresses across
# relaunches), one JSON line each: commit it with the results.
export STEPPOOL_FACTS="${STEPPOOL_FACTS:-$out/facts.jsonl}"
export CRITERION_HOME="$work/criterion"
smoke=()
if [ "$mode" = smoke ]; then
    export STEPPOOL_BENCH_SMOKE=1
    smoke=(--smoke)
fi
status=0
step() { printf '\n== %s\n' "$*"; }

step "device"
"$here/bin/device-probe" 2>&1 | tee "$work/device.log" || status=1
nvidia-smi 2>/dev/null | tee -a "$work/device.log" || true

step "the driver's pool: units, growth, less free memory than a unit, placement (pool-probe)"
"$here/bin/pool-probe" "$out/pool-probe.jsonl" "$here"/traces/*_train.csv > "$work/pool-probe.log" 2>&1 || status=1
tail -n 3 "$work/pool-probe.log"

step "device tests"
for test in "$here"/tests/*; do
    case "$test" in *.so) continue ;; esac
    "$test" 2>&1 | tee -a "$work/tests.log" || status=1
done

step "calibration: the traces replayed on the GPU and on the simulated device"
calibration=("$here"/traces/*_train.csv)
for trace in "$here"/traces/recorded/*.csv "$here"/traces/recorded/*.jsonl; do
    [ -e "$trace" ] && calibration+=("$trace")
done
"$here/bin/steppool" calibrate "${calibration[@]}" --markdown "$out/calibration.md" --json "$out/calibration.json" \
    2>&1 | tee "$work/calibration.log" || status=1

step "examples"
"$here/examples/training_loop" --steps 8 2>&1 | tee "$work/example.log" || status=1
"$here/examples/cudarc_trainer" 2>&1 | tee -a "$work/example.log" || status=1

step "PyTorch: steppool as its allocator; the workloads recorded under its own allocator"
cuda_recorded="$out/cuda-recorded"
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export STEPPOOL_TORCH_LIBRARY="$here/lib/libsteppool_torch.so"
    python_path="$here/python${PYTHONPATH:+:$PYTHONPATH}"
    PYTHONPATH="$python_path" python3 -m pytest -q -rs -p no:cacheprovider "$here/python/tests" 2>&1 \
        | tee "$work/pytorch.log" || status=1
    gpt_steps=60
    [ "$mode" = smoke ] && gpt_steps=20
    PYTHONPATH="$python_path" python3 "$here/examples/torch_gpt.py" --steps "$gpt_steps" 2>&1 \
        | tee -a "$work/pytorch.log" || status=1
    # The same requests under both modes of PyTorch's allocator: the traces (and the profiler's own
    # files) from the default mode, the expandable mode's peaks in manifest-expandable.json.
    python3 "$here/traces/record.py" --device cuda --chrome --out "$cuda_recorded" 2>&1 \
        | grep -v '^USDT' | tee "$work/record.log" || status=1
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$here/traces/record.py" --device cuda \
        --out "$work/cuda-expandable" 2>&1 | grep -v '^USDT' | tee -a "$work/record.log" || status=1
    cp "$work/cuda-expandable/manifest.json" "$cuda_recorded/manifest-expandable.json" || status=1
    # A CUDA profiler trace read directly must replay as its conversion does.
    for chrome in "$cuda_recorded"/*.pt.trace.json.gz; do
        [ -e "$chrome" ] || continue
        base="${chrome%.pt.trace.json.gz}"
        converted="$base.csv"
        [ -e "$converted" ] || converted="$base.jsonl"
        "$here/bin/steppool" replay "$chrome" --json "$base.profiler-replay.json" >/dev/null 2>>"$work/record.log" \
            && "$here/bin/steppool" replay "$converted" --json "$base.replay.json" >/dev/null 2>>"$work/record.log" \
            || status=1
    done
    # The traces recorded here, replayed on this GPU and on the simulated device.
    cuda_traces=()
    for trace in "$cuda_recorded"/*.csv "$cuda_recorded"/*.jsonl; do
        [ -e "$trace" ] && cuda_traces+=("$trace")
    done
    "$here/bin/steppool" calibrate "${cuda_traces[@]}" --markdown "$out/calibration-cuda-recorded.md" \
        --json "$out/calibration-cuda-recorded.json" 2>&1 | tee -a "$work/calibration.log" || status=1
else
    echo "skipped: python3 has no CUDA build of PyTorch" | tee "$work/pytorch.log"
fi

step "benchmarks ($mode)"
for bench in "$here"/benches/*; do
    "$bench" --bench 2>&1 | tee -a "$work/benches.log" || status=1
done

step "peers"
if "$here/bin/steppool-bench-report" export-sequences "$work/sequences" "${smoke[@]}"; then
    python3 "$here/peers/peers.py" --sequences "$work/sequences" --out "$work/peers.jsonl" "${smoke[@]}" 2>&1 \
        | tee "$work/peers.log" || status=1
else
    status=1
fi

step "results"
"$here/bin/steppool-bench-report" collect --out "$out" --mode "$mode" --criterion "$work/criterion" \
    --records "$work/records.jsonl" --records "$work/peers.jsonl" || status=1
mkdir -p "$out/logs"
cp "$work"/*.log "$out/logs/" 2>/dev/null || true
echo "results in $out (status $status)"
exit $status
"#;
