//! The telemetry hub: what a runtime keeps for its operators across steps — the history
//! recorder, the counts of pools gone, the warning rules with their memory and callbacks, the
//! last step's fragmentation, and the overhead breakdown of the last step and of the run's peak.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::error::{Error, ErrorSink};
use crate::report::{Breakdown, StepReport, fragmentation_ratio};
use crate::telemetry::{
    EventKind, GroupKey, PhaseFragmentation, PhaseOverhead, Recorder, Retired, Warning, WarningCount, WarningRules,
    WarningState,
};

/// A callback registered with [`Telemetry::on_warning`](crate::Telemetry::on_warning).
pub(crate) type WarningSink = Arc<dyn Fn(&Warning) + Send + Sync>;

/// What the runtime keeps for its operators.
#[derive(Default)]
pub(crate) struct Hub {
    pub(crate) recorder: Arc<Recorder>,
    /// Counts of pools gone with their streams.
    pub(crate) retired: Arc<Retired>,
    /// Allocations that succeeded only after out-of-memory recovery.
    pub(crate) oom_recoveries: AtomicU64,
    /// Steps ended.
    pub(crate) steps_ended: AtomicU64,
    /// Captured steps launched since the last step end (`capture.rs`); a step end takes them.
    pub(crate) graph_launches: AtomicU64,
    /// Captures begun, and those that ended without a graph (deviation, invalidation).
    pub(crate) captures_begun: AtomicU64,
    pub(crate) captures_failed: AtomicU64,
    /// The early-warning rules and their memory between steps.
    warnings: Mutex<(WarningRules, WarningState)>,
    /// Callbacks told of every warning.
    sinks: RwLock<Vec<WarningSink>>,
    /// Each phase's fragmentation ratio in the last step, per device.
    last_fragmentation: Mutex<Vec<PhaseFragmentation>>,
    /// Each phase's overhead breakdown, per device, in the last step and at the run's peak.
    overhead: Mutex<Overhead>,
}

/// Breakdowns per (device, phase).
type PhaseBreakdowns = Vec<(GroupKey, Breakdown)>;

/// The overhead breakdowns the metrics export.
#[derive(Debug, Default)]
struct Overhead {
    /// Per (device, phase), in the last step.
    last: PhaseBreakdowns,
    /// Per device: the step with the highest peak reserved so far (then the most peak used) as
    /// `(device, peak reserved, peak used)`, and its breakdown per phase.
    peaks: Vec<((usize, u64, u64), PhaseBreakdowns)>,
}

impl Overhead {
    /// Takes in a step's pools: the last step's breakdowns, and each device's if its peak is the
    /// run's so far.
    fn update(&mut self, report: &StepReport) {
        self.last.clear();
        let mut devices: Vec<(usize, u64, u64)> = Vec::new();
        for pool in &report.pools {
            let group = GroupKey::Phase { device: pool.pool.device, phase: pool.phase_name.clone() };
            match self.last.iter_mut().find(|(key, _)| *key == group) {
                Some((_, sum)) => *sum += pool.breakdown,
                None => self.last.push((group, pool.breakdown)),
            }
            match devices.iter_mut().find(|(device, _, _)| *device == pool.pool.device) {
                Some((_, reserved, used)) => {
                    *reserved += pool.peak_reserved;
                    *used += pool.peak_used;
                }
                None => devices.push((pool.pool.device, pool.peak_reserved, pool.peak_used)),
            }
        }
        self.last.sort_by(|a, b| a.0.cmp(&b.0));
        for (device, reserved, used) in devices {
            let phases = || {
                self.last
                    .iter()
                    .filter(|(key, _)| matches!(key, GroupKey::Phase { device: d, .. } if *d == device))
                    .cloned()
                    .collect::<PhaseBreakdowns>()
            };
            match self.peaks.iter_mut().find(|((d, _, _), _)| *d == device) {
                Some((peak, breakdowns)) => {
                    if (reserved, used) > (peak.1, peak.2) {
                        *peak = (device, reserved, used);
                        *breakdowns = phases();
                    }
                }
                None => {
                    let breakdowns = phases();
                    self.peaks.push(((device, reserved, used), breakdowns));
                }
            }
        }
    }

