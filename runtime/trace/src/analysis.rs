//! What a trace's events mean for a replay: each allocation's lifetime and scope, the phases to
//! replay them in, the operations in order, and the live bytes over time.
//!
//! Scopes come from real lifetimes, so a replay never has a boundary release memory the trace
//! still uses: an allocation freed inside the micro-step it was made in is micro-step-scoped;
//! freed inside its step, step-scoped; freed in the step after the one it was made in,
//! step-scoped in the phase [`CARRIED_PHASE`], which carries it across the boundary
//! ([`ReplayPhase::carried`]); anything else (made outside a step, freed two steps later or
//! after, never freed) persistent. A tagged trace's phases keep their declared scope where the lifetime
//! fits it; where it does not, the allocation's scope is inferred and a warning counted.
//!
//! One exception: memory the trace's last step makes and never frees, when nothing is allocated
//! after that step, is step-scoped, released by the step's end. The trace ends with the step, and
//! what it still holds there is, as far as the trace can tell, what the next iteration would free
//! at its top: the gradients a loop that calls `zero_grad()` as its first statement keeps from its
//! backward pass to the next iteration, which earlier steps freed inside their own (a step begins
//! at its first allocation, see [`crate::steps`]). Persistent, they made the last step leave the
//! plan the earlier steps recorded, its gradients served apart from the planned ranges those
//! steps gave them, and the whole run held the gradients twice at the last step's peak. Nothing
//! runs after the step's end, so the release changes no placement of the trace. Where the step
//! before made the same allocation (at the same place among its step's allocations, of the same
//! size) and kept it past its own end, the last step's is kept as that one was: carried (the
//! gradients of a loop that calls `zero_grad()` between the passes, which the next step frees)
//! or persistent (freed between two steps, outside both: a loop whose step is marked after its
//! `zero_grad()`). Step-scoped, they made the last step leave the plan of its phase, which had
//! never seen them: a Llama with accumulation, whose loop copies its batch before the mark,
//! deviated at its last step's first gradient and held 340 MiB where every step before held 324.
//!
//! The same holds one step earlier where the last step is of another kind: memory the step before
//! the last makes and never frees, when nothing is allocated after the last step, where the
//! latest step like it (as many allocations) made the same allocation and freed it inside its
//! own, is carried into the last step and released by its end. An evaluation step ends the trace
//! after a training step whose loop calls `zero_grad()` at its top, and the gradients it holds
//! would have been freed at the next training step's top, right after the evaluation step's
//! end, as the gradients of the training steps before each earlier evaluation step were.
//! Persistent, they made that training step leave its plan at its first gradient and held them
//! beside the plan's place for them: a 5.6 GiB recording of that loop held 5,906 MiB at that
//! step where every other held 5,712. Where the step like it kept its own past its end (a loop
//! that calls `zero_grad()` between the passes, whose gradients the evaluation step would hold
//! into the next training step's backward pass), they are persistent.

use std::collections::{HashMap, HashSet};

use crate::error::{Location, Result, TraceError};
use crate::scope::Scope;
use crate::trace::{EventKind, Trace, WarningKind, Warnings};

/// The name of the phase inferred for allocations made in one step and freed in the next.
pub const CARRIED_PHASE: &str = "carried";

/// The most streams a trace may use: a replay creates one runtime stream per trace stream.
pub const MAX_STREAMS: usize = 4096;

/// The largest allocation a trace may hold: 1 PiB, far beyond any device. A larger size is a
/// corrupt field, and refusing it keeps every sum and rounding of sizes downstream (replay, the
/// offline limit, the PyTorch models) clear of overflow.
pub const MAX_ALLOCATION_BYTES: u64 = 1 << 50;

