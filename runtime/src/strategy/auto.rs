//! The `Auto` strategy: a phase pool records its first scope and then chooses its strategy from
//! what it recorded, by the rule `steppool replay` names its recommended strategy with
//! ([`steppool_trace::recommend`]).
//!
//! The first scope (step or micro-step) is served as [`Direct`] serves it, straight from the
//! phase's CUDA pool, while its allocations (sizes, aligned) and frees are recorded. At its end
//! each candidate — [`Direct`], an [`Arena`] with the slab `steppool replay` gives an arena
//! ([`Strategy::arena_slab`]: an eighth of the recorded peak of live bytes, 2 MiB to 256 MiB), and
//! [`Planned`] — serves the recorded scope [`TRIAL_SCOPES`] times over a pool of its own on a
//! simulated device (the same model of the CUDA pool `steppool replay` runs on, with its 2 MiB
//! granule and virtual memory management as a GPU has it, so slabs and arenas are ranges that
//! grow in place; never the real device: nothing is taken from it), and the peak it reserves from its
//! second scope on is read from the pool's high-water mark. The rule takes the least of the
//! candidates that completed, the first listed (the simpler) on ties. The pool then serves every
//! later scope with the chosen strategy, after giving back (a stream wait, then a trim) what the
//! first scope left in it; a chosen `Planned` starts with the plan its trial packed
//! from the recording ([`Planned::with_plans`]), so the second scope is already planned.
//!
//! A trial that fails (the simulated device refuses a call) counts as a candidate that did not
//! complete; if none completes, the pool stays `Direct`. The choice is made once per pool and not
//! revisited: a workload whose first step is not like the others (a warm-up, an evaluation pass
//! first) should use a strategy named in its spec, or the plans of a run ([`PhaseSpec::plans`]).
//!
//! [`PhaseSpec::plans`]: crate::PhaseSpec#structfield.plans

use std::collections::HashMap;
use std::sync::Arc;

use steppool_sys::sim::SimConfig;
use steppool_sys::{CUdeviceptr, CUstream_flags, Driver};
use steppool_trace::plans::SavedPlan;
use steppool_trace::recommend::{Candidate, recommend};

use super::{Allocator, Arena, Bin, Direct, Planned, Served};
use crate::device_core::DeviceCore;
use crate::error::Result;
use crate::phase::{ALIGNMENT, PhaseEntry, Strategy};
use crate::report::{FreeSpace, PlanStats, PoolId};
use crate::source::{DeviceSource, Source};
use crate::stream_core::StreamCore;
use crate::telemetry::Recorder;

/// How many times a trial serves the recorded scope: the first is a planned strategy's recording,
/// the others show what each strategy holds once it has settled.
pub(crate) const TRIAL_SCOPES: usize = 3;

/// Scopes with more allocations than this are not tried: the phase stays `Direct`.
const MAX_RECORDED: usize = 1 << 16;

/// One recorded event of the first scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// An allocation of this many bytes, aligned.
    Alloc(u64),
    /// The free of the scope's allocation with this index.
    Free(u32),
}

/// What one candidate did on the recording.
#[derive(Clone, Debug)]
pub(crate) struct Trial {
    /// The strategy tried.
    pub(crate) strategy: Strategy,
    /// Whether every call succeeded.
    pub(crate) completed: bool,
    /// The peak reserved from the second scope on.
    pub(crate) peak_reserved: u64,
    /// A planned trial's plans, to start the chosen strategy with.
    plans: Vec<SavedPlan>,
}

/// The first scope as it runs.
#[derive(Debug, Default)]
struct Recording {
    events: Vec<Recorded>,
    /// Live allocations: their index in the scope.
    live: HashMap<CUdeviceptr, u32>,
    allocations: u32,
}

/// The `Auto` strategy's state in one phase pool.
#[derive(Debug)]
pub(crate) struct Auto {
    entry: Arc<PhaseEntry>,
    inner: Box<dyn Allocator>,
    /// While the first scope runs: what it did so far.
    recording: Option<Recording>,
    chosen: Option<Strategy>,
}

impl Auto {
    pub(crate) fn new(entry: Arc<PhaseEntry>) -> Self {
        Self { entry, inner: Box::new(Direct), recording: Some(Recording::default()), chosen: None }
    }

