//! Phase pools: the memory of one phase on one stream of one device.
//!
//! A [`PhasePool`] is its phase's spec, its stream, and its state behind its own lock: the
//! strategy, the [`DeviceSource`] it takes memory from, the raw allocations, the counters. Only
//! threads that allocate on its stream in its phase take that lock, so threads on their own
//! streams never contend; a boundary takes the locks of the pools it releases. Everything that
//! needs the state is a method of the [`PoolGuard`] that [`PhasePool::lock`] returns.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError};

use steppool_sys::handle::PoolHandle;
use steppool_sys::{CUdevice, CUdeviceptr, CUmemoryPool};

use crate::device_core::{DeviceCore, GivesBackFreed};
use crate::error::{Error, ErrorSink, Result};
use crate::phase::{ALIGNMENT, MAX_PHASES, Phase, PhaseEntry, PhaseSpec, Scope, TrimPolicy};
use crate::report::{PoolId, PoolStats};
use crate::source::{DeviceSource, Source};
use crate::strategy::{Allocator, Bin, Served, allocator};
use crate::stream_core::StreamCore;
use crate::sync::{PoolMutex, PoolMutexGuard, lock_pool, pool_state_mut, try_lock_pool};
use crate::telemetry::{self, EventKind, PoolMetrics, Recorder, Retired, Usage, thread_number};

/// The pools of one stream, by phase index.
pub(crate) type PoolSlots = [OnceLock<Arc<PhasePool>>; MAX_PHASES];

/// An allocation made through the raw API, which the boundary of its scope releases.
#[derive(Debug)]
pub(crate) struct RawAllocation {
    pub(crate) bytes: u64,
    /// Where the strategy filed it ([`Served::slot`]).
    pub(crate) slot: u32,
    /// Other streams it was used on; its free waits for them.
    pub(crate) uses: Vec<Arc<StreamCore>>,
    /// Kept live past the end of the step that made it ([`PhaseSpec::carry`]): the next
    /// boundary releases it if it is still live.
    ///
    /// [`PhaseSpec::carry`]: crate::PhaseSpec::carry
    pub(crate) carried: bool,
}

/// Counters of the current step (since the last `begin_step`).
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    used: u64,
    peak_used: u64,
    /// `used` as served: each allocation rounded up to [`ALIGNMENT`].
    served: u64,
    /// `served` when `used` reached `peak_used`.
    peak_served: u64,

    allocations: u64,
    frees: u64,
    released: u64,
    largest_request: u64,
}

/// The reservation granule assumed where the device reports no allocation granularity: the
/// granularity of physical memory on current GPUs, and the simulated device's default.
const DEFAULT_GRANULE: u64 = 2 << 20;

/// The unit in which a pool's memory is reserved: the CUDA pool's unit where all of it is the
/// CUDA pool's (`pool_only`), otherwise the pages mapped into its ranges.
fn granule(device: &DeviceCore, pool_only: bool) -> u64 {
    if pool_only && device.pools_supported {
        device.pool_unit
    } else {
        device.vmm_granularity.unwrap_or(DEFAULT_GRANULE)
    }
}

/// One allocation call in this many is timed.
const TIMING_SAMPLE: u64 = 64;

/// A random sample of allocation times, scaled to every call: an unbiased estimate of the time
/// spent allocating, at a sixteenth of the cost of timing every call.
#[derive(Clone, Copy, Debug)]
struct Timing {
    /// xorshift state, never zero.
    rng: u64,
    calls: u64,
    timed: u64,
    ticks: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Self { rng: 0x9e37_79b9_7f4a_7c15, calls: 0, timed: 0, ticks: 0 }
    }
}

impl Timing {
    /// Counts a call; the clock's reading if this call is sampled.
    #[inline]
    fn start(&mut self) -> Option<u64> {
        self.calls += 1;
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng.is_multiple_of(TIMING_SAMPLE).then(|| telemetry::clock().raw())
    }

    #[inline]
    fn stop(&mut self, started: Option<u64>) {
        if let Some(started) = started {
            self.timed += 1;
            self.ticks += telemetry::clock().raw().saturating_sub(started);
        }
    }

    /// Nanoseconds spent in every call, estimated from the sampled ones.
    fn estimate_nanos(&self) -> u64 {
        if self.timed == 0 {
            return 0;
        }
        let sampled = telemetry::clock().delta_as_nanos(0, self.ticks) as u128;
        (sampled * u128::from(self.calls) / u128::from(self.timed)) as u64
    }
}

