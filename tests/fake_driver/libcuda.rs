//! A stand-in for `libcuda.so.1` that exports only the entry points a driver of its variant
//! would, for the loader tests. Built by `build.rs` with `--cfg variant="..."`:
//!
//! - `old`: a CUDA 11.1 driver, before memory pools: no `cuMemPool*`, no `cuMemAllocAsync`.
//! - `stub`: the toolkit's stub library: `cuInit` returns `CUDA_ERROR_STUB_LIBRARY` (34).
//! - `nodevice`: starts, but reports no device.
//! - `noinit`: lacks `cuInit` altogether.
#![allow(non_snake_case, unexpected_cfgs)]

use std::ffi::{c_char, c_int, c_uint};

type CUresult = c_uint;

const VERSION: c_int = if cfg!(variant = "old") { 11010 } else { 12090 };
const DEVICES: c_int = if cfg!(variant = "nodevice") { 0 } else { 1 };

#[cfg(not(variant = "noinit"))]
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    if cfg!(variant = "stub") { 34 } else { 0 }
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

/// Every attribute reads 0: in particular, no memory pool support.
///
/// # Safety
/// `value` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, _attribute: c_uint, _device: c_int) -> CUresult {
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { value.write(0) };
    0
}

/// # Safety
/// `text` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, text: *mut *const c_char) -> CUresult {
    let name: &'static std::ffi::CStr = match code {
        0 => c"CUDA_SUCCESS",
        34 => c"CUDA_ERROR_STUB_LIBRARY",
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
        _ => return 1,
    };
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { text.write(description.as_ptr()) };
    0
}
