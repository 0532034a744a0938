//! Replaying a trace through the steppool runtime on the simulated device, under each strategy,
//! and finding the smallest device that runs it.
//!
//! A replay is the real runtime code: one [`Runtime`] on a simulated device of the chosen
//! capacity (one device per trace device, each of that capacity), one runtime stream per trace
//! stream, the phases of the [analysis](steppool_trace::analysis) declared as the strategy lays them out,
//! and every operation in trace order through the raw API (`RawApi::alloc`, `RawApi::free`,
//! `RawApi::begin_step`, `RawApi::end_step`, and the micro-step pair). A free is issued on the stream the
//! memory was allocated on, as the runtime does. Before each step's end the host waits for every
//! stream, as a training loop that reads its loss each step does. Failed allocations recorded in
//! the trace are not replayed (as RMM's replay benchmark skips them).
//!
//! **Peak reserved** is exact: the device's reservation (`total - free` from `cuMemGetInfo`,
//! which on the simulated device counts every pool's segments) is read after every allocation and
//! every boundary, and the sum over devices is maximised. Allocations grow a reservation, and a
//! boundary may too (a planned range mapping its holes again up to what the step held); frees
//! and the rest of a boundary only give back, so no higher value occurs between samples. The
//! overhead breakdown reads the layout after the allocation at the highest reservation an
//! allocation saw; where a boundary reserved more, the difference is unattributed (no step of
//! the repository's traces does, which their tests check).
//!
//! **Smallest capacity** is found by bisection over multiples of the simulated device's
//! reservation granule (2 MiB): the device reserves whole granules, so a capacity between two
//! multiples behaves exactly as the lower one, and the answer is exact for the model. The bisection
//! starts from a capacity known to fail (below the trace's peak of live bytes on its busiest
//! device) and one known to complete (the peak reservation of a completed run, which replays
//! identically on a device that size), and assumes, as RMM's replay benchmark does, that a
//! larger device never fails where a smaller one completes.
//!
//! **Steady peak** is the same maximum taken from the second step's beginning on (the
//! reservation it starts with included), over the live bytes' maximum over the same stretch:
//! what a long run settles at once the first step's warm-up has shaped its pools. A trace with
//! fewer than two steps has none.
//!
//! **Breakdown**: once a run completes, the replay runs again up to the peak moment defined in
//! [`breakdown`](crate::breakdown) and reads the layout there: through
//! [`Runtime::pool_handle`] and the simulated device's
//! [`pool_layout`](steppool::sys::sim::Sim::pool_layout) for steppool's strategies (every pool of
//! every phase and stream, its segments, with the live allocations at the addresses the runtime
//! returned; each run of adjacent pages mapped into a range that grows in place,
//! [`mapped_ranges`](steppool::sys::sim::Sim::mapped_ranges), as one range of a pool of its own),
//! and from the model's own blocks for the PyTorch models. Replays are deterministic,
//! so the second run reaches the same state.
//!
//! **PyTorch models** ([`TORCH_MODELS`]) replay the same operations through
//! [`TorchAllocator`], one per device of the same capacity, with
//! no step boundaries (PyTorch has none); they are compared, never recommended.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use steppool::sys::sim::{DEFAULT_GRANULE, MAX_CAPACITY, SimConfig};
use steppool::sys::{CUmemoryPool, Driver};
use steppool::{Error, PageTraffic, Phase, PhaseSpec, Runtime, Scope, Strategy, Verdict, fragmentation_ratio};

use steppool_trace::analysis::{Analysis, Op, PhaseFacts, ReplayPhase, location_of};
use steppool_trace::plans::PlanFile;
use steppool_trace::recommend::{Candidate, recommend};
use steppool_trace::{Location, Trace};

use crate::breakdown::{Breakdown, Live, Range, Snapshot, breakdown};
use crate::error::{ReplayError, Result};
use crate::torch::{TorchAllocator, TorchMode};

/// How a strategy lays out the trace's phases: the runtime phase spec for each replay phase.
/// Replay phases given specs of the same name share one runtime phase.
pub type Layout = fn(&ReplayPhase, &PhaseFacts, &ReplayOptions) -> PhaseSpec;

/// A strategy the replay compares.
#[derive(Clone, Copy, Debug)]
pub struct StrategyDef {
    /// Its name on the command line and in reports.
    pub name: &'static str,
    /// One line on what it does.
    pub summary: &'static str,
    /// Its layout.
    pub layout: Layout,
}

/// Every strategy, in report order. A new strategy is one more entry here.
pub const STRATEGIES: &[StrategyDef] = &[
    StrategyDef {
        name: "default-pool",
        summary: "one pool per stream for everything, release threshold raised (plain cudaMallocAsync as frameworks configure it)",
        layout: default_pool,
    },
    StrategyDef {
        name: "phase-pools",
        summary: "a pool per (stream, phase): persistent, step and micro-step lifetimes apart, released at boundaries",
        layout: phase_pools,
    },
    StrategyDef {
        name: "arena",
        summary: "phase pools, with step and micro-step phases as bump arenas reset at their boundary",
        layout: arena,
    },
    PLANNED,
];

/// `planned`: persistent allocations in chunks, the rest in one plan per step.
pub const PLANNED: StrategyDef = StrategyDef {
    name: "planned",
    summary: "persistent allocations packed end to end (one range grown in place, or chunks); every step- and micro-step-scoped allocation, and memory a step hands to the next, in one plan per step, packed offline from its recording",
    layout: planned,
};

fn default_pool(_: &ReplayPhase, _: &PhaseFacts, _: &ReplayOptions) -> PhaseSpec {
    // PhaseSpec's release threshold defaults to u64::MAX, as PyTorch and RMM set it on the
    // cudaMallocAsync pool; a persistent phase is never trimmed.
    PhaseSpec::new("default", Scope::Persistent)
}

fn phase_pools(phase: &ReplayPhase, _: &PhaseFacts, _: &ReplayOptions) -> PhaseSpec {
    PhaseSpec::new(phase.name.clone(), phase.scope).carry(phase.carried)
}

