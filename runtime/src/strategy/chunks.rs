//! Best-fit sub-allocation inside chunks taken from a [`Source`]: the free ranges of memory a
//! strategy holds, and the chunks it grows by.
//!
//! The CUDA pool reserves a segment of each request rounded up to its granule (2 MiB), so a run
//! of 2.25 MiB weights reserves 4 MiB apiece unless smaller requests happen to fill the tails.
//! Taking memory in larger chunks and placing requests best-fit inside them packs such runs
//! end to end: what is left unused is the end of the last chunk and the gaps frees leave, not
//! a tail per request. [`FreeRanges`] are the free pieces, by address and by size, never merged
//! across a region's start (two chunks adjacent in the address space are still two allocations
//! of the source, and no hand-out may span them). [`Chunks`] is the sub-allocator the
//! [`Chunked`](super::Chunked) strategy is and the [`Planned`](super::Planned) strategy serves
//! its unplanned allocations from.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use steppool_sys::CUdeviceptr;

use crate::error::{Error, Result};
use crate::report::FreeSpace;
use crate::source::Source;

/// The reservation granule of CUDA pools on current GPUs: a chunk of a multiple of it fills the
/// segment the pool reserves for it.
pub(crate) const GRANULE: u64 = 2 << 20;

/// Hashes device pointers: they are 512-byte aligned, so the low bits carry nothing.
#[derive(Default)]
pub(crate) struct PointerHasher(u64);

impl Hasher for PointerHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (value >> 9).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by device pointers.
pub(crate) type PointerMap<V> = HashMap<CUdeviceptr, V, BuildHasherDefault<PointerHasher>>;

/// Free address ranges inside regions (a slab, chunks): best fit by size, the lowest address on
/// ties; a freed range merges with its free neighbours in the same region.
#[derive(Debug, Default)]
pub(crate) struct FreeRanges {
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    /// The start of every region: ranges never merge across one.
    starts: BTreeSet<u64>,
}

impl FreeRanges {
    /// Adds a region whose free ranges are those of `[base, base + len)` around `live`
    /// (`(address, size)` pairs inside it).
    pub(crate) fn add_region(&mut self, base: u64, len: u64, mut live: Vec<(u64, u64)>) {
        self.starts.insert(base);
        live.sort_unstable();
        let mut top = base;
        for (at, size) in live.into_iter().chain(std::iter::once((base + len, 0))) {
            if at > top {
                self.insert(top, at - top);
            }
            top = top.max(at + size);
        }
    }

    /// Removes a region that is free in full; false (and nothing changes) if part is handed out.
    pub(crate) fn remove_region(&mut self, base: u64, len: u64) -> bool {
        if self.by_addr.get(&base) != Some(&len) {
            return false;
        }
        self.remove(base, len);
        self.starts.remove(&base);
        true
    }

    /// Whether the region at `base` of `len` bytes is free in full.
    pub(crate) fn is_free(&self, base: u64, len: u64) -> bool {
        self.by_addr.get(&base) == Some(&len)
    }

    fn insert(&mut self, at: u64, len: u64) {
        self.by_addr.insert(at, len);
        self.by_size.insert((len, at));
    }

    fn remove(&mut self, at: u64, len: u64) {
        self.by_addr.remove(&at);
        self.by_size.remove(&(len, at));
    }

    /// The start of the smallest free range that holds `size` (the lowest on ties), taken.
    pub(crate) fn take(&mut self, size: u64) -> Option<u64> {
        let &(len, at) = self.by_size.range((size, 0)..).next()?;
        self.remove(at, len);
        if len > size {
            self.insert(at + size, len - size);
        }
        Some(at)
    }

    /// Returns a range, merged with its free neighbours in its region.
    pub(crate) fn give(&mut self, mut at: u64, mut len: u64) {
        if !self.starts.contains(&at)
            && let Some((&below, &below_len)) = self.by_addr.range(..at).next_back()
            && below + below_len == at
        {
            self.remove(below, below_len);
            at = below;
            len += below_len;
        }
        let end = at + len;
        if !self.starts.contains(&end)
            && let Some(&above_len) = self.by_addr.get(&end)
        {
            self.remove(end, above_len);
            len += above_len;
        }
        self.insert(at, len);
    }

    /// The free ranges that start in `[from, to)`, by address.
    pub(crate) fn pieces(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_addr.range(from..to).map(|(&at, &len)| (at, len))
    }

