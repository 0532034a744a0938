//! Telemetry: counters per pool, phase, stream and device; early warnings; the allocation
//! history; and the forms operators read them in (JSON lines, Prometheus text, a PyTorch memory
//! snapshot, an SVG timeline, steppool trace files).
//!
//! What costs what: the counters are always on and cost a few additions per allocation, under the
//! pool lock the allocation takes anyway; the time spent allocating is estimated from one
//! allocation in 16, chosen at random, because two clock reads would cost as much as an arena
//! allocation itself. The history is off until
//! [`Runtime::start_recording`](crate::Runtime::start_recording); while on, every event takes
//! one runtime-wide lock, so it is a diagnostic mode, as PyTorch's `_record_memory_history` is.
//!
//! # Trace format, version 1
//!
//! [`History::write_trace`] writes JSON lines. Line 1 is a header:
//! `{"format":"steppool-trace","version":1,"driver":…,"devices":[{"ordinal":0,"total_bytes":N}],
//! "phases":[{"name":"weights","scope":"persistent"},…],"dropped_events":N}` (`scope` is
//! `persistent`, `step` or `micro_step`; `dropped_events` counts the oldest events the recording
//! bound dropped). Then one object per event, in order, with `t_ns` (nanoseconds since recording
//! began, never decreasing) and `event`:
//! - `alloc` and `free`: `ptr`, `bytes`, `device`, `stream`, `phase`, `step` (or null), `thread`;
//!   a free made by a boundary's release has `"release":true`. A free whose allocation came
//!   before recording began (or was dropped) has no matching `alloc`;
//! - `step_begin` and `step_end`: `step`; `micro_begin` and `micro_end`: `step`, `micro`;
//! - `oom`: `bytes`, `device`, `stream`, `phase`;
//! - `warning`: `rule`, `message`.
//!
//! Segments and trims are the runtime's own doing, not the workload's, and are not written.
//! Readers ignore keys they do not know.

mod history;
mod http;
pub mod json;
mod metrics;
pub mod prometheus;
mod snapshot;
mod timeline;
mod trace;
mod warnings;

use std::sync::OnceLock;

pub use history::{Event, EventKind, History, LiveBlock, LiveSegment, PoolKey};
pub(crate) use history::{Recorder, thread_number};
pub use http::MetricsServer;
pub(crate) use metrics::Retired;
pub use metrics::{DeviceMemory, GroupKey, Metrics, PoolMetrics, Usage};
pub(crate) use warnings::WarningState;
pub use warnings::{
    FragmentationRule, LowHeadroomRule, ReservedCreepRule, ScatteredFreeRule, Warning, WarningKind, WarningRules,
};

/// The process's cycle-counter clock (the TSC where it is stable, else the OS's monotonic
/// clock), calibrated once.
pub(crate) fn clock() -> &'static quanta::Clock {
    static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}
