//! The trace model every reader produces and every writer takes: allocation events in record
//! order, the step boundaries, the phases and devices a trace declares, and the warnings counted
//! while reading.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use crate::error::Location;
use crate::scope::Scope;

/// The file format a trace was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// An RMM `logging_resource_adaptor` CSV log.
    Rmm,
    /// A PyTorch memory snapshot pickle (`torch.cuda.memory._dump_snapshot`).
    PyTorch,
    /// steppool's own JSON-lines trace.
    Steppool,
    /// A PyTorch profiler trace: the Chrome trace JSON of `torch.profiler` with
    /// `profile_memory=True`.
    Profiler,
}

impl TraceFormat {
    /// `rmm-csv`, `pytorch-snapshot`, `steppool` or `torch-profiler`.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Rmm => "rmm-csv",
            TraceFormat::PyTorch => "pytorch-snapshot",
            TraceFormat::Steppool => "steppool",
            TraceFormat::Profiler => "torch-profiler",
        }
    }
}

/// What happened at one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `bytes` were allocated at `ptr`.
    Alloc,
    /// The allocation at `ptr` was freed; `released` when a step boundary released it (steppool
    /// traces).
    Free {
        /// Freed by a boundary release rather than by the program.
        released: bool,
    },
    /// An allocation of `bytes` failed (RMM's `allocate failure`, PyTorch's `oom`, steppool's
    /// `oom`). Not replayed.
    AllocFailure,
    /// Step `n` (the trace's numbering) begins.
    StepBegin(u64),
    /// Step `n` ends.
    StepEnd(u64),
    /// Micro-step `k` of step `n` begins.
    MicroBegin(u64, u32),
    /// Micro-step `k` of step `n` ends.
    MicroEnd(u64, u32),
}

impl EventKind {
    /// Whether this is a step or micro-step boundary.
    pub fn is_boundary(self) -> bool {
        matches!(
            self,
            EventKind::StepBegin(_) | EventKind::StepEnd(_) | EventKind::MicroBegin(..) | EventKind::MicroEnd(..)
        )
    }
}

/// One event of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Nanoseconds on the trace's own clock (non-decreasing in a well-formed trace).
    pub t_ns: u64,
    /// What happened.
    pub kind: EventKind,
    /// The device pointer (allocations, frees).
    pub ptr: u64,
    /// Bytes requested (allocations, frees, failures).
    pub bytes: u64,
    /// The device ordinal.
    pub device: u32,
    /// The stream handle as the trace writes it (0: the default stream).
    pub stream: u64,
    /// Index into [`Trace::threads`].
    pub thread: u32,
    /// Index into [`Trace::phases`], for tagged (steppool) traces.
    pub phase: Option<u16>,
    /// Where the event is in the file.
    pub location: Location,
}

impl Event {
    /// An event with every optional field empty: device 0, stream 0, thread 0, no phase.
    pub fn new(t_ns: u64, kind: EventKind, location: Location) -> Self {
        Self { t_ns, kind, ptr: 0, bytes: 0, device: 0, stream: 0, thread: 0, phase: None, location }
    }
}

/// A phase declared by a tagged trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracePhase {
    /// Its name.
    pub name: String,
    /// Its scope.
    pub scope: Scope,
}

/// A device a trace uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceDevice {
    /// Its ordinal.
    pub ordinal: u32,
    /// Its memory, when the trace says.
    pub total_bytes: Option<u64>,
}

/// An early warning the runtime fired while it recorded the trace: telemetry, not workload, so no
/// analysis or replay uses it, but a steppool trace keeps it where it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alert {
    /// How many of [`Trace::events`] came before it.
    pub at: usize,
    /// Nanoseconds on the trace's clock.
    pub t_ns: u64,
    /// The rule that fired (`fragmentation`, `scattered_free`, ...).
    pub rule: String,
    /// What it said.
    pub message: String,
}