fn arena(phase: &ReplayPhase, facts: &PhaseFacts, options: &ReplayOptions) -> PhaseSpec {
    let spec = PhaseSpec::new(phase.name.clone(), phase.scope);
    match phase.scope {
        Scope::Persistent => spec,
        // Memory a step hands to the next outlives the arena's reset: a pool of its own.
        Scope::Step if phase.carried => spec.carry(true),
        Scope::Step | Scope::MicroStep => {
            spec.strategy(Strategy::Arena { slab_bytes: options.arena_slab.unwrap_or_else(|| default_slab(facts)) })
        }
    }
}

/// The phase the `planned` layout serves every step- and micro-step-scoped allocation from: the
/// phase whose plans `steppool plan` saves and [`PLANNED_LOADED`] loads.
pub const STEP_PHASE: &str = "step";

/// `planned`, its step phase starting with saved plans ([`ReplayOptions::plans`]): planned from
/// the first step. Replayed only when plans are given (`steppool replay --plan`).
pub const PLANNED_LOADED: StrategyDef = StrategyDef {
    name: "planned-loaded",
    summary: "planned, starting with the saved plans of --plan: the first step is served from them, with no recording step",
    layout: planned_loaded,
};

fn planned_loaded(phase: &ReplayPhase, facts: &PhaseFacts, options: &ReplayOptions) -> PhaseSpec {
    let spec = planned(phase, facts, options);
    match options.plans.as_ref().and_then(|file| file.phase(STEP_PHASE)) {
        Some(saved) if spec.name == STEP_PHASE => spec.plans(saved.clone()),
        _ => spec,
    }
}

fn planned(phase: &ReplayPhase, facts: &PhaseFacts, _: &ReplayOptions) -> PhaseSpec {
    match phase.scope {
        // Long-lived allocations of every persistent phase share one pool, packed in chunks.
        Scope::Persistent => persistent_chunks(facts),
        // One plan for the whole step: every step- and micro-step-scoped allocation (each freed
        // within its micro-step, which the trace does) in one lifetime-aware packing, and the
        // memory a step hands to the next (the `carried` phase), which the step phase then
        // carries (`PhaseSpec::carry`): packed with both its lives, its allocation to the step's
        // end and the next step's start to its free there, at one offset.
        Scope::Step if phase.carried => step_phase().carry(true),
        Scope::Step | Scope::MicroStep => step_phase(),
    }
}

/// The spec `def` gives each phase of `analysis`, in order: a runtime phase per distinct name,
/// declared by the first spec of that name, which carries memory into the next step where the
/// layout routes any carrying phase to it.
pub fn phase_specs(def: &StrategyDef, analysis: &Analysis, options: &ReplayOptions) -> Vec<PhaseSpec> {
    let specs: Vec<PhaseSpec> =
        analysis.phases.iter().zip(&analysis.facts).map(|(phase, facts)| (def.layout)(phase, facts, options)).collect();
    let carrying: HashSet<String> = specs.iter().filter(|spec| spec.carry).map(|spec| spec.name.clone()).collect();
    specs
        .into_iter()
        .map(|spec| {
            let carries = carrying.contains(&spec.name);
            spec.carry(carries)
        })
        .collect()
}

/// The phase of `planned` every step- and micro-step-scoped allocation is served from.
fn step_phase() -> PhaseSpec {
    PhaseSpec::new(STEP_PHASE, Scope::Step).strategy(Strategy::PLANNED)
}

/// The long-lived allocations of `planned`: one pool, packed in chunks.
fn persistent_chunks(facts: &PhaseFacts) -> PhaseSpec {
    PhaseSpec::new("persistent", Scope::Persistent).strategy(Strategy::Chunked { chunk_bytes: default_chunk(facts) })
}

/// The chunk of a persistent phase when planned: a sixteenth of its peak of live bytes, rounded
/// up to the 2 MiB granule, between 2 MiB and 64 MiB. The unused end of the last chunk is then
/// at most a sixteenth of the phase, and large phases are not taken in one piece.
pub fn default_chunk(facts: &PhaseFacts) -> u64 {
    (facts.peak_live / 16).next_multiple_of(DEFAULT_GRANULE).clamp(DEFAULT_GRANULE, 64 << 20)
}

/// The arena slab for a phase when none is given: [`Strategy::arena_slab`] of its peak of live
/// bytes (an eighth of it, 2 MiB to 256 MiB), as the runtime's automatic strategy sizes arenas.
pub fn default_slab(facts: &PhaseFacts) -> u64 {
    Strategy::arena_slab(facts.peak_live)
}

/// A model of PyTorch's caching allocator the replay compares with.
#[derive(Clone, Copy, Debug)]
pub struct TorchDef {
    /// Its name on the command line and in reports.
    pub name: &'static str,
    /// One line on what it models.
    pub summary: &'static str,
    /// The configuration modelled.
    pub mode: TorchMode,
}

/// The PyTorch models, in report order, after the strategies.
pub const TORCH_MODELS: &[TorchDef] = &[
    TorchDef {
        name: "torch-caching",
        summary: "model of PyTorch's native caching allocator, default settings (2/20 MiB segments, best fit, splits)",
        mode: TorchMode::Caching,
    },
    TorchDef {
        name: "torch-expandable",
        summary: "model of PyTorch's caching allocator with expandable_segments:True (one growing segment per stream and pool)",
        mode: TorchMode::Expandable,
    },
];

/// What a replay runs: one of steppool's strategies, or a PyTorch model.
#[derive(Clone, Copy, Debug)]
pub enum Allocator {
    /// A steppool strategy, through the runtime on the simulated device.
    Steppool(&'static StrategyDef),
    /// A model of PyTorch's allocator.
    Torch(&'static TorchDef),
}

impl Allocator {
    /// Its name.
    pub fn name(&self) -> &'static str {
        match self {
            Allocator::Steppool(def) => def.name,
            Allocator::Torch(def) => def.name,
        }
    }

    /// One line on what it does.
    pub fn summary(&self) -> &'static str {
        match self {
            Allocator::Steppool(def) => def.summary,
            Allocator::Torch(def) => def.summary,
        }
    }

    /// Whether it is a model of PyTorch (never recommended).
    pub fn is_torch(&self) -> bool {
        matches!(self, Allocator::Torch(_))
    }
}

