//! PTX kernels kept in the repository, for tests, examples and benchmarks that need a kernel to
//! touch the memory they allocate. Load them with [`Driver::module_load_ptx`](crate::Driver).

use std::ffi::CStr;

/// `fill_bytes(u8 *dst, u64 len, u32 value)`: writes `value` to every byte of `dst[..len]` with a
/// grid-stride loop (any launch shape covers any length). Source: `sys/kernels/fill_bytes.ptx`.
pub const FILL_BYTES_PTX: &CStr = nul_terminated(concat!(include_str!("../kernels/fill_bytes.ptx"), "\0"));

/// The entry name of [`FILL_BYTES_PTX`].
pub const FILL_BYTES: &CStr = c"fill_bytes";

/// `fill_v4(u8 *dst, u64 len, u32 value)`: writes `value` to every byte of `dst[..len]` with
/// 16-byte stores (byte stores for the last `len % 16` bytes), a grid-stride loop. `dst` must be
/// 16-byte aligned, as every CUDA allocation is. The benchmarks' kernel: wide stores keep a step's
/// time from being padded by byte-by-byte writes. Source: `sys/kernels/fill_v4.ptx`.
pub const FILL_V4_PTX: &CStr = nul_terminated(concat!(include_str!("../kernels/fill_v4.ptx"), "\0"));

/// The entry name of [`FILL_V4_PTX`].
pub const FILL_V4: &CStr = c"fill_v4";

const fn nul_terminated(text: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(text.as_bytes()) {
        Ok(text) => text,
        Err(_) => panic!("a kernel source contains a NUL byte"),
    }
}
