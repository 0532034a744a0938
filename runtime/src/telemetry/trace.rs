//! The history as a steppool trace file; the format is documented in [`crate::telemetry`].

use std::io::{self, Write};

use serde_json::{Value, json};

use super::history::{EventKind, History};
use crate::phase::Scope;

fn scope_name(scope: Scope) -> &'static str {
    match scope {
        Scope::Persistent => "persistent",
        Scope::Step => "step",
        Scope::MicroStep => "micro_step",
    }
}

impl History {
    /// Writes the history as a steppool trace (format 1, documented in [`crate::telemetry`]),
    /// which `steppool replay` reads.
    pub fn write_trace(&self, out: &mut impl Write) -> io::Result<()> {
        let header = json!({
            "format": "steppool-trace",
            "version": 1,
            "driver": self.driver,
            "devices": self.devices.iter().map(|&(ordinal, total)| json!({"ordinal": ordinal, "total_bytes": total})).collect::<Vec<_>>(),
            "phases": self.phases.iter().map(|(name, scope)| json!({"name": name, "scope": scope_name(*scope)})).collect::<Vec<_>>(),
            "dropped_events": self.dropped,
        });
        write_line(out, &header)?;
        for event in &self.events {
            let t = event.t_ns;
            let line = match &event.kind {
                EventKind::Alloc { pool, ptr, bytes, step, thread } => json!({
                    "t_ns": t, "event": "alloc", "ptr": ptr, "bytes": bytes, "device": pool.device,
                    "stream": pool.stream, "phase": self.phase_name(pool.phase), "step": step, "thread": thread,
                }),
                EventKind::Free { pool, ptr, bytes, step, thread, release } => {
                    let mut line = json!({
                        "t_ns": t, "event": "free", "ptr": ptr, "bytes": bytes, "device": pool.device,
                        "stream": pool.stream, "phase": self.phase_name(pool.phase), "step": step, "thread": thread,
                    });
                    if *release {
                        line["release"] = Value::Bool(true);
                    }
                    line
                }
                EventKind::StepBegin { step } => json!({"t_ns": t, "event": "step_begin", "step": step}),
                EventKind::StepEnd { step } => json!({"t_ns": t, "event": "step_end", "step": step}),
                EventKind::MicroBegin { step, micro } => {
                    json!({"t_ns": t, "event": "micro_begin", "step": step, "micro": micro})
                }
                EventKind::MicroEnd { step, micro } => {
                    json!({"t_ns": t, "event": "micro_end", "step": step, "micro": micro})
                }
                EventKind::Oom { pool, bytes, .. } => json!({
                    "t_ns": t, "event": "oom", "bytes": bytes, "device": pool.device, "stream": pool.stream,
                    "phase": self.phase_name(pool.phase),
                }),
                EventKind::Warning { rule, message } => {
                    json!({"t_ns": t, "event": "warning", "rule": rule, "message": message})
                }
                EventKind::SegmentAlloc { .. } | EventKind::SegmentFree { .. } | EventKind::Reserved { .. } => continue,
            };
            write_line(out, &line)?;
        }
        out.flush()
    }
}

fn write_line(out: &mut impl Write, value: &Value) -> io::Result<()> {
    serde_json::to_writer(&mut *out, value)?;
    out.write_all(b"\n")
}
