//! Shared setup of steppool's benchmarks: the device they run on and the sizes they sweep.
//!
//! Benchmarks follow `STEPPOOL_DEVICE` like everything else: on a GPU they measure the driver;
//! on the simulated device they measure steppool's own overhead above a CPU model of the driver,
//! which is what CI runs (`cargo test --benches`, each benchmark once).

use steppool::Runtime;

/// Allocation sizes swept by the latency benchmarks: 256 B to 256 MiB, by 16×.
pub const SIZES: [u64; 6] = [256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20];

/// The runtime benchmarks measure, on the driver `STEPPOOL_DEVICE` selects.
pub fn runtime() -> Runtime {
    Runtime::new().expect("a driver to benchmark (STEPPOOL_DEVICE)")
}
