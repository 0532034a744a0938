//! PyTorch memory snapshot pickles (`torch.cuda.memory._dump_snapshot`): the reader of their
//! allocation traces, and the writer of the snapshots the runtime records, which
//! pytorch.org/memory_viz opens.
//!
//! A snapshot is a dict with `segments` (what the allocator holds, each tiled by its blocks),
//! `device_traces` (one list per device of trace entries, each a dict with `action`, `addr`,
//! `size`, `stream`, `time_us` (newer PyTorch; older ones have none), `frames` and, in newer
//! snapshots, `category`) and `allocator_settings`, as `torch/csrc/cuda/memory_snapshot.cpp` and
//! the `_snapshot` docstring in `torch/cuda/memory.py` lay them out. [`Action`] lists the entry
//! kinds.
//!
//! # Reading
//!
//! [`read()`] turns `device_traces` into a [`Trace`](crate::Trace):
//!
//! - `alloc`: an allocation; `free_requested`: the program freed it, which is the free replayed
//!   (a stream-ordered pool makes the memory reusable in stream order from there).
//!   `free_completed` (the caching allocator may reuse it) is replayed as the free only when no
//!   `free_requested` came first, as in traces recorded with `skip_actions=["free_requested"]`.
//! - `oom`: a failed allocation of `size`.
//! - the segment actions, `snapshot` and `annotate`: the caching allocator's own bookkeeping, not
//!   requests; skipped.
//! - `segments`, the allocator's state at the dump: a block still allocated there
//!   (`active_allocated`) that the trace never shows was allocated before the history was recorded
//!   (the model built, then `_record_memory_history` called), and is replayed as allocated at the
//!   trace's start, at its `requested_size`, as is the memory behind a free of an address the trace
//!   never allocated ([`Trace::hold_from_start`](crate::Trace::hold_from_start)): otherwise the
//!   replay would measure part of the memory.
//!
//! Devices are merged by `time_us` (their own order kept on ties); without times, device after
//! device. Times become nanoseconds (`time_us` × 1000). Before parsing, a pass over the opcodes
//! refuses pickles nested past 256 levels or with more than 4096 marks open, which would exhaust
//! the parser's stack or memory.
//!
//! # Writing
//!
//! [`write()`] writes a [`Snapshot`] as a protocol-3 pickle, with only the opcodes both
//! `pickle.load` and the viewer read.

mod pickle;
#[cfg(feature = "pytorch")]
mod scan;

use std::io::{self, Write};

use self::pickle::{Value, dict};

/// What a snapshot's trace entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A block was allocated.
    Alloc,
    /// The program freed a block (its memory is reusable in stream order from here).
    FreeRequested,
    /// The allocator may reuse the freed block.
    FreeCompleted,
    /// An allocation failed for lack of memory.
    Oom,
    /// The allocator took a segment from the driver.
    SegmentAlloc,
    /// The allocator gave a segment back.
    SegmentFree,
    /// An expandable segment grew.
    SegmentMap,
    /// An expandable segment shrank.
    SegmentUnmap,
    /// The snapshot was taken.
    Snapshot,
    /// A user annotation.
    Annotate,
}

impl Action {
    /// Every action.
    pub const ALL: [Action; 10] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::Oom,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Snapshot,
        Action::Annotate,
    ];

    /// The name PyTorch writes: `alloc`, `free_requested`, `segment_alloc`, ...
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::Oom => "oom",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Annotate => "annotate",
        }
    }

    /// The action PyTorch names `name`.
    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|action| action.name() == name)
    }

    /// Whether the entry is the allocator's own bookkeeping rather than a request.
    pub fn is_bookkeeping(self) -> bool {
        !matches!(self, Action::Alloc | Action::FreeRequested | Action::FreeCompleted | Action::Oom)
    }
}

/// One frame of the stack an entry, block or segment was made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The file (the viewer shows it as the frame's origin).
    pub filename: String,
    /// The line.
    pub line: u64,
    /// The function.
    pub name: String,
}

