//! [`Torch`]: the process's one steppool runtime as the C ABI holds it — configuration, the
//! streams PyTorch hands in, each thread's phase, the counters of what the ABI was asked, and
//! what telemetry needs between calls (the last failed allocation, the last step report, recent
//! warnings, the metrics server). Every behaviour is the runtime's: this only translates.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::ThreadId;

use serde_json::{Value, json};
use steppool::sys::{CUdeviceptr, CUstream, Selection};
use steppool::telemetry::json::{step_json, warning_json};
use steppool::telemetry::{GroupKey, MetricsServer};
use steppool::{Phase, PhaseSpec, Runtime, Scope, StepReport, Strategy, Warning, fragmentation_ratio};

use crate::error::{Result, TorchError};

/// How many recent warnings the telemetry keeps.
const KEPT_WARNINGS: usize = 64;

/// The name of the persistent phase that serves allocations made outside every phase.
pub(crate) const UNTAGGED: &str = "untagged";

/// What `init` chooses; every field has a default, so a first allocation can initialise alone.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Config {
    /// The strategy of step- and micro-step-scoped phases.
    pub(crate) strategy: Strategy,
    /// The strategy of persistent phases.
    pub(crate) persistent_strategy: Strategy,
    /// The device layer: `STEPPOOL_DEVICE`'s spelling; `None` reads `STEPPOOL_DEVICE`, `auto`
    /// when it is unset.
    pub(crate) device: Option<Selection>,
    /// Checked mode: frees of pointers a step released are reported as such.
    pub(crate) checked: bool,
    /// Events of allocation history to keep (0: not recording).
    pub(crate) record_history: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            strategy: Strategy::PLANNED,
            persistent_strategy: Strategy::Chunked { chunk_bytes: 64 << 20 },
            device: None,
            checked: true,
            record_history: 0,
        }
    }
}

/// Reads a strategy by name: `direct`, `arena`, `chunked` or `planned`, with the runtime's
/// default parameters.
pub(crate) fn parse_strategy(name: &str) -> Result<Strategy> {
    match name {
        "direct" | "pool" => Ok(Strategy::Direct),
        "arena" => Ok(Strategy::ARENA),
        "chunked" => Ok(Strategy::Chunked { chunk_bytes: 64 << 20 }),
        "planned" => Ok(Strategy::PLANNED),
        other => {
            Err(TorchError::Invalid(format!("unknown strategy `{other}`: expected direct, arena, chunked or planned")))
        }
    }
}

/// Reads a scope by name: `persistent`, `step` or `micro_step`.
pub(crate) fn parse_scope(name: &str) -> Result<Scope> {
    Scope::ALL
        .into_iter()
        .find(|scope| scope.name() == name)
        .ok_or_else(|| TorchError::Invalid(format!("unknown scope `{name}`: expected persistent, step or micro_step")))
}

impl Config {
    /// Reads the JSON object `init` is given; absent keys keep their defaults, unknown keys are
    /// refused.
    pub(crate) fn from_json(text: &str) -> Result<Self> {
        let value: Value = if text.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(text).map_err(|error| TorchError::Invalid(format!("init configuration: {error}")))?
        };
        let object =
            value.as_object().ok_or_else(|| TorchError::Invalid("init configuration: not a JSON object".into()))?;
        let mut config = Config::default();
        for (key, value) in object {
            let text = || {
                value
                    .as_str()
                    .ok_or_else(|| TorchError::Invalid(format!("init configuration: `{key}` is not a string")))
            };
            match key.as_str() {
                "strategy" => config.strategy = parse_strategy(text()?)?,
                "persistent_strategy" => config.persistent_strategy = parse_strategy(text()?)?,
                "device" if value.is_null() => config.device = None,
                "device" => {
                    config.device = Some(Selection::parse(text()?).map_err(|e| TorchError::Invalid(e.to_string()))?)
                }
                "checked" => {
                    config.checked = value
                        .as_bool()
                        .ok_or_else(|| TorchError::Invalid("init configuration: `checked` is not a boolean".into()))?
                }
                "record_history" => {
                    config.record_history = value.as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
                        TorchError::Invalid("init configuration: `record_history` is not a count".into())
                    })?
                }
                other => {
                    return Err(TorchError::Invalid(format!(
                        "init configuration: unknown key `{other}` (known: strategy, persistent_strategy, device, \
                         checked, record_history)"
                    )));
                }
            }
        }
        Ok(config)
    }

    fn strategy_for(&self, scope: Scope) -> Strategy {
        match scope {
            Scope::Persistent => self.persistent_strategy,
            Scope::Step | Scope::MicroStep => self.strategy,
        }
    }

    fn describe(&self) -> String {
        format!(
            "strategy {}, persistent strategy {}, device {}, checked {}",
            self.strategy.name(),
            self.persistent_strategy.name(),
            self.device.map_or("from STEPPOOL_DEVICE", |selection| match selection {
                Selection::Auto => "auto",
                Selection::Cuda => "cuda",
                Selection::Sim => "sim",
            }),
            self.checked
        )
    }
}

