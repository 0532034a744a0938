//! steppool's own trace format, version 1: JSON lines, a header then one object per event.
//!
//! ```text
//! {"format":"steppool-trace","version":1,"driver":"...","devices":[{"ordinal":0,"total_bytes":N}],
//!  "phases":[{"name":"weights","scope":"persistent"},{"name":"activations","scope":"step"}, ...]}
//! {"t_ns":T,"event":"alloc","ptr":P,"bytes":B,"device":D,"stream":S,"phase":"activations","step":N,"thread":H}
//! {"t_ns":T,"event":"free", ... same keys ..., "release":true}   (release: freed by a boundary)
//! {"t_ns":T,"event":"step_begin","step":N}        {"t_ns":T,"event":"step_end","step":N}
//! {"t_ns":T,"event":"micro_begin","step":N,"micro":K}   {"t_ns":T,"event":"micro_end","step":N,"micro":K}
//! {"t_ns":T,"event":"oom","bytes":B,"device":D,"stream":S,"phase":"..."}
//! {"t_ns":T,"event":"warning","rule":"fragmentation","message":"..."}   (skipped: telemetry)
//! ```
//!
//! Unknown keys are ignored; an unknown `event` is a counted warning; a phase the header does not
//! declare is a counted warning and the allocation is taken as untagged.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use steppool::Scope;

use super::{Threads, check_device};
use crate::error::{Location, Result, TraceError};
use crate::trace::{Event, EventKind, Trace, TraceFormat, TracePhase, WarningKind};

#[derive(Deserialize)]
struct Header {
    format: String,
    version: u64,
    #[serde(default)]
    driver: Option<String>,
    #[serde(default)]
    devices: Vec<HeaderDevice>,
    #[serde(default)]
    phases: Vec<HeaderPhase>,
    #[serde(default)]
    dropped_events: u64,
}

#[derive(Deserialize, Serialize)]
struct HeaderDevice {
    ordinal: u64,
    #[serde(default)]
    total_bytes: Option<u64>,
}

#[derive(Deserialize, Serialize)]
struct HeaderPhase {
    name: String,
    scope: String,
}

#[derive(Deserialize)]
struct Line {
    t_ns: Option<u64>,
    event: Option<String>,
    ptr: Option<u64>,
    bytes: Option<u64>,
    device: Option<u64>,
    stream: Option<u64>,
    phase: Option<String>,
    step: Option<u64>,
    micro: Option<u32>,
    thread: Option<u64>,
    release: Option<bool>,
}

fn scope_from(name: &str) -> Option<Scope> {
    match name {
        "persistent" => Some(Scope::Persistent),
        "step" => Some(Scope::Step),
        "micro_step" | "micro-step" => Some(Scope::MicroStep),
        _ => None,
    }
}

fn scope_name(scope: Scope) -> &'static str {
    match scope {
        Scope::Persistent => "persistent",
        Scope::Step => "step",
        Scope::MicroStep => "micro_step",
    }
}

