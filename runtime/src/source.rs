//! Where a phase pool's memory comes from: the [`Source`] a strategy takes device memory from,
//! and [`DeviceSource`], the one that takes it from the device.
//!
//! A strategy sees only [`Source`]: four calls, in the pool's stream order, and three more for
//! address ranges that grow in place. That is what lets each strategy be tested in its own file
//! against a fake source. [`DeviceSource`] implements it over a CUDA memory pool of its own
//! (`cuMemAllocFromPoolAsync`/`cuMemFreeAsync`) or, on devices without pools, over
//! `cuMemAlloc`/`cuMemFree` with frees deferred until the stream's work is done; it also answers
//! what the pool above asks of its memory (counters, trim, access).
//!
//! # Ranges that grow in place
//!
//! Where the device has virtual memory management, [`Source::reserve_range`] reserves address
//! space with no memory behind it, and [`Source::resize_range`] maps physical pages (one handle
//! per granule, `cuMemCreate` + `cuMemMap`, access granted to the device and its peers) at the
//! end of what is mapped, or gives them back from the end: a slab that a larger plan outgrows
//! gets more pages at the same addresses, its live allocations untouched, and pages a smaller
//! plan no longer needs go back to the device, where any pool or phase can take them (physical
//! pages are a device-wide resource). When memory is short, a strategy can also give back the
//! pages of a free stretch inside the range ([`Source::punch_range`]) and map them again when it
//! places something there ([`Source::fill_range`]), as PyTorch's expandable segments unmap their
//! free pages wherever they lie. Mapped pages count in the source's reservation like pool
//! segments. On a device without it, `reserve_range` answers `None` and the strategy takes slabs
//! with [`Source::alloc`].
//!
//! # Pages given back in stream order
//!
//! A page may be unmapped only once the work enqueued on the stream no longer uses it, but a
//! give-back in the middle of a step must not stall the host until the GPU drains its queue: that
//! would lose the overlap of host and GPU in the step. So a shrink or a punch waits for nothing.
//! [`DeviceSource`] records an event on the stream after the work that used the pages (events
//! made once with `CU_EVENT_DISABLE_TIMING` and reused) and marks the pages *retiring*: still
//! mapped and still counted in the reservation, since they are. It queries the event at once;
//! complete, the pages are unmapped then. Otherwise every later call of the source that maps,
//! punches, resizes, fills, allocates or trims first queries the oldest retirements, in order,
//! and unmaps those whose event completed, never waiting. Only calls that may wait finish every
//! retirement first (`cuEventSynchronize`): freeing a range, destroying the source, a trim after
//! a device synchronization, and a page the device refuses to map for want of memory, which is
//! retried once after the retiring pages went back. A retiring page that a fill or a growth asks
//! for again is kept: its retirement is cancelled (stream order puts the new use after the old
//! one), with no unmap and no new page. While the stream is captured, pages stay mapped as before
//! and nothing is recorded into the capture.

use std::fmt;
use std::sync::Arc;

use std::collections::{BTreeMap, VecDeque};
use steppool_sys::handle::{EventHandle, PoolHandle};

use steppool_sys::{
    CUdevice, CUdeviceptr, CUevent_flags, CUmemGenericAllocationHandle, CUmemPool_attribute, CUmemoryPool, Driver,
    PoolProps,
};

use crate::device_core::{DeviceCore, read_write};
use crate::error::{Error, Result};
use crate::report::{PageTraffic, PoolId};
use crate::stream_core::StreamCore;
use crate::telemetry::{EventKind, Recorder};

/// Device memory in a stream's order, as a strategy takes it.
pub(crate) trait Source {
    /// `bytes` (more than 0) of memory, usable by work enqueued on the stream from now on.
    fn alloc(&mut self, bytes: u64) -> Result<CUdeviceptr>;

    /// Gives back `bytes` at `ptr` (from [`Source::alloc`]) once the stream's work enqueued so far
    /// is done. Whatever it returns, the memory is no longer the caller's: a free the driver
    /// refused is owed by the source, which makes it later (see [`DeviceSource`]), so a strategy
    /// forgets the memory before calling this and never uses it again.
    fn free(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()>;

    /// Gives back to the device what the source holds without live data beyond `keep` bytes, as
    /// far as its frees have been observed complete. Never waits for the GPU.
    fn trim_to(&mut self, keep: u64) -> Result<()>;

    /// Waits for the work enqueued so far on the stream, so that its frees are complete and a
    /// trim can give them back. For rare events only (a planned slab that must grow).
    fn synchronize(&mut self) -> Result<()>;

    /// Reserves a range of address space that grows in place, with nothing mapped yet: its base
    /// and the most it can map. `None` where the device has no virtual memory management.
    fn reserve_range(&mut self) -> Result<Option<(CUdeviceptr, u64)>>;

    /// Makes the first `bytes` of the range at `base` (from [`Source::reserve_range`]) the mapped
    /// part, rounded up to the page granularity; returns the bytes mapped now. Growing maps new
    /// pages after the mapped ones (memory before them keeps its contents and addresses);
    /// shrinking gives back pages from the end, whose memory the caller no longer uses, in the
    /// stream's order: they go back to the device now or once the stream's work enqueued so far
    /// no longer uses them, without waiting for it. A growth the device refuses maps nothing and
    /// is an error, and so is one past what the range can map (an out-of-memory error).
    fn resize_range(&mut self, base: CUdeviceptr, bytes: u64) -> Result<u64>;

    /// Gives back the range at `base`: what is mapped (after waiting for the stream) and the
    /// addresses.
    fn free_range(&mut self, base: CUdeviceptr) -> Result<()>;

    /// Gives back the pages of the range at `base` that lie wholly inside `[offset, offset + len)`
    /// of its mapped part: a hole whose memory the caller no longer uses goes back to the device
    /// while the memory around it stays where it is. Like a shrink, it never waits for the
    /// stream: the pages go back now or once the stream's work enqueued so far no longer uses
    /// them. Returns the bytes given back (now or then). The range keeps its size
    /// ([`Source::resize_range`] still counts from the base); [`Source::fill_range`] maps the hole
    /// again.
    fn punch_range(&mut self, base: CUdeviceptr, offset: u64, len: u64) -> Result<u64>;

    /// Maps again the pages of holes ([`Source::punch_range`]) that `[offset, offset + len)` of
    /// the range at `base` touches: all of them, or (refused by the device, an out-of-memory
    /// error) none. Returns the bytes mapped.
    fn fill_range(&mut self, base: CUdeviceptr, offset: u64, len: u64) -> Result<u64>;

    /// The strategy starts (`true`) or stops keeping pages of freed memory mapped, which it gives
    /// back when the device needs more ([`FreedPages`](crate::device_core::FreedPages)).
    fn hold_freed(&mut self, _holding: bool) {}
}

/// An address range of a [`DeviceSource`] that grows in place.
#[derive(Debug)]
struct GrowableRange {
    /// Bytes of address space reserved.
    limit: u64,
    /// The physical page mapped at each granule from the base, in order; `None` where a hole was
    /// punched ([`Source::punch_range`]).
    pages: Vec<Option<CUmemGenericAllocationHandle>>,
}

/// A page of a growable range on its way back to the device: given back by a shrink or a punch,
/// still mapped until the stream's work no longer uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RetiringPage {
    /// The base of its range.
    base: CUdeviceptr,
    /// Its index from the base, in granules.
    page: usize,
    /// Its physical memory.
    handle: CUmemGenericAllocationHandle,
}

/// Pages given back by one call, in the stream's order.
#[derive(Debug)]
struct Retirement {
    /// Recorded on the stream after the work that used the pages; `None` once the host has seen
    /// it complete (the event went back to the source's idle events).
    event: Option<EventHandle>,
    /// The pages still mapped: unmapped once `event` completes. A page the driver refused to
    /// unmap stays here, mapped and counted, and is retried by the next call that looks.
    pages: Vec<RetiringPage>,
}

