//! `cargo xtask soak [ARGS]`: the runtime's long run under driver faults (`tests/soak.rs`), in a
//! release build: 8 threads × 10⁶ steps unless ARGS say otherwise (`--threads N`, `--steps N`,
//! `--faults PLAN`). It prints operations per second, the process's peak memory and the leak;
//! commit its output under `benches/results/` with the machine it ran on.

use std::process::Command;

use anyhow::Result;

use crate::bench::{cargo, status};
use crate::project_root;

/// Builds and runs the soak binary with `args`.
pub(crate) fn run(args: &[&str]) -> Result<()> {
    status(
        Command::new(cargo())
            .current_dir(project_root())
            .args(["run", "--release", "--quiet", "-p", "steppool-tests", "--bin", "soak", "--"])
            .args(args),
        "the soak run",
    )
}
