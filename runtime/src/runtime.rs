//! [`Runtime`]: the handle a program holds on steppool — its devices, phases and steps — and
//! [`RuntimeBuilder`]. The raw API and the telemetry have handles of their own
//! ([`Runtime::raw`], [`Runtime::telemetry`]).

use std::sync::{Arc, PoisonError};

use steppool_sys::{Driver, Selection};
use steppool_trace::plans::{PhasePlans, PlanFile};

use crate::buffer::{Buffer, PoolRef};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::inner::{Caller, RuntimeInner};
use crate::phase::{Phase, PhaseSpec, Strategy};
use crate::raw::RawApi;
use crate::report::PoolStats;
use crate::step::Step;
use crate::stream::Stream;
use crate::telemetry::WarningRules;
use crate::telemetry_handle::Telemetry;

/// The process's steppool: its devices, phases and pools. Cheap to clone; `Send + Sync`.
///
/// ```
/// use steppool::{Phase, Runtime};
/// # fn main() -> steppool::Result<()> {
/// let runtime = Runtime::builder().simulated(steppool_sys::sim::SimConfig::with_capacity(8 << 30)).build()?;
/// let stream = runtime.device(0)?.create_stream()?;
/// let weights = runtime.alloc(Phase::WEIGHTS, 64 << 20, &stream)?;
/// for _ in 0..3 {
///     let step = runtime.begin_step()?;
///     let activations = step.alloc(Phase::ACTIVATIONS, 256 << 20, &stream)?;
///     drop(activations);
///     let report = step.end()?;
///     assert_eq!(report.phase(Phase::ACTIVATIONS).unwrap().peak_used, 256 << 20);
/// }
/// drop(weights);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Runtime {
    pub(crate) inner: Arc<RuntimeInner>,
}

/// Builds a [`Runtime`].
#[derive(Debug, Default)]
pub struct RuntimeBuilder {
    driver: Option<std::result::Result<Driver, steppool_sys::LoadError>>,
    default_device: Option<Selection>,
    checked: Option<bool>,
    specs: Vec<(Phase, PhaseSpec)>,
    warning_rules: Option<WarningRules>,
    record: Option<usize>,
}

impl RuntimeBuilder {
    /// Uses `driver` instead of the one `STEPPOOL_DEVICE` selects.
    pub fn driver(mut self, driver: Driver) -> Self {
        self.driver = Some(Ok(driver));
        self
    }

    /// Uses a simulated device with this configuration, whatever `STEPPOOL_DEVICE` says.
    pub fn simulated(mut self, config: steppool_sys::sim::SimConfig) -> Self {
        self.driver = Some(Driver::simulated(config));
        self
    }

    /// What to use when `STEPPOOL_DEVICE` is unset (default [`Selection::Cuda`]: the GPU, or an
    /// error that says why there is none). Programs that should run anywhere — examples, tools,
    /// tests — ask for [`Selection::Auto`]: the GPU when one answers, else the simulated device,
    /// said once on stderr.
    pub fn default_device(mut self, selection: Selection) -> Self {
        self.default_device = Some(selection);
        self
    }

    /// Turns checked mode on or off (default: `STEPPOOL_CHECKED=1`). In checked mode the raw
    /// API reports frees of unknown or released pointers and uses after a step release precisely.
    pub fn checked(mut self, checked: bool) -> Self {
        self.checked = Some(checked);
        self
    }

    /// Replaces the spec of a built-in phase.
    pub fn phase(mut self, phase: Phase, spec: PhaseSpec) -> Self {
        self.specs.push((phase, spec));
        self
    }

    /// Uses these early-warning rules instead of [`WarningRules::default`].
    pub fn warning_rules(mut self, rules: WarningRules) -> Self {
        self.warning_rules = Some(rules);
        self
    }

    /// Records the allocation history from the start, keeping the most recent `max_events`
    /// (see [`Telemetry::start_recording`](crate::Telemetry::start_recording)).
    pub fn record_history(mut self, max_events: usize) -> Self {
        self.record = Some(max_events);
        self
    }