    /// The free space: its total and its largest piece.
    pub(crate) fn free_space(&self) -> FreeSpace {
        FreeSpace {
            largest_free: self.by_size.last().map_or(0, |&(len, _)| len),
            total_free: self.by_addr.values().sum(),
        }
    }

    /// The free range that ends at `end`, if there is one: `(start, len)`.
    pub(crate) fn free_end(&self, end: u64) -> Option<(u64, u64)> {
        self.by_addr.range(..end).next_back().filter(|&(&at, &len)| at + len == end).map(|(&at, &len)| (at, len))
    }

    /// Moves the end of the region whose free range ends at `end` down to `new_end` (inside that
    /// free range): the memory past `new_end` is no longer the region's.
    pub(crate) fn cut_end(&mut self, end: u64, new_end: u64) {
        let Some((at, len)) = self.free_end(end) else { return };
        debug_assert!(at <= new_end && new_end <= at + len);
        self.remove(at, len);
        if new_end > at {
            self.insert(at, new_end - at);
        }
    }

    /// Takes the free range at `at` of exactly `len` bytes, if there is one.
    pub(crate) fn take_exact(&mut self, at: u64, len: u64) -> bool {
        if self.by_addr.get(&at) != Some(&len) {
            return false;
        }
        self.remove(at, len);
        true
    }

    /// Forgets every range and region.
    pub(crate) fn clear(&mut self) {
        self.by_addr.clear();
        self.by_size.clear();
        self.starts.clear();
    }
}

/// Best-fit sub-allocation in chunks taken from a source: a request goes to the smallest free
/// range that holds it, else to a new chunk of about the chunk size, a whole number of requests
/// of its size rounded up to the [`GRANULE`] (the request alone when that much is refused).
///
/// Made [`Chunks::growing`], and where the source has ranges that grow in place, there is one
/// chunk: a reserved range whose pages are mapped at its end by what the free range there lacks
/// for a request (as an expandable segment grows), so long-lived allocations lie end to end and
/// what is held unused is less than a page at the end plus the holes frees leave.
#[derive(Debug, Default)]
pub(crate) struct Chunks {
    /// Whether to grow one range in place where the source has ranges.
    growing: bool,
    /// That range: its base and the bytes mapped. `None` until the first growth, or where the
    /// source has none (`no_ranges`).
    range: Option<(CUdeviceptr, u64)>,
    no_ranges: bool,
    ranges: FreeRanges,
    /// Chunks held: base → size.
    chunks: BTreeMap<CUdeviceptr, u64>,
    /// Live hand-outs: address → aligned size.
    live: PointerMap<u64>,
    /// Whether free pages inside the range are kept mapped, to be given back when something on
    /// the device must take memory ([`Chunks::give_back_freed`]).
    holding_freed: bool,
    /// Pages inside the range given back while it kept its size, by offset from its base in
    /// [`GRANULE`]s; a hand-out over them maps them again.
    punched: BTreeSet<u64>,
    held: u64,
    /// The most held at once since [`Chunks::start_scope`].
    peak_held: u64,
}

impl Chunks {
    /// Chunks that grow one range in place where the source has ranges (see [`Chunks`]).
    pub(crate) fn growing() -> Self {
        Self { growing: true, ..Self::default() }
    }

    /// Grows the range in place so that a request of `size` fits at its end; false where the
    /// source has no ranges (chunks serve instead).
    fn grow_range(&mut self, source: &mut dyn Source, size: u64) -> Result<bool> {
        if !self.growing || self.no_ranges {
            return Ok(false);
        }
        let (base, mapped) = match self.range {
            Some(range) => range,
            None => match source.reserve_range()? {
                Some((base, _)) => {
                    self.ranges.add_region(base, 0, Vec::new());
                    (base, 0)
                }
                None => {
                    self.no_ranges = true;
                    return Ok(false);
                }
            },
        };
        self.range = Some((base, mapped));
        let tail = self.ranges.free_end(base + mapped).map_or(0, |(_, len)| len);
        let now = source.resize_range(base, mapped + (size - tail.min(size)))?;
        if now > mapped {
            self.ranges.give(base + mapped, now - mapped);
            self.held += now - mapped;
            self.peak_held = self.peak_held.max(self.held);
        }
        self.range = Some((base, now));
        Ok(true)
    }

