//! What a step did: per-pool numbers and their sums per phase, and where the step's overhead
//! went (see [`StepReport`]).

use std::fmt;
use std::time::Duration;

use steppool_sys::bytes::Bytes;

use crate::phase::{Phase, Scope, Strategy};
use crate::warning::Warning;

/// The split of peak reserved − peak live into rounding, granule tails, segregation and holes,
/// defined with `steppool replay`'s, which uses the same type.
pub use steppool_trace::breakdown::Breakdown;
use steppool_trace::breakdown::{Live, Range, Snapshot, breakdown};

/// Which pool: the pool of one phase on one stream of one device. Every record of a pool (its
/// step numbers, its lifetime counters, the history's events, an OOM report's lines) names it by
/// this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId {
    /// The device ordinal.
    pub device: usize,
    /// The stream's id in the runtime.
    pub stream: u32,
    /// The phase.
    pub phase: Phase,
}

/// The numbers of one pool (one phase on one stream of one device), over the current step.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Which pool.
    pub pool: PoolId,
    /// The phase's name.
    pub phase_name: String,
    /// The phase's scope.
    pub scope: Scope,
    /// The phase's strategy.
    pub strategy: Strategy,
    /// Bytes of live allocations, as requested.
    pub used: u64,
    /// Highest `used` in the step.
    pub peak_used: u64,
    /// Bytes the pool holds from the device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub reserved: u64,
    /// Highest `reserved` in the step (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    pub peak_reserved: u64,
    /// Bytes live at the step's peak of `used`, as served: each allocation rounded up to 512
    /// bytes.
    pub peak_served: u64,
    /// The reservation granule of its device: the allocation granularity the device reports, or
    /// 2 MiB.
    pub granule: u64,
    /// Its part of the step's [overhead breakdown](StepReport#the-overhead-breakdown).
    pub breakdown: Breakdown,
    /// Allocations in the step.
    pub allocations: u64,
    /// Frees in the step.
    pub frees: u64,
    /// Bytes still live at a boundary of the step, which the boundary released.
    pub released: u64,
    /// The largest allocation requested in the step.
    pub largest_request: u64,
    /// Free space inside what the pool holds, where its strategy knows the layout (arenas,
    /// planned slabs); `None` for a `Direct` pool, whose CUDA pool does not publish its layout.
    pub free_space: Option<FreeSpace>,
    /// The planned strategy's hit rate, deviations, slab and plans over the step.
    pub plan: Option<PlanStats>,
    /// The strategy an [`Auto`](Strategy::Auto) pool chose at the end of its first scope; `None`
    /// before that and for the other strategies.
    pub chosen: Option<Strategy>,
    /// Pages mapped into and unmapped from its ranges in the step.
    pub pages: PageTraffic,
}

/// The sum of a phase's pools over a step.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct PhaseReport {
    /// The phase.
    pub phase: Phase,
    /// Its name.
    pub name: String,
    /// Its scope.
    pub scope: Scope,
    /// Its strategy.
    pub strategy: Strategy,
    /// Sum over its pools of their peak live bytes (an upper bound of the phase's peak).
    pub peak_used: u64,
    /// Sum over its pools of their peak reservations.
    pub peak_reserved: u64,
    /// Bytes its pools hold at the end of the step.
    pub reserved: u64,
    /// Bytes released at the step's boundaries.
    pub released: u64,
    /// Allocations in the step.
    pub allocations: u64,
    /// Frees in the step.
    pub frees: u64,
    /// Free space inside what its pools hold at the end of the step, where steppool knows the
    /// layout (arenas, the simulated device): the largest piece over its pools, and their sum.
    pub free_space: Option<FreeSpace>,
    /// Its part of the step's [overhead breakdown](StepReport#the-overhead-breakdown): the sum of its
    /// pools'. The parts sum to `peak_reserved − peak_used`.
    pub breakdown: Breakdown,
    /// Pages its pools mapped and unmapped in the step.
    pub pages: PageTraffic,
}

