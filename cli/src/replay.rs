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
//! every boundary, and the sum over devices is maximised. Only allocations grow a reservation;
//! frees never shrink one and boundaries only trim, so no higher value occurs between samples.
//!
//! **Smallest capacity** is found by bisection over multiples of the simulated device's
//! reservation granule (2 MiB): the device reserves whole granules, so a capacity between two
//! multiples behaves exactly as the lower one, and the answer is exact for the model. The bisection
//! starts from a capacity known to fail (below the trace's peak of live bytes on its busiest
//! device) and one known to complete (the peak reservation of a completed run, which replays
//! identically on a device that size), and assumes, as RMM's replay benchmark does, that a
//! larger device never fails where a smaller one completes.

use std::collections::HashMap;

use steppool::sys::sim::{DEFAULT_GRANULE, MAX_CAPACITY, SimConfig};
use steppool::{Error, Phase, PhaseSpec, Runtime, Scope, Strategy, Verdict, fragmentation_ratio};

use steppool_trace::analysis::{Analysis, Op, PhaseFacts, ReplayPhase, location_of};
use steppool_trace::{Location, Trace};

use crate::error::{ReplayError, Result};

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
    StrategyDef {
        name: "planned",
        summary: "persistent allocations packed in chunks; every step- and micro-step-scoped allocation in one plan per step, packed offline from its recording",
        layout: planned,
    },
];

fn default_pool(_: &ReplayPhase, _: &PhaseFacts, _: &ReplayOptions) -> PhaseSpec {
    // PhaseSpec's release threshold defaults to u64::MAX, as PyTorch and RMM set it on the
    // cudaMallocAsync pool; a persistent phase is never trimmed.
    PhaseSpec::new("default", Scope::Persistent)
}

fn phase_pools(phase: &ReplayPhase, _: &PhaseFacts, _: &ReplayOptions) -> PhaseSpec {
    PhaseSpec::new(phase.name.clone(), phase.scope)
}

fn arena(phase: &ReplayPhase, facts: &PhaseFacts, options: &ReplayOptions) -> PhaseSpec {
    let spec = PhaseSpec::new(phase.name.clone(), phase.scope);
    match phase.scope {
        Scope::Persistent => spec,
        Scope::Step | Scope::MicroStep => {
            spec.strategy(Strategy::Arena { slab_bytes: options.arena_slab.unwrap_or_else(|| default_slab(facts)) })
        }
    }
}

fn planned(phase: &ReplayPhase, facts: &PhaseFacts, _: &ReplayOptions) -> PhaseSpec {
    match phase.scope {
        // Long-lived allocations of every persistent phase share one pool, packed in chunks.
        Scope::Persistent => PhaseSpec::new("persistent", Scope::Persistent)
            .strategy(Strategy::Chunked { chunk_bytes: default_chunk(facts) }),
        // One plan for the whole step: every step- and micro-step-scoped allocation (each freed
        // within its micro-step, which the trace does) in one lifetime-aware packing.
        Scope::Step | Scope::MicroStep => PhaseSpec::new("step", Scope::Step).strategy(Strategy::PLANNED),
    }
}

/// The chunk of a persistent phase when planned: a sixteenth of its peak of live bytes, rounded
/// up to the 2 MiB granule, between 2 MiB and 64 MiB. The unused end of the last chunk is then
/// at most a sixteenth of the phase, and large phases are not taken in one piece.
pub fn default_chunk(facts: &PhaseFacts) -> u64 {
    (facts.peak_live / 16).next_multiple_of(DEFAULT_GRANULE).clamp(DEFAULT_GRANULE, 64 << 20)
}

/// The arena slab for a phase when none is given: an eighth of the phase's peak of live bytes,
/// rounded up to the 2 MiB granule, between 2 MiB and 256 MiB. Eight slabs keep the unused tail of
/// each slab (at most the largest allocation that did not fit) small against the peak, and the
/// bounds keep tiny phases from taking many slabs and large ones from stranding a huge tail.
pub fn default_slab(facts: &PhaseFacts) -> u64 {
    (facts.peak_live / 8).next_multiple_of(DEFAULT_GRANULE).clamp(DEFAULT_GRANULE, 256 << 20)
}

/// The strategies `name` selects: one by name, or `all`.
pub fn select(name: &str) -> Result<Vec<&'static StrategyDef>> {
    if name == "all" {
        return Ok(STRATEGIES.iter().collect());
    }
    STRATEGIES.iter().find(|s| s.name == name).map(|s| vec![s]).ok_or_else(|| {
        let names: Vec<&str> = STRATEGIES.iter().map(|s| s.name).collect();
        ReplayError::Invalid(format!("no strategy `{name}`: choose one of {}, or all", names.join(", ")))
    })
}

/// Settings of a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Capacity of each simulated device, in bytes.
    pub capacity: u64,
    /// Arena slab size; `None` for [`default_slab`].
    pub arena_slab: Option<u64>,
    /// Whether to find the smallest capacity that completes.
    pub bisect: bool,
    /// Points in each run's timeline.
    pub timeline_points: usize,
}

