//! The `Arena` strategy: bump allocation in slabs, reset at the boundary.

use steppool_sys::CUdeviceptr;

use super::chunks::GRANULE;
use super::{Allocator, Served};
use crate::error::Result;
use crate::phase::ALIGNMENT;
use crate::report::FreeSpace;
use crate::source::Source;

#[derive(Clone, Copy, Debug)]
struct Slab {
    base: CUdeviceptr,
    size: u64,
}

/// Bump allocation in slabs of `slab_bytes`, used front to back: `current` is the slab being
/// bumped and `offset` its first free byte; slabs after it are untouched in this scope. A request
/// larger than a slab gets an oversize slab of its own, so it never wastes the current slab's
/// tail; oversize slabs are reused (best fit) once freed or at the next scope.
///
/// A free gives memory back only in stack order: freeing the most recent allocation moves the
/// bump pointer back (across slabs), so buffers freed in the reverse order of their allocation,
/// as scratch space and a backward pass's activations are, share their memory. Every other free
/// waits for the reset. Reuse happens in the pool's stream order, which is what makes it safe;
/// uses on other streams were made to precede the free.
///
/// Where the source has ranges that grow in place, there are no slabs: the bump runs through one
/// reserved range whose pages are mapped as it passes their end, so no slab tail is left unused
/// and no request is oversize. At the reset the pages past what the trim policy keeps go back
/// in stream order, without a wait for the stream ([`Source::resize_range`]).
#[derive(Debug)]
pub(crate) struct Arena {
    slab_bytes: u64,
    slabs: Vec<Slab>,
    /// For each slab before `current`: the bytes used when the bump moved past it.
    extents: Vec<u64>,
    current: usize,
    offset: u64,
    /// Oversize slabs and whether the current scope uses each.
    oversize: Vec<(Slab, bool)>,
    /// The most slab bytes the current scope has had in use at once.
    peak_touched: u64,
    /// The range the bump runs through, where the source has ranges: its base and the bytes
    /// mapped (`offset` is the bump in it).
    range: Option<(CUdeviceptr, u64)>,
    /// The source has no ranges: slabs serve.
    no_ranges: bool,
}

impl Arena {
    /// An arena of `slab_bytes` slabs, rounded up to the alignment ([`PhaseSpec::validate`]
    /// keeps them between 512 bytes and 64 TiB).
    ///
    /// [`PhaseSpec::validate`]: crate::PhaseSpec::validate
    pub(crate) fn new(slab_bytes: u64) -> Self {
        let slab_bytes = slab_bytes.clamp(ALIGNMENT, 1 << 46).next_multiple_of(ALIGNMENT);
        Self {
            slab_bytes,
            slabs: Vec::new(),
            extents: Vec::new(),
            current: 0,
            offset: 0,
            oversize: Vec::new(),
            peak_touched: 0,
            range: None,
            no_ranges: false,
        }
    }

    /// The range the bump runs through, reserved at the first allocation where the source has
    /// ranges; `None` where slabs serve.
    fn range(&mut self, source: &mut dyn Source) -> Result<Option<(CUdeviceptr, u64)>> {
        if self.range.is_none() && !self.no_ranges {
            match source.reserve_range()? {
                Some((base, _)) => self.range = Some((base, 0)),
                None => self.no_ranges = true,
            }
        }
        Ok(self.range)
    }

    /// Bumps `size` in the range, mapping pages past its end when the bump reaches it.
    fn bump_in_range(&mut self, source: &mut dyn Source, base: CUdeviceptr, mapped: u64, size: u64) -> Result<u64> {
        let end = self.offset + size;
        if end > mapped {
            let now = source.resize_range(base, end)?;
            self.range = Some((base, now));
        }
        let ptr = base + self.offset;
        self.offset = end;
        self.peak_touched = self.peak_touched.max(end.next_multiple_of(GRANULE));
        Ok(ptr)
    }

    /// Unmaps the range's pages past `keep` bytes (rounded up to a page) and past the bump.
    fn shrink_range(&mut self, source: &mut dyn Source, keep: u64) -> Result<u64> {
        let Some((base, mapped)) = self.range else { return Ok(0) };
        let target = keep.max(self.offset);
        if target >= mapped {
            return Ok(0);
        }
        let target = target.next_multiple_of(GRANULE);
        if target >= mapped {
            return Ok(0);
        }
        let now = source.resize_range(base, target)?;
        self.range = Some((base, now));
        Ok(mapped - now)
    }

