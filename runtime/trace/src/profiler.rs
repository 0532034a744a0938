//! PyTorch profiler traces: the Chrome trace JSON that `torch.profiler` writes
//! (`prof.export_chrome_trace(path)`, or `tensorboard_trace_handler`'s `*.pt.trace.json`, gzipped
//! or not) for a run profiled with `profile_memory=True`.
//!
//! **Memory.** Every `[memory]` instant event of `traceEvents` is an allocation (`args.Bytes`
//! positive) or a free (negative) at `args.Addr`, on the device of `args."Device Type"` (c10's
//! numbering: 0 the CPU, 1 CUDA) and `args."Device Id"` (-1 on the CPU, read as device 0). A
//! trace with CUDA memory events is replayed from those (a GPU run's CPU tensors are left out,
//! counted as [`WarningKind::OtherDevice`]); one without is replayed from its CPU events (a run
//! profiled on the CPU, as `benches/traces/record.py` records). Events are in time order, the
//! profiler's own index (`Ev Idx`) breaking ties, then file order. Times are microseconds in the
//! file, nanoseconds from the first event read in the trace. The profiler writes no stream: every
//! event is on stream 0.
//!
//! **Steps.** The `record_function` ranges `steppool_step_N`, with micro-steps
//! `steppool_micro_N_K` (gradient accumulation), as `record.py` marks them; without them, the
//! `ProfilerStep#N` ranges that `prof.step()` opens under a schedule. Without either the trace
//! has no steps of its own ([`read_trace`](crate::read::read_trace) then infers them). Ranges of
//! one name are one step (or micro-step), from the first begin to the last end (a loop may open
//! its step's range twice, nested); the GPU's copies of a range (`gpu_user_annotation`, timed on
//! the GPU's clock) and ranges of no duration at the time's precision are left out. At one time,
//! ranges end before others begin, and both come before memory events.
//!
//! **Bad input.** A `[memory]` event without a time, an address from 0 to 2^63 - 1 or a byte
//! count within `i64` (its negation included) is an error naming the event
//! (`traceEvents[i]`), as is JSON that is no Chrome trace.
//!
//! **Memory from before the recording.** `args."Total Allocated"` is the allocator's total after
//! the event; on CUDA it counts memory allocated before profiling began (a model built before the
//! profiler started, or the steps a schedule skipped), which the trace never shows. The first
//! event of a device then says how much that is: its total less its own bytes. What of it the
//! trace frees is held from the start by [`Trace::hold_from_start`] (with each free's size);
//! what remains is one allocation held from the trace's start and never freed, so that peaks
//! and every strategy count it (a [`WarningKind::HeldBeforeRecording`]). The CPU's total is the
//! profiler's own count, which keeps what an earlier profiling session in the process allocated
//! and freed outside it (measured: 5.7 MiB on the second of two workloads recorded in one
//! process, none of it live), so on the CPU nothing is added.

use std::borrow::Cow;
use std::path::Path;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::error::{Location, Result, TraceError};
use crate::trace::{Event, EventKind, Threads, Trace, TraceFormat, WarningKind, check_device};

/// c10's `DeviceType` of the CPU.
const CPU: i64 = 0;
/// c10's `DeviceType` of CUDA.
const CUDA: i64 = 1;

/// The pointer of the allocation that stands for a device's memory allocated before the
/// recording began and never freed in it: no allocator hands out the last byte of the address
/// space.
const BEFORE_RECORDING: u64 = u64::MAX;

/// The events a trace is read from, with their index in `traceEvents`, kept as they stream past:
/// `[memory]` events and the ranges that may be steps. A profiler trace is mostly operator
/// ranges, which are dropped as soon as they are parsed, so reading holds the file and little
/// beside it (measured on a trace of 9.4 MB: 26 MB resident when every event was kept, 18 MB
/// streamed, 7 MB of it the program's own).
#[derive(Default)]
struct Kept<'a> {
    /// The index of the next event.
    next: usize,
    events: Vec<(usize, RawEvent<'a>)>,
}