/// Reads a steppool trace (format `steppool-trace`, version 1).
pub fn read_steppool(path: &Path, bytes: &[u8]) -> Result<Trace> {
    let mut trace = Trace::new(path, TraceFormat::Steppool);
    let mut threads = Threads::default();
    let mut phases: HashMap<String, u16> = HashMap::new();
    let mut header_seen = false;
    let mut last_time = 0u64;
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    for (index, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let location = Location::Line(index as u64 + 1);
        let bad = |message: String| TraceError::malformed(path, location, message);
        let line = std::str::from_utf8(raw).map_err(|e| bad(format!("not UTF-8 text ({e})")))?;
        if line.trim().is_empty() {
            continue;
        }
        if !header_seen {
            let header: Header = serde_json::from_str(line).map_err(|e| bad(format!("not a trace header: {e}")))?;
            if header.format != "steppool-trace" {
                return Err(bad(format!("format `{}` is not `steppool-trace`", header.format)));
            }
            if header.version != 1 {
                return Err(bad(format!(
                    "trace version {} is not supported; this steppool reads version 1",
                    header.version
                )));
            }
            trace.driver = header.driver;
            trace.warnings.add_many(WarningKind::DroppedEvents, header.dropped_events, location, || {
                "record with a larger bound (`record_history`, `start_recording`)".to_owned()
            });
            for device in header.devices {
                let ordinal = check_device(path, location, device.ordinal)?;
                trace.note_device(ordinal);
                if let Some(slot) = trace.devices.iter_mut().find(|d| d.ordinal == ordinal) {
                    slot.total_bytes = device.total_bytes;
                }
            }
            for phase in header.phases {
                let scope = scope_from(&phase.scope).ok_or_else(|| {
                    bad(format!(
                        "phase `{}` has scope `{}`; use `persistent`, `step` or `micro_step`",
                        phase.name, phase.scope
                    ))
                })?;
                if phases.contains_key(&phase.name) {
                    return Err(bad(format!("phase `{}` is declared twice", phase.name)));
                }
                if trace.phases.len() >= usize::from(u16::MAX) {
                    return Err(bad("more than 65535 phases".to_owned()));
                }
                phases.insert(phase.name.clone(), trace.phases.len() as u16);
                trace.phases.push(TracePhase { name: phase.name, scope });
            }
            header_seen = true;
            continue;
        }
        let record: Line = serde_json::from_str(line).map_err(|e| bad(format!("not an event object: {e}")))?;
        let event_name = record.event.as_deref().ok_or_else(|| bad("no `event` key".to_owned()))?;
        let t_ns = record.t_ns.ok_or_else(|| bad(format!("`{event_name}` event without `t_ns`")))?;
        let need = |value: Option<u64>, key: &str| {
            value.ok_or_else(|| TraceError::malformed(path, location, format!("`{event_name}` event without `{key}`")))
        };
        let kind = match event_name {
            "alloc" => EventKind::Alloc,
            "free" => EventKind::Free { released: record.release.unwrap_or(false) },
            "oom" => EventKind::AllocFailure,
            "step_begin" => EventKind::StepBegin(need(record.step, "step")?),
            "step_end" => EventKind::StepEnd(need(record.step, "step")?),
            "micro_begin" => {
                EventKind::MicroBegin(need(record.step, "step")?, need(record.micro.map(u64::from), "micro")? as u32)
            }
            "micro_end" => {
                EventKind::MicroEnd(need(record.step, "step")?, need(record.micro.map(u64::from), "micro")? as u32)
            }
            // The runtime's early warnings are telemetry, not workload.
            "warning" => continue,
            other => {
                trace.warnings.add(WarningKind::UnknownAction, location, || format!("event `{other}`"));
                continue;
            }
        };
        if t_ns < last_time {
            trace.warnings.add(WarningKind::TimeBackwards, location, || format!("t_ns {t_ns} after {last_time}"));
        }
        last_time = last_time.max(t_ns);
        let mut event = Event::new(t_ns, kind, location);
        if matches!(kind, EventKind::Alloc | EventKind::Free { .. } | EventKind::AllocFailure) {
            if kind != EventKind::AllocFailure {
                event.ptr = need(record.ptr, "ptr")?;
            }
            event.bytes = need(record.bytes, "bytes")?;
            event.device = check_device(path, location, record.device.unwrap_or(0))?;
            event.stream = record.stream.unwrap_or(0);
            event.thread = threads.index(&mut trace, &record.thread.unwrap_or(0).to_string());
            if let Some(name) = &record.phase {
                match phases.get(name) {
                    Some(&phase) => event.phase = Some(phase),
                    None => trace.warnings.add(WarningKind::UnknownPhase, location, || format!("phase `{name}`")),
                }
            }
            trace.note_device(event.device);
        }
        trace.events.push(event);
    }
    if !header_seen {
        return Err(TraceError::malformed(path, Location::Line(1), "empty file: no steppool-trace header"));
    }
    Ok(trace)
}

/// Writes `trace` in steppool's trace format, version 1. Threads are written by index; reading
/// the result gives back the same events, phases and devices.
pub fn write_steppool(trace: &Trace, out: &mut dyn Write) -> std::io::Result<()> {
    let header = serde_json::json!({
        "format": "steppool-trace",
        "version": 1,
        "driver": trace.driver.clone().unwrap_or_else(|| format!("converted from {}", trace.format.name())),
        "devices": trace.devices.iter().map(|d| HeaderDevice { ordinal: u64::from(d.ordinal), total_bytes: d.total_bytes }).collect::<Vec<_>>(),
        "phases": trace.phases.iter().map(|p| HeaderPhase { name: p.name.clone(), scope: scope_name(p.scope).to_owned() }).collect::<Vec<_>>(),
    });
    writeln!(out, "{header}")?;
    let mut step: Option<u64> = None;
    for event in &trace.events {
        let mut line = serde_json::Map::new();
        line.insert("t_ns".into(), event.t_ns.into());
        let name = match event.kind {
            EventKind::Alloc => "alloc",
            EventKind::Free { .. } => "free",
            EventKind::AllocFailure => "oom",
            EventKind::StepBegin(n) => {
                step = Some(n);
                "step_begin"
            }
            EventKind::StepEnd(_) => "step_end",
            EventKind::MicroBegin(..) => "micro_begin",
            EventKind::MicroEnd(..) => "micro_end",
        };
        line.insert("event".into(), name.into());
        match event.kind {
            EventKind::StepBegin(n) | EventKind::StepEnd(n) => {
                line.insert("step".into(), n.into());
            }
            EventKind::MicroBegin(n, k) | EventKind::MicroEnd(n, k) => {
                line.insert("step".into(), n.into());
                line.insert("micro".into(), k.into());
            }
            EventKind::Alloc | EventKind::Free { .. } | EventKind::AllocFailure => {
                if event.kind != EventKind::AllocFailure {
                    line.insert("ptr".into(), event.ptr.into());
                }
                line.insert("bytes".into(), event.bytes.into());
                line.insert("device".into(), event.device.into());
                line.insert("stream".into(), event.stream.into());
                if let Some(phase) = event.phase.and_then(|p| trace.phases.get(usize::from(p))) {
                    line.insert("phase".into(), phase.name.clone().into());
                }
                if event.kind != EventKind::AllocFailure {
                    line.insert("step".into(), step.map_or(serde_json::Value::Null, Into::into));
                    line.insert("thread".into(), event.thread.into());
                }
                if let EventKind::Free { released: true } = event.kind {
                    line.insert("release".into(), true.into());
                }
            }
        }
        if matches!(event.kind, EventKind::StepEnd(_)) {
            step = None;
        }
        writeln!(out, "{}", serde_json::Value::Object(line))?;
    }
    Ok(())
}
