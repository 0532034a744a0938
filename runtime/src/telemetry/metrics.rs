//! Counters: what each pool has done over its life, and their sums per phase, stream and device.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::phase::{Scope, Strategy};
use crate::report::{Breakdown, FreeSpace, PageTraffic, PoolId};
use crate::warning::WarningRule;

/// The counters of one pool (one phase on one stream of one device), over its life.
///
/// Counts are kept under the pool's own lock, which only threads allocating on its stream in its
/// phase take: counting costs a few additions, no cache line is shared between streams, and the
/// clock is read for one allocation in 16, chosen at random. Reading them takes each pool's lock
/// briefly.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct PoolMetrics {
    /// Which pool.
    pub pool: PoolId,
    /// The phase's name.
    pub phase_name: String,
    /// The phase's scope.
    pub scope: Scope,
    /// The phase's strategy.
    pub strategy: Strategy,
    /// Whether this is the sum of the (device, phase) pools that went away with their streams:
    /// their counts stay, so counters never go back; `used` and `reserved` are 0 and
    /// `pool.stream` is meaningless (Prometheus labels it `retired`).
    pub retired: bool,
    /// Usage and counts.
    pub usage: Usage,
    /// Free space inside what the strategy holds, where it knows the layout.
    pub free_space: Option<FreeSpace>,
}

/// Usage and counts, summable over pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Usage {
    /// Bytes of live allocations, as requested.
    pub used: u64,
    /// Highest `used` ever (a sum over pools is an upper bound of their joint high-water mark).
    pub used_high: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// Highest `reserved` over the pool's life (the CUDA pool's high-water mark, kept across the
    /// per-step resets).
    pub reserved_high: u64,
    /// Highest reservation of the CUDA pool (or `cuMemAlloc` fallback) over the pool's life,
    /// pages mapped into the pool's address ranges left out: with the device's own high-water
    /// mark of those pages ([`Device::mapped_high_bytes`](crate::Device::mapped_high_bytes)), a
    /// bound of the device's peak far tighter than the sum of `reserved_high` where pools take
    /// turns with the same memory.
    pub pool_reserved_high: u64,
    /// Allocations handed out.
    pub allocations: u64,
    /// Allocations given back by their owner.
    pub frees: u64,
    /// Bytes requested by the allocations handed out.
    pub requested_bytes: u64,
    /// Allocations that failed (out of memory after recovery, budget, driver errors).
    pub failures: u64,
    /// Allocations that succeeded only after out-of-memory recovery.
    pub oom_recoveries: u64,
    /// Allocations that failed for lack of memory after recovery.
    pub ooms: u64,
    /// Bytes still live at a boundary, which the boundary released.
    pub released_bytes: u64,
    /// Nanoseconds spent allocating (the strategy and the driver call), estimated from a random
    /// sample of one call in 16, which keeps the clock off the hot path.
    pub alloc_nanos: u64,
    /// Pages mapped into and unmapped from the pool's address ranges over its life.
    pub pages: PageTraffic,
}

impl Usage {
    /// `reserved - used`: what PyTorch users read as fragmentation.
    pub fn reserved_unused(&self) -> u64 {
        self.reserved.saturating_sub(self.used)
    }

    /// Time spent allocating.
    pub fn alloc_time(&self) -> Duration {
        Duration::from_nanos(self.alloc_nanos)
    }

    /// Folds in the counts of a pool that went away: sums, and the highest high-water marks.
    fn retire(&mut self, other: &Usage) {
        self.used_high = self.used_high.max(other.used_high);
        self.reserved_high = self.reserved_high.max(other.reserved_high);
        self.pool_reserved_high = self.pool_reserved_high.max(other.pool_reserved_high);
        self.add_counts(other);
    }

    fn add(&mut self, other: &Usage) {
        self.used += other.used;
        self.used_high += other.used_high;
        self.reserved += other.reserved;
        self.reserved_high += other.reserved_high;
        self.pool_reserved_high += other.pool_reserved_high;
        self.add_counts(other);
    }

    /// Sums the counts that only grow.
    fn add_counts(&mut self, other: &Usage) {
        self.allocations += other.allocations;
        self.frees += other.frees;
        self.requested_bytes += other.requested_bytes;
        self.failures += other.failures;
        self.oom_recoveries += other.oom_recoveries;
        self.ooms += other.ooms;
        self.released_bytes += other.released_bytes;
        self.alloc_nanos += other.alloc_nanos;
        self.pages.add(other.pages);
    }
}