impl<'a> Kept<'a> {
    fn offer(&mut self, event: RawEvent<'a>) {
        let index = self.next;
        self.next += 1;
        let range = event.ph.as_deref() == Some("X")
            && event.name.as_deref().is_some_and(|name| steppool_range(name).or_else(|| profiler_step(name)).is_some());
        if range || is_memory(&event) {
            self.events.push((index, event));
        }
    }
}

/// The top level of a Chrome trace: an object whose `traceEvents` is streamed into [`Kept`]
/// (every other member skipped unread), or the bare list of events.
struct TopLevel<'k, 'a>(&'k mut Kept<'a>);

impl<'de, 'k> Visitor<'de> for TopLevel<'k, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a Chrome trace: an object with `traceEvents`, or a list of events")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> std::result::Result<(), M::Error> {
        let mut found = false;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "traceEvents" && !found {
                map.next_value_seed(Events(&mut *self.0))?;
                found = true;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        if !found {
            return Err(serde::de::Error::custom("an object without `traceEvents`"));
        }
        Ok(())
    }

    fn visit_seq<S: SeqAccess<'de>>(self, seq: S) -> std::result::Result<(), S::Error> {
        Events(self.0).visit_seq(seq)
    }
}

/// The list of events, each offered to [`Kept`] as it is parsed.
struct Events<'k, 'a>(&'k mut Kept<'a>);

impl<'de, 'k> DeserializeSeed<'de> for Events<'k, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> std::result::Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, 'k> Visitor<'de> for Events<'k, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a list of trace events")
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> std::result::Result<(), S::Error> {
        while let Some(event) = seq.next_element::<RawEvent<'de>>()? {
            self.0.offer(event);
        }
        Ok(())
    }
}

/// The fields of a trace event this reader uses; the others are skipped unread.
#[derive(Deserialize)]
struct RawEvent<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    ph: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cat: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "lenient_f64")]
    ts: Option<f64>,
    #[serde(default, deserialize_with = "lenient_f64")]
    dur: Option<f64>,
    #[serde(default, deserialize_with = "lenient_label")]
    tid: Option<String>,
    #[serde(default)]
    args: Option<Args>,
}

/// A `[memory]` event's arguments. Other events' arguments are read through the same fields,
/// each of which takes any JSON value and keeps only an integer (or a number, for times), so
/// arguments of another shape in an event this reader drops do not fail the file; an event
/// whose `name`, `ph` or `cat` is not a string does, as JSON that is no Chrome trace.
#[derive(Deserialize)]
struct Args {
    #[serde(rename = "Addr", default, deserialize_with = "lenient_i64")]
    addr: Option<i64>,
    #[serde(rename = "Bytes", default, deserialize_with = "lenient_i64")]
    bytes: Option<i64>,
    #[serde(rename = "Device Type", default, deserialize_with = "lenient_i64")]
    device_type: Option<i64>,
    #[serde(rename = "Device Id", default, deserialize_with = "lenient_i64")]
    device_id: Option<i64>,
    #[serde(rename = "Total Allocated", default, deserialize_with = "lenient_i64")]
    total_allocated: Option<i64>,
    #[serde(rename = "Ev Idx", default, deserialize_with = "lenient_i64")]
    ev_idx: Option<i64>,
}

fn lenient_f64<'de, D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Option<f64>, D::Error> {
    Ok(serde_json::Value::deserialize(deserializer)?.as_f64())
}

fn lenient_i64<'de, D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Option<i64>, D::Error> {
    Ok(match serde_json::Value::deserialize(deserializer)? {
        // An integer past `i64` is kept out, not wrapped: the events that need one say so.
        serde_json::Value::Number(n) => n.as_i64(),
        _ => None,
    })
}

