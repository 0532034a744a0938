//! The allocation history: every allocation, free, segment, trim, boundary, warning and OOM of a
//! runtime, in order, while recording is on. The memory snapshot, the timeline picture and trace
//! files are drawn from it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use steppool_sys::CUdeviceptr;

use crate::phase::{Phase, Scope};
use crate::report::PoolId;

/// One recorded event: when, and what.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// Nanoseconds since recording began.
    pub t_ns: u64,
    /// What happened.
    pub kind: EventKind,
}

/// What a recorded [`Event`] says.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EventKind {
    /// An allocation handed out.
    Alloc {
        /// Its pool.
        pool: PoolId,
        /// Its address.
        ptr: CUdeviceptr,
        /// Bytes requested.
        bytes: u64,
        /// The step active when it was made.
        step: Option<u64>,
        /// The thread that made it (numbered from 1 in order of first use).
        thread: u64,
    },
    /// An allocation given back.
    Free {
        /// Its pool.
        pool: PoolId,
        /// Its address.
        ptr: CUdeviceptr,
        /// Bytes requested at its allocation.
        bytes: u64,
        /// The step active when it was freed.
        step: Option<u64>,
        /// The thread that freed it.
        thread: u64,
        /// Whether a boundary released it (it was still live when its scope ended).
        release: bool,
    },
    /// Memory a pool's strategy took from its CUDA pool (an arena slab, or a `Pool` strategy's
    /// allocation itself).
    SegmentAlloc {
        /// The pool.
        pool: PoolId,
        /// The segment's address.
        ptr: CUdeviceptr,
        /// Its size.
        bytes: u64,
        /// The CUDA pool's reservation after it.
        pool_reserved: u64,
    },
    /// Memory a pool's strategy gave back to its CUDA pool.
    SegmentFree {
        /// The pool.
        pool: PoolId,
        /// The segment's address.
        ptr: CUdeviceptr,
        /// Its size.
        bytes: u64,
        /// The CUDA pool's reservation after it.
        pool_reserved: u64,
    },
    /// Pages mapped into an address range a pool reserved (a planned slab, a persistent chunk
    /// or an arena under virtual memory management): the range is one segment that grows by
    /// them, as PyTorch's expandable segments do.
    SegmentMap {
        /// The pool.
        pool: PoolId,
        /// The range's address.
        range: CUdeviceptr,
        /// The first page's address.
        ptr: CUdeviceptr,
        /// The pages' bytes.
        bytes: u64,
        /// The pool's reservation after it.
        pool_reserved: u64,
    },
    /// Pages unmapped from an address range a pool reserved: its segment shrinks by them (and
    /// splits where they lay between mapped pages).
    SegmentUnmap {
        /// The pool.
        pool: PoolId,
        /// The range's address.
        range: CUdeviceptr,
        /// The first page's address.
        ptr: CUdeviceptr,
        /// The pages' bytes.
        bytes: u64,
        /// The pool's reservation after it.
        pool_reserved: u64,
    },
    /// A pool's reservation read after a boundary's trim or an out-of-memory recovery.
    Reserved {
        /// The pool.
        pool: PoolId,
        /// Its reservation.
        pool_reserved: u64,
    },
    /// A step began.
    StepBegin {
        /// Its index.
        step: u64,
    },
    /// A step ended (after its release).
    StepEnd {
        /// Its index.
        step: u64,
    },
    /// A micro-step began.
    MicroBegin {
        /// The step.
        step: u64,
        /// Its index in the step.
        micro: u32,
    },
    /// A micro-step ended (after its release).
    MicroEnd {
        /// The step.
        step: u64,
        /// Its index in the step.
        micro: u32,
    },
    /// An allocation failed for lack of memory after recovery.
    Oom {
        /// The pool asked.
        pool: PoolId,
        /// Bytes requested.
        bytes: u64,
        /// Free device memory then.
        device_free: u64,
    },
    /// A captured step's graph was launched
    /// ([`CapturedStep::launch`](crate::CapturedStep::launch)).
    GraphLaunch {
        /// The device it ran on.
        device: usize,
        /// The id of the stream it was launched on.
        stream: u32,
        /// The step active when it was launched.
        step: Option<u64>,
    },
    /// A device's graph memory pool (`cuDeviceGetGraphMemAttribute`), read at a step's end once a
    /// capture has begun.
    GraphMemory {
        /// The device.
        device: usize,
        /// Bytes the graph memory pool holds from the device.
        reserved: u64,
        /// Bytes associated with graphs.
        used: u64,
    },
    /// An early warning fired.
    Warning {
        /// The rule's name.
        rule: &'static str,
        /// Its message.
        message: String,
    },
}