    /// Per (device, phase), the last step's breakdown and the run peak's.
    fn phases(&self) -> Vec<PhaseOverhead> {
        let mut phases: Vec<PhaseOverhead> = self
            .last
            .iter()
            .map(|(group, last)| PhaseOverhead {
                group: group.clone(),
                last_step: *last,
                run_peak: Breakdown::default(),
            })
            .collect();
        for (group, at_peak) in self.peaks.iter().flat_map(|(_, breakdowns)| breakdowns) {
            match phases.iter_mut().find(|phase| phase.group == *group) {
                Some(phase) => phase.run_peak = *at_peak,
                None => phases.push(PhaseOverhead {
                    group: group.clone(),
                    last_step: Breakdown::default(),
                    run_peak: *at_peak,
                }),
            }
        }
        phases.sort_by(|a, b| a.group.cmp(&b.group));
        phases
    }
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").field("recording", &self.recorder.is_on()).finish_non_exhaustive()
    }
}

impl Hub {
    /// Replaces the warning rules; their memory of past steps starts over.
    pub(crate) fn set_rules(&self, rules: WarningRules) {
        *self.warnings.lock().unwrap_or_else(PoisonError::into_inner) = (rules, WarningState::default());
    }

    /// The warning rules in force.
    pub(crate) fn rules(&self) -> WarningRules {
        self.warnings.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Adds a warning callback.
    pub(crate) fn add_sink(&self, sink: WarningSink) {
        self.sinks.write().unwrap_or_else(PoisonError::into_inner).push(sink);
    }

    /// How often each rule has fired.
    pub(crate) fn warning_counts(&self) -> Vec<WarningCount> {
        self.warnings.lock().unwrap_or_else(PoisonError::into_inner).1.counts()
    }

    /// The last step's fragmentation per (device, phase).
    pub(crate) fn last_fragmentation(&self) -> Vec<PhaseFragmentation> {
        self.last_fragmentation.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Each phase's overhead breakdown per device, in the last step and at the run's peak.
    pub(crate) fn overhead(&self) -> Vec<PhaseOverhead> {
        self.overhead.lock().unwrap_or_else(PoisonError::into_inner).phases()
    }

    /// Runs the warning rules on a step's numbers and keeps each phase's fragmentation ratio and
    /// overhead breakdown;
    /// `memory` gives a device's `(free, total)` memory.
    pub(crate) fn evaluate(&self, report: &StepReport, memory: &dyn Fn(usize) -> Option<(u64, u64)>) -> Vec<Warning> {
        let mut sums: Vec<(GroupKey, u64, u64)> = Vec::new();
        for pool in &report.pools {
            let group = GroupKey::Phase { device: pool.pool.device, phase: pool.phase_name.clone() };
            match sums.iter_mut().find(|(key, _, _)| *key == group) {
                Some((_, used, reserved)) => {
                    *used += pool.peak_used;
                    *reserved += pool.peak_reserved;
                }
                None => sums.push((group, pool.peak_used, pool.peak_reserved)),
            }
        }
        *self.last_fragmentation.lock().unwrap_or_else(PoisonError::into_inner) = sums
            .into_iter()
            .map(|(group, used, reserved)| PhaseFragmentation { group, ratio: fragmentation_ratio(used, reserved) })
            .collect();
        self.overhead.lock().unwrap_or_else(PoisonError::into_inner).update(report);
        let mut warnings = self.warnings.lock().unwrap_or_else(PoisonError::into_inner);
        let (rules, state) = &mut *warnings;
        state.evaluate(rules, report.index, &report.pools, memory)
    }

    /// Tells the log, the history and the callbacks of `warnings`; a callback that panics is
    /// recorded in `errors` (it must not unwind through `Step`'s drop, where a step may end).
    pub(crate) fn dispatch(&self, warnings: &[Warning], errors: &ErrorSink) {
        if warnings.is_empty() {
            return;
        }
        let sinks: Vec<WarningSink> = self.sinks.read().unwrap_or_else(PoisonError::into_inner).clone();
        for warning in warnings {
            tracing::warn!(
                target: "steppool::warnings",
                rule = warning.rule().name(),
                step = warning.step,
                device = warning.device,
                phase = warning.phase().unwrap_or(""),
                "{warning}"
            );
            self.recorder.record(EventKind::Warning { rule: warning.rule().name(), message: warning.to_string() });
            for sink in &sinks {
                let called = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(warning)));
                if called.is_err() {
                    errors.record(Error::CallbackPanicked { rule: warning.rule() });
                }
            }
        }
    }
}
