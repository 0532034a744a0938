//! Project automation for steppool, run as `cargo xtask <command>` (see
//! <https://github.com/matklad/cargo-xtask/>).
//!
//! Commands:
//! - `codegen [--check]`: regenerate `sys/src/bindings.rs` from NVIDIA's `cuda.h`; with `--check`,
//!   fail when the committed file differs from a fresh generation (CI runs this).
//! - `bench [--smoke]`: run the benchmark suite and the peer harness; write
//!   `benches/results/<date>-<device>.{json,md}` and SVG plots.
//! - `gpu-bundle DIR`: build the release binaries, peer harness and run script a GPU host without
//!   a Rust toolchain needs, into `DIR` (at most 64 MiB).
//! - `soak [ARGS]`: the runtime's long run under driver faults on the simulated device.
//! - `loom`: the boundary protocol model-checked with loom, in `target/loom`.
//! - `test [ARGS]`: every test: `cargo test --workspace ARGS`, then the Python package's tests
//!   with pytest in a virtual environment it makes.

mod bench;
mod bundle;
mod codegen;
mod loom;
mod soak;
mod test;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  codegen [--check]   regenerate sys/src/bindings.rs from cuda.h (--check: fail if it is stale)
  bench [--smoke]     run the benchmarks and peers; write benches/results/<date>-<device>.{json,md,svg}
  gpu-bundle DIR      build binaries, peer harness and run.sh for a GPU host into DIR (<= 64 MiB)
  soak [ARGS]         8 threads x 10^6 steps under driver faults on the simulated device (ARGS: --threads N,
                      --steps N, --faults PLAN); prints operations/s, peak memory and leaks
  loom                the boundary protocol model-checked: steppool built with --cfg loom in target/loom,
                      every interleaving of runtime/tests/loom_boundary.rs
  test [ARGS]         cargo test --workspace ARGS, then the Python package's tests (pytest, in a venv
                      under target/ with the package installed by pip install ./runtime/torch), then the
                      repository's traces against the replay targets (benches/traces/targets.py)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match args.as_slice() {
        ["codegen"] => codegen::run(codegen::Mode::Write),
        ["codegen", "--check"] => codegen::run(codegen::Mode::Check),
        ["bench"] => bench::run(false),
        ["bench", "--smoke"] => bench::run(true),
        ["gpu-bundle", dir] => bundle::run(Path::new(dir)),
        ["soak", rest @ ..] => soak::run(rest),
        ["loom"] => loom::run(),
        ["test", rest @ ..] => test::run(rest),
        ["help" | "--help" | "-h"] | [] => {
            println!("{USAGE}");
            Ok(())
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: the parent of this crate's folder.
fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The cargo target folder, honouring `CARGO_TARGET_DIR`.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| project_root().join("target"))
}
