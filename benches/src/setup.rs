//! Where benchmarks run and for how long: the driver (`STEPPOOL_DEVICE`, `STEPPOOL_REQUIRE_GPU`),
//! smoke or full mode, criterion's settings, and where the traces are.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use criterion::Criterion;
use steppool::Runtime;
use steppool::sys::{Driver, DriverKind, Selection};

use crate::record::{DeviceInfo, HostInfo};

/// How much a benchmark does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Few sizes, threads and steps: each benchmark in seconds on the simulated device. Chosen by
    /// `STEPPOOL_BENCH_SMOKE=1`, and under `cargo test --benches` (no `--bench` argument).
    Smoke,
    /// Every size, thread count and step.
    Full,
}

impl Mode {
    /// The mode of this process.
    pub fn current() -> Mode {
        let smoke_env = std::env::var("STEPPOOL_BENCH_SMOKE").is_ok_and(|v| v == "1");
        let benchmarking = std::env::args().any(|arg| arg == "--bench");
        if smoke_env || !benchmarking { Mode::Smoke } else { Mode::Full }
    }

    /// `smoke` or `full`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Smoke => "smoke",
            Mode::Full => "full",
        }
    }
}

/// `full` in full mode, `smoke` in smoke mode.
pub fn pick<T: Clone>(full: &[T], smoke: &[T]) -> Vec<T> {
    match Mode::current() {
        Mode::Full => full.to_vec(),
        Mode::Smoke => smoke.to_vec(),
    }
}

/// criterion's settings for this suite. With `STEPPOOL_BENCH_SMOKE=1` every benchmark measures
/// briefly (10 samples in about a quarter of a second); command-line arguments override both.
pub fn bench_config() -> Criterion {
    let criterion = Criterion::default();
    if std::env::var("STEPPOOL_BENCH_SMOKE").is_ok_and(|v| v == "1") {
        criterion
            .warm_up_time(Duration::from_millis(50))
            .measurement_time(Duration::from_millis(200))
            .sample_size(10)
            .without_plots()
    } else {
        criterion.without_plots()
    }
}

/// The driver every benchmark of this process uses: `STEPPOOL_DEVICE`'s choice, or the real one
/// whatever it says when `STEPPOOL_REQUIRE_GPU=1`.
///
/// # Panics
///
/// When no driver can be had, or `STEPPOOL_REQUIRE_GPU=1` and no GPU answers: a benchmark
/// fails rather than measure something else than asked.
pub fn driver() -> Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let require_gpu = std::env::var("STEPPOOL_REQUIRE_GPU").is_ok_and(|v| v == "1");
            let selection =
                Selection::from_env_or(Selection::Auto).unwrap_or_else(|error| panic!("STEPPOOL_DEVICE: {error}"));
            if require_gpu && selection == Selection::Sim {
                panic!("STEPPOOL_REQUIRE_GPU=1 contradicts STEPPOOL_DEVICE=sim");
            }
            let selection = if require_gpu { Selection::Cuda } else { selection };
            let driver = Driver::select(selection).unwrap_or_else(|error| {
                if require_gpu {
                    panic!("STEPPOOL_REQUIRE_GPU=1 but no GPU answered: {error}")
                } else {
                    panic!("no driver to benchmark: {error}")
                }
            });
            eprintln!("steppool-benches: {} ({} mode)", driver.describe(), Mode::current().name());
            driver
        })
        .clone()
}

/// A fresh runtime on [`driver`].
///
/// # Panics
///
/// When the runtime cannot be made.
pub fn runtime() -> Runtime {
    Runtime::with_driver(driver()).expect("a runtime on the benchmark driver")
}

/// What `driver` runs on, for the records of a run.
pub fn device_info(driver: &Driver) -> DeviceInfo {
    let device = driver.device(0).ok();
    let name = device.and_then(|d| driver.device_name(d).ok()).unwrap_or_else(|| "unknown".to_owned());
    let total_memory = device.and_then(|d| driver.device_total_memory(d).ok()).unwrap_or(0);
    let kind = match driver.kind() {
        DriverKind::Cuda => "gpu",
        DriverKind::Simulated => "simulated",
    };
    let driver_version = driver.driver_version().map(|v| v.to_string()).unwrap_or_default();
    DeviceInfo {
        name,
        kind: kind.to_owned(),
        driver: driver.describe(),
        driver_version,
        total_memory,
        host: HostInfo::current(),
    }
}

/// The folder of the recorded traces: `STEPPOOL_TRACES`, else `cli/tests/data`, where the
/// repository keeps the shared training traces.
pub fn traces_dir() -> PathBuf {
    match std::env::var_os("STEPPOOL_TRACES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../cli/tests/data")),
    }
}
