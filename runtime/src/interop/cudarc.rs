//! steppool inside programs built on [cudarc](https://crates.io/crates/cudarc)'s driver API
//! (feature `cudarc`): typed views of steppool buffers that cudarc's launches and copies accept,
//! steppool and cudarc streams over one `CUstream`, and a guard that routes cudarc's own
//! allocations (`cuMemAllocAsync`) into a phase's pool.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use steppool::interop::cudarc::{StreamPair, route_allocations};
//! use steppool::{Phase, Runtime};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = Runtime::new()?; // the GPU's libcuda, which cudarc loads too
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.new_stream()?;
//! // SAFETY: `pair` outlives every buffer allocated on its steppool half.
//! let pair = unsafe { StreamPair::from_cudarc(&runtime.device(0)?, &stream)? };
//! let step = runtime.begin_step()?;
//! let mut activations = pair.view::<f32>(step.alloc(Phase::ACTIVATIONS, 4 << 20, pair.steppool())?)?;
//! stream.memset_zeros(&mut activations)?; // cudarc's own calls take the view
//! {
//!     let _route = route_allocations(&runtime, Phase::WORKSPACE, pair.steppool())?;
//!     let scratch = stream.alloc_zeros::<f32>(1 << 20)?; // from the workspace phase's pool
//! }
//! drop(activations);
//! println!("{}", step.end()?);
//! # Ok(()) }
//! ```
//!
//! # One driver
//!
//! Everything here assumes that the runtime and cudarc talk to the same driver in the same
//! process, so that contexts, streams, pools and pointers mean the same to both: on a GPU, both
//! load `libcuda`; on the simulated device, the runtime must be built over the libcuda stand-in
//! (`sys/libcuda-sim`), opened by path with `CudaLibrary::open_path` and given to
//! [`Runtime::with_driver`](crate::Runtime::with_driver) before cudarc's first call, which then
//! finds the same library by its soname. A runtime on [`Driver::simulated`](steppool_sys::Driver::simulated) has a device of its
//! own that cudarc cannot reach: [`StreamPair`] and [`route_allocations`] refuse it with
//! [`InteropError::NotShared`].
//!
//! # Lifetime rules
//!
//! - **Views borrow the step.** A [`CudaBuffer`] owns a steppool [`Buffer`] and keeps its
//!   lifetime, so a view of a step's buffer cannot outlive the step: ending the step while a view
//!   is alive does not compile. Dropping the view frees the buffer through steppool, once.
//!
//!   ```compile_fail,E0505
//!   # use steppool::{Phase, Runtime};
//!   # use steppool::interop::cudarc::StreamPair;
//!   # fn f(runtime: &Runtime, pair: &StreamPair) -> Result<(), Box<dyn std::error::Error>> {
//!   let step = runtime.begin_step()?;
//!   let view = pair.view::<f32>(step.alloc(Phase::ACTIVATIONS, 4096, pair.steppool())?)?;
//!   step.end()?; // refused: `view` still borrows the step
//!   drop(view);
//!   # Ok(()) }
//!   ```
//! - **steppool memory is never owned by a `CudaSlice`.** An owning `CudaSlice` frees its memory
//!   on drop; if it held a steppool pointer, the step end (or the buffer's drop) would free it a
//!   second time. Views therefore implement cudarc's [`DevicePtr`] and [`DevicePtrMut`] instead of
//!   being slices. An API that insists on `&CudaSlice` gets one from
//!   [`CudaBuffer::with_slice`], which lends a slice for the length of a closure and then leaks
//!   it (on a panic as well): the slice never frees. Never call `upgrade_device_ptr` on a
//!   steppool pointer yourself.
//! - **Routed allocations belong to cudarc.** Under a [`RouteGuard`] (from
//!   [`interop::route`](super::route), re-exported here), `CudaStream::alloc*` takes memory from
//!   the phase's pool, but the `CudaSlice` owns it and frees it on drop (`cuMemFreeAsync`, back
//!   into the same pool). A step end releases only what steppool handed out, so it never frees a
//!   routed allocation: there is no double free, and a routed slice that outlives its step stays
//!   valid. Its memory is simply not released at the step end; drop routed slices of
//!   step-scoped phases before the step ends, or the pool holds them (its `reserved` in the step
//!   report shows it) until they are dropped.
//! - **Streams outlive their pair's other half.** [`StreamPair::from_cudarc`] and
//!   [`StreamPair::from_steppool`] wrap a stream owned by the other library without taking
//!   ownership of the `CUstream`; the pair keeps the owner alive, but clones taken out of it must
//!   not outlive it (their `# Safety` sections).
//!
//! # Build
//!
//! The feature depends on cudarc 0.19 with `driver`, `dynamic-loading` and `cuda-12090`: no CUDA
//! toolkit is needed to build, and `libcuda` is loaded at run time. A program whose cudarc 0.19
//! enables another linking feature (candle 0.11's CUDA device enables `dynamic-linking`) gets
//! cargo's feature union, which cudarc's build script refuses: such a program leaves this feature
//! off and routes with [`interop::route`](super::route), which needs no cudarc at all.

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};