/// Where a trace's step boundaries came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepSource {
    /// The trace's own `step_begin`/`step_end` events.
    Trace,
    /// `steps_start_ns` of a sidecar JSON file.
    Sidecar(PathBuf),
    /// Inferred from the trace's periodic pattern (see [`crate::steps`]): the points where no
    /// allocation that counts is live, one step every `every` such points.
    Inferred {
        /// How many quiescent points make one step.
        every: usize,
        /// How many freed allocations were left out as long-lived, as those never freed are.
        long_lived: usize,
        /// The lifetime (events from allocation to free) at and above which an allocation was
        /// left out; `None` when every freed allocation counted.
        limit: Option<usize>,
    },
    /// Inferred from the period of the allocation sizes, where no point is quiescent (see
    /// [`crate::steps`]): one step every `allocations` allocations.
    Periodic {
        /// Allocations per step.
        allocations: usize,
    },
    /// No steps: the trace has none and no pattern was found.
    None,
}

impl fmt::Display for StepSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepSource::Trace => f.write_str("from the trace"),
            StepSource::Sidecar(path) => write!(f, "from {}", path.display()),
            StepSource::Inferred { every, long_lived, limit } => {
                f.write_str("inferred: ")?;
                match every {
                    1 => f.write_str("the points")?,
                    every => write!(f, "one step every {every} points")?,
                }
                f.write_str(" where every allocation that is ever freed")?;
                if let Some(limit) = limit {
                    write!(f, " within {limit} events")?;
                }
                f.write_str(" has been freed")?;
                if *long_lived > 0 {
                    write!(f, " ({long_lived} longer-lived left out)")?;
                }
                Ok(())
            }
            StepSource::Periodic { allocations } => {
                write!(f, "inferred: a step every {allocations} allocations, the period of their sizes")
            }
            StepSource::None => f.write_str("none found: every allocation is replayed as persistent"),
        }
    }
}

/// Kinds of odd records that leave the trace usable; each is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum WarningKind {
    /// An action or event name the reader does not know; the record is skipped.
    UnknownAction,
    /// A free of a pointer that is not live (freed twice, or of unknown size and never allocated
    /// in the trace); skipped.
    UnknownPointerFree,
    /// An allocation at a pointer that is still live; the earlier allocation is taken as freed.
    PointerReused,
    /// A free whose size differs from its allocation's; the allocation's size is used.
    SizeMismatch,
    /// A zero-byte allocation; skipped.
    ZeroBytes,
    /// A time earlier than the record before it; records are replayed in file order.
    TimeBackwards,
    /// A phase name the header does not declare; the allocation is taken as untagged.
    UnknownPhase,
    /// An allocation whose tagged phase's scope does not fit its lifetime; its scope is inferred.
    ScopeMismatch,
    /// A step or micro-step boundary out of order (an end without a begin, a begin inside an
    /// active one); fixed up.
    BoundaryOrder,
    /// Events the recorder dropped (its bound was reached) before the trace begins: allocations
    /// made then and not freed in the trace are missing, so peaks may come out low (those freed
    /// in it are [held from its start](WarningKind::HeldBeforeRecording)). Counted once per
    /// dropped event.
    DroppedEvents,
    /// An allocation made before the recording began, known by its free in the trace or, in a
    /// PyTorch snapshot, as a block still allocated at its end: replayed as made at the trace's
    /// start ([`Trace::hold_from_start`]), so its memory counts.
    HeldBeforeRecording,
    /// A memory event of another kind of device than the one the trace is replayed on (a GPU
    /// run's CPU tensors, in a PyTorch profiler trace); left out.
    OtherDevice,
}

impl WarningKind {
    /// What the warning means, as [`Warnings::lines`] says it.
    pub fn describe(self) -> &'static str {
        match self {
            WarningKind::UnknownAction => "record(s) with an unknown action, skipped",
            WarningKind::UnknownPointerFree => "free(s) of a pointer that is not live, skipped",
            WarningKind::PointerReused => "allocation(s) at a pointer still live; the earlier one taken as freed",
            WarningKind::SizeMismatch => "free(s) whose size differs from the allocation's; the allocation's used",
            WarningKind::ZeroBytes => "zero-byte allocation(s), skipped",
            WarningKind::TimeBackwards => "record(s) earlier than the one before; replayed in file order",
            WarningKind::UnknownPhase => "allocation(s) of a phase the header does not declare; taken as untagged",
            WarningKind::ScopeMismatch => "allocation(s) outliving their phase's scope; scope inferred instead",
            WarningKind::BoundaryOrder => "step boundary(ies) out of order, fixed up",
            WarningKind::HeldBeforeRecording => {
                "allocation(s) made before the recording began, replayed as made at its start"
            }
            WarningKind::OtherDevice => "memory event(s) of another device type than the one replayed, left out",
            WarningKind::DroppedEvents => {
                "event(s) dropped by the recorder before the trace begins; allocations made then and never freed are missing"
            }
        }
    }
}

