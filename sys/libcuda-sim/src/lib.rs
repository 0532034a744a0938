//! `libcuda` from the simulated device: a shared library exporting the CUDA driver's C entry
//! points, each answered by one process-wide [`SimLibrary`], so that programs which load the
//! driver by name (cudarc, or C code) run on steppool's simulated device.
//!
//! # What it answers
//!
//! Every entry point the simulated device models (the list is
//! [`steppool_sys::sim_entry_points!`]): initialization, devices, the primary context, streams,
//! events, memory pools, virtual memory management (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`, ...), `cuMemAlloc*`/`cuMemFree*`, memset, host/device copies,
//! modules and launches, stream capture and graphs (the model's, checked on an H200), with the
//! codes the real driver returns. Device memory is backed by host memory
//! (unless `STEPPOOL_SIM_HOST_MEMORY=0`; unlike `Driver::simulated`, where it is off by default),
//! so copies read back what was written and the repository's fill kernels
//! (`steppool_sys::kernels`) run at launch; other kernels are checked and ordered, not
//! run. Entry points cudarc's safe layer may call but the model does not cover (UUIDs, graph upload,
//! managed and pinned host memory, occupancy, external memory, peer copies, priorities,
//! non-primary contexts) are exported and return `CUDA_ERROR_NOT_SUPPORTED`, so a caller gets a
//! code instead of a missing symbol.
//!
//! # Configuration
//!
//! Read once, at the first call, from the environment: `STEPPOOL_SIM_DEVICES` (for example
//! `2x16GiB`), `STEPPOOL_SIM_GRANULE`, `STEPPOOL_SIM_VMM` (virtual memory management, on unless
//! `0`, as a GPU has it), `STEPPOOL_SIM_HOST_MEMORY` and `STEPPOOL_SIM_FAULTS` (see
//! [`SimConfig::from_env`]). A configuration that does not parse is said once on stderr, and then
//! every entry point but the error-text ones returns `CUDA_ERROR_NOT_INITIALIZED`.
//!
//! # One device per process
//!
//! The simulated device is a process-wide static: every opening of this file in one process
//! (by path through `steppool_sys::CudaLibrary::open_path`, or by the name `libcuda.so`, its
//! soname, once it is loaded) reaches the same handles, pools and memory. That is how a steppool
//! runtime over this library and cudarc share one device.
//!
//! # Checking it
//!
//! `tests/cudarc.rs` drives it with cudarc. Any device test of the workspace also runs through it
//! when it is given as the real driver, which checks the C ABI against the same expectations as
//! the simulated device behind [`Driver`](steppool_sys::Driver):
//!
//! ```text
//! STEPPOOL_DEVICE=cuda STEPPOOL_CUDA_LIBRARY=$PWD/target/debug/deps/libsteppool_libcuda_sim.so \
//!     cargo test -p steppool-tests --test conformance --test runtime
//! ```
//!
//! # Safety at the boundary
//!
//! No panic crosses the C ABI: each entry point runs inside `catch_unwind`, and a panic becomes
//! `CUDA_ERROR_UNKNOWN`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use steppool_sys::CUresult;
use steppool_sys::sim::{SimConfig, SimLibrary};

/// The variable that turns host-backed memory off (`0`); on by default in this library.
const HOST_MEMORY_VARIABLE: &str = "STEPPOOL_SIM_HOST_MEMORY";

/// The process-wide simulated driver, or why its configuration was refused.
static LIBRARY: OnceLock<Result<SimLibrary, String>> = OnceLock::new();

/// A default simulated driver that answers `cuGetErrorName` and `cuGetErrorString` when the
/// configured one could not be made; it serves nothing else.
static ERROR_TEXT: OnceLock<Result<SimLibrary, String>> = OnceLock::new();

fn library() -> Result<&'static SimLibrary, CUresult> {
    let library = LIBRARY.get_or_init(|| {
        let config = SimConfig::from_env().map(|mut config| {
            // Programs that load a driver expect copies to read back what they wrote: memory is
            // host-backed unless `STEPPOOL_SIM_HOST_MEMORY=0` says otherwise (pages cost nothing
            // until written, so large capacities stay cheap).
            if std::env::var_os(HOST_MEMORY_VARIABLE).is_none() {
                config.host_memory = true;
            }
            config
        });
        config.and_then(SimLibrary::new).map_err(|error| {
            eprintln!("steppool libcuda-sim: {error}; every call returns CUDA_ERROR_NOT_INITIALIZED");
            error.to_string()
        })
    });
    library.as_ref().map_err(|_| CUresult::CUDA_ERROR_NOT_INITIALIZED)
}

/// The driver that answers the error-text entry points: the configured one, or a default one.
fn error_text_library() -> Result<&'static SimLibrary, CUresult> {
    library().or_else(|_| {
        let fallback = ERROR_TEXT.get_or_init(|| SimLibrary::new(SimConfig::default()).map_err(|e| e.to_string()));
        fallback.as_ref().map_err(|_| CUresult::CUDA_ERROR_NOT_INITIALIZED)
    })
}

/// Runs one entry point with panics caught: a panic is `CUDA_ERROR_UNKNOWN`, never an unwind
/// into the caller's frames.
fn guard(call: impl FnOnce() -> Result<CUresult, CUresult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(Ok(code) | Err(code)) => code,
        Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
    }
}