/// A segment live at the end of the history, and the blocks inside it. In an address range a
/// pool reserved, a segment is a stretch of contiguous mapped pages (the whole mapped range
/// unless pages were unmapped between mapped ones), as PyTorch reports an expandable segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveSegment {
    /// The pool that holds it.
    pub pool: PoolId,
    /// Its address.
    pub ptr: CUdeviceptr,
    /// Its size: for a range's segment, its mapped bytes.
    pub bytes: u64,
    /// The address range it lies in, for mapped pages; `None` for memory taken from a CUDA pool.
    pub range: Option<CUdeviceptr>,
}

/// Live segments by device and address.
pub(crate) type Segments = BTreeMap<(usize, CUdeviceptr), LiveSegment>;

/// Adds `segment` to `segments`; mapped pages join the segment of their range they touch.
pub(crate) fn add_segment(segments: &mut Segments, mut segment: LiveSegment) {
    let device = segment.pool.device;
    if segment.range.is_some() {
        let left = segments.range(..(device, segment.ptr)).next_back().map(|(&key, left)| (key, left));
        if let Some((key, left)) = left
            && key.0 == device
            && left.range == segment.range
            && left.ptr + left.bytes == segment.ptr
        {
            segment.ptr = left.ptr;
            segment.bytes += left.bytes;
            segments.remove(&key);
        }
        let end = (device, segment.ptr + segment.bytes);
        if segments.get(&end).is_some_and(|right| right.range == segment.range) {
            segment.bytes += segments.remove(&end).map_or(0, |right| right.bytes);
        }
    }
    segments.insert((device, segment.ptr), segment);
}

/// Takes `[ptr, ptr + bytes)` on `device` out of `segments`: a whole segment, or unmapped pages
/// of a range's segment, which keeps the pages on either side.
pub(crate) fn remove_segment(segments: &mut Segments, device: usize, ptr: CUdeviceptr, bytes: u64) {
    let Some((&key, _)) = segments
        .range(..=(device, ptr))
        .next_back()
        .filter(|&(&(d, _), segment)| d == device && ptr < segment.ptr + segment.bytes)
    else {
        return;
    };
    let Some(segment) = segments.remove(&key) else { return };
    let (end, segment_end) = (ptr + bytes, segment.ptr + segment.bytes);
    if segment.ptr < ptr {
        segments.insert(key, LiveSegment { bytes: ptr - segment.ptr, ..segment.clone() });
    }
    if end < segment_end {
        segments.insert((device, end), LiveSegment { ptr: end, bytes: segment_end - end, ..segment });
    }
}

/// A live allocation at the end of the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    /// Its pool.
    pub pool: PoolId,
    /// Its address.
    pub ptr: CUdeviceptr,
    /// Bytes requested.
    pub bytes: u64,
    /// The step it was allocated in.
    pub step: Option<u64>,
}

/// The recorded history: the retained events (the most recent ones when the bound was hit) and
/// what was live when it was taken.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    /// Events, oldest first.
    pub events: Vec<Event>,
    /// Events dropped because the bound was reached (the oldest ones).
    pub dropped: u64,
    /// Segments live now, by device and address.
    pub segments: Vec<LiveSegment>,
    /// Allocations live now, by device and address.
    pub blocks: Vec<LiveBlock>,
    /// The runtime's phases, by index: name and scope.
    pub phases: Vec<(String, Scope)>,
    /// The driver, in words.
    pub driver: String,
    /// The devices the runtime opened: ordinal and total memory.
    pub devices: Vec<(usize, u64)>,
}

