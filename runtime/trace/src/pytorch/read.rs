//! The reader of PyTorch memory snapshots' allocation traces; the format and the mapping are in
//! the [module docs](super).

use std::collections::HashSet;
use std::path::Path;

use serde_pickle::{DeOptions, HashableValue, Value};

use super::Action;
use super::scan::{self, MAX_DEPTH, MAX_OPEN_MARKS, Refusal};
use crate::error::{Location, Result, TraceError};
use crate::trace::{Event, EventKind, Trace, TraceFormat, WarningKind, check_device};

/// Reads a PyTorch memory snapshot pickle's allocation trace (see the [module docs](super));
/// `path` names it in messages.
pub fn read(path: &Path, bytes: &[u8]) -> Result<Trace> {
    let refused = |message: String| TraceError::malformed(path, Location::File, message);
    match scan::scan(bytes) {
        Ok(()) => {}
        Err(Refusal::TooDeep(at)) => {
            return Err(refused(format!("values nested deeper than {MAX_DEPTH} at byte {at}: not a memory snapshot")));
        }
        Err(Refusal::TooManyMarks(at)) => {
            return Err(refused(format!("more than {MAX_OPEN_MARKS} marks open at byte {at}: not a memory snapshot")));
        }
    }
    // PyTorch 2.11 shares one frames list among many entries. serde-pickle resolves a reference
    // made from inside a shared value once, and reports its second resolution as recursion: with
    // `replace_recursive_structures` such a value reads as `None`. Only frames (which the reader
    // does not need) are shared; a true cycle cannot occur in a snapshot's entries.
    let options = DeOptions::new().replace_unresolved_globals().replace_recursive_structures();
    let value = serde_pickle::value_from_slice(bytes, options)
        .map_err(|e| TraceError::Pickle { path: path.to_owned(), message: e.to_string() })?;
    let file = Location::File;
    let Value::Dict(snapshot) = value else {
        return Err(TraceError::malformed(path, file, "the pickle is not a dict: not a memory snapshot"));
    };
    let Some(device_traces) = get(&snapshot, "device_traces") else {
        return Err(TraceError::malformed(
            path,
            file,
            "the snapshot has no `device_traces`: record them with torch.cuda.memory._record_memory_history() \
             before torch.cuda.memory._dump_snapshot()",
        ));
    };
    let Value::List(device_traces) = device_traces else {
        return Err(TraceError::malformed(path, file, "`device_traces` is not a list"));
    };
    let mut trace = Trace::new(path, TraceFormat::PyTorch);
    trace.threads.push("python".to_owned());
    let mut events: Vec<(Option<u64>, u32, u64, Event)> = Vec::new();
    // Per device, the addresses its trace shows.
    let mut shown: Vec<HashSet<u64>> = Vec::new();
    for (device, entries) in device_traces.iter().enumerate() {
        let device_ordinal = check_device(path, file, device as u64)?;
        let Value::List(entries) = entries else {
            return Err(TraceError::malformed(path, file, format!("device_traces[{device}] is not a list")));
        };
        let mut live: HashSet<u64> = HashSet::new();
        let mut requested: HashSet<u64> = HashSet::new();
        let mut seen: HashSet<u64> = HashSet::new();
        for (index, entry) in entries.iter().enumerate() {
            let location = Location::Entry { device: device_ordinal, index: index as u64 };
            let bad = |message: String| TraceError::malformed(path, location, message);
            let Value::Dict(entry) = entry else {
                return Err(bad("the trace entry is not a dict".to_owned()));
            };
            let action = match get(entry, "action") {
                Some(Value::String(action)) => action.as_str(),
                Some(Value::Bytes(action)) => std::str::from_utf8(action).unwrap_or("?"),
                _ => return Err(bad("the trace entry has no `action` string".to_owned())),
            };
            let int = |key: &str| int_field(entry, key).map_err(bad);
            let time_us = int("time_us")?;
            let Some(known) = Action::from_name(action) else {
                trace.warnings.add(WarningKind::UnknownAction, location, || format!("action `{action}`"));
                continue;
            };
            let kind = match known {
                Action::Alloc => EventKind::Alloc,
                Action::FreeRequested | Action::FreeCompleted => EventKind::Free { released: false },
                Action::Oom => EventKind::AllocFailure,
                _ => continue,
            };
            let size = int("size")?.ok_or_else(|| bad(format!("`{action}` entry without `size`")))?;
            let addr = match kind {
                EventKind::AllocFailure => 0,
                _ => int("addr")?.ok_or_else(|| bad(format!("`{action}` entry without `addr`")))?,
            };
            match known {
                Action::Alloc => {
                    live.insert(addr);
                    requested.remove(&addr);
                }
                Action::FreeRequested => {
                    requested.insert(addr);
                    live.remove(&addr);
                }
                // The free was replayed at `free_requested`; only a trace without those frees here
                // (or the first free of memory allocated before the recording began).
                Action::FreeCompleted if requested.remove(&addr) || !(live.remove(&addr) || seen.insert(addr)) => {
                    continue;
                }
                _ => {}
            }
            seen.insert(addr);
            let stream = stream_field(entry);
            let mut event = Event::new(time_us.map_or(0, |t| t.saturating_mul(1000)), kind, location);
            event.ptr = addr;
            event.bytes = size;
            event.device = device_ordinal;
            event.stream = stream;
            events.push((time_us, device_ordinal, index as u64, event));
        }
        if !entries.is_empty() {
            trace.note_device(device_ordinal);
        }
        shown.push(seen);
    }
    let held = match get(&snapshot, "segments") {
        Some(segments) => held_blocks(path, segments, &shown)?,
        None => Vec::new(),
    };
    let timed = events.iter().all(|(time, ..)| time.is_some());
    if timed {
        // Stable: ties keep device order, then entry order.
        events.sort_by_key(|(time, device, index, _)| (*time, *device, *index));
    } else {
        // Without times, device after device, each in its order; times are the record counts.
        for (position, (_, _, _, event)) in events.iter_mut().enumerate() {
            event.t_ns = position as u64;
        }
    }
    let mut last = 0;
    for (_, _, _, event) in &events {
        if event.t_ns < last {
            trace.warnings.add(WarningKind::TimeBackwards, event.location, || {
                format!("time {} us after {} us", event.t_ns / 1000, last / 1000)
            });
        }
        last = last.max(event.t_ns);
    }
    trace.events = events.into_iter().map(|(_, _, _, event)| event).collect();
    trace.hold_from_start(held);
    Ok(trace)
}

