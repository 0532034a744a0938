//! The `Chunked` strategy: best-fit sub-allocation in chunks taken from the phase's pool, for
//! long-lived allocations (weights, optimizer state) that the pool's per-request granule would
//! leave tails after.

use super::chunks::Chunks;
use super::{Allocator, Bin, Served};
use crate::error::Result;
use crate::phase::ALIGNMENT;
use crate::report::FreeSpace;
use crate::source::Source;

/// Serves every allocation best-fit from chunks of about `chunk_bytes` (or, where the device has
/// virtual memory management, from one range that grows in place by what each request lacks);
/// frees go back to the chunks' free ranges and are reused at once (in the pool's stream order,
/// as the pool's own reuse is). A chunk goes back to the pool only when nothing in it is handed out: at a reset
/// beyond what the trim policy keeps, or when memory is short.
#[derive(Debug)]
pub(crate) struct Chunked {
    chunk_bytes: u64,
    chunks: Chunks,
}

impl Chunked {
    /// Chunks of about `chunk_bytes` ([`PhaseSpec::validate`] keeps it between 512 bytes and
    /// 64 TiB), each fitted to the request that opens it and rounded up to the 2 MiB granule.
    ///
    /// [`PhaseSpec::validate`]: crate::PhaseSpec::validate
    pub(crate) fn new(chunk_bytes: u64) -> Self {
        Self { chunk_bytes, chunks: Chunks::growing() }
    }
}

impl Allocator for Chunked {
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served> {
        self.chunks.alloc(source, bytes.next_multiple_of(ALIGNMENT), self.chunk_bytes).map(Served::unfiled)
    }

    fn free(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        let ptr = served.ptr;
        if self.chunks.free(ptr).is_none() {
            debug_assert!(false, "free of {ptr:#x}, which this strategy did not hand out");
            return source.free(ptr, bytes);
        }
        self.chunks.freed_in_range(source, ptr);
        Ok(())
    }

    /// Takes back what the scope left handed out, and gives back empty chunks beyond `keep`.
    fn reset(&mut self, source: &mut dyn Source, keep: u64) -> Result<()> {
        self.chunks.reclaim();
        let released = self.chunks.release_empty(source, keep);
        self.chunks.start_scope();
        released.map(drop)
    }

    fn touched(&self) -> Option<u64> {
        Some(self.chunks.peak_held())
    }

    fn free_space(&self) -> Option<FreeSpace> {
        Some(self.chunks.free_space())
    }

    /// Gives back every chunk with nothing handed out.
    fn release_unused(&mut self, source: &mut dyn Source) -> Result<u64> {
        self.chunks.release_empty(source, 0)
    }

    /// Gives back the pages of freed long-lived memory inside the range (a training step's
    /// gradients kept across an evaluation pass, freed by the next step), so that the phase
    /// that is about to grow maps them instead of new ones.
    fn give_back_freed(&mut self, source: &mut dyn Source, bytes: u64) -> Result<u64> {
        self.chunks.give_back_freed(source, bytes)
    }

    fn release_all(&mut self, source: &mut dyn Source) -> Result<()> {
        self.chunks.release_all(source)
    }