/// What `name` selects: a strategy or a PyTorch model by name, or `all` (every strategy, then
/// the models).
pub fn select(name: &str) -> Result<Vec<Allocator>> {
    let all = STRATEGIES.iter().map(Allocator::Steppool).chain(TORCH_MODELS.iter().map(Allocator::Torch));
    if name == "all" {
        return Ok(all.collect());
    }
    all.clone().find(|a| a.name() == name).map(|a| vec![a]).ok_or_else(|| {
        let names: Vec<&str> = all.map(|a| a.name()).collect();
        ReplayError::Invalid(format!("no strategy `{name}`: choose one of {}, or all", names.join(", ")))
    })
}

/// Settings of a replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Capacity of each simulated device, in bytes.
    pub capacity: u64,
    /// Arena slab size; `None` for [`default_slab`].
    pub arena_slab: Option<u64>,
    /// Whether to find the smallest capacity that completes.
    pub bisect: bool,
    /// Points in each run's timeline.
    pub timeline_points: usize,
    /// Saved plans for [`PLANNED_LOADED`]: its step phase starts with the plans of the file's
    /// phase named [`STEP_PHASE`].
    pub plans: Option<Arc<PlanFile>>,
    /// Replay steppool's strategies on this driver's devices (a GPU) instead of simulated devices
    /// of `capacity`: the reservation is read from the driver alone (`cuMemGetInfo`, less what the
    /// device held before the run), so neither the breakdown (it reads the simulated device's
    /// layout) nor the bisection (it needs devices of any size) is made. The PyTorch models are
    /// models either way.
    pub driver: Option<Driver>,
    /// The unit in which the simulated devices' stream-ordered pools grow
    /// ([`SimConfig::pool_unit`]): by default
    /// [`DEFAULT_POOL_UNIT`](steppool::sys::sim::DEFAULT_POOL_UNIT), 32 MiB, what an H200's
    /// driver was measured to use; `None` for the segment model, a segment of each request
    /// rounded to the granule.
    pub pool_unit: Option<u64>,
}

impl ReplayOptions {
    /// A replay on devices of `capacity` bytes, with bisection and a 1000-point timeline.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            arena_slab: None,
            bisect: true,
            timeline_points: 1000,
            plans: None,
            driver: None,
            pool_unit: SimConfig::default().pool_unit,
        }
    }
}

/// Told how a replay proceeds, for a progress bar.
pub trait Observer {
    /// A run of `ops` operations under `strategy` on devices of `capacity` bytes begins.
    fn start(&self, strategy: &str, capacity: u64, ops: u64) {
        let _ = (strategy, capacity, ops);
    }
    /// `ops` more operations were replayed.
    fn advance(&self, ops: u64) {
        let _ = ops;
    }
}

/// An observer that ignores everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct Silent;

impl Observer for Silent {}

/// Why a run stopped short.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// The index of the event whose allocation failed.
    pub event: usize,
    /// Its line or record.
    pub location: Location,
    /// Bytes requested.
    pub requested: u64,
    /// The runtime phase it was allocated in.
    pub phase: String,
    /// The runtime's verdict: fragmentation or demand.
    pub verdict: Verdict,
    /// The runtime's report.
    pub message: String,
}

/// Live and reserved bytes over a run, sampled into buckets of events (the highest value of
/// each bucket).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Events in the trace.
    pub events: usize,
    /// Per bucket, `(live, reserved)`; `None` past a failure or where nothing happened.
    pub points: Vec<Option<(u64, u64)>>,
}

impl Timeline {
    fn new(events: usize, points: usize) -> Self {
        Self { events, points: vec![None; points.max(1)] }
    }

    fn record(&mut self, event: usize, live: u64, reserved: u64) {
        let bucket = (event as u128 * self.points.len() as u128 / self.events.max(1) as u128) as usize;
        let bucket = bucket.min(self.points.len() - 1);
        let point = self.points[bucket].get_or_insert((0, 0));
        point.0 = point.0.max(live);
        point.1 = point.1.max(reserved);
    }
}

/// One step's peaks in a [`Run`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepPeak {
    /// The highest sum over devices of reserved bytes during the step.
    pub peak_reserved_bytes: u64,
    /// The highest sum of live bytes during the step.
    pub peak_live_bytes: u64,
}

/// One replay at one capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// The strategy.
    pub strategy: &'static str,
    /// Capacity of each device.
    pub capacity: u64,
    /// `None` when every operation was replayed.
    pub failure: Option<Failure>,
    /// The highest sum over devices of reserved bytes, at any moment the replay samples (after
    /// each allocation and free, and at each boundary).
    pub peak_reserved_bytes: u64,
    /// That sum after the peak moment's allocation ([`Run::peak_op`]): below the run's peak
    /// only where a boundary reserved more than any allocation did, such as a range mapping
    /// its holes again at a step's end.
    pub peak_op_reserved_bytes: u64,
    /// Per device, its highest reservation.
    pub device_peak_reserved: Vec<u64>,
    /// The highest sum of live bytes the replay saw.
    pub peak_live_bytes: u64,
    /// The highest sum of reserved bytes from the second step's beginning on; `None` with fewer
    /// than two steps.
    pub steady_peak_reserved_bytes: Option<u64>,
    /// The highest sum of live bytes over the same stretch.
    pub steady_peak_live_bytes: Option<u64>,
    /// The index in [`Analysis::ops`] of the peak moment's allocation (see
    /// [`breakdown`](crate::breakdown)); `None` when nothing was allocated.
    pub peak_op: Option<usize>,
    /// Per step, from its beginning to the next one's (or the run's end), the highest sums of
    /// reserved and of live bytes: which step sets the peak. What runs before the first step (a
    /// program's setup) belongs to none.
    pub step_peaks: Vec<StepPeak>,
    /// The first step, from 0, whose reservation reached the run's peak; `None` when the setup
    /// before the first step did (or the trace has no steps).
    pub peak_step: Option<u32>,
    /// Live and reserved bytes over the run.
    pub timeline: Timeline,
    /// What the planned strategy's plans served over the run, summed over its steps' reports
    /// ([`PlanStats`](steppool::PlanStats)); `None` for a run without a planned pool.
    pub plans: Option<PlanTotals>,
    /// Pages the runtime's pools mapped into and unmapped from their ranges (each costs time on
    /// a GPU: some 70 µs a 2 MiB page on an H200), over the run and from the second step's
    /// beginning on; `None` for the models of PyTorch's allocator, which run no runtime.
    pub pages: Option<RunPages>,
}