/// What the ABI was asked, counted: the tests and the telemetry read them.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    allocations: AtomicU64,
    zero_size_allocations: AtomicU64,
    failed_allocations: AtomicU64,
    frees: AtomicU64,
    null_frees: AtomicU64,
    refused_frees: AtomicU64,
    other_stream_frees: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn json(&self) -> Value {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        json!({
            "allocations": get(&self.allocations),
            "zero_size_allocations": get(&self.zero_size_allocations),
            "failed_allocations": get(&self.failed_allocations),
            "frees": get(&self.frees),
            "null_frees": get(&self.null_frees),
            "refused_frees": get(&self.refused_frees),
            "other_stream_frees": get(&self.other_stream_frees),
        })
    }
}

/// The last allocation that could not be served, kept for the explanation PyTorch cannot give.
#[derive(Debug)]
struct Failure {
    requested: i64,
    device: i64,
    phase: String,
    error: Value,
}

thread_local! {
    /// The phases this thread entered, innermost last, each with whether it was entered for
    /// every thread ([`Threads::All`]); allocations go to the innermost.
    static PHASES: RefCell<Vec<(Phase, Threads)>> = const { RefCell::new(Vec::new()) };
}

/// Which threads a phase entered on one thread routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Threads {
    /// The entering thread only.
    Current,
    /// The entering thread, and every thread that has entered no phase of its own while it is
    /// open: autograd's backward threads, which run the backward pass a `loss.backward()` inside
    /// the phase starts.
    All,
}

/// The phases open for every thread ([`Threads::All`]), innermost last, each with the thread
/// that entered it; `open` counts them, so that a thread with no phase of its own takes the lock
/// only while one is open.
#[derive(Debug, Default)]
struct SharedPhases {
    open: AtomicUsize,
    stack: Mutex<Vec<(Phase, ThreadId)>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The process's runtime as the ABI holds it.
#[derive(Debug)]
pub(crate) struct Torch {
    runtime: Runtime,
    config: Config,
    untagged: Phase,
    /// Phases open for every thread.
    shared: SharedPhases,
    /// Streams PyTorch handed in, wrapped once each: (device, raw handle) → stream.
    streams: Mutex<HashMap<(usize, usize), steppool::Stream>>,
    /// Memory fractions set per device.
    fractions: Mutex<HashMap<usize, f64>>,
    counters: Counters,
    last_failure: Mutex<Option<Failure>>,
    last_step: Mutex<Option<StepReport>>,
    warnings: Arc<Mutex<VecDeque<Warning>>>,
    server: Mutex<Option<MetricsServer>>,
}

static TORCH: OnceLock<Torch> = OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());

