//! [`Telemetry`]: what a runtime tells its operators — counters, warnings, the allocation history
//! and the metrics endpoint — behind a handle of its own ([`Runtime::telemetry`]).

use std::sync::Arc;

use crate::error::Result;
use crate::inner::RuntimeInner;
use crate::telemetry::{History, Metrics, Warning, WarningRules};

#[cfg(doc)]
use crate::Runtime;

/// The telemetry of a [`Runtime`], from [`Runtime::telemetry`].
#[derive(Clone, Copy, Debug)]
pub struct Telemetry<'a> {
    pub(crate) inner: &'a Arc<RuntimeInner>,
}

impl Telemetry<'_> {
    /// Every counter now: per pool, with sums per phase, stream and device
    /// ([`Metrics::by_phase`] and so on), and the devices' memory.
    pub fn metrics(&self) -> Result<Metrics> {
        self.inner.metrics()
    }

    /// How many allocations succeeded only after out-of-memory recovery.
    pub fn oom_recoveries(&self) -> u64 {
        self.inner.hub.oom_recoveries.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Replaces the early-warning rules (default: [`WarningRules::default`]). Their memory of
    /// past steps starts over.
    pub fn set_warning_rules(&self, rules: WarningRules) {
        self.inner.hub.set_rules(rules);
    }

    /// The early-warning rules in force.
    pub fn warning_rules(&self) -> WarningRules {
        self.inner.hub.rules()
    }

    /// Calls `callback` with every warning as it fires, at the end of the step that fired it,
    /// on the thread that ended the step. The callback may use the runtime.
    pub fn on_warning(&self, callback: impl Fn(&Warning) + Send + Sync + 'static) {
        self.inner.hub.add_sink(Arc::new(callback));
    }

    /// Serves [`Telemetry::metrics`] as Prometheus text at `GET /metrics` on `addr` (for
    /// example `"127.0.0.1:9400"`, or port 0 for any free port), from a thread of its own, until
    /// the returned server is dropped, with the default [`ServeOptions`](crate::telemetry::ServeOptions):
    /// 64 connections at once, 5 s for a whole request. The server does not keep the runtime
    /// alive.
    #[cfg(feature = "prometheus")]
    pub fn serve_metrics(
        &self,
        addr: impl std::net::ToSocketAddrs,
    ) -> std::io::Result<crate::telemetry::MetricsServer> {
        self.serve_metrics_with(addr, crate::telemetry::ServeOptions::default())
    }

    /// [`Telemetry::serve_metrics`] with its bounds on clients chosen. An `InvalidInput` error
    /// for zero connections or a zero deadline.
    #[cfg(feature = "prometheus")]
    pub fn serve_metrics_with(
        &self,
        addr: impl std::net::ToSocketAddrs,
        options: crate::telemetry::ServeOptions,
    ) -> std::io::Result<crate::telemetry::MetricsServer> {
        let runtime = Arc::downgrade(self.inner);
        let read = Arc::new(move || runtime.upgrade().map(|inner| inner.metrics()));
        crate::telemetry::MetricsServer::start(read, addr, options)
    }

    /// Starts recording the allocation history afresh, keeping the most recent `max_events`
    /// events: allocations, frees, segments, boundaries, warnings and OOMs. Each event takes a
    /// runtime-wide lock while recording is on: a diagnostic mode.
    pub fn start_recording(&self, max_events: usize) {
        self.inner.hub.recorder.start(max_events);
    }

    /// Stops recording; the history recorded so far stays readable.
    pub fn stop_recording(&self) {
        self.inner.hub.recorder.stop();
    }

    /// Whether the history is being recorded.
    pub fn is_recording(&self) -> bool {
        self.inner.hub.recorder.is_on()
    }

    /// A copy of the recorded history.
    pub fn history(&self) -> History {
        self.inner.history()
    }
}
