//! Routing a framework's allocations into a phase: while a [`RouteGuard`] is alive, the pool of
//! one (phase, stream) is the device's current memory pool (`cuDeviceSetMemPool`), so every
//! `cuMemAllocAsync` on that device takes its memory from it. This needs nothing of the framework
//! but that it allocates with `cuMemAllocAsync` through the same `libcuda`: cudarc's
//! `CudaStream::alloc*` (and so candle's CUDA device), and cubecl-cuda's storage (burn's CUDA
//! backend) do, whatever cudarc version or linking feature they were built with.
//!
//! ```no_run
//! use steppool::interop::route::route_allocations;
//! use steppool::{Phase, Runtime};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = Runtime::new()?; // the GPU's libcuda, which the framework loads too
//! let stream = runtime.device(0)?.create_stream()?;
//! let step = runtime.begin_step()?;
//! {
//!     let _route = route_allocations(&runtime, Phase::ACTIVATIONS, &stream)?;
//!     // ... the framework's forward and backward pass: its cuMemAllocAsync lands in activations
//! }
//! println!("{}", step.end()?);
//! # Ok(()) }
//! ```
//!
//! # Who owns routed memory
//!
//! The framework does. It frees its allocations itself (`cuMemFreeAsync`, back into the pool
//! they came from, wherever the route points by then), and a step end releases only what
//! steppool handed out, so nothing is freed twice and a routed allocation that outlives its step
//! stays valid. What a step end does to a routed step-scoped pool is trim it by its phase's
//! policy: memory the framework freed goes back to the device, what it still holds stays.
//! Drop a step's routed allocations (or ask the framework to free its cached memory) before
//! the step ends, or the pool keeps them until they are freed.
//!
//! # What the reports count
//!
//! A pool's `reserved` and its peaks come from the driver's counters, so they include routed
//! memory; its `used`, `allocations` and `frees` count only what steppool handed out. The
//! driver's own `used` of a routed pool is [`RouteGuard::counters`].

use std::fmt;
use std::marker::PhantomData;

use steppool_sys::{CUdevice, CUmemoryPool, Driver, PoolCounters};

use super::{InteropError, shared};
use crate::phase::Phase;
use crate::runtime::Runtime;
use crate::stream::Stream;

/// While alive, the device's current memory pool is the pool of one (phase, stream):
/// `cuMemAllocAsync` on that device (cudarc's `CudaStream::alloc`, `alloc_zeros` and
/// `clone_htod`, candle's tensors, cubecl's pages) takes memory from it. Dropping it restores the
/// pool it found. See the [module docs](self) for who owns routed memory.
///
/// The current pool is per device, for every thread and stream: while a guard is alive, every
/// `cuMemAllocAsync` on the device lands in its pool. Guards nest; drop them in reverse order.
#[must_use = "the route ends when the guard is dropped"]
pub struct RouteGuard<'r> {
    driver: Driver,
    device: CUdevice,
    ordinal: usize,
    routed: CUmemoryPool,
    previous: CUmemoryPool,
    ended: bool,
    // Keeps the routed pool alive: it belongs to the stream and goes with it.
    _stream: Stream,
    _runtime: PhantomData<&'r Runtime>,
}

impl fmt::Debug for RouteGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteGuard")
            .field("device", &self.ordinal)
            .field("routed", &self.routed)
            .field("previous", &self.previous)
            .finish()
    }
}

/// Makes `phase`'s pool on `stream` the current pool of `stream`'s device until the returned
/// guard is dropped (`cuDeviceSetMemPool`), so that `cuMemAllocAsync` on that device, a
/// framework's included, allocates in that phase.
///
/// # Errors
///
/// [`InteropError::NotShared`] for a runtime on a simulated device of its own,
/// [`InteropError::NoPools`] for a device without memory pools, and the runtime's or the
/// driver's errors.
pub fn route_allocations<'r>(
    runtime: &'r Runtime,
    phase: Phase,
    stream: &Stream,
) -> Result<RouteGuard<'r>, InteropError> {
    let driver = runtime.driver().clone();
    shared(&driver)?;
    let ordinal = stream.device_ordinal();
    let routed = runtime.pool_handle(phase, stream)?.ok_or(InteropError::NoPools { device: ordinal })?;
    let device = driver.device(ordinal)?;
    let previous = driver.device_mem_pool(device)?;
    // SAFETY: `routed` is a live pool of this driver, kept alive by the guard's clone of its
    // stream; `device` came from this driver.
    unsafe { driver.device_set_mem_pool(device, routed) }?;
    Ok(RouteGuard {
        driver,
        device,
        ordinal,
        routed,
        previous,
        ended: false,
        _stream: stream.clone(),
        _runtime: PhantomData,
    })
}

impl RouteGuard<'_> {
    /// The pool allocations are routed to.
    pub fn pool(&self) -> CUmemoryPool {
        self.routed
    }

    /// The routed pool's counters as the driver keeps them: unlike a step report's `used`, they
    /// include the framework's allocations.
    pub fn counters(&self) -> Result<PoolCounters, InteropError> {
        // SAFETY: the routed pool is live while the guard keeps its stream.
        Ok(unsafe { self.driver.mem_pool_counters(self.routed) }?)
    }

    /// Ends the route, saying whether the previous pool could be restored (it is not when the
    /// device's current pool is no longer this guard's: [`InteropError::RouteChanged`]).
    pub fn end(mut self) -> Result<(), InteropError> {
        self.ended = true;
        self.restore()
    }

    fn restore(&self) -> Result<(), InteropError> {
        let found = self.driver.device_mem_pool(self.device)?;
        if found != self.routed {
            return Err(InteropError::RouteChanged {
                device: self.ordinal,
                routed: self.routed as usize,
                found: found as usize,
            });
        }
        // SAFETY: `previous` was the device's current pool when the guard was made: the device's
        // default pool or a pool its owner keeps alive while it is current.
        unsafe { self.driver.device_set_mem_pool(self.device, self.previous) }?;
        Ok(())
    }
}

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let Err(error) = self.restore() {
            tracing::warn!(target: "steppool::interop", "ending a route: {error}");
        }
    }
}
