//! Strategies: how a phase pool serves allocations from the memory it takes from the device.
//!
//! Every strategy implements [`Allocator`]: allocate, free, and reset at the boundary of the
//! phase's scope. A strategy takes memory only through a [`Source`], which hides whether it comes
//! from a CUDA memory pool in stream order or, on devices without pools, from `cuMemAlloc`.

mod arena;
mod plan;
mod planned;
mod pool;

use std::fmt;
use std::sync::Arc;

use steppool_sys::{CUdeviceptr, CUevent, CUevent_flags, CUmemoryPool};

pub(crate) use arena::Arena;
pub(crate) use planned::Planned;
pub use planned::{PlanKey, PlanStats, PlanSummary};
pub(crate) use pool::Direct;

use crate::error::Result;
use crate::phase::{PhaseEntry, Strategy};
use crate::stream::StreamCore;
use crate::telemetry::{EventKind, PoolKey, Recorder};

/// Alignment of every allocation a strategy hands out.
pub(crate) const ALIGNMENT: u64 = 512;

/// Where a phase pool's memory comes from.
#[derive(Debug)]
pub(crate) enum Backing {
    /// A CUDA memory pool of its own, allocated from in the stream's order.
    Pool(CUmemoryPool),
    /// `cuMemAlloc`/`cuMemFree`, for devices without pools.
    Synchronous,
}

/// What a [`Source`] keeps between calls: the bookkeeping of the synchronous fallback, whose
/// frees wait for the stream's work before `cuMemFree`.
#[derive(Debug, Default)]
pub(crate) struct SourceState {
    /// Fallback: freed allocations waiting for an event recorded on the stream at their free.
    deferred: Vec<(CUdeviceptr, u64, CUevent)>,
    /// Fallback: bytes allocated with `cuMemAlloc` and not yet given back.
    pub(crate) reserved: u64,
    pub(crate) reserved_high: u64,
}

/// A strategy's access to device memory, in the order of the pool's stream.
pub(crate) struct Source<'a> {
    pub(crate) stream: &'a StreamCore,
    pub(crate) backing: &'a Backing,
    pub(crate) state: &'a mut SourceState,
    /// The runtime's history, told of every segment taken and given back while it records.
    pub(crate) recorder: &'a Recorder,
    /// The pool this source serves, for the history.
    pub(crate) key: PoolKey,
}