/// One allocation of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The index of its `alloc` event.
    pub event: usize,
    /// The index of the event that frees it, if any (its `free`, or the allocation that reused its
    /// pointer).
    pub free: Option<usize>,
    /// Bytes requested.
    pub bytes: u64,
    /// Its device.
    pub device: u32,
    /// Its replay stream: an index into [`Analysis::streams`].
    pub stream: u16,
    /// When it was allocated, on the trace's clock.
    pub t_alloc: u64,
    /// When it was freed.
    pub t_free: Option<u64>,
    /// The scope it is replayed with.
    pub scope: Scope,
    /// Its replay phase: an index into [`Analysis::phases`].
    pub phase: u16,
    /// Released by the boundary that ended its step (a steppool trace's `release` free after the
    /// boundary): the replay does not free it again.
    pub released_at_boundary: bool,
}

/// A phase the replay declares: a tagged trace's phase, or an inferred lifetime class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayPhase {
    /// Its name.
    pub name: String,
    /// Its scope.
    pub scope: Scope,
    /// Whether the trace tagged it (otherwise it is inferred).
    pub tagged: bool,
    /// Its allocations are made in one step and freed in the next (step scope, carried across
    /// the boundary: the `carried` phase inferred for gradients a loop sets to `None` between
    /// its forward and backward passes). Only an inferred phase carries.
    pub carried: bool,
}

/// The numbers of one replay phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseFacts {
    /// Allocations.
    pub allocations: u64,
    /// Bytes allocated in total.
    pub bytes: u64,
    /// The largest allocation.
    pub largest: u64,
    /// The most bytes live at once.
    pub peak_live: u64,
    /// Allocations never freed.
    pub never_freed: u64,
    /// Median lifetime of the freed ones, in nanoseconds.
    pub median_lifetime_ns: u64,
    /// Longest lifetime of the freed ones, in nanoseconds.
    pub max_lifetime_ns: u64,
}

/// One operation of a replay, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate [`Analysis::allocations`]`[i]`.
    Alloc(u32),
    /// Free it.
    Free(u32),
    /// Begin a step.
    BeginStep,
    /// End the step.
    EndStep,
    /// Begin a micro-step.
    BeginMicro,
    /// End the micro-step.
    EndMicro,
}

/// A trace prepared for replay and inspection.
#[derive(Clone, Debug)]
pub struct Analysis {
    /// Every allocation, in order.
    pub allocations: Vec<Allocation>,
    /// The phases to declare.
    pub phases: Vec<ReplayPhase>,
    /// Per phase, its numbers.
    pub facts: Vec<PhaseFacts>,
    /// The operations, each with the index of the event it comes from.
    pub ops: Vec<(usize, Op)>,
    /// The replay streams: (device, the trace's stream handle).
    pub streams: Vec<(u32, u64)>,
    /// The highest sum of live bytes over all devices.
    pub peak_live_bytes: u64,
    /// The event after which it was reached.
    pub peak_live_event: usize,
    /// Per device ordinal, its highest live bytes.
    pub device_peak_live: Vec<(u32, u64)>,
    /// Bytes still live at the end.
    pub live_at_end: u64,
    /// Steps.
    pub steps: u64,
    /// Micro-steps.
    pub micro_steps: u64,
    /// Failed allocations recorded in the trace.
    pub failures: u64,
    /// Odd records met while analysing.
    pub warnings: Warnings,
}

#[derive(Clone, Copy, Default)]
struct Boundaries {
    step: Option<u32>,
    micro: Option<u32>,
    steps: u32,
    micros: u32,
    /// Whether something was allocated outside a step after the latest step ended.
    allocated_after_step: bool,
    /// Allocations made so far in the current step.
    in_step: u32,
}

struct Pending {
    step: Option<u32>,
    micro: Option<u32>,
    tag: Option<u16>,
    /// Its place among its step's allocations.
    nth: u32,
}

struct Freed {
    step: Option<u32>,
    micro: Option<u32>,
    released: bool,
}

