//! steppool: stream-ordered GPU memory pools, one per (device, stream, phase), with every
//! allocation of a step-scoped phase released at once at the step boundary.
//!
//! Long training runs die with "CUDA out of memory" while gigabytes are free, because free memory
//! is scattered in pieces too small for the request. Much of that comes from long-lived and
//! short-lived tensors sharing one pool, and from one step's leftovers splitting the next step's
//! memory. steppool separates lifetimes into [`Phase`]s, gives each (device, stream, phase) its
//! own CUDA memory pool (`cuMemPoolCreate`, release threshold raised), and releases every
//! allocation of a step-scoped phase at the boundary, so each step starts clean.
//!
//! ```
//! use steppool::{Phase, PhaseSpec, Runtime, Scope};
//! # fn main() -> steppool::Result<()> {
//! # let runtime = Runtime::builder().simulated(steppool_sys::sim::SimConfig::with_capacity(16 << 30)).build()?;
//! // let runtime = Runtime::new()?; // the GPU, or an error that says why there is none
//! let micro = runtime.declare_phase(PhaseSpec::new("micro_activations", Scope::MicroStep))?;
//! let stream = runtime.device(0)?.create_stream()?;
//! let weights = runtime.alloc(Phase::WEIGHTS, 512 << 20, &stream)?;
//! let step = runtime.begin_step()?;
//! let grads = step.alloc(Phase::GRADIENTS, 512 << 20, &stream)?;
//! for _ in 0..4 {
//!     let micro_step = step.begin_micro_step()?;
//!     let activations = micro_step.alloc(micro, 1 << 30, &stream)?;
//!     // ... launch kernels on `stream` with activations.ptr(), grads.ptr() ...
//!     drop(activations);
//!     micro_step.end()?;
//! }
//! drop(grads);
//! let report = step.end()?;
//! println!("{report}");
//! # drop(weights);
//! # Ok(()) }
//! ```
//!
//! # What the runtime promises
//!
//! - A [`Buffer`] of a step borrows the [`Step`] (or [`MicroStep`]); using it after the step
//!   ended does not compile. Dropping a buffer frees it in its stream's order; a buffer used on
//!   another stream ([`Buffer::record_use`]) is freed after that stream's work.
//! - [`Step::end`] releases every allocation still live in the step's phases (those handed out
//!   through the [raw API](crate::raw)), in stream order and at once: another thread sees the step
//!   before or after, never half released. Persistent phases are untouched.
//! - On `CUDA_ERROR_OUT_OF_MEMORY` the runtime synchronizes the device, gives back the idle memory
//!   of its other pools and retries once; then it fails with [`Error::OutOfMemory`], whose
//!   [`OomReport`] says whether fragmentation or demand caused it.
//! - Devices without memory pools (old drivers, vGPU slices, Windows TCC) are refused with
//!   [`Error::PoolsUnsupported`], unless the driver was opened with
//!   `PoolRequirement::Optional` (or is the simulated device): then they get the same API over
//!   `cuMemAlloc`/`cuMemFree`, said once on stderr.
//! - [`Runtime`] is `Send + Sync`. Each (stream, phase) pool has its own lock and is found by index
//!   from the stream, so threads allocating on their own streams do not contend.
//!
//! What it leaves to the caller: the order of work on streams (a buffer's memory is valid for
//! work in its stream's order), and, with the raw API, the lifetime of pointers.
//!
//! # Features
//!
//! The telemetry exporters are cargo features, all on by default. An embedding build keeps those
//! it uses (`default-features = false, features = [...]`) and sheds the rest with their
//! dependencies; counters, step reports, warnings, OOM reports and the recorded history stay.
//!
//! | feature | exporter | needs |
//! | --- | --- | --- |
//! | `json` | JSON lines of step reports, warnings and OOM reports (`telemetry::json`) | serde_json |
//! | `prometheus` | Prometheus text (`telemetry::prometheus`) and the `/metrics` endpoint (`Telemetry::serve_metrics`, absent without it) | — |
//! | `snapshot` | the history as a PyTorch memory snapshot (`History::write_memory_snapshot`) | — |
//! | `svg` | the history as an SVG timeline (`History::timeline_svg`) | — |
//! | `trace` | the history as a steppool trace (`History::write_trace`) | serde, serde_json (through steppool-trace) |
//!
//! Framework interop is a feature of its own, off by default:
//!
//! | feature | interop | needs |
//! | --- | --- | --- |
//! | `cudarc` | `interop::cudarc`: buffer views that cudarc's launches and copies accept, stream pairs, routing `cuMemAllocAsync` into a phase | cudarc 0.19 (`driver`, `dynamic-loading`, `cuda-12090`) |
//!
//! The trace model itself ([`trace`], which [`telemetry::History::to_trace`] gives the history
//! in, and [`Scope`]) is always there.

// Layers, each importing only from the ones above it in this list (`tests/tidy.rs` fails on a
// loop):
//
// 1. plain types: what a phase is, errors, reports, warnings; the synchronization primitives
//    of the boundary protocol (std's, or loom's under `cfg(loom)`).
mod error;
mod phase;
mod report;
mod sync;
mod warning;
// 2. telemetry: counters, the history recorder, the warning rules and the exporters, all over
//    plain types.
pub mod telemetry;
// 3. machinery: devices and streams as the runtime holds them, the memory a pool takes from the
//    device, the strategies (unit-tested against a fake source), and the phase pool.
mod device_core;
mod pool;
mod source;
mod strategy;
mod stream_core;
// 4. runtime state: the registry, boundary control, the raw-pointer table, the telemetry hub,
//    and the runtime that holds them (the allocation path, the boundaries).
mod control;
mod hub;
mod inner;
mod raw_table;
mod registry;
// 5. public handles.
mod buffer;
pub mod capture;
mod device;
pub mod interop;
pub mod raw;
mod runtime;
mod step;
mod stream;
mod telemetry_handle;

pub use buffer::Buffer;
pub use capture::{CaptureMemory, CaptureMode, CapturedBuffer, CapturedStep, StepCapture};
pub use device::Device;
pub use error::{CaptureError, Error, OomReport, PoolUsage, Result, Verdict};
pub use phase::{InvalidPhaseSpec, MAX_PHASES, Phase, PhaseSpec, Scope, Strategy, TrimPolicy};
pub use raw::RawApi;
pub use report::{
    Breakdown, FreeSpace, GraphMemory, MicroStepReport, PageTraffic, PhaseReport, PlanKey, PlanStats, PlanSummary,
    PoolId, PoolStats, StepReport, fragmentation_ratio,
};
pub use runtime::{Runtime, RuntimeBuilder};
pub use step::{MicroStep, Step};
/// Saved plans: the model and file format of [`Runtime::saved_plans`] and [`Runtime::load_plans`].
pub use steppool_trace::plans::{PhasePlans, PlanFile, PlanFileError};
pub use stream::{Event, Stream};
pub use telemetry_handle::Telemetry;
pub use warning::{Warning, WarningKind, WarningRule};

/// The device layer steppool is built on: generated bindings, the loader and the simulated device.
pub use steppool_sys as sys;
/// The trace model the runtime's recorder writes through and the CLI reads: events, phases,
/// readers and writers, the lifetime analysis and the SVG writer.
pub use steppool_trace as trace;
