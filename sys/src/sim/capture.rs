//! Stream capture and graphs on the simulated device: capture sequences, the graphs they produce,
//! executable graphs and their launches, graph allocations and the per-device graph memory pool.
//! See the [module docs](super::super) ("Stream capture and graphs") for the model.
//!
//! **Confirmed in part.** The rules here come from `cuda.h` 12.9 and the CUDA programming guide;
//! where they leave a return code or an accounting detail open, the choice made is written beside
//! it. The capture conformance tests (`tests/capture.rs`) ran on an H200 (driver 580.159.04,
//! 2026-11-27, `benches/results/2026-11-27-h200-calibration.md`): the model was changed where the
//! driver answered otherwise, and the rules the tests exercise are the driver's. Those they do
//! not exercise stay marked *(unconfirmed)*.
//!
//! This is a child module of `state` so that the hooks in `State`'s entry points can stay one line
//! each; everything it keeps lives in [`Captures`], one field of `State`.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::thread::ThreadId;

use super::*;

pub(crate) const CAPTURE_UNSUPPORTED: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
pub(crate) const CAPTURE_INVALIDATED: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
const CAPTURE_MERGE: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE;
const CAPTURE_UNMATCHED: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
const CAPTURE_UNJOINED: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
const CAPTURE_ISOLATION: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
const CAPTURE_IMPLICIT: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
const CAPTURED_EVENT: CUresult = CUresult::CUDA_ERROR_CAPTURED_EVENT;
const CAPTURE_WRONG_THREAD: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
const ILLEGAL_STATE: CUresult = CUresult::CUDA_ERROR_ILLEGAL_STATE;

const AUTO_FREE_ON_LAUNCH: u64 = CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64;
/// The instantiation flags the driver defines; the model acts on auto-free only.
const KNOWN_FLAGS: u64 = 0b1111;

thread_local! {
    /// Each thread's capture mode (`cuThreadExchangeStreamCaptureMode`), per simulated driver.
    static THREAD_MODES: RefCell<Vec<(u64, CUstreamCaptureMode)>> = const { RefCell::new(Vec::new()) };
}

fn thread_mode(sim: u64) -> CUstreamCaptureMode {
    THREAD_MODES.with_borrow(|modes| {
        modes.iter().find(|(id, _)| *id == sim).map_or(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL, |m| m.1)
    })
}

fn valid_mode(mode: CUstreamCaptureMode) -> bool {
    mode.0 <= CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED.0
}

/// One node of a captured graph, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Node {
    /// A graph allocation at this address.
    Alloc(u64),
    /// The free of a graph allocation (of this graph or another).
    Free(u64),
    /// Any other work (kernel, memset, copy, event wait): ordered, not replayed.
    Work,
}

/// A stream that takes part in a capture sequence.
#[derive(Clone, Copy, Debug, Default)]
struct Member {
    /// Nodes captured on it so far.
    nodes: u64,
    /// The origin stream has waited on an event recorded on it after this many of its nodes.
    joined_up_to: u64,
}

/// A capture sequence, from `cuStreamBeginCapture` to `cuStreamEndCapture`.
#[derive(Debug)]
struct Capture {
    origin: StreamId,
    ctx: u32,
    mode: CUstreamCaptureMode,
    thread: ThreadId,
    /// The graph being captured into.
    graph: u32,
    invalidated: bool,
    /// Every stream in the sequence, the origin included.
    members: BTreeMap<StreamId, Member>,
    /// Allocations captured in it and not freed in it yet.
    open: BTreeSet<u64>,
}

#[derive(Debug)]
struct Graph {
    device: usize,
    nodes: Vec<Node>,
    /// Still being captured into.
    capturing: bool,
    /// Destroyed by the caller; kept while an executable graph made from it lives.
    destroyed: bool,
    /// Its executable graph: at most one while it has memory nodes.
    exec: Option<u32>,
    /// Bytes its launch maps: the peak of its live allocations in node order, rounded up to the
    /// granule.
    footprint: u64,
}

impl Graph {
    fn has_memory_nodes(&self) -> bool {
        self.nodes.iter().any(|n| !matches!(n, Node::Work))
    }

    fn own_allocations(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().filter_map(|n| if let Node::Alloc(a) = n { Some(*a) } else { None })
    }
}

