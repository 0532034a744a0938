//! The history as a PyTorch memory snapshot: the pickle `torch.cuda.memory._snapshot()` writes,
//! which pytorch.org/memory_viz opens (drag the file onto the page). This module maps the history
//! onto the snapshot's layout; [`steppool_trace::pytorch`] writes it.
//!
//! Mapping: a *segment* is memory a pool's strategy took from its CUDA pool (an arena slab, or
//! for the `Pool` strategy the allocation itself, as PyTorch's own `cudaMallocAsync` backend
//! reports); a *block* is an allocation. Under virtual memory management a planned slab, a
//! persistent chunk or an arena is an address range whose pages are mapped on demand: it is one
//! *expandable* segment (`is_expandable`), as PyTorch reports its `expandable_segments`, sized by
//! its mapped bytes, whose growth and shrinking are `segment_map` and `segment_unmap` entries of
//! the pages concerned; the viewer merges mapped pages into the segment they touch and splits it
//! around unmapped ones, so a block across pages lies in one segment at every point (a range
//! with pages unmapped between mapped ones is one segment per stretch of mapped pages, as in
//! PyTorch). Each event carries one frame naming its phase and step
//! (`steppool phase `activations`:3:step 3`), and a `category` with the phase name, which the
//! viewer colours and lists in its legend. Frees are written as `free_requested` followed by
//! `free_completed`, stream order being the runtime's concern.
//!
//! Graph memory: the driver's graph memory pools hold memory the runtime has no segments or
//! addresses for (graph allocation nodes of captured steps), read at each step's end once a
//! capture has begun. Each reading becomes a `snapshot` entry in its device's trace (the action
//! the viewer lists and otherwise ignores, so it draws nothing false), its frame naming the step,
//! the bytes (`graph memory reserved 4.0 MiB, used 4.0 MiB`) and, for a step in which captured
//! steps were launched, `captured: 3 graph launches`. The last reading per device also goes into
//! `allocator_settings` as `graph_memory_reserved_bytes:<device>` and
//! `graph_memory_used_bytes:<device>`, with `graph_launches` counting the launches recorded.
//! A plan-slab captured step's slab is a pool's segment like any other and appears as one.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::io::{self, Write};

use steppool_sys::bytes::Bytes;

use steppool_trace::pytorch::{self, Action, Block, BlockState, Frame, Segment, Snapshot, TraceEntry};

use super::history::{EventKind, History, LiveSegment, Segments, add_segment, remove_segment};
use crate::phase::ALIGNMENT;
use crate::report::PoolId;

fn frames(history: &History, pool: PoolId, step: Option<u64>, thread: Option<u64>) -> Vec<Frame> {
    let name = match (step, thread) {
        (Some(step), Some(thread)) => format!("step {step} (thread {thread})"),
        (Some(step), None) => format!("step {step}"),
        (None, Some(thread)) => format!("outside steps (thread {thread})"),
        (None, None) => "outside steps".to_owned(),
    };
    vec![Frame {
        filename: format!("steppool phase `{}`", history.phase_name(pool.phase)),
        line: step.unwrap_or(0),
        name,
    }]
}

fn trace_entry(
    action: Action,
    addr: u64,
    size: u64,
    pool: PoolId,
    t_ns: u64,
    frames: Vec<Frame>,
    category: &str,
) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream: u64::from(pool.stream),
        time_us: t_ns / 1000,
        device_free: None,
        frames,
        category: Some(category.to_owned()),
    }
}

