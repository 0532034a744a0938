//! Telemetry: counters per pool, phase, stream and device; early warnings; the allocation
//! history; and the forms operators read them in (JSON lines, Prometheus text, a PyTorch memory
//! snapshot, an SVG timeline, steppool trace files).
//!
//! What costs what: the counters are always on and cost a few additions per allocation, under the
//! pool lock the allocation takes anyway; the time spent allocating is estimated from one
//! allocation in 16, chosen at random, because two clock reads would cost as much as an arena
//! allocation itself. The history is off until
//! [`Telemetry::start_recording`](crate::Telemetry::start_recording); while on, every event takes
//! one runtime-wide lock, so it is a diagnostic mode, as PyTorch's `_record_memory_history` is.
//!
//! # Exporters
//!
//! Each form is a cargo feature of this crate, all on by default (see the [crate docs](crate)):
//! [`json`] (`json`), [`prometheus`] and [`Telemetry::serve_metrics`](crate::Telemetry::serve_metrics)
//! (`prometheus`), [`History::write_memory_snapshot`] (`snapshot`), [`History::timeline_svg`]
//! (`svg`) and [`History::write_trace`] (`trace`). The history itself, and
//! [`History::to_trace`], which gives it in the trace model the CLI and the benchmarks share, are
//! always there.
//!
//! # Trace format
//!
//! [`History::write_trace`] writes steppool's JSON-lines trace format, whose version and fields
//! [`steppool_trace::jsonl`] documents: a header naming the driver, the devices and the phases with
//! their scopes (`persistent`, `step` or `micro_step`), then one line per allocation, free,
//! failed allocation, step and micro-step boundary, and early warning, with `t_ns` in
//! nanoseconds since recording began. Segments and trims are the runtime's own doing, not the
//! workload's, and are not written. Readers ignore keys they do not know.

mod history;
#[cfg(feature = "prometheus")]
mod http;
#[cfg(feature = "json")]
pub mod json;
mod metrics;
#[cfg(feature = "prometheus")]
pub mod prometheus;
#[cfg(feature = "snapshot")]
mod snapshot;
#[cfg(feature = "svg")]
mod timeline;
mod trace;
mod warnings;

use std::sync::OnceLock;

pub use history::{Event, EventKind, History, LiveBlock, LiveSegment};
pub(crate) use history::{Recorder, thread_number};
#[cfg(feature = "prometheus")]
pub use http::{MAX_REQUEST_BYTES, MetricsServer, ServeOptions};
pub(crate) use metrics::Retired;
pub use metrics::{
    DeviceMemory, GroupKey, Metrics, PhaseFragmentation, PhaseOverhead, PoolMetrics, Usage, WarningCount,
};
pub(crate) use warnings::WarningState;
pub use warnings::{
    FragmentationRule, LowHeadroomRule, ReservedCreepRule, ScatteredFreeRule, Warning, WarningKind, WarningRule,
    WarningRules,
};

/// The process's cycle-counter clock (the TSC where it is stable, else the OS's monotonic
/// clock), calibrated once.
pub(crate) fn clock() -> &'static quanta::Clock {
    static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}