    /// Chooses from the recording and switches to the choice, if one completed.
    fn choose(&mut self, source: &mut dyn Source, events: &[Recorded]) -> Result<()> {
        if events.is_empty() {
            // Nothing recorded (a scope that did not allocate): record the next one.
            self.recording = Some(Recording::default());
            return Ok(());
        }
        let trials = if events.len() <= MAX_RECORDED { trials(&self.entry, events) } else { Vec::new() };
        let candidates: Vec<Candidate<'_>> = trials
            .iter()
            .map(|t| Candidate { name: t.strategy.name(), completed: t.completed, peak_reserved: t.peak_reserved })
            .collect();
        let Some(index) = recommend(&candidates) else {
            self.chosen = Some(Strategy::Direct);
            return Ok(());
        };
        let trial = &trials[index];
        self.chosen = Some(trial.strategy);
        if trial.strategy == Strategy::Direct {
            return Ok(());
        }
        let next = make(&self.entry, trial.strategy, &trial.plans);
        let mut previous = std::mem::replace(&mut self.inner, next);
        previous.release_all(source)?;
        // What the recording's pool holds goes back before the chosen strategy takes its own
        // (the stream is waited for, so the trim sees the frees complete): otherwise the pool
        // would keep the first step's memory idle beside the new slab, as the trim policy keeps
        // the recent peak.
        source.synchronize()?;
        source.trim_to(0)
    }
}

/// The strategies tried, in the rule's order (the simpler first), for a scope whose peak of live
/// bytes is `peak_live`.
pub(crate) fn candidates(peak_live: u64) -> [Strategy; 3] {
    [Strategy::Direct, Strategy::Arena { slab_bytes: Strategy::arena_slab(peak_live) }, Strategy::PLANNED]
}

/// An allocator of `strategy` for `entry`'s phase; a planned one starts with `plans`.
fn make(entry: &Arc<PhaseEntry>, strategy: Strategy, plans: &[SavedPlan]) -> Box<dyn Allocator> {
    match strategy {
        Strategy::Arena { slab_bytes } => Box::new(Arena::new(slab_bytes)),
        Strategy::Planned { max_plans, signature_len } => {
            Box::new(Planned::with_plans(entry.clone(), max_plans, signature_len, plans))
        }
        _ => Box::new(Direct),
    }
}

/// The peak of live bytes of a recorded scope.
fn peak_live(events: &[Recorded]) -> u64 {
    let mut sizes = Vec::new();
    let (mut live, mut peak) = (0u64, 0u64);
    for event in events {
        match *event {
            Recorded::Alloc(size) => {
                sizes.push(size);
                live += size;
                peak = peak.max(live);
            }
            Recorded::Free(index) => live -= sizes[index as usize],
        }
    }
    peak
}

/// Each candidate on the recording, on a simulated device of its own.
pub(crate) fn trials(entry: &Arc<PhaseEntry>, events: &[Recorded]) -> Vec<Trial> {
    candidates(peak_live(events))
        .into_iter()
        .map(|strategy| {
            trial(entry, strategy, events).unwrap_or(Trial {
                strategy,
                completed: false,
                peak_reserved: u64::MAX,
                plans: Vec::new(),
            })
        })
        .collect()
}