    /// Unmaps the free pages at the end of the range while more than `keep` bytes are held.
    /// Returns the bytes given back.
    fn shrink_range(&mut self, source: &mut dyn Source, keep: u64) -> Result<u64> {
        let Some((base, mapped)) = self.range else { return Ok(0) };
        let Some((at, _)) = self.ranges.free_end(base + mapped) else { return Ok(0) };
        let excess = self.held.saturating_sub(keep);
        let new_end = (base + mapped - excess).max(at);
        let target = (new_end - base).next_multiple_of(GRANULE);
        if target >= mapped {
            return Ok(0);
        }
        let now = source.resize_range(base, target)?;
        self.ranges.cut_end(base + mapped, base + now);
        self.range = Some((base, now));
        // Pages given back earlier went with the end without being mapped.
        let gone = self.punched.split_off(&(now / GRANULE)).len() as u64 * GRANULE;
        let unmapped = (mapped - now).saturating_sub(gone);
        self.held -= unmapped;
        Ok(unmapped)
    }

    /// `size` bytes (aligned), from a free range or a new chunk of at least `chunk_bytes`.
    pub(crate) fn alloc(&mut self, source: &mut dyn Source, size: u64, chunk_bytes: u64) -> Result<CUdeviceptr> {
        let ptr = match self.ranges.take(size) {
            Some(ptr) => ptr,
            None => {
                let grown = if self.grow_range(source, size)? { self.ranges.take(size) } else { None };
                match grown {
                    Some(ptr) => ptr,
                    None => {
                        self.grow(source, size, chunk_bytes)?;
                        self.ranges.take(size).expect("a new chunk holds the request")
                    }
                }
            }
        };
        if let Err(error) = self.fill_punched(source, ptr, size) {
            self.ranges.give(ptr, size);
            return Err(error);
        }
        self.live.insert(ptr, size);
        Ok(ptr)
    }

    /// Maps again the pages given back inside the range that `[ptr, ptr + size)` lies on.
    fn fill_punched(&mut self, source: &mut dyn Source, ptr: CUdeviceptr, size: u64) -> Result<()> {
        let Some((base, _)) = self.range.filter(|_| !self.punched.is_empty()) else { return Ok(()) };
        if ptr < base {
            return Ok(());
        }
        let pages: Vec<u64> =
            self.punched.range((ptr - base) / GRANULE..(ptr - base + size).div_ceil(GRANULE)).copied().collect();
        if pages.is_empty() {
            return Ok(());
        }
        let filled = source.fill_range(base, ptr - base, size)?;
        for page in pages {
            self.punched.remove(&page);
        }
        self.held += filled;
        self.peak_held = self.peak_held.max(self.held);
        Ok(())
    }

    /// A hand-out inside the range was freed: the pages it leaves free stay mapped, for the
    /// next hand-out, until the device needs memory ([`Chunks::give_back_freed`]).
    pub(crate) fn freed_in_range(&mut self, source: &mut dyn Source, ptr: CUdeviceptr) {
        let Some((base, mapped)) = self.range else { return };
        if self.holding_freed || ptr < base || ptr >= base + mapped {
            return;
        }
        self.holding_freed = true;
        source.hold_freed(true);
    }

    /// Something on the device is about to take `bytes`: gives back that much of the free pages
    /// inside the range, or all of them if fewer: its free end first (no hand-out lies above
    /// it), then the first whole pages of its largest free ranges, as many as are still wanted.
    /// Only what is asked goes back: a page given back and mapped again for the next hand-out
    /// costs some 70 µs on an H200, create to release, and two pools that gave each other
    /// everything would trade their pages every step. Returns the bytes given back.
    pub(crate) fn give_back_freed(&mut self, source: &mut dyn Source, bytes: u64) -> Result<u64> {
        let Some((base, _)) = self.range.filter(|_| self.holding_freed) else { return Ok(0) };
        let mut given = self.shrink_range(source, self.held.saturating_sub(bytes))?;
        let mapped = self.range.map_or(0, |(_, mapped)| mapped);
        let mut free: Vec<(u64, u64)> = self
            .ranges
            .pieces(base, base + mapped)
            .filter(|&(at, len)| len >= GRANULE && at + len != base + mapped)
            .map(|(at, len)| (len, at))
            .collect();
        free.sort_unstable_by(|a, b| b.cmp(a));
        for (len, at) in free {
            if given >= bytes {
                break;
            }
            // The range's first whole pages not given back yet, as many as are still wanted.
            let (first, end) = ((at - base).div_ceil(GRANULE), (at - base + len) / GRANULE);
            let wanted = (bytes - given).div_ceil(GRANULE) as usize;
            let Some(last) = (first..end).filter(|page| !self.punched.contains(page)).take(wanted).last() else {
                continue;
            };
            let unmapped = source.punch_range(base, first * GRANULE, (last + 1 - first) * GRANULE)?;
            if unmapped > 0 {
                self.punched.extend(first..=last);
                self.held -= unmapped;
                given += unmapped;
            }
        }
        if given < bytes {
            // Everything it kept went back.
            self.holding_freed = false;
            source.hold_freed(false);
        }
        Ok(given)
    }

