//! Errors of the runtime, and the out-of-memory report that explains an OOM.

use std::fmt;
use std::sync::{Mutex, OnceLock, PoisonError};

use steppool_sys::bytes::Bytes;
use steppool_sys::{CUdeviceptr, DriverError, LoadError};

use crate::phase::{InvalidPhaseSpec, Scope};
use crate::report::PoolId;
use crate::warning::WarningRule;

/// What went wrong. Every variant carries the numbers a user needs to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No driver could be opened.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The device could not hold the request, even after synchronizing and trimming the
    /// device's idle pool memory. The report says why.
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// A request of zero bytes.
    #[error("a zero-byte allocation was requested in phase `{phase}`")]
    ZeroSize {
        /// The phase.
        phase: String,
    },
    /// A request larger than the whole device; refused without trying.
    #[error("{requested} requested in phase `{phase}` exceeds device {device}'s {total} of memory", requested = Bytes(*.requested), total = Bytes(*.device_total))]
    ExceedsDevice {
        /// Bytes requested.
        requested: u64,
        /// The phase.
        phase: String,
        /// The device ordinal.
        device: usize,
        /// The device's memory.
        device_total: u64,
    },
    /// The phase's budget would be exceeded.
    #[error("phase `{phase}` has a budget of {budget}; it holds {live} and {requested} more was requested", budget = Bytes(*.budget), live = Bytes(*.live), requested = Bytes(*.requested))]
    BudgetExceeded {
        /// The phase.
        phase: String,
        /// Its budget in bytes.
        budget: u64,
        /// Bytes it holds.
        live: u64,
        /// Bytes requested.
        requested: u64,
    },
    /// A phase index this runtime does not have.
    #[error("phase #{index} is not a phase of this runtime (it has {count})")]
    UnknownPhase {
        /// The index.
        index: usize,
        /// How many phases the runtime has.
        count: usize,
    },
    /// The phase's scope does not allow allocating it here.
    #[error("phase `{phase}` is {scope}-scoped: allocate it from {from}")]
    PhaseScope {
        /// The phase.
        phase: String,
        /// Its scope.
        scope: Scope,
        /// Where its allocations come from.
        from: &'static str,
    },
    /// A phase spec the runtime cannot serve.
    #[error("phase `{phase}`: {reason}")]
    InvalidPhaseSpec {
        /// The phase.
        phase: String,
        /// What is wrong.
        reason: String,
    },
    /// A phase name is already taken.
    #[error("a phase named `{name}` already exists")]
    DuplicatePhase {
        /// The name.
        name: String,
    },
    /// The phase's pools exist already; its spec can no longer change.
    #[error("phase `{phase}` is in use: its spec can only change before its first allocation")]
    PhaseInUse {
        /// The phase.
        phase: String,
    },
    /// More than [`MAX_PHASES`](crate::MAX_PHASES) phases.
    #[error("a runtime has at most {max} phases")]
    TooManyPhases {
        /// The limit.
        max: usize,
    },
    /// A step was begun while one is active.
    #[error("step {index} is still active: end it before beginning another")]
    StepActive {
        /// The active step.
        index: u64,
    },
    /// A step-scoped operation with no active step (for example, ending a step twice).
    #[error("no step is active")]
    NoActiveStep,
    /// A micro-step was begun while one is active.
    #[error("micro-step {index} of step {step} is still active")]
    MicroStepActive {
        /// The active step.
        step: u64,
        /// The active micro-step.
        index: u32,
    },
    /// A micro-step operation with no active micro-step.
    #[error("no micro-step is active")]
    NoActiveMicroStep,
    /// The raw API tried to end a step or micro-step that a [`Step`](crate::Step) guard owns.
    #[error("step {index} is owned by a Step guard: end it with Step::end")]
    OwnedByGuard {
        /// The step.
        index: u64,
    },
    /// A callback registered with [`Telemetry::on_warning`](crate::Telemetry::on_warning) panicked;
    /// the panic was caught and the other callbacks still ran.
    #[error("a warning callback panicked while handling a `{rule}` warning")]
    CallbackPanicked {
        /// The rule of the warning it was handling.
        rule: WarningRule,
    },
    /// A device ordinal the driver does not have.
    #[error("device {ordinal} does not exist: the driver has {count} device(s)")]
    NoSuchDevice {
        /// The ordinal.
        ordinal: usize,
        /// How many devices there are.
        count: usize,
    },
    /// The device has no stream-ordered memory pools and the driver was opened requiring them
    /// (`PoolRequirement::Required`, what `Driver::cuda` asks). Open the driver with
    /// `Driver::cuda_with(PoolRequirement::Optional)` to serve such a device with `cuMemAlloc`.
    #[error(
        "device {ordinal} ({name}) has no stream-ordered memory pools (driver {driver_version}), and the driver was \
         opened requiring them; open it with PoolRequirement::Optional to use cuMemAlloc on this device"
    )]
    PoolsUnsupported {
        /// The ordinal.
        ordinal: usize,
        /// The device's name.
        name: String,
        /// The driver's version, as it reports it.
        driver_version: String,
    },
    /// The driver says `peer` cannot access `device`'s memory.
    #[error("device {peer} cannot access the memory of device {device} (cuDeviceCanAccessPeer)")]
    PeerAccessUnsupported {
        /// The device whose pools were to be shared.
        device: usize,
        /// The device that was to access them.
        peer: usize,
    },
    /// A stream of another runtime.
    #[error("the stream belongs to another runtime")]
    ForeignStream,
    /// A raw free or check of a pointer this runtime did not hand out (or already freed).
    #[error("pointer {ptr:#x} was not allocated by this runtime's raw API, or is already freed")]
    UnknownPointer {
        /// The pointer.
        ptr: CUdeviceptr,
    },
    /// Checked mode: a pointer released at a step or micro-step boundary was used again.
    #[error("pointer {ptr:#x} of phase `{phase}` was released at the end of step {step}")]
    UseAfterRelease {
        /// The pointer.
        ptr: CUdeviceptr,
        /// Its phase.
        phase: String,
        /// The step that released it.
        step: u64,
    },
    /// Saved plans name a phase the runtime does not have.
    #[error("the plans name phase `{name}`, which this runtime does not have: declare it first")]
    NoPhaseNamed {
        /// The name.
        name: String,
    },
    /// A plan file that cannot be used (its format, version, or a plan that is not valid).
    #[error("plan file: {0}")]
    InvalidPlans(#[from] steppool_trace::plans::PlanFileError),
    /// A plan key was set for a phase that does not use the planned strategy.
    #[error("phase `{phase}` uses the {strategy} strategy: plan keys select plans of planned phases")]
    NotPlanned {
        /// The phase.
        phase: String,
        /// Its strategy's name.
        strategy: &'static str,
    },
    /// Checked mode: a range that runs past the end of its allocation.
    #[error("range {ptr:#x}+{len} runs past its allocation {base:#x}+{size}")]
    OutOfBounds {
        /// Start of the range.
        ptr: CUdeviceptr,
        /// Its length.
        len: u64,
        /// Start of the allocation it starts in.
        base: CUdeviceptr,
        /// The allocation's size.
        size: u64,
    },
    /// Stream capture: an operation the runtime cannot serve safely while a stream captures,
    /// or a captured step that cannot go on. The capture was ended cleanly, never left invalid.
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// Why a capture could not go on (see [`Error::Capture`]). When the runtime returns one, the
/// capture has been ended and its graph destroyed: the stream is usable, and the caller falls
/// back to an eager step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// An allocation, boundary or other operation on a stream that a capture the runtime does
    /// not own is recording: serving it would leave memory the graph's relaunches reuse.
    #[error(
        "{operation} on stream {stream} while it is being captured: the runtime ended the capture (capture id {id})"
    )]
    Unsafe {
        /// What was asked (`allocation`, `step end`, ...).
        operation: &'static str,
        /// The stream's id.
        stream: u32,
        /// The driver's capture sequence id.
        id: u64,
    },
    /// The capture had already been invalidated by an illegal call; it was ended without a graph.
    #[error("the capture on stream {stream} was invalidated (capture id {id}); it was ended without a graph")]
    Invalidated {
        /// The stream's id.
        stream: u32,
        /// The driver's capture sequence id.
        id: u64,
    },
    /// A planned phase has no packed plan yet (its first step records it), or is not planned.
    #[error("phase `{phase}` has no packed plan to capture a step on (plans exist from a planned phase's second step)")]
    NoPlan {
        /// The phase.
        phase: String,
    },
    /// An allocation during a captured step that the plan does not cover: more allocations than
    /// planned, a larger size, or a planned range still held. The capture was ended; run the
    /// step eagerly.
    #[error("captured step deviates from the plan of phase `{phase}` at allocation {index}: {requested} requested, {planned}", requested = Bytes(*.requested), planned = match .planned { Some(p) => format!("{} planned", Bytes(*p)), None => "none planned".to_owned() })]
    Deviation {
        /// The phase.
        phase: String,
        /// The allocation's index in the step, from 0.
        index: usize,
        /// Bytes requested.
        requested: u64,
        /// The planned entry's size, if there is one at that index.
        planned: Option<u64>,
    },
    /// The phase was not declared to the capture when it began.
    #[error("phase `{phase}` was not named when the capture began")]
    PhaseNotCaptured {
        /// The phase.
        phase: String,
    },
    /// The capture already ended (after a deviation or an error).
    #[error("the capture already ended")]
    Ended,
}

