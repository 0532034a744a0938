//! The `Pool` strategy: every allocation and free goes to the phase's CUDA pool.

use steppool_sys::CUdeviceptr;

use super::{Allocator, Source};
use crate::error::Result;

/// Passes every allocation and free to the source; the CUDA pool does the caching and reuse.
#[derive(Debug)]
pub(crate) struct Direct;

impl Allocator for Direct {
    fn allocate(&mut self, source: &mut Source<'_>, bytes: u64) -> Result<CUdeviceptr> {
        source.alloc(bytes)
    }

    fn free(&mut self, source: &mut Source<'_>, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        source.free(ptr, bytes)
    }

    fn reset(&mut self, _: &mut Source<'_>, _: u64) -> Result<()> {
        Ok(())
    }

    fn release_all(&mut self, _: &mut Source<'_>) -> Result<()> {
        Ok(())
    }
}