/// What a boundary released from one pool.
#[derive(Debug, Default)]
pub(crate) struct Released {
    pub(crate) bytes: u64,
    /// Raw pointers it took out of the pool, to drop from the runtime's registry: freed, or
    /// left allocated (and reported) when the free failed.
    pub(crate) raw: Vec<(CUdeviceptr, u64)>,
    /// The first error, if a free, the reset or the trim failed; the rest still ran.
    pub(crate) error: Option<Error>,
}

impl Released {
    fn note(&mut self, result: Result<()>) {
        if let Err(error) = result {
            self.error.get_or_insert(error);
        }
    }
}

/// A pool's state, behind its lock.
struct PoolState {
    allocator: Box<dyn Allocator>,
    source: DeviceSource,
    raw: HashMap<CUdeviceptr, RawAllocation>,
    /// Other streams that used this pool's buffers since the last boundary; the boundary makes
    /// the pool's stream wait for them before memory is reused (covers buffers leaked with
    /// `mem::forget`, whose memory an arena reclaims).
    cross_uses: Vec<Arc<StreamCore>>,
    counters: Counters,
    /// Counters over the pool's life, for the runtime's metrics.
    totals: Usage,
    /// Allocation timing, sampled: reading a clock twice costs more than the rest of an arena
    /// allocation, so one call in [`TIMING_SAMPLE`], picked at random, is timed.
    timing: Timing,
    /// What the pool needed at recent boundaries, for [`TrimPolicy::KeepRecentPeak`].
    recent: VecDeque<u64>,
    /// The pool whose strategy lent the bin this pool's strategy holds
    /// ([`Allocator::lend_tail`]): kept alive while the loan lasts, and given the loan back
    /// when this pool goes.
    bin_lender: Option<Arc<PhasePool>>,
}

/// The pool of one (device, stream, phase).
pub(crate) struct PhasePool {
    pub(crate) entry: Arc<PhaseEntry>,
    pub(crate) stream: Arc<StreamCore>,
    /// The CUDA pool, fixed at creation (`None` for the `cuMemAlloc` fallback): readable
    /// without the lock.
    handle: Option<PoolHandle>,
    /// One more than the index of the step whose [`StepPools`] holds the pool; 0 for none.
    kept_for_step: AtomicU64,
    state: PoolMutex<PoolState>,
    errors: Arc<ErrorSink>,
    recorder: Arc<Recorder>,
    retired: Arc<Retired>,
}

impl fmt::Debug for PhasePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PhasePool({} on stream {})", self.entry.spec.name, self.stream.id)
    }
}

/// The runtime-wide sinks a pool reports to.
#[derive(Clone, Debug)]
pub(crate) struct PoolSinks {
    pub(crate) errors: Arc<ErrorSink>,
    pub(crate) recorder: Arc<Recorder>,
    pub(crate) retired: Arc<Retired>,
}

impl PhasePool {
    /// Creates the pool: its source on the stream's device with the phase's release threshold and
    /// `peers` granted access, and the phase's strategy.
    pub(crate) fn new(
        entry: Arc<PhaseEntry>,
        stream: Arc<StreamCore>,
        peers: &[CUdevice],
        sinks: PoolSinks,
    ) -> Result<Self> {
        let id = PoolId { device: stream.device.ordinal, stream: stream.id, phase: entry.phase };
        let source =
            DeviceSource::new(stream.clone(), id, entry.spec.release_threshold, peers, sinks.recorder.clone())?;
        let state = PoolState {
            allocator: allocator(&entry),
            source,
            raw: HashMap::new(),
            cross_uses: Vec::new(),
            counters: Counters::default(),
            totals: Usage::default(),
            timing: Timing::default(),
            recent: VecDeque::new(),
            bin_lender: None,
        };
        let handle = state.source.handle().map(PoolHandle::from_raw);
        let PoolSinks { errors, recorder, retired } = sinks;
        let kept_for_step = AtomicU64::new(0);
        Ok(Self { entry, stream, handle, kept_for_step, state: PoolMutex::new(state), errors, recorder, retired })
    }

    pub(crate) fn phase(&self) -> Phase {
        self.entry.phase
    }

    pub(crate) fn spec(&self) -> &PhaseSpec {
        &self.entry.spec
    }