impl PhaseReport {
    /// `1 - largest_free / total_free` at the end of the step, where the layout is known.
    pub fn free_space_fragmentation(&self) -> Option<f64> {
        self.free_space.map(|space| space.fragmentation())
    }

    /// `1 - peak_used / peak_reserved`: the share of the peak reservation that never held live
    /// data at the peak. 0 when nothing was reserved.
    pub fn fragmentation_ratio(&self) -> f64 {
        fragmentation_ratio(self.peak_used, self.peak_reserved)
    }
}

/// `1 - peak_used / peak_reserved`, 0 when nothing was reserved.
pub fn fragmentation_ratio(peak_used: u64, peak_reserved: u64) -> f64 {
    if peak_reserved == 0 { 0.0 } else { 1.0 - peak_used.min(peak_reserved) as f64 / peak_reserved as f64 }
}

/// Sets each pool's [`PoolStats::breakdown`] from its counters: the split of its peak reserved −
/// peak used at its own peak, with its idle memory as holes in its device's peak pool and as
/// segregation in the others (see the [report's docs](StepReport#the-overhead-breakdown)).
pub(crate) fn attribute_overhead(pools: &mut [PoolStats]) {
    // Per device, the peak pool: of the pools that allocated in the step, the one with the most
    // live bytes at its peak (a persistent pool holding its weights is not where a step peaks);
    // the first on ties.
    let mut peak: Vec<(usize, (bool, u64), usize)> = Vec::new();
    for (index, pool) in pools.iter().enumerate() {
        let key = (pool.allocations > 0, pool.peak_used);
        match peak.iter_mut().find(|(device, _, _)| *device == pool.pool.device) {
            Some(best) if key > best.1 => *best = (pool.pool.device, key, index),
            Some(_) => {}
            None => peak.push((pool.pool.device, key, index)),
        }
    }
    for (index, pool) in pools.iter_mut().enumerate() {
        let is_peak = peak.iter().any(|&(_, (_, used), at)| at == index && used > 0);
        pool.breakdown = pool_breakdown(pool, is_peak);
    }
}

/// One pool's breakdown: the pool as one reserved range, its live data packed from the start.
fn pool_breakdown(pool: &PoolStats, is_peak: bool) -> Breakdown {
    let device = pool.pool.device as u32;
    let footprint = pool.peak_served.clamp(pool.peak_used, pool.peak_reserved.max(pool.peak_used));
    let snapshot = Snapshot {
        reserved: pool.peak_reserved,
        ranges: vec![Range { device, base: 0, size: pool.peak_reserved, granule: pool.granule.max(1), pool: 0 }],
        live: if pool.peak_used == 0 {
            Vec::new()
        } else {
            vec![Live { device, addr: 0, footprint, requested: pool.peak_used }]
        },
        // Holes when this is the device's peak pool: the peak allocation is in its range.
        peak_allocation: if is_peak { (device, 0) } else { (u32::MAX, 0) },
    };
    breakdown(&snapshot, pool.peak_used)
}

