//! The `Direct` strategy: every allocation and free goes to the phase's CUDA pool.

use super::{Allocator, Served};
use crate::error::Result;
use crate::source::Source;

/// Passes every allocation and free to the source; the CUDA pool does the caching and reuse.
#[derive(Debug)]
pub(crate) struct Direct;

impl Allocator for Direct {
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served> {
        source.alloc(bytes).map(Served::unfiled)
    }

    fn free(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        source.free(served.ptr, bytes)
    }

    /// Every allocation was freed through the source; nothing is held here.
    fn reset(&mut self, _: &mut dyn Source, _: u64) -> Result<()> {
        Ok(())
    }

    /// The source holds each allocation as its own, so it lives until its free whatever the
    /// boundaries between.
    fn carry(&mut self, served: Served, _: u64) -> Option<u32> {
        Some(served.slot)
    }

    /// The source holds each allocation as its own: one leaked with `mem::forget` stays leaked.
    fn reclaims_live(&self) -> bool {
        false
    }

    fn release_all(&mut self, _: &mut dyn Source) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::fake::FakeSource;

    #[test]
    fn every_call_reaches_the_source_and_nothing_is_held_between_them() {
        let mut source = FakeSource::new(1 << 20);
        let mut direct = Direct;
        let a = direct.allocate(&mut source, 1000).unwrap();
        let b = direct.allocate(&mut source, 3000).unwrap();
        assert_eq!((source.allocs, source.held()), (2, 4000));
        direct.free(&mut source, a, 1000).unwrap();
        direct.free(&mut source, b, 3000).unwrap();
        assert_eq!((source.frees, source.held()), (2, 0));
        direct.reset(&mut source, 0).unwrap();
        assert_eq!((source.allocs, source.frees, source.syncs), (2, 2, 0));
        assert_eq!((direct.touched(), direct.free_space(), direct.reclaims_live()), (None, None, false));
    }

    #[test]
    fn the_source_running_out_is_the_callers_error() {
        let mut source = FakeSource::new(4096);
        let error = Direct.allocate(&mut source, 8192).unwrap_err();
        assert!(matches!(&error, crate::Error::Driver(e) if e.is_out_of_memory()), "{error}");
    }
}
