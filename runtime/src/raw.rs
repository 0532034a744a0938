//! The raw API, for frameworks that keep device pointers rather than [`Buffer`](crate::Buffer)s
//! (cubecl's storage, a custom trainer's tensor type, anything on cudarc): [`RawApi`], from
//! [`Runtime::raw`](crate::Runtime::raw).
//!
//! Allocations are plain pointers. A pointer of a step- or micro-step-scoped phase is released at
//! the end of its scope, all at once, whether or not it was freed; a persistent one lives until
//! [`RawApi::free`]. The framework drives steps with [`RawApi::begin_step`] and
//! [`RawApi::end_step`] (or uses a [`Step`](crate::Step) guard for the steps and the raw calls
//! for its allocations).
//!
//! Misuse is reported, not silently absorbed: freeing an unknown or already-freed pointer,
//! ending a step twice, or allocating a step-scoped phase outside a step is an [`Error`]. In
//! checked mode ([`RuntimeBuilder::checked`](crate::RuntimeBuilder::checked) or
//! `STEPPOOL_CHECKED=1`) the runtime also remembers what each boundary released, so a free or a
//! [`RawApi::check_range`] of such a pointer names the step that released it.

use std::sync::Arc;

use steppool_sys::CUdeviceptr;

use crate::error::{Error, Result};
use crate::inner::{Caller, RuntimeInner};
use crate::phase::Phase;
use crate::raw_table::within;
use crate::report::{MicroStepReport, PoolId, StepReport};
use crate::strategy::Served;
use crate::stream::Stream;

/// A live raw allocation as [`RawApi::allocation`] finds it: where it lives and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawAllocationInfo {
    /// The pool that holds it: its device, stream (compare with [`Stream::id`]) and phase.
    pub pool: PoolId,
    /// The bytes requested.
    pub bytes: u64,
}

/// The raw API of a runtime, from [`Runtime::raw`](crate::Runtime::raw).
#[derive(Clone, Copy, Debug)]
pub struct RawApi<'a> {
    pub(crate) inner: &'a Arc<RuntimeInner>,
}