    pub(crate) fn scope(&self) -> Scope {
        self.entry.spec.scope
    }

    pub(crate) fn device_ordinal(&self) -> usize {
        self.stream.device.ordinal
    }

    /// The CUDA pool, unless the device has none.
    pub(crate) fn handle(&self) -> Option<CUmemoryPool> {
        self.handle.map(PoolHandle::raw)
    }

    /// The pool's (device, stream, phase).
    pub(crate) fn id(&self) -> PoolId {
        PoolId { device: self.stream.device.ordinal, stream: self.stream.id, phase: self.entry.phase }
    }

    /// Takes the pool's lock.
    #[inline]
    pub(crate) fn lock(&self) -> PoolGuard<'_> {
        PoolGuard { pool: self, state: lock_pool(&self.state) }
    }

    /// The runtime's sink of errors raised in `Drop`.
    pub(crate) fn errors(&self) -> &Arc<ErrorSink> {
        &self.errors
    }

    /// Frees a buffer's allocation; an error goes to the runtime's sink (called from `Drop`).
    #[inline]
    pub(crate) fn free_or_record(&self, served: Served, bytes: u64, uses: &[Arc<StreamCore>]) {
        // A lost context's memory is not touched again (the sticky error is already kept).
        if self.errors.check().is_err() {
            return;
        }
        if let Err(error) = self.lock().free(served, bytes, uses) {
            self.errors.record(error);
        }
    }
}

/// The pools that buffers of the active step were allocated from, each held until the step
/// ends. A step's [`Buffer`](crate::Buffer) borrows the step, so it is gone before the step can
/// end: it refers to its pool without counting a reference (two atomic operations per buffer
/// saved), and the pool outlives it even when every clone of its stream is dropped first.
#[derive(Debug, Default)]
pub(crate) struct StepPools {
    /// Behind a lock of its own, taken once per pool and step, with nothing else held inside it.
    pools: std::sync::Mutex<Vec<Arc<PhasePool>>>,
}

impl StepPools {
    /// Holds `pool` until step `step` ends ([`StepPools::take`]); once per pool and step.
    #[inline]
    pub(crate) fn keep(&self, pool: &Arc<PhasePool>, step: u64) {
        let mark = step + 1;
        if pool.kept_for_step.load(Ordering::Relaxed) != mark {
            self.keep_slow(pool, mark);
        }
    }

    #[cold]
    fn keep_slow(&self, pool: &Arc<PhasePool>, mark: u64) {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.kept_for_step.load(Ordering::Relaxed) != mark {
            pools.push(pool.clone());
            pool.kept_for_step.store(mark, Ordering::Relaxed);
        }
    }

    /// The pools held for the step that just ended, to drop: called by the boundary that ends
    /// it, when no buffer of the step is left.
    pub(crate) fn take(&self) -> Vec<Arc<PhasePool>> {
        std::mem::take(&mut *self.pools.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A locked [`PhasePool`]: what may be done to the pool's state.
pub(crate) struct PoolGuard<'a> {
    pool: &'a PhasePool,
    state: PoolMutexGuard<'a, PoolState>,
}

impl Deref for PoolGuard<'_> {
    type Target = PhasePool;

    fn deref(&self) -> &PhasePool {
        self.pool
    }
}

impl PoolGuard<'_> {
    /// Allocates `bytes`, charging the phase's budget. Does not recover from out-of-memory.
    #[inline]
    pub(crate) fn allocate(&mut self, bytes: u64) -> Result<Served> {
        let pool = self.pool;
        let spec = &pool.entry.spec;
        let state = self.state.deref_mut();
        if let Some(budget) = spec.budget {
            let live = pool.entry.live.fetch_add(bytes, Ordering::Relaxed);
            if live + bytes > budget {
                pool.entry.live.fetch_sub(bytes, Ordering::Relaxed);
                state.totals.failures += 1;
                return Err(Error::BudgetExceeded { phase: spec.name.clone(), budget, live, requested: bytes });
            }
        }
        let PoolState { allocator, source, counters, totals, timing, .. } = state;
        let started = timing.start();
        let result = allocator.allocate(source, bytes);
        timing.stop(started);
        match result {
            Ok(served) => {
                counters.used += bytes;
                counters.served += bytes.next_multiple_of(ALIGNMENT);
                if counters.used > counters.peak_used {
                    counters.peak_used = counters.used;
                    counters.peak_served = counters.served;
                }
                counters.allocations += 1;
                counters.largest_request = counters.largest_request.max(bytes);
                totals.used += bytes;
                totals.used_high = totals.used_high.max(totals.used);
                totals.allocations += 1;
                totals.requested_bytes += bytes;
                if pool.recorder.is_on() {
                    let (step, thread) = (pool.recorder.step(), thread_number());
                    pool.recorder.record(EventKind::Alloc { pool: pool.id(), ptr: served.ptr, bytes, step, thread });
                }
                Ok(served)
            }
            Err(error) => {
                if spec.budget.is_some() {
                    pool.entry.live.fetch_sub(bytes, Ordering::Relaxed);
                }
                // Out of memory may still be recovered from; the runtime counts its outcome.
                if !matches!(&error, Error::Driver(e) if e.is_out_of_memory()) {
                    totals.failures += 1;
                }
                Err(error)
            }
        }
    }