/// What ending a step did.
///
/// # The overhead breakdown
///
/// [`StepReport::breakdown`](Self::breakdown) splits the step's peak reserved − peak used (the report's own
/// [`peak_reserved`](StepReport::peak_reserved) and [`peak_used`](StepReport::peak_used), sums of
/// each pool's peak over the step) into the parts `steppool replay` reports, with the same names
/// and the same implementation ([`steppool_trace::breakdown`]): size rounding, granule tails,
/// segregation and holes. [`PhaseReport::breakdown`] and [`PoolStats::breakdown`] are its parts
/// per phase and per pool, and the metrics export them per device and phase. It is computed from
/// counters when a report is made, never on the allocation path: each pool counts its live bytes
/// as served (each allocation rounded up to the 512-byte alignment every strategy serves) beside
/// its live bytes as requested, and remembers the first at the step's peak of the second.
///
/// **What the runtime knows**, per pool, at its own peak of live bytes in the step: the bytes
/// requested (`peak_used`), the same allocations as served (`peak_served`), the most the pool
/// held in the step (`peak_reserved`, the driver's high-water mark plus mapped pages). From them, through a [`Snapshot`] in which each pool is one
/// reserved range with its live data packed from its start:
///
/// - **rounding** = `peak_served − peak_used`;
/// - **granule tails** = the unused end of the last granule the pool's live data reaches, with
///   the device's allocation granularity (2 MiB where the device reports none), at most what
///   the pool holds beyond its live data;
/// - the rest is **idle**: **holes** in the device's *peak pool* — of the pools that allocated in
///   the step, the one with the most live bytes at its peak: the one most likely at its peak
///   when the device is — and **segregation** in every other pool of the device:
///   memory it held while the peak pool was at its peak.
///
/// **What it cannot know.** The placement inside a CUDA pool is the driver's and unpublished, so
/// a `Direct` pool's free ranges and its segments' own tails are not seen: its idle memory is
/// holes or segregation as a whole, and its granule tail is the least one its live data costs
/// (exact for an arena's or plan slab's data packed from the slab's start; less than replay's
/// where live data sits above a hole). The runtime has no moment at which it reads every pool at
/// once without taking their locks on the allocation path: each pool is measured at its own
/// peak, so two pools that peak at different moments of the step count both peaks, as
/// [`StepReport::peak_used`] does, and the idle memory a pool holds at the device's peak only
/// because its own peak came earlier or later is not shown (`steppool replay`, which sees the
/// moment, counts it as segregation). So the runtime's `unattributed_bytes` and
/// `peak_shift_bytes` are always 0, and its parts sum exactly to `peak_reserved − peak_used` of
/// the pool, the phase and the step.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct StepReport {
    /// The step's index, from 0.
    pub index: u64,
    /// From `begin_step` to the end of the release.
    pub duration: Duration,
    /// Time spent releasing step-scoped memory at the end.
    pub release_time: Duration,
    /// Micro-steps the step had.
    pub micro_steps: u32,
    /// Every pool of the runtime, persistent ones included.
    pub pools: Vec<PoolStats>,
    /// The pools summed per phase, in phase order.
    pub phases: Vec<PhaseReport>,
    /// Errors raised in `Drop` during the step (see [`Runtime::take_errors`](crate::Runtime::take_errors)).
    pub deferred_errors: usize,
    /// Early warnings that fired at this step's end.
    pub warnings: Vec<Warning>,
    /// Captured steps ([`CapturedStep`](crate::CapturedStep)) launched during the step: a step
    /// that ran captured has at least one, and its allocations ran no allocator code.
    pub graph_launches: u64,
    /// The devices' graph memory pools (`cuDeviceGetGraphMemAttribute`), summed over the open
    /// devices, once the runtime has captured; zero before.
    pub graph_memory: GraphMemory,
    /// Where [`peak_reserved`](Self::peak_reserved) − [`peak_used`](Self::peak_used) went:
    /// rounding, granule tails, segregation and holes, summed over the pools (see the
    /// [report's docs](StepReport#the-overhead-breakdown) for what the runtime can and cannot see).
    pub breakdown: Breakdown,
}

/// Memory of the devices' graph memory pools, which the driver's graph allocation nodes use and
/// the CUDA pool counters do not show.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphMemory {
    /// Bytes the graph memory pools hold from the devices.
    pub reserved: u64,
    /// Their high-water mark.
    pub reserved_high: u64,
    /// Bytes associated with graphs.
    pub used: u64,
    /// Their high-water mark.
    pub used_high: u64,
}

impl GraphMemory {
    /// Adds one device's graph memory pool counters.
    pub(crate) fn add(&mut self, counters: &steppool_sys::PoolCounters) {
        self.reserved += counters.reserved;
        self.reserved_high += counters.reserved_high;
        self.used += counters.used;
        self.used_high += counters.used_high;
    }
}

