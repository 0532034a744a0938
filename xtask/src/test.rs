//! `cargo xtask test [CARGO TEST ARGS]`: every test of the repository. `cargo test --workspace`
//! (with ARGS), then the Python package's tests: a virtual environment under the target folder
//! (`python-venv/`, made once), pytest from PyPI, the package installed from `runtime/torch` the
//! way a user installs it (`pip install ./runtime/torch`, here with cargo's dev profile unless
//! `SETUPTOOLS_RUST_CARGO_PROFILE` says otherwise, so it reuses the build the Rust tests made),
//! and pytest over `runtime/torch/python/tests` on the simulated device. Last, the repository's
//! real traces (`cli/tests/data/`, `cli/tests/data/recorded/`) against the replay targets
//! (`benches/traces/targets.py`, with the debug build of `steppool`): each must keep meeting them.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::bench::{cargo, status};
use crate::{project_root, target_dir};

/// The Python interpreter that makes the virtual environment: `PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Runs the Rust tests with `args`, then the Python package's.
pub(crate) fn run(args: &[&str]) -> Result<()> {
    let root = project_root();
    status(
        Command::new(cargo()).current_dir(&root).args(["test", "--workspace"]).args(args),
        "cargo test --workspace",
    )?;
    let venv = target_dir().join("python-venv");
    let bin = venv.join("bin");
    if !bin.join("python").exists() {
        status(Command::new(python()).args(["-m", "venv"]).arg(&venv), "making the virtual environment")?;
    }
    let pip = |what: &str, args: &[&str]| {
        status(
            Command::new(bin.join("python"))
                .current_dir(&root)
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
                .args(args)
                .env("SETUPTOOLS_RUST_CARGO_PROFILE", profile()),
            what,
        )
    };
    pip("installing pytest", &["pytest>=7"])?;
    pip("installing the steppool package (pip install ./runtime/torch)", &["./runtime/torch"])?;
    // From outside the source folder, so the installed package is the one imported.
    let tests = root.join("runtime/torch/python/tests");
    status(
        Command::new(bin.join("python"))
            .current_dir(target_dir())
            .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
            .arg(&tests)
            .env("STEPPOOL_DEVICE", "sim"),
        "the Python package's tests",
    )
    .with_context(|| format!("pytest over {}", display(&tests)))?;
    targets(&root)
}

/// The repository's real traces replayed against the replay targets, with the debug build.
fn targets(root: &Path) -> Result<()> {
    // `--bin` without `-p` resolves features over the whole workspace, as `cargo test --workspace`
    // did: the binary that run built is reused, not built again with its dependencies.
    status(
        Command::new(cargo()).current_dir(root).args(["build", "--quiet", "--bin", "steppool"]),
        "building steppool",
    )?;
    let mut traces = Vec::new();
    for (dir, extensions) in [("cli/tests/data", &["csv"][..]), ("cli/tests/data/recorded", &["csv", "jsonl"][..])] {
        let entries = std::fs::read_dir(root.join(dir)).with_context(|| format!("reading {dir}"))?;
        for entry in entries {
            let path = entry?.path();
            if path.extension().is_some_and(|e| extensions.iter().any(|x| e == *x)) {
                traces.push(path);
            }
        }
    }
    traces.sort();
    status(
        Command::new(python())
            .current_dir(root)
            .arg("benches/traces/targets.py")
            .arg("--steppool")
            .arg(target_dir().join("debug/steppool"))
            .args(&traces),
        "the repository's traces against the replay targets (benches/traces/targets.py)",
    )
}

fn profile() -> String {
    std::env::var("SETUPTOOLS_RUST_CARGO_PROFILE").unwrap_or_else(|_| "dev".to_owned())
}

fn display(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}
