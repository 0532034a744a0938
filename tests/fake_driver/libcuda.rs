//! A stand-in for `libcuda.so.1` that exports only the entry points a driver of its variant
//! would, for the loader tests. Built by `build.rs` with `--cfg variant="..."`:
//!
//! - `pools`: a CUDA 12.9 driver with one device that supports memory pools: it opens.
//! - `nopools`: the same, but its device reports no `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`
//!   (a vGPU slice, a Windows TCC driver).
//! - `mixed`: two devices; device 0 supports memory pools, device 1 does not.
//! - `old`: a CUDA 11.1 driver, before memory pools: no `cuMemPool*`, no `cuMemAllocAsync`.
//! - `nopoolcalls`: reports 12.9 but exports none of the pool entry points.
//! - `stub`: the toolkit's stub library: `cuInit` returns `CUDA_ERROR_STUB_LIBRARY` (34).
//! - `nodevice`: starts, but reports no device.
//! - `initnodevice`: `cuInit` returns `CUDA_ERROR_NO_DEVICE` (100), as an installed driver does
//!   on a machine without a GPU.
//! - `noinit`: lacks `cuInit` altogether.
//!
//! The pool entry points it exports are never called by the tests; they answer
//! `CUDA_ERROR_NOT_SUPPORTED` (801).
#![allow(non_snake_case, unexpected_cfgs)]

use std::ffi::{c_char, c_int, c_uint};

type CUresult = c_uint;

const VERSION: c_int = if cfg!(variant = "old") { 11010 } else { 12090 };
const DEVICES: c_int = if cfg!(variant = "nodevice") {
    0
} else if cfg!(variant = "mixed") {
    2
} else {
    1
};

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`, `_MINOR` and `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`.
const COMPUTE_MAJOR: c_uint = 75;
const COMPUTE_MINOR: c_uint = 76;
const MEMORY_POOLS_SUPPORTED: c_uint = 115;

#[cfg(not(variant = "noinit"))]
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    if cfg!(variant = "stub") {
        34
    } else if cfg!(variant = "initnodevice") {
        100
    } else {
        0
    }
}

/// # Safety
/// `version` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { version.write(VERSION) };
    0
}

/// # Safety
/// `count` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { count.write(DEVICES) };
    0
}

/// # Safety
/// `device` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CUresult {
    if ordinal >= DEVICES {
        return 101;
    }
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { device.write(ordinal) };
    0
}

/// Compute capability 9.0; memory pools in the `pools` variant and on device 0 of `mixed`; every
/// other attribute 0.
///
/// # Safety
/// `value` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_uint, device: c_int) -> CUresult {
    let answer = match attribute {
        COMPUTE_MAJOR => 9,
        COMPUTE_MINOR => 0,
        MEMORY_POOLS_SUPPORTED => c_int::from(cfg!(variant = "pools") || (cfg!(variant = "mixed") && device == 0)),
        _ => 0,
    };
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { value.write(answer) };
    0
}

/// # Safety
/// `name` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, _device: c_int) -> CUresult {
    let text = c"Fake GPU".to_bytes_with_nul();
    if len < text.len() as c_int {
        return 1;
    }
    // SAFETY: the caller gives `len` writable bytes, at least `text.len()`.
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, text.len()) };
    0
}

/// # Safety
/// `bytes` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, _device: c_int) -> CUresult {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { bytes.write(16 << 30) };
    0
}

/// # Safety
/// `text` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, text: *mut *const c_char) -> CUresult {
    let name: &'static std::ffi::CStr = match code {
        0 => c"CUDA_SUCCESS",
        34 => c"CUDA_ERROR_STUB_LIBRARY",
        100 => c"CUDA_ERROR_NO_DEVICE",
        _ => return 1,
    };
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { text.write(name.as_ptr()) };
    0
}

/// # Safety
/// `text` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, text: *mut *const c_char) -> CUresult {
    let description: &'static std::ffi::CStr = match code {
        0 => c"no error",
        34 => c"fake driver: this is a stub library",
        100 => c"fake driver: no CUDA-capable device is detected",
        _ => return 1,
    };
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { text.write(description.as_ptr()) };
    0
}

/// Pool entry points that answer `CUDA_ERROR_NOT_SUPPORTED`, exported by the variants of 11.2 and
/// later that have them.
#[cfg(not(any(variant = "old", variant = "nopoolcalls")))]
pub mod pools {
    use std::ffi::{c_uint, c_void};

    use super::CUresult;

    const NOT_SUPPORTED: CUresult = 801;

    macro_rules! not_supported {
        ($($name:ident($($ty:ty),*);)*) => {$(
            #[unsafe(no_mangle)]
            pub extern "C" fn $name($(_: $ty),*) -> CUresult {
                NOT_SUPPORTED
            }
        )*};
    }

    not_supported! {
        cuMemPoolCreate(*mut c_void, *const c_void);
        cuMemPoolDestroy(*mut c_void);
        cuMemAllocFromPoolAsync(*mut u64, usize, *mut c_void, *mut c_void);
        cuMemFreeAsync(u64, *mut c_void);
        cuMemPoolTrimTo(*mut c_void, usize);
        cuMemPoolSetAttribute(*mut c_void, c_uint, *mut c_void);
        cuMemPoolGetAttribute(*mut c_void, c_uint, *mut c_void);
    }
}
