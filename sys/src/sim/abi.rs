//! [`SimLibrary`]: the simulated device's entry points made public for a C ABI library that
//! stands in for `libcuda` (`sys/libcuda-sim`), and [`sim_entry_points!`](crate::sim_entry_points),
//! the one list of their names and C signatures that the library exports.
//!
//! Everything else reaches the simulated device through [`Driver`](crate::Driver), whose checked
//! methods are the API; this type exists so that a program loading the driver by name (cudarc,
//! or any C code) can be served by the same model, with the same error codes.

use super::{Sim, SimConfig, SimConfigError};

/// Calls `$callback!` with every entry point of the simulated device, one per line as
/// `name(arg: Type, ...);`, with the C signature of the exported (versioned) name. Each returns
/// `CUresult`. The C ABI library generates its `extern "C"` functions from it, and
/// [`SimLibrary`] its forwarding methods, so the two cannot drift apart.
#[macro_export]
macro_rules! sim_entry_points {
    ($callback:ident) => {
        $callback! {
            cuGetErrorName(error: $crate::CUresult, pStr: *mut *const ::std::ffi::c_char);
            cuGetErrorString(error: $crate::CUresult, pStr: *mut *const ::std::ffi::c_char);
            cuInit(Flags: ::std::ffi::c_uint);
            cuDriverGetVersion(driverVersion: *mut ::std::ffi::c_int);
            cuDeviceGet(device: *mut $crate::CUdevice, ordinal: ::std::ffi::c_int);
            cuDeviceGetCount(count: *mut ::std::ffi::c_int);
            cuDeviceGetName(name: *mut ::std::ffi::c_char, len: ::std::ffi::c_int, dev: $crate::CUdevice);
            cuDeviceGetAttribute(pi: *mut ::std::ffi::c_int, attrib: $crate::CUdevice_attribute, dev: $crate::CUdevice);
            cuDeviceTotalMem_v2(bytes: *mut usize, dev: $crate::CUdevice);
            cuDeviceCanAccessPeer(canAccessPeer: *mut ::std::ffi::c_int, dev: $crate::CUdevice, peerDev: $crate::CUdevice);
            cuDevicePrimaryCtxRetain(pctx: *mut $crate::CUcontext, dev: $crate::CUdevice);
            cuDevicePrimaryCtxRelease_v2(dev: $crate::CUdevice);
            cuCtxGetCurrent(pctx: *mut $crate::CUcontext);
            cuCtxSetCurrent(ctx: $crate::CUcontext);
            cuCtxPushCurrent_v2(ctx: $crate::CUcontext);
            cuCtxPopCurrent_v2(pctx: *mut $crate::CUcontext);
            cuCtxGetDevice(device: *mut $crate::CUdevice);
            cuCtxSynchronize();
            cuStreamCreate(phStream: *mut $crate::CUstream, Flags: ::std::ffi::c_uint);
            cuStreamDestroy_v2(hStream: $crate::CUstream);
            cuStreamSynchronize(hStream: $crate::CUstream);
            cuStreamQuery(hStream: $crate::CUstream);
            cuStreamWaitEvent(hStream: $crate::CUstream, hEvent: $crate::CUevent, Flags: ::std::ffi::c_uint);
            cuStreamGetCtx(hStream: $crate::CUstream, pctx: *mut $crate::CUcontext);
            cuEventCreate(phEvent: *mut $crate::CUevent, Flags: ::std::ffi::c_uint);
            cuEventDestroy_v2(hEvent: $crate::CUevent);
            cuEventRecord(hEvent: $crate::CUevent, hStream: $crate::CUstream);
            cuEventQuery(hEvent: $crate::CUevent);
            cuEventSynchronize(hEvent: $crate::CUevent);
            cuEventElapsedTime(pMilliseconds: *mut f32, hStart: $crate::CUevent, hEnd: $crate::CUevent);
            cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
            cuMemAlloc_v2(dptr: *mut $crate::CUdeviceptr, bytesize: usize);
            cuMemFree_v2(dptr: $crate::CUdeviceptr);
            cuMemsetD8Async(dstDevice: $crate::CUdeviceptr, uc: ::std::ffi::c_uchar, N: usize, hStream: $crate::CUstream);
            cuMemsetD8_v2(dstDevice: $crate::CUdeviceptr, uc: ::std::ffi::c_uchar, N: usize);
            cuMemcpyHtoDAsync_v2(dstDevice: $crate::CUdeviceptr, srcHost: *const ::std::ffi::c_void, ByteCount: usize, hStream: $crate::CUstream);
            cuMemcpyDtoHAsync_v2(dstHost: *mut ::std::ffi::c_void, srcDevice: $crate::CUdeviceptr, ByteCount: usize, hStream: $crate::CUstream);
            cuMemcpyDtoDAsync_v2(dstDevice: $crate::CUdeviceptr, srcDevice: $crate::CUdeviceptr, ByteCount: usize, hStream: $crate::CUstream);
            cuMemcpyHtoD_v2(dstDevice: $crate::CUdeviceptr, srcHost: *const ::std::ffi::c_void, ByteCount: usize);
            cuMemcpyDtoH_v2(dstHost: *mut ::std::ffi::c_void, srcDevice: $crate::CUdeviceptr, ByteCount: usize);
            cuMemcpyDtoD_v2(dstDevice: $crate::CUdeviceptr, srcDevice: $crate::CUdeviceptr, ByteCount: usize);
            cuMemAllocAsync(dptr: *mut $crate::CUdeviceptr, bytesize: usize, hStream: $crate::CUstream);
            cuMemFreeAsync(dptr: $crate::CUdeviceptr, hStream: $crate::CUstream);
            cuMemAllocFromPoolAsync(dptr: *mut $crate::CUdeviceptr, bytesize: usize, pool: $crate::CUmemoryPool, hStream: $crate::CUstream);
            cuMemPoolCreate(pool: *mut $crate::CUmemoryPool, poolProps: *const $crate::CUmemPoolProps);
            cuMemPoolDestroy(pool: $crate::CUmemoryPool);
            cuMemPoolTrimTo(pool: $crate::CUmemoryPool, minBytesToKeep: usize);
            cuMemPoolSetAttribute(pool: $crate::CUmemoryPool, attr: $crate::CUmemPool_attribute, value: *mut ::std::ffi::c_void);
            cuMemPoolGetAttribute(pool: $crate::CUmemoryPool, attr: $crate::CUmemPool_attribute, value: *mut ::std::ffi::c_void);
            cuMemPoolSetAccess(pool: $crate::CUmemoryPool, map: *const $crate::CUmemAccessDesc, count: usize);
            cuMemPoolGetAccess(flags: *mut $crate::CUmemAccess_flags, memPool: $crate::CUmemoryPool, location: *mut $crate::CUmemLocation);
            cuDeviceGetDefaultMemPool(pool_out: *mut $crate::CUmemoryPool, dev: $crate::CUdevice);
            cuDeviceGetMemPool(pool: *mut $crate::CUmemoryPool, dev: $crate::CUdevice);
            cuDeviceSetMemPool(dev: $crate::CUdevice, pool: $crate::CUmemoryPool);
            cuMemPoolExportToShareableHandle(handle_out: *mut ::std::ffi::c_void, pool: $crate::CUmemoryPool, handleType: $crate::CUmemAllocationHandleType, flags: ::std::ffi::c_ulonglong);
            cuMemPoolImportFromShareableHandle(pool_out: *mut $crate::CUmemoryPool, handle: *mut ::std::ffi::c_void, handleType: $crate::CUmemAllocationHandleType, flags: ::std::ffi::c_ulonglong);
            cuMemPoolExportPointer(shareData_out: *mut $crate::CUmemPoolPtrExportData, ptr: $crate::CUdeviceptr);
            cuMemPoolImportPointer(ptr_out: *mut $crate::CUdeviceptr, pool: $crate::CUmemoryPool, shareData: *mut $crate::CUmemPoolPtrExportData);
            cuMemAddressReserve(ptr: *mut $crate::CUdeviceptr, size: usize, alignment: usize, addr: $crate::CUdeviceptr, flags: ::std::ffi::c_ulonglong);
            cuMemAddressFree(ptr: $crate::CUdeviceptr, size: usize);
            cuMemCreate(handle: *mut $crate::CUmemGenericAllocationHandle, size: usize, prop: *const $crate::CUmemAllocationProp, flags: ::std::ffi::c_ulonglong);
            cuMemRelease(handle: $crate::CUmemGenericAllocationHandle);
            cuMemMap(ptr: $crate::CUdeviceptr, size: usize, offset: usize, handle: $crate::CUmemGenericAllocationHandle, flags: ::std::ffi::c_ulonglong);
            cuMemUnmap(ptr: $crate::CUdeviceptr, size: usize);
            cuMemSetAccess(ptr: $crate::CUdeviceptr, size: usize, desc: *const $crate::CUmemAccessDesc, count: usize);
            cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const $crate::CUmemAllocationProp, option: $crate::CUmemAllocationGranularity_flags);
            cuModuleLoadData(module: *mut $crate::CUmodule, image: *const ::std::ffi::c_void);
            cuModuleUnload(hmod: $crate::CUmodule);
            cuModuleGetFunction(hfunc: *mut $crate::CUfunction, hmod: $crate::CUmodule, name: *const ::std::ffi::c_char);
            cuLaunchKernel(f: $crate::CUfunction, gridDimX: ::std::ffi::c_uint, gridDimY: ::std::ffi::c_uint, gridDimZ: ::std::ffi::c_uint, blockDimX: ::std::ffi::c_uint, blockDimY: ::std::ffi::c_uint, blockDimZ: ::std::ffi::c_uint, sharedMemBytes: ::std::ffi::c_uint, hStream: $crate::CUstream, kernelParams: *mut *mut ::std::ffi::c_void, extra: *mut *mut ::std::ffi::c_void);
            cuStreamBeginCapture_v2(hStream: $crate::CUstream, mode: $crate::CUstreamCaptureMode);
            cuStreamEndCapture(hStream: $crate::CUstream, phGraph: *mut $crate::CUgraph);
            cuStreamIsCapturing(hStream: $crate::CUstream, captureStatus: *mut $crate::CUstreamCaptureStatus);
            cuStreamGetCaptureInfo_v2(hStream: $crate::CUstream, captureStatus_out: *mut $crate::CUstreamCaptureStatus, id_out: *mut $crate::cuuint64_t, graph_out: *mut $crate::CUgraph, dependencies_out: *mut *const $crate::CUgraphNode, numDependencies_out: *mut usize);
            cuThreadExchangeStreamCaptureMode(mode: *mut $crate::CUstreamCaptureMode);
            cuGraphInstantiateWithFlags(phGraphExec: *mut $crate::CUgraphExec, hGraph: $crate::CUgraph, flags: ::std::ffi::c_ulonglong);
            cuGraphLaunch(hGraphExec: $crate::CUgraphExec, hStream: $crate::CUstream);
            cuGraphExecDestroy(hGraphExec: $crate::CUgraphExec);
            cuGraphDestroy(hGraph: $crate::CUgraph);
            cuDeviceGraphMemTrim(device: $crate::CUdevice);
            cuDeviceGetGraphMemAttribute(device: $crate::CUdevice, attr: $crate::CUgraphMem_attribute, value: *mut ::std::ffi::c_void);
            cuDeviceSetGraphMemAttribute(device: $crate::CUdevice, attr: $crate::CUgraphMem_attribute, value: *mut ::std::ffi::c_void);
        }
    };
}

