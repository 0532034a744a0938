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
    let value = serde_pickle::value_from_slice(bytes, DeOptions::new().replace_unresolved_globals())
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
    for (device, entries) in device_traces.iter().enumerate() {
        let device_ordinal = check_device(path, file, device as u64)?;
        let Value::List(entries) = entries else {
            return Err(TraceError::malformed(path, file, format!("device_traces[{device}] is not a list")));
        };
        let mut live: HashSet<u64> = HashSet::new();
        let mut requested: HashSet<u64> = HashSet::new();
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
            let int = |key: &str| -> Result<Option<u64>> {
                match get(entry, key) {
                    None | Some(Value::None) => Ok(None),
                    Some(value) => integer(value).map(Some).ok_or_else(|| {
                        TraceError::malformed(path, location, format!("`{key}` is {value:?}, not an integer"))
                    }),
                }
            };
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
                // The free was replayed at `free_requested`; only a trace without those frees here.
                Action::FreeCompleted if requested.remove(&addr) || !live.remove(&addr) => continue,
                _ => {}
            }
            // Streams are cudaStream_t values stored as int64: keep their bits.
            let stream = match get(entry, "stream") {
                Some(Value::I64(stream)) => *stream as u64,
                Some(value) => integer(value).unwrap_or(0),
                None => 0,
            };
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
    }
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
    Ok(trace)
}

fn get<'a>(dict: &'a std::collections::BTreeMap<HashableValue, Value>, key: &str) -> Option<&'a Value> {
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