/// `strategy` serving the recorded scope [`TRIAL_SCOPES`] times over a pool of a simulated device.
fn trial(entry: &Arc<PhaseEntry>, strategy: Strategy, events: &[Recorded]) -> Result<Trial> {
    // Virtual memory management as on a GPU, and as `steppool replay` measures: slabs and arenas
    // are ranges that grow in place (an arena's bump through one range ties the plan on a scope
    // freed in stack order, and the tie goes to the simpler arena).
    let config = SimConfig { vmm_supported: true, ..SimConfig::with_capacity(steppool_sys::sim::MAX_CAPACITY) };
    let driver = Driver::simulated(config)?;
    let device = Arc::new(DeviceCore::open(&driver, 0)?);
    let raw = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING)?;
    let stream = Arc::new(StreamCore::new(device, raw, true, 0));
    let id = PoolId { device: 0, stream: stream.id, phase: entry.phase };
    let mut source = DeviceSource::new(stream, id, u64::MAX, &[], Arc::new(Recorder::default()))?;
    let mut allocator = make(entry, strategy, &[]);
    let mut ptrs: Vec<(Served, u64)> = Vec::with_capacity(events.len());
    let mut freed: Vec<bool> = Vec::with_capacity(events.len());
    let mut served = |allocator: &mut Box<dyn Allocator>, source: &mut DeviceSource| -> Result<()> {
        allocator.begin_step();
        ptrs.clear();
        freed.clear();
        for event in events {
            match *event {
                Recorded::Alloc(size) => {
                    ptrs.push((allocator.allocate(source, size)?, size));
                    freed.push(false);
                }
                Recorded::Free(index) => {
                    let (ptr, size) = ptrs[index as usize];
                    freed[index as usize] = true;
                    allocator.free(source, ptr, size)?;
                }
            }
        }
        // The boundary frees what is still live, as a pool does for a strategy that does not
        // reclaim it, then resets, keeping what the scope touched, as the trim policy does.
        for (&(ptr, size), _) in ptrs.iter().zip(&freed).filter(|(_, freed)| !**freed) {
            if !allocator.reclaims_live() {
                allocator.free(source, ptr, size)?;
            }
        }
        allocator.reset(source, u64::MAX)?;
        source.synchronize()?;
        let keep = allocator.touched().unwrap_or(peak_live(events));
        source.trim(keep, true)?;
        Ok(())
    };
    served(&mut allocator, &mut source)?;
    source.begin_step()?;
    for _ in 1..TRIAL_SCOPES {
        served(&mut allocator, &mut source)?;
    }
    let peak_reserved = source.reservation()?.peak_reserved;
    let plans = allocator.saved_plans();
    let released = allocator.release_all(&mut source);
    let destroyed = source.destroy();
    released.and(destroyed)?;
    Ok(Trial { strategy, completed: true, peak_reserved, plans })
}

impl Allocator for Auto {
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served> {
        let served = self.inner.allocate(source, bytes)?;
        if let Some(recording) = &mut self.recording {
            recording.live.insert(served.ptr, recording.allocations);
            recording.allocations += 1;
            recording.events.push(Recorded::Alloc(bytes.next_multiple_of(ALIGNMENT)));
        }
        Ok(served)
    }

    fn free(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        if let Some(recording) = &mut self.recording
            && let Some(index) = recording.live.remove(&served.ptr)
        {
            recording.events.push(Recorded::Free(index));
        }
        self.inner.free(source, served, bytes)
    }

    fn reset(&mut self, source: &mut dyn Source, keep: u64) -> Result<()> {
        let reset = self.inner.reset(source, keep);
        match self.recording.take() {
            Some(recording) => reset.and(self.choose(source, &recording.events)),
            None => reset,
        }
    }

    fn reclaims_live(&self) -> bool {
        self.inner.reclaims_live()
    }

    fn touched(&self) -> Option<u64> {
        self.inner.touched()
    }

    fn free_space(&self) -> Option<FreeSpace> {
        self.inner.free_space()
    }

    fn release_unused(&mut self, source: &mut dyn Source) -> Result<u64> {
        self.inner.release_unused(source)
    }

    fn give_back_freed(&mut self, source: &mut dyn Source, bytes: u64) -> Result<u64> {
        self.inner.give_back_freed(source, bytes)
    }

    fn release_all(&mut self, source: &mut dyn Source) -> Result<()> {
        self.inner.release_all(source)
    }

    fn begin_step(&mut self) {
        self.inner.begin_step();
    }

    fn saved_plans(&self) -> Vec<SavedPlan> {
        self.inner.saved_plans()
    }

    fn plan_stats(&self) -> Option<PlanStats> {
        self.inner.plan_stats()
    }

    fn chosen(&self) -> Option<Strategy> {
        self.chosen
    }

    /// A chosen planned strategy takes bins as a planned phase does; the recording (served
    /// directly) takes none, and it is replaced only once, before any bin is lent.
    fn bin(&self) -> Option<(Option<Bin>, bool)> {
        self.inner.bin()
    }

