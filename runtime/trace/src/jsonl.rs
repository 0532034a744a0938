//! steppool's own trace format: JSON lines, a header then one object per event. The runtime's
//! recorder writes it (`History::write_trace`), `steppool convert` writes it from any other
//! format, and every reader of steppool traces reads it here.
//!
//! # Version 1
//!
//! ```text
//! {"format":"steppool-trace","version":1,"driver":"...","devices":[{"ordinal":0,"total_bytes":N}],
//!  "phases":[{"name":"weights","scope":"persistent"},{"name":"activations","scope":"step"}, ...],
//!  "dropped_events":N}
//! {"t_ns":T,"event":"alloc","ptr":P,"bytes":B,"device":D,"stream":S,"phase":"activations","step":N,"thread":H}
//! {"t_ns":T,"event":"free", ... same keys ..., "release":true}   (release: freed by a boundary)
//! {"t_ns":T,"event":"step_begin","step":N}        {"t_ns":T,"event":"step_end","step":N}
//! {"t_ns":T,"event":"micro_begin","step":N,"micro":K}   {"t_ns":T,"event":"micro_end","step":N,"micro":K}
//! {"t_ns":T,"event":"oom","bytes":B,"device":D,"stream":S,"phase":"..."}
//! {"t_ns":T,"event":"warning","rule":"fragmentation","message":"..."}
//! ```
//!
//! `scope` is `persistent`, `step` or `micro_step` (a version 1 file may also spell it
//! `micro-step`, as early writers did). `dropped_events` counts the oldest events a bounded
//! recording dropped. `t_ns` never decreases. `step` on an allocation or a free is the step it
//! happened in, `null` outside steps. `thread` is a number naming the thread. A free whose
//! allocation came before the trace begins has no matching `alloc`. A `warning` is one of the
//! runtime's early warnings: telemetry, kept in [`Trace::alerts`], never replayed.
//!
//! Readers ignore keys they do not know; an unknown `event` is a counted warning; a phase the
//! header does not declare is a counted warning and the allocation is taken as untagged.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::error::{Location, Result, TraceError};
use crate::scope::Scope;
use crate::trace::{Alert, Event, EventKind, Threads, Trace, TraceFormat, TracePhase, WarningKind, check_device};

/// The `format` a steppool trace's header names.
pub const FORMAT: &str = "steppool-trace";

/// The version this crate writes.
pub const VERSION: u64 = 1;

/// The versions this crate reads.
pub const READS_VERSIONS: [u64; 1] = [1];

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

#[derive(Deserialize)]
struct HeaderDevice {
    ordinal: u64,
    #[serde(default)]
    total_bytes: Option<u64>,
}

#[derive(Deserialize)]
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
    rule: Option<String>,
    message: Option<String>,
}

/// The scope a version 1 header spells `name`: [`Scope::name`]'s spelling, or `micro-step`.
fn scope_v1(name: &str) -> Option<Scope> {
    match name {
        "micro-step" => Some(Scope::MicroStep),
        other => Scope::from_name(other),
    }
}

/// Reads a steppool trace (format `steppool-trace`, version 1); `path` names it in messages.
pub fn read(path: &Path, bytes: &[u8]) -> Result<Trace> {
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
            if header.format != FORMAT {
                return Err(bad(format!("format `{}` is not `{FORMAT}`", header.format)));
            }
            if !READS_VERSIONS.contains(&header.version) {
                return Err(bad(format!(
                    "trace version {} is not supported; this steppool reads version {}",
                    header.version,
                    READS_VERSIONS.map(|v| v.to_string()).join(", ")
                )));
            }
            trace.driver = header.driver;
            trace.dropped_events = header.dropped_events;
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
                let scope = scope_v1(&phase.scope).ok_or_else(|| {
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
            // The runtime's early warnings are telemetry, not workload: kept aside.
            "warning" => {
                trace.alerts.push(Alert {
                    at: trace.events.len(),
                    t_ns,
                    rule: record.rule.unwrap_or_default(),
                    message: record.message.unwrap_or_default(),
                });
                continue;
            }
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

/// How threads are written: their names when every name is a decimal number (as the runtime and
/// RMM name them), else their indices into [`Trace::threads`].
fn thread_numbers(trace: &Trace) -> Vec<u64> {
    let numbers: Option<Vec<u64>> = trace
        .threads
        .iter()
        .map(|name| name.parse::<u64>().ok().filter(|number| number.to_string() == *name))
        .collect();
    numbers.unwrap_or_else(|| (0..trace.threads.len() as u64).collect())
}

/// The step events before the first boundary happened in: the step a trace that begins inside
/// one (a bounded recording that dropped its `step_begin`) ends or subdivides first.
fn initial_step(trace: &Trace) -> Option<u64> {
    trace.events.iter().find(|event| event.kind.is_boundary()).and_then(|event| match event.kind {
        EventKind::StepEnd(n) | EventKind::MicroBegin(n, _) | EventKind::MicroEnd(n, _) => Some(n),
        _ => None,
    })
}

/// Writes `trace` in steppool's trace format, version [`VERSION`], and flushes `out`. Reading
/// the result gives back the same events, phases, devices, threads and alerts.
pub fn write(trace: &Trace, out: &mut dyn Write) -> std::io::Result<()> {
    let header = json!({
        "format": FORMAT,
        "version": VERSION,
        "driver": trace.driver.clone().unwrap_or_else(|| format!("converted from {}", trace.format.name())),
        "devices": trace.devices.iter().map(|d| json!({"ordinal": d.ordinal, "total_bytes": d.total_bytes})).collect::<Vec<_>>(),
        "phases": trace.phases.iter().map(|p| json!({"name": p.name, "scope": p.scope.name()})).collect::<Vec<_>>(),
        "dropped_events": trace.dropped_events,
    });
    write_line(out, &header)?;
    let threads = thread_numbers(trace);
    let mut alerts = trace.alerts.iter().peekable();
    let mut step = initial_step(trace);
    for (index, event) in trace.events.iter().enumerate() {
        while let Some(alert) = alerts.next_if(|alert| alert.at <= index) {
            write_alert(out, alert)?;
        }
        let mut line = Map::new();
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
                    line.insert("step".into(), step.map_or(Value::Null, Into::into));
                    let thread = threads.get(event.thread as usize).copied().unwrap_or(u64::from(event.thread));
                    line.insert("thread".into(), thread.into());
                }
                if let EventKind::Free { released: true } = event.kind {
                    line.insert("release".into(), true.into());
                }
            }
        }
        if matches!(event.kind, EventKind::StepEnd(_)) {
            step = None;
        }
        write_line(out, &Value::Object(line))?;
    }
    for alert in alerts {
        write_alert(out, alert)?;
    }
    out.flush()
}