    /// Builds the runtime.
    pub fn build(self) -> Result<Runtime> {
        let driver = match self.driver {
            Some(driver) => driver?,
            None => Driver::from_env_or(self.default_device.unwrap_or(Selection::Cuda))?,
        };
        let checked = self.checked.unwrap_or_else(|| std::env::var("STEPPOOL_CHECKED").is_ok_and(|v| v == "1"));
        let runtime = Runtime { inner: Arc::new(RuntimeInner::new(driver, checked)?) };
        for (phase, spec) in self.specs {
            runtime.set_phase_spec(phase, spec)?;
        }
        let telemetry = runtime.telemetry();
        if let Some(rules) = self.warning_rules {
            telemetry.set_warning_rules(rules);
        }
        if let Some(max_events) = self.record {
            telemetry.start_recording(max_events);
        }
        Ok(runtime)
    }
}

impl Runtime {
    /// A runtime on the GPU, or the error that says why there is none (no driver library, no
    /// device, a driver too old for memory pools). `STEPPOOL_DEVICE=sim` asks for the simulated
    /// device, `STEPPOOL_DEVICE=auto` for the GPU with the simulated device as fallback.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// A builder, to choose the driver, checked mode and phase specs.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// A runtime on `driver`.
    pub fn with_driver(driver: Driver) -> Result<Self> {
        Self::builder().driver(driver).build()
    }

    /// The driver: the real one or the simulated device.
    pub fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// Whether checked mode is on.
    pub fn is_checked(&self) -> bool {
        self.inner.raw.is_checked()
    }

    /// How many devices the driver has.
    pub fn device_count(&self) -> usize {
        self.inner.registry.device_count()
    }

    /// Device `ordinal`, its primary context retained on first use.
    pub fn device(&self, ordinal: usize) -> Result<Device> {
        let core = self.inner.device(ordinal)?;
        Ok(Device { core, runtime: self.inner.clone() })
    }

    // ----- phases ------------------------------------------------------------------------------

    /// Declares a new phase.
    pub fn declare_phase(&self, spec: PhaseSpec) -> Result<Phase> {
        self.inner.registry.declare_phase(spec)
    }

    /// Replaces a phase's spec; only before its first allocation.
    pub fn set_phase_spec(&self, phase: Phase, spec: PhaseSpec) -> Result<()> {
        self.inner.registry.set_phase_spec(phase, spec)
    }

    /// A phase's spec.
    pub fn phase_spec(&self, phase: Phase) -> Result<PhaseSpec> {
        Ok(self.inner.registry.phase(phase)?.spec.clone())
    }

    /// The phase with this name.
    pub fn phase_named(&self, name: &str) -> Option<Phase> {
        self.inner.registry.phases().iter().find(|entry| entry.spec.name == name).map(|entry| entry.phase)
    }

    /// Every phase, in order.
    pub fn phases(&self) -> Vec<(Phase, PhaseSpec)> {
        self.inner.registry.phases().iter().map(|entry| (entry.phase, entry.spec.clone())).collect()
    }

    /// Sets the key that selects the plan of a [`Planned`](Strategy::Planned) phase from the
    /// next scope on (its next step or micro-step to allocate), instead of the scope's first
    /// sizes: a sequence-length bucket, a batch size. `None` goes back to the first sizes. Each
    /// key gets its own plan, up to the strategy's `max_plans`. A phase's key is part of its
    /// spec's state: [`Runtime::set_phase_spec`] starts it over.
    pub fn set_plan_key(&self, phase: Phase, key: Option<u64>) -> Result<()> {
        let entry = self.inner.registry.phase(phase)?;
        if !matches!(entry.spec.strategy, Strategy::Planned { .. }) {
            return Err(Error::NotPlanned { phase: entry.spec.name.clone(), strategy: entry.spec.strategy.name() });
        }
        *entry.plan_key.lock().unwrap_or_else(PoisonError::into_inner) = key;
        Ok(())
    }

    /// The plans the runtime's [`Planned`](Strategy::Planned) phases keep, per phase by name,
    /// most recently used first: what a later run loads ([`Runtime::load_plans`],
    /// [`PhaseSpec::plans`](PhaseSpec#structfield.plans)) to be planned from its first step.
    /// A phase with pools on several streams or devices gets each pool's plans, one per key and
    /// kind of scope (`SavedPlan::received`; the pool created first wins), at most the phase's
    /// `max_plans`; a pool that is gone (its stream
    /// dropped) took its plans with it. Taken between boundaries, like [`Runtime::stats`]. Write
    /// it with [`PlanFile::to_json`] (feature `trace`).
    pub fn saved_plans(&self) -> PlanFile {
        let _steps = self.inner.control.lock();
        let pools = self.inner.registry.pools();
        let mut phases = Vec::new();
        for entry in self.inner.registry.phases().iter() {
            let Strategy::Planned { max_plans, .. } = entry.spec.strategy else { continue };
            let mut saved = PhasePlans { phase: entry.spec.name.clone(), plans: Vec::new() };
            for pool in pools.iter().filter(|pool| pool.phase() == entry.phase) {
                for plan in pool.lock().saved_plans() {
                    let kept = saved.plans.iter().any(|p| p.key == plan.key && p.received == plan.received);
                    if saved.plans.len() < max_plans as usize && !kept {
                        saved.plans.push(plan);
                    }
                }
            }
            if !saved.plans.is_empty() {
                phases.push(saved);
            }
        }
        PlanFile::new(phases)
    }