    fn set_bin(&mut self, bin: Option<Bin>) {
        self.inner.set_bin(bin);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phase::{Phase, PhaseSpec, Scope};

    fn entry() -> Arc<PhaseEntry> {
        PhaseEntry::new(Phase(0), PhaseSpec::new("p", Scope::Step).strategy(Strategy::Auto))
    }

    /// Events of a scope where each `(size, lives)` is allocated in turn and freed at once
    /// unless it `lives`; the living ones are freed at the end, last first.
    fn scope(sizes: &[(u64, bool)]) -> Vec<Recorded> {
        let mut events = Vec::new();
        let mut live = Vec::new();
        for (index, &(size, lives)) in sizes.iter().enumerate() {
            events.push(Recorded::Alloc(size));
            if lives {
                live.push(index as u32);
            } else {
                events.push(Recorded::Free(index as u32));
            }
        }
        events.extend(live.into_iter().rev().map(Recorded::Free));
        events
    }

    /// The trials' peaks, in candidate order, and the strategy the rule picks from them.
    fn tried(sizes: &[(u64, bool)]) -> (Vec<u64>, &'static str) {
        tried_events(&scope(sizes))
    }

    /// As [`tried`], for a recorded scope given event by event.
    fn tried_events(events: &[Recorded]) -> (Vec<u64>, &'static str) {
        let trials = trials(&entry(), events);
        assert!(trials.iter().all(|t| t.completed));
        let candidates: Vec<Candidate<'_>> = trials
            .iter()
            .map(|t| Candidate { name: t.strategy.name(), completed: t.completed, peak_reserved: t.peak_reserved })
            .collect();
        let chosen = trials[recommend(&candidates).unwrap()].strategy.name();
        (trials.iter().map(|t| t.peak_reserved).collect(), chosen)
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_scope_freed_in_stack_order_ties_the_arena_and_the_plan_and_takes_the_arena() {
        // Eight 3 MiB activations kept while scratch of 1 to 8 MiB comes and goes, each freed
        // before the next allocation: the pool's best fit puts each scratch above the
        // activations, which stretch across its first 32 MiB unit into a second; the arena's
        // bump, through a range that grows in place as on a GPU, moves back over each freed
        // scratch; both it and the plan need the peak of live bytes (24 + 8 MiB), and the tie
        // goes to the simpler arena.
        let sizes: Vec<(u64, bool)> = (0..8).flat_map(|l| [(3 * MIB, true), ((1 + l) * MIB, false)]).collect();
        let (peaks, chosen) = tried(&sizes);
        assert_eq!(peaks, [64 * MIB, 32 * MIB, 32 * MIB]);
        assert_eq!(chosen, "arena");
    }

    #[test]
    fn a_scope_freed_out_of_stack_order_is_planned() {
        // Buffers of 1 to 16 MiB, each freed after the next one is made (a sliding window of
        // two): the arena's bump never moves back and runs to their sum; the pool's best fit
        // leaves a hole each buffer is too large for and climbs into a second 32 MiB unit; the
        // plan reuses the holes.
        let mut events = vec![Recorded::Alloc(MIB)];
        for index in 1..16u32 {
            events.push(Recorded::Alloc(u64::from(index + 1) * MIB));
            events.push(Recorded::Free(index - 1));
        }
        events.push(Recorded::Free(15));
        let (peaks, chosen) = tried_events(&events);
        assert_eq!(peaks, [64 * MIB, 136 * MIB, 32 * MIB], "the plan at the largest pair, 15 + 16 MiB");
        assert_eq!(chosen, "planned");
    }

    #[test]
    fn an_arena_beats_one_pool_when_a_survivor_splits_a_freed_segment() {
        // 300 MiB freed, 1 MiB kept, 300 MiB again: the pool's best fit puts the survivor in the
        // first 300 MiB's free space, so the second 300 MiB, too large for what is left of it,
        // goes above it, in the memory of the first's idle units and one more (11 units of 32
        // MiB at the peak: the survivor's and the second's); the arena's bump moves back over
        // the freed 300 MiB, and the second lands after the survivor, as the plan places it: a
        // tie, which the arena takes.
        let (peaks, chosen) = tried(&[(300 * MIB, false), (MIB, true), (300 * MIB, false)]);
        assert_eq!(peaks, [352 * MIB, 302 * MIB, 302 * MIB]);
        assert_eq!(chosen, "arena");
    }

    #[test]
    fn a_tie_goes_to_the_simplest() {
        // One allocation of one pool unit: every strategy holds 32 MiB.
        let (peaks, chosen) = tried(&[(32 * MIB, false)]);
        assert_eq!(peaks, [32 * MIB; 3]);
        assert_eq!(chosen, "direct");
    }
}
