//! The raw API, for frameworks that keep device pointers rather than [`Buffer`](crate::Buffer)s
//! (cubecl's storage, a custom trainer's tensor type, anything on cudarc).
//!
//! Allocations are plain pointers. A pointer of a step- or micro-step-scoped phase is released at
//! the end of its scope, all at once, whether or not it was freed; a persistent one lives until
//! [`Runtime::free_raw`]. The framework drives steps with [`Runtime::begin_step_raw`] and
//! [`Runtime::end_step_raw`] (or uses a [`Step`](crate::Step) guard for the steps and the raw
//! calls for its allocations).
//!
//! Misuse is reported, not silently absorbed: freeing an unknown or already-freed pointer,
//! ending a step twice, or allocating a step-scoped phase outside a step is an [`Error`]. In
//! checked mode ([`RuntimeBuilder::checked`](crate::RuntimeBuilder::checked) or
//! `STEPPOOL_CHECKED=1`) the runtime also remembers what each boundary released, so a free or a
//! [`Runtime::check_range`] of such a pointer names the step that released it.

use std::sync::PoisonError;

use steppool_sys::CUdeviceptr;

use crate::error::{Error, Result};
use crate::phase::Phase;
use crate::report::{MicroStepReport, StepReport};
use crate::runtime::{Caller, Runtime};
use crate::stream::Stream;

impl Runtime {
    /// Allocates `bytes` of `phase` on `stream` and returns the device pointer.
    ///
    /// # Safety
    ///
    /// The caller uses the memory only in `stream` order (or after making another stream wait,
    /// and recording that use with [`Runtime::record_use_raw`]), and not after the pointer is
    /// released: by [`Runtime::free_raw`], or, for a step- or micro-step-scoped phase, at the
    /// end of the scope it was allocated in. A wrapped `stream` must stay live until then.
    pub unsafe fn alloc_raw(&self, phase: Phase, bytes: u64, stream: &Stream) -> Result<CUdeviceptr> {
        let (_, ptr) = self.inner.allocate(phase, bytes, stream, Caller::Raw)?;
        Ok(ptr)
    }

    /// Frees a pointer from [`Runtime::alloc_raw`], in the order of the stream it was allocated
    /// on, after the other streams it was used on.
    ///
    /// # Safety
    ///
    /// No work enqueued after this call, on any stream, uses the memory.
    pub unsafe fn free_raw(&self, ptr: CUdeviceptr) -> Result<()> {
        // Find the pool without holding the registry entry, then do everything under the pool's
        // lock: take the allocation out, unregister it, free it. Until the free, the address
        // cannot serve anyone else, so the registry entry removed is this allocation's.
        let pool = self.inner.raw.get(&ptr).map(|entry| entry.value().clone()).ok_or_else(|| self.unknown(ptr))?;
        let mut state = pool.lock();
        let Some(allocation) = state.raw.remove(&ptr) else {
            // A boundary released it after the lookup.
            drop(state);
            return Err(self.unknown(ptr));
        };
        self.inner.forget_raw(&pool, &[(ptr, allocation.bytes)], None);
        pool.free(&mut state, ptr, allocation.bytes, &allocation.uses)
    }

    /// Records that work on `stream` uses the raw allocation at `ptr`: its release waits for it.
    ///
    /// # Safety
    ///
    /// As for [`Runtime::alloc_raw`]; `stream` must stay live until the release.
    pub unsafe fn record_use_raw(&self, ptr: CUdeviceptr, stream: &Stream) -> Result<()> {
        let pool = self.inner.raw.get(&ptr).map(|entry| entry.value().clone()).ok_or_else(|| self.unknown(ptr))?;
        let mut state = pool.lock();
        let allocation = state.raw.get_mut(&ptr).ok_or_else(|| self.unknown(ptr))?;
        if stream.core.id != pool.stream.id && !allocation.uses.iter().any(|used| used.id == stream.core.id) {
            allocation.uses.push(stream.core.clone());
        }
        Ok(())
    }

    /// Checks that `[ptr, ptr + len)` lies inside a live raw allocation. Outside checked mode only
    /// the allocation's start can be looked up; in checked mode any address inside it can, and a
    /// pointer a boundary released is reported with its step ([`Error::UseAfterRelease`]).
    pub fn check_range(&self, ptr: CUdeviceptr, len: u64) -> Result<()> {
        if !self.inner.checked {
            // Clone the pool out of the registry before locking it: the registry is always taken
            // after a pool's lock, never before.
            return match self.inner.raw.get(&ptr).map(|entry| entry.value().clone()) {
                Some(pool) => {
                    let size = pool.lock().raw.get(&ptr).map(|a| a.bytes).ok_or_else(|| self.unknown(ptr))?;
                    within(ptr, len, ptr, size)
                }
                None => Err(self.unknown(ptr)),
            };
        }
        let ranges = self.inner.raw_ranges.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((&base, &(size, _))) = ranges.range(..=ptr).next_back()
            && ptr < base + size
        {
            return within(ptr, len, base, size);
        }
        drop(ranges);
        Err(self.unknown(ptr))
    }

    fn unknown(&self, ptr: CUdeviceptr) -> Error {
        if self.inner.checked {
            let log = self.inner.released.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, _, phase, step)) = log.find(ptr) {
                let phase = self.phase_spec(phase).map(|spec| spec.name).unwrap_or_default();
                return Error::UseAfterRelease { ptr, phase, step };
            }
        }
        Error::UnknownPointer { ptr }
    }

    /// Begins a step driven by the raw API; returns its index.
    pub fn begin_step_raw(&self) -> Result<u64> {
        self.inner.begin_step(false)
    }

    /// Ends the step begun by [`Runtime::begin_step_raw`], releasing every raw allocation of its
    /// step- and micro-step-scoped phases. Ending a step twice is [`Error::NoActiveStep`]; a
    /// step owned by a [`Step`](crate::Step) guard is refused.
    ///
    /// # Safety
    ///
    /// No work enqueued after this call uses the released pointers.
    pub unsafe fn end_step_raw(&self) -> Result<StepReport> {
        self.inner.end_step(false)
    }

    /// Begins a micro-step of the active step; returns its index in the step.
    pub fn begin_micro_step_raw(&self) -> Result<u32> {
        self.inner.begin_micro_step(false).map(|(_, index)| index)
    }

    /// Ends the active micro-step, releasing every raw allocation of its micro-step-scoped phases.
    ///
    /// # Safety
    ///
    /// No work enqueued after this call uses the released pointers.
    pub unsafe fn end_micro_step_raw(&self) -> Result<MicroStepReport> {
        self.inner.end_micro_step(false)
    }

    /// The index of the active step, if any.
    pub fn active_step(&self) -> Option<u64> {
        self.inner.active_step()
    }
}

fn within(ptr: CUdeviceptr, len: u64, base: CUdeviceptr, size: u64) -> Result<()> {
    if ptr.checked_add(len).is_some_and(|end| end <= base + size) {
        Ok(())
    } else {
        Err(Error::OutOfBounds { ptr, len, base, size })
    }
}