    /// Frees an allocation of `bytes`, after making the pool's stream wait for the other streams
    /// it was used on.
    #[inline]
    pub(crate) fn free(&mut self, served: Served, bytes: u64, uses: &[Arc<StreamCore>]) -> Result<()> {
        // Under a capture, the driver free the strategy may make waits in the source
        // (`DeviceSource::free`): a strategy that frees without the driver pays no question.
        self.free_inner(served, bytes, uses, false)
    }

    /// The packed plan a captured step would be served from (see [`Allocator::plan_view`]).
    pub(crate) fn plan_view(&self) -> Option<crate::strategy::PlanView> {
        self.state.allocator.plan_view()
    }

    /// The bin the strategy holds and whether it wants one, for a strategy that takes bins; its
    /// lender. See [`Allocator::lend_tail`].
    pub(crate) fn bin(&self) -> Option<(Option<Bin>, bool, Option<Arc<PhasePool>>)> {
        let state = self.state.deref();
        state.allocator.bin().map(|(bin, wants)| (bin, wants, state.bin_lender.clone()))
    }

    /// Gives the strategy `bin`, lent by `lender` (see [`Allocator::lend_tail`]).
    pub(crate) fn set_bin(&mut self, bin: Option<Bin>, lender: Option<Arc<PhasePool>>) {
        let state = self.state.deref_mut();
        state.allocator.set_bin(bin);
        state.bin_lender = bin.and(lender);
    }

    /// Lends the unused end of the strategy's last page, or keeps or takes back `current` (see
    /// [`Allocator::lend_tail`]).
    pub(crate) fn lend_tail(&mut self, current: Option<Bin>, lend: bool) -> Option<Bin> {
        self.state.deref_mut().allocator.lend_tail(current, lend)
    }

    /// Lends the strategy's slab to a captured step (see [`Allocator::lend_slab`]).
    pub(crate) fn lend_slab(&mut self, bytes: u64) -> Result<Option<CUdeviceptr>> {
        let PoolState { allocator, source, .. } = self.state.deref_mut();
        allocator.lend_slab(source, bytes)
    }

    /// Takes back a slab lent by [`PoolGuard::lend_slab`] (see [`Allocator::take_back_slab`]).
    pub(crate) fn take_back_slab(&mut self, base: CUdeviceptr) -> Result<bool> {
        let PoolState { allocator, source, .. } = self.state.deref_mut();
        allocator.take_back_slab(source, base)
    }

    /// Takes `bytes` straight from the pool's source, beside the strategy: a captured step's slab
    /// when the strategy's cannot be lent.
    pub(crate) fn take_slab(&mut self, bytes: u64) -> Result<CUdeviceptr> {
        self.state.source.alloc(bytes)
    }

    /// Gives back a slab from [`PoolGuard::take_slab`], in the stream's order.
    pub(crate) fn give_slab(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        self.state.source.free(ptr, bytes)
    }