#[derive(Debug)]
struct Exec {
    graph: u32,
    auto_free: bool,
    /// Bytes of graph memory mapped for it since its first launch (0 before).
    mapped: u64,
}

/// A graph allocation: its address is fixed when captured and stays valid while its graph lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GraphAllocation {
    device: usize,
    /// Bytes, rounded up to 512.
    pub(crate) size: u64,
    /// Address space it holds, rounded up to the granule.
    span: u64,
    graph: u32,
    /// Allocated by a launch and not freed since.
    pub(crate) live: bool,
}

/// A device's graph memory pool, observed with `cuDeviceGetGraphMemAttribute`.
#[derive(Clone, Copy, Debug, Default)]
struct GraphPool {
    used: u64,
    used_high: u64,
    reserved: u64,
    reserved_high: u64,
}

/// Everything the simulated driver knows about capture and graphs.
#[derive(Debug, Default)]
pub(crate) struct Captures {
    sequences: BTreeMap<u64, Capture>,
    next_sequence: u64,
    /// Which capture sequence each capturing stream belongs to.
    streams: BTreeMap<StreamId, u64>,
    /// Events last recorded inside a capture: (sequence, stream, nodes on it at the record).
    events: BTreeMap<u32, (u64, StreamId, u64)>,
    graphs: BTreeMap<u32, Graph>,
    execs: BTreeMap<u32, Exec>,
    pub(crate) allocations: BTreeMap<u64, GraphAllocation>,
    pools: BTreeMap<usize, GraphPool>,
}

impl State {
    // ----- hooks called by the entry points of state.rs -------------------------------------------

    /// Whether a stream-ordered operation on `stream` is captured: the sequence it belongs to, or
    /// `None` to run it. On the legacy stream while a blocking stream of its context captures,
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and those captures are invalidated; on a stream
    /// whose capture was invalidated, `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
    pub(super) fn capture_gate(&mut self, stream: StreamId) -> R<Option<u64>> {
        if self.capture.sequences.is_empty() {
            return Ok(None);
        }
        if self.streams[&stream].kind == StreamKind::Legacy {
            let blocked = self.blocking_captures(stream);
            if !blocked.is_empty() {
                for sequence in blocked {
                    self.invalidate(sequence);
                }
                return Err(CAPTURE_IMPLICIT);
            }
            return Ok(None);
        }
        match self.capture.streams.get(&stream) {
            Some(&sequence) if self.capture.sequences[&sequence].invalidated => Err(CAPTURE_INVALIDATED),
            Some(&sequence) => Ok(Some(sequence)),
            None => Ok(None),
        }
    }

    /// Captures of blocking streams in the legacy stream `legacy`'s context.
    fn blocking_captures(&self, legacy: StreamId) -> Vec<u64> {
        let ctx = self.streams[&legacy].ctx;
        let mut found: Vec<u64> = self
            .capture
            .streams
            .iter()
            .filter(|(id, _)| self.streams.get(id).is_some_and(|s| s.ctx == ctx && s.blocking))
            .map(|(_, &sequence)| sequence)
            .collect();
        found.dedup();
        found
    }

    /// Records a node of `sequence` on `stream`.
    fn add_node(&mut self, sequence: u64, stream: StreamId, node: Node) {
        let capture = self.capture.sequences.get_mut(&sequence).expect("capture");
        capture.members.entry(stream).or_default().nodes += 1;
        let graph = capture.graph;
        self.capture.graphs.get_mut(&graph).expect("graph").nodes.push(node);
    }

    /// A captured call failed: the capture is invalidated and the call returns `code`.
    fn fail_capture<T>(&mut self, sequence: u64, code: CUresult) -> R<T> {
        self.invalidate(sequence);
        Err(code)
    }

    fn invalidate(&mut self, sequence: u64) {
        if let Some(capture) = self.capture.sequences.get_mut(&sequence) {
            capture.invalidated = true;
        }
    }

    /// A captured kernel, memset, copy or event wait: a node touching `[ptr, ptr + len)` (an
    /// empty range touches nothing), which must lie in live memory or in an allocation captured
    /// in this sequence and not freed in it.
    pub(super) fn capture_work(&mut self, sequence: u64, stream: StreamId, ranges: &[(u64, usize)]) -> R<()> {
        for &(ptr, len) in ranges {
            let open = self.capture.sequences[&sequence].open.iter().any(|&a| {
                let size = self.capture.allocations[&a].size;
                ptr >= a && ptr.saturating_add(len as u64) <= a + size
            });
            if !open && self.live_range(ptr, len).is_none() {
                return self.fail_capture(sequence, INVALID_VALUE);
            }
        }
        self.add_node(sequence, stream, Node::Work);
        Ok(())
    }