impl From<InvalidPhaseSpec> for Error {
    fn from(InvalidPhaseSpec { phase, reason }: InvalidPhaseSpec) -> Self {
        Error::InvalidPhaseSpec { phase, reason }
    }
}

impl Error {
    /// Whether the device had no memory for the request, as
    /// [`DriverError::is_out_of_memory`] means it: after the runtime's recovery
    /// ([`Error::OutOfMemory`], with its [report](Error::oom_report)), or straight from the
    /// driver where no recovery applies.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory(_) => true,
            Error::Driver(error) => error.is_out_of_memory(),
            _ => false,
        }
    }

    /// Whether the driver's context is lost ([`DriverError::is_sticky`]): every later call fails
    /// too, and memory can no longer be given back.
    pub fn is_sticky(&self) -> bool {
        matches!(self, Error::Driver(error) if error.is_sticky())
    }

    /// The report of an out-of-memory error.
    pub fn oom_report(&self) -> Option<&OomReport> {
        match self {
            Error::OutOfMemory(report) => Some(report),
            _ => None,
        }
    }
}

/// A result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why an allocation failed for lack of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Enough memory held no live data (free on the device, or reserved by pools but unused), but
    /// not in a piece the request could use: the memory is fragmented.
    Fragmentation,
    /// The live data really needs more memory than the device has.
    Demand,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Fragmentation => "fragmentation",
            Verdict::Demand => "demand",
        })
    }
}