/// The memory a phase pool holds, as the driver counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// Bytes held from the device now.
    pub(crate) reserved: u64,
    /// The most held since the step began.
    pub(crate) peak_reserved: u64,
    /// The most allocated from the CUDA pool since the step began, rounded as the pool rounds
    /// (0 without a CUDA pool).
    pub(crate) peak_used: u64,
    /// Whether all of it came from the CUDA pool (or `cuMemAlloc`) since the step began: no pages
    /// were mapped into ranges of the source's own.
    pub(crate) pool_only: bool,
    /// The most the CUDA pool (or `cuMemAlloc`) held since the step began, pages mapped into the
    /// source's ranges left out.
    pub(crate) peak_pool: u64,
    /// Pages mapped into and unmapped from the source's ranges since the step began.
    pub(crate) pages: PageTraffic,
}

/// Where a [`DeviceSource`] gets its memory.
#[derive(Debug)]
enum Backing {
    /// A CUDA memory pool of its own, allocated from in the stream's order.
    CudaPool(PoolHandle),
    /// `cuMemAlloc`/`cuMemFree`, for devices without pools.
    Synchronous(Fallback),
}

/// The bookkeeping of the synchronous fallback, whose frees wait for the stream's work before
/// `cuMemFree`.
#[derive(Debug, Default)]
struct Fallback {
    /// Freed allocations waiting for an event recorded on the stream at their free.
    deferred: Vec<(CUdeviceptr, u64, EventHandle)>,
    /// Bytes allocated with `cuMemAlloc` and not yet given back.
    reserved: u64,
    reserved_high: u64,
}

/// The memory of one phase pool, taken from the device on the pool's stream.
pub(crate) struct DeviceSource {
    stream: Arc<StreamCore>,
    backing: Backing,
    /// The runtime's history, told of every segment taken and given back while it records.
    recorder: Arc<Recorder>,
    /// The pool this source serves, for the history.
    id: PoolId,
    /// Frees that did not happen and that the source now owns: the driver refused them with an
    /// error that leaves the context usable, or they could not be ordered after the streams that
    /// used the memory. Given back after a device-wide synchronization, at the next trim and at
    /// destroy.
    pending: Vec<(CUdeviceptr, u64)>,
    /// Frees asked for while the stream was being captured: made then, they would be recorded
    /// into the graph (or invalidate it), so they wait for the stream's next call outside
    /// capture.
    after_capture: Vec<(CUdeviceptr, u64)>,
    /// Address ranges that grow in place, by base.
    ranges: BTreeMap<CUdeviceptr, GrowableRange>,
    /// Bytes mapped in them now, and the most since the step began.
    mapped: u64,
    mapped_high: u64,
    /// Pages mapped and unmapped since the step began.
    pages: PageTraffic,
    /// Pages whose unmap (at the address, if any) or release the driver refused: owed, and made
    /// at the next trim and at destroy, as refused frees are.
    owed_pages: Vec<(Option<CUdeviceptr>, CUmemGenericAllocationHandle)>,
    /// Pages given back and still mapped until the stream's work no longer uses them, oldest
    /// first (see the [module docs](self)).
    retiring: VecDeque<Retirement>,
    /// Events made for retirements and free again, reused before a new one is made.
    idle_events: Vec<EventHandle>,
}

impl fmt::Debug for DeviceSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSource").field("backing", &self.backing).field("pool", &self.id).finish()
    }
}

impl DeviceSource {
    /// A CUDA pool on the stream's device with `release_threshold` and `peers` granted access,
    /// or the synchronous fallback on a device without pools.
    pub(crate) fn new(
        stream: Arc<StreamCore>,
        id: PoolId,
        release_threshold: u64,
        peers: &[CUdevice],
        recorder: Arc<Recorder>,
    ) -> Result<Self> {
        let device = &stream.device;
        let backing = if device.pools_supported {
            let driver = &device.driver;
            let pool = driver.mem_pool_create(&PoolProps::device(device.device).build())?;
            let threshold = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            // SAFETY: the pool was just created.
            let configured = unsafe { driver.mem_pool_set_attribute(pool, threshold, release_threshold) };
            if let Err(error) = configured {
                // SAFETY: the pool was just created and holds nothing.
                let _ = unsafe { driver.mem_pool_destroy(pool) };
                return Err(error.into());
            }
            Backing::CudaPool(PoolHandle::from_raw(pool))
        } else {
            Backing::Synchronous(Fallback::default())
        };
        let mut source = Self {
            stream,
            backing,
            recorder,
            id,
            pending: Vec::new(),
            after_capture: Vec::new(),
            ranges: BTreeMap::new(),
            mapped: 0,
            mapped_high: 0,
            pages: PageTraffic::default(),
            owed_pages: Vec::new(),
            retiring: VecDeque::new(),
            idle_events: Vec::new(),
        };
        source.grant_access(peers)?;
        Ok(source)
    }

    /// The CUDA pool, unless the device has none.
    pub(crate) fn handle(&self) -> Option<CUmemoryPool> {
        match self.backing {
            Backing::CudaPool(pool) => Some(pool.raw()),
            Backing::Synchronous(_) => None,
        }
    }

    /// Grants `peers` read-write access to the memory of the CUDA pool.
    pub(crate) fn grant_access(&mut self, peers: &[CUdevice]) -> Result<()> {
        if let (Backing::CudaPool(pool), false) = (&self.backing, peers.is_empty()) {
            let access: Vec<_> = peers.iter().map(|&peer| read_write(peer)).collect();
            // SAFETY: the pool is live while `self` is.
            unsafe { self.stream.device.driver.mem_pool_set_access(pool.raw(), &access) }?;
        }
        if !peers.is_empty() {
            let granule = self.stream.device.vmm_granularity.unwrap_or(0);
            let access: Vec<_> = peers.iter().map(|&peer| read_write(peer)).collect();
            for (&base, range) in &self.ranges {
                // Each run of mapped pages (holes have nothing to grant).
                let mut page = 0;
                while page < range.pages.len() {
                    let run = range.pages[page..].iter().take_while(|handle| handle.is_some()).count();
                    if run > 0 {
                        let (start, bytes) = (base + page as u64 * granule, run as u64 * granule);
                        // SAFETY: `[start, start + bytes)` is mapped memory of this source.
                        unsafe { self.stream.device.driver.mem_set_access(start, bytes, &access) }?;
                    }
                    page += run + 1;
                }
            }
            // Retiring pages are mapped too, and may be kept for a later use.
            for page in self.retiring.iter().flat_map(|retirement| &retirement.pages) {
                let start = page.base + page.page as u64 * granule;
                // SAFETY: `[start, start + granule)` is a mapped page of this source.
                unsafe { self.stream.device.driver.mem_set_access(start, granule, &access) }?;
            }
        }
        Ok(())
    }

    /// What the source holds: the CUDA pool's attributes, or the fallback's own accounting.
    pub(crate) fn reservation(&self) -> Result<Reservation> {
        match &self.backing {
            Backing::CudaPool(pool) => {
                // SAFETY: the pool is live while `self` is.
                let counters = unsafe { self.stream.device.driver.mem_pool_counters(pool.raw()) }?;
                Ok(Reservation {
                    reserved: counters.reserved + self.mapped,
                    // The two high-water marks may fall at different times: their sum bounds the
                    // peak from above.
                    peak_reserved: counters.reserved_high + self.mapped_high,
                    peak_used: counters.used_high,
                    pool_only: self.mapped_high == 0,
                    peak_pool: counters.reserved_high,
                    pages: self.pages,
                })
            }
            Backing::Synchronous(fallback) => Ok(Reservation {
                reserved: fallback.reserved + self.mapped,
                peak_reserved: fallback.reserved_high + self.mapped_high,
                peak_used: 0,
                pool_only: self.mapped_high == 0,
                peak_pool: fallback.reserved_high,
                pages: self.pages,
            }),
        }
    }

    /// Pages mapped and unmapped since the step began.
    pub(crate) fn pages(&self) -> PageTraffic {
        self.pages
    }