    /// `cuMemAllocAsync`/`cuMemAllocFromPoolAsync` under capture: an allocation node. Its
    /// address is reserved now and fixed for the life of the graph; no memory is taken until a
    /// launch. The pool only parameterises the node.
    pub(super) fn capture_alloc(&mut self, sequence: u64, stream: StreamId, bytes: u64) -> R<CUdeviceptr> {
        if bytes == 0 {
            return self.fail_capture(sequence, INVALID_VALUE);
        }
        let Some(size) = bytes.checked_next_multiple_of(ALIGNMENT) else {
            return self.fail_capture(sequence, OUT_OF_MEMORY);
        };
        let Some(span) = size.checked_next_multiple_of(self.config.granule) else {
            return self.fail_capture(sequence, OUT_OF_MEMORY);
        };
        let device = self.streams[&stream].device;
        let Some(addr) = self.devices[device].space.reserve(span) else {
            return self.fail_capture(sequence, OUT_OF_MEMORY);
        };
        let graph = self.capture.sequences[&sequence].graph;
        self.capture.allocations.insert(addr, GraphAllocation { device, size, span, graph, live: false });
        self.capture.sequences.get_mut(&sequence).expect("capture").open.insert(addr);
        self.add_node(sequence, stream, Node::Alloc(addr));
        Ok(addr)
    }

    /// `cuMemFreeAsync` under capture: a free node, which must be given a graph allocation
    /// (captured in this sequence and not freed in it, or live from another graph); anything else
    /// is `CUDA_ERROR_INVALID_VALUE` and invalidates the capture.
    pub(super) fn capture_free(&mut self, sequence: u64, stream: StreamId, ptr: CUdeviceptr) -> R<()> {
        let capture = self.capture.sequences.get_mut(&sequence).expect("capture");
        let ours = capture.open.remove(&ptr);
        let foreign = !ours && self.capture.allocations.get(&ptr).is_some_and(|a| a.live && a.graph != capture.graph);
        if !ours && !foreign {
            // Memory allocated outside the capture: refused, and the capture goes on (measured on
            // an H200, driver 580.159.04, in every mode).
            return Err(INVALID_VALUE);
        }
        self.add_node(sequence, stream, Node::Free(ptr));
        Ok(())
    }

    /// `cuEventRecord` on a capturing stream marks the event as recorded in the capture; a
    /// record outside capture clears the mark.
    pub(super) fn capture_event_record(&mut self, event: u32, stream: StreamId, sequence: Option<u64>) {
        match sequence {
            Some(sequence) => {
                let nodes = self.capture.sequences[&sequence].members.get(&stream).map_or(0, |m| m.nodes);
                self.capture.events.insert(event, (sequence, stream, nodes));
            }
            None => {
                self.capture.events.remove(&event);
            }
        }
    }

    /// `cuStreamWaitEvent` where capture is involved; `Ok(true)` when it was handled here.
    ///
    /// - A stream outside capture waiting on an event recorded in an active capture joins that
    ///   capture (a fork).
    /// - A capturing stream waiting on an event of its own capture: a join; the origin waiting
    ///   on an event recorded on a member after its last node joins that member back.
    /// - A capturing stream waiting on an event of another capture: `..._MERGE`; on an event
    ///   recorded outside capture without `CU_EVENT_WAIT_EXTERNAL`: `..._ISOLATION`. Both
    ///   invalidate the capture *(unconfirmed)*.
    pub(super) fn capture_wait(&mut self, stream: StreamId, event: u32, flags: u32) -> R<bool> {
        let mark = self.capture.events.get(&event).copied().filter(|(s, ..)| self.capture.sequences.contains_key(s));
        let sequence = self.capture_gate(stream)?;
        let external = flags == CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL.0;
        match (sequence, mark) {
            (None, None) => Ok(false),
            (None, Some((theirs, ..))) => {
                if external || flags != 0 {
                    return Err(INVALID_VALUE);
                }
                if self.capture.sequences[&theirs].invalidated {
                    return Err(CAPTURE_INVALIDATED);
                }
                self.capture_may_change();
                self.capture.streams.insert(stream, theirs);
                self.capture.sequences.get_mut(&theirs).expect("capture").members.entry(stream).or_default();
                Ok(true)
            }
            (Some(ours), None) => {
                if external {
                    self.add_node(ours, stream, Node::Work);
                    Ok(true)
                } else {
                    self.fail_capture(ours, CAPTURE_ISOLATION)
                }
            }
            (Some(ours), Some((theirs, recorded_on, nodes))) => {
                if ours != theirs {
                    self.invalidate(theirs);
                    return self.fail_capture(ours, CAPTURE_MERGE);
                }
                if flags != 0 {
                    return self.fail_capture(ours, INVALID_VALUE);
                }
                let capture = self.capture.sequences.get_mut(&ours).expect("capture");
                if stream == capture.origin
                    && let Some(member) = capture.members.get_mut(&recorded_on)
                {
                    member.joined_up_to = member.joined_up_to.max(nodes);
                }
                Ok(true)
            }
        }
    }

