//! steppool-cli: read GPU allocation traces (RMM logs, PyTorch memory snapshots, steppool's own
//! traces), inspect them, replay them through the steppool runtime on the simulated device under
//! each strategy, and convert them to steppool's own trace format.
//!
//! The `steppool` binary is a thin front end over this library:
//!
//! ```text
//! steppool inspect TRACE [--json FILE]
//! steppool replay TRACE [--capacity SIZE] [--strategy NAME|all] [--arena-slab SIZE]
//!                       [--pool-unit SIZE|segments] [--no-bisect] [--json FILE] [--svg FILE]
//!                       [--plan PLAN]
//! steppool plan TRACE -o PLAN [--capacity SIZE]
//! steppool convert TRACE OUTPUT.jsonl
//! steppool synth PATTERN OUTPUT.jsonl [--scale X] [--steps N] [--seed N] [--no-micro-steps]
//! steppool calibrate TRACE... [--pool-unit SIZE|segments] [--markdown FILE] [--json FILE]
//! ```
//!
//! The pipeline is [`read::read_trace`] (format by content, steps from the trace, a sidecar, or
//! [inference](steps)), [`analysis::analyse`] (lifetimes, scopes, phases, operations, live bytes),
//! then [`replay::replay`] (the real runtime on the simulated device, with bisection for the
//! smallest capacity, and the [models of PyTorch's allocator](torch) beside it), the
//! [breakdown] of each run's overhead at its peak, the offline [limit], and [`report`] (tables,
//! JSON, [SVG](svg)). `convert` is
//! [`read::read_trace`] then [`jsonl::write`](steppool_trace::jsonl::write): JSON lines with the trace's step
//! boundaries, which `replay` reads back. `calibrate` runs the same replays on a GPU's driver and
//! on the simulated device, side by side ([calibrate]).
//!
//! ```
//! use steppool_cli::{analysis, read, replay};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let log = "Thread,Time,Action,Pointer,Size,Stream\n\
//!            1,0,allocate,0x1000,4194304,0x0\n\
//!            1,10,free,0x1000,4194304,0x0\n";
//! let trace = read::read_bytes(std::path::Path::new("log.csv"), log.as_bytes())?;
//! let analysis = analysis::analyse(&trace)?;
//! assert_eq!(analysis.peak_live_bytes, 4 << 20);
//! let options = replay::ReplayOptions::new(1 << 30);
//! let results = replay::replay(&trace, &analysis, &replay::select("all")?, &options, &replay::Silent)?;
//! assert!(results.iter().all(|r| r.run.completed()));
//! // One plain pool maps a 32 MiB unit, as the driver does, with a 2 MiB granule free beside
//! // it; the plan maps 2 MiB pages.
//! assert_eq!(results[0].run.strategy, "default-pool");
//! assert_eq!(results[0].min_capacity_bytes, Some(34 << 20));
//! assert_eq!(replay::recommended(&results), Some("planned"));
//! # Ok(()) }
//! ```

pub mod calibrate;
pub mod error;
pub mod limit;
pub mod patterns;
pub mod replay;
pub mod report;
pub mod svg;
pub mod synth;
pub mod torch;

pub use error::{ReplayError, Result};
/// The split of a run's overhead at its peak, defined in [`steppool_trace`] because the runtime's
/// step reports use the same definitions.
pub use steppool_trace::breakdown;
/// The trace model, its readers, step inference and the lifetime analysis live in
/// [`steppool_trace`], shared with the runtime, the benchmarks and the examples.
pub use steppool_trace::{analysis, read, steps};

// The readers accept as many devices as the simulated device replays.
const _: () = assert!(steppool_trace::MAX_DEVICES as usize == steppool_sys::sim::MAX_DEVICES);
