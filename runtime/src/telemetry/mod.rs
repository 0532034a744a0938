//! Telemetry: counters per pool, phase, stream and device; early warnings; the allocation
//! history; and the forms operators read them in (JSON lines, Prometheus text, a PyTorch memory
//! snapshot, an SVG timeline, steppool trace files).
//!
//! What costs what: the counters are always on and cost a few additions and two cycle-counter
//! reads per allocation, under the pool lock the allocation takes anyway. The history is off
//! until [`Runtime::start_recording`](crate::Runtime::start_recording); while on, every event
//! takes one runtime-wide lock, so it is a diagnostic mode, as PyTorch's
//! `_record_memory_history` is.

mod history;
mod http;
pub mod json;
mod metrics;
mod pickle;
pub mod prometheus;
mod snapshot;
mod timeline;
mod trace;
mod warnings;

use std::sync::OnceLock;

pub use history::{Event, EventKind, History, LiveBlock, LiveSegment, PoolKey};
pub(crate) use history::{Recorder, thread_number};
pub use http::MetricsServer;
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