    /// A synchronization or query of `stream`: on a capturing stream it is
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture; on the legacy stream
    /// while a blocking stream captures, `..._IMPLICIT`, invalidating those captures.
    pub(super) fn capture_forbids_wait(&mut self, stream: StreamId) -> R<()> {
        match self.capture_gate(stream) {
            Ok(Some(sequence)) => self.fail_capture(sequence, CAPTURE_UNSUPPORTED),
            Err(code) if code == CAPTURE_INVALIDATED => Err(CAPTURE_UNSUPPORTED),
            other => other.map(drop),
        }
    }

    /// `cuCtxSynchronize` while streams of the context capture: `..._UNSUPPORTED`, and every
    /// capture in the context is invalidated *(unconfirmed: the rule `cuCtxRecordEvent`
    /// documents)*.
    pub(super) fn capture_forbids_context_wait(&mut self, ctx: u32) -> R<()> {
        let doomed: Vec<u64> =
            self.capture.sequences.iter().filter(|(_, c)| c.ctx == ctx).map(|(&sequence, _)| sequence).collect();
        if doomed.is_empty() {
            return Ok(());
        }
        for sequence in doomed {
            self.invalidate(sequence);
        }
        Err(CAPTURE_UNSUPPORTED)
    }

    /// `cuEventQuery`/`cuEventSynchronize` of an event last recorded in a capture that has not
    /// ended: `CUDA_ERROR_CAPTURED_EVENT`, and the capture is invalidated (`cuEventQuery`,
    /// measured on an H200 in every mode; after the capture ends the model answers as for an
    /// event never recorded, *unconfirmed*).
    pub(super) fn capture_forbids_event(&mut self, event: u32) -> R<()> {
        match self.capture.events.get(&event) {
            Some(&(sequence, ..)) if self.capture.sequences.contains_key(&sequence) => {
                self.invalidate(sequence);
                Err(CAPTURED_EVENT)
            }
            _ => Ok(()),
        }
    }

    /// A potentially unsafe call (`cuMemAlloc`, `cuMemFree`, `cuMemPoolTrimTo`, `cuMemPoolCreate`,
    /// `cuMemPoolGetAttribute`, `cuMemPoolSetAttribute` in this model) from the calling thread,
    /// under the rules of `cuThreadExchangeStreamCaptureMode`: refused with `..._UNSUPPORTED` when
    /// prohibited, invalidating the captures that prohibit it. Measured on an H200 (driver
    /// 580.159.04) for `cuMemAlloc`, `cuMemPoolTrimTo`, `cuMemPoolCreate` and
    /// `cuMemPoolGetAttribute`: refused and invalidating in global and thread-local mode, allowed
    /// in relaxed mode (`cuMemFree` and `cuMemPoolSetAttribute` *unconfirmed*).
    pub(super) fn capture_forbids_unsafe_call(&mut self) -> R<()> {
        if self.capture.sequences.is_empty() {
            return Ok(());
        }
        let me = std::thread::current().id();
        let relaxed = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let global = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        let mode = thread_mode(self.id);
        let prohibiting: Vec<u64> = self
            .capture
            .sequences
            .iter()
            .filter(|(_, c)| match mode {
                m if m == relaxed => false,
                m if m == global => (c.thread == me && c.mode != relaxed) || (c.thread != me && c.mode == global),
                _ => c.thread == me && c.mode != relaxed,
            })
            .map(|(&sequence, _)| sequence)
            .collect();
        if prohibiting.is_empty() {
            return Ok(());
        }
        for sequence in prohibiting {
            self.invalidate(sequence);
        }
        Err(CAPTURE_UNSUPPORTED)
    }