impl Source<'_> {
    /// `bytes` of device memory, usable in stream order.
    pub(crate) fn alloc(&mut self, bytes: u64) -> Result<CUdeviceptr> {
        let ptr = self.alloc_untracked(bytes)?;
        if self.recorder.is_on() {
            let pool_reserved = self.reserved();
            self.recorder.record(EventKind::SegmentAlloc { pool: self.key, ptr, bytes, pool_reserved });
        }
        Ok(ptr)
    }

    /// Gives back `bytes` at `ptr` once the stream's work enqueued so far is done.
    pub(crate) fn free(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        self.free_untracked(ptr, bytes)?;
        if self.recorder.is_on() {
            let pool_reserved = self.reserved();
            self.recorder.record(EventKind::SegmentFree { pool: self.key, ptr, bytes, pool_reserved });
        }
        Ok(())
    }

    /// What the CUDA pool (or the fallback) reserves now; 0 when the pool cannot say.
    pub(crate) fn reserved(&self) -> u64 {
        match self.backing {
            Backing::Pool(pool) => {
                // SAFETY: the pool is live while the phase pool that owns this source is.
                let counters = unsafe { self.stream.device.driver.mem_pool_counters(*pool) };
                counters.map_or(0, |counters| counters.reserved)
            }
            Backing::Synchronous => self.state.reserved,
        }
    }

    fn alloc_untracked(&mut self, bytes: u64) -> Result<CUdeviceptr> {
        let device = &self.stream.device;
        match self.backing {
            Backing::Pool(pool) => {
                self.stream.prepare()?;
                // SAFETY: the pool and the stream are live while the phase pool that owns this
                // source is; the stream belongs to the pool's device.
                Ok(unsafe { device.driver.mem_alloc_from_pool_async(bytes as usize, *pool, self.stream.raw) }?)
            }
            Backing::Synchronous => {
                device.make_current()?;
                self.reclaim(false)?;
                let ptr = device.driver.mem_alloc(bytes as usize)?;
                self.state.reserved += bytes;
                self.state.reserved_high = self.state.reserved_high.max(self.state.reserved);
                Ok(ptr)
            }
        }
    }

    fn free_untracked(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        let device = &self.stream.device;
        match self.backing {
            Backing::Pool(_) => {
                self.stream.prepare()?;
                // SAFETY: `ptr` was allocated from this source and is freed once; the caller
                // guarantees nothing enqueued after this uses it.
                unsafe { device.driver.mem_free_async(ptr, self.stream.raw) }?;
            }
            Backing::Synchronous => {
                device.make_current()?;
                let event = device.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
                self.stream.prepare()?;
                // SAFETY: both handles are live.
                unsafe { device.driver.event_record(event, self.stream.raw) }?;
                self.state.deferred.push((ptr, bytes, event));
            }
        }
        Ok(())
    }

    /// Gives back the memory the source holds without live data beyond `keep` bytes, as far as
    /// its frees have been observed complete (`cuMemPoolTrimTo`; the fallback's completed
    /// deferred frees). Never waits for the GPU.
    pub(crate) fn trim_to(&mut self, keep: u64) -> Result<()> {
        match self.backing {
            Backing::Pool(pool) => {
                // SAFETY: the pool is live while the phase pool that owns this source is.
                unsafe { self.stream.device.driver.mem_pool_trim_to(*pool, keep) }?;
            }
            Backing::Synchronous => {
                self.reclaim(false)?;
            }
        }
        Ok(())
    }

    /// Waits for the work enqueued so far on the source's stream, so that its frees are complete
    /// and a trim can give them back. For rare events only (a planned slab that must grow).
    pub(crate) fn synchronize(&mut self) -> Result<()> {
        self.stream.prepare()?;
        // SAFETY: the stream is live while the phase pool that owns this source is.
        unsafe { self.stream.device.driver.stream_synchronize(self.stream.raw) }?;
        Ok(())
    }

    /// Fallback only: `cuMemFree`s the deferred allocations whose stream work is done, or all of
    /// them after waiting when `wait` is set. Returns the bytes given back.
    pub(crate) fn reclaim(&mut self, wait: bool) -> Result<u64> {
        let driver = &self.stream.device.driver;
        let mut released = 0;
        let mut index = 0;
        while index < self.state.deferred.len() {
            let (ptr, bytes, event) = self.state.deferred[index];
            // SAFETY: `event` is live until destroyed below; once it completes, no work enqueued
            // before the free uses `ptr`, and nothing after it may.
            let done = unsafe {
                if wait {
                    driver.event_synchronize(event)?;
                    true
                } else {
                    driver.event_query(event)?
                }
            };
            if done {
                // SAFETY: as above: the allocation's last use is complete.
                unsafe {
                    driver.mem_free(ptr)?;
                    driver.event_destroy(event)?;
                }
                self.state.deferred.swap_remove(index);
                self.state.reserved -= bytes;
                released += bytes;
            } else {
                index += 1;
            }
        }
        Ok(released)
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

/// A strategy's state in one phase pool. Called under the pool's lock.
pub(crate) trait Allocator: Send + fmt::Debug {
    /// Memory for `bytes` (more than 0) in the pool's stream order, [`ALIGNMENT`]-aligned.
    fn allocate(&mut self, source: &mut Source<'_>, bytes: u64) -> Result<CUdeviceptr>;

    /// Gives back an allocation of `bytes` made by [`Allocator::allocate`].
    fn free(&mut self, source: &mut Source<'_>, ptr: CUdeviceptr, bytes: u64) -> Result<()>;

    /// The phase's scope has ended and every allocation of it is gone: start over, keeping at
    /// least `keep` bytes of what the strategy holds for the next scope.
    fn reset(&mut self, source: &mut Source<'_>, keep: u64) -> Result<()>;

    /// Bytes held from the source beyond what the source itself tracks (an arena's slabs count
    /// as allocated in the CUDA pool); the high-water mark of what the scope touched.
    fn touched(&self) -> u64 {
        0
    }

    /// The free space inside what the strategy holds, where it knows the layout.
    fn free_space(&self) -> Option<FreeSpace> {
        None
    }

    /// Memory is short (out-of-memory recovery): give back what the current scope has not
    /// touched and will not need unless it grows. Returns the bytes given back.
    fn release_unused(&mut self, _source: &mut Source<'_>) -> Result<u64> {
        Ok(0)
    }

    /// The pool is going away: give everything back.
    fn release_all(&mut self, source: &mut Source<'_>) -> Result<()>;

    /// A step begins: counters kept per step start over.
    fn begin_step(&mut self) {}

    /// The planned strategy's numbers over the current step.
    fn plan_stats(&self) -> Option<PlanStats> {
        None
    }
}

/// The allocator state for a phase's strategy.
pub(crate) fn allocator(entry: &Arc<PhaseEntry>) -> Box<dyn Allocator> {
    match entry.spec.strategy {
        Strategy::Pool => Box::new(Direct),
        Strategy::Arena { slab_bytes } => Box::new(Arena::new(slab_bytes)),
        Strategy::Planned { max_plans, signature_len } => {
            Box::new(Planned::new(entry.clone(), max_plans, signature_len))
        }
    }
}
