//! Step boundaries for traces that have none of their own: from a sidecar's `steps_start_ns`, or
//! inferred from the trace's periodic pattern.
//!
//! Inference looks for the *quiescent points* of the lifetime graph: the places between two events
//! where no allocation that the trace ever frees is live, only those it never frees (weights,
//! optimizer state). A training loop passes through one at every step boundary, when the step's
//! activations, gradients and workspace are gone. Quiescent points inside a step (between an
//! evaluation pass and a training pass, say) are told apart by periodicity: the segments between
//! consecutive points are compared by their numbers of events and allocations, and the smallest
//! period `r` at which at least three quarters of them repeat makes every `r`th point a step
//! boundary. The first segment (warm-up) is left out of the comparison.

use crate::error::Location;
use crate::trace::{Event, EventKind, StepSource, Trace};

/// Inserts step boundaries at `starts` (nanoseconds on the trace's clock): step `i` begins at the
/// first event at or after `starts[i]` and ends where step `i + 1` begins, the last one at the end
/// of the trace. Starts after the last event are ignored.
pub fn insert_step_starts(trace: &mut Trace, starts: &[i64]) {
    let mut starts: Vec<i64> = starts.to_vec();
    starts.sort_unstable();
    let mut events = Vec::with_capacity(trace.events.len() + 2 * starts.len());
    let mut next = 0;
    let mut step: Option<u64> = None;
    let mut clock = 0u64;
    for event in std::mem::take(&mut trace.events) {
        let before = clock;
        clock = clock.max(event.t_ns);
        while next < starts.len() && starts[next] <= clock.min(i64::MAX as u64) as i64 {
            // Between the events around it: a boundary never goes back in time.
            let at = (starts[next].max(0) as u64).clamp(before, clock);
            if let Some(n) = step {
                events.push(Event::new(at, EventKind::StepEnd(n), event.location));
            }
            let n = next as u64;
            events.push(Event::new(at, EventKind::StepBegin(n), event.location));
            step = Some(n);
            next += 1;
        }
        events.push(event);
    }
    if let Some(n) = step {
        events.push(Event::new(clock, EventKind::StepEnd(n), Location::File));
    }
    trace.events = events;
}

/// Infers step boundaries (see the module docs), inserts them, and says how it found them.
pub fn infer(trace: &mut Trace) -> StepSource {
    let points = quiescent_points(&trace.events);
    if points.is_empty() {
        return StepSource::None;
    }
    let every = period(&trace.events, &points);
    let starts: Vec<usize> = std::iter::once(0).chain(points.iter().copied().skip(every - 1).step_by(every)).collect();
    let mut events = Vec::with_capacity(trace.events.len() + 2 * starts.len());
    let mut step = 0u64;
    let mut clock = 0;
    let mut boundary = starts.iter().peekable();
    for (index, event) in std::mem::take(&mut trace.events).into_iter().enumerate() {
        if boundary.peek().is_some_and(|&&start| start == index) {
            boundary.next();
            let at = clock.max(event.t_ns);
            if index > 0 {
                events.push(Event::new(at, EventKind::StepEnd(step - 1), event.location));
            }
            events.push(Event::new(at, EventKind::StepBegin(step), event.location));
            step += 1;
        }
        clock = clock.max(event.t_ns);
        events.push(event);
    }
    if step > 0 {
        events.push(Event::new(clock, EventKind::StepEnd(step - 1), Location::File));
    }
    trace.events = events;
    StepSource::Inferred { every }
}

/// Event indices `p` (0 < p < n) before which no allocation that is freed later is live, the first
/// of each run of consecutive such indices, and only where an allocation follows before the next
/// point (a point must start something).
fn quiescent_points(events: &[Event]) -> Vec<usize> {
    let n = events.len();
    // crossing[p]: allocations made before event p and freed at or after it.
    let mut delta = vec![0i64; n + 1];
    let mut live: std::collections::HashMap<(u32, u64), usize> = std::collections::HashMap::new();
    for (index, event) in events.iter().enumerate() {
        match event.kind {
            EventKind::Alloc if event.bytes > 0 => {
                live.insert((event.device, event.ptr), index);
            }
            EventKind::Free { .. } => {
                if let Some(alloc) = live.remove(&(event.device, event.ptr)) {
                    delta[alloc + 1] += 1;
                    delta[index + 1] -= 1;
                }
            }
            _ => {}
        }
    }
    let mut points = Vec::new();
    let mut crossing = 0i64;
    let mut previous_quiet = true;
    let mut allocated_since = false;
    for (p, step) in delta.iter().enumerate().take(n) {
        crossing += step;
        let quiet = crossing == 0;
        if quiet && !previous_quiet && p > 0 && allocated_since {
            points.push(p);
            allocated_since = false;
        }
        previous_quiet = quiet;
        if matches!(events[p].kind, EventKind::Alloc) {
            allocated_since = true;
        }
    }
    // A point after which nothing is allocated does not start a step.
    while let Some(&last) = points.last() {
        if events[last..].iter().any(|e| matches!(e.kind, EventKind::Alloc)) {
            break;
        }
        points.pop();
    }
    points
}

/// The smallest number of quiescent points per step at which the segments between them repeat.
fn period(events: &[Event], points: &[usize]) -> usize {
    let bounds: Vec<usize> =
        std::iter::once(0).chain(points.iter().copied()).chain(std::iter::once(events.len())).collect();
    let segments: Vec<(usize, usize)> = bounds
        .windows(2)
        .map(|w| (w[1] - w[0], events[w[0]..w[1]].iter().filter(|e| matches!(e.kind, EventKind::Alloc)).count()))
        .collect();
    // Leave out the warm-up segment and the last one (a run may stop mid-step).
    let body = if segments.len() > 3 { &segments[1..segments.len() - 1] } else { &segments[..] };
    // Steps of more than 64 quiescent points are not looked for: the search is quadratic.
    for r in 1..=(body.len() / 2).min(64) {
        let pairs = body.len() - r;
        let same = (0..pairs).filter(|&j| body[j] == body[j + r]).count();
        if same * 4 >= pairs * 3 {
            return r;
        }
    }
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(ptr: u64, bytes: u64) -> Event {
        let mut event = Event::new(0, EventKind::Alloc, Location::File);
        event.ptr = ptr;
        event.bytes = bytes;
        event
    }

    fn free(ptr: u64) -> Event {
        let mut event = Event::new(0, EventKind::Free { released: false }, Location::File);
        event.ptr = ptr;
        event
    }

    #[test]
    fn quiescent_points_are_where_only_never_freed_memory_is_live() {
        // weights (never freed), then two steps of a, b.
        let events = vec![alloc(1, 100), alloc(2, 10), alloc(3, 10), free(3), free(2), alloc(2, 10), free(2)];
        assert_eq!(quiescent_points(&events), vec![5]);
    }

    #[test]
    fn the_period_skips_quiescent_points_inside_a_step() {
        // Each step: a short pass (1 alloc) then a long one (3 allocs); quiescent between them.
        let mut events = vec![alloc(1, 100)];
        for _ in 0..6 {
            events.extend([alloc(2, 1), free(2)]);
            events.extend([alloc(3, 1), alloc(4, 1), alloc(5, 1), free(5), free(4), free(3)]);
        }
        let points = quiescent_points(&events);
        assert_eq!(points.len(), 11);
        assert_eq!(period(&events, &points), 2);
    }
}