    /// A step begins: the high-water marks start over from the current values.
    pub(crate) fn begin_step(&mut self) -> Result<()> {
        self.mapped_high = self.mapped;
        self.pages = PageTraffic::default();
        match &mut self.backing {
            Backing::CudaPool(pool) => {
                let driver = &self.stream.device.driver;
                // SAFETY: the pool is live while `self` is. Setting a high-water mark to 0 resets
                // it to the current value.
                unsafe {
                    driver.mem_pool_set_attribute(
                        pool.raw(),
                        CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                        0,
                    )?;
                    driver.mem_pool_set_attribute(pool.raw(), CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
                }
            }
            Backing::Synchronous(fallback) => fallback.reserved_high = fallback.reserved,
        }
        Ok(())
    }

    /// Gives back what the source holds beyond `keep` bytes and without live data, as far as the
    /// host has observed its frees complete; after a device synchronization (`wait`), all of
    /// that. Returns the bytes given back.
    pub(crate) fn trim(&mut self, keep: u64, wait: bool) -> Result<u64> {
        // Called at boundaries and recoveries, which end any capture first.
        self.free_after_capture()?;
        self.retry_pending()?;
        self.poll_retirements(if wait { Look::Wait } else { Look::Query }, |_| false)?;
        match &mut self.backing {
            Backing::CudaPool(pool) => {
                let pool = pool.raw();
                let before = self.reservation()?.reserved;
                // SAFETY: the pool is live while `self` is.
                unsafe { self.stream.device.driver.mem_pool_trim_to(pool, keep) }?;
                let after = self.reservation()?.reserved;
                Ok(before.saturating_sub(after))
            }
            Backing::Synchronous(_) => self.reclaim(wait),
        }
    }

    /// Unmaps the pages given back in stream order whose work the host has seen complete,
    /// without waiting for any.
    pub(crate) fn poll_given_back(&mut self) -> Result<()> {
        self.poll_retirements(Look::Query, |_| false)
    }

    /// Records the source's reservation in the history, if it records.
    pub(crate) fn record_reserved(&self) {
        if self.recorder.is_on() {
            let pool_reserved = self.reserved_or_zero();
            self.recorder.record(EventKind::Reserved { pool: self.id, pool_reserved });
        }
    }

    /// The pool is going away (nothing allocates from it any more): destroys the CUDA pool, or
    /// waits for the fallback's deferred frees and makes them.
    pub(crate) fn destroy(&mut self) -> Result<()> {
        // The pool goes whether or not the owed frees succeed: the driver releases a destroyed
        // pool's memory once its last allocation is freed.
        // Frees that waited for a capture are owed like refused ones: made after a synchronize.
        self.pending.append(&mut self.after_capture);
        let mut retried = self.retry_pending();
        // Pages on their way back go first; ranges a strategy still holds (it gives them back in
        // `release_all`) go too.
        retried = retried.and(self.poll_retirements(Look::Wait, |_| false));
        let bases: Vec<CUdeviceptr> = self.ranges.keys().copied().collect();
        for base in bases {
            retried = retried.and(self.free_range(base));
        }
        retried = retried.and(self.destroy_events());
        let destroyed = match self.backing {
            Backing::CudaPool(pool) => {
                // SAFETY: nothing allocates from the pool any more; allocations still outstanding
                // keep their memory until freed, as cuMemPoolDestroy documents.
                unsafe { self.stream.device.driver.mem_pool_destroy(pool.raw()) }
                    .map_err(Error::from)
                    .map(|()| self.backing = Backing::Synchronous(Fallback::default()))
            }
            Backing::Synchronous(_) => self.reclaim(true).map(drop),
        };
        retried.and(destroyed)
    }

    /// Takes over the free of `ptr` (of this source), which could not be made in stream order:
    /// it is made after a device-wide synchronization, at the next trim or at destroy.
    pub(crate) fn keep_for_retry(&mut self, ptr: CUdeviceptr, bytes: u64) {
        self.pending.push((ptr, bytes));
    }

    /// Whether the stream is being captured; a stream that cannot say is taken as not capturing
    /// (the calls that follow report the driver's state).
    fn capturing(&self) -> bool {
        self.stream.capture().ok().flatten().is_some()
    }

    /// Makes the frees that waited for a capture to end, in stream order; one the driver refuses
    /// is owed like any refused free.
    fn free_after_capture(&mut self) -> Result<()> {
        let mut first = Ok(());
        while let Some((ptr, bytes)) = self.after_capture.pop() {
            let freed = self.free_now(ptr, bytes);
            if first.is_ok() {
                first = freed;
            }
        }
        first
    }

    /// Makes the frees the source owes, once the device is idle; those the driver refuses again
    /// stay owed.
    fn retry_pending(&mut self) -> Result<()> {
        self.retry_owed_pages()?;
        if self.pending.is_empty() {
            return Ok(());
        }
        let device = &self.stream.device;
        device.make_current()?;
        // Every stream that used the memory is done with it.
        device.driver.context_synchronize()?;
        while let Some(&(ptr, bytes)) = self.pending.last() {
            match &mut self.backing {
                Backing::CudaPool(_) => {
                    // On the legacy stream of the (current) context rather than the pool's
                    // stream, which may be what failed; the device is idle, so any order will do.
                    // SAFETY: no work uses `ptr`; it was allocated from this source and its free
                    // never happened.
                    unsafe { device.driver.mem_free_async(ptr, std::ptr::null_mut()) }?;
                }
                Backing::Synchronous(fallback) => {
                    // SAFETY: as above.
                    unsafe { device.driver.mem_free(ptr) }?;
                    fallback.reserved -= bytes;
                }
            }
            self.pending.pop();
            if self.recorder.is_on() {
                let pool_reserved = self.reserved_or_zero();
                self.recorder.record(EventKind::SegmentFree { pool: self.id, ptr, bytes, pool_reserved });
            }
        }
        Ok(())
    }

    fn reserved_or_zero(&self) -> u64 {
        self.reservation().map_or(0, |reservation| reservation.reserved)
    }

    /// Fallback only: `cuMemFree`s the deferred allocations whose stream work is done, or all of
    /// them after waiting when `wait` is set. Returns the bytes given back.
    fn reclaim(&mut self, wait: bool) -> Result<u64> {
        let Backing::Synchronous(fallback) = &mut self.backing else {
            return Ok(0);
        };
        let driver = &self.stream.device.driver;
        let mut released = 0;
        let mut index = 0;
        while index < fallback.deferred.len() {
            let (ptr, bytes, event) = fallback.deferred[index];
            let event = event.raw();
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
                fallback.deferred.swap_remove(index);
                fallback.reserved -= bytes;
                released += bytes;
            } else {
                index += 1;
            }
        }
        Ok(released)
    }
}

impl Source for DeviceSource {
    fn alloc(&mut self, bytes: u64) -> Result<CUdeviceptr> {
        if !self.after_capture.is_empty() {
            self.free_after_capture()?;
        }
        self.stream.device.freed.before_growth(bytes);
        self.poll_retirements(Look::Query, |_| false)?;
        if let Backing::Synchronous(_) = self.backing {
            self.stream.device.make_current()?;
            self.reclaim(false)?;
        }
        let device = &self.stream.device;
        let ptr = match &mut self.backing {
            Backing::CudaPool(pool) => {
                self.stream.prepare()?;
                // SAFETY: the pool and the stream are live while `self` is; the stream belongs
                // to the pool's device.
                unsafe { device.driver.mem_alloc_from_pool_async(bytes as usize, pool.raw(), self.stream.raw()) }?
            }
            Backing::Synchronous(fallback) => {
                let ptr = device.driver.mem_alloc(bytes as usize)?;
                fallback.reserved += bytes;
                fallback.reserved_high = fallback.reserved_high.max(fallback.reserved);
                ptr
            }
        };
        if self.recorder.is_on() {
            let pool_reserved = self.reserved_or_zero();
            self.recorder.record(EventKind::SegmentAlloc { pool: self.id, ptr, bytes, pool_reserved });
        }
        Ok(ptr)
    }

    fn free(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        if self.capturing() {
            self.after_capture.push((ptr, bytes));
            return Ok(());
        }
        if !self.after_capture.is_empty() {
            self.free_after_capture()?;
        }
        self.free_now(ptr, bytes)
    }

    fn trim_to(&mut self, keep: u64) -> Result<()> {
        // A trim during a capture would invalidate it; the next one outside capture does it.
        if self.capturing() {
            return Ok(());
        }
        self.free_after_capture()?;
        self.trim(keep, false).map(drop)
    }