    /// Takes a chunk for a request of `size`: as many requests of that size as `chunk_bytes`
    /// holds (at least one), rounded up to the granule, so a chunk's unused end is less than a
    /// granule and open to smaller requests; the request alone if the device refuses that.
    /// (A fixed chunk size would leave a tail per chunk as large as a request that just failed
    /// to fit: 16 MiB of every 64 MiB chunk for 24 MiB requests.)
    fn grow(&mut self, source: &mut dyn Source, size: u64, chunk_bytes: u64) -> Result<()> {
        let wanted = (size * (chunk_bytes / size).max(1)).next_multiple_of(GRANULE);
        let is_oom = |result: &Result<CUdeviceptr>| matches!(result, Err(Error::Driver(e)) if e.is_out_of_memory());
        let mut attempt = source.alloc(wanted);
        let mut len = wanted;
        if is_oom(&attempt) && wanted > size {
            attempt = source.alloc(size);
            len = size;
        }
        if is_oom(&attempt) && self.release_empty(source, 0)? > 0 {
            // Empty chunks went back; after a wait the device sees them idle and can release
            // them for this request: the strategy's own cache is not what it runs out over.
            source.synchronize()?;
            attempt = source.alloc(size);
            len = size;
        }
        let base = attempt?;
        self.chunks.insert(base, len);
        self.ranges.add_region(base, len, Vec::new());
        self.held += len;
        self.peak_held = self.peak_held.max(self.held);
        Ok(())
    }

    /// Lends the unused end of the last page the range's hand-outs touch, as a hand-out of its
    /// own: `(address, bytes)`, or `None` where there is no range or its end is free from a page
    /// boundary on. `current`, an earlier loan, comes back first ([`Chunks::free`]), so the end
    /// is found as if it had not been lent: the same loan again while nothing was handed out or
    /// freed around it, a lower one once the hand-outs below it were freed (their pages can then
    /// go back), a higher one once others came past it. See
    /// [`Allocator::lend_tail`](super::Allocator::lend_tail).
    pub(crate) fn lend_tail(&mut self, current: Option<(CUdeviceptr, u64)>) -> Option<(CUdeviceptr, u64)> {
        if let Some((ptr, _)) = current {
            self.free(ptr);
        }
        let (base, mapped) = self.range?;
        let (at, free) = self.ranges.free_end(base + mapped)?;
        let len = (at - base).next_multiple_of(GRANULE).min(mapped) - (at - base);
        if len == 0 || len > free || !self.ranges.take_exact(at, free) {
            return None;
        }
        if free > len {
            self.ranges.give(at + len, free - len);
        }
        self.live.insert(at, len);
        Some((at, len))
    }

    /// Gives back a hand-out; its aligned size, or `None` if it is not one of these chunks'.
    pub(crate) fn free(&mut self, ptr: CUdeviceptr) -> Option<u64> {
        let size = self.live.remove(&ptr)?;
        self.ranges.give(ptr, size);
        Some(size)
    }

    /// Whether `ptr` is a live hand-out of these chunks.
    #[cfg(test)]
    pub(crate) fn contains(&self, ptr: CUdeviceptr) -> bool {
        self.live.contains_key(&ptr)
    }