/// Analyses `trace` for replay.
pub fn analyse(trace: &Trace) -> Result<Analysis> {
    let mut warnings = Warnings::default();
    let mut allocations: Vec<Allocation> = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    let mut freed: Vec<Option<Freed>> = Vec::new();
    let mut ops: Vec<(usize, Op)> = Vec::with_capacity(trace.events.len());
    let mut live: HashMap<(u32, u64), u32> = HashMap::new();
    let mut zero: HashSet<(u32, u64)> = HashSet::new();
    let mut streams: Vec<(u32, u64)> = Vec::new();
    let mut stream_index: HashMap<(u32, u64), u16> = HashMap::new();
    let mut b = Boundaries::default();
    let mut failures = 0;
    let (mut live_bytes, mut peak, mut peak_event) = (0u64, 0u64, 0usize);
    let mut device_live: HashMap<u32, (u64, u64)> = HashMap::new();

    for (index, event) in trace.events.iter().enumerate() {
        let location = event.location;
        match event.kind {
            EventKind::StepBegin(_) => {
                if b.step.is_some() {
                    warnings.add(WarningKind::BoundaryOrder, location, || "a step begins inside a step".into());
                    end_step(&mut b, &mut ops, index);
                }
                b.step = Some(b.steps);
                b.steps += 1;
                b.allocated_after_step = false;
                b.in_step = 0;
                ops.push((index, Op::BeginStep));
            }
            EventKind::StepEnd(_) => {
                if b.step.is_none() {
                    warnings.add(WarningKind::BoundaryOrder, location, || "a step ends outside a step".into());
                } else {
                    end_step(&mut b, &mut ops, index);
                }
            }
            EventKind::MicroBegin(..) => {
                if b.step.is_none() {
                    warnings.add(WarningKind::BoundaryOrder, location, || "a micro-step begins outside a step".into());
                    continue;
                }
                if b.micro.is_some() {
                    warnings.add(WarningKind::BoundaryOrder, location, || "a micro-step begins inside one".into());
                    b.micro = None;
                    ops.push((index, Op::EndMicro));
                }
                b.micro = Some(b.micros);
                b.micros += 1;
                ops.push((index, Op::BeginMicro));
            }
            EventKind::MicroEnd(..) => {
                if b.micro.is_none() {
                    warnings.add(WarningKind::BoundaryOrder, location, || "a micro-step ends outside one".into());
                } else {
                    b.micro = None;
                    ops.push((index, Op::EndMicro));
                }
            }
            EventKind::AllocFailure => failures += 1,
            EventKind::Alloc => {
                let key = (event.device, event.ptr);
                if let Some(previous) = live.remove(&key) {
                    warnings.add(WarningKind::PointerReused, location, || {
                        format!("{:#x} allocated again while live", event.ptr)
                    });
                    let at = Freed { step: b.step, micro: b.micro, released: false };
                    let bytes = free_one(&mut allocations, &mut freed, previous, index, event.t_ns, at);
                    ops.push((index, Op::Free(previous)));
                    live_bytes -= bytes;
                    device_live.entry(event.device).or_default().0 -= bytes;
                }
                zero.remove(&key);
                if event.bytes == 0 {
                    warnings.add(WarningKind::ZeroBytes, location, || format!("at {:#x}", event.ptr));
                    zero.insert(key);
                    continue;
                }
                let slot = match stream_index.get(&(event.device, event.stream)) {
                    Some(&slot) => slot,
                    None => {
                        if streams.len() >= MAX_STREAMS {
                            return Err(TraceError::malformed(
                                &trace.path,
                                location,
                                format!(
                                    "more than {MAX_STREAMS} streams: the replay creates one runtime stream per trace stream"
                                ),
                            ));
                        }
                        let slot = streams.len() as u16;
                        streams.push((event.device, event.stream));
                        stream_index.insert((event.device, event.stream), slot);
                        slot
                    }
                };
                if event.bytes > MAX_ALLOCATION_BYTES {
                    return Err(TraceError::malformed(
                        &trace.path,
                        location,
                        format!(
                            "an allocation of {} bytes: more than {MAX_ALLOCATION_BYTES} (1 PiB), larger than any device",
                            event.bytes
                        ),
                    ));
                }
                let id = u32::try_from(allocations.len())
                    .map_err(|_| TraceError::malformed(&trace.path, location, "more than 4 billion allocations"))?;
                if live_bytes.checked_add(event.bytes).is_none() {
                    return Err(TraceError::malformed(
                        &trace.path,
                        location,
                        format!("{} bytes allocated while {live_bytes} are live: more than 16 EiB", event.bytes),
                    ));
                }
                allocations.push(Allocation {
                    event: index,
                    free: None,
                    bytes: event.bytes,
                    device: event.device,
                    stream: slot,
                    t_alloc: event.t_ns,
                    t_free: None,
                    scope: Scope::Persistent,
                    phase: 0,
                    released_at_boundary: false,
                });
                b.allocated_after_step |= b.step.is_none() && b.steps > 0;
                pending.push(Pending { step: b.step, micro: b.micro, tag: event.phase, nth: b.in_step });
                b.in_step += 1;
                freed.push(None);
                live.insert(key, id);
                live_bytes += event.bytes;
                let device = device_live.entry(event.device).or_default();
                device.0 += event.bytes;
                device.1 = device.1.max(device.0);
                if live_bytes > peak {
                    peak = live_bytes;
                    peak_event = index;
                }
                ops.push((index, Op::Alloc(id)));
            }
            EventKind::Free { released } => {
                let key = (event.device, event.ptr);
                let Some(id) = live.remove(&key) else {
                    if !zero.remove(&key) {
                        warnings.add(WarningKind::UnknownPointerFree, location, || {
                            format!("{:#x} on device {}", event.ptr, event.device)
                        });
                    }
                    continue;
                };
                let bytes = allocations[id as usize].bytes;
                if event.bytes != 0 && event.bytes != bytes {
                    warnings.add(WarningKind::SizeMismatch, location, || {
                        format!("{:#x} freed as {} bytes, allocated as {bytes}", event.ptr, event.bytes)
                    });
                }
                let at = Freed { step: b.step, micro: b.micro, released };
                free_one(&mut allocations, &mut freed, id, index, event.t_ns, at);
                ops.push((index, Op::Free(id)));
                live_bytes -= bytes;
                device_live.entry(event.device).or_default().0 -= bytes;
            }
        }
    }
    let end = trace.events.len();
    if b.step.is_some() {
        end_step(&mut b, &mut ops, end);
    }

    // Scopes and phases.
    let mut phases: Vec<ReplayPhase> = trace
        .phases
        .iter()
        .map(|phase| ReplayPhase { name: phase.name.clone(), scope: phase.scope, tagged: true, carried: false })
        .collect();
    let mut inferred: [Option<u16>; 4] = [None; 4];
    let sizes: Vec<u64> = allocations.iter().map(|allocation| allocation.bytes).collect();
    // The allocations of the step before the last, by their place in it (see the module docs).
    let before_last: HashMap<u32, usize> = (0..pending.len())
        .filter(|&id| b.steps >= 2 && pending[id].step == Some(b.steps - 2))
        .map(|id| (pending[id].nth, id))
        .collect();
    // The allocations of the latest step before the one before the last that made as many as
    // that one did, by their place in it (see the module docs).
    let mut counts = vec![0u32; b.steps as usize];
    for at in &pending {
        if let Some(step) = at.step {
            counts[step as usize] += 1;
        }
    }
    let second_last = b.steps.checked_sub(2);
    let like_second_last =
        second_last.and_then(|last| (0..last).rev().find(|&s| counts[s as usize] == counts[last as usize]));
    let before_second_last: HashMap<u32, usize> = (0..pending.len())
        .filter(|&id| like_second_last.is_some() && pending[id].step == like_second_last)
        .map(|id| (pending[id].nth, id))
        .collect();
    // Per allocation so far, whether it is persistent.
    let mut persistent: Vec<bool> = Vec::with_capacity(allocations.len());
    for (id, allocation) in allocations.iter_mut().enumerate() {
        let at = &pending[id];
        let lifetime = freed[id].as_ref();
        let same_step = at.step.is_some() && lifetime.is_some_and(|f| f.step == at.step);
        let same_micro = at.micro.is_some() && lifetime.is_some_and(|f| f.micro == at.micro);
        // Made in a step, freed (not released) in the next.
        let carried_by = |id: usize| {
            pending[id]
                .step
                .is_some_and(|step| freed[id].as_ref().is_some_and(|f| !f.released && f.step == Some(step + 1)))
        };
        // Held at the end by the last step, nothing allocated after it (see the module docs),
        // as the step before held the same allocation (its place in the step, its size), if it
        // made one: carried into the next step, or kept for longer (persistent), or its own.
        let held_at_end =
            lifetime.is_none() && at.step.is_some_and(|step| step + 1 == b.steps) && !b.allocated_after_step;
        let before = before_last.get(&at.nth).copied().filter(|&other| held_at_end && sizes[other] == sizes[id]);
        let carried_like_before = held_at_end && before.is_some_and(carried_by);
        let persistent_before = before.is_some_and(|other| persistent[other]);
        let held_by_last_step = held_at_end && !carried_like_before && !persistent_before;
        let released_after_step =
            held_by_last_step || (at.step.is_some() && lifetime.is_some_and(|f| f.released && f.step != at.step));
        // Held at the end since the step before the last, nothing allocated after the last step,
        // where a step like it made the same allocation and freed it within itself (see the
        // module docs): carried into the last step, released by its end.
        let held_through_last =
            lifetime.is_none() && at.step.is_some() && at.step == second_last && !b.allocated_after_step;
        let freed_before = held_through_last
            && before_second_last.get(&at.nth).is_some_and(|&other| {
                sizes[other] == sizes[id]
                    && freed[other].as_ref().is_some_and(|f| !f.released && f.step == pending[other].step)
            });
        let carried = carried_like_before || freed_before || (!released_after_step && carried_by(id));
        let fits = |scope: Scope| match scope {
            Scope::Persistent => true,
            Scope::Step => same_step || released_after_step,
            Scope::MicroStep => same_micro,
        };
        let inferred_scope = if same_micro {
            Scope::MicroStep
        } else if same_step || released_after_step || carried {
            Scope::Step
        } else {
            Scope::Persistent
        };
        let tagged = at.tag.and_then(|tag| trace.phases.get(usize::from(tag)).map(|phase| (tag, phase.scope)));
        let (scope, phase) = match tagged {
            Some((tag, scope)) if fits(scope) => (scope, tag),
            other => {
                if let Some((tag, scope)) = other {
                    let location = trace.events[allocation.event].location;
                    let name = &trace.phases[usize::from(tag)].name;
                    warnings.add(WarningKind::ScopeMismatch, location, || {
                        format!(
                            "an allocation of phase `{name}` (scope {scope}) is replayed with scope {inferred_scope}"
                        )
                    });
                }
                let slot = match inferred_scope {
                    Scope::Persistent => 0,
                    Scope::Step if carried => 3,
                    Scope::Step => 1,
                    Scope::MicroStep => 2,
                };
                let phase = match inferred[slot] {
                    Some(phase) => phase,
                    None => {
                        let base = if carried { CARRIED_PHASE } else { inferred_scope.name() };
                        let mut name = base.to_owned();
                        if phases.iter().any(|p| p.name == name) {
                            name = format!("{base} (inferred)");
                        }
                        phases.push(ReplayPhase { name, scope: inferred_scope, tagged: false, carried });
                        let phase = (phases.len() - 1) as u16;
                        inferred[slot] = Some(phase);
                        phase
                    }
                };
                (inferred_scope, phase)
            }
        };
        allocation.scope = scope;
        allocation.phase = phase;
        allocation.released_at_boundary = scope == Scope::Step && released_after_step;
        persistent.push(scope == Scope::Persistent);
    }

    let facts = phase_facts(&allocations, &ops, phases.len());
    let mut device_peak_live: Vec<(u32, u64)> = device_live.iter().map(|(&d, &(_, peak))| (d, peak)).collect();
    device_peak_live.sort_unstable();
    Ok(Analysis {
        allocations,
        phases,
        facts,
        ops,
        streams,
        peak_live_bytes: peak,
        peak_live_event: peak_event,
        device_peak_live,
        live_at_end: live_bytes,
        steps: u64::from(b.steps),
        micro_steps: u64::from(b.micros),
        failures,
        warnings,
    })
}