/// One entry of a device's trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The block's or segment's address (0 for `oom` and `snapshot`).
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The stream.
    pub stream: u64,
    /// Microseconds on the recording's clock.
    pub time_us: u64,
    /// Free device memory, for `oom`.
    pub device_free: Option<u64>,
    /// Where it was made.
    pub frames: Vec<Frame>,
    /// The viewer's category (newer snapshots): it colours and lists blocks by it, and needs
    /// `unknown` among them once any entry has one.
    pub category: Option<String>,
}

/// The state of a block inside a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Allocated and live.
    ActiveAllocated,
    /// Freed by the program, awaiting its stream.
    ActivePendingFree,
    /// Free.
    Inactive,
}

impl BlockState {
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A block of a segment: a live allocation or a free gap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its address.
    pub address: u64,
    /// Its size in the segment.
    pub size: u64,
    /// Bytes requested (0 for a free gap).
    pub requested_size: u64,
    /// Its state.
    pub state: BlockState,
    /// Where it was made.
    pub frames: Vec<Frame>,
}

/// Memory the allocator holds at the end, tiled by its blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The device ordinal.
    pub device: u64,
    /// Its address.
    pub address: u64,
    /// Its size.
    pub total_size: u64,
    /// Bytes of its blocks that are allocated.
    pub allocated_size: u64,
    /// Bytes of its blocks that are active (allocated or pending free).
    pub active_size: u64,
    /// Bytes requested by its allocated blocks.
    pub requested_size: u64,
    /// The stream.
    pub stream: u64,
    /// `large` or `small`, PyTorch's two size classes.
    pub segment_type: String,
    /// The pool it belongs to: PyTorch writes a pair of integers.
    pub pool_id: (u64, u64),
    /// Whether it is an expandable segment.
    pub is_expandable: bool,
    /// Where it was made.
    pub frames: Vec<Frame>,
    /// Its blocks, in address order, covering it exactly.
    pub blocks: Vec<Block>,
}

/// A memory snapshot, as `torch.cuda.memory._snapshot()` returns it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// What the allocator holds at the end.
    pub segments: Vec<Segment>,
    /// Per device, its trace entries in order.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The allocator's settings, as name and value.
    pub allocator_settings: Vec<(String, String)>,
}

fn frames(frames: &[Frame]) -> Value {
    Value::List(
        frames
            .iter()
            .map(|frame| {
                dict([
                    ("filename", frame.filename.as_str().into()),
                    ("line", frame.line.into()),
                    ("name", frame.name.as_str().into()),
                ])
            })
            .collect(),
    )
}

fn entry(entry: &TraceEntry) -> Value {
    let mut items: Vec<(String, Value)> = vec![
        ("action".into(), entry.action.name().into()),
        ("addr".into(), entry.addr.into()),
        ("size".into(), entry.size.into()),
        ("stream".into(), entry.stream.into()),
        ("time_us".into(), entry.time_us.into()),
    ];
    if let Some(free) = entry.device_free {
        items.push(("device_free".into(), free.into()));
    }
    items.push(("frames".into(), frames(&entry.frames)));
    if let Some(category) = &entry.category {
        items.push(("category".into(), category.as_str().into()));
    }
    Value::Dict(items)
}

fn segment(segment: &Segment) -> Value {
    let blocks = segment
        .blocks
        .iter()
        .map(|block| {
            dict([
                ("address", block.address.into()),
                ("size", block.size.into()),
                ("requested_size", block.requested_size.into()),
                ("state", block.state.name().into()),
                ("frames", frames(&block.frames)),
            ])
        })
        .collect();
    dict([
        ("device", segment.device.into()),
        ("address", segment.address.into()),
        ("total_size", segment.total_size.into()),
        ("allocated_size", segment.allocated_size.into()),
        ("active_size", segment.active_size.into()),
        ("requested_size", segment.requested_size.into()),
        ("stream", segment.stream.into()),
        ("segment_type", segment.segment_type.as_str().into()),
        ("segment_pool_id", Value::Tuple(vec![segment.pool_id.0.into(), segment.pool_id.1.into()])),
        ("is_expandable", segment.is_expandable.into()),
        ("frames", frames(&segment.frames)),
        ("blocks", Value::List(blocks)),
    ])
}

