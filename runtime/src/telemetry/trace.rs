//! The history in the shared trace model ([`steppool_trace::Trace`]), and written as a steppool
//! trace file by the model's writer; the format is documented in [`steppool_trace::jsonl`].

#[cfg(feature = "trace")]
use std::io::{self, Write};

use steppool_trace::{Alert, Event, EventKind as TraceKind, Location, Trace, TraceDevice, TraceFormat, TracePhase};

use super::history::{EventKind, History};

impl History {
    /// The history as a trace in the model the CLI, the benchmarks and the trace files share:
    /// allocations, frees, failed allocations and boundaries become [`steppool_trace::Event`]s
    /// (tagged with their phase by index, their stream by the runtime's stream id, their thread
    /// by number), early warnings become [`steppool_trace::Alert`]s. Segments and reservations
    /// are the runtime's own doing, not the workload's, and are left out. Each event's location
    /// is the line it takes in the written trace.
    pub fn to_trace(&self) -> Trace {
        let mut trace = Trace::new("recorded history", TraceFormat::Steppool);
        trace.driver = Some(self.driver.clone());
        trace.dropped_events = self.dropped;
        trace.devices = self
            .devices
            .iter()
            .map(|&(ordinal, total)| TraceDevice { ordinal: ordinal as u32, total_bytes: Some(total) })
            .collect();
        trace.phases =
            self.phases.iter().map(|(name, scope)| TracePhase { name: name.clone(), scope: *scope }).collect();
        let mut threads: Vec<u64> = Vec::new();
        let mut thread_index = |thread: u64| match threads.iter().position(|&t| t == thread) {
            Some(index) => index as u32,
            None => {
                threads.push(thread);
                threads.len() as u32 - 1
            }
        };
        for event in &self.events {
            // The header is line 1; every event and alert written before this one takes a line.
            let location = Location::Line(2 + (trace.events.len() + trace.alerts.len()) as u64);
            let t = event.t_ns;
            let (kind, pool, ptr, bytes, thread) = match &event.kind {
                EventKind::Alloc { pool, ptr, bytes, thread, .. } => {
                    (TraceKind::Alloc, Some(*pool), *ptr, *bytes, thread_index(*thread))
                }
                EventKind::Free { pool, ptr, bytes, thread, release, .. } => {
                    (TraceKind::Free { released: *release }, Some(*pool), *ptr, *bytes, thread_index(*thread))
                }
                EventKind::Oom { pool, bytes, .. } => (TraceKind::AllocFailure, Some(*pool), 0, *bytes, 0),
                EventKind::StepBegin { step } => (TraceKind::StepBegin(*step), None, 0, 0, 0),
                EventKind::StepEnd { step } => (TraceKind::StepEnd(*step), None, 0, 0, 0),
                EventKind::MicroBegin { step, micro } => (TraceKind::MicroBegin(*step, *micro), None, 0, 0, 0),
                EventKind::MicroEnd { step, micro } => (TraceKind::MicroEnd(*step, *micro), None, 0, 0, 0),
                EventKind::Warning { rule, message } => {
                    let at = trace.events.len();
                    trace.alerts.push(Alert { at, t_ns: t, rule: (*rule).to_owned(), message: message.clone() });
                    continue;
                }
                EventKind::SegmentAlloc { .. } | EventKind::SegmentFree { .. } | EventKind::Reserved { .. } => continue,
            };
            let mut written = Event::new(t, kind, location);
            written.ptr = ptr;
            written.bytes = bytes;
            written.thread = thread;
            if let Some(pool) = pool {
                written.device = pool.device as u32;
                written.stream = u64::from(pool.stream);
                written.phase = Some(pool.phase.index() as u16);
            }
            trace.events.push(written);
        }
        trace.threads = threads.iter().map(u64::to_string).collect();
        trace
    }

    /// Writes the history as a steppool trace ([`steppool_trace::jsonl`], the version it writes),
    /// which `steppool replay` reads.
    #[cfg(feature = "trace")]
    pub fn write_trace(&self, out: &mut impl Write) -> io::Result<()> {
        steppool_trace::jsonl::write(&self.to_trace(), out)
    }
}