/// Marks allocation `id` freed at event `index`; returns its bytes.
fn free_one(
    allocations: &mut [Allocation],
    freed: &mut [Option<Freed>],
    id: u32,
    index: usize,
    t: u64,
    at: Freed,
) -> u64 {
    let allocation = &mut allocations[id as usize];
    allocation.free = Some(index);
    allocation.t_free = Some(t);
    freed[id as usize] = Some(at);
    allocation.bytes
}

fn end_step(b: &mut Boundaries, ops: &mut Vec<(usize, Op)>, index: usize) {
    if b.micro.take().is_some() {
        ops.push((index, Op::EndMicro));
    }
    b.step = None;
    ops.push((index, Op::EndStep));
}

fn phase_facts(allocations: &[Allocation], ops: &[(usize, Op)], count: usize) -> Vec<PhaseFacts> {
    let mut facts = vec![PhaseFacts::default(); count];
    let mut lifetimes: Vec<Vec<u64>> = vec![Vec::new(); count];
    for allocation in allocations {
        let f = &mut facts[usize::from(allocation.phase)];
        f.allocations += 1;
        f.bytes = f.bytes.saturating_add(allocation.bytes);
        f.largest = f.largest.max(allocation.bytes);
        match allocation.t_free {
            Some(t) => lifetimes[usize::from(allocation.phase)].push(t.saturating_sub(allocation.t_alloc)),
            None => f.never_freed += 1,
        }
    }
    for (f, mut lifetimes) in facts.iter_mut().zip(lifetimes) {
        lifetimes.sort_unstable();
        f.median_lifetime_ns = lifetimes.get(lifetimes.len() / 2).copied().unwrap_or(0);
        f.max_lifetime_ns = lifetimes.last().copied().unwrap_or(0);
    }
    let mut live = vec![0u64; count];
    for &(_, op) in ops {
        match op {
            Op::Alloc(id) => {
                let a = &allocations[id as usize];
                let phase = usize::from(a.phase);
                live[phase] += a.bytes;
                facts[phase].peak_live = facts[phase].peak_live.max(live[phase]);
            }
            Op::Free(id) => {
                let a = &allocations[id as usize];
                live[usize::from(a.phase)] -= a.bytes;
            }
            _ => {}
        }
    }
    facts
}