    /// Loads saved plans into the phases they name, before their first allocation: each named
    /// phase's spec gets its plans ([`PhaseSpec::plans`](PhaseSpec#structfield.plans)). The file
    /// is checked first ([`PlanFile::validate`]: format, version, every plan overlap-free), and
    /// every phase must exist, use the planned strategy and not be in use yet, or nothing is
    /// loaded: [`Error::InvalidPlans`], [`Error::NoPhaseNamed`], [`Error::InvalidPhaseSpec`],
    /// [`Error::PhaseInUse`].
    pub fn load_plans(&self, file: &PlanFile) -> Result<()> {
        file.validate()?;
        let mut specs = Vec::with_capacity(file.phases.len());
        for saved in &file.phases {
            let phase =
                self.phase_named(&saved.phase).ok_or_else(|| Error::NoPhaseNamed { name: saved.phase.clone() })?;
            let spec = self.phase_spec(phase)?.plans(saved.clone());
            spec.validate()?;
            if self.inner.registry.phase(phase)?.in_use.load(std::sync::atomic::Ordering::Acquire) {
                return Err(Error::PhaseInUse { phase: saved.phase.clone() });
            }
            specs.push((phase, spec));
        }
        for (phase, spec) in specs {
            self.set_phase_spec(phase, spec)?;
        }
        Ok(())
    }

    // ----- memory and steps --------------------------------------------------------------------

    /// Allocates `bytes` of a persistent phase on `stream`; freed (in stream order) on drop.
    pub fn alloc(&self, phase: Phase, bytes: u64, stream: &Stream) -> Result<Buffer<'static>> {
        let (pool, served) = self.inner.allocate(phase, bytes, &stream.core, &stream.pools, Caller::Runtime)?;
        Ok(Buffer::new(served, bytes, PoolRef::Owned(pool.clone())))
    }

    /// The CUDA memory pool serving `phase` on `stream`, created if needed; `None` on devices
    /// without memory pools. Frameworks that allocate with `cuMemAllocAsync` (cudarc, candle,
    /// cubecl) can be routed to it with `cuDeviceSetMemPool` without code changes.
    ///
    /// The handle stays valid as long as `stream` or a clone of it does.
    pub fn pool_handle(&self, phase: Phase, stream: &Stream) -> Result<Option<steppool_sys::CUmemoryPool>> {
        Ok(self.inner.pool(&stream.core, &stream.pools, phase)?.handle())
    }

    /// Begins a step. Step-scoped allocations borrow the returned [`Step`]; ending it releases
    /// everything of its step-scoped phases at once.
    pub fn begin_step(&self) -> Result<Step> {
        let index = self.inner.begin_step(true)?;
        Ok(Step::new(self.inner.clone(), index))
    }

    /// The index of the active step, if any.
    pub fn active_step(&self) -> Option<u64> {
        self.inner.control.lock().active()
    }

    /// The numbers of every pool now. Taken between boundaries: never half-way through a release.
    pub fn stats(&self) -> Result<Vec<PoolStats>> {
        let _steps = self.inner.control.lock();
        self.inner.pool_stats()
    }

    /// Errors raised where they could not be returned (in `Drop`), oldest first.
    pub fn take_errors(&self) -> Vec<Error> {
        self.inner.errors.take()
    }

    // ----- handles -----------------------------------------------------------------------------

    /// The raw API, for frameworks that keep device pointers rather than [`Buffer`]s.
    pub fn raw(&self) -> RawApi<'_> {
        RawApi { inner: &self.inner }
    }

    /// Counters, warnings, the allocation history and the metrics endpoint.
    pub fn telemetry(&self) -> Telemetry<'_> {
        Telemetry { inner: &self.inner }
    }
}
