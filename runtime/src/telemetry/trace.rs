//! The history in the shared trace model ([`steppool_trace::Trace`]), and written as a steppool
//! trace file by the model's writer; the format is documented in [`steppool_trace::jsonl`].

#[cfg(feature = "trace")]
use std::io::{self, Write};

use steppool_trace::{
    Alert, Event, EventKind as TraceKind, Location, StepSource, Trace, TraceDevice, TraceFormat, TracePhase,
};

use super::history::{EventKind, History};

impl History {
    /// The history as a trace in the model the CLI, the benchmarks and the trace files share:
    /// allocations, frees, failed allocations and boundaries become [`steppool_trace::Event`]s
    /// (tagged with their phase by index, their stream by the runtime's stream id, their thread
    /// by number), early warnings become [`steppool_trace::Alert`]s. Segments and reservations
    /// are the runtime's own doing, not the workload's, and are left out, as are graph launches
    /// and graph memory readings. Each event's location is the line it takes in the written trace.
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
                EventKind::SegmentAlloc { .. }
                | EventKind::SegmentFree { .. }
                | EventKind::SegmentMap { .. }
                | EventKind::SegmentUnmap { .. }
                | EventKind::Reserved { .. }
                | EventKind::GraphLaunch { .. }
                | EventKind::GraphMemory { .. } => continue,
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
        trace.steps = if trace.has_steps() { StepSource::Trace } else { StepSource::None };
        trace
    }

    /// Writes the history as a steppool trace ([`steppool_trace::jsonl`], the version it writes),
    /// which `steppool replay` reads.
    #[cfg(feature = "trace")]
    pub fn write_trace(&self, out: &mut impl Write) -> io::Result<()> {
        steppool_trace::jsonl::write(&self.to_trace(), out)
    }
}

#[cfg(test)]
mod tests {
    use steppool_trace::{EventKind as TraceKind, Location, Scope, StepSource};

    use crate::Phase;
    use crate::report::PoolId;
    use crate::telemetry::{Event, EventKind, History};

    #[test]
    fn the_history_becomes_trace_events_and_alerts_without_its_segments() {
        let pool = PoolId { device: 1, stream: 3, phase: Phase::ACTIVATIONS };
        let event = |t_ns, kind| Event { t_ns, kind };
        let history = History {
            events: vec![
                event(1, EventKind::StepBegin { step: 4 }),
                event(2, EventKind::SegmentAlloc { pool, ptr: 4096, bytes: 8192, pool_reserved: 8192 }),
                event(3, EventKind::Alloc { pool, ptr: 4096, bytes: 100, step: Some(4), thread: 7 }),
                event(4, EventKind::Warning { rule: "fragmentation", message: "high".into() }),
                event(5, EventKind::Free { pool, ptr: 4096, bytes: 100, step: Some(4), thread: 2, release: true }),
                event(6, EventKind::Reserved { pool, pool_reserved: 0 }),
                event(7, EventKind::StepEnd { step: 4 }),
            ],
            dropped: 2,
            phases: vec![
                ("weights".into(), Scope::Persistent),
                ("optimizer_state".into(), Scope::Persistent),
                ("activations".into(), Scope::Step),
            ],
            driver: "simulated".into(),
            devices: vec![(0, 1 << 30), (1, 1 << 30)],
            ..History::default()
        };
        let trace = history.to_trace();
        let kinds: Vec<TraceKind> = trace.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [TraceKind::StepBegin(4), TraceKind::Alloc, TraceKind::Free { released: true }, TraceKind::StepEnd(4)]
        );
        let free = &trace.events[2];
        assert_eq!((free.device, free.stream, free.ptr, free.bytes), (1, 3, 4096, 100));
        assert_eq!(trace.phases[usize::from(free.phase.unwrap())].name, "activations");
        assert_eq!(trace.threads[free.thread as usize], "2");
        assert_eq!(trace.threads, ["7", "2"]);
        // Header on line 1, the alert on line 4: the free after it is on line 5.
        assert_eq!(free.location, Location::Line(5));
        assert_eq!((trace.alerts[0].at, trace.alerts[0].rule.as_str()), (2, "fragmentation"));
        assert_eq!((trace.dropped_events, trace.devices.len(), trace.steps.clone()), (2, 2, StepSource::Trace));
    }
}
