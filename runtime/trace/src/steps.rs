//! Step boundaries for traces that have none of their own: from a sidecar's `steps_start_ns`, or
//! inferred from the trace's periodic pattern.
//!
//! Inference looks for the *quiescent points* of the lifetime graph: the places between two events
//! where no allocation that counts is live. A training loop passes through one at every step
//! boundary, when the step's activations, gradients and workspace are gone and only state that
//! outlives steps (weights, optimizer state, batches held for the run) is left.
//!
//! Which allocations count is found by trying lifetime limits from the longest down. At the first
//! limit every allocation that is ever freed counts, and only those never freed are left out. A
//! real trace also frees some memory that outlives many steps: input batches allocated before the
//! loop and freed at teardown, batches prefetched up front and freed one per step, a buffer held
//! across a few steps. Each such allocation hides every boundary it spans, and at the first limit
//! there may be no quiescent point at all, or steps merged into segments several steps long. So
//! the limit is lowered, by a quarter at a time down to [`SHORTEST_LIMIT`] events, and an
//! allocation freed `limit` or more events after it was made is left out as long-lived, until the
//! boundaries found are *regular*: no step is longer than one and a half times the median step
//! (the lower median, in events), and none but the first and the last shorter than a quarter of
//! it. A missed boundary makes a step about twice as long as its neighbours, a boundary too many
//! a short one; steps of variable length (sequence length, batch size) keep their number of
//! operations, so they pass. The first step alone may pass points of its own: an optimizer's
//! first step makes its state between temporaries made and freed one after another, and where
//! the gradients are left out as long-lived (a loop that copies its batch, then calls
//! `zero_grad()`: they live about a step), each temporary ends in one. Where the steps are
//! regular once the short steps at the start are joined to the next, the first step runs from
//! its start to the first boundary after them (on a recorded token-budget GPT-2, four such
//! points, found as 12 steps of 8). The search stops short once more than one in
//! [`MOST_LONG_LIVED`] of the freed allocations would be left out: memory that many allocations
//! hold is each step's own work, not state that outlives steps. If no limit gives regular steps,
//! the first limit that gives any boundaries is taken, unless its first step is longer than all
//! the others together, three or more: those points are one step's own, not steps. A loop that
//! hands its gradients to the next step (set to `None` between the passes) has no point between
//! its steps, but its last step's gradients are never freed, and each temporary of that step's
//! optimizer update passes one: on recorded logs of that loop under SGD with clipping, 63 or 71
//! steps, the first of them the whole run but its last few hundred events. Such a trace is read
//! as one with no quiescent point (below); if none is found there either, it has no steps.
//! Lifetime alone cannot tell memory held about one step (a batch prefetched one step ahead) from
//! a step's own memory of about that lifetime (gradients kept across the micro-steps of gradient
//! accumulation): there no limit separates them, and the steps found are the first limit's.
//!
//! At each limit, quiescent points inside a step (between an evaluation pass and a training pass,
//! say) are told apart by periodicity: the segments between consecutive points are compared by
//! their numbers of events and allocations, and the period `r` at which the most of them repeat,
//! at least three quarters (the smallest such on a tie), makes every `r`th point a step boundary.
//! The best period, not the smallest that repeats: steps of many points, each segment like the
//! next, repeat at every period. A loop whose gradients outlive the steps
//! (`zero_grad(set_to_none=False)`) has freed all its counted memory after each backward pass, and
//! every temporary of its optimizer step, made and freed one after another, is a point of its
//! own: most neighbouring segments are two such temporaries alike, and only the step's own number
//! of points pairs the backward passes too. The first segment (warm-up)
//! and the last are left out of the comparison, and a period longer than one needs at least three
//! pairs of segments compared, so that two steps of the same size by chance do not pair up. The
//! trace alone cannot tell a pass inside a step from a step of its own: a loop recorded as steps
//! train, train, eval infers as one step of all three. The first step
//! begins at the first allocation that counts: what comes before it (weights, optimizer state,
//! long-lived batches) is set-up, as a recording's own step boundaries have it. Except what
//! makes the first step begin as the second does: a batch copied at each step's start and freed
//! by the next step lives about a step, is left out as long-lived, and is not counted; the later
//! steps begin with their copy, and the first step's start moves back over the allocations right
//! before it that are the second step's first ones, where the first step's own allocations then
//! follow the second's (`aligned_first`; on a recorded BERT that copies its batch and calls
//! `zero_grad()` between the passes, the first step began after its copy, and its plan, which
//! saw no copy, made a guess the loop proved wrong: 308 MiB over the run, 288 with the copy).
//! Each later step begins at the first allocation of its quiescent run: memory left out as
//! long-lived and freed at the end of a step (gradients freed by `zero_grad`, say) stays in that
//! step.
//!
//! Memory never freed is set-up, except what the last step holds at the trace's end. A loop that
//! calls `zero_grad()` as its first statement frees a step's gradients at the top of the next
//! iteration; the last iteration has no next one, so its gradients are never freed, and without
//! them the rest of that step (an optimizer step's temporaries, one after another) passes a
//! quiescent point every few events: measured on a recorded BERT trace with a foreach AdamW,
//! 124 steps of four events each after the last real boundary. So at each limit, every allocation
//! never freed that is made after the first quiescent point (weights and the optimizer state
//! come before it) counts as freed at the trace's last event, under the same limit as any other:
//! the last step's gradients hide the points of its own end, and state made later in the run and
//! kept to the end is left out as long-lived once the limit falls below its lifetime. The replay
//! releases such memory at the last step's end ([`crate::analysis`]).
//!
//! Where no limit gives a quiescent point at all, or only the points of one step, the steps are
//! found from the period of the allocation sizes instead. A loop that hands about a seventh of each step's allocations to the
//! next (gradients made in its backward pass and set to `None` between the next step's passes),
//! whose other memory lives as long (activations made early in the forward pass), has memory of
//! its own live at every point, and lifetime cannot tell the two apart. Its steps repeat their
//! operations, so the sizes repeat at the step's number of allocations: the lag at which the
//! most sizes recur, less the lags of a layer's repetition (whose boundaries, falling at every
//! phase of the step, leave the step's average live), at the phase where the least memory that
//! is ever freed is live (the step's own work done, what it hands on left). On a recorded BERT
//! of 1 GiB live under SGD, copying its batch before its step's mark and calling `zero_grad()`
//! between the passes, it finds a step every 421 allocations, beginning where the batch is
//! copied (the sidecar's marks come right after the copy).
//!
//! Each search is linear in the events, and there are about `log(n / 16) / log(4 / 3)` of them
//! (31 for 100,000 events), plus a period search bounded by [`MOST_POINTS_PER_STEP`] points a
//! step. The period of the sizes, where it is looked for, costs at most 2²⁷ comparisons of two
//! sizes and a pass over the allocations per candidate lag.
//!
//! A long-lived allocation keeps its real lifetime in the replay: made before an inferred boundary
//! and freed after it, it is persistent (see [`crate::analysis`]), never released at a boundary.