    fn held(&self) -> u64 {
        self.slabs.iter().map(|s| s.size).sum::<u64>() + self.oversize.iter().map(|(s, _)| s.size).sum::<u64>()
    }

    /// Slab bytes in use now: the regular slabs up to the current one, and the used oversize ones.
    fn touched_now(&self) -> u64 {
        let regular = if self.current == 0 && self.offset == 0 {
            0
        } else {
            self.slabs[..=self.current].iter().map(|s| s.size).sum()
        };
        regular + self.oversize.iter().filter(|(_, used)| *used).map(|(s, _)| s.size).sum::<u64>()
    }

    /// Moves the bump to the next slab, remembering how far the current one was used.
    fn advance(&mut self) {
        self.extents.push(self.offset);
        self.current += 1;
        self.offset = 0;
    }

    fn bump(&mut self, source: &mut dyn Source, size: u64) -> Result<CUdeviceptr> {
        // The current slab, else the next kept one (the current one's tail stays unused until
        // the bump comes back to it), else a new slab.
        while let Some(slab) = self.slabs.get(self.current) {
            if slab.size - self.offset >= size {
                let ptr = slab.base + self.offset;
                self.offset += size;
                return Ok(ptr);
            }
            if self.current + 1 == self.slabs.len() {
                break;
            }
            self.advance();
        }
        let base = source.alloc(self.slab_bytes)?;
        self.slabs.push(Slab { base, size: self.slab_bytes });
        if self.slabs.len() > 1 {
            self.advance();
        }
        self.offset = size;
        Ok(base)
    }

    fn allocate_oversize(&mut self, source: &mut dyn Source, size: u64) -> Result<CUdeviceptr> {
        let fit = self
            .oversize
            .iter()
            .enumerate()
            .filter(|(_, (slab, used))| !used && slab.size >= size)
            .min_by_key(|(_, (slab, _))| slab.size)
            .map(|(index, _)| index);
        if let Some(index) = fit {
            self.oversize[index].1 = true;
            return Ok(self.oversize[index].0.base);
        }
        let base = source.alloc(size)?;
        self.oversize.push((Slab { base, size }, true));
        Ok(base)
    }
}

impl Allocator for Arena {
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served> {
        let size = bytes.next_multiple_of(ALIGNMENT);
        if let Some((base, mapped)) = self.range(source)? {
            return self.bump_in_range(source, base, mapped, size).map(Served::unfiled);
        }
        let ptr = if size > self.slab_bytes { self.allocate_oversize(source, size)? } else { self.bump(source, size)? };
        self.peak_touched = self.peak_touched.max(self.touched_now());
        Ok(Served::unfiled(ptr))
    }

    fn free(&mut self, _: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        let ptr = served.ptr;
        let size = bytes.next_multiple_of(ALIGNMENT);
        if let Some((base, _)) = self.range {
            if self.offset >= size && base + self.offset - size == ptr {
                self.offset -= size;
            }
            return Ok(());
        }
        if size > self.slab_bytes {
            if let Some(slab) = self.oversize.iter_mut().find(|(slab, used)| *used && slab.base == ptr) {
                slab.1 = false;
            }
        } else if let Some(slab) = self.slabs.get(self.current)
            && self.offset >= size
            && slab.base + self.offset - size == ptr
        {
            self.offset -= size;
            // An emptied slab hands the bump back to the one before it, so the stack order
            // continues across slabs.
            if self.offset == 0
                && let Some(extent) = self.extents.pop()
            {
                self.current -= 1;
                self.offset = extent;
            }
        }
        Ok(())
    }

    /// Starts over and gives back slabs while at least `keep` bytes stay: unused oversize
    /// slabs first (largest first), then regular slabs from the back.
    fn reset(&mut self, source: &mut dyn Source, keep: u64) -> Result<()> {
        self.current = 0;
        self.offset = 0;
        self.extents.clear();
        self.peak_touched = 0;
        if self.range.is_some() {
            return self.shrink_range(source, keep).map(drop);
        }
        let mut held = self.held();
        self.oversize.sort_unstable_by_key(|(slab, _)| std::cmp::Reverse(slab.size));
        let mut index = 0;
        while index < self.oversize.len() {
            let slab = self.oversize[index].0;
            if held - slab.size >= keep {
                self.oversize.remove(index);
                held -= slab.size;
                source.free(slab.base, slab.size)?;
            } else {
                self.oversize[index].1 = false;
                index += 1;
            }
        }
        while let Some(last) = self.slabs.last().copied() {
            if held - last.size < keep {
                break;
            }
            self.slabs.pop();
            held -= last.size;
            source.free(last.base, last.size)?;
        }
        Ok(())
    }

