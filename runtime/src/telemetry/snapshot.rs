//! The history as a PyTorch memory snapshot: the pickle `torch.cuda.memory._snapshot()` writes,
//! which pytorch.org/memory_viz opens (drag the file onto the page).
//!
//! Mapping: a *segment* is memory a pool's strategy took from its CUDA pool (an arena slab, or
//! for the `Pool` strategy the allocation itself, as PyTorch's own `cudaMallocAsync` backend
//! reports); a *block* is an allocation. Each event carries one frame naming its phase and step
//! (`steppool phase `activations`:3:step 3`), and a `category` with the phase name, which the
//! viewer colours and lists in its legend. Frees are written as `free_requested` followed by
//! `free_completed`, stream order being the runtime's concern.

use std::collections::{BTreeMap, HashSet};
use std::io::{self, Write};

use super::history::{EventKind, History};
use super::pickle::{self, Value, dict};
use crate::phase::ALIGNMENT;
use crate::report::PoolId;

fn frames(history: &History, pool: PoolId, step: Option<u64>, thread: Option<u64>) -> Value {
    let name = match (step, thread) {
        (Some(step), Some(thread)) => format!("step {step} (thread {thread})"),
        (Some(step), None) => format!("step {step}"),
        (None, Some(thread)) => format!("outside steps (thread {thread})"),
        (None, None) => "outside steps".to_owned(),
    };
    Value::List(vec![dict([
        ("filename", format!("steppool phase `{}`", history.phase_name(pool.phase)).into()),
        ("line", Value::Int(step.map_or(0, i128::from))),
        ("name", name.into()),
    ])])
}

fn trace_entry(action: &str, addr: u64, size: u64, pool: PoolId, t_ns: u64, frames: Value, category: &str) -> Value {
    dict([
        ("action", action.into()),
        ("addr", addr.into()),
        ("size", size.into()),
        ("stream", u64::from(pool.stream).into()),
        ("time_us", (t_ns / 1000).into()),
        ("frames", frames),
        ("category", category.into()),
    ])
}