impl StepReport {
    pub(crate) fn new(
        index: u64,
        duration: Duration,
        release_time: Duration,
        micro_steps: u32,
        pools: Vec<PoolStats>,
        deferred_errors: usize,
    ) -> Self {
        let mut phases: Vec<PhaseReport> = Vec::new();
        for pool in &pools {
            let report = match phases.iter_mut().find(|p| p.phase == pool.pool.phase) {
                Some(report) => report,
                None => {
                    phases.push(PhaseReport {
                        phase: pool.pool.phase,
                        name: pool.phase_name.clone(),
                        scope: pool.scope,
                        strategy: pool.strategy,
                        peak_used: 0,
                        peak_reserved: 0,
                        reserved: 0,
                        released: 0,
                        allocations: 0,
                        frees: 0,
                        free_space: None,
                        breakdown: Breakdown::default(),
                        pages: PageTraffic::default(),
                    });
                    phases.last_mut().expect("just pushed")
                }
            };
            report.peak_used += pool.peak_used;
            report.peak_reserved += pool.peak_reserved;
            report.reserved += pool.reserved;
            report.released += pool.released;
            report.allocations += pool.allocations;
            report.frees += pool.frees;
            report.breakdown += pool.breakdown;
            report.pages.add(pool.pages);
            if let Some(space) = pool.free_space {
                let sum = report.free_space.get_or_insert_with(FreeSpace::default);
                sum.largest_free = sum.largest_free.max(space.largest_free);
                sum.total_free += space.total_free;
            }
        }
        phases.sort_by_key(|p| p.phase);
        let breakdown = pools.iter().map(|pool| pool.breakdown).sum();
        Self {
            index,
            duration,
            release_time,
            micro_steps,
            pools,
            phases,
            deferred_errors,
            warnings: Vec::new(),
            graph_launches: 0,
            graph_memory: GraphMemory::default(),
            breakdown,
        }
    }

    /// Sum of the phases' peak live bytes.
    pub fn peak_used(&self) -> u64 {
        self.phases.iter().map(|p| p.peak_used).sum()
    }

    /// Sum of the phases' peak reservations.
    pub fn peak_reserved(&self) -> u64 {
        self.phases.iter().map(|p| p.peak_reserved).sum()
    }

    /// Bytes released at the step's boundaries.
    pub fn released(&self) -> u64 {
        self.phases.iter().map(|p| p.released).sum()
    }

    /// The report of one phase.
    pub fn phase(&self, phase: Phase) -> Option<&PhaseReport> {
        self.phases.iter().find(|p| p.phase == phase)
    }
}

impl fmt::Display for StepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "step {}: {:.3} ms, release {:.1} µs, {} micro-step(s)",
            self.index,
            self.duration.as_secs_f64() * 1e3,
            self.release_time.as_secs_f64() * 1e6,
            self.micro_steps
        )?;
        writeln!(
            f,
            "  {:<18} {:>11} {:>11} {:>11} {:>6} {:>12} {:>9} {:>8}",
            "phase", "peak used", "peak resv", "released", "frag", "largest free", "free frag", "allocs"
        )?;
        for p in &self.phases {
            let (largest, free_frag) = match p.free_space {
                Some(space) => {
                    (Bytes(space.largest_free).to_string(), format!("{:.1}%", space.fragmentation() * 100.0))
                }
                None => ("-".into(), "-".into()),
            };
            writeln!(
                f,
                "  {:<18} {:>11} {:>11} {:>11} {:>5.1}% {:>12} {:>9} {:>8}",
                p.name,
                Bytes(p.peak_used).to_string(),
                Bytes(p.peak_reserved).to_string(),
                Bytes(p.released).to_string(),
                p.fragmentation_ratio() * 100.0,
                largest,
                free_frag,
                p.allocations
            )?;
        }
        let b = &self.breakdown;
        writeln!(
            f,
            "  overhead {}: rounding {}, granule tails {}, segregation {}, holes {}",
            Bytes(self.peak_reserved().saturating_sub(self.peak_used())),
            Bytes(b.rounding_bytes),
            Bytes(b.granule_tail_bytes),
            Bytes(b.segregation_bytes),
            Bytes(b.hole_bytes)
        )?;
        for pool in &self.pools {
            if let Some(plan) = &pool.plan {
                writeln!(
                    f,
                    "  plan of {} on stream {}: {:.1}% hit, {} deviation(s), slab {}, {}",
                    pool.phase_name,
                    pool.pool.stream,
                    plan.hit_rate() * 100.0,
                    plan.deviations,
                    Bytes(plan.slab_bytes),
                    plan.overhead().map_or_else(
                        || "no plan yet".to_owned(),
                        |o| format!("{:.2}% over the lower bound", (o - 1.0) * 100.0)
                    )
                )?;
            }
        }
        for warning in &self.warnings {
            writeln!(f, "  warning [{}] {warning}", warning.rule())?;
        }
        Ok(())
    }
}