/// A device's memory as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device ordinal.
    pub device: usize,
    /// Free bytes (`cuMemGetInfo`).
    pub free: u64,
    /// Total bytes.
    pub total: u64,
    /// Bytes the device's graph memory pool holds (`cuDeviceGetGraphMemAttribute`), which
    /// captured steps in graph-memory-node mode use; 0 until the runtime has captured.
    pub graph_reserved: u64,
    /// Bytes of it associated with graphs.
    pub graph_used: u64,
    /// The most bytes of pages mapped at once into the address ranges of steppool's pools on the
    /// device ([`Device::mapped_high_bytes`](crate::Device::mapped_high_bytes)).
    pub mapped_high: u64,
}

/// Every counter of a runtime at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Metrics {
    /// Every live pool.
    pub pools: Vec<PoolMetrics>,
    /// The devices the runtime opened.
    pub devices: Vec<DeviceMemory>,
    /// Steps ended.
    pub steps: u64,
    /// The fragmentation ratio of each phase on each device in the last step.
    pub fragmentation: Vec<PhaseFragmentation>,
    /// Where each phase's overhead went on each device, in the last step and in the step of the
    /// device's highest peak reservation so far.
    pub overhead: Vec<PhaseOverhead>,
    /// How often each rule has fired, for the rules that have.
    pub warnings: Vec<WarningCount>,
}

/// A phase's fragmentation ratio on a device in the last step.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseFragmentation {
    /// The phase on its device ([`GroupKey::Phase`]).
    pub group: GroupKey,
    /// `1 - peak_used / peak_reserved` summed over the phase's pools on the device.
    pub ratio: f64,
}

/// A phase's part of the [overhead breakdown](crate::StepReport#the-overhead-breakdown) on a device.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseOverhead {
    /// The phase on its device ([`GroupKey::Phase`]).
    pub group: GroupKey,
    /// Its breakdown in the last step (the sum of its pools' on the device).
    pub last_step: Breakdown,
    /// Its breakdown in the step whose peak reservation on the device is the highest so far (the
    /// most live bytes, then the earliest, on ties): the run's peak as the runtime sees it.
    pub run_peak: Breakdown,
}

/// How often a warning rule has fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WarningCount {
    /// The rule.
    pub rule: WarningRule,
    /// Episodes it has fired for.
    pub fired: u64,
}

/// What a sum of pools is grouped by.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKey {
    /// All pools of a phase on a device.
    Phase {
        /// The device.
        device: usize,
        /// The phase's name.
        phase: String,
    },
    /// All pools of a stream.
    Stream {
        /// The device.
        device: usize,
        /// The stream's id.
        stream: u32,
    },
    /// All pools of a device.
    Device {
        /// The device.
        device: usize,
    },
}

impl Metrics {
    fn group(&self, key: impl Fn(&PoolMetrics) -> GroupKey) -> Vec<(GroupKey, Usage)> {
        let mut groups: Vec<(GroupKey, Usage)> = Vec::new();
        for pool in &self.pools {
            let key = key(pool);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, usage)) => usage.add(&pool.usage),
                None => groups.push((key, pool.usage)),
            }
        }
        groups.sort_by(|a, b| a.0.cmp(&b.0));
        groups
    }

    /// Sums per (device, phase).
    pub fn by_phase(&self) -> Vec<(GroupKey, Usage)> {
        self.group(|p| GroupKey::Phase { device: p.pool.device, phase: p.phase_name.clone() })
    }

    /// Sums per live stream (retired pools are left out: their streams are gone).
    pub fn by_stream(&self) -> Vec<(GroupKey, Usage)> {
        let live = Metrics { pools: self.pools.iter().filter(|p| !p.retired).cloned().collect(), ..Metrics::default() };
        live.group(|p| GroupKey::Stream { device: p.pool.device, stream: p.pool.stream })
    }

    /// Sums per device.
    pub fn by_device(&self) -> Vec<(GroupKey, Usage)> {
        self.group(|p| GroupKey::Device { device: p.pool.device })
    }

    /// The sum over every pool.
    pub fn total(&self) -> Usage {
        let mut total = Usage::default();
        for pool in &self.pools {
            total.add(&pool.usage);
        }
        total
    }
}

/// The counts of pools that went away with their streams, per (device, phase).
#[derive(Debug, Default)]
pub(crate) struct Retired {
    pools: Mutex<Vec<PoolMetrics>>,
}

impl Retired {
    /// Folds in the final counts of a pool being dropped.
    pub(crate) fn add(&self, pool: PoolMetrics) {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        match pools.iter_mut().find(|p| p.pool.device == pool.pool.device && p.pool.phase == pool.pool.phase) {
            Some(sum) => sum.usage.retire(&pool.usage),
            None => {
                let mut usage = Usage::default();
                usage.retire(&pool.usage);
                let id = PoolId { stream: 0, ..pool.pool };
                pools.push(PoolMetrics { pool: id, retired: true, usage, free_space: None, ..pool });
            }
        }
    }

    /// The sums so far.
    pub(crate) fn pools(&self) -> Vec<PoolMetrics> {
        self.pools.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}