fn lenient_label<'de, D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Option<String>, D::Error> {
    Ok(match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    })
}

/// Whether `bytes` look like a Chrome trace: JSON whose first mebibyte names `traceEvents` (or,
/// for a bare list of events, has a `[memory]` event).
pub fn looks_like(bytes: &[u8]) -> bool {
    let text = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let Some(&first) = text.iter().find(|b| !b.is_ascii_whitespace()) else { return false };
    let head = &text[..text.len().min(1 << 20)];
    let has = |needle: &[u8]| head.windows(needle.len()).any(|window| window == needle);
    match first {
        b'{' => has(b"\"traceEvents\""),
        b'[' => has(b"\"[memory]\""),
        _ => false,
    }
}

/// A memory event kept for the trace, before sorting.
struct Memory {
    ts: f64,
    ev_idx: i64,
    index: usize,
    addr: u64,
    bytes: i64,
    device: u32,
    total_allocated: Option<i64>,
    tid: String,
}

/// A step or micro-step boundary, before sorting.
struct Boundary {
    ts: f64,
    /// Order among boundaries at the same time: ends before begins, so adjacent ranges nest.
    rank: u8,
    kind: EventKind,
    index: usize,
}

/// Reads a PyTorch profiler trace (see the module docs); `path` names it in messages.
pub fn read(path: &Path, bytes: &[u8]) -> Result<Trace> {
    let text = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let not_json = |e: serde_json::Error| {
        TraceError::malformed(path, Location::Line(e.line() as u64), format!("not a Chrome trace: {e}"))
    };
    let mut kept = Kept::default();
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    deserializer.deserialize_any(TopLevel(&mut kept)).map_err(not_json)?;
    deserializer.end().map_err(not_json)?;
    let events = kept.events;

    let mut trace = Trace::new(path, TraceFormat::Profiler);
    let mut memory = Vec::new();
    let mut other_device = Vec::new();
    let device_type =
        if events.iter().any(|(_, e)| is_memory(e) && e.args.as_ref().and_then(|a| a.device_type) == Some(CUDA)) {
            CUDA
        } else {
            CPU
        };
    for &(index, ref event) in &events {
        if !is_memory(event) {
            continue;
        }
        let location = Location::TraceEvent(index as u64);
        let bad = |message: String| TraceError::malformed(path, location, message);
        let args = event.args.as_ref().expect("a memory event has args");
        let ts = event.ts.ok_or_else(|| bad("a `[memory]` event without a numeric `ts`".to_owned()))?;
        let addr = args
            .addr
            .filter(|&addr| addr >= 0)
            .ok_or_else(|| bad("a `[memory]` event without `args.Addr`, an address from 0 to 2^63 - 1".to_owned()))?;
        let size = args.bytes.filter(|bytes| bytes.checked_abs().is_some()).ok_or_else(|| {
            bad("a `[memory]` event without `args.Bytes`, an integer from -(2^63 - 1) to 2^63 - 1".to_owned())
        })?;
        let kind = args.device_type.unwrap_or(CPU);
        if kind != device_type {
            other_device.push((location, kind, size));
            continue;
        }
        let device = check_device(path, location, args.device_id.unwrap_or(-1).max(0) as u64)?;
        memory.push(Memory {
            ts,
            ev_idx: args.ev_idx.unwrap_or(i64::MAX),
            index,
            addr: addr as u64,
            bytes: size,
            device,
            total_allocated: args.total_allocated,
            tid: event.tid.clone().unwrap_or_else(|| "0".to_owned()),
        });
    }
    for (location, kind, size) in other_device {
        trace.warnings.add(WarningKind::OtherDevice, location, || {
            format!("{size} bytes on device type {kind}, beside device type {device_type}'s events")
        });
    }
    memory.sort_by(|a, b| a.ts.total_cmp(&b.ts).then(a.ev_idx.cmp(&b.ev_idx)).then(a.index.cmp(&b.index)));
    let boundaries = boundaries(&events);
    let t0 = memory.iter().map(|m| m.ts).chain(boundaries.iter().map(|b| b.ts)).min_by(f64::total_cmp).unwrap_or(0.0);
    let ns = |ts: f64| ((ts - t0) * 1000.0).round().max(0.0) as u64;

    let mut threads = Threads::default();
    let mut held_before: Vec<(u32, i64, Location)> = Vec::new();
    let mut memory = memory.into_iter().peekable();
    let mut boundaries = boundaries.into_iter().peekable();
    loop {
        // Boundaries go before memory events of the same time: a range opens before what it holds.
        let take_boundary = match (boundaries.peek(), memory.peek()) {
            (Some(boundary), Some(event)) => boundary.ts <= event.ts,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        if take_boundary {
            let boundary = boundaries.next().expect("peeked");
            trace.events.push(Event::new(ns(boundary.ts), boundary.kind, Location::TraceEvent(boundary.index as u64)));
            continue;
        }
        let m = memory.next().expect("peeked");
        let location = Location::TraceEvent(m.index as u64);
        let kind = match m.bytes {
            0 => {
                trace.warnings.add(WarningKind::ZeroBytes, location, || format!("at {:#x}", m.addr));
                continue;
            }
            b if b > 0 => EventKind::Alloc,
            _ => EventKind::Free { released: false },
        };
        if device_type == CUDA && !held_before.iter().any(|&(device, ..)| device == m.device) {
            // The caching allocator's total before this device's first event, as it reports it.
            let before = m.total_allocated.map_or(0, |total| total.saturating_sub(m.bytes));
            held_before.push((m.device, before, location));
        }
        let mut event = Event::new(ns(m.ts), kind, location);
        event.ptr = m.addr;
        event.bytes = m.bytes.unsigned_abs();
        event.device = m.device;
        event.thread = threads.index(&mut trace, &m.tid);
        trace.note_device(m.device);
        trace.events.push(event);
    }
    let held = held_from_before(&trace, &held_before);
    trace.hold_from_start(held);
    Ok(trace)
}

fn is_memory(event: &RawEvent<'_>) -> bool {
    event.name.as_deref() == Some("[memory]") && event.args.is_some()
}

/// A range's step, and its micro-step within the step for a micro-step's range.
type RangeOf = (u64, Option<u32>);

/// `steppool_step_N` and `steppool_micro_N_K`, as `benches/traces/record.py` names its ranges.
fn steppool_range(name: &str) -> Option<RangeOf> {
    if let Some(step) = name.strip_prefix("steppool_step_") {
        return Some((step.parse().ok()?, None));
    }
    let (step, micro) = name.strip_prefix("steppool_micro_")?.split_once('_')?;
    Some((step.parse().ok()?, Some(micro.parse().ok()?)))
}

/// `ProfilerStep#N`, the range `prof.step()` opens under a schedule.
fn profiler_step(name: &str) -> Option<RangeOf> {
    Some((name.strip_prefix("ProfilerStep#")?.parse().ok()?, None))
}

/// The step and micro-step boundaries of the trace's ranges, sorted (see the module docs).
fn boundaries(events: &[(usize, RawEvent<'_>)]) -> Vec<Boundary> {
    let mut found = ranges(events, steppool_range);
    if !found.iter().any(|b| matches!(b.kind, EventKind::StepBegin(_))) {
        found = ranges(events, profiler_step);
    }
    found.sort_by(|a, b| a.ts.total_cmp(&b.ts).then(a.rank.cmp(&b.rank)).then(a.index.cmp(&b.index)));
    found
}

/// The boundaries of the complete ranges (`"ph": "X"`) that `parse` names, unsorted. Ranges of
/// one name are one step (or micro-step) from the first begin to the last end: a loop may open
/// its step's range twice, nested (measured on `record.py`'s recordings). The GPU's copies of a
/// range (`gpu_user_annotation`, on the GPU's clock: when the step's kernels ran) are left out:
/// memory events are on the CPU's.
fn ranges(events: &[(usize, RawEvent<'_>)], parse: fn(&str) -> Option<RangeOf>) -> Vec<Boundary> {
    let mut spans: std::collections::BTreeMap<RangeOf, (f64, f64, usize)> = std::collections::BTreeMap::new();
    for &(index, ref event) in events {
        let (Some(name), Some("X"), Some(ts), Some(dur)) =
            (event.name.as_deref(), event.ph.as_deref(), event.ts, event.dur)
        else {
            continue;
        };
        let Some(key) = parse(name) else { continue };
        // No duration at the time's precision (a time of 1e17 µs moves in steps of 16): no range.
        if ts + dur <= ts || event.cat.as_deref() == Some("gpu_user_annotation") {
            continue;
        }
        let span = spans.entry(key).or_insert((ts, ts + dur, index));
        *span = (span.0.min(ts), span.1.max(ts + dur), span.2);
    }
    let mut out = Vec::new();
    for ((step, micro), (begin_ts, end_ts, index)) in spans {
        let (begin, end) = match micro {
            None => (EventKind::StepBegin(step), EventKind::StepEnd(step)),
            Some(k) => (EventKind::MicroBegin(step, k), EventKind::MicroEnd(step, k)),
        };
        // At one time: a micro-step ends, then its step, then the next step begins, then its
        // first micro-step.
        let (begin_rank, end_rank) = if micro.is_some() { (3, 0) } else { (2, 1) };
        out.push(Boundary { ts: begin_ts, rank: begin_rank, kind: begin, index });
        out.push(Boundary { ts: end_ts, rank: end_rank, kind: end, index });
    }
    out
}

/// One allocation per device for the memory its allocator held before the first event (`held`:
/// device and bytes, with the location of that event) that the trace does not free, at
/// [`BEFORE_RECORDING`]: what the frees of pointers it never showed account for is held by
/// [`Trace::hold_from_start`] itself.
fn held_from_before(trace: &Trace, held: &[(u32, i64, Location)]) -> Vec<Event> {
    let freed = trace.allocations_behind_unseen_frees(std::collections::HashSet::new());
    let mut out = Vec::new();
    for &(device, before, location) in held {
        let freed: i64 =
            freed.iter().filter(|e| e.device == device).map(|e| e.bytes as i64).fold(0, i64::saturating_add);
        let unseen = before.saturating_sub(freed);
        if unseen > 0 {
            let mut event = Event::new(0, EventKind::Alloc, location);
            event.ptr = BEFORE_RECORDING;
            event.bytes = unseen as u64;
            event.device = device;
            out.push(event);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis;

    /// A memory event as the profiler writes it.
    fn memory(ts: f64, idx: i64, addr: u64, bytes: i64, device_type: i64, device_id: i64, total: i64) -> String {
        format!(
            r#"{{"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 7, "tid": 7, "ts": {ts},
               "args": {{"Total Reserved": 0, "Total Allocated": {total}, "Bytes": {bytes}, "Device Id": {device_id},
                        "Device Type": {device_type}, "Addr": {addr}, "finished": false, "Ev Idx": {idx}}}}}"#
        )
    }

    fn range(name: &str, ts: f64, dur: f64) -> String {
        format!(
            r#"{{"ph": "X", "cat": "user_annotation", "name": "{name}", "pid": 7, "tid": 7, "ts": {ts}, "dur": {dur},
               "args": {{"External id": 1, "Input Dims": [[2, 3]], "Ev Idx": 0}}}}"#
        )
    }

    fn chrome(events: &[String]) -> Vec<u8> {
        format!(
            r#"{{"schemaVersion": 1, "deviceProperties": [], "displayTimeUnit": "ms",
                "traceEvents": [{{"ph": "M", "name": "process_name", "pid": "Spans", "tid": "PyTorch Profiler", "ts": 0, "args": {{"name": "python"}}}},
                {}]}}"#,
            events.join(",\n")
        )
        .into_bytes()
    }

    fn kinds(trace: &Trace) -> Vec<(EventKind, u64)> {
        trace.events.iter().map(|e| (e.kind, e.bytes)).collect()
    }

    #[test]
    fn profiler_steps_and_memory_in_time_order() {
        let bytes = chrome(&[
            range("ProfilerStep#3", 100.0, 50.0),
            // Out of file order, and two at one time ordered by their index.
            memory(120.5, 11, 0x2000, -4096, 0, -1, 0),
            memory(110.25, 10, 0x2000, 4096, 0, -1, 4096),
            range("ProfilerStep#4", 150.0, 50.0),
            // The same step's range again, nested, and the GPU's copy of it: one step.
            range("ProfilerStep#4", 151.0, 40.0),
            r#"{"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "pid": 0, "tid": 7, "ts": 180.0, "dur": 90.0}"#.to_owned(),
            memory(160.0, 13, 0x3000, -512, 0, -1, 0),
            memory(160.0, 12, 0x3000, 512, 0, -1, 512),
            memory(230.0, 14, 0x4000, 64, 0, -1, 576),
            range("ProfilerStep#5", 200.0, 0.0),
        ]);
        assert!(looks_like(&bytes));
        let trace = read(Path::new("t.json"), &bytes).unwrap();
        assert_eq!(trace.format, TraceFormat::Profiler);
        assert_eq!(
            kinds(&trace),
            [
                (EventKind::StepBegin(3), 0),
                (EventKind::Alloc, 4096),
                (EventKind::Free { released: false }, 4096),
                (EventKind::StepEnd(3), 0),
                (EventKind::StepBegin(4), 0),
                (EventKind::Alloc, 512),
                (EventKind::Free { released: false }, 512),
                (EventKind::StepEnd(4), 0),
                (EventKind::Alloc, 64),
            ],
            "a range of no duration is no step; past the CPU's range, the GPU's copy does not count"
        );
        assert_eq!(trace.events[1].t_ns, 10_250, "nanoseconds from the first event read");
        assert_eq!(trace.events[1].location, Location::TraceEvent(3), "the later event of the file, earlier in time");
        assert!(trace.warnings.is_empty());
    }

    #[test]
    fn steppool_ranges_give_steps_and_micro_steps_over_profiler_steps() {
        let bytes = chrome(&[
            range("ProfilerStep#0", 0.0, 100.0),
            range("steppool_step_0", 1.0, 90.0),
            range("steppool_micro_0_0", 2.0, 40.0),
            range("steppool_micro_0_1", 42.0, 40.0),
            memory(10.0, 1, 0x1000, 256, 0, -1, 256),
            memory(20.0, 2, 0x1000, -256, 0, -1, 0),
            memory(50.0, 3, 0x1000, 256, 0, -1, 256),
            memory(60.0, 4, 0x1000, -256, 0, -1, 0),
        ]);
        let trace = read(Path::new("t.json"), &bytes).unwrap();
        let boundaries: Vec<EventKind> = trace.events.iter().map(|e| e.kind).filter(|k| k.is_boundary()).collect();
        assert_eq!(
            boundaries,
            [
                EventKind::StepBegin(0),
                EventKind::MicroBegin(0, 0),
                EventKind::MicroEnd(0, 0),
                EventKind::MicroBegin(0, 1),
                EventKind::MicroEnd(0, 1),
                EventKind::StepEnd(0)
            ]
        );
    }

    #[test]
    fn cuda_events_are_replayed_and_memory_from_before_is_held() {
        let bytes = chrome(&[
            // 10 MiB allocated before profiling began on device 1: 1 MiB of it freed in the trace.
            memory(1.0, 1, 0xa000, 4096, 0, -1, 4096),
            memory(2.0, 2, 0x7f00_0000, 2 << 20, 1, 1, (10 << 20) + (2 << 20)),
            memory(3.0, 3, 0x7e00_0000, -(1 << 20), 1, 1, 11 << 20),
            memory(4.0, 4, 0x7f00_0000, -(2 << 20), 1, 1, 9 << 20),
        ]);
        let trace = read(Path::new("t.json"), &bytes).unwrap();
        assert_eq!(trace.devices.iter().map(|d| d.ordinal).collect::<Vec<_>>(), [1]);
        assert_eq!(trace.warnings.count(WarningKind::OtherDevice), 1, "the CPU tensor is left out");
        assert_eq!(trace.warnings.count(WarningKind::HeldBeforeRecording), 2);
        let analysis = analysis::analyse(&trace).unwrap();
        assert_eq!(analysis.peak_live_bytes, 12 << 20, "10 MiB from before and the 2 MiB allocated");
    }

    #[test]
    fn on_the_cpu_nothing_is_added_and_a_bare_list_reads() {
        // The CPU's total counts what an earlier session left in it: not memory held now.
        let events = [memory(1.0, 1, 0x1000, 100, 0, -1, 5 << 20), memory(2.0, 2, 0x1000, -100, 0, -1, 5 << 20)];
        let bytes = format!("[{}]", events.join(",")).into_bytes();
        assert!(looks_like(&bytes));
        let trace = read(Path::new("t.json"), &bytes).unwrap();
        assert_eq!(kinds(&trace), [(EventKind::Alloc, 100), (EventKind::Free { released: false }, 100)]);
        assert!(trace.warnings.is_empty());
    }

    #[test]
    fn addresses_and_sizes_out_of_range_are_errors_and_ranges_too_short_to_time_are_none() {
        for (addr, bytes) in [("-1", "64"), ("18446744073709551615", "64"), ("4096", "-9223372036854775808")] {
            let event = format!(
                r#"{{"ph": "i", "name": "[memory]", "ts": 1.0, "args": {{"Addr": {addr}, "Bytes": {bytes}}}}}"#
            );
            let error = read(Path::new("t.json"), &chrome(&[event])).unwrap_err().to_string();
            assert!(error.contains("traceEvents[1]") && error.contains("2^63 - 1"), "{error}");
        }
        // At 1e17 µs a duration of 1 is below the time's precision: begin and end would be one
        // time, the end ordered first.
        let bytes = chrome(&[range("steppool_step_0", 1e17, 1.0), memory(1e17, 1, 0x1000, 64, 0, -1, 64)]);
        let trace = read(Path::new("t.json"), &bytes).unwrap();
        assert_eq!(kinds(&trace), [(EventKind::Alloc, 64)]);
    }

    #[test]
    fn bad_events_are_typed_errors_naming_the_event() {
        let bytes = chrome(&[r#"{"ph": "i", "name": "[memory]", "ts": 1.0, "args": {"Bytes": 64}}"#.to_owned()]);
        let error = read(Path::new("t.json"), &bytes).unwrap_err().to_string();
        assert!(error.contains("traceEvents[1]") && error.contains("args.Addr"), "{error}");
        for truncated in [&b"{\"traceEvents\": ["[..], b"{\"traceEvents\": []} []", b"{\"other\": [1]}"] {
            let error = read(Path::new("t.json"), truncated).unwrap_err().to_string();
            assert!(error.contains("not a Chrome trace"), "{error}");
        }
        let error = read(Path::new("t.json"), b"{\"other\": [1]}").unwrap_err().to_string();
        assert!(error.contains("without `traceEvents`"), "{error}");
        assert!(!looks_like(b"{\"steps_start_ns\": [0, 10]}"), "a step sidecar is not a trace");
    }
}