    fn synchronize(&mut self) -> Result<()> {
        // A synchronization during a capture would invalidate it: a strategy that asks for one
        // (to let a trim give memory back) goes on without it.
        if self.capturing() {
            return Ok(());
        }
        self.stream.prepare()?;
        // SAFETY: the stream is live while `self` is.
        unsafe { self.stream.device.driver.stream_synchronize(self.stream.raw()) }?;
        // Every retirement's event was recorded on the stream before this: all are complete.
        for retirement in &mut self.retiring {
            if let Some(event) = retirement.event.take() {
                self.idle_events.push(event);
            }
        }
        self.poll_retirements(Look::Query, |_| false)
    }

    fn reserve_range(&mut self) -> Result<Option<(CUdeviceptr, u64)>> {
        let device = &self.stream.device;
        let Some(granule) = device.vmm_granularity else { return Ok(None) };
        // As much address space as the device has memory: a slab never needs more.
        let limit = device.total_memory.next_multiple_of(granule);
        device.make_current()?;
        let base = device.driver.mem_address_reserve(limit, 0)?;
        self.ranges.insert(base, GrowableRange { limit, pages: Vec::new() });
        Ok(Some((base, limit)))
    }

    fn resize_range(&mut self, base: CUdeviceptr, bytes: u64) -> Result<u64> {
        let granule = self.stream.device.vmm_granularity.expect("a range exists only with virtual memory management");
        let range = self.ranges.get(&base).expect("a range of this source");
        if bytes > range.limit {
            // More than the device has: what mapping it would end in.
            return Err(Error::Driver(steppool_sys::DriverError::Call {
                call: "cuMemCreate",
                code: steppool_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                description: format!("{bytes} bytes asked of a range of {} bytes", range.limit).into(),
            }));
        }
        let target = bytes.div_ceil(granule) as usize;
        let mapped = range.pages.len();
        if target > mapped {
            self.stream.device.freed.before_growth((target - mapped) as u64 * granule);
            self.poll_retirements(Look::Query, |_| false)?;
            let pages: Vec<usize> = (mapped..target).collect();
            self.map_holes(base, &pages, granule)?;
        } else if target < mapped {
            // Nothing may still run on the pages given back, and an event recorded into a
            // capture would belong to the graph: while the stream captures, the pages stay mapped.
            if self.capturing() {
                return Ok(mapped as u64 * granule);
            }
            self.poll_retirements(Look::Query, |_| false)?;
            // From the end down, as they are unmapped.
            let range = &self.ranges[&base];
            let pages: Vec<usize> = (target..mapped).rev().filter(|&page| range.pages[page].is_some()).collect();
            self.retire(base, &pages, granule)?;
            self.ranges.get_mut(&base).expect("range").pages.truncate(target);
        }
        Ok(target as u64 * granule)
    }

    fn free_range(&mut self, base: CUdeviceptr) -> Result<()> {
        let granule = self.stream.device.vmm_granularity.expect("a range exists only with virtual memory management");
        self.poll_retirements(Look::Wait, |_| false)?;
        if self.ranges.get(&base).is_some_and(|range| range.pages.iter().any(Option::is_some)) {
            self.synchronize()?;
            self.unmap_pages(base, 0, granule)?;
        }
        let range = self.ranges.remove(&base).expect("a range of this source");
        // SAFETY: the range was reserved by this source and nothing is mapped in it any more.
        unsafe { self.stream.device.driver.mem_address_free(base, range.limit) }?;
        Ok(())
    }

    fn punch_range(&mut self, base: CUdeviceptr, offset: u64, len: u64) -> Result<u64> {
        let granule = self.stream.device.vmm_granularity.expect("a range exists only with virtual memory management");
        let range = self.ranges.get(&base).expect("a range of this source");
        let from = offset.div_ceil(granule) as usize;
        let to = (((offset + len) / granule) as usize).min(range.pages.len());
        if from >= to || range.pages[from..to].iter().all(Option::is_none) {
            return Ok(0);
        }
        // As for a shrink: nothing may still run on the pages, and a capture keeps them mapped.
        if self.capturing() {
            return Ok(0);
        }
        self.poll_retirements(Look::Query, |_| false)?;
        let range = &self.ranges[&base];
        let pages: Vec<usize> = (from..to).filter(|&page| range.pages[page].is_some()).collect();
        self.retire(base, &pages, granule)
    }

    fn fill_range(&mut self, base: CUdeviceptr, offset: u64, len: u64) -> Result<u64> {
        let granule = self.stream.device.vmm_granularity.expect("a range exists only with virtual memory management");
        let range = self.ranges.get(&base).expect("a range of this source");
        let from = (offset / granule) as usize;
        let to = ((offset + len).div_ceil(granule) as usize).min(range.pages.len());
        if !range.pages.get(from..to).is_some_and(|pages| pages.iter().any(Option::is_none)) {
            return Ok(0);
        }
        let holes = range.pages[from..to].iter().filter(|page| page.is_none()).count() as u64;
        self.stream.device.freed.before_growth(holes * granule);
        self.poll_retirements(Look::Query, |_| false)?;
        let range = &self.ranges[&base];
        let holes: Vec<usize> = (from..to).filter(|&page| range.pages[page].is_none()).collect();
        self.map_holes(base, &holes, granule)
    }

    fn hold_freed(&mut self, holding: bool) {
        self.stream.device.freed.hold(holding);
    }
}

impl DeviceSource {
    /// The free of [`Source::free`], made now.
    fn free_now(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        let device = &self.stream.device;
        match &mut self.backing {
            Backing::CudaPool(_) => {
                let freed = self.stream.prepare().and_then(|()| {
                    // SAFETY: `ptr` was allocated from this source and is freed once; the
                    // strategy enqueues nothing after this that uses it.
                    Ok(unsafe { device.driver.mem_free_async(ptr, self.stream.raw()) }?)
                });
                if let Err(error) = freed {
                    // Unless the context is lost, the free is owed, not forgotten.
                    if !error.is_sticky() {
                        self.pending.push((ptr, bytes));
                    }
                    return Err(error);
                }
            }
            Backing::Synchronous(fallback) => {
                device.make_current()?;
                let event = device.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
                self.stream.prepare()?;
                // SAFETY: both handles are live.
                unsafe { device.driver.event_record(event, self.stream.raw()) }?;
                fallback.deferred.push((ptr, bytes, EventHandle::from_raw(event)));
            }
        }
        if self.recorder.is_on() {
            let pool_reserved = self.reserved_or_zero();
            self.recorder.record(EventKind::SegmentFree { pool: self.id, ptr, bytes, pool_reserved });
        }
        Ok(())
    }

    /// Unmaps and releases the pages the driver refused to before; those it refuses again stay
    /// owed. Their memory was last used before the refused call, which waited for the stream.
    fn retry_owed_pages(&mut self) -> Result<()> {
        if self.owed_pages.is_empty() {
            return Ok(());
        }
        let device = self.stream.device.clone();
        let granule = device.vmm_granularity.unwrap_or(0);
        device.make_current()?;
        let mut outcome = Ok(());
        for (ptr, handle) in std::mem::take(&mut self.owed_pages) {
            if let Some(ptr) = ptr {
                // SAFETY: the page was mapped by this source with this handle and is no longer
                // used (the stream was waited for before the refused unmap).
                if let Err(error) = unsafe { device.driver.mem_unmap(ptr, granule) } {
                    self.owed_pages.push((Some(ptr), handle));
                    outcome = outcome.and(Err(error.into()));
                    continue;
                }
            }
            // SAFETY: the handle is this source's and no longer mapped.
            if let Err(error) = unsafe { device.driver.mem_release(handle) } {
                self.owed_pages.push((None, handle));
                outcome = outcome.and(Err(error.into()));
            }
        }
        outcome
    }

