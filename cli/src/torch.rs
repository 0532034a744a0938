//! Models of PyTorch's native caching allocator (`CUDACachingAllocator`), in its default mode and
//! with `expandable_segments:True`, to replay a trace against the allocator users compare with.
//!
//! These are models, built from the rules of PyTorch's `c10/cuda/CUDACachingAllocator.cpp`
//! (pytorch/pytorch commit 001074d2); each rule below names the function it models. One [`TorchAllocator`] models one device: its physical
//! memory is the device's capacity, and `cudaMalloc` (or mapping a page) succeeds while the bytes
//! reserved stay within it. Nothing else is modelled: no CUDA context overhead, no cross-stream
//! uses (`record_stream`, events: every free in a replay is on the allocation's stream), no
//! `garbage_collection_threshold`, no CUDA graph pools.
//!
//! Rules of both modes:
//!
//! - **Rounding** (`round_size`): every request is rounded up to a multiple of 512 bytes
//!   (`kMinBlockSize`), 512 at least.
//! - **Two pools per stream** (`get_pool`): requests of at most 1 MiB (`kSmallSize`) go to
//!   the small pool, larger ones to the large pool; blocks are reused only by requests of the
//!   same stream and pool (`BlockComparatorSize` orders by stream first).
//! - **Best fit** (`get_free_block`): the smallest cached block that holds the request, the
//!   lowest address on ties.
//! - **`max_split_size` at its default**: unlimited, so every block may be split and
//!   the oversize rules (`get_free_block`'s limits for blocks ≥ `max_split_size`,
//!   `release_available_cached_blocks`) never apply.
//! - **Out of memory** (`malloc`): when the device cannot reserve more, free every cached
//!   segment that is wholly free (`release_cached_blocks`) and retry once; then fail.
//!
//! Default mode ([`TorchMode::Caching`]):
//!
//! - **Segments** (`get_allocation_size`): a small request that fits no cached block
//!   reserves a 2 MiB segment (`kSmallBuffer`); a large one below 10 MiB (`kMinLargeAlloc`) a
//!   20 MiB segment (`kLargeBuffer`); a larger one its size rounded up to 2 MiB (`kRoundLarge`).
//! - **Splitting** (`should_split`): the request takes the front of the chosen block; the
//!   rest becomes a free block when it is at least 512 bytes in the small pool, more than 1 MiB in
//!   the large pool; otherwise the allocation keeps it. Freed blocks merge with free neighbours of
//!   their segment (`try_merge_blocks`).
//!
//! Expandable mode ([`TorchMode::Expandable`]):
//!
//! - **One growing segment per stream and pool** (`find_expandable_block`): a virtual range of
//!   9/8 of the device's memory, mapped in pages of 2 MiB (small pool) or 20 MiB (large pool);
//!   reserved bytes are mapped bytes (`map_block`). A second segment is made only when the first
//!   has no room left in its virtual range.
//! - **Growth at the lowest fitting address** (`find_expandable_block`,
//!   `try_allocate_expandable_block`): the request (rounded to 512, not to a segment size) is
//!   placed at the lowest unmapped range, together with a free block just before it, whose free
//!   and unmapped space holds it; the pages it needs are mapped there.
//! - **Best fit by expandable size** (`get_free_block`): a free block followed by unmapped space
//!   counts as large as it could grow, so interior blocks that fit are preferred.
//! - **Splitting** (`should_split`): any remainder of at least 512 bytes is split off, in both pools.
//! - **Unmapping** (`release_blocks`, `unmap_block`): freed memory stays mapped (cached), as in the
//!   default mode; on out of memory every page lying wholly inside a free block is unmapped, mid-
//!   segment holes too, and the allocation retried.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Every request is rounded up to a multiple of this (`kMinBlockSize`).
pub const MIN_BLOCK: u64 = 512;
/// Requests up to this go to the small pool (`kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;
/// The small pool's segment and page (`kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Large requests below this take a [`LARGE_BUFFER`] segment (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// The large pool's segment for mid-sized requests, and its page in expandable mode
/// (`kLargeBuffer`).
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Larger requests reserve their size rounded up to this (`kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 << 20;

/// Which configuration of the caching allocator is modelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TorchMode {
    /// The default: `cudaMalloc`ed segments of 2 MiB, 20 MiB or the rounded request.
    Caching,
    /// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    Expandable,
}

/// The request's size after rounding (`round_size`).
pub fn round_size(bytes: u64) -> u64 {
    bytes.max(1).next_multiple_of(MIN_BLOCK)
}

/// Whether a rounded request goes to the small pool.
pub fn is_small(size: u64) -> bool {
    size <= SMALL_SIZE
}

/// The segment the default mode reserves for a rounded request that fits no cached block
/// (`get_allocation_size`).
pub fn allocation_size(size: u64) -> u64 {
    if is_small(size) {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.next_multiple_of(ROUND_LARGE)
    }
}

/// Whether a block of `block` bytes chosen for a rounded request of `size` is split
/// (`should_split`, with `max_split_size` unlimited).
pub fn should_split(mode: TorchMode, block: u64, size: u64) -> bool {
    let remaining = block - size;
    if is_small(size) || mode == TorchMode::Expandable { remaining >= MIN_BLOCK } else { remaining > SMALL_SIZE }
}

/// A pool: a stream's small or large blocks.
type PoolKey = (u16, bool);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Allocated,
    Free,
    Unmapped,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    size: u64,
    state: State,
    segment: u32,
}

#[derive(Clone, Copy, Debug)]
struct Segment {
    base: u64,
    size: u64,
    pool: PoolKey,
    /// Its page in expandable mode; the reservation granule otherwise.
    page: u64,
    released: bool,
}

/// The allocator could not serve a request even after freeing its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TorchOom {
    /// Bytes requested.
    pub requested: u64,
    /// Bytes reserved when it gave up.
    pub reserved: u64,
}

/// A reserved range of one pool, as the breakdown reads it: a `cudaMalloc`ed segment, or a run of
/// mapped pages of an expandable segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReservedRange {
    /// Start address.
    pub base: u64,
    /// Length in bytes.
    pub size: u64,
    /// The reservation granule: 2 MiB for `cudaMalloc`ed segments, the page when mapped.
    pub granule: u64,
    /// The pool: stream index and whether it is the small pool.
    pub pool: (u16, bool),
}

/// A model of one device's caching allocator. See the [module docs](self) for its rules.
#[derive(Debug)]
pub struct TorchAllocator {
    mode: TorchMode,
    capacity: u64,
    reserved: u64,
    /// Every block by address; segments never share addresses.
    blocks: BTreeMap<u64, Block>,
    segments: Vec<Segment>,
    /// Free (mapped) blocks per pool, by (size, address).
    free: HashMap<PoolKey, BTreeSet<(u64, u64)>>,
    /// Unmapped blocks per pool, by address (expandable mode).
    unmapped: HashMap<PoolKey, BTreeSet<u64>>,
    next_base: u64,
}

impl TorchAllocator {
    /// A model of a device of `capacity` bytes, nothing reserved.
    pub fn new(mode: TorchMode, capacity: u64) -> Self {
        Self {
            mode,
            capacity,
            reserved: 0,
            blocks: BTreeMap::new(),
            segments: Vec::new(),
            free: HashMap::new(),
            unmapped: HashMap::new(),
            next_base: 1 << 40,
        }
    }

    /// Bytes reserved: `cudaMalloc`ed segments, or mapped pages.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Bytes the allocation at `addr` holds (its block), if it is live.
    pub fn block_size(&self, addr: u64) -> Option<u64> {
        self.blocks.get(&addr).filter(|b| b.state == State::Allocated).map(|b| b.size)
    }

    /// Allocates `bytes` on stream `stream` (an index), returning its address.
    pub fn alloc(&mut self, bytes: u64, stream: u16) -> Result<u64, TorchOom> {
        // More than the device holds can never be served, and rounding it could overflow.
        if bytes > self.capacity {
            return Err(TorchOom { requested: bytes, reserved: self.reserved });
        }
        let size = round_size(bytes);
        let pool = (stream, is_small(size));
        let found = match self.free_block(pool, size) {
            Some(addr) => Some(addr),
            None => self.grow(pool, size).or_else(|| {
                self.release_cached();
                self.grow(pool, size)
            }),
        };
        let addr = found.ok_or(TorchOom { requested: bytes, reserved: self.reserved })?;
        self.take(pool, addr, size);
        Ok(addr)
    }

    /// Frees the allocation at `addr`; the block merges with free neighbours and is cached.
    ///
    /// # Panics
    ///
    /// If `addr` is not a live allocation of this model (a replay frees only what it allocated).
    pub fn free(&mut self, addr: u64) {
        let block = self.blocks.get_mut(&addr).filter(|b| b.state == State::Allocated).expect("a live allocation");
        block.state = State::Free;
        let pool = self.segments[block.segment as usize].pool;
        self.insert_free(pool, addr);
    }

    /// The reserved ranges, for the breakdown.
    pub fn reserved_ranges(&self) -> Vec<ReservedRange> {
        let mut ranges: Vec<ReservedRange> = Vec::new();
        for (&addr, block) in &self.blocks {
            if block.state == State::Unmapped {
                continue;
            }
            let segment = &self.segments[block.segment as usize];
            let granule = match self.mode {
                TorchMode::Caching => ROUND_LARGE,
                TorchMode::Expandable => segment.page,
            };
            match ranges.last_mut() {
                Some(last)
                    if last.base + last.size == addr
                        && last.pool == segment.pool
                        && last.granule == granule
                        && self.segment_of(last.base) == Some(block.segment) =>
                {
                    last.size += block.size;
                }
                _ => ranges.push(ReservedRange { base: addr, size: block.size, granule, pool: segment.pool }),
            }
        }
        ranges
    }

    fn segment_of(&self, addr: u64) -> Option<u32> {
        self.blocks.get(&addr).map(|b| b.segment)
    }

    /// Best fit among the pool's free blocks (`get_free_block`).
    fn free_block(&self, pool: PoolKey, size: u64) -> Option<u64> {
        let set = self.free.get(&pool)?;
        let mut candidates = set.range((size, 0)..);
        let mut best = *candidates.next()?;
        if self.mode == TorchMode::Expandable {
            // Walk to larger blocks while their expandable size is smaller.
            for next in candidates {
                if self.expandable_size(next.1) < self.expandable_size(best.1) {
                    best = *next;
                } else {
                    break;
                }
            }
        }
        Some(best.1)
    }

    /// A free block's size plus the unmapped block right after it in its segment.
    fn expandable_size(&self, addr: u64) -> u64 {
        let block = self.blocks[&addr];
        block.size + self.next(addr).filter(|(_, b)| b.state == State::Unmapped).map_or(0, |(_, b)| b.size)
    }

    /// The block after `addr` in the same segment.
    fn next(&self, addr: u64) -> Option<(u64, Block)> {
        let block = self.blocks[&addr];
        self.blocks
            .range(addr + 1..)
            .next()
            .filter(|&(&at, next)| at == addr + block.size && next.segment == block.segment)
            .map(|(&at, next)| (at, *next))
    }

    /// The block before `addr` in the same segment.
    fn prev(&self, addr: u64) -> Option<(u64, Block)> {
        let block = self.blocks[&addr];
        self.blocks
            .range(..addr)
            .next_back()
            .filter(|&(&at, prev)| at + prev.size == addr && prev.segment == block.segment)
            .map(|(&at, prev)| (at, *prev))
    }

    /// Reserves memory for a request no cached block fits (`alloc_block`); the new memory is a
    /// free block of `pool` holding at least `size` bytes.
    fn grow(&mut self, pool: PoolKey, size: u64) -> Option<u64> {
        match self.mode {
            TorchMode::Caching => {
                let bytes = allocation_size(size);
                if self.reserved + bytes > self.capacity {
                    return None;
                }
                let addr = self.new_segment(pool, bytes, ROUND_LARGE, State::Free);
                self.reserved += bytes;
                self.insert_free(pool, addr);
                Some(addr)
            }
            TorchMode::Expandable => self.grow_expandable(pool, size),
        }
    }

    fn new_segment(&mut self, pool: PoolKey, size: u64, page: u64, state: State) -> u64 {
        let base = self.next_base.next_multiple_of(LARGE_BUFFER);
        self.next_base = base + size;
        let segment = self.segments.len() as u32;
        self.segments.push(Segment { base, size, pool, page, released: false });
        self.blocks.insert(base, Block { size, state, segment });
        base
    }

    /// `find_expandable_block` and `try_allocate_expandable_block`.
    fn grow_expandable(&mut self, pool: PoolKey, size: u64) -> Option<u64> {
        let allocatable = |b: &Block| b.state != State::Allocated;
        let mut chosen = None;
        for &addr in self.unmapped.get(&pool).into_iter().flatten() {
            let start = match self.prev(addr) {
                Some((at, prev)) if prev.state == State::Free => at,
                _ => addr,
            };
            let (mut bytes, mut at) = (0u64, Some(start));
            while bytes < size
                && let Some(here) = at
                && allocatable(&self.blocks[&here])
            {
                bytes += self.blocks[&here].size;
                at = self.next(here).map(|(next, _)| next);
            }
            if bytes >= size {
                chosen = Some(start);
                break;
            }
        }
        let mut candidate = match chosen {
            Some(addr) => addr,
            None => {
                let page = if pool.1 { SMALL_BUFFER } else { LARGE_BUFFER };
                let virtual_size = (self.capacity / 8 * 9).next_multiple_of(page);
                let addr = self.new_segment(pool, virtual_size, page, State::Unmapped);
                self.unmapped.entry(pool).or_default().insert(addr);
                addr
            }
        };
        if self.blocks[&candidate].state == State::Unmapped {
            let want = self.blocks[&candidate].size.min(size);
            candidate = self.map(pool, candidate, want)?;
        }
        while self.blocks[&candidate].size < size {
            let (next, block) = self.next(candidate).expect("the space was counted");
            let want = (size - self.blocks[&candidate].size).min(block.size);
            candidate = self.map(pool, next, want)?;
        }
        Some(candidate)
    }

    /// Maps the pages holding the first `bytes` of the unmapped block at `addr` (`map_block`); the
    /// mapped part merges with free neighbours. Returns the free block it became part of.
    fn map(&mut self, pool: PoolKey, addr: u64, bytes: u64) -> Option<u64> {
        let block = self.blocks[&addr];
        let page = self.segments[block.segment as usize].page;
        let mapped = bytes.next_multiple_of(page).min(block.size);
        if self.reserved + mapped > self.capacity {
            return None;
        }
        self.reserved += mapped;
        if let Some(set) = self.unmapped.get_mut(&pool) {
            set.remove(&addr);
        }
        if mapped < block.size {
            self.blocks.insert(addr + mapped, Block { size: block.size - mapped, ..block });
            self.unmapped.entry(pool).or_default().insert(addr + mapped);
        }
        self.blocks.insert(addr, Block { size: mapped, state: State::Free, segment: block.segment });
        Some(self.insert_free(pool, addr))
    }

    /// Marks the free block at `addr` as cached: merges it with free neighbours and indexes it.
    /// Returns the merged block's address.
    fn insert_free(&mut self, pool: PoolKey, mut addr: u64) -> u64 {
        let set = self.free.entry(pool).or_default();
        if let Some((at, prev)) = self.blocks.range(..addr).next_back().map(|(&a, b)| (a, *b))
            && prev.state == State::Free
            && at + prev.size == addr
            && prev.segment == self.blocks[&addr].segment
        {
            set.remove(&(prev.size, at));
            let block = self.blocks.remove(&addr).expect("indexed");
            self.blocks.get_mut(&at).expect("indexed").size += block.size;
            addr = at;
        }
        let block = self.blocks[&addr];
        if let Some((&at, &next)) = self.blocks.range(addr + 1..).next()
            && next.state == State::Free
            && at == addr + block.size
            && next.segment == block.segment
        {
            set.remove(&(next.size, at));
            self.blocks.remove(&at);
            self.blocks.get_mut(&addr).expect("indexed").size += next.size;
        }
        set.insert((self.blocks[&addr].size, addr));
        addr
    }

    /// Allocates `size` bytes at the start of the free block at `addr`, splitting off the rest
    /// when [`should_split`] says so.
    fn take(&mut self, pool: PoolKey, addr: u64, size: u64) {
        let block = self.blocks[&addr];
        if let Some(set) = self.free.get_mut(&pool) {
            set.remove(&(block.size, addr));
        }
        if should_split(self.mode, block.size, size) {
            self.blocks.insert(addr, Block { size, state: State::Allocated, ..block });
            self.blocks.insert(addr + size, Block { size: block.size - size, state: State::Free, ..block });
            self.free.entry(pool).or_default().insert((block.size - size, addr + size));
        } else {
            self.blocks.insert(addr, Block { state: State::Allocated, ..block });
        }
    }

    /// On out of memory, gives cached memory back (`release_cached_blocks`): in the default mode
    /// every segment that is one free block; in expandable mode every page wholly inside a free
    /// block, and a segment left wholly unmapped.
    fn release_cached(&mut self) {
        let free: Vec<(PoolKey, u64, u64)> =
            self.free.iter().flat_map(|(&pool, set)| set.iter().map(move |&(size, addr)| (pool, size, addr))).collect();
        for (pool, size, addr) in free {
            let segment = self.blocks[&addr].segment;
            let seg = self.segments[segment as usize];
            match self.mode {
                TorchMode::Caching => {
                    if addr == seg.base && size == seg.size {
                        if let Some(set) = self.free.get_mut(&pool) {
                            set.remove(&(size, addr));
                        }
                        self.blocks.remove(&addr);
                        self.reserved -= size;
                        self.segments[segment as usize].released = true;
                    }
                }
                TorchMode::Expandable => self.unmap(pool, addr),
            }
        }
        if self.mode == TorchMode::Expandable {
            for (index, seg) in self.segments.iter_mut().enumerate() {
                let whole =
                    self.blocks.get(&seg.base).is_some_and(|b| b.size == seg.size && b.state == State::Unmapped);
                if !seg.released && whole && self.blocks[&seg.base].segment == index as u32 {
                    seg.released = true;
                    self.blocks.remove(&seg.base);
                    if let Some(set) = self.unmapped.get_mut(&seg.pool) {
                        set.remove(&seg.base);
                    }
                }
            }
        }
    }

    /// Unmaps the pages wholly inside the free block at `addr` (`unmap_block`).
    fn unmap(&mut self, pool: PoolKey, addr: u64) {
        let block = self.blocks[&addr];
        let page = self.segments[block.segment as usize].page;
        let (begin, end) = (addr.next_multiple_of(page), (addr + block.size) / page * page);
        if begin >= end {
            return;
        }
        if let Some(set) = self.free.get_mut(&pool) {
            set.remove(&(block.size, addr));
        }
        self.blocks.remove(&addr);
        if begin > addr {
            self.blocks.insert(addr, Block { size: begin - addr, ..block });
            self.free.entry(pool).or_default().insert((begin - addr, addr));
        }
        if addr + block.size > end {
            self.blocks.insert(end, Block { size: addr + block.size - end, ..block });
            self.free.entry(pool).or_default().insert((addr + block.size - end, end));
        }
        self.reserved -= end - begin;
        let (mut start, mut size) = (begin, end - begin);
        let unmapped = self.unmapped.entry(pool).or_default();
        if let Some((&at, &prev)) = self.blocks.range(..start).next_back()
            && prev.state == State::Unmapped
            && at + prev.size == start
            && prev.segment == block.segment
        {
            unmapped.remove(&at);
            self.blocks.remove(&at);
            start = at;
            size += prev.size;
        }
        if let Some(&next) = self.blocks.get(&(start + size))
            && next.state == State::Unmapped
            && next.segment == block.segment
        {
            unmapped.remove(&(start + size));
            self.blocks.remove(&(start + size));
            size += next.size;
        }
        self.blocks.insert(start, Block { size, state: State::Unmapped, segment: block.segment });
        unmapped.insert(start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn caching() -> TorchAllocator {
        TorchAllocator::new(TorchMode::Caching, GIB)
    }

    fn expandable() -> TorchAllocator {
        TorchAllocator::new(TorchMode::Expandable, GIB)
    }

    #[test]
    fn a_request_larger_than_the_device_runs_out_of_memory_whatever_its_size() {
        for mut model in [caching(), expandable()] {
            for bytes in [GIB + 1, u64::MAX - 1, u64::MAX] {
                let refused = model.alloc(bytes, 0).expect_err("larger than the device");
                assert_eq!((refused.requested, refused.reserved), (bytes, 0));
            }
            // Nothing was reserved on the way, and the device still serves what fits.
            assert_eq!(model.reserved(), 0);
            assert!(model.alloc(GIB / 2, 0).is_ok());
        }
    }

    #[test]
    fn requests_are_rounded_to_512_bytes() {
        assert_eq!((round_size(0), round_size(1), round_size(512), round_size(513)), (512, 512, 512, 1024));
        let mut torch = caching();
        let a = torch.alloc(100, 0).unwrap();
        let b = torch.alloc(600, 0).unwrap();
        assert_eq!((torch.block_size(a), torch.block_size(b)), (Some(512), Some(1024)));
        assert_eq!(b - a, 512, "the next block starts where the rounded one ends");
    }

    #[test]
    fn segment_sizes_follow_the_request_size() {
        assert_eq!(allocation_size(512), SMALL_BUFFER);
        assert_eq!(allocation_size(MIB), SMALL_BUFFER);
        assert_eq!(allocation_size(MIB + 512), LARGE_BUFFER);
        assert_eq!(allocation_size(10 * MIB - 512), LARGE_BUFFER);
        assert_eq!(allocation_size(10 * MIB), 10 * MIB);
        assert_eq!(allocation_size(11 * MIB), 12 * MIB);
        let mut torch = caching();
        torch.alloc(1000, 0).unwrap();
        assert_eq!(torch.reserved(), 2 * MIB);
        torch.alloc(3 * MIB, 0).unwrap();
        assert_eq!(torch.reserved(), 22 * MIB);
        // 17.5 MiB does not fit the 17 MiB left of that segment, and reserves its size rounded up to
        // 2 MiB.
        torch.alloc(17 * MIB + MIB / 2, 0).unwrap();
        assert_eq!(torch.reserved(), 40 * MIB);
    }

    #[test]
    fn small_and_large_pools_and_streams_do_not_share_blocks() {
        let mut torch = caching();
        let small = torch.alloc(4096, 0).unwrap();
        torch.free(small);
        // A large request does not use the cached 2 MiB small segment ...
        torch.alloc(2 * MIB, 0).unwrap();
        assert_eq!(torch.reserved(), 22 * MIB);
        // ... and another stream does not use stream 0's cached small block.
        torch.alloc(4096, 1).unwrap();
        assert_eq!(torch.reserved(), 24 * MIB);
        assert_eq!(torch.alloc(4096, 0).unwrap(), small, "its own stream reuses it");
    }

    #[test]
    fn the_best_fitting_block_is_chosen() {
        let mut torch = caching();
        // Three free blocks of 4, 1.5 and 3 MiB in one 20 MiB segment, kept apart by live ones.
        let a = torch.alloc(4 * MIB, 0).unwrap();
        let _k1 = torch.alloc(2 * MIB, 0).unwrap();
        let b = torch.alloc(3 * MIB / 2, 0).unwrap();
        let _k2 = torch.alloc(2 * MIB, 0).unwrap();
        let c = torch.alloc(3 * MIB, 0).unwrap();
        let _k3 = torch.alloc(2 * MIB, 0).unwrap();
        for addr in [a, b, c] {
            torch.free(addr);
        }
        assert_eq!(torch.alloc(5 * MIB / 4, 0).unwrap(), b, "1.5 MiB is the smallest that holds 1.25 MiB");
        assert_eq!(torch.alloc(5 * MIB / 2, 0).unwrap(), c);
    }

    #[test]
    fn large_blocks_keep_remainders_of_one_mib_or_less() {
        // A 20 MiB segment for 19.5 MiB leaves 0.5 MiB: not split in the large pool.
        let mut torch = caching();
        let a = torch.alloc(19 * MIB + MIB / 2, 0).unwrap();
        assert_eq!(torch.reserved(), 20 * MIB);
        assert_eq!(torch.block_size(a), Some(20 * MIB));
        // 3 MiB leaves 17 MiB: split, and the next request uses the rest.
        let mut torch = caching();
        let a = torch.alloc(3 * MIB, 0).unwrap();
        assert_eq!(torch.block_size(a), Some(3 * MIB));
        assert_eq!(torch.alloc(5 * MIB, 0).unwrap(), a + 3 * MIB);
        assert_eq!(torch.reserved(), 20 * MIB);
        // In the small pool, any remainder of 512 bytes is split off.
        assert!(should_split(TorchMode::Caching, 2 * MIB, 1536));
        assert!(!should_split(TorchMode::Caching, 20 * MIB, 19 * MIB));
        assert!(should_split(TorchMode::Expandable, 20 * MIB, 20 * MIB - 512));
    }

    #[test]
    fn max_split_size_is_unlimited_so_huge_blocks_split() {
        // A 1 GiB cached block serves a 100 MiB request and keeps the rest free: no oversize rule.
        let mut torch = TorchAllocator::new(TorchMode::Caching, 2 * GIB);
        let big = torch.alloc(GIB, 0).unwrap();
        torch.free(big);
        let small = torch.alloc(100 * MIB, 0).unwrap();
        assert_eq!(small, big);
        assert_eq!(torch.alloc(500 * MIB, 0).unwrap(), big + 100 * MIB);
        assert_eq!(torch.reserved(), GIB);
    }

    #[test]
    fn freed_neighbours_merge() {
        let mut torch = caching();
        let a = torch.alloc(2 * MIB, 0).unwrap();
        let b = torch.alloc(2 * MIB, 0).unwrap();
        let _c = torch.alloc(2 * MIB, 0).unwrap();
        torch.free(a);
        torch.free(b);
        assert_eq!(torch.alloc(4 * MIB, 0).unwrap(), a, "a and b merged into one 4 MiB block");
    }

    #[test]
    fn out_of_memory_frees_cached_segments_and_retries() {
        let mut torch = TorchAllocator::new(TorchMode::Caching, 40 * MIB);
        let a = torch.alloc(3 * MIB, 0).unwrap();
        let b = torch.alloc(4096, 0).unwrap();
        torch.free(a);
        torch.free(b);
        assert_eq!(torch.reserved(), 22 * MIB);
        // 30 MiB does not fit beside the 22 MiB cached: both cached segments go, then it fits.
        torch.alloc(30 * MIB, 0).unwrap();
        assert_eq!(torch.reserved(), 30 * MIB);
        // A segment holding a live block is not freed: 12 MiB more cannot be had.
        assert_eq!(torch.alloc(12 * MIB, 0), Err(TorchOom { requested: 12 * MIB, reserved: 30 * MIB }));
    }

    #[test]
    fn an_expandable_segment_grows_by_pages_of_the_rounded_request() {
        let mut torch = expandable();
        let a = torch.alloc(3 * MIB, 0).unwrap();
        assert_eq!(torch.reserved(), 20 * MIB, "one 20 MiB page of the large pool");
        let b = torch.alloc(18 * MIB, 0).unwrap();
        assert_eq!(b, a + 3 * MIB, "placed right after, in the same segment");
        assert_eq!(torch.reserved(), 40 * MIB, "one page more, not a new 20 MiB segment");
        let s = torch.alloc(4096, 0).unwrap();
        assert_eq!(torch.reserved(), 42 * MIB, "the small pool maps 2 MiB pages");
        assert_ne!(torch.segment_of(s), torch.segment_of(a));
        // 50 MiB extends the 19 MiB free at the end by two more pages.
        assert_eq!(torch.alloc(50 * MIB, 0).unwrap(), b + 18 * MIB);
        assert_eq!(torch.reserved(), 82 * MIB);
    }

    #[test]
    fn expandable_best_fit_prefers_interior_blocks() {
        let mut torch = expandable();
        let a = torch.alloc(4 * MIB, 0).unwrap();
        let _keep = torch.alloc(2 * MIB, 0).unwrap();
        torch.free(a);
        // Free now: 4 MiB at the start, and 14 MiB at the end of the mapped page before unmapped
        // space. 3 MiB goes into the interior 4 MiB block, though the end block is larger.
        assert_eq!(torch.alloc(3 * MIB, 0).unwrap(), a);
        // The 1 MiB rest was split off: the large pool of the default mode would have kept it.
        assert_eq!(torch.block_size(a), Some(3 * MIB));
    }

    #[test]
    fn expandable_out_of_memory_unmaps_free_pages_and_retries() {
        let mut torch = TorchAllocator::new(TorchMode::Expandable, 100 * MIB);
        let a = torch.alloc(60 * MIB, 0).unwrap();
        let keep = torch.alloc(10 * MIB, 0).unwrap();
        torch.free(a);
        assert_eq!(torch.reserved(), 80 * MIB, "freed pages stay mapped");
        // 40 MiB on another stream needs 40 MiB of pages: the 60 MiB hole is unmapped first.
        torch.alloc(40 * MIB, 1).unwrap();
        assert_eq!(torch.reserved(), 20 * MIB + 40 * MIB, "only the pages holding `keep` stayed");
        assert_eq!(torch.block_size(keep), Some(10 * MIB));
        // The unmapped range is the lowest that fits: stream 0 maps it again from its start.
        assert_eq!(torch.alloc(20 * MIB, 0).unwrap(), a);
    }
}