use crate::buffer::Buffer;
use crate::device::Device;
use crate::stream::Stream;

pub use super::InteropError;
use super::shared;
// The route guard is not cudarc's own: it serves any framework that allocates with
// `cuMemAllocAsync`, and lives in `interop::route`, which needs no feature.
pub use super::route::{RouteGuard, route_allocations};

fn same_context(device: &Device, ctx: &CudaContext) -> Result<(), InteropError> {
    let (cudarc, steppool) = (ctx.cu_ctx() as usize, device.raw_context() as usize);
    if cudarc == steppool && ctx.ordinal() == device.ordinal() {
        Ok(())
    } else {
        Err(InteropError::ContextMismatch {
            cudarc,
            cudarc_ordinal: ctx.ordinal(),
            steppool,
            steppool_ordinal: device.ordinal(),
        })
    }
}

/// A steppool [`Stream`] and a cudarc [`CudaStream`] over the same `CUstream` in the same
/// (primary) context. Cheap to clone.
#[derive(Clone)]
pub struct StreamPair {
    steppool: Stream,
    cudarc: Arc<CudaStream>,
}

impl fmt::Debug for StreamPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamPair")
            .field("steppool", &self.steppool)
            .field("cu_stream", &self.cudarc.cu_stream())
            .finish()
    }
}

impl StreamPair {
    /// A steppool stream over cudarc's `stream`, which the pair keeps alive.
    ///
    /// # Errors
    ///
    /// [`InteropError::NotShared`] for a runtime on its own simulated device,
    /// [`InteropError::ContextMismatch`] when `stream`'s context is not `device`'s primary one.
    ///
    /// # Safety
    ///
    /// The steppool half (`self.steppool()`), its clones and every buffer allocated on it must not
    /// outlive every clone of this pair: they use the `CUstream` that cudarc owns, which the pair
    /// keeps alive.
    pub unsafe fn from_cudarc(device: &Device, stream: &Arc<CudaStream>) -> Result<Self, InteropError> {
        shared(&device.runtime.driver)?;
        same_context(device, stream.context())?;
        // SAFETY: the stream is live (the pair holds its `Arc`), belongs to this device's primary
        // context (checked above) and outlives the steppool stream by the caller's contract.
        let steppool = unsafe { device.wrap_stream(stream.cu_stream() as steppool_sys::CUstream) }?;
        Ok(Self { steppool, cudarc: stream.clone() })
    }

    /// A cudarc stream over steppool's `stream`, borrowed: cudarc never destroys it.
    ///
    /// # Errors
    ///
    /// As [`StreamPair::from_cudarc`].
    ///
    /// # Safety
    ///
    /// The cudarc half (`self.cudarc()`) and every clone of its `Arc` (cudarc slices and views
    /// keep one) must not outlive every clone of this pair, which keeps `stream` alive.
    pub unsafe fn from_steppool(
        device: &Device,
        ctx: &Arc<CudaContext>,
        stream: &Stream,
    ) -> Result<Self, InteropError> {
        shared(&device.runtime.driver)?;
        same_context(device, ctx)?;
        // SAFETY: `stream` is a live stream of this context (checked above), kept alive by the
        // pair's clone of it; the caller keeps the cudarc half within the pair's life.
        let cudarc = unsafe { ctx.wrap_borrowed_stream(stream.raw() as cudarc::driver::sys::CUstream) };
        Ok(Self { steppool: stream.clone(), cudarc })
    }

    /// The steppool half.
    pub fn steppool(&self) -> &Stream {
        &self.steppool
    }

    /// The cudarc half.
    pub fn cudarc(&self) -> &Arc<CudaStream> {
        &self.cudarc
    }