    /// Maps `pages` (ascending page indices of the range at `base`: holes, or pages past its
    /// mapped part for a growth) with access for the device and its peers. A page on its way
    /// back ([`Retirement`]) is kept, its retirement cancelled: stream order puts the new use
    /// after the old one. The others get new pages. All or none: on a failure, the new pages go
    /// back and the retiring ones stay retiring. When the device is out of memory and pages are
    /// retiring, waits for them to go back (keeping those asked for) and tries once more. Returns
    /// the bytes mapped, kept pages included.
    fn map_holes(&mut self, base: CUdeviceptr, pages: &[usize], granule: u64) -> Result<u64> {
        if pages.is_empty() {
            return Ok(0);
        }
        let device = self.stream.device.clone();
        let asked = |page: &RetiringPage| page.base == base && pages.binary_search(&page.page).is_ok();
        let retiring_asked = |retiring: &VecDeque<Retirement>| -> Vec<usize> {
            retiring
                .iter()
                .flat_map(|retirement| &retirement.pages)
                .filter(|page| asked(page))
                .map(|page| page.page)
                .collect()
        };
        let kept = retiring_asked(&self.retiring);
        let fresh: Vec<usize> = pages.iter().copied().filter(|page| !kept.contains(page)).collect();
        let added = match self.create_pages(&device, base, &fresh, granule) {
            // The pages retiring may be what the device lacks: once the stream is done with
            // them, they go back and the mapping is tried again (not while capturing: the wait
            // would invalidate the capture).
            Err(error) if error.is_out_of_memory() && !self.retiring.is_empty() && !self.capturing() => {
                self.poll_retirements(Look::Wait, asked)?;
                self.create_pages(&device, base, &fresh, granule)?
            }
            created => created?,
        };
        let mut access = vec![read_write(device.device)];
        access.extend(device.peers().into_iter().map(read_write));
        for (first, end) in runs(added.iter().map(|&(page, _)| page)) {
            let start = base + first as u64 * granule;
            // SAFETY: `[start, start + len)` was just mapped.
            let granted = unsafe { device.driver.mem_set_access(start, (end - first) as u64 * granule, &access) };
            if let Err(error) = granted {
                // Nothing used the new pages: they go back at once.
                let pages = added.into_iter().rev().map(|(page, handle)| (base + page as u64 * granule, handle));
                self.give_back_unused(&device.driver, pages, granule);
                return Err(error.into());
            }
        }
        // Kept: taken out of their retirements; one left with no page frees its event.
        let mut kept: Vec<RetiringPage> = Vec::new();
        for retirement in &mut self.retiring {
            kept.extend(retirement.pages.iter().filter(|page| asked(page)));
            retirement.pages.retain(|page| !asked(page));
        }
        let (mut index, mut freed) = (0, Vec::new());
        while index < self.retiring.len() {
            if self.retiring[index].pages.is_empty() {
                freed.extend(self.retiring.remove(index).and_then(|retirement| retirement.event));
            } else {
                index += 1;
            }
        }
        self.idle_events.extend(freed);
        let range = self.ranges.get_mut(&base).expect("range");
        let end = pages[pages.len() - 1] + 1;
        if range.pages.len() < end {
            range.pages.resize(end, None);
        }
        for page in &kept {
            range.pages[page.page] = Some(page.handle);
        }
        for &(page, handle) in &added {
            range.pages[page] = Some(handle);
        }
        let bytes = added.len() as u64 * granule;
        self.mapped += bytes;
        self.pages.mapped += bytes;
        self.mapped_high = self.mapped_high.max(self.mapped);
        self.stream.device.mapped.add(bytes);
        if self.recorder.is_on() {
            // One mapping per run of new pages, as the range's segment grew by each.
            let pool_reserved = self.reserved_or_zero();
            for (first, end) in runs(added.iter().map(|&(page, _)| page)) {
                let (ptr, bytes) = (base + first as u64 * granule, (end - first) as u64 * granule);
                self.recorder.record(EventKind::SegmentMap { pool: self.id, range: base, ptr, bytes, pool_reserved });
            }
        }
        Ok(bytes + kept.len() as u64 * granule)
    }

    /// Creates and maps a new page at each of `pages` of the range at `base` (nothing mapped
    /// there). On a failure, unmaps and releases what it mapped and maps nothing.
    fn create_pages(
        &mut self,
        device: &DeviceCore,
        base: CUdeviceptr,
        pages: &[usize],
        granule: u64,
    ) -> Result<Vec<(usize, CUmemGenericAllocationHandle)>> {
        let driver = &device.driver;
        if !pages.is_empty() {
            device.make_current()?;
        }
        let mut added: Vec<(usize, CUmemGenericAllocationHandle)> = Vec::with_capacity(pages.len());
        for &page in pages {
            let mapped = driver.mem_create(device.device, granule).and_then(|handle| {
                // SAFETY: the handle was just created; the page lies inside the reserved range,
                // where nothing is mapped.
                match unsafe { driver.mem_map(base + page as u64 * granule, granule, handle) } {
                    Ok(()) => Ok(handle),
                    Err(error) => {
                        // SAFETY: the handle was just created and is not mapped.
                        if unsafe { driver.mem_release(handle) }.is_err() {
                            self.owed_pages.push((None, handle));
                        }
                        Err(error)
                    }
                }
            });
            match mapped {
                Ok(handle) => added.push((page, handle)),
                Err(error) => {
                    // Nothing used the new pages: they go back at once.
                    let pages = added.into_iter().rev().map(|(page, handle)| (base + page as u64 * granule, handle));
                    self.give_back_unused(driver, pages, granule);
                    return Err(error.into());
                }
            }
        }
        Ok(added)
    }

    /// Gives back `pages` (mapped pages of the range at `base` that the caller no longer uses)
    /// in the stream's order, without waiting: records an event on the stream after the work
    /// enqueued so far, moves the pages out of the range into a [`Retirement`], and unmaps them
    /// at once if the event is already complete. An event call that fails is an error, and then
    /// nothing is given back. Returns the bytes given back, now or once the event completes.
    fn retire(&mut self, base: CUdeviceptr, pages: &[usize], granule: u64) -> Result<u64> {
        if pages.is_empty() {
            return Ok(0);
        }
        let device = self.stream.device.clone();
        let driver = &device.driver;
        device.make_current()?;
        let event = match self.idle_events.pop() {
            Some(event) => event,
            None => EventHandle::from_raw(driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?),
        };
        let recorded = self.stream.prepare().and_then(|()| {
            // SAFETY: the event is this source's, made in the stream's context (current), and
            // not waited on by anything; the stream is live while `self` is and not capturing
            // (the callers checked), so the record is not part of a graph.
            unsafe { driver.event_record(event.raw(), self.stream.raw()) }?;
            // SAFETY: as above; the event was just recorded outside capture.
            Ok(unsafe { driver.event_query(event.raw()) }?)
        });
        let done = match recorded {
            Ok(done) => done,
            Err(error) => {
                self.idle_events.push(event);
                return Err(error);
            }
        };
        let range = self.ranges.get_mut(&base).expect("a range of this source");
        let retiring = pages
            .iter()
            .map(|&page| RetiringPage { base, page, handle: range.pages[page].take().expect("a mapped page") })
            .collect();
        let event = if done {
            self.idle_events.push(event);
            None
        } else {
            Some(event)
        };
        self.retiring.push_back(Retirement { event, pages: retiring });
        if done {
            // The pages are given back whatever the unmap says: a page the driver refuses to
            // unmap stays retiring, mapped and counted, and the next call that looks retries it
            // and reports the error.
            let _ = self.poll_retirements(Look::Query, |_| false);
        }
        Ok(pages.len() as u64 * granule)
    }