impl History {
    /// The name of `phase`.
    pub fn phase_name(&self, phase: Phase) -> &str {
        self.phases.get(phase.index()).map_or("unknown", |(name, _)| name.as_str())
    }

    /// Devices that appear in the history.
    pub fn devices_used(&self) -> Vec<usize> {
        let mut devices: Vec<usize> = self
            .events
            .iter()
            .filter_map(|event| event.kind.pool().map(|pool| pool.device))
            .chain(self.segments.iter().map(|segment| segment.pool.device))
            .collect();
        devices.sort_unstable();
        devices.dedup();
        devices
    }
}

impl EventKind {
    /// The pool the event is about, if any.
    pub fn pool(&self) -> Option<PoolId> {
        match *self {
            Self::Alloc { pool, .. }
            | Self::Free { pool, .. }
            | Self::SegmentAlloc { pool, .. }
            | Self::SegmentFree { pool, .. }
            | Self::SegmentMap { pool, .. }
            | Self::SegmentUnmap { pool, .. }
            | Self::Reserved { pool, .. }
            | Self::Oom { pool, .. } => Some(pool),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
struct RecorderState {
    capacity: usize,
    started: u64,
    events: VecDeque<Event>,
    dropped: u64,
    segments: Segments,
    blocks: BTreeMap<(usize, CUdeviceptr), LiveBlock>,
}

/// Records events while on. Off, a record call costs one relaxed load.
#[derive(Debug)]
pub(crate) struct Recorder {
    on: AtomicBool,
    /// The active step, [`NO_STEP`] between steps; kept by the boundaries for the events.
    step: AtomicU64,
    state: Mutex<RecorderState>,
}

const NO_STEP: u64 = u64::MAX;

impl Default for Recorder {
    fn default() -> Self {
        Self { on: AtomicBool::new(false), step: AtomicU64::new(NO_STEP), state: Mutex::default() }
    }
}

thread_local! {
    static THREAD: u64 = {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    };
}

/// A small number naming the calling thread, stable for its life.
pub(crate) fn thread_number() -> u64 {
    THREAD.with(|id| *id)
}

impl Recorder {
    fn lock(&self) -> MutexGuard<'_, RecorderState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether recording is on.
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Notes the active step (`None` between steps).
    pub(crate) fn set_step(&self, step: Option<u64>) {
        self.step.store(step.unwrap_or(NO_STEP), Ordering::Relaxed);
    }

    /// The active step, as the boundaries last said.
    pub(crate) fn step(&self) -> Option<u64> {
        let step = self.step.load(Ordering::Relaxed);
        (step != NO_STEP).then_some(step)
    }

    /// Starts recording afresh, keeping at most `capacity` events (the most recent).
    pub(crate) fn start(&self, capacity: usize) {
        let mut state = self.lock();
        *state = RecorderState { capacity: capacity.max(1), started: super::clock().raw(), ..Default::default() };
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops recording; what was recorded stays until the next start.
    pub(crate) fn stop(&self) {
        self.on.store(false, Ordering::Relaxed);
    }

    /// Records `kind` now, if recording is on.
    pub(crate) fn record(&self, kind: EventKind) {
        if !self.is_on() {
            return;
        }
        let mut state = self.lock();
        let now = super::clock().raw();
        let t_ns = super::clock().delta_as_nanos(state.started, now);
        match &kind {
            EventKind::Alloc { pool, ptr, bytes, step, .. } => {
                state
                    .blocks
                    .insert((pool.device, *ptr), LiveBlock { pool: *pool, ptr: *ptr, bytes: *bytes, step: *step });
            }
            EventKind::Free { pool, ptr, .. } => {
                state.blocks.remove(&(pool.device, *ptr));
            }
            EventKind::SegmentAlloc { pool, ptr, bytes, .. } => {
                let segment = LiveSegment { pool: *pool, ptr: *ptr, bytes: *bytes, range: None };
                add_segment(&mut state.segments, segment);
            }
            EventKind::SegmentMap { pool, range, ptr, bytes, .. } => {
                let segment = LiveSegment { pool: *pool, ptr: *ptr, bytes: *bytes, range: Some(*range) };
                add_segment(&mut state.segments, segment);
            }
            EventKind::SegmentFree { pool, ptr, bytes, .. } | EventKind::SegmentUnmap { pool, ptr, bytes, .. } => {
                remove_segment(&mut state.segments, pool.device, *ptr, *bytes);
            }
            _ => {}
        }
        // Timestamps never go back, even where the clock's source differs between cores.
        let t_ns = state.events.back().map_or(t_ns, |last| t_ns.max(last.t_ns));
        if state.events.len() == state.capacity {
            state.events.pop_front();
            state.dropped += 1;
        }
        state.events.push_back(Event { t_ns, kind });
    }

    /// Records as released by a boundary every allocation of `pool` still live in the history
    /// but those at `kept` (carried into the next step): a strategy that reclaims what its scope
    /// handed out (an arena) releases them all.
    pub(crate) fn release_pool(&self, pool: PoolId, kept: &[CUdeviceptr]) {
        if !self.is_on() {
            return;
        }
        let kept: std::collections::HashSet<CUdeviceptr> = kept.iter().copied().collect();
        let live: Vec<LiveBlock> = self
            .lock()
            .blocks
            .values()
            .filter(|block| block.pool == pool && !kept.contains(&block.ptr))
            .cloned()
            .collect();
        let (step, thread) = (self.step(), thread_number());
        for block in live {
            self.record(EventKind::Free { pool, ptr: block.ptr, bytes: block.bytes, step, thread, release: true });
        }
    }

    /// A copy of what was recorded; the caller fills in the runtime's description.
    pub(crate) fn history(&self) -> History {
        let state = self.lock();
        History {
            events: state.events.iter().cloned().collect(),
            dropped: state.dropped,
            segments: state.segments.values().cloned().collect(),
            blocks: state.blocks.values().cloned().collect(),
            ..History::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LiveSegment, Segments, add_segment, remove_segment};
    use crate::Phase;
    use crate::report::PoolId;

    #[test]
    fn mapped_pages_join_their_ranges_segment_and_unmapped_ones_split_it() {
        let pool = PoolId { device: 0, stream: 1, phase: Phase::ACTIVATIONS };
        let page = |range, ptr, bytes| LiveSegment { pool, ptr, bytes, range: Some(range) };
        let spans = |segments: &Segments| segments.values().map(|s| (s.ptr, s.bytes, s.range)).collect::<Vec<_>>();
        let mut segments = Segments::new();
        // A pool allocation ending where a range begins stays a segment of its own.
        add_segment(&mut segments, LiveSegment { pool, ptr: 0, bytes: 100, range: None });
        add_segment(&mut segments, page(100, 100, 20));
        add_segment(&mut segments, page(100, 140, 20));
        assert_eq!(spans(&segments), [(0, 100, None), (100, 20, Some(100)), (140, 20, Some(100))]);
        // The hole filled: one segment of the mapped bytes. Another range's pages beside it do
        // not join it.
        add_segment(&mut segments, page(100, 120, 20));
        add_segment(&mut segments, page(160, 160, 20));
        assert_eq!(spans(&segments), [(0, 100, None), (100, 60, Some(100)), (160, 20, Some(160))]);
        // A page unmapped in the middle leaves the pages on either side.
        remove_segment(&mut segments, 0, 120, 20);
        assert_eq!(
            spans(&segments),
            [(0, 100, None), (100, 20, Some(100)), (140, 20, Some(100)), (160, 20, Some(160))]
        );
        remove_segment(&mut segments, 0, 140, 20);
        remove_segment(&mut segments, 0, 0, 100);
        remove_segment(&mut segments, 1, 100, 20); // another device's: nothing there
        assert_eq!(spans(&segments), [(100, 20, Some(100)), (160, 20, Some(160))]);
    }
}