/// One kind of warning: how often, and the first occurrence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarningCount {
    /// How many records.
    pub count: u64,
    /// The first record.
    pub first: Location,
    /// What the first record said.
    pub detail: String,
}

/// Counted warnings, by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Warnings {
    counts: BTreeMap<WarningKind, WarningCount>,
}

impl Warnings {
    /// Counts one warning; the first of each kind keeps its location and detail.
    pub fn add(&mut self, kind: WarningKind, location: Location, detail: impl FnOnce() -> String) {
        self.counts.entry(kind).and_modify(|count| count.count += 1).or_insert_with(|| WarningCount {
            count: 1,
            first: location,
            detail: detail(),
        });
    }

    /// Counts `count` warnings of one kind at once.
    pub fn add_many(&mut self, kind: WarningKind, count: u64, location: Location, detail: impl FnOnce() -> String) {
        if count == 0 {
            return;
        }
        self.counts.entry(kind).and_modify(|c| c.count += count).or_insert_with(|| WarningCount {
            count,
            first: location,
            detail: detail(),
        });
    }

    /// Adds every warning of `other`.
    pub fn merge(&mut self, other: &Warnings) {
        for (&kind, count) in &other.counts {
            self.counts.entry(kind).and_modify(|mine| mine.count += count.count).or_insert_with(|| count.clone());
        }
    }

    /// How many warnings of `kind`.
    pub fn count(&self, kind: WarningKind) -> u64 {
        self.counts.get(&kind).map_or(0, |count| count.count)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Every kind with its count, in kind order.
    pub fn iter(&self) -> impl Iterator<Item = (WarningKind, &WarningCount)> {
        self.counts.iter().map(|(&kind, count)| (kind, count))
    }

    /// One line per kind: `12 free(s) of a pointer that is not live, skipped (first at line 40: ...)`.
    pub fn lines(&self) -> Vec<String> {
        self.iter()
            .map(|(kind, count)| {
                format!("{} {} (first at {}: {})", count.count, kind.describe(), count.first, count.detail)
            })
            .collect()
    }
}

/// A trace: its events in record order, with step boundaries as events.
#[derive(Clone, Debug)]
pub struct Trace {
    /// The file it was read from, or a name for a trace made in memory (a recorded history, a
    /// synthetic workload); messages about its records name it.
    pub path: PathBuf,
    /// Its format.
    pub format: TraceFormat,
    /// What recorded it, when it says (steppool traces' `driver`).
    pub driver: Option<String>,
    /// The devices it declares or uses, by ordinal.
    pub devices: Vec<TraceDevice>,
    /// Its tagged phases (steppool traces); empty for untagged formats.
    pub phases: Vec<TracePhase>,
    /// Thread names, as the trace writes them; [`Event::thread`] indexes this.
    pub threads: Vec<String>,
    /// Its events, in record order, step boundaries included.
    pub events: Vec<Event>,
    /// The runtime's early warnings recorded with it (steppool traces), in order.
    pub alerts: Vec<Alert>,
    /// Events the recorder dropped before the first one kept, when its bound was reached.
    pub dropped_events: u64,
    /// Where the step boundaries came from.
    pub steps: StepSource,
    /// Odd records that were counted and fixed up or skipped.
    pub warnings: Warnings,
}

impl Trace {
    /// An empty trace of `format`, read from (or named) `path`.
    pub fn new(path: impl Into<PathBuf>, format: TraceFormat) -> Self {
        Self {
            path: path.into(),
            format,
            driver: None,
            devices: Vec::new(),
            phases: Vec::new(),
            threads: Vec::new(),
            events: Vec::new(),
            alerts: Vec::new(),
            dropped_events: 0,
            steps: StepSource::None,
            warnings: Warnings::default(),
        }
    }