impl ReplayOptions {
    /// A replay on devices of `capacity` bytes, with bisection and a 1000-point timeline.
    pub fn new(capacity: u64) -> Self {
        Self { capacity, arena_slab: None, bisect: true, timeline_points: 1000 }
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

/// One replay at one capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// The strategy.
    pub strategy: &'static str,
    /// Capacity of each device.
    pub capacity: u64,
    /// `None` when every operation was replayed.
    pub failure: Option<Failure>,
    /// The highest sum over devices of reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Per device, its highest reservation.
    pub device_peak_reserved: Vec<u64>,
    /// The highest sum of live bytes the replay saw.
    pub peak_live_bytes: u64,
    /// Live and reserved bytes over the run.
    pub timeline: Timeline,
}

impl Run {
    /// Whether every operation was replayed.
    pub fn completed(&self) -> bool {
        self.failure.is_none()
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
}

/// Replays `analysis` of `trace` under each of `strategies`: a run at the chosen capacity, then
/// (if asked) the bisection for the smallest capacity.
pub fn replay(
    trace: &Trace,
    analysis: &Analysis,
    strategies: &[&'static StrategyDef],
    options: &ReplayOptions,
    observer: &dyn Observer,
) -> Result<Vec<StrategyResult>> {
    strategies
        .iter()
        .map(|def| {
            let run = run(trace, analysis, def, options.capacity, options, observer)?;
            let (min_capacity_bytes, bisection_runs) =
                if options.bisect { min_capacity(trace, analysis, def, options, &run, observer)? } else { (None, 0) };
            Ok(StrategyResult { run, peak_live_bytes: analysis.peak_live_bytes, min_capacity_bytes, bisection_runs })
        })
        .collect()
}

/// The smallest capacity per device, a multiple of the granule, on which `def` replays the trace
/// to the end, and the runs it took; `None` when not even the largest simulated device does.
pub fn min_capacity(
    trace: &Trace,
    analysis: &Analysis,
    def: &'static StrategyDef,
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
    let peak_device = completed.device_peak_reserved.iter().copied().max().unwrap_or(0);
    let mut hi = peak_device.div_ceil(granule).max(lo + 1);
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

/// Replays `analysis` under `def` on devices of `capacity` bytes, stopping at the first allocation
/// the runtime cannot serve.
pub fn run(
    trace: &Trace,
    analysis: &Analysis,
    def: &'static StrategyDef,
    capacity: u64,
    options: &ReplayOptions,
    observer: &dyn Observer,
) -> Result<Run> {
    let device_count = analysis
        .streams
        .iter()
        .map(|&(device, _)| device as usize + 1)
        .chain(trace.devices.iter().map(|d| d.ordinal as usize + 1))
        .max()
        .unwrap_or(1);
    let config = SimConfig { capacities: vec![capacity; device_count], ..SimConfig::with_capacity(capacity) };
    config.validate().map_err(|e| ReplayError::Invalid(format!("capacity {capacity} bytes: {e}")))?;
    let at = |event: usize, source: Error| ReplayError::Runtime {
        strategy: def.name.to_owned(),
        event,
        location: location_of(trace, event),
        source: Box::new(source),
    };
    let runtime = Runtime::builder().simulated(config).checked(false).build().map_err(|e| at(0, e))?;

    // Phases: one runtime phase per distinct spec name.
    let mut by_name: HashMap<String, Phase> = HashMap::new();
    let mut phases: Vec<Phase> = Vec::with_capacity(analysis.phases.len());
    for (phase, facts) in analysis.phases.iter().zip(&analysis.facts) {
        let spec = (def.layout)(phase, facts, options);
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
    let mut reserved = vec![0u64; device_count];
    let mut device_peak_reserved = vec![0u64; device_count];
    let (mut total_reserved, mut peak_reserved) = (0u64, 0u64);
    let (mut live, mut peak_live) = (0u64, 0u64);
    let mut pointers = vec![0u64; analysis.allocations.len()];
    let mut timeline = Timeline::new(trace.events.len(), options.timeline_points);
    let mut failure = None;

    let sample =
        |device: usize, reserved: &mut [u64], device_peak: &mut [u64], total: &mut u64, event: usize| -> Result<()> {
            let (free, capacity) = devices[device].memory_info().map_err(|e| at(event, e))?;
            let now = capacity - free;
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
                // SAFETY: the simulated device never backs its pointers with memory and the replay
                // launches no work, so no memory is ever used, before or after its release.
                let result =
                    unsafe { runtime.raw().alloc(phase, allocation.bytes, &streams[usize::from(allocation.stream)]) };
                match result {
                    Ok(ptr) => pointers[id as usize] = ptr,
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
                peak_live = peak_live.max(live);
                let device = allocation.device as usize;
                sample(device, &mut reserved, &mut device_peak_reserved, &mut total_reserved, event)?;
                peak_reserved = peak_reserved.max(total_reserved);
                timeline.record(event, live, total_reserved);
            }
            Op::Free(id) => {
                let allocation = &analysis.allocations[id as usize];
                live -= allocation.bytes;
                if !allocation.released_at_boundary || persistent[usize::from(allocation.phase)] {
                    // SAFETY: as for the allocation: nothing uses simulated memory.
                    unsafe { runtime.raw().free(pointers[id as usize]) }.map_err(|e| at(event, e))?;
                }
                timeline.record(event, live, total_reserved);
            }
            Op::BeginStep => {
                runtime.raw().begin_step().map_err(|e| at(event, e))?;
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
                        runtime.raw().end_step().map(drop)
                    } else {
                        runtime.raw().end_micro_step().map(drop)
                    }
                };
                ended.map_err(|e| at(event, e))?;
                for device in 0..device_count {
                    sample(device, &mut reserved, &mut device_peak_reserved, &mut total_reserved, event)?;
                }
                timeline.record(event.min(trace.events.len().saturating_sub(1)), live, total_reserved);
            }
        }
    }
    observer.advance((analysis.ops.len() % REPORT_EVERY) as u64);
    Ok(Run {
        strategy: def.name,
        capacity,
        failure,
        peak_reserved_bytes: peak_reserved,
        device_peak_reserved,
        peak_live_bytes: peak_live,
        timeline,
    })
}