/// The blocks of `segments` still allocated (`active_allocated`) at the snapshot's end that the
/// trace of their device never shows: memory allocated before the recording began (the model
/// built, then `_record_memory_history` called), as allocations of their requested size, on
/// the segment's stream. A device whose trace is empty is not replayed, and adds none.
fn held_blocks(path: &Path, segments: &Value, shown: &[HashSet<u64>]) -> Result<Vec<Event>> {
    let file = Location::File;
    let bad = |message: String| TraceError::malformed(path, file, message);
    let Value::List(segments) = segments else {
        return Err(bad("`segments` is not a list".to_owned()));
    };
    let mut held = Vec::new();
    for (s, segment) in segments.iter().enumerate() {
        let Value::Dict(segment) = segment else {
            return Err(bad(format!("segments[{s}] is not a dict")));
        };
        let int = |dict: &Dict, key: &str, at: &str| int_field(dict, key).map_err(|m| bad(format!("{at}: {m}")));
        let at = format!("segments[{s}]");
        let device = int(segment, "device", &at)?.unwrap_or(0);
        let Some(seen) = usize::try_from(device).ok().and_then(|device| shown.get(device)) else { continue };
        if seen.is_empty() {
            continue;
        }
        let stream = stream_field(segment);
        let mut address = int(segment, "address", &at)?.ok_or_else(|| bad(format!("{at} has no `address`")))?;
        let blocks = match get(segment, "blocks") {
            Some(Value::List(blocks)) => blocks.as_slice(),
            None => &[],
            Some(_) => return Err(bad(format!("{at}: `blocks` is not a list"))),
        };
        for (b, block) in blocks.iter().enumerate() {
            let at = format!("segments[{s}].blocks[{b}]");
            let Value::Dict(block) = block else {
                return Err(bad(format!("{at} is not a dict")));
            };
            let size = int(block, "size", &at)?.ok_or_else(|| bad(format!("{at} has no `size`")))?;
            // Blocks tile their segment; newer snapshots also give each block's address.
            let addr = int(block, "address", &at)?.unwrap_or(address);
            address = addr.saturating_add(size);
            let allocated = match get(block, "state") {
                Some(Value::String(state)) => state == "active_allocated",
                Some(Value::Bytes(state)) => state == b"active_allocated",
                _ => false,
            };
            if !allocated || seen.contains(&addr) {
                continue;
            }
            let mut event = Event::new(0, EventKind::Alloc, Location::Block { segment: s as u64, block: b as u64 });
            event.ptr = addr;
            event.bytes = int(block, "requested_size", &at)?.filter(|&bytes| bytes > 0).unwrap_or(size);
            event.device = device as u32;
            event.stream = stream;
            held.push(event);
        }
    }
    Ok(held)
}

/// A pickled dict.
type Dict = std::collections::BTreeMap<HashableValue, Value>;

/// The non-negative integer at `key`, none where it is absent or `None`; otherwise what is wrong.
fn int_field(dict: &Dict, key: &str) -> std::result::Result<Option<u64>, String> {
    match get(dict, key) {
        None | Some(Value::None) => Ok(None),
        Some(value) => integer(value).map(Some).ok_or_else(|| format!("`{key}` is {value:?}, not an integer")),
    }
}

/// The `stream` of an entry or segment: a cudaStream_t stored as int64, its bits kept; 0 without one.
fn stream_field(dict: &Dict) -> u64 {
    match get(dict, "stream") {
        Some(Value::I64(stream)) => *stream as u64,
        Some(value) => integer(value).unwrap_or(0),
        None => 0,
    }
}

fn get<'a>(dict: &'a Dict, key: &str) -> Option<&'a Value> {
    dict.get(&HashableValue::String(key.to_owned()))
        .or_else(|| dict.get(&HashableValue::Bytes(key.as_bytes().to_vec())))
}

/// A non-negative integer that fits in 64 bits.
fn integer(value: &Value) -> Option<u64> {
    match value {
        Value::I64(v) => u64::try_from(*v).ok(),
        Value::Int(v) => u64::try_from(v).ok(),
        Value::Bool(v) => Some(u64::from(*v)),
        _ => None,
    }
}