/// The history as a snapshot.
fn snapshot(history: &History) -> Snapshot {
    let devices =
        history.devices_used().into_iter().chain(history.devices.iter().map(|d| d.0)).max().map_or(0, |d| d + 1);
    let mut traces: Vec<Vec<TraceEntry>> = vec![Vec::new(); devices];
    // The viewer replays the events backwards from the final state and needs every live block
    // inside a live segment at every point. Segments live when the retained window began are the
    // final ones with the window's segment events undone; a block that lands in no known segment
    // (in an arena slab taken before recording began) gets a segment of its own around it.
    let mut live_segments: Segments = history.segments.iter().map(|s| ((s.pool.device, s.ptr), s.clone())).collect();
    for event in history.events.iter().rev() {
        match event.kind {
            EventKind::SegmentAlloc { pool, ptr, bytes, .. } | EventKind::SegmentMap { pool, ptr, bytes, .. } => {
                remove_segment(&mut live_segments, pool.device, ptr, bytes);
            }
            EventKind::SegmentFree { pool, ptr, bytes, .. } => {
                add_segment(&mut live_segments, LiveSegment { pool, ptr, bytes, range: None });
            }
            EventKind::SegmentUnmap { pool, range, ptr, bytes, .. } => {
                add_segment(&mut live_segments, LiveSegment { pool, ptr, bytes, range: Some(range) });
            }
            _ => {}
        }
    }
    let inside = |live: &Segments, device: usize, ptr: u64| {
        live.range(..=(device, ptr))
            .next_back()
            .is_some_and(|(&(d, _), segment)| d == device && ptr < segment.ptr + segment.bytes)
    };
    let mut own_segments: HashSet<(usize, u64)> = HashSet::new();
    // Blocks allocated inside the retained window: frees of older ones are left out, since the
    // viewer could not place them in a segment.
    let mut allocated: HashSet<(usize, u64)> = HashSet::new();
    let mut last_t = 0;
    // Graph launches per step, and each device's last graph memory reading.
    let mut launches: BTreeMap<Option<u64>, u64> = BTreeMap::new();
    let mut graph_launches = 0u64;
    let mut graph_memory: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
    for (index, event) in history.events.iter().enumerate() {
        let t = event.t_ns;
        last_t = last_t.max(t);
        match &event.kind {
            EventKind::Alloc { pool, ptr, bytes, step, thread } => {
                allocated.insert((pool.device, *ptr));
                if !inside(&live_segments, pool.device, *ptr) {
                    own_segments.insert((pool.device, *ptr));
                    let own = LiveSegment { pool: *pool, ptr: *ptr, bytes: *bytes, range: None };
                    add_segment(&mut live_segments, own);
                    let frames = frames(history, *pool, None, None);
                    traces[pool.device].push(trace_entry(
                        Action::SegmentAlloc,
                        *ptr,
                        *bytes,
                        *pool,
                        t,
                        frames,
                        "unknown",
                    ));
                }
                let frames = frames(history, *pool, *step, Some(*thread));
                traces[pool.device].push(trace_entry(
                    Action::Alloc,
                    *ptr,
                    *bytes,
                    *pool,
                    t,
                    frames,
                    history.phase_name(pool.phase),
                ));
            }
            EventKind::Free { pool, ptr, bytes, step, thread, .. } => {
                if !allocated.remove(&(pool.device, *ptr)) {
                    continue;
                }
                let category = history.phase_name(pool.phase);
                for action in [Action::FreeRequested, Action::FreeCompleted] {
                    let frames = frames(history, *pool, *step, Some(*thread));
                    traces[pool.device].push(trace_entry(action, *ptr, *bytes, *pool, t, frames, category));
                }
                if own_segments.remove(&(pool.device, *ptr)) {
                    remove_segment(&mut live_segments, pool.device, *ptr, *bytes);
                    let frames = frames(history, *pool, None, None);
                    traces[pool.device].push(trace_entry(
                        Action::SegmentFree,
                        *ptr,
                        *bytes,
                        *pool,
                        t,
                        frames,
                        "unknown",
                    ));
                }
            }
            EventKind::SegmentAlloc { pool, ptr, bytes, .. }
            | EventKind::SegmentFree { pool, ptr, bytes, .. }
            | EventKind::SegmentMap { pool, ptr, bytes, .. }
            | EventKind::SegmentUnmap { pool, ptr, bytes, .. } => {
                let action = match event.kind {
                    EventKind::SegmentAlloc { .. } => {
                        add_segment(
                            &mut live_segments,
                            LiveSegment { pool: *pool, ptr: *ptr, bytes: *bytes, range: None },
                        );
                        Action::SegmentAlloc
                    }
                    EventKind::SegmentMap { range, .. } => {
                        let segment = LiveSegment { pool: *pool, ptr: *ptr, bytes: *bytes, range: Some(range) };
                        add_segment(&mut live_segments, segment);
                        Action::SegmentMap
                    }
                    EventKind::SegmentFree { .. } => {
                        remove_segment(&mut live_segments, pool.device, *ptr, *bytes);
                        Action::SegmentFree
                    }
                    _ => {
                        remove_segment(&mut live_segments, pool.device, *ptr, *bytes);
                        Action::SegmentUnmap
                    }
                };
                // The viewer requires the category `unknown` once any event has a category.
                traces[pool.device].push(trace_entry(
                    action,
                    *ptr,
                    *bytes,
                    *pool,
                    t,
                    frames(history, *pool, None, None),
                    "unknown",
                ));
            }
            EventKind::GraphLaunch { step, .. } => {
                *launches.entry(*step).or_default() += 1;
                graph_launches += 1;
            }
            EventKind::GraphMemory { device, reserved, used } => {
                let step = history.events[..index].iter().rev().find_map(|e| match e.kind {
                    EventKind::StepEnd { step } | EventKind::StepBegin { step } => Some(step),
                    _ => None,
                });
                let mut name = format!("graph memory reserved {}, used {}", Bytes(*reserved), Bytes(*used));
                if let Some(&count) = launches.get(&step) {
                    let _ = write!(name, "; captured: {count} graph launch{}", if count == 1 { "" } else { "es" });
                }
                if let Some(trace) = traces.get_mut(*device) {
                    trace.push(TraceEntry {
                        action: Action::Snapshot,
                        addr: 0,
                        size: 0,
                        stream: 0,
                        time_us: t / 1000,
                        device_free: None,
                        frames: vec![Frame {
                            filename: format!("steppool graph memory, device {device}"),
                            line: step.unwrap_or(0),
                            name,
                        }],
                        category: Some("unknown".to_owned()),
                    });
                }
                graph_memory.insert(*device, (*reserved, *used));
            }
            EventKind::Oom { pool, bytes, device_free } => {
                let frames = frames(history, *pool, None, None);
                let mut entry = trace_entry(Action::Oom, 0, *bytes, *pool, t, frames, history.phase_name(pool.phase));
                entry.device_free = Some(*device_free);
                traces[pool.device].push(entry);
            }
            _ => {}
        }
    }
    // The viewer fails to load a snapshot whose events have categories but not `unknown`: one
    // closing `snapshot` event (which it lists and otherwise ignores) guarantees it.
    for trace in &mut traces {
        trace.push(TraceEntry {
            action: Action::Snapshot,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: last_t / 1000,
            device_free: None,
            frames: Vec::new(),
            category: Some("unknown".to_owned()),
        });
    }

    // Live segments, each tiled by its live blocks and the free gaps between them; a live block
    // outside every known segment (allocated before recording began) gets a segment of its own.
    let mut segments: Vec<(PoolId, u64, u64, bool)> =
        history.segments.iter().map(|s| (s.pool, s.ptr, s.bytes, s.range.is_some())).collect();
    for block in &history.blocks {
        let inside = segments.iter().any(|&(pool, base, size, _)| {
            pool.device == block.pool.device && base <= block.ptr && block.ptr < base + size
        });
        if !inside {
            segments.push((block.pool, block.ptr, block.bytes, false));
        }
    }
    segments.sort_by_key(|&(pool, base, _, _)| (pool.device, base));
    let mut segment_values = Vec::new();
    for &(pool, base, size, is_expandable) in &segments {
        let end = base + size;
        let mut blocks = Vec::new();
        let mut cursor = base;
        let (mut allocated_size, mut requested_size) = (0, 0);
        let inside = history.blocks.iter().filter(|b| b.pool.device == pool.device && base <= b.ptr && b.ptr < end);
        for block in inside {
            if block.ptr < cursor {
                continue; // overlapping records cannot come from the runtime; keep the tiling valid
            }
            if block.ptr > cursor {
                blocks.push(free_gap(cursor, block.ptr - cursor));
            }
            let block_size = block.bytes.next_multiple_of(ALIGNMENT).min(end - block.ptr);
            blocks.push(Block {
                address: block.ptr,
                size: block_size,
                requested_size: block.bytes.min(block_size),
                state: BlockState::ActiveAllocated,
                frames: frames(history, block.pool, block.step, None),
            });
            allocated_size += block_size;
            requested_size += block.bytes.min(block_size);
            cursor = block.ptr + block_size;
        }
        if cursor < end {
            blocks.push(free_gap(cursor, end - cursor));
        }
        segment_values.push(Segment {
            device: pool.device as u64,
            address: base,
            total_size: size,
            allocated_size,
            active_size: allocated_size,
            requested_size,
            stream: u64::from(pool.stream),
            segment_type: "large".to_owned(),
            pool_id: (0, pool.phase.index() as u64),
            is_expandable,
            frames: frames(history, pool, None, None),
            blocks,
        });
    }
    let mut allocator_settings =
        vec![("backend".to_owned(), "steppool".to_owned()), ("driver".to_owned(), history.driver.clone())];
    if graph_launches > 0 || !graph_memory.is_empty() {
        allocator_settings.push(("graph_launches".to_owned(), graph_launches.to_string()));
    }
    for (device, (reserved, used)) in graph_memory {
        allocator_settings.push((format!("graph_memory_reserved_bytes:{device}"), reserved.to_string()));
        allocator_settings.push((format!("graph_memory_used_bytes:{device}"), used.to_string()));
    }
    Snapshot { segments: segment_values, device_traces: traces, allocator_settings }
}