impl RawApi<'_> {
    /// Allocates `bytes` of `phase` on `stream` and returns the device pointer.
    ///
    /// # Safety
    ///
    /// The caller uses the memory only in `stream` order (or after making another stream wait,
    /// and recording that use with [`RawApi::record_use`]), and not after the pointer is
    /// released: by [`RawApi::free`], or, for a step- or micro-step-scoped phase, at the end of
    /// the scope it was allocated in. A wrapped `stream` must stay live until then.
    pub unsafe fn alloc(&self, phase: Phase, bytes: u64, stream: &Stream) -> Result<CUdeviceptr> {
        let (_, served) = self.inner.allocate(phase, bytes, &stream.core, &stream.pools, Caller::Raw)?;
        Ok(served.ptr)
    }

    /// Frees a pointer from [`RawApi::alloc`], in the order of the stream it was allocated on,
    /// after the other streams it was used on.
    ///
    /// # Safety
    ///
    /// No work enqueued after this call, on any stream, uses the memory.
    pub unsafe fn free(&self, ptr: CUdeviceptr) -> Result<()> {
        // SAFETY: the caller's contract, forwarded.
        self.inner.errors.guard(|| unsafe { self.free_checked(ptr) })
    }

    /// [`RawApi::free`] on a usable context.
    ///
    /// # Safety
    ///
    /// As for [`RawApi::free`].
    unsafe fn free_checked(&self, ptr: CUdeviceptr) -> Result<()> {
        // Find the pool without holding the table's entry, then do everything under the pool's
        // lock: take the allocation out, unregister it, free it. Until the free, the address
        // cannot serve anyone else, so the entry removed is this allocation's.
        let pool = self.inner.raw.pool_of(ptr).ok_or_else(|| self.unknown(ptr))?;
        let mut guard = pool.lock();
        let Some(allocation) = guard.take_raw(ptr) else {
            // A boundary released it after the lookup.
            drop(guard);
            return Err(self.unknown(ptr));
        };
        self.inner.raw.forget(&pool, &[(ptr, allocation.bytes)], None);
        guard.free(Served { ptr, slot: allocation.slot }, allocation.bytes, &allocation.uses)
    }

    /// Records that work on `stream` uses the raw allocation at `ptr`: its release waits for it.
    ///
    /// # Safety
    ///
    /// As for [`RawApi::alloc`]; `stream` must stay live until the release.
    pub unsafe fn record_use(&self, ptr: CUdeviceptr, stream: &Stream) -> Result<()> {
        let pool = self.inner.raw.pool_of(ptr).ok_or_else(|| self.unknown(ptr))?;
        let mut guard = pool.lock();
        let own = pool.stream.id;
        let allocation = guard.raw(ptr).ok_or_else(|| self.unknown(ptr))?;
        if stream.core.id != own && !allocation.uses.iter().any(|used| used.id == stream.core.id) {
            allocation.uses.push(stream.core.clone());
        }
        Ok(())
    }

    /// Checks that `[ptr, ptr + len)` lies inside a live raw allocation. Outside checked mode only
    /// the allocation's start can be looked up; in checked mode any address inside it can, and a
    /// pointer a boundary released is reported with its step ([`Error::UseAfterRelease`]).
    pub fn check_range(&self, ptr: CUdeviceptr, len: u64) -> Result<()> {
        if self.inner.raw.is_checked() {
            let (base, size) = self.inner.raw.range_of(ptr).ok_or_else(|| self.unknown(ptr))?;
            return within(ptr, len, base, size);
        }
        let pool = self.inner.raw.pool_of(ptr).ok_or_else(|| self.unknown(ptr))?;
        let size = pool.lock().raw(ptr).map(|allocation| allocation.bytes).ok_or_else(|| self.unknown(ptr))?;
        within(ptr, len, ptr, size)
    }

    /// The pool and size of the live raw allocation that starts at `ptr`: what a framework that
    /// is handed a pointer, a size and a stream back (PyTorch's pluggable allocator) checks them
    /// against. A pointer that is not the start of a live raw allocation is
    /// [`Error::UnknownPointer`] (or, in checked mode, [`Error::UseAfterRelease`] for one a
    /// boundary released).
    pub fn allocation(&self, ptr: CUdeviceptr) -> Result<RawAllocationInfo> {
        let pool = self.inner.raw.pool_of(ptr).ok_or_else(|| self.unknown(ptr))?;
        let bytes = pool.lock().raw(ptr).map(|allocation| allocation.bytes).ok_or_else(|| self.unknown(ptr))?;
        Ok(RawAllocationInfo { pool: pool.id(), bytes })
    }

    fn unknown(&self, ptr: CUdeviceptr) -> Error {
        self.inner.raw.unknown(ptr, |phase| self.inner.phase_name(phase))
    }

    /// Begins a step driven by the raw API; returns its index.
    pub fn begin_step(&self) -> Result<u64> {
        self.inner.begin_step(false)
    }

    /// Ends the step begun by [`RawApi::begin_step`], releasing every raw allocation of its
    /// step- and micro-step-scoped phases. Ending a step twice is [`Error::NoActiveStep`]; a
    /// step owned by a [`Step`](crate::Step) guard is refused.
    ///
    /// # Safety
    ///
    /// No work enqueued after this call uses the released pointers.
    pub unsafe fn end_step(&self) -> Result<StepReport> {
        self.inner.end_step(false)
    }

    /// Begins a micro-step of the active step; returns its index in the step.
    pub fn begin_micro_step(&self) -> Result<u32> {
        self.inner.begin_micro_step(false).map(|(_, index)| index)
    }

    /// Ends the active micro-step, releasing every raw allocation of its micro-step-scoped phases.
    ///
    /// # Safety
    ///
    /// No work enqueued after this call uses the released pointers.
    pub unsafe fn end_micro_step(&self) -> Result<MicroStepReport> {
        self.inner.end_micro_step(false)
    }
}