impl Torch {
    /// The runtime, initialised with the defaults if `init` has not run.
    pub(crate) fn get() -> Result<&'static Torch> {
        match TORCH.get() {
            Some(torch) => Ok(torch),
            None => Self::init(Config::default(), false),
        }
    }

    /// Initialises the runtime with `config`. With `explicit`, a runtime that already exists is
    /// [`TorchError::AlreadyInitialised`]; without, it is returned.
    pub(crate) fn init(config: Config, explicit: bool) -> Result<&'static Torch> {
        let _once = lock(&INIT);
        if let Some(torch) = TORCH.get() {
            return if explicit {
                Err(TorchError::AlreadyInitialised { existing: torch.config.describe() })
            } else {
                Ok(torch)
            };
        }
        let mut builder = Runtime::builder().checked(config.checked).default_device(Selection::Auto);
        if let Some(selection) = config.device {
            builder = builder.driver(steppool::sys::Driver::select(selection).map_err(steppool::Error::from)?);
        }
        if config.record_history > 0 {
            builder = builder.record_history(config.record_history);
        }
        let runtime = builder.build()?;
        for (phase, spec) in runtime.phases() {
            let strategy = config.strategy_for(spec.scope);
            runtime.set_phase_spec(phase, spec.strategy(strategy))?;
        }
        let untagged = runtime.declare_phase(
            PhaseSpec::new(UNTAGGED, Scope::Persistent).strategy(config.strategy_for(Scope::Persistent)),
        )?;
        let warnings = Arc::new(Mutex::new(VecDeque::new()));
        let sink = Arc::downgrade(&warnings);
        runtime.telemetry().on_warning(move |warning| {
            if let Some(warnings) = sink.upgrade() {
                let mut warnings = lock(&warnings);
                if warnings.len() == KEPT_WARNINGS {
                    warnings.pop_front();
                }
                warnings.push_back(warning.clone());
            }
        });
        let torch = Torch {
            runtime,
            config,
            untagged,
            shared: SharedPhases::default(),
            streams: Mutex::default(),
            fractions: Mutex::default(),
            counters: Counters::default(),
            last_failure: Mutex::default(),
            last_step: Mutex::default(),
            warnings,
            server: Mutex::default(),
        };
        Ok(TORCH.get_or_init(|| torch))
    }

    fn device(&self, device: i64) -> Result<steppool::Device> {
        let count = self.runtime.device_count();
        match usize::try_from(device) {
            Ok(ordinal) if ordinal < count => Ok(self.runtime.device(ordinal)?),
            _ => Err(TorchError::BadDevice { device, count }),
        }
    }

    /// The steppool stream over PyTorch's `raw` stream on `device`, wrapped on first use.
    fn stream(&self, device: i64, raw: CUstream) -> Result<steppool::Stream> {
        let handle = self.device(device)?;
        let key = (handle.ordinal(), raw as usize);
        let mut streams = lock(&self.streams);
        if let Some(stream) = streams.get(&key) {
            return Ok(stream.clone());
        }
        // SAFETY: PyTorch hands in streams of its primary context (the one steppool's device uses)
        // from its stream pools, which live as long as the process, or the special handles; the
        // library's contract (lib.rs) asks the same of other callers.
        let stream = unsafe { handle.wrap_stream(raw) }?;
        streams.insert(key, stream.clone());
        Ok(stream)
    }

    /// The phase allocations on this thread go to now: its innermost phase, else the innermost
    /// phase open for every thread, else `untagged`.
    fn current_phase(&self) -> Phase {
        if let Some((phase, _)) = PHASES.with(|phases| phases.borrow().last().copied()) {
            return phase;
        }
        if self.shared.open.load(Ordering::Acquire) > 0
            && let Some(&(phase, _)) = lock(&self.shared.stack).last()
        {
            return phase;
        }
        self.untagged
    }

    /// `alloc_fn`: `size` bytes on `device` in `stream`'s order, in this thread's phase. Zero
    /// bytes is a null pointer and no error.
    pub(crate) fn alloc(&self, size: i64, device: i64, raw: CUstream) -> Result<CUdeviceptr> {
        let phase = self.current_phase();
        let result = self.try_alloc(size, device, raw, phase);
        match &result {
            Ok(0) => Counters::bump(&self.counters.zero_size_allocations),
            Ok(_) => Counters::bump(&self.counters.allocations),
            Err(error) => {
                Counters::bump(&self.counters.failed_allocations);
                let failure =
                    Failure { requested: size, device, phase: self.phase_name(phase), error: error.to_json() };
                *lock(&self.last_failure) = Some(failure);
            }
        }
        result
    }

    fn try_alloc(&self, size: i64, device: i64, raw: CUstream, phase: Phase) -> Result<CUdeviceptr> {
        let bytes = u64::try_from(size).map_err(|_| TorchError::BadSize { size })?;
        if bytes == 0 {
            return Ok(0);
        }
        let stream = self.stream(device, raw)?;
        self.check_fraction(stream.device_ordinal(), bytes)?;
        // SAFETY: the library's contract: PyTorch uses the memory in `raw`'s order (or records
        // other streams through the record-stream hook) and not after freeing it, and a
        // step-scoped phase's tensors do not outlive the step (the Python package says so).
        Ok(unsafe { self.runtime.raw().alloc(phase, bytes, &stream) }?)
    }

    fn check_fraction(&self, device: usize, bytes: u64) -> Result<()> {
        let Some(fraction) = lock(&self.fractions).get(&device).copied() else { return Ok(()) };
        let metrics = self.runtime.telemetry().metrics()?;
        let reserved: u64 = metrics.pools.iter().filter(|p| p.pool.device == device).map(|p| p.usage.reserved).sum();
        let used: u64 = metrics.pools.iter().filter(|p| p.pool.device == device).map(|p| p.usage.used).sum();
        let total = self.runtime.device(device)?.total_memory();
        let allowed = (total as f64 * fraction) as u64;
        // What is reserved but unused may serve the request; count the rest as new reservation.
        let would_reserve = reserved.max(used.saturating_add(bytes));
        if would_reserve > allowed {
            return Err(TorchError::MemoryFraction { requested: bytes, device, would_reserve, fraction, allowed });
        }
        Ok(())
    }

    /// `free_fn`: frees `ptr`, which PyTorch allocated with `size` bytes on `device` and `raw`.
    /// Null is ignored; a size other than the allocated one or an unknown pointer is refused (the
    /// memory is not freed) and reported; a stream other than the allocation's is waited for
    /// before the memory is reused.
    pub(crate) fn free(&self, ptr: CUdeviceptr, size: i64, device: i64, raw: CUstream) -> Result<()> {
        if ptr == 0 {
            Counters::bump(&self.counters.null_frees);
            return Ok(());
        }
        let result = self.try_free(ptr, size, device, raw);
        match &result {
            Ok(()) => Counters::bump(&self.counters.frees),
            Err(_) => Counters::bump(&self.counters.refused_frees),
        }
        result
    }

    fn try_free(&self, ptr: CUdeviceptr, size: i64, device: i64, raw: CUstream) -> Result<()> {
        let api = self.runtime.raw();
        let allocation = api.allocation(ptr)?;
        if u64::try_from(size) != Ok(allocation.bytes) {
            return Err(TorchError::SizeMismatch { ptr, given: size, allocated: allocation.bytes });
        }
        let stream = self.stream(device, raw)?;
        if stream.device_ordinal() != allocation.pool.device || stream.id() != allocation.pool.stream {
            // SAFETY: the stream outlives the release (the stream contract above).
            unsafe { api.record_use(ptr, &stream) }?;
            Counters::bump(&self.counters.other_stream_frees);
        }
        // SAFETY: PyTorch frees a pointer once its last user is gone; work on other streams was
        // recorded above or through the record-stream hook.
        Ok(unsafe { api.free(ptr) }?)
    }

    /// The record-stream hook: work on `raw` uses `ptr`; its free waits for it.
    pub(crate) fn record_stream(&self, ptr: CUdeviceptr, raw: CUstream) -> Result<()> {
        let api = self.runtime.raw();
        let allocation = api.allocation(ptr)?;
        let stream = self.stream(allocation.pool.device as i64, raw)?;
        // SAFETY: the stream outlives the release (the stream contract above).
        Ok(unsafe { api.record_use(ptr, &stream) }?)
    }

    /// The empty-cache hook: every device synchronizes and gives back what its pools hold
    /// without live data. Returns the bytes released.
    pub(crate) fn empty_cache(&self) -> Result<u64> {
        let mut released = 0;
        for ordinal in 0..self.runtime.device_count() {
            released += self.runtime.device(ordinal)?.release_idle()?;
        }
        Ok(released)
    }

    /// The memory-fraction hook: allocations on `device` fail once its pools would reserve more
    /// than `fraction` of its memory.
    pub(crate) fn set_memory_fraction(&self, fraction: f64, device: i64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(TorchError::BadFraction { fraction });
        }
        let ordinal = self.device(device)?.ordinal();
        let mut fractions = lock(&self.fractions);
        if fraction < 1.0 {
            fractions.insert(ordinal, fraction);
        } else {
            // The whole device: its capacity limits, and the runtime's OOM report explains.
            fractions.remove(&ordinal);
        }
        Ok(())
    }

    /// Enters `name` on this thread, declaring it with `scope` (and `strategy`, else the one
    /// `init` chose for the scope) if it is new. A built-in phase keeps its spec unless a
    /// different strategy is asked for before its first allocation.
    pub(crate) fn phase_enter(
        &self,
        name: &str,
        scope: Scope,
        strategy: Option<Strategy>,
        threads: Threads,
    ) -> Result<Phase> {
        let phase = self.declare_phase(name, scope, strategy, None)?;
        PHASES.with(|phases| phases.borrow_mut().push((phase, threads)));
        if threads == Threads::All {
            lock(&self.shared.stack).push((phase, std::thread::current().id()));
            self.shared.open.fetch_add(1, Ordering::AcqRel);
        }
        Ok(phase)
    }

    /// The phase `name`, declared with `scope`, `strategy` (else the one `init` chose for the
    /// scope) and `carry` (else not carrying) if it is new. One that exists must have `scope`;
    /// it takes a different `strategy` or `carry` asked for before its first allocation (a
    /// built-in phase keeps its spec otherwise).
    pub(crate) fn declare_phase(
        &self,
        name: &str,
        scope: Scope,
        strategy: Option<Strategy>,
        carry: Option<bool>,
    ) -> Result<Phase> {
        match self.runtime.phase_named(name) {
            Some(phase) => {
                let spec = self.runtime.phase_spec(phase)?;
                if spec.scope != scope {
                    return Err(TorchError::ScopeMismatch {
                        phase: name.to_owned(),
                        existing: spec.scope.name(),
                        requested: scope.name(),
                    });
                }
                let wanted =
                    spec.clone().strategy(strategy.unwrap_or(spec.strategy)).carry(carry.unwrap_or(spec.carry));
                if wanted != spec {
                    self.runtime.set_phase_spec(phase, wanted)?;
                }
                Ok(phase)
            }
            None => {
                let strategy = strategy.unwrap_or_else(|| self.config.strategy_for(scope));
                let spec = PhaseSpec::new(name, scope).strategy(strategy).carry(carry.unwrap_or(false));
                Ok(self.runtime.declare_phase(spec)?)
            }
        }
    }

    /// Leaves the innermost phase this thread entered.
    pub(crate) fn phase_leave(&self) -> Result<()> {
        let (phase, threads) = PHASES.with(|phases| phases.borrow_mut().pop()).ok_or(TorchError::NoPhase)?;
        if threads == Threads::All {
            let me = std::thread::current().id();
            let mut stack = lock(&self.shared.stack);
            if let Some(index) = stack.iter().rposition(|&entry| entry == (phase, me)) {
                stack.remove(index);
                self.shared.open.fetch_sub(1, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    /// The name of this thread's current phase.
    pub(crate) fn current_phase_name(&self) -> String {
        self.phase_name(self.current_phase())
    }

    fn phase_name(&self, phase: Phase) -> String {
        self.runtime.phase_spec(phase).map_or_else(|_| format!("#{}", phase.index()), |spec| spec.name)
    }

    /// Ends the active step, if any (releasing what its step-scoped phases still hold), and
    /// begins the next; returns the new step's index.
    pub(crate) fn step(&self) -> Result<u64> {
        if self.runtime.active_step().is_some() {
            self.end_step()?;
        }
        Ok(self.runtime.raw().begin_step()?)
    }

    /// Ends the active step and keeps its report.
    pub(crate) fn end_step(&self) -> Result<()> {
        // SAFETY: the library's contract: a step-scoped phase's tensors are gone by its end.
        let report = unsafe { self.runtime.raw().end_step() }?;
        *lock(&self.last_step) = Some(report);
        Ok(())
    }

    /// Starts recording the allocation history afresh, keeping `max_events`.
    pub(crate) fn start_recording(&self, max_events: usize) {
        self.runtime.telemetry().start_recording(max_events);
    }

    /// Writes the recorded history as a PyTorch memory snapshot pickle to `path`.
    pub(crate) fn write_snapshot(&self, path: &str) -> Result<()> {
        let telemetry = self.runtime.telemetry();
        if !telemetry.is_recording() && telemetry.history().events.is_empty() {
            return Err(TorchError::NotRecording);
        }
        let io = |source| TorchError::Io { what: format!("writing the snapshot to {path}"), source };
        let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        telemetry.history().write_memory_snapshot(&mut file).map_err(io)?;
        std::io::Write::flush(&mut file).map_err(io)
    }

    /// Serves the Prometheus metrics at `addr`, replacing a server already running; returns the
    /// port.
    pub(crate) fn serve_metrics(&self, addr: &str) -> Result<u16> {
        let server = self
            .runtime
            .telemetry()
            .serve_metrics(addr)
            .map_err(|source| TorchError::Io { what: format!("serving metrics at {addr}"), source })?;
        let port = server.addr().port();
        *lock(&self.server) = Some(server);
        Ok(port)
    }

    /// Stops the metrics server, if one runs.
    pub(crate) fn stop_metrics(&self) {
        lock(&self.server).take();
    }

    /// Everything a PyTorch user reads, as one JSON object: per phase and device used and
    /// reserved bytes (now and at the step's peak), the fragmentation ratio, the largest free
    /// block where the strategy knows it; the devices' memory; recent warnings; the last failed
    /// allocation with its OOM verdict; the last step report; the ABI's counters.
    pub(crate) fn telemetry(&self) -> Result<Value> {
        let stats = self.runtime.stats()?;
        let mut phases: Vec<(usize, String, Value)> = Vec::new();
        for pool in &stats {
            let largest = pool.free_space.map(|space| space.largest_free);
            match phases.iter_mut().find(|(device, name, _)| *device == pool.pool.device && *name == pool.phase_name) {
                Some((_, _, value)) => {
                    for (key, add) in [
                        ("used_bytes", pool.used),
                        ("reserved_bytes", pool.reserved),
                        ("peak_used_bytes", pool.peak_used),
                        ("peak_reserved_bytes", pool.peak_reserved),
                    ] {
                        value[key] = json!(value[key].as_u64().unwrap_or(0) + add);
                    }
                    value["largest_free_bytes"] = match (value["largest_free_bytes"].as_u64(), largest) {
                        (Some(a), Some(b)) => json!(a.max(b)),
                        _ => Value::Null,
                    };
                }
                None => phases.push((
                    pool.pool.device,
                    pool.phase_name.clone(),
                    json!({
                        "device": pool.pool.device,
                        "phase": pool.phase_name,
                        "scope": pool.scope.name(),
                        "strategy": pool.strategy.name(),
                        "used_bytes": pool.used,
                        "reserved_bytes": pool.reserved,
                        "peak_used_bytes": pool.peak_used,
                        "peak_reserved_bytes": pool.peak_reserved,
                        "largest_free_bytes": largest,
                    }),
                )),
            }
        }
        let phases: Vec<Value> = phases
            .into_iter()
            .map(|(_, _, mut value)| {
                let number = |key: &str| value[key].as_u64().unwrap_or(0);
                let (used, reserved) = (number("used_bytes"), number("reserved_bytes"));
                let ratio = fragmentation_ratio(number("peak_used_bytes"), number("peak_reserved_bytes"));
                value["reserved_unused_bytes"] = json!(reserved.saturating_sub(used));
                value["fragmentation_ratio"] = json!(ratio);
                value
            })
            .collect();
        let metrics = self.runtime.telemetry().metrics()?;
        let by_device = metrics.by_device();
        let mut devices = Vec::new();
        for ordinal in 0..self.runtime.device_count() {
            let device = self.runtime.device(ordinal)?;
            let (free, total) = device.memory_info()?;
            let mapped_high = device.mapped_high_bytes();
            let usage = by_device
                .iter()
                .find(|(key, _)| *key == GroupKey::Device { device: ordinal })
                .map(|(_, usage)| *usage)
                .unwrap_or_default();
            devices.push(json!({
                "device": ordinal,
                "free_bytes": free,
                "total_bytes": total,
                "used_bytes": usage.used,
                "reserved_bytes": usage.reserved,
                // A sum of the pools' high-water marks: an upper bound of the device's.
                "used_high_bytes": usage.used_high,
                // The device's own high-water mark of mapped pages, beside the sum of what the
                // pools' CUDA pools held at most: an upper bound too, exact where the pools map
                // all their memory, and never above the sum of the pools' marks.
                "reserved_high_bytes": usage.reserved_high.min(usage.pool_reserved_high + mapped_high),
                "mapped_high_bytes": mapped_high,
            }));
        }
        let warnings: Vec<Value> = lock(&self.warnings).iter().map(warning_json).collect();
        let last_failure = lock(&self.last_failure).as_ref().map(|failure| {
            json!({
                "requested_bytes": failure.requested,
                "device": failure.device,
                "phase": failure.phase,
                "error": failure.error,
            })
        });
        let gpu = match self.runtime.device_count() {
            0 => false,
            _ => self.runtime.device(0)?.is_gpu(),
        };
        Ok(json!({
            "driver": if gpu { "cuda" } else { "simulated" },
            "configuration": self.config.describe(),
            "device_count": self.runtime.device_count(),
            "active_step": self.runtime.active_step(),
            "steps": metrics.steps,
            "current_phase": self.current_phase_name(),
            "phases": phases,
            "devices": devices,
            "warnings": warnings,
            "last_failure": last_failure,
            "last_step": lock(&self.last_step).as_ref().map(step_json),
            "counters": self.counters.json(),
        }))
    }
}
