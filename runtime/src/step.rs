//! Steps and micro-steps: the boundaries at which step-scoped memory is released at once.
//!
//! A buffer of a step borrows the [`Step`]; [`Step::end`] takes the step by value, so a buffer
//! used after its step ended does not compile. The same holds for micro-steps. Ending releases
//! every allocation still live in the scope's phases (those made through the raw API), in stream
//! order, under the locks of all the pools concerned: another thread sees the step before or
//! after, never half released.

use std::fmt;
use std::sync::Arc;

use crate::buffer::{Buffer, PoolRef};
use crate::error::Result;
use crate::inner::{Caller, RuntimeInner};
use crate::phase::Phase;
use crate::pool::PhasePool;
use crate::report::{MicroStepReport, StepReport};
use crate::stream::Stream;

/// An active step of a [`Runtime`](crate::Runtime). `Send + Sync`: threads may allocate from it
/// at once (scoped threads borrow it). Dropping it without [`Step::end`] ends it, keeping any
/// error for [`Runtime::take_errors`](crate::Runtime::take_errors).
pub struct Step {
    runtime: Arc<RuntimeInner>,
    index: u64,
    ended: bool,
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Step({})", self.index)
    }
}

impl Step {
    pub(crate) fn new(runtime: Arc<RuntimeInner>, index: u64) -> Self {
        Self { runtime, index, ended: false }
    }

    /// The step's index, from 0.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// The runtime the step belongs to (for `capture.rs`).
    pub(crate) fn runtime(&self) -> &Arc<RuntimeInner> {
        &self.runtime
    }

    /// Allocates `bytes` of a step-scoped phase on `stream`. The buffer borrows the step; freed
    /// in stream order on drop, and reusable within the step.
    #[inline(always)]
    pub fn alloc(&self, phase: Phase, bytes: u64, stream: &Stream) -> Result<Buffer<'_>> {
        let (pool, served) = self.runtime.allocate(phase, bytes, &stream.core, &stream.pools, Caller::Step)?;
        Ok(Buffer::new(served, bytes, self.borrow_pool(pool)))
    }

    /// The pool of a buffer of this step: held by the runtime until the step ends
    /// ([`StepPools`](crate::pool::StepPools)), borrowed by the buffer for as long as it borrows
    /// the step. On a wrapped stream the buffer holds its pool as a persistent one does: the
    /// caller may destroy such a stream once the wrapper, its clones and its buffers are gone,
    /// and a pool kept to the step's end would still use it.
    #[inline]
    fn borrow_pool(&self, pool: &Arc<PhasePool>) -> PoolRef<'_> {
        if !pool.stream.is_owned() {
            return PoolRef::Owned(pool.clone());
        }
        self.runtime.step_pools.keep(pool, self.index);
        // SAFETY: `step_pools` holds a reference to the pool until this step ends, and the step
        // ends only in `Step::end` (which takes the step by value) or `Step::drop` (the raw API
        // may not end a guard's step): both after every borrow of the step, hence every buffer
        // with this lifetime, is gone. So the pool outlives the reference.
        PoolRef::Step(unsafe { &*Arc::as_ptr(pool) })
    }

    /// Begins a micro-step (one micro-batch of gradient accumulation).
    pub fn begin_micro_step(&self) -> Result<MicroStep<'_>> {
        let (_, index) = self.runtime.begin_micro_step(true)?;
        Ok(MicroStep { step: self, index, ended: false })
    }

    /// Ends the step: releases everything still live in its step-scoped phases at once, applies
    /// the trim policies, and reports.
    pub fn end(mut self) -> Result<StepReport> {
        self.ended = true;
        self.runtime.end_step(true)
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        if !self.ended
            && let Err(error) = self.runtime.end_step(true)
        {
            self.runtime.errors.record(error);
        }
    }
}

/// An active micro-step of a [`Step`]. Dropping it without [`MicroStep::end`] ends it.
pub struct MicroStep<'s> {
    step: &'s Step,
    index: u32,
    ended: bool,
}

impl fmt::Debug for MicroStep<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MicroStep({}.{})", self.step.index, self.index)
    }
}

impl<'s> MicroStep<'s> {
    /// The micro-step's index in its step, from 0.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The step it belongs to.
    pub fn step(&self) -> &'s Step {
        self.step
    }

    /// Allocates `bytes` of a micro-step-scoped (or step-scoped) phase on `stream`. The buffer
    /// borrows the micro-step.
    #[inline(always)]
    pub fn alloc(&self, phase: Phase, bytes: u64, stream: &Stream) -> Result<Buffer<'_>> {
        let (pool, served) =
            self.step.runtime.allocate(phase, bytes, &stream.core, &stream.pools, Caller::MicroStep)?;
        Ok(Buffer::new(served, bytes, self.step.borrow_pool(pool)))
    }

    /// Ends the micro-step: releases everything still live in its micro-step-scoped phases.
    pub fn end(mut self) -> Result<MicroStepReport> {
        self.ended = true;
        self.step.runtime.end_micro_step(true)
    }
}

impl Drop for MicroStep<'_> {
    fn drop(&mut self) {
        if !self.ended
            && let Err(error) = self.step.runtime.end_micro_step(true)
        {
            self.step.runtime.errors.record(error);
        }
    }
}