macro_rules! export {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {$(
        #[doc = concat!("`", stringify!($name), "`, answered by the simulated device.")]
        ///
        /// # Safety
        ///
        /// The contract of the driver function of the same name: pointer arguments are null or
        /// valid for the reads and writes it documents. Handles may be anything; invalid ones are
        /// refused with the driver's error code.
        #[unsafe(no_mangle)]
        #[allow(non_snake_case, clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| {
                let library = export!(@library $name)?;
                // SAFETY: the caller's contract is the entry point's, forwarded unchanged.
                Ok(unsafe { library.$name($($arg),*) })
            })
        }
    )*};
    (@library cuGetErrorName) => { error_text_library() };
    (@library cuGetErrorString) => { error_text_library() };
    (@library $name:ident) => { library() };
}

steppool_sys::sim_entry_points!(export);

macro_rules! not_supported {
    ($($name:ident)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not modelled by the simulated device; returns `CUDA_ERROR_NOT_SUPPORTED`.")]
        ///
        /// It reads none of its arguments. In the C calling convention the caller owns the
        /// argument area, so a callee that reads nothing is sound whatever the caller passed.
        #[unsafe(no_mangle)]
        pub extern "C" fn $name() -> CUresult {
            CUresult::CUDA_ERROR_NOT_SUPPORTED
        }
    )*};
}

not_supported! {
    cuCtxCreate_v3 cuCtxCreate_v4 cuCtxDestroy_v2 cuCtxGetCacheConfig cuCtxSetCacheConfig
    cuCtxGetLimit cuCtxSetLimit cuCtxSetFlags cuCtxGetStreamPriorityRange cuStreamCreateWithPriority
    cuDeviceGetUuid cuDeviceGetUuid_v2 cuEventElapsedTime_v2
    cuFuncGetAttribute cuFuncSetAttribute cuFuncSetCacheConfig cuModuleLoad cuModuleGetGlobal_v2
    cuLaunchCooperativeKernel cuLaunchHostFunc
    cuOccupancyAvailableDynamicSMemPerBlock cuOccupancyMaxActiveBlocksPerMultiprocessor
    cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags cuOccupancyMaxPotentialBlockSize
    cuOccupancyMaxPotentialBlockSizeWithFlags cuOccupancyMaxActiveClusters cuOccupancyMaxPotentialClusterSize
    cuMemAllocManaged cuMemHostAlloc cuMemFreeHost cuMemAdvise_v2 cuMemPrefetchAsync_v2 cuStreamAttachMemAsync
    cuMemcpyPeerAsync cuImportExternalMemory cuExternalMemoryGetMappedBuffer cuDestroyExternalMemory
    cuGraphUpload
}

#[cfg(test)]
mod tests {
    use std::ffi::{CStr, c_char, c_int};

    use steppool_sys::{CUcontext, CUdevice, CUdeviceptr, CUresult};

    use super::*;

    #[test]
    fn entry_points_answer_through_the_c_abi() {
        let mut count: c_int = 0;
        let mut device: CUdevice = -1;
        let mut ctx: CUcontext = std::ptr::null_mut();
        let mut ptr: CUdeviceptr = 0;
        let data = [7u8; 64];
        let mut back = [0u8; 64];
        // SAFETY: every out-pointer is a live local of the written type; the context, device and
        // pointer passed back in were produced by the calls before them.
        unsafe {
            assert_eq!(cuInit(0), CUresult::CUDA_SUCCESS);
            assert_eq!(cuDeviceGetCount(&mut count), CUresult::CUDA_SUCCESS);
            assert!(count >= 1);
            assert_eq!(cuDeviceGet(&mut device, 0), CUresult::CUDA_SUCCESS);
            assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, device), CUresult::CUDA_SUCCESS);
            assert_eq!(cuCtxSetCurrent(ctx), CUresult::CUDA_SUCCESS);
            assert_eq!(cuMemAlloc_v2(&mut ptr, 64), CUresult::CUDA_SUCCESS);
            assert_eq!(cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), 64), CUresult::CUDA_SUCCESS);
            assert_eq!(cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), ptr, 64), CUresult::CUDA_SUCCESS);
            assert_eq!(back, data, "memory is host-backed by default in the stand-in");
            assert_eq!(cuMemFree_v2(ptr), CUresult::CUDA_SUCCESS);
            assert_eq!(cuMemFree_v2(ptr), CUresult::CUDA_ERROR_INVALID_VALUE, "a second free is refused");
            assert_eq!(cuDevicePrimaryCtxRelease_v2(device), CUresult::CUDA_SUCCESS);
        }
    }

    #[test]
    fn unmodelled_entry_points_are_not_supported() {
        assert_eq!(cuDeviceGetUuid_v2(), CUresult::CUDA_ERROR_NOT_SUPPORTED);
        assert_eq!(cuGraphUpload(), CUresult::CUDA_ERROR_NOT_SUPPORTED);
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: `name` is a live local; the driver writes a pointer to a static string.
        let code = unsafe { cuGetErrorName(CUresult::CUDA_ERROR_NOT_SUPPORTED, &mut name) };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
        // SAFETY: a non-null result of cuGetErrorName is a static NUL-terminated string.
        assert_eq!(unsafe { CStr::from_ptr(name) }, c"CUDA_ERROR_NOT_SUPPORTED");
    }
}