    /// Unmaps the retiring pages whose event has completed, oldest retirement first, except
    /// those `keep` names (a mapping about to take them back). With [`Look::Query`] it stops at
    /// the first event not complete (those after it were recorded later on the same stream) and
    /// looks at nothing while the stream captures; with [`Look::Wait`] it waits for each event.
    /// A page the driver refuses to unmap stays retiring, and the error is returned; a release
    /// it refuses is owed.
    fn poll_retirements(&mut self, look: Look, keep: impl Fn(&RetiringPage) -> bool) -> Result<()> {
        if self.retiring.is_empty() || (look == Look::Query && self.capturing()) {
            return Ok(());
        }
        let device = self.stream.device.clone();
        let granule = device.vmm_granularity.unwrap_or(0);
        device.make_current()?;
        let mut outcome = Ok(());
        let mut index = 0;
        while index < self.retiring.len() {
            if let Some(event) = self.retiring[index].event {
                // SAFETY: the event is this source's and was recorded on its stream outside
                // capture.
                let done = unsafe {
                    match look {
                        Look::Query => device.driver.event_query(event.raw())?,
                        Look::Wait => device.driver.event_synchronize(event.raw()).map(|()| true)?,
                    }
                };
                if !done {
                    break;
                }
                self.retiring[index].event = None;
                self.idle_events.push(event);
            }
            let pages = std::mem::take(&mut self.retiring[index].pages);
            let (mut left, mut refused) = (Vec::new(), None);
            for page in pages {
                if keep(&page) || refused.is_some() {
                    left.push(page);
                    continue;
                }
                let ptr = page.base + page.page as u64 * granule;
                // SAFETY: the page was mapped by this source with this handle, the caller no
                // longer uses it, and the event recorded after its last use has completed.
                match unsafe { device.driver.mem_unmap(ptr, granule) } {
                    Ok(()) => outcome = outcome.and(self.unmapped(page.base, ptr, page.handle, granule)),
                    Err(error) => {
                        left.push(page);
                        refused = Some(error);
                    }
                }
            }
            if left.is_empty() {
                self.retiring.remove(index);
            } else {
                self.retiring[index].pages = left;
                index += 1;
            }
            if let Some(error) = refused {
                // Retried, in order, by the next call that looks.
                return Err(error.into());
            }
        }
        outcome
    }

    /// Destroys the source's events: idle ones, and those of retirements left (their pages stay
    /// counted as mapped, and are given back with their range).
    fn destroy_events(&mut self) -> Result<()> {
        let driver = &self.stream.device.driver;
        let left = self.retiring.iter_mut().filter_map(|retirement| retirement.event.take());
        let events: Vec<EventHandle> = self.idle_events.drain(..).chain(left).collect();
        let mut outcome = Ok(());
        for event in events {
            // SAFETY: the event is this source's and nothing uses it any more.
            outcome = outcome.and(unsafe { driver.event_destroy(event.raw()) }.map_err(Error::from));
        }
        outcome
    }

    /// Unmaps and releases the pages of the range at `base` from the end down to `target`. The
    /// caller has waited for every use of them.
    fn unmap_pages(&mut self, base: CUdeviceptr, target: usize, granule: u64) -> Result<()> {
        let device = self.stream.device.clone();
        device.make_current()?;
        while self.ranges[&base].pages.len() > target {
            let page = self.ranges[&base].pages.len() - 1;
            // The caller waited for every use of the page. Once unmapped (its release refused
            // or not) it is a hole, popped; a page the driver would not unmap stays.
            let unmapped = if self.ranges[&base].pages[page].is_some() {
                self.unmap_page(&device, base, page, granule)
            } else {
                Ok(())
            };
            if self.ranges[&base].pages[page].is_none() {
                self.ranges.get_mut(&base).expect("range").pages.pop();
            }
            unmapped?;
        }
        Ok(())
    }

    /// Unmaps and releases the mapped page `page` of the range at `base`, leaving a hole there.
    /// The caller has waited for every use of it. A release the driver refuses leaves memory
    /// owed (retried later), never a dangling mapping.
    fn unmap_page(&mut self, device: &DeviceCore, base: CUdeviceptr, page: usize, granule: u64) -> Result<()> {
        let handle = self.ranges[&base].pages[page].expect("a mapped page");
        let ptr = base + page as u64 * granule;
        // SAFETY: the page was mapped by this source with this handle, and the caller waited for
        // every use of it.
        unsafe { device.driver.mem_unmap(ptr, granule) }?;
        self.ranges.get_mut(&base).expect("range").pages[page] = None;
        self.unmapped(base, ptr, handle, granule)
    }

    /// A page of the range at `base` at `ptr` was just unmapped: it no longer counts, its
    /// physical memory is released (a release the driver refuses is owed) and the history told.
    fn unmapped(
        &mut self,
        base: CUdeviceptr,
        ptr: CUdeviceptr,
        handle: CUmemGenericAllocationHandle,
        granule: u64,
    ) -> Result<()> {
        self.mapped -= granule;
        self.pages.unmapped += granule;
        self.stream.device.mapped.sub(granule);
        // SAFETY: the handle is this source's and no longer mapped.
        let released = unsafe { self.stream.device.driver.mem_release(handle) };
        if self.recorder.is_on() {
            let pool_reserved = self.reserved_or_zero();
            let unmapped = EventKind::SegmentUnmap { pool: self.id, range: base, ptr, bytes: granule, pool_reserved };
            self.recorder.record(unmapped);
        }
        if let Err(error) = released {
            self.owed_pages.push((None, handle));
            return Err(error.into());
        }
        Ok(())
    }

    /// Gives back pages mapped by a call that then failed, before anything used them; what the
    /// driver refuses is owed.
    fn give_back_unused(
        &mut self,
        driver: &Driver,
        pages: impl Iterator<Item = (CUdeviceptr, CUmemGenericAllocationHandle)>,
        granule: u64,
    ) {
        for (ptr, handle) in pages {
            // SAFETY: each page was mapped by the failed call with this handle and never used.
            if unsafe { driver.mem_unmap(ptr, granule) }.is_err() {
                self.owed_pages.push((Some(ptr), handle));
            // SAFETY: as above; the handle is no longer mapped.
            } else if unsafe { driver.mem_release(handle) }.is_err() {
                self.owed_pages.push((None, handle));
            }
        }
    }
}

/// How [`DeviceSource::poll_retirements`] learns that the stream is done with retiring pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Look {
    /// `cuEventQuery`: never waits.
    Query,
    /// `cuEventSynchronize`: waits for the GPU.
    Wait,
}

/// The runs of consecutive numbers in `pages` (ascending), each as `(first, end)`.
fn runs(pages: impl Iterator<Item = usize>) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for page in pages {
        match runs.last_mut() {
            Some((_, end)) if *end == page => *end += 1,
            _ => runs.push((page, page + 1)),
        }
    }
    runs
}

/// A source for the strategies' unit tests: hands out addresses from a plain range, never
/// reuses one before it is given back, and checks every free against what it handed out.
#[cfg(test)]
pub(crate) mod fake {
    use std::collections::{BTreeMap, BTreeSet};

    use steppool_sys::CUdeviceptr;

    use super::Source;
    use crate::error::{Error, Result};

    /// A fake device: first-fit over `capacity` bytes starting at `BASE`, with the calls counted;
    /// with virtual memory management ([`FakeSource::with_ranges`]), ranges that grow in place in
    /// 2 MiB pages, their mapped bytes counted against the same capacity.
    #[derive(Debug)]
    pub(crate) struct FakeSource {
        pub(crate) capacity: u64,
        /// Live ranges handed out: base → size.
        pub(crate) live: BTreeMap<CUdeviceptr, u64>,
        pub(crate) allocs: u64,
        pub(crate) frees: u64,
        pub(crate) syncs: u64,
        pub(crate) trims: Vec<u64>,
        /// Whether it has ranges that grow in place.
        pub(crate) vmm: bool,
        /// Reserved ranges: base → mapped bytes from the base (holes included).
        pub(crate) ranges: BTreeMap<CUdeviceptr, u64>,
        /// The pages of each range punched out ([`Source::punch_range`]), by index from its base.
        pub(crate) holes: BTreeMap<CUdeviceptr, BTreeSet<u64>>,
        /// Resizes (and fills) that mapped pages, and resizes (and punches) that gave them back,
        /// in stream order without a wait as [`DeviceSource`](super::DeviceSource) does.
        pub(crate) grows: u64,
        pub(crate) shrinks: u64,
        /// Whether the strategy keeps pages of freed memory mapped ([`Source::hold_freed`]).
        pub(crate) holding: bool,
    }

