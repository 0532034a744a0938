//! The kernel that touches what the benchmarks allocate: `fill_v4` from `sys/kernels/`, loaded
//! with `cuModuleLoadData` and launched with `cuLaunchKernel`, writing every byte of a buffer.
//!
//! On the simulated device the module loads and each launch is checked and ordered on its
//! stream, but nothing runs: step times there are the host's costs alone.

use std::ffi::c_void;

use steppool::sys::kernels::{FILL_V4, FILL_V4_PTX};
use steppool::sys::{CUdeviceptr, CUfunction, CUmodule, CUstream, Driver};

use crate::Result;

/// Threads per block of every launch.
const BLOCK: u32 = 256;
/// Most blocks of a launch; the grid-stride loop covers the rest.
const MAX_BLOCKS: u64 = 8192;

/// `fill_v4`, loaded in the current context.
#[derive(Debug)]
pub struct Fill {
    driver: Driver,
    module: CUmodule,
    function: CUfunction,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread whose
// current context is the one they were loaded in; `Fill` only launches and unloads.
unsafe impl Send for Fill {}

impl Fill {
    /// Loads the kernel in the calling thread's current context.
    pub fn load(driver: &Driver) -> Result<Self> {
        let module = driver.module_load_ptx(FILL_V4_PTX)?;
        // SAFETY: the module was just loaded.
        let function = match unsafe { driver.module_function(module, FILL_V4) } {
            Ok(function) => function,
            Err(error) => {
                // SAFETY: the module is live and nothing of it is used.
                let _ = unsafe { driver.module_unload(module) };
                return Err(error.into());
            }
        };
        Ok(Self { driver: driver.clone(), module, function })
    }

    /// Writes `value` to every byte of `[ptr, ptr + bytes)`, in `stream` order.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + bytes)` lies in a live, 16-byte aligned allocation that `stream` may use;
    /// `stream` is a live stream of the context the kernel was loaded in.
    pub unsafe fn launch(&self, ptr: CUdeviceptr, bytes: u64, value: u8, stream: CUstream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let (mut ptr, mut len, mut value) = (ptr, bytes, u32::from(value));
        let mut params =
            [(&raw mut ptr).cast::<c_void>(), (&raw mut len).cast::<c_void>(), (&raw mut value).cast::<c_void>()];
        let blocks = (bytes / 16).div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32;
        // SAFETY: the parameters match `fill_v4(u8 *, u64, u32)` and live across the call; the
        // caller guarantees the memory and the stream.
        unsafe { self.driver.launch_kernel(self.function, [blocks, 1, 1], [BLOCK, 1, 1], 0, stream, &mut params) }?;
        Ok(())
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        // SAFETY: the module is live and its function is not used after this.
        let _ = unsafe { self.driver.module_unload(self.module) };
    }
}