    /// [`PoolGuard::free`]; `release` says a boundary frees it.
    #[inline]
    fn free_inner(&mut self, served: Served, bytes: u64, uses: &[Arc<StreamCore>], release: bool) -> Result<()> {
        let pool = self.pool;
        let ptr = served.ptr;
        if !uses.is_empty() {
            self.wait_for_uses(ptr, bytes, uses, release)?;
        }
        // The block's free is recorded before the strategy gives its segment back (a `Direct`
        // strategy's allocation is its own segment): a history never has a live block outside
        // every segment.
        if pool.recorder.is_on() {
            let (step, thread) = (pool.recorder.step(), thread_number());
            pool.recorder.record(EventKind::Free { pool: pool.id(), ptr, bytes, step, thread, release });
        }
        let PoolState { allocator, source, .. } = self.state.deref_mut();
        match allocator.free(source, served, bytes) {
            Ok(()) => {
                self.count_free(bytes, release);
                Ok(())
            }
            // The source owes a free the driver refused (see `DeviceSource::free`): as freed
            // for the pool, and reported.
            Err(error @ Error::Driver(_)) if !error.is_sticky() => {
                self.count_free(bytes, release);
                Err(error)
            }
            Err(error) => Err(error),
        }
    }

    /// Makes the pool's stream wait for the other streams that used the allocation at `ptr`
    /// before it is freed. On failure the free is still counted: the caller no longer has the
    /// memory, and it is given back once the other stream's work is done.
    #[cold]
    fn wait_for_uses(&mut self, ptr: CUdeviceptr, bytes: u64, uses: &[Arc<StreamCore>], release: bool) -> Result<()> {
        for other in uses {
            if let Err(error) = self.pool.stream.wait_for(other) {
                if !error.is_sticky() {
                    let state = self.state.deref_mut();
                    if state.allocator.reclaims_live() {
                        // The scope's end reclaims it, after waiting for `other`.
                        state.cross_uses.push(other.clone());
                    } else {
                        state.source.keep_for_retry(ptr, bytes);
                    }
                    self.count_free(bytes, release);
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Counts `bytes` freed (by a boundary's release when `release`).
    #[inline]
    fn count_free(&mut self, bytes: u64, release: bool) {
        let state = self.state.deref_mut();
        state.counters.used -= bytes;
        state.counters.served -= bytes.next_multiple_of(ALIGNMENT);
        state.counters.frees += 1;
        state.totals.used -= bytes;
        if !release {
            state.totals.frees += 1;
        }
        if self.pool.entry.spec.budget.is_some() {
            self.pool.entry.live.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Keeps a raw allocation for the boundary of its scope.
    pub(crate) fn insert_raw(&mut self, served: Served, bytes: u64) {
        self.state.raw.insert(served.ptr, RawAllocation { bytes, slot: served.slot, uses: Vec::new(), carried: false });
    }

    /// Takes a raw allocation out, if the pool has it.
    pub(crate) fn take_raw(&mut self, ptr: CUdeviceptr) -> Option<RawAllocation> {
        self.state.raw.remove(&ptr)
    }

    /// A raw allocation of the pool.
    pub(crate) fn raw(&mut self, ptr: CUdeviceptr) -> Option<&mut RawAllocation> {
        self.state.raw.get_mut(&ptr)
    }

    /// Counts an allocation that succeeded after out-of-memory recovery, or one that failed
    /// for lack of memory after it.
    pub(crate) fn note_oom(&mut self, recovered: bool) {
        let totals = &mut self.state.totals;
        if recovered {
            totals.oom_recoveries += 1;
        } else {
            totals.ooms += 1;
            totals.failures += 1;
        }
    }

    /// Notes that a buffer of this pool is used on `other` (see [`PoolState::cross_uses`]).
    pub(crate) fn note_use(&mut self, other: &Arc<StreamCore>) {
        if !self.state.cross_uses.iter().any(|used| used.id == other.id) {
            self.state.cross_uses.push(other.clone());
        }
    }

    /// Grants `peers` read-write access to the pool's memory.
    pub(crate) fn grant_access(&mut self, peers: &[CUdevice]) -> Result<()> {
        self.state.source.grant_access(peers)
    }

    /// Starts a step's counters: peaks from the current values, counts from zero.
    pub(crate) fn begin_step(&mut self) -> Result<()> {
        let state = self.state.deref_mut();
        // The last step's peak reservation goes into the lifetime mark before it is reset.
        let reservation = state.source.reservation()?;
        state.totals.reserved_high = state.totals.reserved_high.max(reservation.peak_reserved);
        state.totals.pool_reserved_high = state.totals.pool_reserved_high.max(reservation.peak_pool);
        state.totals.pages.add(reservation.pages);
        let counters = &mut state.counters;
        *counters = Counters {
            used: counters.used,
            peak_used: counters.used,
            served: counters.served,
            peak_served: counters.served,
            ..Counters::default()
        };
        state.allocator.begin_step();
        state.source.begin_step()
    }

    /// Ends the phase's scope: frees the raw allocations still live (in stream order, after the
    /// other streams they were used on) but those a carrying phase keeps for the next step
    /// (made in this one, [`PhaseSpec::carry`](crate::PhaseSpec::carry)), resets the strategy,
    /// and trims by the phase's policy. A failure does not stop the rest: every step runs and
    /// the first error is reported.
    pub(crate) fn end_scope(&mut self) -> Released {
        let pool = self.pool;
        let mut released = Released::default();
        let raw: Vec<(CUdeviceptr, RawAllocation)> = self.state.raw.drain().collect();
        let (mut kept, mut kept_bytes, mut kept_served) = (Vec::new(), 0u64, 0u64);
        for (ptr, allocation) in raw {
            let served = Served { ptr, slot: allocation.slot };
            if pool.entry.spec.carry
                && !allocation.carried
                && let Some(slot) = self.state.allocator.carry(served, allocation.bytes)
            {
                kept_bytes += allocation.bytes;
                kept_served += allocation.bytes.next_multiple_of(ALIGNMENT);
                kept.push((ptr, RawAllocation { slot, carried: true, ..allocation }));
                continue;
            }
            let freed = self.free_inner(served, allocation.bytes, &allocation.uses, true);
            if freed.is_ok() {
                released.bytes += allocation.bytes;
            }
            released.raw.push((ptr, allocation.bytes));
            released.note(freed);
        }
        let state = self.state.deref_mut();
        for other in std::mem::take(&mut state.cross_uses) {
            released.note(pool.stream.wait_for(&other));
        }
        // What the scope needed: the memory the strategy touched, or else its peak of live
        // bytes (as the CUDA pool counts them, rounded). Not its peak reservation, which counts
        // kept memory.
        let needed = match state.allocator.touched() {
            Some(touched) => touched,
            None => {
                let pool_peak = state.source.reservation().map(|reservation| reservation.peak_used);
                let peak = state.counters.peak_used.max(*pool_peak.as_ref().unwrap_or(&0));
                released.note(pool_peak.map(drop));
                peak
            }
        };
        let keep = match pool.entry.spec.trim {
            TrimPolicy::Never => u64::MAX,
            TrimPolicy::KeepBytes(bytes) => bytes,
            TrimPolicy::KeepRecentPeak { steps } => {
                state.recent.push_back(needed);
                while state.recent.len() > steps.max(1) as usize {
                    state.recent.pop_front();
                }
                state.recent.iter().copied().max().unwrap_or(0)
            }
        };
        let PoolState { allocator, source, counters, totals, .. } = state;
        // A strategy that carves its own memory reclaims everything it handed out, buffers
        // leaked with `forget` included, but what it carries into the next scope.
        let leaked = counters.used - kept_bytes;
        if allocator.reclaims_live() && leaked > 0 {
            released.bytes += leaked;
            if pool.entry.spec.budget.is_some() {
                pool.entry.live.fetch_sub(leaked, Ordering::Relaxed);
            }
            totals.used -= leaked;
            counters.used = kept_bytes;
            counters.served = kept_served;
            let kept: Vec<CUdeviceptr> = kept.iter().map(|&(ptr, _)| ptr).collect();
            pool.recorder.release_pool(pool.id(), &kept);
        }
        released.note(allocator.reset(source, keep));
        counters.released += released.bytes;
        totals.released_bytes += released.bytes;
        if keep != u64::MAX {
            released.note(source.trim(keep, false).map(drop));
        } else {
            // Pages the reset gave back in stream order go back now where the stream's work is
            // done (a host that waited for its step), not at the next step's first growth.
            released.note(source.poll_given_back());
        }
        source.record_reserved();
        state.raw.extend(kept);
        released
    }

    /// Memory is short: the strategy gives back to the CUDA pool what its scope has not touched
    /// (in stream order; a synchronization completes it). Returns the bytes given back.
    pub(crate) fn release_unused(&mut self) -> Result<u64> {
        let PoolState { allocator, source, .. } = self.state.deref_mut();
        allocator.release_unused(source)
    }

    /// After the device was synchronized: gives back everything idle (out-of-memory recovery,
    /// [`Device::release_idle`](crate::Device::release_idle)).
    pub(crate) fn release_idle(&mut self) -> Result<u64> {
        let source = &mut self.state.source;
        let released = source.trim(0, true)?;
        source.record_reserved();
        Ok(released)
    }

    /// The pool's lifetime counters now.
    pub(crate) fn metrics(&mut self) -> Result<PoolMetrics> {
        let state = self.state.deref_mut();
        let reservation = state.source.reservation()?;
        let totals = &mut state.totals;
        totals.reserved = reservation.reserved;
        totals.reserved_high = totals.reserved_high.max(reservation.peak_reserved).max(reservation.reserved);
        totals.pool_reserved_high = totals.pool_reserved_high.max(reservation.peak_pool);
        totals.alloc_nanos = state.timing.estimate_nanos();
        // The completed steps' pages, and the current step's so far.
        let mut usage = state.totals;
        usage.pages.add(reservation.pages);
        Ok(pool_metrics(self.pool, usage, state.allocator.free_space()))
    }

    /// The plans its strategy keeps, as a plan file saves them (none unless it is planned).
    pub(crate) fn saved_plans(&self) -> Vec<steppool_trace::plans::SavedPlan> {
        self.state.allocator.saved_plans()
    }

    /// The pool's numbers over the current step.
    pub(crate) fn stats(&self) -> Result<PoolStats> {
        let pool = self.pool;
        let reservation = self.state.source.reservation()?;
        let c = &self.state.counters;
        let spec = &pool.entry.spec;
        Ok(PoolStats {
            pool: pool.id(),
            phase_name: spec.name.clone(),
            scope: spec.scope,
            strategy: spec.strategy,
            used: c.used,
            peak_used: c.peak_used,
            reserved: reservation.reserved,
            peak_reserved: reservation.peak_reserved,
            peak_served: c.peak_served,
            granule: granule(&pool.stream.device, reservation.pool_only),
            breakdown: crate::report::Breakdown::default(),
            allocations: c.allocations,
            frees: c.frees,
            released: c.released,
            largest_request: c.largest_request,
            free_space: self.state.allocator.free_space(),
            plan: self.state.allocator.plan_stats(),
            chosen: self.state.allocator.chosen(),
            pages: reservation.pages,
        })
    }
}

fn pool_metrics(pool: &PhasePool, usage: Usage, free_space: Option<crate::report::FreeSpace>) -> PoolMetrics {
    let spec = &pool.entry.spec;
    PoolMetrics {
        pool: pool.id(),
        phase_name: spec.name.clone(),
        scope: spec.scope,
        strategy: spec.strategy,
        retired: false,
        usage,
        free_space,
    }
}

impl GivesBackFreed for PhasePool {
    fn give_back_freed(&self, bytes: u64) -> u64 {
        let Some(mut state) = try_lock_pool(&self.state) else { return 0 };
        let PoolState { allocator, source, .. } = state.deref_mut();
        match allocator.give_back_freed(source, bytes) {
            Ok(0) => 0,
            Ok(given) => {
                source.record_reserved();
                given
            }
            // The pages stay mapped and counted; the allocation that asked goes on.
            Err(error) => {
                self.errors.record(error);
                0
            }
        }
    }
}

impl Drop for PhasePool {
    fn drop(&mut self) {
        let state = pool_state_mut(&mut self.state);
        // Its counts outlive it, so the runtime's counters never go back.
        let mut usage = state.totals;
        usage.alloc_nanos = state.timing.estimate_nanos();
        let PoolState { allocator, source, raw, bin_lender, .. } = state;
        let mut outcome = Ok(());
        // Through the strategy: a raw pointer is the source's own allocation only for `Direct`.
        for (ptr, allocation) in raw.drain() {
            outcome = outcome.and(allocator.free(source, Served { ptr, slot: allocation.slot }, allocation.bytes));
        }
        outcome = outcome.and(allocator.release_all(source));
        // A bin goes back to the pool that lent it, which this pool kept alive until now.
        if let Some(lender) = bin_lender.take()
            && let Some((Some(bin), _)) = allocator.bin()
        {
            lender.lock().lend_tail(Some(bin), false);
        }
        outcome = outcome.and(source.destroy());
        // The last step's pages, those its ranges gave back on the way out included.
        usage.pages.add(source.pages());
        let metrics = pool_metrics(self, usage, None);
        self.retired.add(metrics);
        if let Err(error) = outcome {
            self.errors.record(error);
        }
    }
}
