//! Phase pools: the memory of one phase on one stream of one device, with its own CUDA pool.
//!
//! A phase pool's state sits behind its own lock. Only the threads that allocate on its stream
//! in its phase take that lock, so threads on their own streams never contend; a boundary takes
//! the locks of the pools it releases.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use steppool_sys::{CUdevice, CUdeviceptr, CUmemPool_attribute, PoolProps};

use crate::device::read_write;
use crate::error::{Error, Result};
use crate::phase::{Phase, PhaseEntry, PhaseSpec, Scope, TrimPolicy};
use crate::report::PoolStats;
use crate::strategy::{Allocator, Backing, FreeSpace, Source, SourceState, allocator};
use crate::stream::StreamCore;
use crate::telemetry::{self, EventKind, PoolKey, PoolMetrics, Recorder, Retired, Usage, thread_number};

/// Errors raised where they cannot be returned (in `Drop`), kept for
/// [`Runtime::take_errors`](crate::Runtime::take_errors).
pub(crate) type ErrorSink = Mutex<Vec<Error>>;

pub(crate) fn record(sink: &ErrorSink, error: Error) {
    sink.lock().unwrap_or_else(PoisonError::into_inner).push(error);
}

/// An allocation made through the raw API, which the boundary of its scope releases.
#[derive(Debug)]
pub(crate) struct RawAllocation {
    pub(crate) bytes: u64,
    /// Other streams it was used on; its free waits for them.
    pub(crate) uses: Vec<Arc<StreamCore>>,
}

/// Counters of the current step (since the last `begin_step`).
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    used: u64,
    peak_used: u64,
    allocations: u64,
    frees: u64,
    released: u64,
    largest_request: u64,
}

/// One allocation call in this many is timed.
const TIMING_SAMPLE: u64 = 16;

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

pub(crate) struct PoolState {
    allocator: Box<dyn Allocator>,
    source: SourceState,
    pub(crate) raw: HashMap<CUdeviceptr, RawAllocation>,
    /// Other streams that used this pool's buffers since the last boundary; the boundary makes
    /// the pool's stream wait for them before memory is reused (covers buffers leaked with
    /// `mem::forget`, whose memory an arena reclaims).
    cross_uses: Vec<Arc<StreamCore>>,
    counters: Counters,
    /// Counters over the pool's life, for [`Runtime::metrics`](crate::Runtime::metrics).
    totals: Usage,
    /// Allocation timing, sampled: reading a clock twice costs more than the rest of an arena
    /// allocation, so one call in [`TIMING_SAMPLE`], picked at random, is timed.
    timing: Timing,
    /// What the pool needed at recent boundaries, for [`TrimPolicy::KeepRecentPeak`].
    recent: VecDeque<u64>,
}

impl fmt::Debug for PoolState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolState").field("allocator", &self.allocator).field("counters", &self.counters).finish()
    }
}

/// The pool of one (device, stream, phase).
pub(crate) struct PhasePool {
    pub(crate) entry: Arc<PhaseEntry>,
    pub(crate) stream: Arc<StreamCore>,
    backing: Backing,
    state: Mutex<PoolState>,
    errors: Arc<ErrorSink>,
    recorder: Arc<Recorder>,
    retired: Arc<Retired>,
}

// SAFETY: the fields that are not Send + Sync by themselves are driver handles: the CUmemoryPool
// inside `backing`, never mutated after creation, and the CUevents of the fallback's deferred
// frees, behind the mutex. Driver handles may be used from any thread.
unsafe impl Send for PhasePool {}
// SAFETY: as above; mutable state sits behind the mutex.
unsafe impl Sync for PhasePool {}

impl fmt::Debug for PhasePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PhasePool({} on stream {})", self.entry.spec.name, self.stream.id)
    }
}