use crate::error::Location;
use crate::trace::{Event, EventKind, StepSource, Trace};

/// Inserts step boundaries at `starts` (nanoseconds on the trace's clock): step `i` begins at the
/// first event at or after `starts[i]` and ends where step `i + 1` begins, the last one at the end
/// of the trace. Starts after the last event are ignored. Then, as for every trace, a step begins
/// at its first allocation ([`begin_at_first_allocation`]).
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
    begin_at_first_allocation(trace);
}

/// Moves each step and micro-step boundary past the frees that follow it, up to the first
/// allocation after it: a scope begins at its first allocation, and what is freed between the
/// boundary and that allocation is freed in the scope that ends.
///
/// A boundary marks where the loop's iteration begins, and what an iteration frees before it
/// allocates anything is the previous iteration's memory: gradients set to `None` by
/// `zero_grad()` as the loop's first statement (the most common way to write it), the previous
/// step's outputs dropped. Those frees stay in the step that made the memory, as they do at an
/// inferred boundary (each step begins at the first allocation of its quiescent run), so memory
/// the next iteration's first statements free is the step's own, not persistent, and a plan
/// holds it with the step's other memory. The replay begins the step there, as a loop would that
/// begins its step after `zero_grad()`, or a runtime that takes a boundary at the next allocation.
/// Frees a boundary itself released (a steppool trace's `release`) stay after it. Moved
/// boundaries (and such frees) keep their order and take the time of the last free moved ahead of
/// them, so time never goes back.
pub fn begin_at_first_allocation(trace: &mut Trace) {
    let mut events = Vec::with_capacity(trace.events.len());
    let mut held: Vec<Event> = Vec::new();
    let mut clock = 0;
    for event in std::mem::take(&mut trace.events) {
        match event.kind {
            kind if kind.is_boundary() => held.push(event),
            EventKind::Free { released: true } if !held.is_empty() => held.push(event),
            EventKind::Free { released: false } if !held.is_empty() => {
                clock = clock.max(event.t_ns);
                events.push(event);
            }
            _ => {
                for mut boundary in held.drain(..) {
                    boundary.t_ns = boundary.t_ns.max(clock);
                    events.push(boundary);
                }
                clock = clock.max(event.t_ns);
                events.push(event);
            }
        }
    }
    for mut boundary in held {
        boundary.t_ns = boundary.t_ns.max(clock);
        events.push(boundary);
    }
    trace.events = events;
}

/// The shortest lifetime limit, in events, that inference tries (see the module docs).
pub const SHORTEST_LIMIT: usize = 16;

/// Inference stops lowering the lifetime limit once more than one in this many freed allocations
/// would be left out as long-lived (see the module docs).
pub const MOST_LONG_LIVED: usize = 16;