    /// Where the fake device's addresses start.
    pub(crate) const BASE: CUdeviceptr = 1 << 40;
    /// Where its reserved ranges start, each [`RANGE_LIMIT`] apart.
    pub(crate) const RANGES: CUdeviceptr = 1 << 44;
    /// The most a range maps.
    pub(crate) const RANGE_LIMIT: u64 = 1 << 36;
    /// Its page.
    pub(crate) const PAGE: u64 = 2 << 20;

    impl FakeSource {
        pub(crate) fn new(capacity: u64) -> Self {
            Self {
                capacity,
                live: BTreeMap::new(),
                allocs: 0,
                frees: 0,
                syncs: 0,
                trims: Vec::new(),
                vmm: false,
                ranges: BTreeMap::new(),
                holes: BTreeMap::new(),
                grows: 0,
                shrinks: 0,
                holding: false,
            }
        }

        /// A fake device with virtual memory management.
        pub(crate) fn with_ranges(capacity: u64) -> Self {
            Self { vmm: true, ..Self::new(capacity) }
        }

        /// Bytes handed out or mapped and not given back.
        pub(crate) fn held(&self) -> u64 {
            self.live.values().sum::<u64>() + self.mapped()
        }

        /// Bytes mapped in ranges.
        pub(crate) fn mapped(&self) -> u64 {
            self.ranges.values().sum::<u64>() - self.holes.values().map(|pages| pages.len() as u64 * PAGE).sum::<u64>()
        }

        fn out_of_memory() -> Error {
            Error::Driver(steppool_sys::DriverError::Call {
                call: "cuMemAllocFromPoolAsync",
                code: steppool_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                description: "out of memory".into(),
            })
        }
    }

    impl Source for FakeSource {
        fn alloc(&mut self, bytes: u64) -> Result<CUdeviceptr> {
            let mut at = BASE;
            for (&base, &size) in &self.live {
                if base >= at + bytes {
                    break;
                }
                at = at.max(base + size);
            }
            if at + bytes > BASE + self.capacity || self.held() + bytes > self.capacity {
                return Err(Self::out_of_memory());
            }
            self.live.insert(at, bytes);
            self.allocs += 1;
            Ok(at)
        }

        fn free(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
            let size = self.live.remove(&ptr);
            assert_eq!(size, Some(bytes), "free of {ptr:#x} ({bytes} bytes), which the source did not hand out");
            self.frees += 1;
            Ok(())
        }

        fn trim_to(&mut self, keep: u64) -> Result<()> {
            self.trims.push(keep);
            Ok(())
        }

        fn synchronize(&mut self) -> Result<()> {
            self.syncs += 1;
            Ok(())
        }

        fn reserve_range(&mut self) -> Result<Option<(CUdeviceptr, u64)>> {
            if !self.vmm {
                return Ok(None);
            }
            let base = (0..).map(|i| RANGES + i * RANGE_LIMIT).find(|base| !self.ranges.contains_key(base)).unwrap();
            self.ranges.insert(base, 0);
            Ok(Some((base, RANGE_LIMIT)))
        }

        fn resize_range(&mut self, base: CUdeviceptr, bytes: u64) -> Result<u64> {
            let mapped = *self.ranges.get(&base).expect("resize of a range the source did not reserve");
            let target = bytes.next_multiple_of(PAGE);
            if target > mapped {
                if target > RANGE_LIMIT || self.held() + (target - mapped) > self.capacity {
                    return Err(Self::out_of_memory());
                }
                self.grows += 1;
            } else if target < mapped {
                // Given back in stream order, as by the device: no wait.
                self.shrinks += 1;
                if let Some(holes) = self.holes.get_mut(&base) {
                    holes.retain(|&page| page < target / PAGE);
                }
            }
            self.ranges.insert(base, target);
            Ok(target)
        }

        fn free_range(&mut self, base: CUdeviceptr) -> Result<()> {
            let mapped = self.ranges.remove(&base).expect("free of a range the source did not reserve");
            self.holes.remove(&base);
            if mapped > 0 {
                self.syncs += 1;
            }
            Ok(())
        }

        fn punch_range(&mut self, base: CUdeviceptr, offset: u64, len: u64) -> Result<u64> {
            let mapped = *self.ranges.get(&base).expect("punch of a range the source did not reserve");
            let (from, to) = (offset.div_ceil(PAGE), ((offset + len) / PAGE).min(mapped / PAGE));
            let holes = self.holes.entry(base).or_default();
            let punched = (from..to).filter(|&page| holes.insert(page)).count() as u64;
            if punched > 0 {
                self.shrinks += 1;
            }
            Ok(punched * PAGE)
        }

        fn fill_range(&mut self, base: CUdeviceptr, offset: u64, len: u64) -> Result<u64> {
            let mapped = *self.ranges.get(&base).expect("fill of a range the source did not reserve");
            let (from, to) = (offset / PAGE, (offset + len).div_ceil(PAGE).min(mapped / PAGE));
            let holes = self.holes.entry(base).or_default();
            let filled: Vec<u64> = holes.range(from..to).copied().collect();
            let bytes = filled.len() as u64 * PAGE;
            if bytes == 0 {
                return Ok(0);
            }
            if self.held() + bytes > self.capacity {
                return Err(Self::out_of_memory());
            }
            let holes = self.holes.get_mut(&base).expect("holes");
            for page in filled {
                holes.remove(&page);
            }
            self.grows += 1;
            Ok(bytes)
        }

        fn hold_freed(&mut self, holding: bool) {
            assert_ne!(self.holding, holding, "told twice");
            self.holding = holding;
        }
    }
}

/// [`DeviceSource`] on the simulated device, with its stream's work held incomplete where a test
/// needs the GPU behind the host ([`Sim::hold_stream`](steppool_sys::sim::Sim::hold_stream)).
#[cfg(test)]
mod tests {
    use steppool_sys::sim::{FaultCode, FaultPlan, Sim, SimConfig};
    use steppool_sys::{CUstream_flags, Driver};

    use super::*;
    use crate::phase::Phase;

    const PAGE: u64 = 2 << 20;

    /// A source on a simulated device of `capacity` bytes, on a stream of its own.
    fn source(capacity: u64) -> (Driver, DeviceSource) {
        let driver = Driver::simulated(SimConfig { count_calls: true, ..SimConfig::with_capacity(capacity) }).unwrap();
        let device = Arc::new(DeviceCore::open(&driver, 0).unwrap());
        let raw = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let stream = Arc::new(StreamCore::new(device, raw, true, 0));
        let id = PoolId { device: 0, stream: stream.id, phase: Phase::ACTIVATIONS };
        let source = DeviceSource::new(stream, id, u64::MAX, &[], Arc::new(Recorder::default())).unwrap();
        (driver, source)
    }

    fn sim(driver: &Driver) -> &Sim {
        driver.sim().unwrap()
    }

    /// Bytes the device has mapped into reserved ranges.
    fn mapped(driver: &Driver) -> u64 {
        sim(driver).mapped_ranges().iter().map(|range| range.size).sum()
    }

    /// A range of this source with `pages` pages mapped.
    fn range(source: &mut DeviceSource, pages: u64) -> CUdeviceptr {
        let (base, _) = source.reserve_range().unwrap().unwrap();
        assert_eq!(source.resize_range(base, pages * PAGE).unwrap(), pages * PAGE);
        base
    }

    fn hold(driver: &Driver, source: &DeviceSource) {
        sim(driver).hold_stream(source.stream.raw()).unwrap();
    }

    fn release(driver: &Driver, source: &DeviceSource) {
        sim(driver).release_stream(source.stream.raw()).unwrap();
    }

    /// The waits for the GPU made so far.
    fn waits(driver: &Driver) -> u64 {
        let sim = sim(driver);
        sim.calls("cuStreamSynchronize") + sim.calls("cuEventSynchronize") + sim.calls("cuCtxSynchronize")
    }

