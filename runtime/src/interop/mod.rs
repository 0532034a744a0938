//! Interoperation with the frameworks steppool is embedded in.
//!
//! - [`route`] (always there): a guard that makes a phase's pool the device's current memory
//!   pool (`cuDeviceSetMemPool`), so that any code allocating with `cuMemAllocAsync` — cudarc,
//!   candle, burn's CUDA backend (cubecl), whatever cudarc version or linking it was built with —
//!   takes its memory from that phase without code changes.
//! - `cudarc` (feature `cudarc`): typed views of buffers for cudarc's launches and copies,
//!   steppool and cudarc streams over one `CUstream`, and the route guard under cudarc's names.
//!
//! Both assume that the runtime and the framework talk to the same driver in the same process:
//! on a GPU both load `libcuda`; on the simulated device the runtime must be built over the
//! libcuda stand-in (`sys/libcuda-sim`) opened by path with `CudaLibrary::open_path`. A runtime on
//! [`Driver::simulated`](steppool_sys::Driver::simulated) has a device of its own that no
//! framework can reach, and is refused with [`InteropError::NotShared`].

#[cfg(feature = "cudarc")]
pub mod cudarc;
pub mod route;

use steppool_sys::{Driver, DriverError, DriverKind};

/// Why a framework's object and a steppool one could not be paired, or a route could not be made
/// or ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InteropError {
    /// The runtime runs on a simulated device of its own, which no framework can reach.
    #[error(
        "the runtime runs on `{driver}`, which no framework can reach: build it over the libcuda that the \
         framework loads (a GPU, or sys/libcuda-sim opened with CudaLibrary::open_path)"
    )]
    NotShared {
        /// The runtime's driver, described.
        driver: String,
    },
    /// The cudarc context is not the steppool device's primary context.
    #[error(
        "cudarc's context {cudarc:#x} (device {cudarc_ordinal}) is not the primary context {steppool:#x} of \
         steppool's device {steppool_ordinal}"
    )]
    ContextMismatch {
        /// cudarc's `CUcontext`, as an address.
        cudarc: usize,
        /// The ordinal of cudarc's device.
        cudarc_ordinal: usize,
        /// steppool's `CUcontext`, as an address.
        steppool: usize,
        /// The ordinal of steppool's device.
        steppool_ordinal: usize,
    },
    /// A buffer's length is not a whole number of elements.
    #[error("a buffer of {bytes} bytes is not a whole number of {element}-byte elements")]
    Length {
        /// The buffer's length in bytes.
        bytes: u64,
        /// The element size in bytes.
        element: usize,
    },
    /// A buffer was paired with a stream other than the one it was allocated on.
    #[error("the buffer belongs to steppool stream {buffer}, not to the pair's stream {pair}")]
    WrongStream {
        /// The buffer's stream id.
        buffer: u32,
        /// The pair's stream id.
        pair: u32,
    },
    /// The device has no memory pools, so there is no pool to route to.
    #[error("device {device} has no memory pools: cuMemAllocAsync cannot be routed")]
    NoPools {
        /// The device ordinal.
        device: usize,
    },
    /// The device's current pool changed under a route guard (guards dropped out of order, or
    /// another party called `cuDeviceSetMemPool`): the guard left it as it found it.
    #[error("device {device}'s current pool is {found:#x}, not the routed pool {routed:#x}: left as found")]
    RouteChanged {
        /// The device ordinal.
        device: usize,
        /// The pool the guard set.
        routed: usize,
        /// The pool found at the restore.
        found: usize,
    },
    /// A runtime call failed.
    #[error(transparent)]
    Runtime(#[from] crate::Error),
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A cudarc call failed.
    #[cfg(feature = "cudarc")]
    #[error("cudarc: {0}")]
    Cudarc(#[from] ::cudarc::driver::DriverError),
}

/// Refuses a driver that only this runtime can reach.
pub(crate) fn shared(driver: &Driver) -> Result<(), InteropError> {
    match driver.kind() {
        DriverKind::Cuda => Ok(()),
        DriverKind::Simulated => Err(InteropError::NotShared { driver: driver.describe() }),
    }
}