/// What ending a micro-step did.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct MicroStepReport {
    /// The step it belonged to.
    pub step: u64,
    /// Its index in the step, from 0.
    pub index: u32,
    /// From its beginning to the end of its release.
    pub duration: Duration,
    /// Time spent releasing its memory.
    pub release_time: Duration,
    /// Bytes still live at its end, which it released.
    pub released: u64,
}

/// Pages mapped into and unmapped from the address ranges that grow in place (slabs and chunks on
/// a device with virtual memory management): the page traffic of a pool. Each page costs time
/// both ways: on an H200 some 70 µs a 2 MiB page from `cuMemCreate` to `cuMemRelease`, so a pool
/// that maps and unmaps gigabytes a step spends milliseconds on it. Pages a pool kept mapped
/// across a free, and mapped again on its way back before it was unmapped, count in neither.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PageTraffic {
    /// Bytes of pages mapped.
    pub mapped: u64,
    /// Bytes of pages unmapped.
    pub unmapped: u64,
}

impl PageTraffic {
    /// The traffic since `earlier`, a reading of the same counts.
    pub fn since(self, earlier: PageTraffic) -> PageTraffic {
        PageTraffic {
            mapped: self.mapped.saturating_sub(earlier.mapped),
            unmapped: self.unmapped.saturating_sub(earlier.unmapped),
        }
    }

    /// Adds `other`'s bytes.
    pub(crate) fn add(&mut self, other: PageTraffic) {
        self.mapped += other.mapped;
        self.unmapped += other.unmapped;
    }
}

/// Free space a strategy knows the layout of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeSpace {
    /// The largest piece a request could still get without new memory.
    pub largest_free: u64,
    /// All bytes held but not handed out.
    pub total_free: u64,
}

impl FreeSpace {
    /// `1 - largest_free / total_free`: 0 when the free space is one piece (or there is none).
    pub fn fragmentation(&self) -> f64 {
        if self.total_free == 0 { 0.0 } else { 1.0 - self.largest_free as f64 / self.total_free as f64 }
    }
}

/// What a plan is keyed by: defined with the plan file format, so that a plan the runtime keeps
/// and one it saves or loads have one key type.
pub use steppool_trace::plans::PlanKey;

/// One plan a phase pool keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanSummary {
    /// What selects it.
    pub key: PlanKey,
    /// Allocations it places.
    pub allocations: usize,
    /// Slab bytes it needs.
    pub bytes: u64,
    /// The peak of live bytes of the recorded sequence (sizes rounded to 512): no plan of it can
    /// need less.
    pub lower_bound: u64,
    /// Scopes of the current step it served.
    pub scopes: u64,
}

impl PlanSummary {
    /// `bytes / lower_bound`: 1.0 is a perfect packing.
    pub fn overhead(&self) -> f64 {
        if self.lower_bound == 0 { 1.0 } else { self.bytes as f64 / self.lower_bound as f64 }
    }
}