    /// A typed view of `buffer`, which must have been allocated on this pair's stream.
    pub fn view<'a, T: DeviceRepr>(&self, buffer: Buffer<'a>) -> Result<CudaBuffer<'a, T>, InteropError> {
        CudaBuffer::new(buffer, self)
    }
}

/// A steppool [`Buffer`] seen by cudarc as `len` elements of `T`: it implements [`DevicePtr`]
/// and [`DevicePtrMut`], so `memcpy_htod`, `memcpy_dtoh`, `memset_zeros` and `launch_builder`'s
/// `arg` accept it.
///
/// It owns the buffer and keeps its lifetime: a view of a step's buffer borrows the step, and
/// dropping the view frees the buffer through steppool. Work on its own stream needs nothing
/// more; work on another cudarc stream first waits for the buffer's stream, and that stream is
/// synchronized once the work is enqueued, so the buffer's free (in its own stream's order)
/// never overtakes it.
pub struct CudaBuffer<'a, T> {
    buffer: Buffer<'a>,
    stream: Arc<CudaStream>,
    len: usize,
    _element: PhantomData<T>,
}

impl<T> fmt::Debug for CudaBuffer<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer").field("buffer", &self.buffer).field("len", &self.len).finish()
    }
}

impl<'a, T: DeviceRepr> CudaBuffer<'a, T> {
    /// A view of `buffer` on `pair`'s stream, which must be the stream it was allocated on.
    pub fn new(buffer: Buffer<'a>, pair: &StreamPair) -> Result<Self, InteropError> {
        let element = std::mem::size_of::<T>().max(1);
        if !buffer.len().is_multiple_of(element as u64) {
            return Err(InteropError::Length { bytes: buffer.len(), element });
        }
        if buffer.stream_id() != pair.steppool.id() {
            return Err(InteropError::WrongStream { buffer: buffer.stream_id(), pair: pair.steppool.id() });
        }
        let len = (buffer.len() / element as u64) as usize;
        Ok(Self { buffer, stream: pair.cudarc.clone(), len, _element: PhantomData })
    }

    /// The steppool buffer.
    pub fn buffer(&self) -> &Buffer<'a> {
        &self.buffer
    }

    /// The buffer back, ending the view.
    pub fn into_buffer(self) -> Buffer<'a> {
        self.buffer
    }

    /// Lends the memory to `f` as a `CudaSlice`, for APIs that take `&CudaSlice` or
    /// `&mut CudaSlice`, and leaks that slice when `f` returns or panics, so it never frees
    /// steppool's memory. `f` cannot keep it: it gets a reference.
    pub fn with_slice<R>(&mut self, f: impl FnOnce(&mut CudaSlice<T>) -> R) -> R {
        /// Leaks the slice on drop, so a panic in `f` does not free the memory either.
        struct Lent<T>(ManuallyDrop<CudaSlice<T>>);
        impl<T> Drop for Lent<T> {
            fn drop(&mut self) {
                // SAFETY: taken once, here, and never used again.
                let slice = unsafe { ManuallyDrop::take(&mut self.0) };
                slice.leak();
            }
        }
        // SAFETY: the pointer is a live allocation of at least `len * size_of::<T>()` bytes (the
        // buffer, which `&mut self` keeps alive and unshared); the slice is leaked, never freed.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(self.buffer.ptr(), self.len) };
        let mut lent = Lent(ManuallyDrop::new(slice));
        f(&mut lent.0)
    }

    /// Makes `stream` ready for this buffer's memory: orders it after the buffer's own stream,
    /// and, if it is another stream, synchronizes it once the work using the memory is enqueued.
    fn use_on<'s>(&'s self, stream: &'s CudaStream) -> SyncOnDrop<'s> {
        if stream.cu_stream() == self.stream.cu_stream() {
            return SyncOnDrop::Sync(None);
        }
        stream.context().record_err(stream.join(&self.stream));
        SyncOnDrop::sync_stream(stream)
    }
}

impl<T> DeviceSlice<T> for CudaBuffer<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T: DeviceRepr> DevicePtr<T> for CudaBuffer<'_, T> {
    fn device_ptr<'s>(&'s self, stream: &'s CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'s>) {
        (self.buffer.ptr(), self.use_on(stream))
    }
}

impl<T: DeviceRepr> DevicePtrMut<T> for CudaBuffer<'_, T> {
    fn device_ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'s>) {
        (self.buffer.ptr(), self.use_on(stream))
    }
}