/// A simulated driver served through a C ABI: every entry point of the simulated device, with the
/// C signature and the driver's error contract (see the [module docs](super)).
///
/// Made for one caller, the `libcuda` stand-in in `sys/libcuda-sim`, which keeps one per process
/// and exports a C function per entry point. Programs use [`Driver`](crate::Driver) instead; one
/// that loads that library through [`CudaLibrary::open_path`](crate::CudaLibrary::open_path)
/// talks to the same simulated device as any other code in the process that loads it by name.
#[derive(Debug)]
pub struct SimLibrary {
    sim: Sim,
}

impl SimLibrary {
    /// A simulated driver with the given devices, once [`SimConfig::validate`] accepts them.
    /// Like the real driver, it answers nothing but `cuGetErrorName`, `cuGetErrorString` and
    /// `cuDriverGetVersion` before `cuInit`.
    pub fn new(config: SimConfig) -> Result<Self, SimConfigError> {
        Ok(Self { sim: Sim::new(config)? })
    }

    /// The simulated device, for inspection (configuration, pool layouts, stream order).
    pub fn sim(&self) -> &Sim {
        &self.sim
    }
}

macro_rules! forward {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// The entry points, each with the signature and contract of the `cuda.h` function of the
        /// same name.
        ///
        /// # Safety
        ///
        /// This section is the `# Safety` of every method below: pointer arguments must be null or
        /// valid for the reads and writes the driver function of the same name documents. Handles
        /// may be anything; invalid ones are refused with the driver's error code.
        #[allow(non_snake_case, clippy::too_many_arguments, clippy::missing_safety_doc)]
        impl SimLibrary {
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub unsafe fn $name(&self, $($arg: $ty),*) -> $crate::CUresult {
                    if let Some(code) = self.sim.fault(stringify!($name)) {
                        return code;
                    }
                    // SAFETY: the caller's contract is the entry point's, forwarded unchanged.
                    unsafe { self.sim.$name($($arg),*) }
                }
            )*
        }
    };
}

crate::sim_entry_points!(forward);