/// A free stretch of a segment.
fn free_gap(address: u64, size: u64) -> Block {
    Block { address, size, requested_size: 0, state: BlockState::Inactive, frames: Vec::new() }
}

impl History {
    /// Writes the history as a PyTorch memory snapshot pickle, as `torch.cuda.memory._snapshot()`
    /// does, for pytorch.org/memory_viz. Segments are what pools took from their CUDA pools (arena
    /// slabs, or a `Pool` strategy's allocations themselves) or, under virtual memory management,
    /// the mapped pages of the address ranges they reserved, each range an expandable segment that
    /// `segment_map` and `segment_unmap` entries grow and shrink; blocks are allocations, each tagged
    /// with its phase and step in its frame and its `category`. The devices' graph memory pools,
    /// read at each step's end once a capture has begun, have no addresses the runtime knows:
    /// each reading is a `snapshot` entry in its device's trace whose frame names the step, the
    /// bytes reserved and used and the step's graph launches (`captured: 3 graph launches`), and
    /// the last one per device is in `allocator_settings` (`graph_memory_reserved_bytes:<device>`,
    /// `graph_memory_used_bytes:<device>`, with `graph_launches`).
    ///
    /// For a complete picture start recording before the first allocation: allocations made
    /// earlier appear as segments of their own, and their frees are left out.
    pub fn write_memory_snapshot(&self, out: &mut impl Write) -> io::Result<()> {
        pytorch::write(&snapshot(self), out)
    }
}
