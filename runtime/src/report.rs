//! What a step did: per-pool numbers and their sums per phase.

use std::fmt;
use std::time::Duration;

use steppool_sys::bytes::Bytes;

use crate::phase::{Phase, Scope, Strategy};
use crate::warning::Warning;

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

/// What ending a step did.
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
            if let Some(space) = pool.free_space {
                let sum = report.free_space.get_or_insert_with(FreeSpace::default);
                sum.largest_free = sum.largest_free.max(space.largest_free);
                sum.total_free += space.total_free;
            }
        }
        phases.sort_by_key(|p| p.phase);
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
    /// Bytes of the slab shared by the plans, held from the pool now.
    pub slab_bytes: u64,
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