    fn lend_tail(&mut self, current: Option<Bin>, lend: bool) -> Option<Bin> {
        let current = current.map(|bin| (bin.ptr, bin.len));
        if !lend {
            if let Some((ptr, _)) = current {
                self.chunks.free(ptr);
            }
            return None;
        }
        self.chunks.lend_tail(current).map(|(ptr, len)| Bin { ptr, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::fake::FakeSource;

    const MIB: u64 = 1 << 20;

    #[test]
    fn long_lived_allocations_share_chunks_and_frees_are_reused() {
        let (mut source, mut chunked) = (FakeSource::new(256 * MIB), Chunked::new(16 * MIB));
        // A layer's weights: 2.25 MiB and three of 0.5625 MiB, six layers (20.25 MiB).
        let mut ptrs = Vec::new();
        for _ in 0..6 {
            ptrs.push(chunked.allocate(&mut source, 9 * MIB / 4).unwrap());
            for _ in 0..3 {
                ptrs.push(chunked.allocate(&mut source, 9 * MIB / 16).unwrap());
            }
        }
        assert_eq!(source.held(), 32 * MIB, "two 16 MiB chunks, where the pool would reserve 6 × 4 MiB");
        let space = chunked.free_space().unwrap();
        assert_eq!(space.total_free, 32 * MIB - 6 * (9 * MIB / 4 + 3 * 9 * MIB / 16));
        chunked.free(&mut source, ptrs[4], 9 * MIB / 4).unwrap();
        assert_eq!(chunked.allocate(&mut source, 2 * MIB).unwrap(), ptrs[4], "the freed range, best fit");
        assert_eq!(source.allocs, 2);
    }

    #[test]
    fn a_reset_reclaims_and_keeps_what_the_policy_asks() {
        let (mut source, mut chunked) = (FakeSource::new(256 * MIB), Chunked::new(4 * MIB));
        for _ in 0..3 {
            chunked.allocate(&mut source, 3 * MIB).unwrap();
        }
        assert_eq!(chunked.touched(), Some(12 * MIB));
        assert!(chunked.reclaims_live());
        chunked.reset(&mut source, 8 * MIB).unwrap();
        assert_eq!(source.held(), 8 * MIB, "a leaked hand-out is taken back, one chunk given back");
        assert_eq!(chunked.touched(), Some(8 * MIB), "the next scope's peak starts from what is held");
        assert_eq!(chunked.release_unused(&mut source).unwrap(), 8 * MIB);
        chunked.allocate(&mut source, MIB).unwrap();
        chunked.release_all(&mut source).unwrap();
        assert_eq!(source.held(), 0);
    }

    #[test]
    fn the_unused_end_of_the_last_page_is_lent_kept_while_it_is_the_end_and_taken_back() {
        let (mut source, mut chunked) = (FakeSource::with_ranges(256 * MIB), Chunked::new(16 * MIB));
        assert_eq!(chunked.lend_tail(None, true), None, "nothing to lend before the range exists");
        let first = chunked.allocate(&mut source, 9 * MIB / 4).unwrap();
        assert_eq!(source.mapped(), 4 * MIB);
        let loan = chunked.lend_tail(None, true).expect("the end of the second page");
        assert_eq!(loan, Bin { ptr: first.ptr + 9 * MIB / 4, len: 7 * MIB / 4 });
        assert_eq!(chunked.lend_tail(Some(loan), true), Some(loan), "still the end: kept");
        // A long-lived allocation comes: it goes past the loan, which is no longer the end.
        let second = chunked.allocate(&mut source, MIB).unwrap();
        assert_eq!(second.ptr, first.ptr + 4 * MIB);
        assert_eq!(source.mapped(), 6 * MIB);
        let again = chunked.lend_tail(Some(loan), true).expect("the end of the third page");
        assert_eq!(again, Bin { ptr: first.ptr + 5 * MIB, len: MIB });
        // The first loan came back: the next allocation that fits takes it.
        assert_eq!(chunked.allocate(&mut source, 3 * MIB / 2).unwrap().ptr, loan.ptr);
        assert_eq!(chunked.lend_tail(Some(again), false), None, "taken back, nothing lent");
        assert_eq!(chunked.allocate(&mut source, MIB).unwrap().ptr, again.ptr, "and free again");
        assert_eq!(source.mapped(), 6 * MIB);
    }

    #[test]
    fn with_ranges_one_range_grows_by_what_each_request_lacks() {
        let (mut source, mut chunked) = (FakeSource::with_ranges(256 * MIB), Chunked::new(16 * MIB));
        let ptrs: Vec<_> = (0..6).map(|_| chunked.allocate(&mut source, 9 * MIB / 4).unwrap()).collect();
        assert_eq!(source.allocs, 0, "no chunk from the pool");
        assert_eq!(source.ranges.len(), 1);
        assert!(ptrs.windows(2).all(|w| w[1].ptr - w[0].ptr == 9 * MIB / 4), "end to end in one range");
        assert_eq!(source.mapped(), 14 * MIB, "13.5 MiB rounded up to a page, not a 16 MiB chunk");
        // The last two freed: the free pages at the end go back when memory is short, the range
        // stays; the next request maps what it lacks again.
        chunked.free(&mut source, ptrs[5], 9 * MIB / 4).unwrap();
        chunked.free(&mut source, ptrs[4], 9 * MIB / 4).unwrap();
        assert_eq!(chunked.release_unused(&mut source).unwrap(), 4 * MIB);
        assert_eq!(source.mapped(), 10 * MIB, "9 MiB live, rounded up to a page");
        assert_eq!(chunked.allocate(&mut source, 9 * MIB / 4).unwrap(), ptrs[4], "the range grows back in place");
        assert_eq!(chunked.touched(), Some(14 * MIB));
        chunked.release_all(&mut source).unwrap();
        assert_eq!((source.held(), source.ranges.len()), (0, 0));
    }

    #[test]
    fn with_ranges_freed_pages_go_back_when_the_device_needs_memory_and_map_again_when_used() {
        let (mut source, mut chunked) = (FakeSource::with_ranges(256 * MIB), Chunked::new(16 * MIB));
        // Weights, then a step's gradients kept across an evaluation pass, then optimizer state.
        let weights = chunked.allocate(&mut source, 4 * MIB).unwrap();
        let grads: Vec<_> = (0..3).map(|_| chunked.allocate(&mut source, 4 * MIB).unwrap()).collect();
        let state = chunked.allocate(&mut source, 4 * MIB).unwrap();
        let tail = chunked.allocate(&mut source, 4 * MIB).unwrap();
        assert_eq!(source.mapped(), 24 * MIB);
        // The next step frees the gradients and the last buffer: the pages stay mapped, for the
        // next hand-out, until the device needs memory.
        for served in grads.iter().chain([&tail]) {
            chunked.free(&mut source, *served, 4 * MIB).unwrap();
        }
        assert!(source.holding, "freed pages kept mapped, and the device told so");
        assert_eq!(source.mapped(), 24 * MIB);
        // Another phase is about to take 2 MiB: the free end goes back first, as much as asked.
        assert_eq!(chunked.give_back_freed(&mut source, 2 * MIB).unwrap(), 2 * MIB);
        assert!(source.holding, "more is kept");
        assert_eq!(source.mapped(), 22 * MIB);
        // Then 14 MiB: the rest of the end, then the 12 MiB hole's pages.
        assert_eq!(chunked.give_back_freed(&mut source, 14 * MIB).unwrap(), 14 * MIB);
        assert_eq!(source.mapped(), 8 * MIB, "the weights and the optimizer state");
        assert_eq!(chunked.give_back_freed(&mut source, MIB).unwrap(), 0, "nothing more kept");
        assert!(!source.holding);
        // The next gradients land in the hole and map its pages again, and only them.
        let again = chunked.allocate(&mut source, 8 * MIB).unwrap();
        assert_eq!(again.ptr, grads[0].ptr, "best fit in the hole, at its start");
        assert_eq!(source.mapped(), 16 * MIB);
        let third = chunked.allocate(&mut source, 4 * MIB).unwrap();
        assert_eq!((third.ptr, source.mapped()), (grads[2].ptr, 20 * MIB));
        assert!(third.ptr < state.ptr && weights.ptr < again.ptr);
        chunked.release_all(&mut source).unwrap();
        assert_eq!((source.held(), source.ranges.len(), source.holding), (0, 0, false));
    }
}