    fn touched(&self) -> Option<u64> {
        Some(self.peak_touched)
    }

    /// Free bytes are the tails of the slabs, untouched slabs and unused oversize slabs; the
    /// tails the bump has moved past count as free but not as available, until it comes back.
    fn free_space(&self) -> Option<FreeSpace> {
        let mut space = FreeSpace::default();
        if let Some((_, mapped)) = self.range {
            let free = mapped - self.offset.min(mapped);
            return Some(FreeSpace { total_free: free, largest_free: free });
        }
        for (index, slab) in self.slabs.iter().enumerate() {
            let (free, available) = match index.cmp(&self.current) {
                std::cmp::Ordering::Less => (slab.size - self.extents[index], false),
                std::cmp::Ordering::Equal => (slab.size - self.offset, true),
                std::cmp::Ordering::Greater => (slab.size, true),
            };
            space.total_free += free;
            if available {
                space.largest_free = space.largest_free.max(free);
            }
        }
        for (slab, used) in &self.oversize {
            if !used {
                space.total_free += slab.size;
                space.largest_free = space.largest_free.max(slab.size);
            }
        }
        Some(space)
    }

    /// Gives back the regular slabs after the current one (and the current one too when nothing
    /// was bumped in it) and the unused oversize slabs: the scope has not touched them, and it
    /// takes new ones if it grows.
    fn release_unused(&mut self, source: &mut dyn Source) -> Result<u64> {
        if self.range.is_some() {
            return self.shrink_range(source, 0);
        }
        let mut released = 0;
        let keep = if self.current == 0 && self.offset == 0 { 0 } else { self.current + 1 };
        while self.slabs.len() > keep {
            let Some(slab) = self.slabs.pop() else { break };
            released += slab.size;
            source.free(slab.base, slab.size)?;
        }
        let mut index = 0;
        while index < self.oversize.len() {
            let (slab, used) = self.oversize[index];
            if used {
                index += 1;
            } else {
                self.oversize.swap_remove(index);
                released += slab.size;
                source.free(slab.base, slab.size)?;
            }
        }
        Ok(released)
    }