/// The snapshot as a Python value.
fn snapshot(history: &History) -> Value {
    let devices =
        history.devices_used().into_iter().chain(history.devices.iter().map(|d| d.0)).max().map_or(0, |d| d + 1);
    let mut traces: Vec<Vec<Value>> = vec![Vec::new(); devices];
    // The viewer replays the events backwards from the final state and needs every live block
    // inside a live segment at every point. Segments live when the retained window began are the
    // final ones with the window's segment events undone; a block that lands in no known segment
    // (in an arena slab taken before recording began) gets a segment of its own around it.
    let mut segments: HashSet<(usize, u64, u64)> =
        history.segments.iter().map(|s| (s.pool.device, s.ptr, s.bytes)).collect();
    for event in history.events.iter().rev() {
        match event.kind {
            EventKind::SegmentAlloc { pool, ptr, bytes, .. } => {
                segments.remove(&(pool.device, ptr, bytes));
            }
            EventKind::SegmentFree { pool, ptr, bytes, .. } => {
                segments.insert((pool.device, ptr, bytes));
            }
            _ => {}
        }
    }
    let mut live_segments: BTreeMap<(usize, u64), u64> = segments.into_iter().map(|(d, p, b)| ((d, p), b)).collect();
    let inside = |live: &BTreeMap<(usize, u64), u64>, device: usize, ptr: u64| {
        live.range(..=(device, ptr)).next_back().is_some_and(|(&(d, base), &size)| d == device && ptr < base + size)
    };
    let mut own_segments: HashSet<(usize, u64)> = HashSet::new();
    // Blocks allocated inside the retained window: frees of older ones are left out, since the
    // viewer could not place them in a segment.
    let mut allocated: HashSet<(usize, u64)> = HashSet::new();
    let mut last_t = 0;
    for event in &history.events {
        let t = event.t_ns;
        last_t = last_t.max(t);
        match &event.kind {
            EventKind::Alloc { pool, ptr, bytes, step, thread } => {
                allocated.insert((pool.device, *ptr));
                if !inside(&live_segments, pool.device, *ptr) {
                    own_segments.insert((pool.device, *ptr));
                    live_segments.insert((pool.device, *ptr), *bytes);
                    let frames = frames(history, *pool, None, None);
                    traces[pool.device].push(trace_entry("segment_alloc", *ptr, *bytes, *pool, t, frames, "unknown"));
                }
                let frames = frames(history, *pool, *step, Some(*thread));
                traces[pool.device].push(trace_entry(
                    "alloc",
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
                for action in ["free_requested", "free_completed"] {
                    let frames = frames(history, *pool, *step, Some(*thread));
                    traces[pool.device].push(trace_entry(action, *ptr, *bytes, *pool, t, frames, category));
                }
                if own_segments.remove(&(pool.device, *ptr)) {
                    live_segments.remove(&(pool.device, *ptr));
                    let frames = frames(history, *pool, None, None);
                    traces[pool.device].push(trace_entry("segment_free", *ptr, *bytes, *pool, t, frames, "unknown"));
                }
            }
            EventKind::SegmentAlloc { pool, ptr, bytes, .. } | EventKind::SegmentFree { pool, ptr, bytes, .. } => {
                let action = if matches!(event.kind, EventKind::SegmentAlloc { .. }) {
                    live_segments.insert((pool.device, *ptr), *bytes);
                    "segment_alloc"
                } else {
                    live_segments.remove(&(pool.device, *ptr));
                    "segment_free"
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
            EventKind::Oom { pool, bytes, device_free } => traces[pool.device].push(dict([
                ("action", "oom".into()),
                ("addr", 0u64.into()),
                ("size", (*bytes).into()),
                ("stream", u64::from(pool.stream).into()),
                ("time_us", (t / 1000).into()),
                ("device_free", (*device_free).into()),
                ("frames", frames(history, *pool, None, None)),
                ("category", history.phase_name(pool.phase).into()),
            ])),
            _ => {}
        }
    }
    // The viewer fails to load a snapshot whose events have categories but not `unknown`: one
    // closing `snapshot` event (which it lists and otherwise ignores) guarantees it.
    for trace in &mut traces {
        trace.push(dict([
            ("action", "snapshot".into()),
            ("addr", 0u64.into()),
            ("size", 0u64.into()),
            ("stream", 0u64.into()),
            ("time_us", (last_t / 1000).into()),
            ("frames", Value::List(Vec::new())),
            ("category", "unknown".into()),
        ]));
    }

    // Live segments, each tiled by its live blocks and the free gaps between them; a live block
    // outside every known segment (allocated before recording began) gets a segment of its own.
    let mut segments: Vec<(PoolId, u64, u64)> = history.segments.iter().map(|s| (s.pool, s.ptr, s.bytes)).collect();
    for block in &history.blocks {
        let inside = segments.iter().any(|&(pool, base, size)| {
            pool.device == block.pool.device && base <= block.ptr && block.ptr < base + size
        });
        if !inside {
            segments.push((block.pool, block.ptr, block.bytes));
        }
    }
    segments.sort_by_key(|&(pool, base, _)| (pool.device, base));
    let mut segment_values = Vec::new();
    for &(pool, base, size) in &segments {
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
                blocks.push(dict([
                    ("address", cursor.into()),
                    ("size", (block.ptr - cursor).into()),
                    ("requested_size", 0u64.into()),
                    ("state", "inactive".into()),
                    ("frames", Value::List(Vec::new())),
                ]));
            }
            let block_size = block.bytes.next_multiple_of(ALIGNMENT).min(end - block.ptr);
            blocks.push(dict([
                ("address", block.ptr.into()),
                ("size", block_size.into()),
                ("requested_size", block.bytes.min(block_size).into()),
                ("state", "active_allocated".into()),
                ("frames", frames(history, block.pool, block.step, None)),
            ]));
            allocated_size += block_size;
            requested_size += block.bytes.min(block_size);
            cursor = block.ptr + block_size;
        }
        if cursor < end {
            blocks.push(dict([
                ("address", cursor.into()),
                ("size", (end - cursor).into()),
                ("requested_size", 0u64.into()),
                ("state", "inactive".into()),
                ("frames", Value::List(Vec::new())),
            ]));
        }
        segment_values.push(dict([
            ("device", (pool.device as u64).into()),
            ("address", base.into()),
            ("total_size", size.into()),
            ("allocated_size", allocated_size.into()),
            ("active_size", allocated_size.into()),
            ("requested_size", requested_size.into()),
            ("stream", u64::from(pool.stream).into()),
            ("segment_type", "large".into()),
            ("segment_pool_id", Value::Tuple(vec![Value::Int(0), Value::Int(pool.phase.index() as i128)])),
            ("is_expandable", false.into()),
            ("frames", frames(history, pool, None, None)),
            ("blocks", Value::List(blocks)),
        ]));
    }
    dict([
        ("segments", Value::List(segment_values)),
        ("device_traces", Value::List(traces.into_iter().map(Value::List).collect())),
        ("allocator_settings", dict([("backend", "steppool".into()), ("driver", history.driver.clone().into())])),
    ])
}

impl History {
    /// Writes the history as a PyTorch memory snapshot pickle, as `torch.cuda.memory._snapshot()`
    /// does, for pytorch.org/memory_viz. Segments are what pools took from their CUDA pools (arena
    /// slabs, or a `Pool` strategy's allocations themselves); blocks are allocations, each tagged
    /// with its phase and step in its frame and its `category`.
    ///
    /// For a complete picture start recording before the first allocation: allocations made
    /// earlier appear as segments of their own, and their frees are left out.
    pub fn write_memory_snapshot(&self, out: &mut impl Write) -> io::Result<()> {
        pickle::write(out, &snapshot(self))
    }
}