/// Infers step boundaries (see the module docs), inserts them, and says how it found them.
pub fn infer(trace: &mut Trace) -> StepSource {
    let (mut starts, source) = match boundaries(&trace.events) {
        Some(found) => {
            let Found { starts, every, long_lived, limit } = found;
            (starts, StepSource::Inferred { every, long_lived, limit })
        }
        None => match periodic(&trace.events) {
            Some((starts, allocations)) => (starts, StepSource::Periodic { allocations }),
            None => return StepSource::None,
        },
    };
    starts[0] = aligned_first(&trace.events, &starts);
    let mut events = Vec::with_capacity(trace.events.len() + 2 * starts.len());
    let mut step = 0u64;
    let mut clock = 0;
    let mut boundary = starts.iter().peekable();
    for (index, event) in std::mem::take(&mut trace.events).into_iter().enumerate() {
        if boundary.peek().is_some_and(|&&start| start == index) {
            boundary.next();
            let at = clock.max(event.t_ns);
            if step > 0 {
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
    source
}

/// The most allocations the first step's start moves back over ([`aligned_first`]).
const MOST_ALIGNED: usize = 8;

/// How many allocations of the first step after its start must match the second step's, once
/// aligned, for the first step's start to move ([`aligned_first`]).
const ALIGNED_MATCH: usize = 8;

/// The first step's start at `starts[0]`, moved back over the allocations right before it (no
/// other event between them) that make the first step begin as the second does: the `k`
/// allocations before it are the second step's first `k` sizes, in order, and the next
/// [`ALIGNED_MATCH`] of the first step's own are the second step's after those, where the first
/// step as found does not already begin as the second does. What a step makes first and frees
/// in the next (a batch copied at the step's start, freed by the next step once it has copied its
/// own) lives about a step, is left out as long-lived, and the first step began after it; the
/// later steps begin with it, at their quiescent runs' first allocation. The largest such `k`,
/// at most [`MOST_ALIGNED`].
fn aligned_first(events: &[Event], starts: &[usize]) -> usize {
    let begin = starts[0];
    let Some(&second) = starts.get(1) else { return begin };
    let end = starts.get(2).copied().unwrap_or(events.len());
    let sizes = |range: std::ops::Range<usize>| -> Vec<u64> {
        events[range].iter().filter(|event| matches!(event.kind, EventKind::Alloc)).map(|event| event.bytes).collect()
    };
    let (first, next) = (sizes(begin..second), sizes(second..end));
    let lines_up = |k: usize| {
        let matched = ALIGNED_MATCH.min(first.len()).min(next.len().saturating_sub(k));
        matched > 0 && first[..matched] == next[k..k + matched]
    };
    if lines_up(0) {
        return begin;
    }
    let before = events[..begin].iter().rev().take_while(|event| matches!(event.kind, EventKind::Alloc)).count();
    (1..=before.min(MOST_ALIGNED).min(next.len()))
        .rev()
        .find(|&k| {
            let moved: Vec<u64> = events[begin - k..begin].iter().map(|event| event.bytes).collect();
            moved == next[..k] && lines_up(k)
        })
        .map_or(begin, |k| begin - k)
}

/// Step boundaries found by [`boundaries`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct Found {
    /// Event indices at which the steps begin, ascending.
    starts: Vec<usize>,
    /// Quiescent points per step.
    every: usize,
    /// Freed allocations left out as long-lived.
    long_lived: usize,
    /// The lifetime limit (events) at and above which they were left out; `None` when none was.
    limit: Option<usize>,
}

/// The allocations that are freed, by the indices of their allocation and free events.
struct Lifetimes {
    spans: Vec<(usize, usize)>,
    /// `allocs_before[i]`: allocation events before event `i`.
    allocs_before: Vec<usize>,
    /// The allocation events of the allocations never freed, ascending.
    unfreed: Vec<usize>,
}

impl Lifetimes {
    fn new(events: &[Event]) -> Lifetimes {
        let mut live: std::collections::HashMap<(u32, u64), usize> = std::collections::HashMap::new();
        let mut spans = Vec::new();
        let mut allocs_before = Vec::with_capacity(events.len() + 1);
        let mut allocs = 0;
        for (index, event) in events.iter().enumerate() {
            allocs_before.push(allocs);
            match event.kind {
                EventKind::Alloc => {
                    allocs += 1;
                    if event.bytes > 0 {
                        live.insert((event.device, event.ptr), index);
                    }
                }
                EventKind::Free { .. } => {
                    if let Some(alloc) = live.remove(&(event.device, event.ptr)) {
                        spans.push((alloc, index));
                    }
                }
                _ => {}
            }
        }
        allocs_before.push(allocs);
        let mut unfreed: Vec<usize> = live.into_values().collect();
        unfreed.sort_unstable();
        Lifetimes { spans, allocs_before, unfreed }
    }

    /// These lifetimes, with every allocation never freed that is made after event `first` held
    /// to the trace's last event (see the module docs); `None` when there is none.
    fn holding_to_end(&self, first: usize, events: usize) -> Option<Lifetimes> {
        let held = self.unfreed.partition_point(|&alloc| alloc <= first);
        if held == self.unfreed.len() {
            return None;
        }
        let mut spans = self.spans.clone();
        spans.extend(self.unfreed[held..].iter().map(|&alloc| (alloc, events - 1)));
        Some(Lifetimes { spans, allocs_before: self.allocs_before.clone(), unfreed: Vec::new() })
    }

    /// The allocations that count under `limit`: freed fewer than `limit` events after they were
    /// made.
    fn counted(&self, limit: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.spans.iter().copied().filter(move |&(alloc, free)| free - alloc < limit)
    }
}

/// The step boundaries of `events` under the rule of the module docs; `None` when no lifetime
/// limit gives a quiescent point.
fn boundaries(events: &[Event]) -> Option<Found> {
    let lifetimes = Lifetimes::new(events);
    let freed = lifetimes.spans.len();
    // Every lifetime is shorter than the trace: at this limit every freed allocation counts.
    let mut limit = events.len() + 1;
    let mut first = None;
    loop {
        let long_lived = freed - lifetimes.counted(limit).count();
        if long_lived * MOST_LONG_LIVED > freed {
            break;
        }
        let mut points = quiescent_points(events, &lifetimes, limit);
        if let Some(held) = points.first().and_then(|&first| lifetimes.holding_to_end(first, events.len())) {
            points = quiescent_points(events, &held, limit);
        }
        if let Some(&first_point) = points.first() {
            // The first step begins at the first allocation that counts (before the first point).
            let begin = lifetimes.counted(limit).map(|(alloc, _)| alloc).min().unwrap_or(0).min(first_point);
            let every = period(&lifetimes.allocs_before, &points);
            let starts: Vec<usize> =
                std::iter::once(begin).chain(points.iter().copied().skip(every - 1).step_by(every)).collect();
            // The first step may hold points of its own (the optimizer's state made, temporaries
            // one after another with the gradients left out), each a step shorter than a quarter
            // of the median: where the steps are regular once those boundaries are dropped, the
            // first step runs to the next one.
            let lengths = step_lengths(&starts, events.len());
            let median = median_step(&starts, events.len());
            let short = lengths.iter().take_while(|&&length| 4 * length < median).count().min(starts.len() - 1);
            let dropping =
                |dropped: usize| -> Vec<usize> { starts[..1].iter().chain(&starts[1 + dropped..]).copied().collect() };
            let limit = (long_lived > 0).then_some(limit);
            if let Some(starts) = [short, 0].into_iter().map(dropping).find(|kept| regular(kept, events.len())) {
                return Some(Found { starts, every, long_lived, limit });
            }
            first.get_or_insert(Found { starts, every, long_lived, limit });
        }
        if limit <= SHORTEST_LIMIT {
            break;
        }
        limit = (limit * 3 / 4).max(SHORTEST_LIMIT);
    }
    first.filter(|found| !one_steps_own(&found.starts, events.len()))
}

/// Whether boundaries that are not regular are the points of one step, not steps: three steps
/// or more, the first longer than all the others together (see the module docs).
fn one_steps_own(starts: &[usize], end: usize) -> bool {
    let lengths = step_lengths(starts, end);
    lengths.len() >= 3 && lengths[0] > lengths[1..].iter().sum::<usize>()
}

/// The lengths (events) of the steps that begin at `starts`, the last ending at `end`.
fn step_lengths(starts: &[usize], end: usize) -> Vec<usize> {
    starts.iter().zip(starts.iter().skip(1).chain(std::iter::once(&end))).map(|(a, b)| b - a).collect()
}

/// The lower median of [`step_lengths`].
fn median_step(starts: &[usize], end: usize) -> usize {
    let mut lengths = step_lengths(starts, end);
    lengths.sort_unstable();
    lengths[(lengths.len() - 1) / 2]
}

/// Whether no step (from each start to the next, the last to `end`) is longer than one and a half
/// times the lower median step, and none but the first and the last shorter than a quarter of it.
fn regular(starts: &[usize], end: usize) -> bool {
    let lengths = step_lengths(starts, end);
    let median = median_step(starts, end);
    let inner = &lengths[1.min(lengths.len())..lengths.len().saturating_sub(1).max(1)];
    lengths.iter().all(|&length| 2 * length <= 3 * median) && inner.iter().all(|&length| 4 * length >= median)
}

/// Event indices `p` (0 < p < n) before which no allocation that counts under `limit` is live: in
/// each run of consecutive such indices, the first that is an allocation (a step begins with its
/// first allocation, and frees of long-lived memory at the end of a step stay in it), and only
/// where an allocation was made since the previous point.
fn quiescent_points(events: &[Event], lifetimes: &Lifetimes, limit: usize) -> Vec<usize> {
    let n = events.len();
    // crossing[p]: counted allocations made before event p and freed at or after it.
    let mut delta = vec![0i64; n + 1];
    for (alloc, free) in lifetimes.counted(limit) {
        delta[alloc + 1] += 1;
        delta[free + 1] -= 1;
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
    // Each run of quiet indices ends at the allocation that ends it, so this scans each run once.
    for point in &mut points {
        while *point < n && !matches!(events[*point].kind, EventKind::Alloc) {
            *point += 1;
        }
    }
    // A point after which nothing is allocated does not start a step.
    let total = lifetimes.allocs_before[n];
    while points.last().is_some_and(|&last| lifetimes.allocs_before[last] == total) {
        points.pop();
    }
    points
}

/// The most quiescent points a step may have: inference looks for no longer period (see the
/// module docs).
pub const MOST_POINTS_PER_STEP: usize = 256;

/// The number of quiescent points per step at which the segments between them repeat best (see
/// the module docs); `allocs_before` is [`Lifetimes::allocs_before`] (its last entry counts all
/// the events).
fn period(allocs_before: &[usize], points: &[usize]) -> usize {
    let end = allocs_before.len() - 1;
    let bounds: Vec<usize> = std::iter::once(0).chain(points.iter().copied()).chain(std::iter::once(end)).collect();
    let segments: Vec<(usize, usize)> =
        bounds.windows(2).map(|w| (w[1] - w[0], allocs_before[w[1]] - allocs_before[w[0]])).collect();
    // Leave out the warm-up segment and the last one (a run may stop mid-step).
    let body = if segments.len() > 3 { &segments[1..segments.len() - 1] } else { &segments[..] };
    // (same, pairs) of the best period so far.
    let mut best: Option<(usize, usize, usize)> = None;
    // Steps of more quiescent points are not looked for: each period tried is a pass over them.
    for r in 1..=(body.len() / 2).min(MOST_POINTS_PER_STEP) {
        let pairs = body.len() - r;
        let same = (0..pairs).filter(|&j| body[j] == body[j + r]).count();
        // A longer period needs three pairs seen: two steps of one size by chance are no pattern.
        let repeats = same * 4 >= pairs * 3 && (r == 1 || pairs >= 3);
        if repeats && best.is_none_or(|(_, s, p)| same * p > s * pairs) {
            best = Some((r, same, pairs));
        }
    }
    best.map_or(1, |(r, _, _)| r)
}

/// The shortest period, in allocations, that inference looks for where no point is quiescent (see
/// the module docs).
pub const SHORTEST_PERIOD: usize = 8;

/// How many positions [`periodic`] compares at each lag, at most: evenly spaced over the trace.
const PERIOD_SAMPLES: usize = 4096;

/// How many comparisons [`periodic`] makes over all lags, at most, down to 256 a lag: a trace of
/// a million allocations is scored in about as many comparisons as one of a hundred thousand.
const PERIOD_WORK: usize = 1 << 27;

/// Step boundaries from the period of the allocation sizes, for a trace in which no lifetime
/// limit gives a quiescent point (see the module docs); the event indices at which the steps
/// begin, and the period in allocations. `None` where no period repeats.
///
/// Each lag `L` from [`SHORTEST_PERIOD`] to a third of the allocations is scored by the share of
/// allocations whose size is that of the allocation `L` later. A step repeats its operations, so
/// its period and every multiple of it score high; so does a layer's, inside the forward and
/// backward passes. The lags within a tenth of the best score (at least half the sizes matched),
/// less the multiples of a shorter one, are the candidates. Of each, the phase is chosen where the
/// memory that is ever freed is least live on average just before the allocations at that phase
/// (a step boundary: the step's activations and workspace are gone, only what it hands to the
/// next is left); the candidate whose boundaries leave the least live wins, the shorter on ties
/// (a layer's boundaries, at every phase of the step, leave the step's average).
///
/// The first step begins at the first allocation that is ever freed (what comes before it is
/// set-up, never freed), and each later one at an allocation of the chosen phase, the first of
/// them more than a quarter of a period after the first step's start, the last more than a
/// quarter of a period before the trace's last allocation. The phases are weighed from a period
/// past the first step's start, where every phase has as many positions.
fn periodic(events: &[Event]) -> Option<(Vec<usize>, usize)> {
    let allocations: Vec<usize> =
        (0..events.len()).filter(|&index| matches!(events[index].kind, EventKind::Alloc)).collect();
    let n = allocations.len();
    if n < 3 * SHORTEST_PERIOD {
        return None;
    }
    let sizes: Vec<u64> = allocations.iter().map(|&index| events[index].bytes).collect();
    let samples = (PERIOD_WORK / (n / 3)).clamp(256, PERIOD_SAMPLES);
    let score = |lag: usize| -> f64 {
        let compared = n - lag;
        let stride = compared.div_ceil(samples).max(1);
        let (matched, seen) = (0..compared)
            .step_by(stride)
            .fold((0usize, 0usize), |(matched, seen), i| (matched + usize::from(sizes[i] == sizes[i + lag]), seen + 1));
        matched as f64 / seen as f64
    };
    let scores: Vec<(usize, f64)> = (SHORTEST_PERIOD..=n / 3).map(|lag| (lag, score(lag))).collect();
    let best = scores.iter().map(|&(_, score)| score).fold(0.0, f64::max);
    if best < 0.5 {
        return None;
    }
    let mut candidates: Vec<usize> = Vec::new();
    for &(lag, score) in &scores {
        if score * 10.0 >= best * 9.0 && !candidates.iter().any(|&shorter| lag % shorter == 0) {
            candidates.push(lag);
        }
    }
    // Live bytes of the memory that is ever freed, just before each allocation.
    let lifetimes = Lifetimes::new(events);
    let mut delta = vec![0i128; events.len() + 1];
    for &(alloc, free) in &lifetimes.spans {
        delta[alloc + 1] += i128::from(events[alloc].bytes);
        delta[free + 1] -= i128::from(events[alloc].bytes);
    }
    let mut live_before = Vec::with_capacity(n);
    let mut live = 0i128;
    let mut next = 0;
    for (index, step) in delta.iter().enumerate().take(events.len()) {
        live += step;
        if next < n && allocations[next] == index {
            live_before.push(live);
            next += 1;
        }
    }
    let first = lifetimes.spans.iter().map(|&(alloc, _)| lifetimes.allocs_before[alloc]).min()?;
    // (live on average at the boundaries, period, phase) of the best candidate.
    let mut chosen: Option<(f64, usize, usize)> = None;
    for lag in candidates {
        // From a period past the first step's start: the first step's own start, where little
        // is live yet, is no phase's.
        let mut sums = vec![(0i128, 0usize); lag];
        for (k, &live) in live_before.iter().enumerate().skip(first + lag) {
            let (sum, count) = &mut sums[k % lag];
            *sum += live;
            *count += 1;
        }
        let phase = (0..lag)
            .filter(|&phase| sums[phase].1 >= 2)
            .map(|phase| (sums[phase].0 as f64 / sums[phase].1 as f64, phase))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        if let Some((mean, phase)) = phase
            && chosen.is_none_or(|(least, _, _)| mean < least)
        {
            chosen = Some((mean, lag, phase));
        }
    }
    let (_, lag, phase) = chosen?;
    let later = (first + lag / 4 + 1..n).find(|k| k % lag == phase)?;
    // A run that stops a few allocations into a step (the next batch copied) keeps them in its
    // last step.
    let end = n.saturating_sub(lag / 4);
    let starts: Vec<usize> = std::iter::once(first).chain((later..end).step_by(lag)).map(|k| allocations[k]).collect();
    if std::env::var_os("SPDBG").is_some() {
        eprintln!(
            "PERIODIC first {first} lag {lag} phase {phase} later {later} n {n} starts(alloc) {:?}",
            std::iter::once(first).chain((later..end).step_by(lag)).collect::<Vec<_>>()
        );
    }
    (starts.len() >= 2).then_some((starts, lag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::Scope;

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

    /// One training step's own memory: 32 nested allocations (a forward pass's activations, freed
    /// backwards), all freed in the step; returns the index of its first event. Of its 64 events,
    /// the 32nd is its peak.
    fn step(events: &mut Vec<Event>) -> usize {
        let start = events.len();
        events.extend((0..32).map(|i| alloc(10 + i, 8)));
        events.extend((0..32).rev().map(|i| free(10 + i)));
        start
    }

    /// Weights that are never freed, then `batches` allocations made before the loop.
    fn set_up(batches: u64) -> Vec<Event> {
        let mut events = vec![alloc(1, 100), alloc(2, 100)];
        events.extend((0..batches).map(|batch| alloc(100 + batch, 4)));
        events
    }

    #[test]
    fn quiescent_points_are_where_only_never_freed_memory_is_live() {
        // weights (never freed), then two steps of a, b.
        let events = vec![alloc(1, 100), alloc(2, 10), alloc(3, 10), free(3), free(2), alloc(2, 10), free(2)];
        assert_eq!(quiescent_points(&events, &Lifetimes::new(&events), events.len() + 1), vec![5]);
        let found = boundaries(&events).unwrap();
        assert_eq!((found.starts, found.every, found.long_lived, found.limit), (vec![1, 5], 1, 0, None));
    }

    #[test]
    fn short_steps_at_the_start_are_the_first_steps_own_points() {
        // The first step runs temporaries one after another before its own work (as an
        // optimizer's first step makes its state between them, the gradients left out): each
        // ends in a quiescent point, a step of two events where the others have 64. Dropped,
        // the first step runs from its first allocation to the second step.
        let mut events = set_up(0);
        let mut starts = vec![events.len()];
        for i in 0..3 {
            events.extend([alloc(50 + i, 4), free(50 + i)]);
        }
        step(&mut events);
        for _ in 0..6 {
            starts.push(step(&mut events));
        }
        let found = boundaries(&events).unwrap();
        assert_eq!((found.starts, found.every), (starts, 1));
        // Short steps elsewhere make the steps irregular: a step split in two is not one.
        assert!(!regular(&[0, 64, 128, 132, 192, 256], 320));
        assert!(regular(&[0, 70, 134, 198, 262], 326));
    }

    #[test]
    fn a_first_step_begins_with_the_batch_it_copies_as_the_later_steps_do() {
        // Each step copies its batch (4 bytes) first and frees the one the step before copied at
        // its end: the batches live about two steps, are left out as long-lived, and the later
        // steps begin at their copy (their quiescent run's first allocation). The first began
        // after its copy, at its first allocation that counts, unlike them.
        let mut events = set_up(0);
        let mut starts = Vec::new();
        for batch in 0..8 {
            starts.push(events.len());
            events.push(alloc(100 + batch, 4));
            step(&mut events);
            if batch > 0 {
                events.push(free(100 + batch - 1));
            }
        }
        let found = boundaries(&events).unwrap();
        assert_eq!(found.starts[0], starts[0] + 1, "found after the copy: {found:?}");
        assert_eq!(found.starts[1..], starts[1..]);
        assert_eq!(aligned_first(&events, &found.starts), starts[0]);
        let mut trace = Trace::new("t", crate::trace::TraceFormat::Steppool);
        trace.events = events.clone();
        infer(&mut trace);
        let begins: Vec<usize> = (trace.events.iter().enumerate())
            .filter(|(_, event)| matches!(event.kind, EventKind::StepBegin(_)))
            .map(|(at, _)| at)
            .collect();
        assert_eq!(begins[0], starts[0]);
        // Without the copy, what lies right before the first step (the weights) is no copy of
        // the second step's first allocations: nothing moves.
        events.remove(starts[0]);
        let found = boundaries(&events).unwrap();
        assert_eq!(aligned_first(&events, &found.starts), found.starts[0]);
    }

    #[test]
    fn the_period_skips_quiescent_points_inside_a_step() {
        // Each step: a short pass (1 alloc) then a long one (3 allocs); quiescent between them.
        let mut events = vec![alloc(1, 100)];
        for _ in 0..6 {
            events.extend([alloc(2, 1), free(2)]);
            events.extend([alloc(3, 1), alloc(4, 1), alloc(5, 1), free(5), free(4), free(3)]);
        }
        let lifetimes = Lifetimes::new(&events);
        let points = quiescent_points(&events, &lifetimes, events.len() + 1);
        assert_eq!(points.len(), 11);
        assert_eq!(period(&lifetimes.allocs_before, &points), 2);
        assert_eq!(boundaries(&events).unwrap().starts, vec![1, 9, 17, 25, 33, 41]);
    }

    /// A loop with no quiescent point: each step makes activations (sizes 10 to 17), sets the
    /// gradients the step before made to `None` between its passes, makes its own (size 100),
    /// frees its activations, and makes and frees `temporaries` of its optimizer update in turn;
    /// the gradients live about a step and are one allocation in `9 + temporaries`, too many to
    /// leave out as long-lived below 7. Returns the index of each step's first event.
    fn gradients_handed_on(steps: u64, temporaries: u64) -> (Vec<Event>, Vec<usize>) {
        let mut events = vec![alloc(1, 1000)];
        let mut starts = Vec::new();
        for step in 0..steps {
            starts.push(events.len());
            events.extend((0..8).map(|i| alloc(10 + i, 10 + i)));
            if step > 0 {
                events.push(free(1000 + step - 1));
            }
            events.push(alloc(1000 + step, 100));
            events.extend((0..8).rev().map(|i| free(10 + i)));
            for t in 0..temporaries {
                events.extend([alloc(2000 + t, 4), free(2000 + t)]);
            }
        }
        (events, starts)
    }

    #[test]
    fn a_loop_with_no_quiescent_point_is_stepped_by_the_period_of_its_sizes() {
        let (events, starts) = gradients_handed_on(8, 0);
        assert_eq!(boundaries(&events), None, "memory of its own is live at every point");
        assert_eq!(periodic(&events), Some((starts.clone(), 9)));
        let mut trace = Trace::new("periodic", crate::trace::TraceFormat::Rmm);
        trace.events = events;
        assert_eq!(infer(&mut trace), StepSource::Periodic { allocations: 9 });
        assert_eq!(trace.step_count(), 8);
        // Sizes that never recur give no period, and no steps.
        let mut events = vec![alloc(1, 1000)];
        for i in 0..64 {
            events.extend([alloc(10 + i, 10 + i), alloc(100 + i, 1000 + i), free(10 + i)]);
        }
        assert_eq!(periodic(&events), None);
    }

    #[test]
    fn the_points_of_the_last_steps_end_alone_are_no_steps() {
        // The loop above, each step ending with its optimizer update: 4 temporaries. The last
        // step's gradients are never freed, so each of its temporaries ends in a quiescent point.
        let (events, starts) = gradients_handed_on(8, 4);
        let last = Lifetimes::new(&events);
        assert_eq!(quiescent_points(&events, &last, events.len() + 1).len(), 4, "the tail's points");
        assert_eq!(boundaries(&events), None, "5 steps, the first of them all but the tail: none");
        let mut trace = Trace::new("tail", crate::trace::TraceFormat::Rmm);
        trace.events = events;
        assert_eq!(infer(&mut trace), StepSource::Periodic { allocations: 13 });
        assert_eq!(trace.step_count(), starts.len());
    }

    #[test]
    fn the_period_is_the_steps_not_a_layers() {
        // Each step: 24 layers of the same three sizes (a layer repeats every three allocations),
        // then gradients handed on as above. The layer's lag scores within a tenth of the
        // step's (69 of 73 sizes recur), but its boundaries fall at every phase of the step.
        let mut events = vec![alloc(1, 1000)];
        let mut starts = Vec::new();
        for step in 0..8u64 {
            starts.push(events.len());
            events.extend((0..72).map(|i| alloc(10 + i, [64, 32, 16][i as usize % 3])));
            if step > 0 {
                events.push(free(1000 + step - 1));
            }
            events.push(alloc(1000 + step, 100));
            events.extend((0..72).rev().map(|i| free(10 + i)));
        }
        assert_eq!(periodic(&events), Some((starts, 73)));
        // A run that stops a few allocations into a step keeps them in its last step.
        let (mut events, starts) = gradients_handed_on(8, 0);
        events.push(alloc(5000, 10));
        assert_eq!(periodic(&events), Some((starts, 9)));
    }

    #[test]
    fn two_steps_of_one_size_by_chance_are_no_period() {
        // Steps of sizes a b c b c d: b c b c repeats at period 2, seen twice only.
        let sizes = [1, 2, 3, 2, 3, 4];
        let mut events = vec![alloc(1, 100)];
        let mut starts = Vec::new();
        for n in sizes {
            starts.push(events.len());
            events.extend((0..n).map(|i| alloc(10 + i, 1)));
            events.extend((0..n).rev().map(|i| free(10 + i)));
        }
        let found = boundaries(&events).unwrap();
        assert_eq!((found.every, found.starts), (1, starts));
    }

    #[test]
    fn batches_freed_at_teardown_are_left_out_as_long_lived() {
        // Eight batches made before the loop and freed after it: no point is quiescent while they
        // count.
        let mut events = set_up(8);
        let starts: Vec<usize> = (0..6).map(|_| step(&mut events)).collect();
        events.extend((0..8).map(|batch| free(100 + batch)));
        assert!(quiescent_points(&events, &Lifetimes::new(&events), events.len() + 1).is_empty());
        let found = boundaries(&events).unwrap();
        assert_eq!((&found.starts, found.every, found.long_lived), (&starts, 1, 8));

        let mut trace = Trace::new("teardown", crate::trace::TraceFormat::Rmm);
        trace.events = events;
        let source = infer(&mut trace);
        assert_eq!(source, StepSource::Inferred { every: 1, long_lived: 8, limit: found.limit });
        assert_eq!(trace.step_count(), 6);
    }

    #[test]
    fn batches_prefetched_and_freed_one_per_step_are_left_out_as_long_lived() {
        // Eight batches made up front; step k frees batch k in its middle. Batch k spans the
        // boundaries before steps 1..=k.
        let mut events = set_up(8);
        let mut starts = Vec::new();
        for batch in 0..8 {
            let start = events.len();
            step(&mut events);
            events.insert(start + 32, free(100 + batch));
            starts.push(start);
        }
        let found = boundaries(&events).unwrap();
        // Step 0 begins with the first batch that counts: the set-up goes with it or before it.
        assert!(found.starts[0] <= starts[0], "{found:?}");
        assert_eq!((&found.starts[1..], found.every), (&starts[1..], 1), "{found:?}");
        assert!(found.long_lived >= 7, "{found:?}");
    }

    #[test]
    fn a_batch_prefetched_one_step_ahead_is_left_out_as_long_lived() {
        // Step k copies in the batch of step k + 1, which frees it: every boundary has a batch
        // live across it.
        let mut events = set_up(1);
        let mut starts = Vec::new();
        for batch in 0..8 {
            let start = step(&mut events);
            events.insert(start + 10, alloc(101 + batch, 4));
            events.insert(start + 40, free(100 + batch));
            starts.push(start);
        }
        assert!(quiescent_points(&events, &Lifetimes::new(&events), events.len() + 1).is_empty());
        let found = boundaries(&events).unwrap();
        // Batches 1 to 7 are long-lived; batch 0 is made in the set-up and freed early in step 0, and
        // the last one is never freed.
        assert_eq!((&found.starts[1..], found.every, found.long_lived), (&starts[1..], 1, 7), "{found:?}");
    }

    #[test]
    fn a_step_keeps_the_frees_of_long_lived_memory_at_its_end() {
        // Step k allocates a buffer in its middle and frees the previous step's at its end, after
        // its own memory is gone: the boundary falls after those frees, at the next allocation.
        let mut events = set_up(0);
        let mut starts = Vec::new();
        for index in 0..8u64 {
            let start = step(&mut events);
            events.insert(start + 20, alloc(200 + index, 64));
            if index > 0 {
                events.push(free(200 + index - 1));
            }
            starts.push(start);
        }
        let found = boundaries(&events).unwrap();
        assert_eq!((&found.starts, found.every, found.long_lived), (&starts, 1, 7), "{found:?}");
    }

    #[test]
    fn a_buffer_held_across_two_steps_is_left_out_as_long_lived() {
        // A buffer made in step 2 and freed in step 4 spans the boundaries before steps 3 and 4.
        let mut events = set_up(0);
        let mut starts = Vec::new();
        for index in 0..8 {
            let start = step(&mut events);
            if index == 2 {
                events.insert(start + 3, alloc(50, 64));
            }
            if index == 4 {
                events.insert(start + 40, free(50));
            }
            starts.push(start);
        }
        // Every freed allocation counting, steps 2, 3 and 4 make one segment.
        let lifetimes = Lifetimes::new(&events);
        let points = quiescent_points(&events, &lifetimes, events.len() + 1);
        assert!(!points.contains(&starts[3]) && !points.contains(&starts[4]), "{points:?}");
        let found = boundaries(&events).unwrap();
        assert_eq!((&found.starts, found.every, found.long_lived), (&starts, 1, 1), "{found:?}");

        // The replay keeps the buffer's real lifetime: made in one inferred step and freed in a
        // later one, it is persistent, and no boundary releases it; the steps' own memory is
        // step-scoped.
        let mut trace = Trace::new("held", crate::trace::TraceFormat::Rmm);
        trace.events = events;
        infer(&mut trace);
        let analysis = crate::analysis::analyse(&trace).unwrap();
        let scopes = |bytes: u64| -> Vec<(Scope, bool)> {
            let of = analysis.allocations.iter().filter(|a| a.bytes == bytes);
            of.map(|a| (a.scope, a.released_at_boundary)).collect()
        };
        assert_eq!(scopes(64), vec![(Scope::Persistent, false)]);
        assert_eq!(scopes(8), vec![(Scope::Step, false); 8 * 32]);
        assert_eq!(scopes(100), vec![(Scope::Persistent, false); 2]);
    }

    #[test]
    fn irregular_steps_at_every_limit_keep_the_first_boundaries_found() {
        // One quiescent point, after a long first step: no limit makes the steps regular.
        let mut events = set_up(0);
        for i in 0..20 {
            events.push(alloc(10 + i, 1));
        }
        for i in (0..20).rev() {
            events.push(free(10 + i));
        }
        let second = events.len();
        events.extend([alloc(40, 1), free(40)]);
        let found = boundaries(&events).unwrap();
        assert_eq!((found.starts, found.long_lived, found.limit), (vec![2, second], 0, None));
    }

    #[test]
    fn a_trace_without_frees_has_no_steps() {
        let mut trace = Trace::new("weights", crate::trace::TraceFormat::Rmm);
        trace.events = set_up(4);
        assert_eq!(infer(&mut trace), StepSource::None);
        assert_eq!(trace.step_count(), 0);
    }

    #[test]
    fn a_marked_step_begins_at_its_first_allocation() {
        // `zero_grad()` at the top of the loop: the gradient `g` a step's backward pass makes is
        // freed by the next iteration's first statement, after the mark, before it allocates.
        let at = |t: u64, mut event: Event| {
            event.t_ns = t;
            event
        };
        let mut trace = Trace::new("zero_grad at the start", crate::trace::TraceFormat::Rmm);
        trace.events = vec![
            at(0, alloc(1, 100)),
            at(10, alloc(2, 50)),
            at(20, alloc(3, 8)),
            at(30, free(2)),
            at(45, free(3)),
            at(50, alloc(2, 50)),
            at(60, alloc(3, 8)),
            at(70, free(2)),
        ];
        insert_step_starts(&mut trace, &[5, 40]);
        let kinds: Vec<EventKind> = trace.events.iter().map(|e| e.kind).collect();
        let begin = |n| kinds.iter().position(|&k| k == EventKind::StepBegin(n)).unwrap();
        assert_eq!((begin(0), begin(1)), (1, 7), "{kinds:?}");
        assert_eq!(kinds[6], EventKind::StepEnd(0));
        assert_eq!(trace.events[7].t_ns, 45, "no boundary goes back in time");
        let analysis = crate::analysis::analyse(&trace).unwrap();
        let scopes: Vec<Scope> = analysis.allocations.iter().map(|a| a.scope).collect();
        // The last step's gradient, never freed, is the step's (see `analysis`).
        assert_eq!(scopes, [Scope::Persistent, Scope::Step, Scope::Step, Scope::Step, Scope::Step]);
    }

    #[test]
    fn a_step_of_micro_steps_begins_at_its_first_allocation() {
        // Gradient accumulation with `zero_grad()` first: the gradient made in the first
        // micro-step's backward pass lives through the second and is freed after the next step's
        // boundary, before its first micro-step; a free the boundary released stays after it.
        let mut released = free(9);
        released.kind = EventKind::Free { released: true };
        let mut trace = Trace::new("accumulation", crate::trace::TraceFormat::Steppool);
        trace.events = vec![
            alloc(1, 100),
            Event::new(0, EventKind::StepBegin(0), Location::File),
            Event::new(0, EventKind::MicroBegin(0, 0), Location::File),
            alloc(2, 50),
            alloc(3, 8),
            alloc(9, 4),
            free(2),
            Event::new(0, EventKind::MicroEnd(0, 0), Location::File),
            Event::new(0, EventKind::MicroBegin(0, 1), Location::File),
            alloc(2, 50),
            free(2),
            Event::new(0, EventKind::MicroEnd(0, 1), Location::File),
            Event::new(0, EventKind::StepEnd(0), Location::File),
            Event::new(0, EventKind::StepBegin(1), Location::File),
            released,
            free(3),
            Event::new(0, EventKind::MicroBegin(1, 0), Location::File),
            alloc(2, 50),
            free(2),
            Event::new(0, EventKind::MicroEnd(1, 0), Location::File),
            Event::new(0, EventKind::StepEnd(1), Location::File),
        ];
        for (i, event) in trace.events.iter_mut().enumerate() {
            event.t_ns = 10 * i as u64;
        }
        begin_at_first_allocation(&mut trace);
        let order: Vec<(EventKind, u64)> = trace.events.iter().map(|e| (e.kind, e.t_ns)).collect();
        let free_at = |t| (EventKind::Free { released: false }, t);
        assert_eq!(
            order[10..17],
            [
                free_at(100),
                free_at(150),
                (EventKind::MicroEnd(0, 1), 150),
                (EventKind::StepEnd(0), 150),
                (EventKind::StepBegin(1), 150),
                (EventKind::Free { released: true }, 150),
                (EventKind::MicroBegin(1, 0), 160),
            ],
            "{order:?}"
        );
        let analysis = crate::analysis::analyse(&trace).unwrap();
        let scopes: Vec<Scope> = analysis.allocations.iter().map(|a| a.scope).collect();
        let micro = Scope::MicroStep;
        assert_eq!(scopes, [Scope::Persistent, micro, Scope::Step, Scope::Step, micro, micro]);
        assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings);
    }

    #[test]
    fn memory_the_last_step_holds_at_the_end_hides_the_points_of_its_end() {
        // `zero_grad()` first: each step makes a gradient the next iteration frees, then runs an
        // optimizer step of temporaries, each freed before the next is made. The last step's
        // gradient is never freed.
        let mut events = set_up(0);
        let mut starts = Vec::new();
        for step in 0..6u64 {
            starts.push(events.len());
            if step > 0 {
                events.push(free(1000 + step - 1));
            }
            events.extend([alloc(10, 8), alloc(1000 + step, 8), free(10)]);
            for t in 0..8 {
                events.extend([alloc(20 + t, 4), free(20 + t)]);
            }
        }
        let found = boundaries(&events).unwrap();
        // Each step begins at its first allocation (after the free of the last gradient).
        let expected: Vec<usize> = starts.iter().enumerate().map(|(i, &s)| s + usize::from(i > 0)).collect();
        assert_eq!(found.starts, expected);
        assert!(regular(&found.starts, events.len()));
    }

    #[test]
    fn steps_of_many_points_like_each_other_are_found_whole() {
        // Gradients made once and kept: after each backward pass only they are live, and each of
        // the optimizer step's 20 temporaries, made and freed in turn, is a quiescent point.
        let mut events = set_up(0);
        events.push(alloc(3, 8));
        let mut starts = Vec::new();
        for _ in 0..6 {
            starts.push(events.len());
            step(&mut events);
            for t in 0..20 {
                events.extend([alloc(200 + t, 4), free(200 + t)]);
            }
        }
        let found = boundaries(&events).unwrap();
        assert_eq!((found.every, found.starts), (21, starts));
    }
}