/// One pool in an [`OomReport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    /// Which pool.
    pub pool: PoolId,
    /// The phase's name.
    pub phase: String,
    /// Bytes the pool holds from the device.
    pub reserved: u64,
    /// Bytes of live allocations in it, as requested.
    pub used: u64,
    /// The largest free piece inside what it holds, where its strategy knows the layout (arenas,
    /// planned slabs).
    pub largest_free: Option<u64>,
}

/// What was asked, what was there, and the verdict, for an allocation that failed after the
/// runtime synchronized the device, trimmed the idle memory of its other pools and retried once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomReport {
    /// Bytes requested.
    pub requested: u64,
    /// The pool that could not serve it.
    pub pool: PoolId,
    /// Its phase's name.
    pub phase: String,
    /// Free device memory, as `cuMemGetInfo` reports it.
    pub device_free: u64,
    /// The device's memory.
    pub device_total: u64,
    /// The step active when it failed.
    pub step: Option<u64>,
    /// Every pool of the runtime on the device.
    pub pools: Vec<PoolUsage>,
    /// Why it failed.
    pub verdict: Verdict,
}

impl OomReport {
    /// Bytes reserved by the pools but holding no live data.
    pub fn reserved_unused(&self) -> u64 {
        self.pools.iter().map(|p| p.reserved.saturating_sub(p.used)).sum()
    }

    /// The verdict for these numbers: fragmentation when the free and the reserved-but-unused
    /// memory together could have held the request.
    pub fn judge(requested: u64, device_free: u64, pools: &[PoolUsage]) -> Verdict {
        let unused: u64 = pools.iter().map(|p| p.reserved.saturating_sub(p.used)).sum();
        if device_free.saturating_add(unused) >= requested { Verdict::Fragmentation } else { Verdict::Demand }
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory: {} requested in phase `{}` on stream {} of device {}",
            Bytes(self.requested),
            self.phase,
            self.pool.stream,
            self.pool.device
        )?;
        match self.step {
            Some(step) => writeln!(f, " in step {step}")?,
            None => writeln!(f)?,
        }
        writeln!(
            f,
            "  device: {} free of {}; pools reserve {} of which {} hold no live data",
            Bytes(self.device_free),
            Bytes(self.device_total),
            Bytes(self.pools.iter().map(|p| p.reserved).sum()),
            Bytes(self.reserved_unused())
        )?;
        writeln!(
            f,
            "  {:<20} {:>6} {:>12} {:>12} {:>12} {:>12}",
            "phase", "stream", "reserved", "used", "not live", "largest free"
        )?;
        for pool in &self.pools {
            writeln!(
                f,
                "  {:<20} {:>6} {:>12} {:>12} {:>12} {:>12}",
                pool.phase,
                pool.pool.stream,
                Bytes(pool.reserved).to_string(),
                Bytes(pool.used).to_string(),
                Bytes(pool.reserved.saturating_sub(pool.used)).to_string(),
                pool.largest_free.map_or_else(|| "-".to_owned(), |bytes| Bytes(bytes).to_string()),
            )?;
        }
        match self.verdict {
            Verdict::Fragmentation => write!(
                f,
                "  verdict: fragmentation — {} was free or reserved without live data, but in pieces the request could not use",
                Bytes(self.device_free + self.reserved_unused())
            ),
            Verdict::Demand => write!(
                f,
                "  verdict: demand — live data needs more than the device has ({} not live, {} requested)",
                Bytes(self.device_free + self.reserved_unused()),
                Bytes(self.requested)
            ),
        }
    }
}