/// Writes `snapshot` as a protocol-3 pickle, as `torch.cuda.memory._dump_snapshot` would.
pub fn write(snapshot: &Snapshot, out: &mut impl Write) -> io::Result<()> {
    let value = dict([
        ("segments", Value::List(snapshot.segments.iter().map(segment).collect())),
        (
            "device_traces",
            Value::List(
                snapshot.device_traces.iter().map(|trace| Value::List(trace.iter().map(entry).collect())).collect(),
            ),
        ),
        (
            "allocator_settings",
            Value::Dict(
                snapshot.allocator_settings.iter().map(|(name, value)| (name.clone(), value.as_str().into())).collect(),
            ),
        ),
    ]);
    pickle::write(out, &value)
}

#[cfg(feature = "pytorch")]
mod read;
#[cfg(feature = "pytorch")]
pub use read::read;

#[cfg(all(test, feature = "pytorch"))]
mod tests {
    use super::*;
    use crate::{EventKind, Location};

    fn entry(action: Action, addr: u64, size: u64, time_us: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 7,
            time_us,
            device_free: (action == Action::Oom).then_some(5),
            frames: vec![Frame { filename: "steppool phase `act`".into(), line: 3, name: "step 3".into() }],
            category: Some("act".into()),
        }
    }

    #[test]
    fn a_written_snapshot_reads_back_as_its_requests() {
        let snapshot = Snapshot {
            segments: vec![Segment {
                device: 0,
                address: 4096,
                total_size: 8192,
                allocated_size: 512,
                active_size: 512,
                requested_size: 100,
                stream: 7,
                segment_type: "large".into(),
                pool_id: (0, 2),
                is_expandable: false,
                frames: Vec::new(),
                blocks: vec![
                    Block {
                        address: 4096,
                        size: 512,
                        requested_size: 100,
                        state: BlockState::ActiveAllocated,
                        frames: Vec::new(),
                    },
                    Block {
                        address: 4608,
                        size: 7680,
                        requested_size: 0,
                        state: BlockState::Inactive,
                        frames: Vec::new(),
                    },
                ],
            }],
            device_traces: vec![vec![
                entry(Action::SegmentAlloc, 4096, 8192, 1),
                entry(Action::Alloc, 4096, 100, 2),
                entry(Action::FreeRequested, 4096, 100, 3),
                entry(Action::FreeCompleted, 4096, 100, 3),
                entry(Action::Oom, 0, 1 << 40, 4),
                entry(Action::Snapshot, 0, 0, 4),
            ]],
            allocator_settings: vec![("backend".into(), "steppool".into())],
        };
        let mut bytes = Vec::new();
        write(&snapshot, &mut bytes).unwrap();
        let trace = read(std::path::Path::new("s.pickle"), &bytes).unwrap();
        assert!(trace.warnings.is_empty(), "{:?}", trace.warnings);
        let events: Vec<(EventKind, u64, u64, u64, u64)> =
            trace.events.iter().map(|e| (e.kind, e.t_ns, e.ptr, e.bytes, e.stream)).collect();
        assert_eq!(
            events,
            [
                (EventKind::Alloc, 2000, 4096, 100, 7),
                (EventKind::Free { released: false }, 3000, 4096, 100, 7),
                (EventKind::AllocFailure, 4000, 0, 1 << 40, 7),
            ]
        );
        assert_eq!(trace.events[0].location, Location::Entry { device: 0, index: 1 });
        let value: serde_pickle::Value =
            serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).expect("a plain pickle");
        let text = format!("{value:?}");
        assert!(text.contains("active_allocated") && text.contains("segment_pool_id"), "{text}");
    }

    #[test]
    fn action_names_are_pytorchs() {
        for action in Action::ALL {
            assert_eq!(Action::from_name(action.name()), Some(action));
        }
        assert!(Action::SegmentMap.is_bookkeeping() && !Action::FreeCompleted.is_bookkeeping());
    }
}