    #[test]
    fn a_punch_while_work_is_pending_waits_for_nothing_and_unmaps_at_the_next_call() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 4);
        hold(&driver, &source);
        let waits = waits(&driver);
        assert_eq!(source.punch_range(base, PAGE, 2 * PAGE).unwrap(), 2 * PAGE, "given back, in stream order");
        assert_eq!(self::waits(&driver), waits, "no wait for the stream");
        assert_eq!(sim(&driver).calls("cuStreamSynchronize"), 0);
        assert!(sim(&driver).calls("cuEventQuery") > 0, "the event was asked, not waited for");
        // Still mapped and counted while the stream may use them, whatever calls come.
        assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (4 * PAGE, 4 * PAGE));
        source.trim_to(0).unwrap();
        assert_eq!(source.punch_range(base, 0, 4 * PAGE).unwrap(), 2 * PAGE, "only the pages not already given");
        assert_eq!(mapped(&driver), 4 * PAGE);
        // The stream passes the events: the next call unmaps the pages, without a wait.
        release(&driver, &source);
        assert_eq!(mapped(&driver), 4 * PAGE, "nothing happens behind the source's back");
        let ptr = source.alloc(PAGE).unwrap();
        assert_eq!(mapped(&driver), 0);
        let unit = steppool_sys::sim::DEFAULT_POOL_UNIT;
        assert_eq!(source.reservation().unwrap().reserved, unit, "the pool's unit only");
        assert_eq!(self::waits(&driver), waits);
        source.free(ptr, PAGE).unwrap();
        source.destroy().unwrap();
        assert_eq!(sim(&driver).calls("cuEventCreate"), sim(&driver).calls("cuEventDestroy_v2"), "no event leaks");
    }

    #[test]
    fn a_shrink_while_work_is_pending_waits_for_nothing() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 4);
        hold(&driver, &source);
        let waits = waits(&driver);
        assert_eq!(source.resize_range(base, PAGE).unwrap(), PAGE);
        assert_eq!(self::waits(&driver), waits);
        assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (4 * PAGE, 4 * PAGE));
        release(&driver, &source);
        source.trim_to(0).unwrap();
        assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (PAGE, PAGE));
        assert_eq!(self::waits(&driver), waits);
        source.destroy().unwrap();
    }

    #[test]
    fn without_pending_work_pages_go_back_at_once_and_events_are_reused() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 8);
        for page in 0..4 {
            assert_eq!(source.punch_range(base, page * PAGE, PAGE).unwrap(), PAGE);
            assert_eq!(mapped(&driver), (7 - page) * PAGE, "the event was complete: unmapped now");
        }
        assert_eq!(source.resize_range(base, 5 * PAGE).unwrap(), 5 * PAGE);
        assert_eq!(mapped(&driver), PAGE);
        assert_eq!(sim(&driver).calls("cuEventCreate"), 1, "one event, reused");
        assert_eq!(waits(&driver), 0);
        source.destroy().unwrap();
        assert_eq!(sim(&driver).calls("cuEventDestroy_v2"), 1);
    }

    #[test]
    fn a_page_asked_for_again_while_retiring_is_kept() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 4);
        hold(&driver, &source);
        source.punch_range(base, PAGE, 2 * PAGE).unwrap();
        let (creates, unmaps) = (sim(&driver).calls("cuMemCreate"), sim(&driver).calls("cuMemUnmap"));
        // A fill over one retiring page: kept, with no new page and no unmap.
        assert_eq!(source.fill_range(base, PAGE, PAGE).unwrap(), PAGE);
        // A growth over pages retiring from a shrink: kept too, and only the new page is made.
        assert_eq!(source.resize_range(base, PAGE).unwrap(), PAGE);
        assert_eq!(source.resize_range(base, 5 * PAGE).unwrap(), 5 * PAGE);
        assert_eq!(sim(&driver).calls("cuMemCreate"), creates + 1, "the fifth page only");
        assert_eq!(sim(&driver).calls("cuMemUnmap"), unmaps);
        release(&driver, &source);
        source.trim_to(0).unwrap();
        assert_eq!(mapped(&driver), 5 * PAGE, "nothing left retiring");
        assert_eq!(source.reservation().unwrap().reserved, 5 * PAGE);
        assert_eq!(sim(&driver).calls("cuMemUnmap"), unmaps);
        assert_eq!(waits(&driver), 0);
        source.destroy().unwrap();
        assert_eq!(mapped(&driver), 0);
    }

    #[test]
    fn a_map_the_device_refuses_waits_for_the_retiring_pages_and_succeeds() {
        // Room for four pages.
        let (driver, mut source) = source(4 * PAGE);
        let base = range(&mut source, 4);
        hold(&driver, &source);
        source.punch_range(base, 0, 2 * PAGE).unwrap();
        assert_eq!(mapped(&driver), 4 * PAGE, "the device is full while the stream uses them");
        let (other, _) = source.reserve_range().unwrap().unwrap();
        let event_waits = sim(&driver).calls("cuEventSynchronize");
        assert_eq!(source.resize_range(other, 2 * PAGE).unwrap(), 2 * PAGE, "mapped once they went back");
        assert_eq!(sim(&driver).calls("cuEventSynchronize"), event_waits + 1, "one wait, for the event");
        assert_eq!(sim(&driver).calls("cuStreamSynchronize"), 0);
        assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (4 * PAGE, 4 * PAGE));
        // Without retiring pages, a refusal is an error.
        let (third, _) = source.reserve_range().unwrap().unwrap();
        let refused = source.resize_range(third, PAGE).unwrap_err();
        assert!(refused.is_out_of_memory(), "{refused}");
        source.destroy().unwrap();
        assert_eq!(mapped(&driver), 0);
    }

    #[test]
    fn destroy_with_retiring_pages_leaks_nothing() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 4);
        let other = range(&mut source, 2);
        hold(&driver, &source);
        source.punch_range(base, 0, 2 * PAGE).unwrap();
        source.resize_range(other, 0).unwrap();
        source.resize_range(base, 3 * PAGE).unwrap();
        assert_eq!(mapped(&driver), 6 * PAGE);
        source.destroy().unwrap();
        assert_eq!(mapped(&driver), 0, "every page unmapped");
        let (free, total) = driver.mem_get_info().unwrap();
        assert_eq!(free, total, "and released");
        assert_eq!(sim(&driver).calls("cuEventCreate"), sim(&driver).calls("cuEventDestroy_v2"));
        assert_eq!(sim(&driver).calls("cuMemAddressReserve"), sim(&driver).calls("cuMemAddressFree"));
    }

    #[test]
    fn an_event_the_driver_refuses_gives_back_nothing_and_leaks_nothing() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 4);
        for call in ["cuEventCreate", "cuEventRecord", "cuEventQuery"] {
            sim(&driver).set_faults(Some(FaultPlan::nth(1, FaultCode::InvalidValue).calls(&[call])));
            let refused = source.punch_range(base, PAGE, 2 * PAGE).unwrap_err();
            assert!(refused.to_string().contains(call), "{refused}");
            assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (4 * PAGE, 4 * PAGE), "{call}");
        }
        sim(&driver).set_faults(None);
        assert_eq!(source.punch_range(base, PAGE, 2 * PAGE).unwrap(), 2 * PAGE, "the pages are still the range's");
        assert_eq!(mapped(&driver), 2 * PAGE);
        source.destroy().unwrap();
        assert_eq!(mapped(&driver), 0);
        assert_eq!(
            sim(&driver).calls("cuEventCreate") - 1,
            sim(&driver).calls("cuEventDestroy_v2"),
            "one create refused"
        );
    }

    #[test]
    fn an_unmap_the_driver_refuses_leaves_the_page_retiring_and_counted() {
        let (driver, mut source) = source(1 << 30);
        let base = range(&mut source, 4);
        hold(&driver, &source);
        source.punch_range(base, 0, 2 * PAGE).unwrap();
        release(&driver, &source);
        sim(&driver).set_faults(Some(FaultPlan::nth(1, FaultCode::InvalidValue).calls(&["cuMemUnmap"])));
        let refused = source.trim_to(0).unwrap_err();
        assert!(refused.to_string().contains("cuMemUnmap"), "{refused}");
        assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (4 * PAGE, 4 * PAGE));
        sim(&driver).set_faults(None);
        source.trim_to(0).unwrap();
        assert_eq!((mapped(&driver), source.reservation().unwrap().reserved), (2 * PAGE, 2 * PAGE), "retried");
        source.destroy().unwrap();
        assert_eq!(mapped(&driver), 0);
    }
}