/// What a phase pool with the [`Planned`](Strategy::Planned) strategy did over the current step,
/// and the plans it keeps.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct PlanStats {
    /// Allocations served at their planned offset.
    pub planned: u64,
    /// Allocations served from the phase's CUDA pool: deviations, and every allocation of a scope
    /// that had no plan yet (it is being recorded).
    pub unplanned: u64,
    /// Allocations a plan was in use for but could not serve: a size that did not match, an
    /// allocation the plan does not have, or a planned range still held by an allocation freed
    /// later than recorded.
    pub deviations: u64,
    /// Planned allocations a scope never asked for.
    pub missing: u64,
    /// Scopes that deviated from their plan (their plan was refreshed at their end).
    pub deviated_scopes: u64,
    /// Plans made at the step's boundaries: for new signatures and after deviations.
    pub replans: u64,
    /// Plans that moved to a new range at the start of the step that first followed them,
    /// leaving in the old one only the memory the step before handed over, where it lay in the
    /// way of what the step makes before it frees it
    /// ([`PhaseSpec::carry`](crate::PhaseSpec::carry)).
    pub moves: u64,
    /// Bytes of the slab shared by the plans, held from the pool now.
    pub slab_bytes: u64,
    /// Bytes of the bin held now: the unused end of the last page of a `Chunked` persistent
    /// pool on the same stream, lent at the step's start, where the plans serve the entries past
    /// their last page boundary so that the slab maps a page less; 0 without one.
    pub bin_bytes: u64,
    /// The plans kept, most recently used first.
    pub plans: Vec<PlanSummary>,
}

impl PlanStats {
    /// `planned / (planned + unplanned)`; 0 when nothing was allocated.
    pub fn hit_rate(&self) -> f64 {
        let total = self.planned + self.unplanned;
        if total == 0 { 0.0 } else { self.planned as f64 / total as f64 }
    }