    /// Takes back every hand-out still live (the scope ended; leaked buffers too).
    pub(crate) fn reclaim(&mut self) {
        if self.live.is_empty() {
            return;
        }
        self.live.clear();
        self.ranges.clear();
        for (&base, &len) in &self.chunks {
            self.ranges.add_region(base, len, Vec::new());
        }
        if let Some((base, mapped)) = self.range {
            self.ranges.add_region(base, mapped, Vec::new());
        }
    }

    /// Takes back every hand-out still live but those in `kept` (address, aligned size):
    /// allocations carried into the next scope, which stay live where they are.
    pub(crate) fn reclaim_keeping(&mut self, kept: &[(CUdeviceptr, u64)]) {
        if kept.is_empty() {
            return self.reclaim();
        }
        self.live.clear();
        self.ranges.clear();
        let inside =
            |base: u64, len: u64| kept.iter().copied().filter(|&(at, _)| at >= base && at < base + len).collect();
        for (&base, &len) in &self.chunks {
            self.ranges.add_region(base, len, inside(base, len));
        }
        if let Some((base, mapped)) = self.range {
            self.ranges.add_region(base, mapped, inside(base, mapped));
        }
        self.live.extend(kept.iter().copied());
    }

    /// Gives back chunks with nothing handed out, largest first, while more than `keep` bytes
    /// are held. Returns the bytes given back.
    pub(crate) fn release_empty(&mut self, source: &mut dyn Source, keep: u64) -> Result<u64> {
        let mut empty: Vec<(u64, CUdeviceptr)> = self
            .chunks
            .iter()
            .filter(|&(&base, &len)| self.ranges.is_free(base, len))
            .map(|(&base, &len)| (len, base))
            .collect();
        empty.sort_unstable_by(|a, b| b.cmp(a));
        let mut released = self.shrink_range(source, keep)?;
        for (len, base) in empty {
            if self.held <= keep {
                break;
            }
            if self.held - len < keep {
                continue;
            }
            self.ranges.remove_region(base, len);
            self.chunks.remove(&base);
            self.held -= len;
            released += len;
            source.free(base, len)?;
        }
        Ok(released)
    }

    /// Gives back the chunk holding `ptr` if nothing in it is handed out any more. Returns the
    /// bytes given back.
    pub(crate) fn release_if_empty(&mut self, source: &mut dyn Source, ptr: CUdeviceptr) -> Result<u64> {
        let Some((&base, &len)) = self.chunks.range(..=ptr).next_back() else { return Ok(0) };
        if ptr >= base + len || !self.ranges.remove_region(base, len) {
            return Ok(0);
        }
        self.chunks.remove(&base);
        self.held -= len;
        source.free(base, len)?;
        Ok(len)
    }

    /// Gives every chunk back (the pool is going away); the hand-outs are forgotten.
    pub(crate) fn release_all(&mut self, source: &mut dyn Source) -> Result<()> {
        let mut outcome = Ok(());
        for (base, len) in std::mem::take(&mut self.chunks) {
            outcome = outcome.and(source.free(base, len));
        }
        if let Some((base, _)) = self.range.take() {
            outcome = outcome.and(source.free_range(base));
        }
        if std::mem::take(&mut self.holding_freed) {
            source.hold_freed(false);
        }
        self.punched.clear();
        self.live.clear();
        self.ranges.clear();
        self.held = 0;
        outcome
    }

    /// A scope begins: the peak of held bytes starts over from what is held.
    pub(crate) fn start_scope(&mut self) {
        self.peak_held = self.held;
    }

    /// Bytes held in chunks.
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// The most held at once since the scope began.
    pub(crate) fn peak_held(&self) -> u64 {
        self.peak_held
    }

