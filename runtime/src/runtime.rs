//! The runtime: devices, phases, the pools of each (device, stream, phase), and the step
//! boundaries that release step-scoped memory at once.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use steppool_sys::{CUdeviceptr, Driver};

use crate::buffer::Buffer;
use crate::device::{Device, DeviceCore};
use crate::error::{Error, OomReport, PoolUsage, Result};
use crate::phase::{MAX_PHASES, Phase, PhaseEntry, PhaseSpec, Scope};
use crate::pool::{ErrorSink, PhasePool, PoolState, RawAllocation};
use crate::report::{MicroStepReport, PoolStats, StepReport};
use crate::step::Step;
use crate::stream::Stream;
use crate::telemetry::{
    DeviceMemory, EventKind, History, Metrics, Recorder, Retired, Warning, WarningRules, WarningState,
};

/// Set in [`RuntimeInner::activity`] while a step is active.
pub(crate) const STEP_ACTIVE: u8 = 1;
/// Set in [`RuntimeInner::activity`] while a micro-step is active.
pub(crate) const MICRO_ACTIVE: u8 = 2;

/// Where an allocation request comes from; decides which scopes it may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// [`Runtime::alloc`]: persistent phases.
    Runtime,
    /// [`Step::alloc`]: step-scoped phases.
    Step,
    /// [`MicroStep::alloc`](crate::MicroStep::alloc): step- and micro-step-scoped phases.
    MicroStep,
    /// The raw API: any scope, while that scope is active.
    Raw,
}

#[derive(Debug)]
struct ActiveMicro {
    index: u32,
    guarded: bool,
    started: Instant,
}

#[derive(Debug)]
struct ActiveStep {
    index: u64,
    guarded: bool,
    started: Instant,
    micro: Option<ActiveMicro>,
    micro_steps: u32,
    release_time: Duration,
}

#[derive(Debug, Default)]
pub(crate) struct Control {
    step: Option<ActiveStep>,
    next_step: u64,
}

/// Raw pointers released at boundaries, for checked mode's use-after-release reports.
#[derive(Debug, Default)]
pub(crate) struct ReleasedLog {
    ranges: BTreeMap<CUdeviceptr, (u64, Phase, u64)>,
    order: VecDeque<CUdeviceptr>,
}

/// How many released ranges checked mode remembers.
const RELEASED_LOG_CAPACITY: usize = 1 << 20;

impl ReleasedLog {
    fn forget_overlaps(&mut self, ptr: CUdeviceptr, len: u64) {
        let overlapping: Vec<CUdeviceptr> = self
            .ranges
            .range(..ptr + len.max(1))
            .rev()
            .take_while(|&(&base, &(size, _, _))| base + size > ptr)
            .map(|(&base, _)| base)
            .collect();
        for base in overlapping {
            self.ranges.remove(&base);
        }
    }

    fn insert(&mut self, ptr: CUdeviceptr, size: u64, phase: Phase, step: u64) {
        self.ranges.insert(ptr, (size, phase, step));
        self.order.push_back(ptr);
        while self.order.len() > RELEASED_LOG_CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.ranges.remove(&old);
            }
        }
    }

    pub(crate) fn find(&self, ptr: CUdeviceptr) -> Option<(CUdeviceptr, u64, Phase, u64)> {
        let (&base, &(size, phase, step)) = self.ranges.range(..=ptr).next_back()?;
        (ptr < base + size.max(1)).then_some((base, size, phase, step))
    }
}

static NEXT_RUNTIME: AtomicU64 = AtomicU64::new(1);