impl PhasePool {
    /// Creates the pool: a CUDA pool on the stream's device with the phase's release threshold
    /// and the device's peers granted access, or the synchronous fallback.
    pub(crate) fn new(
        entry: Arc<PhaseEntry>,
        stream: Arc<StreamCore>,
        errors: Arc<ErrorSink>,
        recorder: Arc<Recorder>,
        retired: Arc<Retired>,
    ) -> Result<Self> {
        let device = &stream.device;
        let backing = if device.pools_supported {
            let driver = &device.driver;
            let pool = driver.mem_pool_create(&PoolProps::device(device.device).build())?;
            let backing = Backing::Pool(pool);
            let threshold = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            // SAFETY: the pool was just created.
            let configured = unsafe { driver.mem_pool_set_attribute(pool, threshold, entry.spec.release_threshold) };
            if let Err(error) = configured {
                // SAFETY: the pool was just created and holds nothing.
                let _ = unsafe { driver.mem_pool_destroy(pool) };
                return Err(error.into());
            }
            backing
        } else {
            Backing::Synchronous
        };
        let state = PoolState {
            allocator: allocator(&entry),
            source: SourceState::default(),
            raw: HashMap::new(),
            cross_uses: Vec::new(),
            counters: Counters::default(),
            totals: Usage::default(),
            timing: Timing::default(),
            recent: VecDeque::new(),
        };
        let pool = Self { entry, stream, backing, state: Mutex::new(state), errors, recorder, retired };
        pool.grant_access(&pool.stream.device.peers())?;
        Ok(pool)
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
    pub(crate) fn handle(&self) -> Option<steppool_sys::CUmemoryPool> {
        match self.backing {
            Backing::Pool(pool) => Some(pool),
            Backing::Synchronous => None,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        // Pool operations leave the state consistent between driver calls, so a poisoned lock
        // (a panic elsewhere while it was held) still guards usable state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn source<'a>(&'a self, state: &'a mut SourceState) -> Source<'a> {
        Source { stream: &self.stream, backing: &self.backing, state, recorder: &self.recorder, key: self.key() }
    }

    /// The pool's (device, stream, phase).
    pub(crate) fn key(&self) -> PoolKey {
        PoolKey { device: self.stream.device.ordinal, stream: self.stream.id, phase: self.entry.phase }
    }

    /// Counts an allocation that succeeded after out-of-memory recovery, or one that failed
    /// for lack of memory after it.
    pub(crate) fn note_oom(&self, recovered: bool) {
        let mut state = self.lock();
        if recovered {
            state.totals.oom_recoveries += 1;
        } else {
            state.totals.ooms += 1;
            state.totals.failures += 1;
        }
    }

    /// Grants `peers` read-write access to the pool's memory.
    pub(crate) fn grant_access(&self, peers: &[CUdevice]) -> Result<()> {
        if let (Backing::Pool(pool), false) = (&self.backing, peers.is_empty()) {
            let access: Vec<_> = peers.iter().map(|&peer| read_write(peer)).collect();
            // SAFETY: the pool is live while `self` is.
            unsafe { self.stream.device.driver.mem_pool_set_access(*pool, &access) }?;
        }
        Ok(())
    }

    /// Allocates `bytes`, charging the phase's budget. Does not recover from out-of-memory.
    pub(crate) fn allocate(&self, state: &mut PoolState, bytes: u64) -> Result<CUdeviceptr> {
        let spec = &self.entry.spec;
        if let Some(budget) = spec.budget {
            let live = self.entry.live.fetch_add(bytes, Ordering::Relaxed);
            if live + bytes > budget {
                self.entry.live.fetch_sub(bytes, Ordering::Relaxed);
                state.totals.failures += 1;
                return Err(Error::BudgetExceeded { phase: spec.name.clone(), budget, live, requested: bytes });
            }
        }
        let PoolState { allocator, source, counters, totals, timing, .. } = state;
        let started = timing.start();
        let result = allocator.allocate(&mut self.source(source), bytes);
        timing.stop(started);
        match result {
            Ok(ptr) => {
                counters.used += bytes;
                counters.peak_used = counters.peak_used.max(counters.used);
                counters.allocations += 1;
                counters.largest_request = counters.largest_request.max(bytes);
                totals.used += bytes;
                totals.used_high = totals.used_high.max(totals.used);
                totals.allocations += 1;
                totals.requested_bytes += bytes;
                if self.recorder.is_on() {
                    let step = self.recorder.step();
                    let thread = thread_number();
                    self.recorder.record(EventKind::Alloc { pool: self.key(), ptr, bytes, step, thread });
                }
                Ok(ptr)
            }
            Err(error) => {
                if spec.budget.is_some() {
                    self.entry.live.fetch_sub(bytes, Ordering::Relaxed);
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
    pub(crate) fn free(
        &self,
        state: &mut PoolState,
        ptr: CUdeviceptr,
        bytes: u64,
        uses: &[Arc<StreamCore>],
    ) -> Result<()> {
        self.free_inner(state, ptr, bytes, uses, false)
    }

    /// [`PhasePool::free`]; `release` says a boundary frees it.
    fn free_inner(
        &self,
        state: &mut PoolState,
        ptr: CUdeviceptr,
        bytes: u64,
        uses: &[Arc<StreamCore>],
        release: bool,
    ) -> Result<()> {
        for other in uses {
            self.stream.wait_for(other)?;
        }
        // The block's free is recorded before the strategy gives its segment back (a `Pool`
        // strategy's allocation is its own segment): a history never has a live block outside
        // every segment.
        if self.recorder.is_on() {
            let (step, thread) = (self.recorder.step(), thread_number());
            self.recorder.record(EventKind::Free { pool: self.key(), ptr, bytes, step, thread, release });
        }
        let PoolState { allocator, source, counters, totals, .. } = state;
        allocator.free(&mut self.source(source), ptr, bytes)?;
        counters.used -= bytes;
        counters.frees += 1;
        totals.used -= bytes;
        if !release {
            totals.frees += 1;
        }
        if self.entry.spec.budget.is_some() {
            self.entry.live.fetch_sub(bytes, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Frees a buffer's allocation; an error goes to the runtime's sink (called from `Drop`).
    pub(crate) fn free_or_record(&self, ptr: CUdeviceptr, bytes: u64, uses: &[Arc<StreamCore>]) {
        let mut state = self.lock();
        if let Err(error) = self.free(&mut state, ptr, bytes, uses) {
            record(&self.errors, error);
        }
    }

    /// Starts a step's counters: peaks from the current values, counts from zero.
    pub(crate) fn begin_step(&self, state: &mut PoolState) -> Result<()> {
        // The last step's peak reservation goes into the lifetime mark before it is reset.
        let (_, peak_reserved) = self.reserved(state)?;
        state.totals.reserved_high = state.totals.reserved_high.max(peak_reserved);
        let counters = &mut state.counters;
        *counters = Counters { used: counters.used, peak_used: counters.used, ..Counters::default() };
        state.allocator.begin_step();
        state.source.reserved_high = state.source.reserved;
        if let Backing::Pool(pool) = self.backing {
            // SAFETY: the pool is live while `self` is. Setting a high-water mark to 0 resets it
            // to the current value.
            unsafe {
                let driver = &self.stream.device.driver;
                driver.mem_pool_set_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
                driver.mem_pool_set_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
            }
        }
        Ok(())
    }

    /// `(reserved, peak reserved since the step began)`: the CUDA pool's attributes, or the
    /// fallback's own accounting.
    pub(crate) fn reserved(&self, state: &PoolState) -> Result<(u64, u64)> {
        match self.backing {
            Backing::Pool(pool) => {
                // SAFETY: the pool is live while `self` is.
                let counters = unsafe { self.stream.device.driver.mem_pool_counters(pool) }?;
                Ok((counters.reserved, counters.reserved_high))
            }
            Backing::Synchronous => Ok((state.source.reserved, state.source.reserved_high)),
        }
    }

    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH` since the step began (0 without a CUDA pool).
    fn peak_pool_used(&self) -> Result<u64> {
        match self.backing {
            // SAFETY: the pool is live while `self` is.
            Backing::Pool(pool) => Ok(unsafe { self.stream.device.driver.mem_pool_counters(pool) }?.used_high),
            Backing::Synchronous => Ok(0),
        }
    }

    /// Notes that a buffer of this pool is used on `other` (see [`PoolState::cross_uses`]).
    pub(crate) fn note_use(&self, other: &Arc<StreamCore>) {
        let mut state = self.lock();
        if !state.cross_uses.iter().any(|used| used.id == other.id) {
            state.cross_uses.push(other.clone());
        }
    }

    /// Ends the phase's scope: frees the raw allocations still live (in stream order, after the
    /// other streams they were used on), resets the strategy, and trims by the phase's policy.
    /// A failure does not stop the rest: every step runs and the first error is reported.
    pub(crate) fn end_scope(&self, state: &mut PoolState) -> Released {
        let mut released = Released::default();
        let failed = |released: &mut Released, result: Result<()>| {
            if let Err(error) = result {
                released.error.get_or_insert(error);
            }
        };
        let raw: Vec<(CUdeviceptr, RawAllocation)> = state.raw.drain().collect();
        for (ptr, allocation) in raw {
            let freed = self.free_inner(state, ptr, allocation.bytes, &allocation.uses, true);
            if freed.is_ok() {
                released.bytes += allocation.bytes;
            }
            released.raw.push((ptr, allocation.bytes));
            failed(&mut released, freed);
        }
        let waits: Vec<Arc<StreamCore>> = std::mem::take(&mut state.cross_uses);
        for other in waits {
            failed(&mut released, self.stream.wait_for(&other));
        }
        // What the scope needed: its peak of live bytes (as the CUDA pool counts them, rounded),
        // or the slabs an arena touched. Not its peak reservation, which counts kept memory.
        let needed = match self.entry.spec.strategy {
            crate::Strategy::Pool => {
                let pool_peak = self.peak_pool_used();
                let peak = state.counters.peak_used.max(*pool_peak.as_ref().unwrap_or(&0));
                failed(&mut released, pool_peak.map(drop));
                peak
            }
            _ => state.allocator.touched(),
        };
        let keep = match self.entry.spec.trim {
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
        // An arena reclaims everything it handed out, including buffers leaked with `forget`.
        let PoolState { allocator, source, counters, totals, .. } = state;
        if self.entry.spec.strategy != crate::Strategy::Pool && counters.used > 0 {
            released.bytes += counters.used;
            if self.entry.spec.budget.is_some() {
                self.entry.live.fetch_sub(counters.used, Ordering::Relaxed);
            }
            totals.used -= counters.used;
            counters.used = 0;
            self.recorder.release_pool(self.key());
        }
        failed(&mut released, allocator.reset(&mut self.source(source), keep));
        counters.released += released.bytes;
        totals.released_bytes += released.bytes;
        if keep != u64::MAX {
            let trimmed = self.trim_to(state, keep).map(drop);
            failed(&mut released, trimmed);
        }
        self.record_reserved(state);
        released
    }

    /// Records the pool's reservation in the history, if it records.
    pub(crate) fn record_reserved(&self, state: &mut PoolState) {
        if self.recorder.is_on() {
            let pool_reserved = self.source(&mut state.source).reserved();
            self.recorder.record(EventKind::Reserved { pool: self.key(), pool_reserved });
        }
    }

    /// Gives back what the pool holds beyond `keep` bytes and without live data, as far as the
    /// host has observed its frees complete. Returns the bytes released.
    pub(crate) fn trim_to(&self, state: &mut PoolState, keep: u64) -> Result<u64> {
        match self.backing {
            Backing::Pool(pool) => {
                let (before, _) = self.reserved(state)?;
                // SAFETY: the pool is live while `self` is.
                unsafe { self.stream.device.driver.mem_pool_trim_to(pool, keep) }?;
                let (after, _) = self.reserved(state)?;
                Ok(before.saturating_sub(after))
            }
            Backing::Synchronous => self.source(&mut state.source).reclaim(false),
        }
    }

    /// Memory is short: the strategy gives back to the CUDA pool what its scope has not touched
    /// (in stream order; a synchronization completes it). Returns the bytes given back.
    pub(crate) fn release_unused(&self, state: &mut PoolState) -> Result<u64> {
        let PoolState { allocator, source, .. } = state;
        allocator.release_unused(&mut self.source(source))
    }

    /// After the device was synchronized: gives back everything idle (out-of-memory recovery,
    /// [`Device::release_idle`](crate::Device::release_idle)).
    pub(crate) fn release_idle(&self, state: &mut PoolState) -> Result<u64> {
        match self.backing {
            Backing::Pool(_) => self.trim_to(state, 0),
            Backing::Synchronous => self.source(&mut state.source).reclaim(true),
        }
        .inspect(|_| self.record_reserved(state))
    }

    /// Free space inside what the pool holds: the strategy's own layout (arenas), else the
    /// CUDA pool's where the device publishes it (the simulated device; the real driver does not).
    fn free_space(&self, state: &PoolState) -> Option<FreeSpace> {
        if let Some(space) = state.allocator.free_space() {
            return Some(space);
        }
        let (Backing::Pool(pool), crate::Strategy::Pool) = (&self.backing, self.entry.spec.strategy) else {
            return None;
        };
        let layout = self.stream.device.driver.sim()?.pool_layout(*pool)?;
        Some(FreeSpace {
            largest_free: layout.free.iter().map(|piece| piece.len).max().unwrap_or(0),
            total_free: layout.free.iter().map(|piece| piece.len).sum(),
        })
    }

    /// The pool's lifetime counters now.
    pub(crate) fn metrics(&self, state: &mut PoolState) -> Result<PoolMetrics> {
        let (reserved, peak_reserved) = self.reserved(state)?;
        let totals = &mut state.totals;
        totals.reserved = reserved;
        totals.reserved_high = totals.reserved_high.max(peak_reserved).max(reserved);
        totals.alloc_nanos = state.timing.estimate_nanos();
        let free_space = self.free_space(state);
        Ok(self.pool_metrics(state.totals, free_space))
    }

    fn pool_metrics(&self, usage: Usage, free_space: Option<FreeSpace>) -> PoolMetrics {
        PoolMetrics {
            phase: self.entry.phase,
            phase_name: self.entry.spec.name.clone(),
            scope: self.entry.spec.scope,
            strategy: self.entry.spec.strategy,
            device: self.stream.device.ordinal,
            stream: self.stream.id,
            retired: false,
            usage,
            free_space,
        }
    }

    /// The pool's numbers now.
    pub(crate) fn stats(&self, state: &PoolState) -> Result<PoolStats> {
        let (reserved, peak_reserved) = self.reserved(state)?;
        let c = &state.counters;
        Ok(PoolStats {
            phase: self.entry.phase,
            phase_name: self.entry.spec.name.clone(),
            scope: self.entry.spec.scope,
            strategy: self.entry.spec.strategy,
            device: self.stream.device.ordinal,
            stream: self.stream.id,
            used: c.used,
            peak_used: c.peak_used,
            reserved,
            peak_reserved,
            allocations: c.allocations,
            frees: c.frees,
            released: c.released,
            largest_request: c.largest_request,
            free_space: self.free_space(state),
            plan: state.allocator.plan_stats(),
        })
    }
}

impl Drop for PhasePool {
    fn drop(&mut self) {
        // Its counts outlive it, so the runtime's counters never go back.
        let (mut usage, nanos) = {
            let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
            (state.totals, state.timing.estimate_nanos())
        };
        usage.alloc_nanos = nanos;
        self.retired.add(self.pool_metrics(usage, None));
        let key = self.key();
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let PoolState { allocator, source, raw, .. } = state;
        let mut source =
            Source { stream: &self.stream, backing: &self.backing, state: source, recorder: &self.recorder, key };
        let mut outcome = Ok(());
        for (ptr, allocation) in raw.drain() {
            outcome = outcome.and(source.free(ptr, allocation.bytes));
        }
        outcome = outcome.and(allocator.release_all(&mut source));
        match self.backing {
            Backing::Pool(pool) => {
                // SAFETY: nothing allocates from the pool any more; allocations still
                // outstanding keep their memory until freed, as cuMemPoolDestroy documents.
                outcome = outcome.and(unsafe { self.stream.device.driver.mem_pool_destroy(pool) }.map_err(Error::from));
            }
            Backing::Synchronous => outcome = outcome.and(source.reclaim(true).map(drop)),
        }
        if let Err(error) = outcome {
            record(&self.errors, error);
        }
    }
}