fn write_alert(out: &mut dyn Write, alert: &Alert) -> std::io::Result<()> {
    write_line(out, &json!({"t_ns": alert.t_ns, "event": "warning", "rule": alert.rule, "message": alert.message}))
}

fn write_line(out: &mut dyn Write, value: &Value) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, value)?;
    out.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_text(text: &str) -> Result<Trace> {
        read(Path::new("t.jsonl"), text.as_bytes())
    }

    #[test]
    fn version_1_reads_either_spelling_of_the_micro_step_scope() {
        for spelling in ["micro_step", "micro-step"] {
            let header =
                format!(r#"{{"format":"steppool-trace","version":1,"phases":[{{"name":"m","scope":"{spelling}"}}]}}"#);
            assert_eq!(read_text(&header).unwrap().phases[0].scope, Scope::MicroStep, "{spelling}");
        }
        let error = read_text(r#"{"format":"steppool-trace","version":1,"phases":[{"name":"m","scope":"micro"}]}"#)
            .unwrap_err()
            .to_string();
        assert!(error.contains("use `persistent`, `step` or `micro_step`"), "{error}");
    }

    #[test]
    fn a_recorded_trace_round_trips_with_its_alerts_threads_and_dropped_events() {
        let text = [
            r#"{"format":"steppool-trace","version":1,"driver":"sim","devices":[{"ordinal":0,"total_bytes":1024}],"phases":[{"name":"act","scope":"micro_step"}],"dropped_events":3}"#,
            r#"{"t_ns":1,"event":"free","ptr":8,"bytes":4,"device":0,"stream":2,"phase":"act","step":4,"thread":9}"#,
            r#"{"t_ns":2,"event":"warning","rule":"fragmentation","message":"a \"quoted\" <message>"}"#,
            r#"{"t_ns":3,"event":"step_end","step":4}"#,
            r#"{"t_ns":4,"event":"alloc","ptr":16,"bytes":4,"device":0,"stream":2,"phase":"act","step":null,"thread":12}"#,
            r#"{"t_ns":5,"event":"warning","rule":"low_headroom","message":"last"}"#,
        ];
        let trace = read_text(&text.join("\n")).unwrap();
        assert_eq!(trace.dropped_events, 3);
        assert_eq!(trace.warnings.count(WarningKind::DroppedEvents), 3);
        assert_eq!(trace.threads, ["9", "12"]);
        assert_eq!(
            trace.alerts.iter().map(|a| (a.at, a.rule.as_str())).collect::<Vec<_>>(),
            [(1, "fragmentation"), (3, "low_headroom")]
        );
        let mut written = Vec::new();
        write(&trace, &mut written).unwrap();
        let lines: Vec<Value> =
            String::from_utf8(written).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect();
        let expected: Vec<Value> = text.iter().map(|line| serde_json::from_str(line).unwrap()).collect();
        assert_eq!(lines, expected, "the free before the first boundary is in step 4, which it ends");
    }

    #[test]
    fn threads_that_are_not_numbers_are_written_by_index() {
        let mut trace = Trace::new("x", TraceFormat::Rmm);
        trace.threads = vec!["main".into(), "7".into()];
        let mut event = Event::new(0, EventKind::Alloc, Location::Line(2));
        event.thread = 1;
        event.bytes = 1;
        trace.events.push(event);
        let mut written = Vec::new();
        write(&trace, &mut written).unwrap();
        let back = read(Path::new("x.jsonl"), &written).unwrap();
        assert_eq!(back.threads, ["1"]);
        assert_eq!(back.driver.as_deref(), Some("converted from rmm-csv"));
    }

    #[test]
    fn other_versions_are_refused_by_number() {
        let error = read_text(r#"{"format":"steppool-trace","version":2}"#).unwrap_err().to_string();
        assert!(error.contains("trace version 2 is not supported; this steppool reads version 1"), "{error}");
    }
}
