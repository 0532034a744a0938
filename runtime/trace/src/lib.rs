//! steppool-trace: the one model of an allocation trace that every part of steppool shares, its
//! readers and writers, the lifetime analysis a replay starts from, and the SVG module every
//! picture is drawn with.
//!
//! A [`Trace`] is a list of [`Event`]s in record order (allocations, frees, failed allocations,
//! step and micro-step boundaries, each with its time, pointer, size, device, stream, thread and
//! phase) with the phases ([`TracePhase`]: a name and a [`Scope`]), devices and threads it
//! declares. Where it comes from and where it goes:
//!
//! | format | module | read | write |
//! | --- | --- | --- | --- |
//! | steppool trace (JSON lines, versioned) | [`jsonl`] | yes (feature `jsonl`) | yes (feature `jsonl`): the runtime's recorder, `steppool convert` |
//! | RMM `logging_resource_adaptor` CSV | [`rmm`] | yes | no |
//! | PyTorch memory snapshot pickle | [`pytorch`] | yes (feature `pytorch`) | [`pytorch::Snapshot`]: the runtime's snapshot exporter |
//! | PyTorch profiler trace (Chrome trace JSON, `profile_memory=True`) | [`profiler`] | yes (feature `jsonl`; gzipped, feature `read`) | no |
//! | steppool plan file (JSON, versioned) | [`plans`] | yes (feature `jsonl`) | yes (feature `jsonl`): `Runtime::saved_plans`, `steppool plan` |
//!
//! [`read::read_trace`] (feature `read`) recognizes the format by content and finds the step
//! boundaries (the trace's own, a sidecar's, or [inferred](steps::infer)). [`analysis::analyse`]
//! then gives each allocation its lifetime and scope and lays out the operations a replay runs,
//! over dense allocation ids. The runtime keeps its own richer in-memory history (segments,
//! reservations, pool keys) and converts it to a [`Trace`] when it writes one; the CLI, the
//! benchmarks and the examples build and read [`Trace`]s directly.
//!
//! ```
//! use std::path::Path;
//! use steppool_trace::{EventKind, Scope, analysis, rmm};
//! # fn main() -> Result<(), steppool_trace::TraceError> {
//! let log = "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x1000,4096,0x0\n1,10,free,0x1000,4096,0x0\n";
//! let trace = rmm::read(Path::new("log.csv"), log.as_bytes())?;
//! assert_eq!(trace.events[1].kind, EventKind::Free { released: false });
//! let analysis = analysis::analyse(&trace)?;
//! assert_eq!((analysis.peak_live_bytes, analysis.allocations[0].scope), (4096, Scope::Persistent));
//! # Ok(()) }
//! ```
//!
//! The crate depends on neither the runtime nor the driver layer: the runtime depends on it, and
//! defines [`Scope`] through it. Features pull in what a format needs and nothing else: `jsonl`
//! (serde, serde_json: steppool traces, plan files, profiler traces), `pytorch` (serde-pickle,
//! for reading), `read` (both, flate2 for gzipped traces, and [`read::read_trace`]); none is on
//! by default.

pub mod analysis;
pub mod breakdown;
mod error;
#[cfg(feature = "jsonl")]
pub mod jsonl;
pub mod packing;
pub mod plans;
#[cfg(feature = "jsonl")]
pub mod profiler;
pub mod pytorch;
#[cfg(feature = "read")]
pub mod read;
pub mod recommend;
pub mod rmm;
mod scope;
pub mod steps;
pub mod svg;
mod trace;

pub use error::{Location, Result, TraceError};
pub use scope::Scope;
pub use trace::{
    Alert, Event, EventKind, MAX_DEVICES, StepSource, Trace, TraceDevice, TraceFormat, TracePhase, WarningCount,
    WarningKind, Warnings,
};