    fn release_all(&mut self, source: &mut dyn Source) -> Result<()> {
        let mut outcome = Ok(());
        if let Some((base, _)) = self.range.take() {
            self.offset = 0;
            outcome = source.free_range(base);
        }
        for slab in self.slabs.drain(..).chain(self.oversize.drain(..).map(|(slab, _)| slab)) {
            outcome = outcome.and(source.free(slab.base, slab.size));
        }
        self.extents.clear();
        self.current = 0;
        self.offset = 0;
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::fake::FakeSource;

    const SLAB: u64 = 4096;

    #[test]
    fn bumps_inside_a_slab_and_takes_a_new_one_when_it_is_full() {
        let mut source = FakeSource::new(1 << 20);
        let mut arena = Arena::new(SLAB);
        let a = arena.allocate(&mut source, 1000).unwrap();
        let b = arena.allocate(&mut source, 1000).unwrap();
        assert_eq!(b.ptr - a.ptr, 1024, "sizes are rounded to the 512-byte alignment");
        assert_eq!(source.allocs, 1);
        let c = arena.allocate(&mut source, 3000).unwrap();
        assert_eq!(source.allocs, 2, "3072 bytes do not fit the 2048 left");
        assert!(c.ptr < a.ptr || c.ptr >= a.ptr + SLAB, "the new slab is another range");
        assert_eq!(arena.touched(), Some(2 * SLAB));
    }

    #[test]
    fn frees_in_stack_order_roll_the_bump_back_and_others_wait_for_the_reset() {
        let mut source = FakeSource::new(1 << 20);
        let mut arena = Arena::new(SLAB);
        let a = arena.allocate(&mut source, 512).unwrap();
        let b = arena.allocate(&mut source, 512).unwrap();
        arena.free(&mut source, b, 512).unwrap();
        assert_eq!(arena.allocate(&mut source, 512).unwrap(), b, "the most recent free is reused at once");
        arena.free(&mut source, a, 512).unwrap();
        assert_ne!(arena.allocate(&mut source, 512).unwrap(), a, "an earlier free waits for the reset");
        arena.reset(&mut source, u64::MAX).unwrap();
        assert_eq!(arena.allocate(&mut source, 512).unwrap(), a, "after the reset the slab starts over");
        assert_eq!((source.allocs, source.frees), (1, 0), "one slab served it all");
    }

    #[test]
    fn oversize_requests_get_their_own_slab_reused_best_fit_once_freed() {
        let mut source = FakeSource::new(1 << 20);
        let mut arena = Arena::new(SLAB);
        let big = arena.allocate(&mut source, 3 * SLAB).unwrap();
        let bigger = arena.allocate(&mut source, 5 * SLAB).unwrap();
        arena.free(&mut source, big, 3 * SLAB).unwrap();
        arena.free(&mut source, bigger, 5 * SLAB).unwrap();
        assert_eq!(arena.allocate(&mut source, 2 * SLAB + 1).unwrap(), big, "the smallest slab that fits");
        assert_eq!(source.allocs, 2);
        let space = arena.free_space().unwrap();
        assert_eq!(space, FreeSpace { largest_free: 5 * SLAB, total_free: 5 * SLAB });
    }

    #[test]
    fn the_reset_keeps_what_the_trim_policy_asks_for_and_gives_back_the_rest() {
        let mut source = FakeSource::new(1 << 20);
        let mut arena = Arena::new(SLAB);
        for _ in 0..4 {
            arena.allocate(&mut source, SLAB).unwrap();
        }
        arena.allocate(&mut source, 3 * SLAB).unwrap();
        assert_eq!(source.held(), 7 * SLAB);
        arena.reset(&mut source, 2 * SLAB).unwrap();
        assert_eq!(source.held(), 2 * SLAB, "the oversize slab goes first, then slabs from the back");
        arena.reset(&mut source, 0).unwrap();
        assert_eq!(source.held(), 0);
    }

    #[test]
    fn release_unused_gives_back_only_what_the_scope_has_not_touched() {
        let mut source = FakeSource::new(1 << 20);
        let mut arena = Arena::new(SLAB);
        for _ in 0..3 {
            arena.allocate(&mut source, SLAB).unwrap();
        }
        arena.reset(&mut source, u64::MAX).unwrap();
        arena.allocate(&mut source, 512).unwrap();
        assert_eq!(arena.release_unused(&mut source).unwrap(), 2 * SLAB);
        assert_eq!(source.held(), SLAB, "the slab in use stays");
        arena.release_all(&mut source).unwrap();
        assert_eq!(source.held(), 0);
    }

    #[test]
    fn with_ranges_the_bump_runs_through_one_range_mapped_as_it_passes() {
        const MIB: u64 = 1 << 20;
        let (mut source, mut arena) = (FakeSource::with_ranges(256 * MIB), Arena::new(8 * MIB));
        let sizes = [3 * MIB, 10 * MIB, MIB];
        let ptrs: Vec<_> = sizes.iter().map(|&size| arena.allocate(&mut source, size).unwrap()).collect();
        assert_eq!(source.allocs, 0, "no slab, no oversize slab: one range");
        assert_eq!(
            (ptrs[1].ptr - ptrs[0].ptr, ptrs[2].ptr - ptrs[1].ptr),
            (3 * MIB, 10 * MIB),
            "end to end, past a slab's size"
        );
        assert_eq!(source.mapped(), 14 * MIB, "14 MiB bumped: no slab tail");
        assert_eq!(arena.touched(), Some(14 * MIB));
        // Stack order moves the bump back; the next request reuses the memory.
        arena.free(&mut source, ptrs[2], MIB).unwrap();
        arena.free(&mut source, ptrs[1], 10 * MIB).unwrap();
        assert_eq!(arena.allocate(&mut source, 2 * MIB).unwrap(), ptrs[1]);
        // The reset keeps what the trim policy asks for and gives back the rest, in stream order
        // without a wait.
        let syncs = source.syncs;
        arena.reset(&mut source, 4 * MIB).unwrap();
        assert_eq!((source.mapped(), source.syncs), (4 * MIB, syncs));
        assert_eq!(arena.allocate(&mut source, MIB).unwrap(), ptrs[0], "the next scope starts at the base");
        arena.release_all(&mut source).unwrap();
        assert_eq!((source.held(), source.ranges.len()), (0, 0));
    }
}