/// The location of event `index` of `trace` (the end of the trace past its last event).
pub fn location_of(trace: &Trace, index: usize) -> Location {
    trace.events.get(index).map_or(Location::File, |event| event.location)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Event, TraceFormat};

    fn event(kind: EventKind, ptr: u64) -> Event {
        let mut event = Event::new(0, kind, Location::File);
        event.ptr = ptr;
        event.bytes = if kind == EventKind::Alloc { 64 } else { 0 };
        event
    }

    /// A weight, then `steps` steps of an activation and a gradient (pointers `10 + 2s` and
    /// `11 + 2s`), each step's events in between its marks as `body(step, events)` pushes them.
    fn training_loop(steps: u32, body: impl Fn(u64, &mut Vec<Event>)) -> Trace {
        let mut trace = Trace::new("loop", TraceFormat::Rmm);
        trace.events.push(event(EventKind::Alloc, 1));
        for step in 0..u64::from(steps) {
            trace.events.push(event(EventKind::StepBegin(step), 0));
            body(step, &mut trace.events);
            trace.events.push(event(EventKind::StepEnd(step), 0));
        }
        trace
    }

    const FREE: EventKind = EventKind::Free { released: false };

    /// Steps of an activation (freed in the step) and a gradient freed at the top of the next
    /// iteration, before its first allocation; the last step's gradient is never freed.
    fn zero_grad_at_the_top(steps: u32) -> Trace {
        training_loop(steps, |step, events| {
            let (activation, gradient) = (10 + 2 * step, 11 + 2 * step);
            events.extend([
                event(EventKind::Alloc, activation),
                event(EventKind::Alloc, gradient),
                event(FREE, activation),
            ]);
            if step + 1 < u64::from(steps) {
                events.push(event(FREE, gradient));
            }
        })
    }

    /// Steps that make an activation, free the step before's gradient, make their own gradient
    /// and free the activation: `zero_grad()` between the forward and backward passes. The last
    /// step's gradient is never freed.
    fn zero_grad_before_backward(steps: u32) -> Trace {
        training_loop(steps, |step, events| {
            let (activation, gradient) = (10 + 2 * step, 11 + 2 * step);
            events.push(event(EventKind::Alloc, activation));
            if step > 0 {
                events.push(event(FREE, gradient - 2));
            }
            events.extend([event(EventKind::Alloc, gradient), event(FREE, activation)]);
        })
    }

    #[test]
    fn memory_freed_in_the_step_after_its_own_is_carried_across_the_boundary() {
        let analysis = analyse(&zero_grad_before_backward(3)).unwrap();
        let step = (Scope::Step, false);
        assert_eq!(scopes(&analysis), [(Scope::Persistent, false), step, step, step, step, step, step]);
        let phase = |id: usize| &analysis.phases[usize::from(analysis.allocations[id].phase)];
        assert_eq!((phase(2).name.as_str(), phase(2).carried), (CARRIED_PHASE, true), "the gradients made in a step");
        assert_eq!(phase(4).name, CARRIED_PHASE);
        assert!(!phase(1).carried, "activations");
        // The last step's gradient, held at the end, is carried as the step before carried its
        // own (the same place in the step, the same size), into a step that never comes: the
        // last step is the sequence the steps before it planned.
        assert!(phase(6).carried);
        assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings);

        // Freed two steps later: no boundary carries it, it is persistent.
        let mut trace = zero_grad_before_backward(4);
        let free_of_first_gradient = trace.events.iter().position(|e| e.ptr == 11 && e.kind != EventKind::Alloc);
        let free = trace.events.remove(free_of_first_gradient.unwrap());
        let in_third_step = trace.events.iter().position(|e| e.ptr == 14).unwrap();
        trace.events.insert(in_third_step + 1, free);
        let analysis = analyse(&trace).unwrap();
        assert_eq!(scopes(&analysis)[2], (Scope::Persistent, false));
        assert_eq!(analysis.phases[usize::from(analysis.allocations[4].phase)].name, CARRIED_PHASE);
    }

    fn scopes(analysis: &Analysis) -> Vec<(Scope, bool)> {
        analysis.allocations.iter().map(|a| (a.scope, a.released_at_boundary)).collect()
    }

    /// Training steps of a loop that calls `zero_grad()` at its top, with an evaluation step
    /// after every second one: steps 0, 1 train, 2 evaluates, 3, 4 train, 5 evaluates. A training step makes an activation (freed) and a gradient
    /// (pointer `100 + step`), which the step frees at its end or, before an evaluation step,
    /// that step frees at its end; the last training step's is never freed.
    fn train_and_evaluate() -> Trace {
        let evaluates = |step: u64| step % 3 == 2;
        training_loop(6, |step, events| {
            if evaluates(step) {
                events.extend([event(EventKind::Alloc, 50 + step), event(FREE, 50 + step)]);
                if step < 5 {
                    events.push(event(FREE, 100 + step - 1));
                }
                return;
            }
            events.extend([
                event(EventKind::Alloc, 10 + step),
                event(EventKind::Alloc, 100 + step),
                event(FREE, 10 + step),
            ]);
            if !evaluates(step + 1) {
                events.push(event(FREE, 100 + step));
            }
        })
    }

    #[test]
    fn memory_the_step_before_the_last_holds_at_the_end_is_carried_as_a_step_like_it_freed_its_own() {
        let trace = train_and_evaluate();
        let analysis = analyse(&trace).unwrap();
        let gradient = |step: u64| {
            let allocation = analysis.allocations.iter().find(|a| trace.events[a.event].ptr == 100 + step).unwrap();
            (
                allocation.scope,
                analysis.phases[usize::from(allocation.phase)].name.clone(),
                allocation.released_at_boundary,
            )
        };
        let carried = (Scope::Step, CARRIED_PHASE.to_owned(), false);
        assert_eq!(gradient(0), (Scope::Step, "step".to_owned(), false), "freed in its step");
        assert_eq!(gradient(1), carried, "freed by the evaluation step");
        // Step 4's, never freed, made in the step before the last as step 3, the latest step
        // with as many allocations, made its own, which it freed: carried into the last step,
        // released by its end. Persistent, it was held beside the place the step's plan keeps
        // for it.
        assert_eq!(gradient(4), carried);
        assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings);

        // Something allocated after the last step: what the step before holds outlives it.
        let mut trace = train_and_evaluate();
        trace.events.push(event(EventKind::Alloc, 99));
        let analysis = analyse(&trace).unwrap();
        let held = analysis.allocations.iter().find(|a| trace.events[a.event].ptr == 104).unwrap();
        assert_eq!(held.scope, Scope::Persistent);
        // And where the step like it kept its own (for good, or into the next step, as a loop
        // that calls `zero_grad()` between its passes does, whose gradients an evaluation step
        // would hold until the next training step's backward pass), so is this one kept.
        for carried_on in [false, true] {
            let mut trace = train_and_evaluate();
            trace.events.retain(|e| !(e.ptr == 103 && e.kind == FREE));
            if carried_on {
                let in_step_4 = trace.events.iter().position(|e| e.ptr == 14).unwrap();
                trace.events.insert(in_step_4 + 1, event(FREE, 103));
            }
            let analysis = analyse(&trace).unwrap();
            let scope =
                |ptr: u64| analysis.allocations.iter().find(|a| trace.events[a.event].ptr == ptr).unwrap().scope;
            assert_eq!(
                (scope(103), scope(104)),
                (if carried_on { Scope::Step } else { Scope::Persistent }, Scope::Persistent)
            );
        }
    }

    #[test]
    fn memory_the_last_step_holds_at_the_end_is_released_by_its_end() {
        let analysis = analyse(&zero_grad_at_the_top(3)).unwrap();
        let step = (Scope::Step, false);
        assert_eq!(scopes(&analysis), [(Scope::Persistent, false), step, step, step, step, step, (Scope::Step, true)]);
        assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings);

        // Something allocated after the last step: what the step holds outlives it.
        let mut trace = zero_grad_at_the_top(3);
        trace.events.push(event(EventKind::Alloc, 99));
        let analysis = analyse(&trace).unwrap();
        assert_eq!(scopes(&analysis)[6], (Scope::Persistent, false));
        // Only the last step's: an earlier step's memory never freed outlives its step.
        let mut trace = zero_grad_at_the_top(3);
        let free_of_first_gradient = trace.events.iter().position(|e| e.ptr == 11 && e.kind != EventKind::Alloc);
        trace.events.remove(free_of_first_gradient.unwrap());
        let analysis = analyse(&trace).unwrap();
        assert_eq!(scopes(&analysis)[2], (Scope::Persistent, false));
        // And weights allocated before any step stay persistent in a trace of one step.
        let analysis = analyse(&zero_grad_at_the_top(1)).unwrap();
        assert_eq!(scopes(&analysis), [(Scope::Persistent, false), (Scope::Step, false), (Scope::Step, true)]);
        // Gradients freed between the steps, outside both (a loop whose step is marked after its
        // `zero_grad()`), are persistent, and so is the last step's, as the step before's was.
        let trace = training_loop(3, |step, events| {
            let (activation, gradient) = (10 + 2 * step, 11 + 2 * step);
            events.extend([
                event(EventKind::Alloc, activation),
                event(EventKind::Alloc, gradient),
                event(FREE, activation),
            ]);
        });
        let mut events = Vec::new();
        for e in trace.events.iter().copied() {
            let ends = matches!(e.kind, EventKind::StepEnd(step) if step < 2);
            events.push(e);
            if let (true, EventKind::StepEnd(step)) = (ends, e.kind) {
                events.push(event(FREE, 11 + 2 * step));
            }
        }
        let analysis = analyse(&Trace { events, ..trace }).unwrap();
        let step = (Scope::Step, false);
        let persistent = (Scope::Persistent, false);
        assert_eq!(scopes(&analysis), [persistent, step, persistent, step, persistent, step, persistent]);
    }
}