    /// Whether the trace has step boundary events.
    pub fn has_steps(&self) -> bool {
        self.events.iter().any(|event| matches!(event.kind, EventKind::StepBegin(_)))
    }

    /// How many steps begin in the trace.
    pub fn step_count(&self) -> usize {
        self.events.iter().filter(|event| matches!(event.kind, EventKind::StepBegin(_))).count()
    }

    /// Allocations made before the recording began are replayed as made at the trace's start, so
    /// that their memory counts: `held` (a PyTorch snapshot's blocks still allocated at its end
    /// that its trace never shows), and the allocation behind every free of a pointer the trace
    /// has not shown before (a log begun mid-run, a snapshot recorded from after the model was
    /// built), with the free's size. Each is a [`WarningKind::HeldBeforeRecording`]. A free of a
    /// pointer seen before (freed twice) or of unknown size stays a free of a pointer that is not
    /// live, which analysis skips.
    pub fn hold_from_start(&mut self, mut held: Vec<Event>) {
        let seen = held.iter().map(|e| (e.device, e.ptr)).collect();
        held.extend(self.allocations_behind_unseen_frees(seen));
        if held.is_empty() {
            return;
        }
        let start = self.events.iter().map(|event| event.t_ns).min().unwrap_or(0);
        for event in &mut held {
            event.t_ns = start;
            self.warnings.add(WarningKind::HeldBeforeRecording, event.location, || {
                format!("{} bytes at {:#x} on device {}", event.bytes, event.ptr, event.device)
            });
        }
        self.events.splice(0..0, held);
    }

    /// The allocation behind each free of a pointer neither in `seen` (device, pointer) nor
    /// allocated or freed in the trace before it, with the free's size when it has one: memory
    /// allocated before the recording began, as [`Trace::hold_from_start`] holds it.
    pub(crate) fn allocations_behind_unseen_frees(
        &self,
        mut seen: std::collections::HashSet<(u32, u64)>,
    ) -> Vec<Event> {
        let mut behind = Vec::new();
        for event in &self.events {
            match event.kind {
                EventKind::Alloc => {
                    seen.insert((event.device, event.ptr));
                }
                EventKind::Free { .. } if seen.insert((event.device, event.ptr)) && event.bytes > 0 => {
                    behind.push(Event { kind: EventKind::Alloc, phase: None, ..*event });
                }
                _ => {}
            }
        }
        behind
    }

    /// Records device `ordinal` in [`Trace::devices`] (kept in ordinal order) if it is new.
    pub fn note_device(&mut self, ordinal: u32) {
        if !self.devices.iter().any(|device| device.ordinal == ordinal) {
            self.devices.push(TraceDevice { ordinal, total_bytes: None });
            self.devices.sort_by_key(|device| device.ordinal);
        }
    }
}

/// The most devices a trace may use (ordinals 0 to 63): as many as steppool's simulated device
/// replays, and a bound on what a hostile file can make a reader allocate per device.
pub const MAX_DEVICES: u32 = 64;

/// Checks a device ordinal read at `location` against [`MAX_DEVICES`].
#[cfg(any(feature = "jsonl", feature = "pytorch"))]
pub(crate) fn check_device(path: &std::path::Path, location: Location, device: u64) -> crate::Result<u32> {
    if device >= u64::from(MAX_DEVICES) {
        return Err(crate::TraceError::malformed(
            path,
            location,
            format!("device {device}: the simulated device replays at most {MAX_DEVICES} devices (0 to 63)"),
        ));
    }
    Ok(device as u32)
}

/// Thread names to indices into [`Trace::threads`], for the readers.
#[derive(Debug, Default)]
pub(crate) struct Threads {
    indices: std::collections::HashMap<String, u32>,
}

impl Threads {
    /// The index of thread `name` in `trace.threads`, added if new.
    pub(crate) fn index(&mut self, trace: &mut Trace, name: &str) -> u32 {
        if let Some(&index) = self.indices.get(name) {
            return index;
        }
        let index = trace.threads.len() as u32;
        trace.threads.push(name.to_owned());
        self.indices.insert(name.to_owned(), index);
        index
    }
}
