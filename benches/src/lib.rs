//! Shared parts of steppool's benchmark suite: the device benchmarks run on, the allocators they
//! compare, the allocation sequences they replay (shared with the Python peer harness, made from
//! traces in steppool's trace model), the fill kernel, and the records, tables and plots of a run.
//!
//! Benchmarks follow `STEPPOOL_DEVICE` like everything else: on a GPU they measure the driver;
//! on the simulated device they measure steppool's own overhead above a CPU model of the driver,
//! which is what CI runs (`cargo test --benches`: each benchmark once, in smoke mode).
//! `STEPPOOL_REQUIRE_GPU=1` makes a benchmark fail rather than fall back to the simulated device.

pub mod alloc;
pub mod kernel;
pub mod record;
pub mod replay;
pub mod report;
pub mod sequence;
mod setup;

pub use setup::{Mode, bench_config, device_info, driver, pick, runtime, traces_dir};

use steppool::sys::DriverError;

/// Allocation sizes swept by the latency benchmarks: 256 B to 256 MiB, by 16×.
pub const SIZES: [u64; 6] = [256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20];

/// Sizes of the smoke run: the smallest, a middle one and the largest.
pub const SMOKE_SIZES: [u64; 3] = [256, 64 << 10, 256 << 20];

/// What can go wrong while setting up or running a benchmark.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A steppool call failed.
    #[error(transparent)]
    Runtime(#[from] steppool::Error),
    /// A trace could not be read.
    #[error(transparent)]
    Trace(#[from] steppool_trace::TraceError),
    /// A sequence refers to an allocation it never made, or makes one twice.
    #[error("sequence `{sequence}`, operation {index}: {reason}")]
    Sequence {
        /// The sequence's name.
        sequence: String,
        /// The index of the operation.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A JSON document could not be read.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: String,
        /// The error.
        source: serde_json::Error,
    },
}

/// The result of benchmark support code.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