/// The shared state of a runtime.
pub(crate) struct RuntimeInner {
    /// Unique in the process, never reused: streams carry it to refuse other runtimes.
    pub(crate) id: u64,
    pub(crate) driver: Driver,
    pub(crate) checked: bool,
    devices: Vec<OnceLock<Arc<DeviceCore>>>,
    phases: RwLock<Vec<Arc<PhaseEntry>>>,
    /// Every pool, weakly: a pool belongs to its stream (and the buffers and raw allocations
    /// on it), and goes away with them while the stream is still live.
    pools: RwLock<Vec<Weak<PhasePool>>>,
    /// Serializes pool creation, phase spec changes and peer grants (all rare); the hot path
    /// reads a stream's pool slots without it.
    pub(crate) creating: Mutex<()>,
    /// Pointers handed out by the raw API, and their pools.
    pub(crate) raw: DashMap<CUdeviceptr, Arc<PhasePool>>,
    /// Checked mode: live raw allocations by address, for range checks.
    pub(crate) raw_ranges: Mutex<BTreeMap<CUdeviceptr, (u64, Phase)>>,
    /// Checked mode: raw allocations released at boundaries.
    pub(crate) released: Mutex<ReleasedLog>,
    control: Mutex<Control>,
    /// [`STEP_ACTIVE`] and [`MICRO_ACTIVE`], cleared at the start of a boundary's release; read
    /// by raw allocations under their pool's lock.
    pub(crate) activity: AtomicU8,
    pub(crate) errors: Arc<ErrorSink>,
    pub(crate) oom_recoveries: AtomicU64,
    pub(crate) recorder: Arc<Recorder>,
    /// Counts of pools gone with their streams.
    retired: Arc<Retired>,
    /// Steps ended.
    steps_ended: AtomicU64,
    /// The early-warning rules and their memory between steps.
    warnings: Mutex<(WarningRules, WarningState)>,
    /// Callbacks told of every warning.
    warning_sinks: RwLock<Vec<WarningSink>>,
    /// Each phase's fragmentation ratio in the last step, per device.
    last_fragmentation: Mutex<Vec<(usize, String, f64)>>,
}

/// A callback registered with [`Runtime::on_warning`].
type WarningSink = Arc<dyn Fn(&Warning) + Send + Sync>;

impl fmt::Debug for RuntimeInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime").field("driver", &self.driver).field("checked", &self.checked).finish_non_exhaustive()
    }
}

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

    /// Uses a simulated device with this configuration.
    pub fn simulated(mut self, config: steppool_sys::sim::SimConfig) -> Self {
        self.driver = Some(Driver::simulated(config));
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
    /// (see [`Runtime::start_recording`]).
    pub fn record_history(mut self, max_events: usize) -> Self {
        self.record = Some(max_events);
        self
    }

    /// Builds the runtime.
    pub fn build(self) -> Result<Runtime> {
        let driver = match self.driver {
            Some(driver) => driver?,
            None => Driver::from_env()?,
        };
        let checked = self.checked.unwrap_or_else(|| std::env::var("STEPPOOL_CHECKED").is_ok_and(|v| v == "1"));
        let runtime = Runtime::with_config(driver, checked)?;
        for (phase, spec) in self.specs {
            runtime.set_phase_spec(phase, spec)?;
        }
        if let Some(rules) = self.warning_rules {
            runtime.set_warning_rules(rules);
        }
        if let Some(max_events) = self.record {
            runtime.start_recording(max_events);
        }
        Ok(runtime)
    }
}

impl Runtime {
    /// A runtime on the driver `STEPPOOL_DEVICE` selects (the real one when a GPU answers,
    /// otherwise the simulated device).
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

