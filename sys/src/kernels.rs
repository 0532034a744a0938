//! PTX kernels kept in the repository, for tests, examples and benchmarks that need a kernel to
//! touch the memory they allocate. Load them with [`Driver::module_load_ptx`](crate::Driver).

use std::ffi::CStr;

/// `fill_bytes(u8 *dst, u64 len, u32 value)`: writes `value` to every byte of `dst[..len]` with a
/// grid-stride loop (any launch shape covers any length). Source: `sys/kernels/fill_bytes.ptx`.
pub const FILL_BYTES_PTX: &CStr = nul_terminated(concat!(include_str!("../kernels/fill_bytes.ptx"), "\0"));

/// The entry name of [`FILL_BYTES_PTX`].
pub const FILL_BYTES: &CStr = c"fill_bytes";

const fn nul_terminated(text: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(text.as_bytes()) {
        Ok(text) => text,
        Err(_) => panic!("a kernel source contains a NUL byte"),
    }
}