    /// The free space inside the chunks.
    pub(crate) fn free_space(&self) -> FreeSpace {
        self.ranges.free_space()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::fake::FakeSource;

    const MIB: u64 = 1 << 20;

    #[test]
    fn ranges_are_best_fit_and_merge_only_inside_a_region() {
        let mut ranges = FreeRanges::default();
        ranges.add_region(0, 100, vec![(10, 10), (50, 20)]);
        ranges.add_region(100, 50, Vec::new());
        assert_eq!(ranges.free_space(), FreeSpace { largest_free: 50, total_free: 120 });
        assert_eq!(ranges.take(10), Some(0), "the smallest range that holds it");
        assert_eq!(ranges.take(30), Some(20));
        // [70, 100) and [100, 150) are adjacent but in two regions: no range spans them.
        assert_eq!(ranges.take(60), None);
        ranges.give(0, 10);
        ranges.give(20, 30);
        assert!(!ranges.is_free(0, 100), "[10, 20) and [50, 70) are still handed out");
        ranges.give(10, 10);
        ranges.give(50, 20);
        assert!(ranges.is_free(0, 100) && ranges.is_free(100, 50), "merged back, each in its region");
        assert!(ranges.remove_region(100, 50));
        assert_eq!(ranges.free_space().total_free, 100);
    }

    #[test]
    fn requests_are_packed_end_to_end_in_chunks() {
        let (mut source, mut chunks) = (FakeSource::new(64 * MIB), Chunks::default());
        // Eight requests of 2.25 MiB: the pool would reserve 4 MiB apiece (32 MiB); 18 MiB
        // chunks hold them all.
        let size = 9 * MIB / 4;
        let ptrs: Vec<_> = (0..8).map(|_| chunks.alloc(&mut source, size, 18 * MIB).unwrap()).collect();
        assert_eq!((source.allocs, chunks.held()), (1, 18 * MIB));
        assert_eq!(chunks.free_space().total_free, 0);
        for pair in ptrs.windows(2) {
            assert_eq!(pair[1] - pair[0], size, "end to end");
        }
        assert_eq!(chunks.free(ptrs[3]), Some(size));
        assert_eq!(chunks.alloc(&mut source, size, 18 * MIB).unwrap(), ptrs[3], "a freed range is reused");
        assert_eq!(chunks.free(12345), None, "not a hand-out");
    }

    #[test]
    fn a_chunk_holds_whole_requests_of_the_size_that_opens_it() {
        let (mut source, mut chunks) = (FakeSource::new(1 << 30), Chunks::default());
        for _ in 0..4 {
            chunks.alloc(&mut source, 24 * MIB, 64 * MIB).unwrap();
        }
        assert_eq!((source.allocs, chunks.held()), (2, 96 * MIB), "two chunks of two, no tails");
    }

    #[test]
    fn a_chunk_the_device_refuses_shrinks_to_the_request() {
        let (mut source, mut chunks) = (FakeSource::new(3 * MIB), Chunks::default());
        chunks.alloc(&mut source, MIB, 16 * MIB).unwrap();
        assert_eq!(chunks.held(), MIB, "16 MiB refused: the request alone");
        assert!(chunks.alloc(&mut source, 4 * MIB, 16 * MIB).is_err(), "more than the device");
    }

    #[test]
    fn empty_chunks_go_back_before_a_request_fails() {
        let (mut source, mut chunks) = (FakeSource::new(8 * MIB), Chunks::default());
        let a = chunks.alloc(&mut source, 3 * MIB, 2 * MIB).unwrap();
        chunks.free(a);
        let syncs = source.syncs;
        chunks.alloc(&mut source, 6 * MIB, 2 * MIB).unwrap();
        assert_eq!((source.held(), chunks.held()), (6 * MIB, 6 * MIB), "the empty 4 MiB chunk made room");
        assert_eq!(source.syncs, syncs + 1);
        assert!(chunks.alloc(&mut source, 4 * MIB, 2 * MIB).is_err(), "nothing empty left to give back");
    }

    #[test]
    fn empty_chunks_go_back_down_to_what_is_kept() {
        let (mut source, mut chunks) = (FakeSource::new(64 * MIB), Chunks::default());
        let a = chunks.alloc(&mut source, 3 * MIB, 2 * MIB).unwrap();
        let b = chunks.alloc(&mut source, 5 * MIB, 2 * MIB).unwrap();
        let c = chunks.alloc(&mut source, 2 * MIB, 2 * MIB).unwrap();
        assert_eq!(chunks.held(), 4 * MIB + 6 * MIB + 2 * MIB);
        chunks.free(b);
        assert_eq!(chunks.release_empty(&mut source, 0).unwrap(), 6 * MIB, "only the emptied chunk");
        assert_eq!(source.held(), 6 * MIB);
        chunks.reclaim();
        assert!(!chunks.contains(a) && !chunks.contains(c), "the scope's hand-outs are taken back");
        assert_eq!(chunks.release_empty(&mut source, 4 * MIB).unwrap(), 2 * MIB, "keeps 4 MiB");
        chunks.release_all(&mut source).unwrap();
        assert_eq!(source.held(), 0);
    }
}