    fn with_config(driver: Driver, checked: bool) -> Result<Self> {
        // Calibrating the clock takes up to a few hundred milliseconds: here, not in the first
        // allocation.
        crate::telemetry::clock();
        let count = driver.device_count()?;
        let phases = Phase::built_in_specs()
            .into_iter()
            .enumerate()
            .map(|(index, spec)| PhaseEntry::new(Phase(index as u16), spec))
            .collect();
        let inner = RuntimeInner {
            id: NEXT_RUNTIME.fetch_add(1, Ordering::Relaxed),
            driver,
            checked,
            devices: (0..count).map(|_| OnceLock::new()).collect(),
            phases: RwLock::new(phases),
            pools: RwLock::new(Vec::new()),
            creating: Mutex::new(()),
            raw: DashMap::new(),
            raw_ranges: Mutex::new(BTreeMap::new()),
            released: Mutex::new(ReleasedLog::default()),
            control: Mutex::new(Control::default()),
            activity: AtomicU8::new(0),
            errors: Arc::new(Mutex::new(Vec::new())),
            oom_recoveries: AtomicU64::new(0),
            recorder: Arc::new(Recorder::default()),
            retired: Arc::new(Retired::default()),
            steps_ended: AtomicU64::new(0),
            warnings: Mutex::new((WarningRules::default(), WarningState::default())),
            warning_sinks: RwLock::new(Vec::new()),
            last_fragmentation: Mutex::new(Vec::new()),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The driver: the real one or the simulated device.
    pub fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// Whether checked mode is on.
    pub fn is_checked(&self) -> bool {
        self.inner.checked
    }

    /// How many devices the driver has.
    pub fn device_count(&self) -> usize {
        self.inner.devices.len()
    }

    /// Device `ordinal`, its primary context retained on first use.
    pub fn device(&self, ordinal: usize) -> Result<Device> {
        let core = self.inner.device_core(ordinal)?;
        Ok(Device { core, runtime: self.inner.clone() })
    }

    /// Declares a new phase.
    pub fn declare_phase(&self, spec: PhaseSpec) -> Result<Phase> {
        spec.validate()?;
        let mut phases = write(&self.inner.phases);
        if phases.iter().any(|entry| entry.spec.name == spec.name) {
            return Err(Error::DuplicatePhase { name: spec.name });
        }
        if phases.len() >= MAX_PHASES {
            return Err(Error::TooManyPhases { max: MAX_PHASES });
        }
        let phase = Phase(phases.len() as u16);
        phases.push(PhaseEntry::new(phase, spec));
        Ok(phase)
    }

    /// Replaces a phase's spec; only before its first allocation.
    pub fn set_phase_spec(&self, phase: Phase, spec: PhaseSpec) -> Result<()> {
        spec.validate()?;
        let _creating = self.inner.creating.lock().unwrap_or_else(PoisonError::into_inner);
        let mut phases = write(&self.inner.phases);
        let count = phases.len();
        let entry = phases.get(phase.index()).ok_or(Error::UnknownPhase { index: phase.index(), count })?;
        if entry.in_use.load(Ordering::Acquire) {
            return Err(Error::PhaseInUse { phase: entry.spec.name.clone() });
        }
        if phases.iter().any(|other| other.phase != phase && other.spec.name == spec.name) {
            return Err(Error::DuplicatePhase { name: spec.name });
        }
        phases[phase.index()] = PhaseEntry::new(phase, spec);
        Ok(())
    }

    /// A phase's spec.
    pub fn phase_spec(&self, phase: Phase) -> Result<PhaseSpec> {
        Ok(self.inner.phase_entry(phase)?.spec.clone())
    }

    /// The phase with this name.
    pub fn phase_named(&self, name: &str) -> Option<Phase> {
        read(&self.inner.phases).iter().find(|entry| entry.spec.name == name).map(|entry| entry.phase)
    }

    /// Every phase, in order.
    pub fn phases(&self) -> Vec<(Phase, PhaseSpec)> {
        read(&self.inner.phases).iter().map(|entry| (entry.phase, entry.spec.clone())).collect()
    }

    /// Allocates `bytes` of a persistent phase on `stream`; freed (in stream order) on drop.
    pub fn alloc(&self, phase: Phase, bytes: u64, stream: &Stream) -> Result<Buffer<'static>> {
        let (pool, ptr) = self.inner.allocate(phase, bytes, stream, Caller::Runtime)?;
        Ok(Buffer::new(ptr, bytes, pool))
    }

    /// The CUDA memory pool serving `phase` on `stream`, created if needed; `None` on devices
    /// without memory pools. Frameworks that allocate with `cuMemAllocAsync` (cudarc, candle,
    /// cubecl) can be routed to it with `cuDeviceSetMemPool` without code changes.
    ///
    /// The handle stays valid as long as `stream` or a clone of it does.
    pub fn pool_handle(&self, phase: Phase, stream: &Stream) -> Result<Option<steppool_sys::CUmemoryPool>> {
        if stream.core.runtime != self.inner.id {
            return Err(Error::ForeignStream);
        }
        Ok(self.inner.pool(stream, phase)?.handle())
    }

    /// Begins a step. Step-scoped allocations borrow the returned [`Step`]; ending it releases
    /// everything of its step-scoped phases at once.
    pub fn begin_step(&self) -> Result<Step> {
        let index = self.inner.begin_step(true)?;
        Ok(Step::new(self.inner.clone(), index))
    }

    /// The numbers of every pool now. Taken between boundaries: never half-way through a release.
    pub fn stats(&self) -> Result<Vec<PoolStats>> {
        let _control = self.inner.control();
        self.inner.all_pools().iter().map(|pool| pool.stats(&pool.lock())).collect()
    }

    /// Errors raised where they could not be returned (in `Drop`), oldest first.
    pub fn take_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.inner.errors.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// How many allocations succeeded only after out-of-memory recovery.
    pub fn oom_recoveries(&self) -> u64 {
        self.inner.oom_recoveries.load(Ordering::Relaxed)
    }

    /// Every counter now: per pool, with sums per phase, stream and device
    /// ([`Metrics::by_phase`] and so on), and the devices' memory.
    pub fn metrics(&self) -> Result<Metrics> {
        let _control = self.inner.control();
        let mut pools = Vec::new();
        for pool in self.inner.all_pools() {
            pools.push(pool.metrics(&mut pool.lock())?);
        }
        pools.extend(self.inner.retired.pools());
        let mut devices = Vec::new();
        for (ordinal, slot) in self.inner.devices.iter().enumerate() {
            if let Some(core) = slot.get() {
                core.make_current()?;
                let (free, total) = self.inner.driver.mem_get_info()?;
                devices.push(DeviceMemory { device: ordinal, free, total });
            }
        }
        let warnings = self.inner.warnings.lock().unwrap_or_else(PoisonError::into_inner);
        let mut fired: Vec<(&'static str, u64)> = warnings.1.fired.iter().map(|(&rule, &n)| (rule, n)).collect();
        fired.sort_unstable();
        Ok(Metrics {
            pools,
            devices,
            steps: self.inner.steps_ended.load(Ordering::Relaxed),
            fragmentation: self.inner.last_fragmentation.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            warnings: fired,
        })
    }

    /// Replaces the early-warning rules (default: [`WarningRules::default`]). Their memory of
    /// past steps starts over.
    pub fn set_warning_rules(&self, rules: WarningRules) {
        *self.inner.warnings.lock().unwrap_or_else(PoisonError::into_inner) = (rules, WarningState::default());
    }

    /// The early-warning rules in force.
    pub fn warning_rules(&self) -> WarningRules {
        self.inner.warnings.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Calls `callback` with every warning as it fires, at the end of the step that fired it,
    /// on the thread that ended the step. The callback may use the runtime.
    pub fn on_warning(&self, callback: impl Fn(&Warning) + Send + Sync + 'static) {
        write(&self.inner.warning_sinks).push(Arc::new(callback));
    }

    /// Serves [`Runtime::metrics`] as Prometheus text at `GET /metrics` on `addr` (for
    /// example `"127.0.0.1:9400"`, or port 0 for any free port), from a thread of its own, until
    /// the returned server is dropped. The server does not keep the runtime alive.
    pub fn serve_metrics(
        &self,
        addr: impl std::net::ToSocketAddrs,
    ) -> std::io::Result<crate::telemetry::MetricsServer> {
        crate::telemetry::MetricsServer::start(self, addr)
    }

    /// Starts recording the allocation history afresh, keeping the most recent `max_events`
    /// events: allocations, frees, segments, boundaries, warnings and OOMs. Each event takes a
    /// runtime-wide lock while recording is on: a diagnostic mode.
    pub fn start_recording(&self, max_events: usize) {
        self.inner.recorder.start(max_events);
    }

    /// Stops recording; the history recorded so far stays readable.
    pub fn stop_recording(&self) {
        self.inner.recorder.stop();
    }

    /// Whether the history is being recorded.
    pub fn is_recording(&self) -> bool {
        self.inner.recorder.is_on()
    }

    /// A copy of the recorded history.
    pub fn history(&self) -> History {
        let mut history = self.inner.recorder.history();
        history.phases =
            read(&self.inner.phases).iter().map(|entry| (entry.spec.name.clone(), entry.spec.scope)).collect();
        history.driver = self.inner.driver.describe();
        history.devices = self
            .inner
            .devices
            .iter()
            .enumerate()
            .filter_map(|(ordinal, slot)| slot.get().map(|core| (ordinal, core.total_memory)))
            .collect();
        history
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

impl RuntimeInner {
    pub(crate) fn device_core(&self, ordinal: usize) -> Result<Arc<DeviceCore>> {
        let slot = self.devices.get(ordinal).ok_or(Error::NoSuchDevice { ordinal, count: self.devices.len() })?;
        if let Some(core) = slot.get() {
            return Ok(core.clone());
        }
        let _creating = self.creating.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(core) = slot.get() {
            return Ok(core.clone());
        }
        let core = Arc::new(DeviceCore::open(&self.driver, ordinal)?);
        let _ = slot.set(core.clone());
        Ok(core)
    }

    pub(crate) fn control(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn phase_entry(&self, phase: Phase) -> Result<Arc<PhaseEntry>> {
        let phases = read(&self.phases);
        let count = phases.len();
        phases.get(phase.index()).cloned().ok_or(Error::UnknownPhase { index: phase.index(), count })
    }

    /// Every live pool, in creation order.
    pub(crate) fn all_pools(&self) -> Vec<Arc<PhasePool>> {
        read(&self.pools).iter().filter_map(Weak::upgrade).collect()
    }

    pub(crate) fn pools_on(&self, device: usize) -> Vec<Arc<PhasePool>> {
        self.all_pools().into_iter().filter(|pool| pool.device_ordinal() == device).collect()
    }

    /// The pool of `phase` on `stream`, created on first use.
    pub(crate) fn pool(&self, stream: &Stream, phase: Phase) -> Result<Arc<PhasePool>> {
        let slot = stream
            .pools
            .get(phase.index())
            .ok_or_else(|| Error::UnknownPhase { index: phase.index(), count: read(&self.phases).len() })?;
        if let Some(pool) = slot.get() {
            return Ok(pool.clone());
        }
        let _creating = self.creating.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pool) = slot.get() {
            return Ok(pool.clone());
        }
        // Read under the creation lock, which `set_phase_spec` takes too: the spec cannot
        // change between this read and marking the phase in use.
        let entry = self.phase_entry(phase)?;
        entry.in_use.store(true, Ordering::Release);
        let pool = Arc::new(PhasePool::new(
            entry,
            stream.core.clone(),
            self.errors.clone(),
            self.recorder.clone(),
            self.retired.clone(),
        )?);
        // A step in progress measures the new pool from its creation.
        if self.activity.load(Ordering::Acquire) & STEP_ACTIVE != 0 {
            pool.begin_step(&mut pool.lock())?;
        }
        let mut pools = write(&self.pools);
        pools.retain(|pool| pool.strong_count() > 0);
        pools.push(Arc::downgrade(&pool));
        drop(pools);
        let _ = slot.set(pool.clone());
        Ok(pool)
    }

    /// Allocates from the pool of (`stream`, `phase`) for `caller`, recovering once from
    /// out-of-memory: synchronize the device, trim its other pools, retry.
    pub(crate) fn allocate(
        &self,
        phase: Phase,
        bytes: u64,
        stream: &Stream,
        caller: Caller,
    ) -> Result<(Arc<PhasePool>, CUdeviceptr)> {
        if stream.core.runtime != self.id {
            return Err(Error::ForeignStream);
        }
        let pool = self.pool(stream, phase)?;
        let spec = pool.spec();
        let allowed = matches!(
            (spec.scope, caller),
            (Scope::Persistent, Caller::Runtime | Caller::Raw)
                | (Scope::Step, Caller::Step | Caller::MicroStep | Caller::Raw)
                | (Scope::MicroStep, Caller::MicroStep | Caller::Raw)
        );
        if !allowed {
            let from = match spec.scope {
                Scope::Persistent => "the Runtime",
                Scope::Step => "a Step",
                Scope::MicroStep => "a MicroStep",
            };
            return Err(Error::PhaseScope { phase: spec.name.clone(), scope: spec.scope, from });
        }
        if bytes == 0 {
            return Err(Error::ZeroSize { phase: spec.name.clone() });
        }
        let device = &stream.core.device;
        if bytes > device.total_memory {
            return Err(Error::ExceedsDevice {
                requested: bytes,
                phase: spec.name.clone(),
                device: device.ordinal,
                device_total: device.total_memory,
            });
        }
        let raw = caller == Caller::Raw;
        match self.try_allocate(&pool, bytes, raw) {
            Err(Error::Driver(error)) if error.is_out_of_memory() => {
                self.recover(&pool)?;
                match self.try_allocate(&pool, bytes, raw) {
                    Ok(ptr) => {
                        self.oom_recoveries.fetch_add(1, Ordering::Relaxed);
                        pool.note_oom(true);
                        Ok((pool, ptr))
                    }
                    Err(Error::Driver(error)) if error.is_out_of_memory() => {
                        pool.note_oom(false);
                        let report = self.oom_report(&pool, bytes)?;
                        self.recorder.record(EventKind::Oom {
                            pool: pool.key(),
                            bytes,
                            device_free: report.device_free,
                        });
                        Err(Error::OutOfMemory(Box::new(report)))
                    }
                    Err(other) => Err(other),
                }
            }
            Ok(ptr) => Ok((pool, ptr)),
            Err(other) => Err(other),
        }
    }

    fn try_allocate(&self, pool: &Arc<PhasePool>, bytes: u64, raw: bool) -> Result<CUdeviceptr> {
        let mut state = pool.lock();
        if raw {
            // Under the pool's lock: a boundary clears the flag before taking this lock, so an
            // allocation either lands before the release (and is released) or is refused.
            let activity = self.activity.load(Ordering::Acquire);
            match pool.scope() {
                Scope::Step if activity & STEP_ACTIVE == 0 => return Err(Error::NoActiveStep),
                Scope::MicroStep if activity & MICRO_ACTIVE == 0 => return Err(Error::NoActiveMicroStep),
                _ => {}
            }
        }
        let ptr = pool.allocate(&mut state, bytes)?;
        if raw {
            state.raw.insert(ptr, RawAllocation { bytes, uses: Vec::new() });
            self.raw.insert(ptr, pool.clone());
            if self.checked {
                self.raw_ranges.lock().unwrap_or_else(PoisonError::into_inner).insert(ptr, (bytes, pool.phase()));
                self.released.lock().unwrap_or_else(PoisonError::into_inner).forget_overlaps(ptr, bytes);
            }
        }
        Ok(ptr)
    }

    /// Out-of-memory recovery: synchronize the device so every pending free is observed, then
    /// give back the idle memory of the device's other pools.
    fn recover(&self, failing: &Arc<PhasePool>) -> Result<()> {
        self.trim_device(failing.stream.device.ordinal, Some(failing))?;
        Ok(())
    }

    /// Gives back the idle memory of every pool on `device` (but `except`): strategies first
    /// return what their scope has not touched (an arena's spare slabs) to their CUDA pools, the
    /// device is synchronized so every free is complete, then every pool is trimmed. Returns the
    /// bytes released to the device.
    pub(crate) fn trim_device(&self, device: usize, except: Option<&Arc<PhasePool>>) -> Result<u64> {
        let pools: Vec<Arc<PhasePool>> = self
            .pools_on(device)
            .into_iter()
            .filter(|pool| !except.is_some_and(|failing| Arc::ptr_eq(failing, pool)))
            .collect();
        for pool in &pools {
            pool.release_unused(&mut pool.lock())?;
        }
        self.device_core(device)?.make_current()?;
        self.driver.context_synchronize()?;
        let mut released = 0;
        for pool in &pools {
            released += pool.release_idle(&mut pool.lock())?;
        }
        Ok(released)
    }

    fn oom_report(&self, failing: &Arc<PhasePool>, bytes: u64) -> Result<OomReport> {
        let device = &failing.stream.device;
        device.make_current()?;
        let (device_free, device_total) = self.driver.mem_get_info()?;
        let mut pools = Vec::new();
        for pool in self.pools_on(device.ordinal) {
            let state = pool.lock();
            let stats = pool.stats(&state)?;
            pools.push(PoolUsage {
                phase: stats.phase_name,
                stream: stats.stream,
                reserved: stats.reserved,
                used: stats.used,
                largest_free: stats.free_space.map(|space| space.largest_free),
            });
        }
        let verdict = OomReport::judge(bytes, device_free, &pools);
        Ok(OomReport {
            requested: bytes,
            phase: failing.spec().name.clone(),
            stream: failing.stream.id,
            device: device.ordinal,
            step: self.recorder.step().or_else(|| self.active_step_unlocked()),
            device_free,
            device_total,
            pools,
            verdict,
        })
    }

    // ----- boundaries --------------------------------------------------------------------------------

    pub(crate) fn begin_step(&self, guarded: bool) -> Result<u64> {
        let mut control = self.control();
        if let Some(step) = &control.step {
            return Err(Error::StepActive { index: step.index });
        }
        for pool in self.all_pools() {
            pool.begin_step(&mut pool.lock())?;
        }
        let index = control.next_step;
        control.next_step += 1;
        self.recorder.set_step(Some(index));
        self.recorder.record(EventKind::StepBegin { step: index });
        control.step = Some(ActiveStep {
            index,
            guarded,
            started: Instant::now(),
            micro: None,
            micro_steps: 0,
            release_time: Duration::ZERO,
        });
        self.activity.store(STEP_ACTIVE, Ordering::Release);
        Ok(index)
    }

    pub(crate) fn begin_micro_step(&self, guarded: bool) -> Result<(u64, u32)> {
        let mut control = self.control();
        let step = control.step.as_mut().ok_or(Error::NoActiveStep)?;
        if let Some(micro) = &step.micro {
            return Err(Error::MicroStepActive { step: step.index, index: micro.index });
        }
        let index = step.micro_steps;
        step.micro_steps += 1;
        step.micro = Some(ActiveMicro { index, guarded, started: Instant::now() });
        self.recorder.record(EventKind::MicroBegin { step: step.index, micro: index });
        self.activity.store(STEP_ACTIVE | MICRO_ACTIVE, Ordering::Release);
        Ok((step.index, index))
    }

    /// Ends the active micro-step. `guarded` says whether a [`MicroStep`](crate::MicroStep) guard
    /// asks; the raw API may not end a guard's micro-step.
    pub(crate) fn end_micro_step(&self, guarded: bool) -> Result<MicroStepReport> {
        let mut control = self.control();
        let step = control.step.as_mut().ok_or(Error::NoActiveStep)?;
        let micro = step.micro.as_ref().ok_or(Error::NoActiveMicroStep)?;
        if micro.guarded && !guarded {
            return Err(Error::OwnedByGuard { index: step.index });
        }
        let micro = step.micro.take().expect("checked above");
        self.activity.store(STEP_ACTIVE, Ordering::Release);
        let started = Instant::now();
        let released = self.release(&[Scope::MicroStep], step.index)?;
        let release_time = started.elapsed();
        step.release_time += release_time;
        self.recorder.record(EventKind::MicroEnd { step: step.index, micro: micro.index });
        Ok(MicroStepReport {
            step: step.index,
            index: micro.index,
            duration: micro.started.elapsed(),
            release_time,
            released,
        })
    }

    /// Ends the active step, and its micro-step if one is still active.
    pub(crate) fn end_step(&self, guarded: bool) -> Result<StepReport> {
        let mut control = self.control();
        let step = control.step.as_ref().ok_or(Error::NoActiveStep)?;
        if step.guarded && !guarded {
            return Err(Error::OwnedByGuard { index: step.index });
        }
        let mut step = control.step.take().expect("checked above");
        self.activity.store(0, Ordering::Release);
        let started = Instant::now();
        let released = self.release(&[Scope::MicroStep, Scope::Step], step.index);
        step.release_time += started.elapsed();
        self.recorder.set_step(None);
        self.recorder.record(EventKind::StepEnd { step: step.index });
        self.steps_ended.fetch_add(1, Ordering::Relaxed);
        released?;
        let pools: Vec<PoolStats> =
            self.all_pools().iter().map(|pool| pool.stats(&pool.lock())).collect::<Result<_>>()?;
        let deferred = self.errors.lock().unwrap_or_else(PoisonError::into_inner).len();
        let mut report =
            StepReport::new(step.index, step.started.elapsed(), step.release_time, step.micro_steps, pools, deferred);
        report.warnings = self.evaluate_warnings(&report);
        drop(control);
        self.dispatch(&report.warnings);
        Ok(report)
    }

    /// Runs the warning rules on a step's numbers and keeps each phase's fragmentation ratio.
    fn evaluate_warnings(&self, report: &StepReport) -> Vec<Warning> {
        let mut ratios: Vec<(usize, String, u64, u64)> = Vec::new();
        for pool in &report.pools {
            match ratios.iter_mut().find(|r| r.0 == pool.device && r.1 == pool.phase_name) {
                Some(entry) => {
                    entry.2 += pool.peak_used;
                    entry.3 += pool.peak_reserved;
                }
                None => ratios.push((pool.device, pool.phase_name.clone(), pool.peak_used, pool.peak_reserved)),
            }
        }
        *self.last_fragmentation.lock().unwrap_or_else(PoisonError::into_inner) = ratios
            .into_iter()
            .map(|(device, phase, used, reserved)| (device, phase, crate::fragmentation_ratio(used, reserved)))
            .collect();
        let cache = std::cell::RefCell::new(std::collections::HashMap::new());
        let memory = |ordinal: usize| -> Option<(u64, u64)> {
            *cache.borrow_mut().entry(ordinal).or_insert_with(|| {
                let core = self.devices.get(ordinal)?.get()?;
                core.make_current().ok()?;
                self.driver.mem_get_info().ok()
            })
        };
        let mut warnings = self.warnings.lock().unwrap_or_else(PoisonError::into_inner);
        let (rules, state) = &mut *warnings;
        state.evaluate(rules, report.index, &report.pools, &memory)
    }

    /// Tells the log, the history and the callbacks of `warnings` (without the control lock, so
    /// a callback may use the runtime).
    fn dispatch(&self, warnings: &[Warning]) {
        if warnings.is_empty() {
            return;
        }
        let sinks: Vec<WarningSink> = read(&self.warning_sinks).clone();
        for warning in warnings {
            tracing::warn!(
                target: "steppool::warnings",
                rule = warning.rule(),
                step = warning.step,
                device = warning.device,
                phase = warning.phase().unwrap_or(""),
                "{warning}"
            );
            self.recorder.record(EventKind::Warning { rule: warning.rule(), message: warning.to_string() });
            for sink in &sinks {
                // A panicking callback must not unwind through `Step`'s drop, which may be where
                // the step ends: it is recorded like any error raised where it cannot return.
                let called = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(warning)));
                if called.is_err() {
                    crate::pool::record(&self.errors, Error::CallbackPanicked { rule: warning.rule() });
                }
            }
        }
    }

    /// Releases every pool of the given scopes at once: all their locks are taken (in registry
    /// order) before anything is released and given back after, so no allocation or statistic
    /// sees the release half done. Returns the bytes released.
    fn release(&self, scopes: &[Scope], step: u64) -> Result<u64> {
        let pools: Vec<Arc<PhasePool>> =
            self.all_pools().into_iter().filter(|pool| scopes.contains(&pool.scope())).collect();
        let mut states: Vec<MutexGuard<'_, PoolState>> = pools.iter().map(|pool| pool.lock()).collect();
        let mut total = 0;
        let mut first_error = None;
        for (pool, state) in pools.iter().zip(states.iter_mut()) {
            let released = pool.end_scope(state);
            total += released.bytes;
            self.forget_raw(pool, &released.raw, Some(step));
            if let Some(error) = released.error {
                first_error.get_or_insert(error);
            }
        }
        drop(states);
        match first_error {
            Some(error) => Err(error),
            None => Ok(total),
        }
    }

    /// Drops released raw pointers from the registry; checked mode remembers them.
    pub(crate) fn forget_raw(&self, pool: &PhasePool, pointers: &[(CUdeviceptr, u64)], step: Option<u64>) {
        if pointers.is_empty() {
            return;
        }
        for (ptr, _) in pointers {
            // Only this pool's entry: the address may already serve another pool's allocation.
            self.raw.remove_if(ptr, |_, owner| std::ptr::eq(Arc::as_ptr(owner), pool));
        }
        if self.checked {
            let mut ranges = self.raw_ranges.lock().unwrap_or_else(PoisonError::into_inner);
            let mut log = self.released.lock().unwrap_or_else(PoisonError::into_inner);
            for &(ptr, bytes) in pointers {
                ranges.remove(&ptr);
                if let Some(step) = step {
                    log.insert(ptr, bytes, pool.phase(), step);
                }
            }
        }
    }

    /// The index of the active step, if any, without waiting for a boundary in progress.
    fn active_step_unlocked(&self) -> Option<u64> {
        let control = self.control.try_lock().ok()?;
        control.step.as_ref().map(|step| step.index)
    }

    /// The index of the active step, if any.
    pub(crate) fn active_step(&self) -> Option<u64> {
        self.control().step.as_ref().map(|step| step.index)
    }
}