    /// The largest plan's bytes over its lower bound, the slab's overhead over perfect packing.
    pub fn overhead(&self) -> Option<f64> {
        self.plans.iter().max_by_key(|plan| plan.bytes).map(PlanSummary::overhead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A pool of `phase` on `device` with the given step numbers and 2 MiB granules.
    fn pool(device: usize, phase: Phase, [used, served, reserved]: [u64; 3]) -> PoolStats {
        PoolStats {
            pool: PoolId { device, stream: 0, phase },
            phase_name: format!("phase {}", phase.index()),
            scope: Scope::Step,
            strategy: Strategy::Direct,
            used: 0,
            peak_used: used,
            reserved,
            peak_reserved: reserved,
            peak_served: served,
            granule: 2 * MIB,
            breakdown: Breakdown::default(),
            allocations: 1,
            frees: 1,
            released: 0,
            largest_request: used,
            free_space: None,
            plan: None,
            chosen: None,
            pages: PageTraffic { mapped: reserved, unmapped: 0 },
        }
    }

    fn report(mut pools: Vec<PoolStats>) -> StepReport {
        attribute_overhead(&mut pools);
        StepReport::new(0, Duration::ZERO, Duration::ZERO, 0, pools, 0)
    }

    fn exact(report: &StepReport) {
        assert_eq!(report.breakdown.total(), report.peak_reserved() as i64 - report.peak_used() as i64);
        for phase in &report.phases {
            assert_eq!(phase.breakdown.total(), phase.peak_reserved as i64 - phase.peak_used as i64, "{}", phase.name);
        }
    }

    #[test]
    fn rounding_tails_and_holes_of_one_growing_pool() {
        // 5 MiB + 100 B live, served as 5 MiB + 512: 412 B of rounding; its last granule ends at
        // 6 MiB: 1 MiB − 512 B of tail; the pool holds 10 MiB, so the other 4 MiB are holes.
        let step = report(vec![pool(0, Phase::ACTIVATIONS, [5 * MIB + 100, 5 * MIB + 512, 10 * MIB])]);
        let expected = Breakdown {
            rounding_bytes: 412,
            granule_tail_bytes: MIB - 512,
            hole_bytes: 4 * MIB,
            ..Breakdown::default()
        };
        assert_eq!(step.breakdown, expected);
        assert_eq!(step.pools[0].breakdown, expected);
        exact(&step);
    }

    #[test]
    fn idle_memory_of_the_other_pools_is_segregation() {
        // Activations has the most live bytes: its idle is holes. Gradients holds 6 MiB with
        // 1 MiB live at its peak: 1 MiB of tail, 4 MiB of segregation. Weights (on device 1) are
        // their device's peak pool (the only one): their idle is holes there.
        let step = report(vec![
            pool(0, Phase::ACTIVATIONS, [3 * MIB, 3 * MIB, 8 * MIB]),
            pool(0, Phase::GRADIENTS, [MIB, MIB, 6 * MIB]),
            pool(1, Phase::WEIGHTS, [2 * MIB, 2 * MIB, 4 * MIB]),
        ]);
        let of = |phase: Phase| step.phase(phase).unwrap().breakdown;
        assert_eq!(
            of(Phase::ACTIVATIONS),
            Breakdown { granule_tail_bytes: MIB, hole_bytes: 4 * MIB, ..Breakdown::default() }
        );
        assert_eq!(
            of(Phase::GRADIENTS),
            Breakdown { granule_tail_bytes: MIB, segregation_bytes: 4 * MIB, ..Breakdown::default() }
        );
        assert_eq!(of(Phase::WEIGHTS), Breakdown { hole_bytes: 2 * MIB, ..Breakdown::default() });
        assert_eq!(
            step.breakdown,
            Breakdown {
                granule_tail_bytes: 2 * MIB,
                segregation_bytes: 4 * MIB,
                hole_bytes: 6 * MIB,
                ..Breakdown::default()
            }
        );
        exact(&step);
    }

    #[test]
    fn a_pool_that_allocated_nothing_in_the_step_holds_no_holes() {
        // Activations had the most live bytes at its peak of the pools that allocated; the
        // weights, with more, allocated nothing in the step.
        let mut weights = pool(0, Phase::WEIGHTS, [30 * MIB, 30 * MIB, 32 * MIB]);
        weights.allocations = 0;
        let step = report(vec![
            weights,
            pool(0, Phase::GRADIENTS, [2 * MIB, 2 * MIB, 8 * MIB]),
            pool(0, Phase::ACTIVATIONS, [6 * MIB, 6 * MIB, 16 * MIB]),
        ]);
        assert_eq!(step.phase(Phase::ACTIVATIONS).unwrap().breakdown.hole_bytes, 10 * MIB);
        assert_eq!(step.phase(Phase::GRADIENTS).unwrap().breakdown.segregation_bytes, 6 * MIB);
        assert_eq!(step.phase(Phase::WEIGHTS).unwrap().breakdown.segregation_bytes, 2 * MIB);
        assert_eq!(step.breakdown.granule_tail_bytes, 0);
        exact(&step);
    }

    #[test]
    fn the_tail_never_exceeds_what_the_pool_holds_beyond_its_data() {
        // 1 MiB live in a pool of 1.5 MiB (mapped pages of 512 KiB with a 2 MiB granule
        // assumed): the tail is the 512 KiB held, no more.
        let step = report(vec![pool(0, Phase::WORKSPACE, [MIB, MIB, 3 * MIB / 2])]);
        assert_eq!(step.breakdown, Breakdown { granule_tail_bytes: MIB / 2, ..Breakdown::default() });
        // A pool with nothing live is nobody's peak: all segregation.
        let idle = report(vec![pool(0, Phase::WORKSPACE, [0, 0, 4 * MIB])]);
        assert_eq!(idle.breakdown, Breakdown { segregation_bytes: 4 * MIB, ..Breakdown::default() });
        exact(&step);
        exact(&idle);
    }

    #[test]
    fn a_phases_page_traffic_sums_its_pools() {
        // Activations on two devices (the helper's pools map what they reserve).
        let step = report(vec![
            pool(0, Phase::ACTIVATIONS, [MIB, MIB, 4 * MIB]),
            pool(1, Phase::ACTIVATIONS, [MIB, MIB, 6 * MIB]),
            pool(0, Phase::WEIGHTS, [MIB, MIB, 2 * MIB]),
        ]);
        assert_eq!(step.phase(Phase::ACTIVATIONS).unwrap().pages, PageTraffic { mapped: 10 * MIB, unmapped: 0 });
        assert_eq!(step.phase(Phase::WEIGHTS).unwrap().pages.mapped, 2 * MIB);
    }
}
