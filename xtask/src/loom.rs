//! `cargo xtask loom`: the boundary protocol model-checked (`runtime/tests/loom_boundary.rs`).
//!
//! Builds steppool alone with `--cfg loom`, which swaps the protocol's locks and flags for loom's
//! (`runtime/src/sync.rs`), in a target folder of its own (`target/loom`), so the rest of the
//! workspace keeps its build; then explores every interleaving of each model.
//! `LOOM_MAX_PREEMPTIONS` bounds the exploration when set.

use std::process::Command;

use anyhow::Result;

use crate::bench::{cargo, status};
use crate::{project_root, target_dir};

/// Builds and runs the loom models.
pub(crate) fn run() -> Result<()> {
    let mut rustflags = std::env::var("RUSTFLAGS").unwrap_or_default();
    if !rustflags.is_empty() {
        rustflags.push(' ');
    }
    rustflags.push_str("--cfg loom");
    status(
        Command::new(cargo())
            .current_dir(project_root())
            .env("RUSTFLAGS", rustflags)
            .args(["test", "--release", "-p", "steppool", "--test", "loom_boundary", "--target-dir"])
            .arg(target_dir().join("loom")),
        "the loom models",
    )
}
