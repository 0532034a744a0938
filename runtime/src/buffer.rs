//! Buffers: owned device allocations, freed in stream order on drop.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

use steppool_sys::CUdeviceptr;

use crate::error::Result;
use crate::phase::Phase;
use crate::pool::PhasePool;
use crate::strategy::Served;
use crate::stream::Stream;
use crate::stream_core::StreamCore;

/// A device allocation of one phase on one stream.
///
/// The lifetime ties a step-scoped buffer to its [`Step`](crate::Step) (or
/// [`MicroStep`](crate::MicroStep)), so it cannot be used after the step ended; persistent
/// buffers are `Buffer<'static>`. Dropping a buffer frees it in the order of its stream: work
/// already enqueued there may still use it, later work on other streams may not, unless
/// recorded with [`Buffer::record_use`].
pub struct Buffer<'a> {
    ptr: CUdeviceptr,
    /// Where the pool's strategy filed it ([`Served::slot`]), for its free.
    slot: u32,
    /// Its size as requested; 0 once [`Buffer::free`] has freed it (no buffer is empty).
    bytes: u64,
    pool: PoolRef<'a>,
    /// The other streams recorded with [`Buffer::record_use`]; behind one thin pointer, since few
    /// buffers have any, so that the buffer every allocation returns stays small.
    #[allow(clippy::box_collection, reason = "a thin pointer where a vector is three words")]
    uses: Option<Box<Vec<Arc<StreamCore>>>>,
    _scope: PhantomData<&'a ()>,
}

impl fmt::Debug for Buffer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("phase", &self.pool.spec().name)
            .field("stream", &self.pool.stream.id)
            .finish()
    }
}

/// The pool a buffer frees into.
pub(crate) enum PoolRef<'a> {
    /// A persistent buffer's, or one on a wrapped stream: it keeps the pool alive (the stream
    /// may go first).
    Owned(Arc<PhasePool>),
    /// A step's (or micro-step's) buffer's: the runtime keeps the pool alive until the step ends
    /// ([`StepPools`](crate::pool::StepPools)), which the buffer's borrow of the step outlasts,
    /// so no reference is counted per buffer.
    Step(&'a PhasePool),
}

impl Deref for PoolRef<'_> {
    type Target = PhasePool;

    #[inline]
    fn deref(&self) -> &PhasePool {
        match self {
            PoolRef::Owned(pool) => pool,
            PoolRef::Step(pool) => pool,
        }
    }
}

impl<'a> Buffer<'a> {
    pub(crate) fn new(served: Served, bytes: u64, pool: PoolRef<'a>) -> Self {
        Self { ptr: served.ptr, slot: served.slot, bytes, pool, uses: None, _scope: PhantomData }
    }

    /// The other streams recorded as using it.
    fn uses(&self) -> &[Arc<StreamCore>] {
        self.uses.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The allocation as the pool's strategy handed it out.
    fn served(&self) -> Served {
        Served { ptr: self.ptr, slot: self.slot }
    }

    /// The device pointer.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Its size in bytes, as requested.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Always `false`: buffers are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Its phase.
    pub fn phase(&self) -> Phase {
        self.pool.phase()
    }

    /// The id of the stream it was allocated on, whose order frees it.
    pub fn stream_id(&self) -> u32 {
        self.pool.stream.id
    }

    /// The ordinal of its device.
    pub fn device_ordinal(&self) -> usize {
        self.pool.device_ordinal()
    }

    /// Records that work on `stream` uses the buffer: its free (or its memory's reuse at the
    /// boundary) will wait for the work enqueued on `stream` up to the free. The role of
    /// PyTorch's `record_stream`.
    pub fn record_use(&mut self, stream: &Stream) {
        let core = &stream.core;
        if core.id != self.pool.stream.id && !self.uses().iter().any(|used| used.id == core.id) {
            self.uses.get_or_insert_default().push(core.clone());
            self.pool.lock().note_use(core);
        }
    }

    /// Sets every byte to `value`, in the buffer's stream order (`cuMemsetD8Async`).
    pub fn fill(&self, value: u8) -> Result<()> {
        let stream = &self.pool.stream;
        stream.prepare()?;
        // SAFETY: the range is this live allocation, on the stream it was allocated on.
        unsafe { stream.device.driver.memset_d8_async(self.ptr, value, self.bytes as usize, stream.raw()) }?;
        Ok(())
    }

    /// Frees the buffer now, returning an error instead of keeping it for
    /// [`Runtime::take_errors`](crate::Runtime::take_errors).
    pub fn free(mut self) -> Result<()> {
        let bytes = std::mem::replace(&mut self.bytes, 0);
        self.pool.lock().free(self.served(), bytes, self.uses())
    }
}

impl Drop for Buffer<'_> {
    fn drop(&mut self) {
        if self.bytes != 0 {
            self.pool.free_or_record(self.served(), self.bytes, self.uses());
        }
    }
}