/// Errors raised where they cannot be returned (in `Drop`), kept for
/// [`Runtime::take_errors`](crate::Runtime::take_errors), and the first sticky driver error
/// ([`Error::is_sticky`]), after which the runtime refuses every operation with it instead of
/// touching memory of a lost context.
#[derive(Debug, Default)]
pub(crate) struct ErrorSink {
    errors: Mutex<Vec<Error>>,
    sticky: OnceLock<DriverError>,
}

impl ErrorSink {
    /// Keeps `error` for later.
    pub(crate) fn record(&self, error: Error) {
        self.observe(&error);
        self.errors.lock().unwrap_or_else(PoisonError::into_inner).push(error);
    }

    /// How many are kept.
    pub(crate) fn len(&self) -> usize {
        self.errors.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Every error kept, oldest first; the sink is empty after.
    pub(crate) fn take(&self) -> Vec<Error> {
        std::mem::take(&mut *self.errors.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Remembers `error` if it is the first sticky one.
    #[cold]
    pub(crate) fn observe(&self, error: &Error) {
        if let Error::Driver(driver) = error
            && driver.is_sticky()
        {
            let _ = self.sticky.set(driver.clone());
        }
    }

    /// Passes `result` through, remembering a sticky error in it.
    #[inline]
    pub(crate) fn watch<T>(&self, result: Result<T>) -> Result<T> {
        match result {
            Ok(value) => Ok(value),
            Err(error) => Err(self.observed(error)),
        }
    }

    /// [`ErrorSink::observe`], passing the error on.
    #[cold]
    fn observed(&self, error: Error) -> Error {
        self.observe(&error);
        error
    }

    /// Runs `operation` unless a sticky error was seen (then returns that), remembering a sticky
    /// error it returns: how every operation that may touch memory starts and ends.
    #[inline]
    pub(crate) fn guard<T>(&self, operation: impl FnOnce() -> Result<T>) -> Result<T> {
        self.check()?;
        self.watch(operation())
    }

    /// The sticky error, once one was seen: every operation returns it.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        match self.sticky.get() {
            Some(error) => Err(Self::sticky_error(error)),
            None => Ok(()),
        }
    }

    /// The error [`ErrorSink::check`] returns, built off the path of every operation.
    #[cold]
    fn sticky_error(error: &DriverError) -> Error {
        Error::Driver(error.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phase::Phase;

    fn usage(reserved: u64, used: u64) -> PoolUsage {
        PoolUsage {
            pool: PoolId { device: 0, stream: 1, phase: Phase::ACTIVATIONS },
            phase: "activations".into(),
            reserved,
            used,
            largest_free: None,
        }
    }

    #[test]
    fn verdicts_follow_free_plus_unused_reserved() {
        assert_eq!(OomReport::judge(10, 4, &[usage(10, 3)]), Verdict::Fragmentation);
        assert_eq!(OomReport::judge(12, 4, &[usage(10, 3)]), Verdict::Demand);
        assert_eq!(OomReport::judge(1, 0, &[usage(10, 10)]), Verdict::Demand);
    }

    #[test]
    fn the_report_names_what_was_asked_and_the_verdict() {
        let report = OomReport {
            requested: 3 << 30,
            phase: "activations".into(),
            pool: PoolId { device: 0, stream: 2, phase: Phase::ACTIVATIONS },
            step: Some(4),
            device_free: 1 << 30,
            device_total: 80 << 30,
            pools: vec![usage(40 << 30, 36 << 30)],
            verdict: Verdict::Fragmentation,
        };
        let text = report.to_string();
        assert!(text.contains("3 GiB requested in phase `activations`"), "{text}");
        assert!(text.contains("1 GiB free of 80 GiB"), "{text}");
        assert!(text.contains("verdict: fragmentation"), "{text}");
    }
}