/// A run's page traffic ([`Run::pages`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunPages {
    /// Over the whole run.
    pub whole: PageTraffic,
    /// From the second step's beginning on; `None` with fewer than two steps.
    pub steady: Option<PageTraffic>,
}

/// The planned strategy's counters ([`PlanStats`](steppool::PlanStats)) summed over a run's
/// steps and pools: how often a plan served, and how often a scope left it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanTotals {
    /// Allocations served at their planned offset.
    pub planned: u64,
    /// Allocations served otherwise: every allocation of a scope being recorded, and those after
    /// a deviation.
    pub unplanned: u64,
    /// Allocations a plan was in use for but could not serve (a size larger than its entry where
    /// the range is taken, an allocation the plan lacks, a planned range held late).
    pub deviations: u64,
    /// Scopes (steps, micro-steps) that deviated from their plan.
    pub deviated_scopes: u64,
    /// Scopes served from a plan, deviated or not.
    pub planned_scopes: u64,
}

impl PlanTotals {
    /// Adds one step's counters of one pool.
    fn add(&mut self, stats: &steppool::PlanStats) {
        self.planned += stats.planned;
        self.unplanned += stats.unplanned;
        self.deviations += stats.deviations;
        self.deviated_scopes += stats.deviated_scopes;
        self.planned_scopes += stats.plans.iter().map(|plan| plan.scopes).sum::<u64>();
    }
}

impl Run {
    /// Whether every operation was replayed.
    pub fn completed(&self) -> bool {
        self.failure.is_none()
    }

    /// Bytes of pages mapped and unmapped per step from the second step on; `None` for the
    /// models of PyTorch's allocator and with fewer than two steps.
    pub fn steady_page_traffic_per_step(&self) -> Option<u64> {
        let steady = self.pages?.steady?;
        let steps = self.step_peaks.len().checked_sub(1).filter(|&steps| steps > 0)? as u64;
        Some((steady.mapped + steady.unmapped) / steps)
    }
}

/// A strategy's result: the run at the chosen capacity and the smallest capacity that completes.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyResult {
    /// The run at the chosen capacity.
    pub run: Run,
    /// The trace's peak of live bytes.
    pub peak_live_bytes: u64,
    /// The smallest capacity (per device) that completes, if bisection ran and one does.
    pub min_capacity_bytes: Option<u64>,
    /// Runs the bisection took.
    pub bisection_runs: u32,
    /// Where peak reserved − peak live goes, for a run that completed.
    pub breakdown: Option<Breakdown>,
}

impl StrategyResult {
    /// Peak reserved / peak live.
    pub fn overhead(&self) -> f64 {
        if self.peak_live_bytes == 0 { 1.0 } else { self.run.peak_reserved_bytes as f64 / self.peak_live_bytes as f64 }
    }

    /// `1 - peak live / peak reserved`.
    pub fn fragmentation_ratio(&self) -> f64 {
        fragmentation_ratio(self.peak_live_bytes, self.run.peak_reserved_bytes)
    }

    /// Steady peak reserved / steady peak live; `None` with fewer than two steps.
    pub fn steady_overhead(&self) -> Option<f64> {
        let reserved = self.run.steady_peak_reserved_bytes?;
        let live = self.run.steady_peak_live_bytes?;
        Some(if live == 0 { 1.0 } else { reserved as f64 / live as f64 })
    }
}

/// The strategy a replay recommends, by [the rule](steppool_trace::recommend) the runtime's
/// automatic strategy uses too: of steppool's strategies (never a PyTorch model) whose run
/// completed, the one with the least whole-run peak reserved, the earlier in report order on
/// ties; `None` when none completed.
pub fn recommended(results: &[StrategyResult]) -> Option<&'static str> {
    let steppool: Vec<&StrategyResult> = results.iter().filter(|r| !is_torch(r.run.strategy)).collect();
    let candidates: Vec<Candidate<'_>> = steppool
        .iter()
        .map(|r| Candidate {
            name: r.run.strategy,
            completed: r.run.completed(),
            peak_reserved: r.run.peak_reserved_bytes,
        })
        .collect();
    recommend(&candidates).map(|index| steppool[index].run.strategy)
}

/// Whether `name` is one of the PyTorch models.
pub fn is_torch(name: &str) -> bool {
    TORCH_MODELS.iter().any(|m| m.name == name)
}

/// Replays `analysis` of `trace` under each of `allocators`: a run at the chosen capacity, the
/// breakdown at its peak if it completed, then (if asked) the bisection for the smallest capacity.
pub fn replay(
    trace: &Trace,
    analysis: &Analysis,
    allocators: &[Allocator],
    options: &ReplayOptions,
    observer: &dyn Observer,
) -> Result<Vec<StrategyResult>> {
    allocators
        .iter()
        .map(|&allocator| {
            let run = run(trace, analysis, allocator, options.capacity, options, observer)?;
            let on_driver = options.driver.is_some() && !is_torch(allocator.name());
            let breakdown = match (run.completed(), run.peak_op) {
                (false, _) => None,
                _ if on_driver => None,
                // Nothing allocated: nothing reserved, nothing live.
                (true, None) => Some(Breakdown::default()),
                (true, Some(peak_op)) => match run_probed(
                    trace,
                    analysis,
                    allocator,
                    options.capacity,
                    options,
                    observer,
                    Some(peak_op),
                )?
                .1
                {
                    // Read at the allocation peak; what a boundary reserved above it has no layout
                    // there and is unattributed, so that the parts still sum to the run's peak.
                    Some(snapshot) if snapshot.reserved == run.peak_op_reserved_bytes => {
                        let snapshot = Snapshot { reserved: run.peak_reserved_bytes, ..snapshot };
                        Some(breakdown(&snapshot, analysis.peak_live_bytes))
                    }
                    other => {
                        return Err(ReplayError::Invalid(format!(
                            "`{}` replayed again to its peak (operation {}) reserved {:?} bytes, not {}: the replay is not deterministic",
                            allocator.name(),
                            peak_op,
                            other.map(|s| s.reserved),
                            run.peak_op_reserved_bytes
                        )));
                    }
                },
            };
            let (min_capacity_bytes, bisection_runs) = if options.bisect && !on_driver {
                min_capacity(trace, analysis, allocator, options, &run, observer)?
            } else {
                (None, 0)
            };
            Ok(StrategyResult {
                run,
                peak_live_bytes: analysis.peak_live_bytes,
                min_capacity_bytes,
                bisection_runs,
                breakdown,
            })
        })
        .collect()
}