    /// The live graph allocation holding `[ptr, ptr + len)`, if any.
    pub(super) fn graph_range(&self, ptr: u64, len: usize) -> Option<u64> {
        let (&start, allocation) = self.capture.allocations.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len as u64)?;
        (allocation.live && end <= start + allocation.size).then_some(start)
    }

    /// `cuMemFreeAsync`/`cuMemFree` outside capture of a graph allocation: allowed once, for an
    /// allocation a launch left live. `None` when `ptr` is no graph allocation.
    pub(super) fn graph_free(&mut self, ptr: u64) -> Option<R<()>> {
        let allocation = *self.capture.allocations.get(&ptr)?;
        if !allocation.live {
            return Some(Err(INVALID_VALUE));
        }
        self.capture.allocations.get_mut(&ptr).expect("allocation").live = false;
        if self.is_orphan(&allocation) {
            self.graph_unmap(allocation.device, allocation.span);
        }
        self.forget_allocations_of(allocation.graph);
        Some(Ok(()))
    }

    // ----- accounting ----------------------------------------------------------------------------

    /// Whether a graph allocation's memory is its own (its graph has no executable graph that
    /// maps it).
    fn is_orphan(&self, allocation: &GraphAllocation) -> bool {
        self.capture.graphs.get(&allocation.graph).is_none_or(|g| g.exec.is_none())
    }

    /// Maps `bytes` more graph memory on `device`, growing its graph pool (taken from the device's
    /// capacity) if needed; `CUDA_ERROR_OUT_OF_MEMORY` leaves everything as it was.
    fn graph_map(&mut self, device: usize, bytes: u64) -> R<()> {
        let pool = self.capture.pools.get(&device).copied().unwrap_or_default();
        let used = pool.used + bytes;
        if used > pool.reserved {
            let grow = (used - pool.reserved).checked_next_multiple_of(self.config.granule).ok_or(OUT_OF_MEMORY)?;
            if self.devices[device].reserved + grow > self.devices[device].capacity {
                self.release_idle_on_device(device);
                if self.devices[device].reserved + grow > self.devices[device].capacity {
                    return Err(OUT_OF_MEMORY);
                }
            }
            self.devices[device].reserved += grow;
            let pool = self.capture.pools.entry(device).or_default();
            pool.reserved += grow;
            pool.reserved_high = pool.reserved_high.max(pool.reserved);
        }
        let pool = self.capture.pools.entry(device).or_default();
        pool.used = used;
        pool.used_high = pool.used_high.max(used);
        Ok(())
    }

    fn graph_unmap(&mut self, device: usize, bytes: u64) {
        let pool = self.capture.pools.entry(device).or_default();
        pool.used -= bytes;
    }

    /// Releases the address space of a destroyed graph's allocations that nothing holds, and the
    /// graph itself once no executable graph and no live allocation needs it.
    fn forget_allocations_of(&mut self, graph: u32) {
        let Some(g) = self.capture.graphs.get(&graph) else { return };
        if !g.destroyed || g.exec.is_some() {
            return;
        }
        let own: Vec<u64> = g.own_allocations().collect();
        let mut live = false;
        for addr in own {
            match self.capture.allocations.get(&addr).copied() {
                Some(a) if a.live => live = true,
                Some(a) => {
                    self.capture.allocations.remove(&addr);
                    self.devices[a.device].space.release(addr, a.span);
                }
                None => {}
            }
        }
        if !live {
            self.capture.graphs.remove(&graph);
        }
    }

    // ----- entry points --------------------------------------------------------------------------

    /// `cuStreamBeginCapture_v2`. The legacy stream cannot be captured, nor a stream already in a
    /// capture: both `..._UNSUPPORTED` *(unconfirmed codes)*.
    pub(crate) fn stream_begin_capture(&mut self, raw: CUstream, mode: CUstreamCaptureMode) -> R<()> {
        let id = self.stream(raw)?;
        if !valid_mode(mode) {
            return Err(INVALID_VALUE);
        }
        if self.streams[&id].kind == StreamKind::Legacy || self.capture.streams.contains_key(&id) {
            return Err(CAPTURE_UNSUPPORTED);
        }
        self.capture_may_change();
        let (ctx, device) = (self.streams[&id].ctx, self.streams[&id].device);
        let graph = self.next();
        self.capture.graphs.insert(
            graph,
            Graph { device, nodes: Vec::new(), capturing: true, destroyed: false, exec: None, footprint: 0 },
        );
        self.capture.next_sequence += 1;
        let sequence = self.capture.next_sequence;
        let members = BTreeMap::from([(id, Member::default())]);
        let thread = std::thread::current().id();
        let capture =
            Capture { origin: id, ctx, mode, thread, graph, invalidated: false, members, open: BTreeSet::new() };
        self.capture.sequences.insert(sequence, capture);
        self.capture.streams.insert(id, sequence);
        Ok(())
    }

    /// `cuStreamEndCapture`: the graph, or `Err` with the graph already dropped. Ends the capture
    /// whatever it returns, except `..._UNMATCHED` (not the origin stream), `..._WRONG_THREAD`
    /// (a non-relaxed capture ended from another thread; the capture goes on, *unconfirmed*) and
    /// `CUDA_ERROR_ILLEGAL_STATE` (the stream is not capturing, *unconfirmed*). An invalidated
    /// capture returns `..._INVALIDATED`; one with a forked stream not joined back,
    /// `..._UNJOINED`.
    pub(crate) fn stream_end_capture(&mut self, raw: CUstream) -> R<CUgraph> {
        let id = self.stream(raw)?;
        let Some(&sequence) = self.capture.streams.get(&id) else { return Err(ILLEGAL_STATE) };
        let capture = &self.capture.sequences[&sequence];
        if capture.origin != id {
            return Err(CAPTURE_UNMATCHED);
        }
        if capture.mode != CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED
            && capture.thread != std::thread::current().id()
        {
            return Err(CAPTURE_WRONG_THREAD);
        }
        let capture = self.capture.sequences.remove(&sequence).expect("capture");
        self.capture.streams.retain(|_, s| *s != sequence);
        let unjoined = capture.members.iter().any(|(&s, m)| s != capture.origin && m.nodes > m.joined_up_to);
        let outcome = if capture.invalidated {
            Err(CAPTURE_INVALIDATED)
        } else if unjoined {
            Err(CAPTURE_UNJOINED)
        } else {
            Ok(())
        };
        let graph = self.capture.graphs.get_mut(&capture.graph).expect("graph");
        graph.capturing = false;
        match outcome {
            Ok(()) => {
                let mut live = BTreeMap::new();
                let (mut now, mut peak) = (0u64, 0u64);
                for node in &graph.nodes {
                    match *node {
                        Node::Alloc(a) => {
                            let span = self.capture.allocations[&a].span;
                            live.insert(a, span);
                            now += span;
                            peak = peak.max(now);
                        }
                        Node::Free(a) => now -= live.remove(&a).unwrap_or(0),
                        Node::Work => {}
                    }
                }
                graph.footprint = peak;
                Ok(self.handle(Kind::Graph, capture.graph) as CUgraph)
            }
            Err(code) => {
                graph.destroyed = true;
                self.forget_allocations_of(capture.graph);
                Err(code)
            }
        }
    }

    /// `cuStreamIsCapturing`; on the legacy stream while a blocking stream captures,
    /// `..._IMPLICIT` without invalidating anything, as `cuda.h` says.
    pub(crate) fn stream_is_capturing(&mut self, raw: CUstream) -> R<CUstreamCaptureStatus> {
        self.stream_get_capture_info(raw).map(|(status, ..)| status)
    }

    /// `cuStreamGetCaptureInfo_v2`: status, the sequence's unique id and the graph being
    /// captured into (id 0 and no graph outside capture).
    pub(crate) fn stream_get_capture_info(&mut self, raw: CUstream) -> R<(CUstreamCaptureStatus, u64, CUgraph)> {
        use CUstreamCaptureStatus as S;
        let id = self.stream(raw)?;
        if self.streams[&id].kind == StreamKind::Legacy && !self.blocking_captures(id).is_empty() {
            return Err(CAPTURE_IMPLICIT);
        }
        Ok(match self.capture.streams.get(&id) {
            None => (S::CU_STREAM_CAPTURE_STATUS_NONE, 0, std::ptr::null_mut()),
            Some(&sequence) => {
                let capture = &self.capture.sequences[&sequence];
                let status = if capture.invalidated {
                    S::CU_STREAM_CAPTURE_STATUS_INVALIDATED
                } else {
                    S::CU_STREAM_CAPTURE_STATUS_ACTIVE
                };
                (status, sequence, self.handle(Kind::Graph, capture.graph) as CUgraph)
            }
        })
    }

    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's mode, returns the old one.
    pub(crate) fn thread_exchange_capture_mode(&mut self, mode: CUstreamCaptureMode) -> R<CUstreamCaptureMode> {
        self.require_init()?;
        if !valid_mode(mode) {
            return Err(INVALID_VALUE);
        }
        let sim = self.id;
        Ok(THREAD_MODES.with_borrow_mut(|modes| match modes.iter_mut().find(|(id, _)| *id == sim) {
            Some((_, old)) => std::mem::replace(old, mode),
            None => {
                modes.push((sim, mode));
                CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL
            }
        }))
    }

    fn graph(&self, raw: CUgraph) -> R<u32> {
        self.require_init()?;
        decode(self.tag, Kind::Graph, raw as usize)
            .filter(|id| self.capture.graphs.get(id).is_some_and(|g| !g.destroyed && !g.capturing))
            .ok_or(INVALID_VALUE)
    }

    fn exec(&self, raw: CUgraphExec) -> R<u32> {
        self.require_init()?;
        decode(self.tag, Kind::GraphExec, raw as usize)
            .filter(|id| self.capture.execs.contains_key(id))
            .ok_or(INVALID_VALUE)
    }

    /// `cuGraphInstantiateWithFlags`. A graph with memory nodes has at most one executable graph
    /// at a time: a second is `CUDA_ERROR_INVALID_VALUE`.
    pub(crate) fn graph_instantiate(&mut self, raw: CUgraph, flags: u64) -> R<CUgraphExec> {
        let graph = self.graph(raw)?;
        if flags & !KNOWN_FLAGS != 0 {
            return Err(INVALID_VALUE);
        }
        let g = &self.capture.graphs[&graph];
        if g.has_memory_nodes() && g.exec.is_some() {
            return Err(INVALID_VALUE);
        }
        let exec = self.next();
        self.capture.execs.insert(exec, Exec { graph, auto_free: flags & AUTO_FREE_ON_LAUNCH != 0, mapped: 0 });
        self.capture.graphs.get_mut(&graph).expect("graph").exec = Some(exec);
        Ok(self.handle(Kind::GraphExec, exec) as CUgraphExec)
    }

    /// `cuGraphLaunch`: runs the graph's memory nodes in order, in zero time. The first launch
    /// maps the graph's footprint from the graph pool (`CUDA_ERROR_OUT_OF_MEMORY` when the device
    /// cannot hold it). A launch while an allocation of an earlier launch is still live fails with
    /// `CUDA_ERROR_INVALID_VALUE` unless the graph was instantiated with auto-free-on-launch, which
    /// frees it first. Kernels, memsets and copies are ordered, not replayed. Launching a graph
    /// with memory nodes into a capturing stream is `..._UNSUPPORTED` and invalidates that capture
    /// *(unconfirmed)*.
    pub(crate) fn graph_launch(&mut self, raw: CUgraphExec, stream: CUstream) -> R<()> {
        let exec = self.exec(raw)?;
        let id = self.stream(stream)?;
        let graph = self.capture.execs[&exec].graph;
        if let Some(sequence) = self.capture_gate(id)? {
            if self.capture.graphs[&graph].has_memory_nodes() {
                return self.fail_capture(sequence, CAPTURE_UNSUPPORTED);
            }
            self.add_node(sequence, id, Node::Work);
            return Ok(());
        }
        let g = &self.capture.graphs[&graph];
        let own: Vec<u64> = g.own_allocations().collect();
        let auto_free = self.capture.execs[&exec].auto_free;
        if !auto_free && own.iter().any(|a| self.capture.allocations[a].live) {
            return Err(INVALID_VALUE);
        }
        let foreign_dead = g.nodes.iter().any(|n| match n {
            Node::Free(a) => !own.contains(a) && !self.capture.allocations.get(a).is_some_and(|x| x.live),
            _ => false,
        });
        if foreign_dead {
            return Err(INVALID_VALUE);
        }
        if self.capture.execs[&exec].mapped == 0 && g.footprint > 0 {
            let (device, footprint) = (g.device, g.footprint);
            self.graph_map(device, footprint)?;
            self.capture.execs.get_mut(&exec).expect("exec").mapped = footprint;
        }
        let nodes = self.capture.graphs[&graph].nodes.clone();
        for a in &own {
            self.capture.allocations.get_mut(a).expect("allocation").live = false;
        }
        for node in nodes {
            match node {
                Node::Alloc(a) => self.capture.allocations.get_mut(&a).expect("allocation").live = true,
                Node::Free(a) if own.contains(&a) => {
                    self.capture.allocations.get_mut(&a).expect("allocation").live = false
                }
                Node::Free(a) => {
                    self.graph_free(a);
                }
                Node::Work => {}
            }
        }
        let clock = self.op_clock(id);
        self.commit(id, clock);
        Ok(())
    }

    /// `cuGraphExecDestroy`: its mapped memory goes back to the graph pool (still reserved until
    /// `cuDeviceGraphMemTrim`); allocations it left live stay live and mapped until freed.
    pub(crate) fn graph_exec_destroy(&mut self, raw: CUgraphExec) -> R<()> {
        let exec = self.exec(raw)?;
        let Exec { graph, mapped, .. } = self.capture.execs.remove(&exec).expect("exec");
        let g = self.capture.graphs.get_mut(&graph).expect("graph of an exec");
        g.exec = None;
        let device = g.device;
        let live: u64 = g
            .own_allocations()
            .filter_map(|a| self.capture.allocations.get(&a))
            .filter(|a| a.live)
            .map(|a| a.span)
            .sum();
        let pool = self.capture.pools.entry(device).or_default();
        pool.used = pool.used - mapped + live.min(mapped);
        self.forget_allocations_of(graph);
        Ok(())
    }

    /// `cuGraphDestroy`: the graph goes; an executable graph made from it lives on.
    pub(crate) fn graph_destroy(&mut self, raw: CUgraph) -> R<()> {
        let graph = self.graph(raw)?;
        self.capture.graphs.get_mut(&graph).expect("graph").destroyed = true;
        self.forget_allocations_of(graph);
        Ok(())
    }

    /// `cuDeviceGraphMemTrim`: the graph pool gives back to the device everything reserved beyond
    /// what is mapped (executable graphs that launched, live allocations). Allowed during a
    /// capture in every mode, which it leaves active (measured on an H200, driver 580.159.04).
    pub(crate) fn device_graph_mem_trim(&mut self, dev: CUdevice) -> R<()> {
        let device = self.device(dev)?;
        let granule = self.config.granule;
        let pool = self.capture.pools.entry(device).or_default();
        let keep = pool.used.next_multiple_of(granule);
        if pool.reserved > keep {
            let give = pool.reserved - keep;
            pool.reserved = keep;
            self.devices[device].reserved -= give;
        }
        Ok(())
    }

    /// `cuDeviceGetGraphMemAttribute`.
    pub(crate) fn device_get_graph_mem_attribute(&self, dev: CUdevice, attribute: CUgraphMem_attribute) -> R<u64> {
        use CUgraphMem_attribute as A;
        let device = self.device(dev)?;
        let pool = self.capture.pools.get(&device).copied().unwrap_or_default();
        Ok(match attribute {
            A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT => pool.used,
            A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH => pool.used_high,
            A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT => pool.reserved,
            A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH => pool.reserved_high,
            _ => return Err(INVALID_VALUE),
        })
    }

    /// `cuDeviceSetGraphMemAttribute`: only the two high-water marks, only to 0 (which resets
    /// them to the current value).
    pub(crate) fn device_set_graph_mem_attribute(
        &mut self,
        dev: CUdevice,
        attribute: CUgraphMem_attribute,
        value: u64,
    ) -> R<()> {
        use CUgraphMem_attribute as A;
        let device = self.device(dev)?;
        let pool = self.capture.pools.entry(device).or_default();
        match attribute {
            A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH if value == 0 => pool.used_high = pool.used,
            A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH if value == 0 => pool.reserved_high = pool.reserved,
            _ => return Err(INVALID_VALUE),
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "capture_tests.rs"]
mod tests;