/// The smallest capacity per device, a multiple of the granule, on which `def` replays the trace
/// to the end, and the runs it took; `None` when not even the largest simulated device does.
pub fn min_capacity(
    trace: &Trace,
    analysis: &Analysis,
    def: Allocator,
    options: &ReplayOptions,
    known: &Run,
    observer: &dyn Observer,
) -> Result<(Option<u64>, u32)> {
    let granule = DEFAULT_GRANULE;
    let need = analysis.device_peak_live.iter().map(|&(_, live)| live).max().unwrap_or(0);
    if need == 0 {
        return Ok((Some(0), 0));
    }
    let mut runs = 0;
    // In granules: `lo` is known to fail (below the live bytes), `hi` known to complete.
    let mut lo = need.div_ceil(granule) - 1;
    let completed = if known.completed() {
        known.clone()
    } else {
        runs += 1;
        let largest = run(trace, analysis, def, MAX_CAPACITY, options, observer)?;
        if !largest.completed() {
            return Ok((None, runs));
        }
        largest
    };
    // A device one granule above the run's peak completes it: the run made the same choices
    // on a larger device without reaching its capacity, and a CUDA pool maps a unit only while a
    // granule stays free beside it.
    let peak_device = completed.device_peak_reserved.iter().copied().max().unwrap_or(0);
    let mut hi = (peak_device.div_ceil(granule) + 1).max(lo + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        runs += 1;
        if run(trace, analysis, def, mid * granule, options, observer)?.completed() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok((Some(hi * granule), runs))
}

/// Replays `analysis` under `allocator` on devices of `capacity` bytes, stopping at the first
/// allocation it cannot serve.
pub fn run(
    trace: &Trace,
    analysis: &Analysis,
    allocator: Allocator,
    capacity: u64,
    options: &ReplayOptions,
    observer: &dyn Observer,
) -> Result<Run> {
    run_probed(trace, analysis, allocator, capacity, options, observer, None).map(|(run, _)| run)
}

/// As [`run`]; with `probe`, the run stops after that operation and returns the layout there.
pub fn run_probed(
    trace: &Trace,
    analysis: &Analysis,
    allocator: Allocator,
    capacity: u64,
    options: &ReplayOptions,
    observer: &dyn Observer,
    probe: Option<usize>,
) -> Result<(Run, Option<Snapshot>)> {
    match allocator {
        Allocator::Steppool(def) => run_steppool(trace, analysis, def, capacity, options, observer, probe, None),
        Allocator::Torch(def) => Ok(run_torch(trace, analysis, def, capacity, options, observer, probe)),
    }
}

/// The devices a replay of `analysis` needs.
fn device_count(trace: &Trace, analysis: &Analysis) -> usize {
    analysis
        .streams
        .iter()
        .map(|&(device, _)| device as usize + 1)
        .chain(trace.devices.iter().map(|d| d.ordinal as usize + 1))
        .max()
        .unwrap_or(1)
}

/// The maxima a run tracks: whole-run and steady peaks and the peak moment.
#[derive(Debug, Default)]
struct Peaks {
    /// The highest reservation of any sample.
    reserved: u64,
    live: u64,
    /// The peak moment's operation, the reservation and the live bytes then.
    op: Option<usize>,
    op_reserved: u64,
    op_live: u64,
    /// The steady stretch's peaks, from the second step's beginning on.
    steady: Option<(u64, u64)>,
    /// Each step begun so far, its peaks, the current one last.
    per_step: Vec<StepPeak>,
    /// The highest reservation before the first step began (a program's setup).
    setup_reserved: u64,
}

impl Peaks {
    /// After allocation `op`, with `reserved` and `live` bytes.
    fn allocated(&mut self, op: usize, reserved: u64, live: u64) {
        self.live = self.live.max(live);
        if self.op.is_none() || reserved > self.op_reserved || (reserved == self.op_reserved && live > self.op_live) {
            (self.op, self.op_reserved, self.op_live) = (Some(op), reserved, live);
        }
        self.sampled(reserved, live);
    }

    /// Any other sample.
    fn sampled(&mut self, reserved: u64, live: u64) {
        self.reserved = self.reserved.max(reserved);
        if let Some((r, l)) = &mut self.steady {
            *r = (*r).max(reserved);
            *l = (*l).max(live);
        }
        match self.per_step.last_mut() {
            Some(step) => {
                step.peak_reserved_bytes = step.peak_reserved_bytes.max(reserved);
                step.peak_live_bytes = step.peak_live_bytes.max(live);
            }
            None => self.setup_reserved = self.setup_reserved.max(reserved),
        }
    }

    /// The first step whose reservation reached the run's peak; `None` when the setup before the
    /// first step did, or there are no steps.
    fn peak_step(&self) -> Option<u32> {
        if self.setup_reserved >= self.reserved {
            return None;
        }
        self.per_step.iter().position(|step| step.peak_reserved_bytes >= self.reserved).map(|step| step as u32)
    }

    fn step_begun(&mut self, reserved: u64, live: u64) {
        self.per_step.push(StepPeak { peak_reserved_bytes: reserved, peak_live_bytes: live });
        if self.per_step.len() == 2 {
            self.steady = Some((reserved, live));
        }
    }
}

/// The page traffic of every pool `runtime` has had.
fn page_traffic(runtime: &Runtime) -> steppool::Result<PageTraffic> {
    Ok(runtime.telemetry().metrics()?.total().pages)
}

/// Replays `analysis` under the `planned` strategy and returns the run with the plans its phases
/// kept at the end ([`Runtime::saved_plans`]): what `steppool plan` writes.
pub fn record_plans(
    trace: &Trace,
    analysis: &Analysis,
    options: &ReplayOptions,
    observer: &dyn Observer,
) -> Result<(Run, PlanFile)> {
    let mut saved = PlanFile::default();
    let (run, _) =
        run_steppool(trace, analysis, &PLANNED, options.capacity, options, observer, None, Some(&mut saved))?;
    Ok((run, saved))
}

#[allow(clippy::too_many_arguments)]
fn run_steppool(
    trace: &Trace,
    analysis: &Analysis,
    def: &'static StrategyDef,
    capacity: u64,
    options: &ReplayOptions,
    observer: &dyn Observer,
    probe: Option<usize>,
    saved: Option<&mut PlanFile>,
) -> Result<(Run, Option<Snapshot>)> {
    let device_count = device_count(trace, analysis);
    // Virtual memory management as a GPU has it (the simulated device's default, named here so
    // that replay figures never depend on it): planned slabs, persistent chunks and arenas grow
    // in place.
    let defaults = SimConfig::with_capacity(capacity);
    let config = SimConfig {
        capacities: vec![capacity; device_count],
        vmm_supported: true,
        pool_unit: options.pool_unit,
        ..defaults
    };
    config.validate().map_err(|e| ReplayError::Invalid(format!("capacity {capacity} bytes: {e}")))?;
    let at = |event: usize, source: Error| ReplayError::Runtime {
        strategy: def.name.to_owned(),
        event,
        location: location_of(trace, event),
        source: Box::new(source),
    };
    let runtime = match &options.driver {
        Some(driver) => Runtime::builder().driver(driver.clone()),
        None => Runtime::builder().simulated(config),
    };
    let runtime = runtime.checked(false).build().map_err(|e| at(0, e))?;

    // Phases: one runtime phase per distinct spec name.
    let mut by_name: HashMap<String, Phase> = HashMap::new();
    let mut phases: Vec<Phase> = Vec::with_capacity(analysis.phases.len());
    for spec in phase_specs(def, analysis, options) {
        let runtime_phase = match by_name.get(&spec.name) {
            Some(&existing) => existing,
            None => {
                let name = spec.name.clone();
                let declared = match runtime.phase_named(&name) {
                    Some(built_in) => runtime.set_phase_spec(built_in, spec).map(|()| built_in),
                    None => runtime.declare_phase(spec),
                };
                let declared = declared.map_err(|e| at(0, e))?;
                by_name.insert(name, declared);
                declared
            }
        };
        phases.push(runtime_phase);
    }
    // Allocations a boundary releases in the trace are released by the runtime's boundary too,
    // unless the strategy puts them in a persistent phase, which no boundary releases.
    let persistent: Vec<bool> = phases
        .iter()
        .map(|&phase| runtime.phase_spec(phase).map(|spec| spec.scope == Scope::Persistent))
        .collect::<steppool::Result<_>>()
        .map_err(|e| at(0, e))?;

    let devices =
        (0..device_count).map(|d| runtime.device(d)).collect::<steppool::Result<Vec<_>>>().map_err(|e| at(0, e))?;
    let streams = analysis
        .streams
        .iter()
        .map(|&(device, _)| devices[device as usize].create_stream())
        .collect::<steppool::Result<Vec<_>>>()
        .map_err(|e| at(0, e))?;
    // What each device held before the run (nothing on a simulated device; the context and other
    // processes on a GPU): the run's reservation is what it adds. The device is waited for first,
    // so memory an earlier run on the same driver gave back in stream order is back.
    let baseline = devices
        .iter()
        .map(|device| device.synchronize().and_then(|()| device.memory_info()).map(|(free, total)| total - free))
        .collect::<steppool::Result<Vec<u64>>>()
        .map_err(|e| at(0, e))?;
    let mut reserved = vec![0u64; device_count];
    let mut device_peak_reserved = vec![0u64; device_count];
    let mut total_reserved = 0u64;
    let mut live = 0u64;
    let mut peaks = Peaks::default();
    let mut pointers = vec![0u64; analysis.allocations.len()];
    let mut alive = vec![false; analysis.allocations.len()];
    // Allocations the step's end releases before the trace frees them: no longer in the layout.
    let mut released_by_boundary: Vec<u32> = Vec::new();
    let mut snapshot = None;
    let mut timeline = Timeline::new(trace.events.len(), options.timeline_points);
    let mut failure = None;
    let mut plans = None;
    let mut second_step_pages: Option<PageTraffic> = None;

    let sample =
        |device: usize, reserved: &mut [u64], device_peak: &mut [u64], total: &mut u64, event: usize| -> Result<()> {
            let (free, capacity) = devices[device].memory_info().map_err(|e| at(event, e))?;
            let now = (capacity - free).saturating_sub(baseline[device]);
            *total = *total - reserved[device] + now;
            reserved[device] = now;
            device_peak[device] = device_peak[device].max(now);
            Ok(())
        };

    observer.start(def.name, capacity, analysis.ops.len() as u64);
    const REPORT_EVERY: usize = 1 << 14;
    for (done, &(event, op)) in analysis.ops.iter().enumerate() {
        if done % REPORT_EVERY == REPORT_EVERY - 1 {
            observer.advance(REPORT_EVERY as u64);
        }
        match op {
            Op::Alloc(id) => {
                let allocation = &analysis.allocations[id as usize];
                let phase = phases[usize::from(allocation.phase)];
                // SAFETY: the replay launches no work, so no memory it allocates is ever used, before
                // or after its release (the simulated device does not even back its pointers).
                let result =
                    unsafe { runtime.raw().alloc(phase, allocation.bytes, &streams[usize::from(allocation.stream)]) };
                match result {
                    Ok(ptr) => {
                        pointers[id as usize] = ptr;
                        alive[id as usize] = true;
                        if allocation.released_at_boundary && !persistent[usize::from(allocation.phase)] {
                            released_by_boundary.push(id);
                        }
                    }
                    Err(error @ (Error::OutOfMemory(_) | Error::ExceedsDevice { .. })) => {
                        let verdict = error.oom_report().map_or(Verdict::Demand, |report| report.verdict);
                        failure = Some(Failure {
                            event,
                            location: location_of(trace, event),
                            requested: allocation.bytes,
                            phase: runtime.phase_spec(phase).map(|s| s.name).unwrap_or_default(),
                            verdict,
                            message: error.to_string(),
                        });
                        break;
                    }
                    Err(other) => return Err(at(event, other)),
                }
                live += allocation.bytes;
                let device = allocation.device as usize;
                sample(device, &mut reserved, &mut device_peak_reserved, &mut total_reserved, event)?;
                peaks.allocated(done, total_reserved, live);
                timeline.record(event, live, total_reserved);
                if probe == Some(done) {
                    snapshot = Some(
                        steppool_snapshot(&runtime, &streams, analysis, &pointers, &alive, id, total_reserved)
                            .map_err(|e| at(event, e))?,
                    );
                    break;
                }
            }
            Op::Free(id) => {
                let allocation = &analysis.allocations[id as usize];
                live -= allocation.bytes;
                alive[id as usize] = false;
                peaks.sampled(total_reserved, live);
                if !allocation.released_at_boundary || persistent[usize::from(allocation.phase)] {
                    // SAFETY: as for the allocation: nothing uses simulated memory.
                    unsafe { runtime.raw().free(pointers[id as usize]) }.map_err(|e| at(event, e))?;
                }
                timeline.record(event, live, total_reserved);
            }
            Op::BeginStep => {
                runtime.raw().begin_step().map_err(|e| at(event, e))?;
                peaks.step_begun(total_reserved, live);
                if peaks.per_step.len() == 2 {
                    second_step_pages = Some(page_traffic(&runtime).map_err(|e| at(event, e))?);
                }
            }
            Op::BeginMicro => {
                runtime.raw().begin_micro_step().map_err(|e| at(event, e))?;
            }
            Op::EndStep | Op::EndMicro => {
                if op == Op::EndStep {
                    // The host waits for each step, as a training loop reading its loss does:
                    // the step's frees are then complete, and a boundary's trim can give back.
                    // One wait per device covers all its streams.
                    for device in &devices {
                        device.synchronize().map_err(|e| at(event, e))?;
                    }
                }
                // SAFETY: as for the allocations: nothing uses simulated memory.
                let ended = unsafe {
                    if op == Op::EndStep {
                        runtime.raw().end_step().map(Some)
                    } else {
                        runtime.raw().end_micro_step().map(|_| None)
                    }
                };
                // The planned pools' counters cover the whole step, its micro-steps included.
                if let Some(report) = ended.map_err(|e| at(event, e))? {
                    for stats in report.pools.iter().filter_map(|pool| pool.plan.as_ref()) {
                        plans.get_or_insert_with(PlanTotals::default).add(stats);
                    }
                }
                if op == Op::EndStep {
                    released_by_boundary.drain(..).for_each(|id| alive[id as usize] = false);
                }
                for device in 0..device_count {
                    sample(device, &mut reserved, &mut device_peak_reserved, &mut total_reserved, event)?;
                }
                peaks.sampled(total_reserved, live);
                timeline.record(event.min(trace.events.len().saturating_sub(1)), live, total_reserved);
            }
        }
    }
    observer.advance((analysis.ops.len() % REPORT_EVERY) as u64);
    let whole = page_traffic(&runtime).map_err(|e| at(trace.events.len().saturating_sub(1), e))?;
    let steady = second_step_pages.map(|before| whole.since(before));
    let run = Run {
        strategy: def.name,
        capacity,
        failure,
        peak_reserved_bytes: peaks.reserved,
        peak_op_reserved_bytes: peaks.op_reserved,
        device_peak_reserved,
        peak_live_bytes: peaks.live,
        steady_peak_reserved_bytes: peaks.steady.map(|(r, _)| r),
        steady_peak_live_bytes: peaks.steady.map(|(_, l)| l),
        peak_op: peaks.op,
        peak_step: peaks.peak_step(),
        step_peaks: peaks.per_step,
        timeline,
        plans,
        pages: Some(RunPages { whole, steady }),
    };
    if let Some(saved) = saved {
        *saved = runtime.saved_plans();
    }
    Ok((run, snapshot))
}

/// The layout of every pool of `runtime` (every phase on every stream) with the live allocations,
/// after allocation `last` brought the reservation to `reserved`.
fn steppool_snapshot(
    runtime: &Runtime,
    streams: &[steppool::Stream],
    analysis: &Analysis,
    pointers: &[u64],
    alive: &[bool],
    last: u32,
    reserved: u64,
) -> steppool::Result<Snapshot> {
    let sim = runtime.driver().sim().expect("a replay runs on the simulated device");
    let granule = sim.config().granule;
    let mut pools: HashMap<CUmemoryPool, usize> = HashMap::new();
    let mut ranges = Vec::new();
    for (phase, _) in runtime.phases() {
        for stream in streams {
            let Some(handle) = runtime.pool_handle(phase, stream)? else { continue };
            if pools.contains_key(&handle) {
                continue;
            }
            let pool = pools.len();
            pools.insert(handle, pool);
            let Some(layout) = sim.pool_layout(handle) else { continue };
            ranges.extend(layout.mapped.iter().map(|&(base, size)| Range {
                device: layout.device as u32,
                base,
                size,
                granule: layout.unit,
                pool,
            }));
        }
    }
    // Pages mapped into ranges that grow in place (planned slabs and persistent chunks on a
    // device with virtual memory management): each run of adjacent pages is one range, of a pool
    // of its own.
    let mut runs: Vec<(usize, u64, u64)> = Vec::new();
    for mapped in sim.mapped_ranges() {
        match runs.last_mut() {
            Some((device, base, size)) if *device == mapped.device && *base + *size == mapped.base => {
                *size += mapped.size
            }
            _ => runs.push((mapped.device, mapped.base, mapped.size)),
        }
    }
    for (device, base, size) in runs {
        let pool = pools.len();
        pools.insert(base as CUmemoryPool, pool);
        ranges.push(Range { device: device as u32, base, size, granule, pool });
    }
    let live = analysis
        .allocations
        .iter()
        .enumerate()
        .filter(|&(id, _)| alive[id])
        .map(|(id, a)| Live {
            device: a.device,
            addr: pointers[id],
            footprint: a.bytes.max(1).next_multiple_of(crate::limit::ALIGNMENT),
            requested: a.bytes,
        })
        .collect();
    let peak = &analysis.allocations[last as usize];
    Ok(Snapshot { reserved, ranges, live, peak_allocation: (peak.device, pointers[last as usize]) })
}

/// Replays `analysis` through models of PyTorch's allocator, one per device.
fn run_torch(
    trace: &Trace,
    analysis: &Analysis,
    def: &'static TorchDef,
    capacity: u64,
    options: &ReplayOptions,
    observer: &dyn Observer,
    probe: Option<usize>,
) -> (Run, Option<Snapshot>) {
    let device_count = device_count(trace, analysis);
    let mut models: Vec<TorchAllocator> = (0..device_count).map(|_| TorchAllocator::new(def.mode, capacity)).collect();
    let mut device_peak_reserved = vec![0u64; device_count];
    let mut device_live = vec![0u64; device_count];
    let mut live = 0u64;
    let mut peaks = Peaks::default();
    let mut pointers = vec![0u64; analysis.allocations.len()];
    let mut alive = vec![false; analysis.allocations.len()];
    let mut timeline = Timeline::new(trace.events.len(), options.timeline_points);
    let (mut failure, mut snapshot) = (None, None);
    let total = |models: &[TorchAllocator]| models.iter().map(TorchAllocator::reserved).sum::<u64>();
    observer.start(def.name, capacity, analysis.ops.len() as u64);
    for (done, &(event, op)) in analysis.ops.iter().enumerate() {
        match op {
            Op::Alloc(id) => {
                let allocation = &analysis.allocations[id as usize];
                let device = allocation.device as usize;
                match models[device].alloc(allocation.bytes, allocation.stream) {
                    Ok(ptr) => {
                        pointers[id as usize] = ptr;
                        alive[id as usize] = true;
                    }
                    Err(oom) => {
                        let fits = device_live[device] + allocation.bytes <= capacity;
                        let verdict = if fits { Verdict::Fragmentation } else { Verdict::Demand };
                        failure = Some(Failure {
                            event,
                            location: location_of(trace, event),
                            requested: allocation.bytes,
                            phase: String::new(),
                            verdict,
                            message: format!(
                                "{}: {} bytes requested with {} reserved and {} live on a device of {capacity}",
                                def.name, oom.requested, oom.reserved, device_live[device]
                            ),
                        });
                        break;
                    }
                }
                live += allocation.bytes;
                device_live[device] += allocation.bytes;
                device_peak_reserved[device] = device_peak_reserved[device].max(models[device].reserved());
                let reserved = total(&models);
                peaks.allocated(done, reserved, live);
                timeline.record(event, live, reserved);
                if probe == Some(done) {
                    snapshot = Some(torch_snapshot(&models, analysis, &pointers, &alive, id, reserved));
                    break;
                }
            }
            Op::Free(id) => {
                let allocation = &analysis.allocations[id as usize];
                models[allocation.device as usize].free(pointers[id as usize]);
                alive[id as usize] = false;
                live -= allocation.bytes;
                device_live[allocation.device as usize] -= allocation.bytes;
                peaks.sampled(total(&models), live);
                timeline.record(event, live, total(&models));
            }
            Op::BeginStep => peaks.step_begun(total(&models), live),
            Op::EndStep | Op::BeginMicro | Op::EndMicro => {}
        }
    }
    observer.advance(analysis.ops.len() as u64);
    let run = Run {
        strategy: def.name,
        capacity,
        failure,
        peak_reserved_bytes: peaks.reserved,
        peak_op_reserved_bytes: peaks.op_reserved,
        device_peak_reserved,
        peak_live_bytes: peaks.live,
        steady_peak_reserved_bytes: peaks.steady.map(|(r, _)| r),
        steady_peak_live_bytes: peaks.steady.map(|(_, l)| l),
        peak_op: peaks.op,
        peak_step: peaks.peak_step(),
        step_peaks: peaks.per_step,
        timeline,
        plans: None,
        pages: None,
    };
    (run, snapshot)
}

/// The models' reserved ranges, each stream's small and large pool apart, with the live blocks.
fn torch_snapshot(
    models: &[TorchAllocator],
    analysis: &Analysis,
    pointers: &[u64],
    alive: &[bool],
    last: u32,
    reserved: u64,
) -> Snapshot {
    let mut pools: HashMap<(usize, (u16, bool)), usize> = HashMap::new();
    let mut ranges = Vec::new();
    for (device, model) in models.iter().enumerate() {
        for range in model.reserved_ranges() {
            let next = pools.len();
            let pool = *pools.entry((device, range.pool)).or_insert(next);
            ranges.push(Range {
                device: device as u32,
                base: range.base,
                size: range.size,
                granule: range.granule,
                pool,
            });
        }
    }
    let live = analysis
        .allocations
        .iter()
        .enumerate()
        .filter(|&(id, _)| alive[id])
        .map(|(id, a)| Live {
            device: a.device,
            addr: pointers[id],
            footprint: models[a.device as usize].block_size(pointers[id]).unwrap_or(a.bytes),
            requested: a.bytes,
        })
        .collect();
    let peak = &analysis.allocations[last as usize];
    Snapshot { reserved, ranges, live, peak_allocation: (peak.device, pointers[last as usize]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boundary_above_every_allocation_sets_the_run_peak_and_the_allocation_peak_stays_the_probe() {
        let mut peaks = Peaks::default();
        peaks.sampled(4, 0);
        peaks.step_begun(4, 0);
        peaks.allocated(0, 10, 6);
        peaks.allocated(1, 11, 5);
        peaks.sampled(11, 2);
        peaks.step_begun(11, 2);
        // A boundary maps pages again: more than any allocation moment.
        peaks.sampled(14, 2);
        peaks.allocated(2, 11, 7);
        assert_eq!((peaks.reserved, peaks.live), (14, 7), "every sample counts");
        // The probe is the allocation at the highest reservation an allocation saw with the
        // most live bytes (the earliest on ties).
        assert_eq!((peaks.op, peaks.op_reserved, peaks.op_live), (Some(2), 11, 7));
        assert_eq!(peaks.peak_step(), Some(1), "the step of the boundary");
        assert_eq!(peaks.per_step[1].peak_reserved_bytes, 14);
    }
}
