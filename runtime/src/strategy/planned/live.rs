//! The live allocations in the slab, filed by the slot handed out with each.

use steppool_sys::CUdeviceptr;

/// A live allocation in the slab.
#[derive(Clone, Copy, Debug)]
pub(super) struct SlabAllocation {
    pub(super) ptr: CUdeviceptr,
    /// Its index among the scope's allocations: the slot handed out with it.
    pub(super) index: u32,
    /// Its entry in the current plan, or [`FOREIGN`] for an entry of a plan the scope left.
    pub(super) entry: u32,
    pub(super) size: u64,
}

pub(super) const FOREIGN: u32 = u32::MAX;

/// The live allocations in the slab, filed by their index among the scope's allocations, which
/// is the slot handed out with each ([`Served::slot`](crate::strategy::Served::slot)): a free
/// finds its record by that index, with no lookup by address, and a bit per index says which are
/// live, for the scans that visit them all (a range checked clear, a scope going online, the free
/// space) at a word per 64 allocations. Filing and taking out one is a store and a bit flipped.
#[derive(Debug, Default)]
pub(super) struct SlabLive {
    /// Per index: the record, meaningful while the index's bit in `live` is set.
    pub(super) by_index: Vec<SlabAllocation>,
    /// A bit per index, set while the allocation lives in the slab.
    pub(super) live: Vec<u64>,
    /// How many bits of `live` are set.
    pub(super) count: usize,
}

impl SlabLive {
    #[inline(always)]
    pub(super) fn insert(&mut self, allocation: SlabAllocation) {
        let index = allocation.index as usize;
        if self.by_index.len() <= index {
            self.grow(index);
        }
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        debug_assert!(self.live[word] & bit == 0, "allocation {index} filed twice");
        self.by_index[index] = allocation;
        self.live[word] |= bit;
        self.count += 1;
    }

    /// Room for index `index`, with some to spare.
    #[cold]
    pub(super) fn grow(&mut self, index: usize) {
        let len = (index + 1).next_power_of_two().max(64);
        self.by_index.resize(len, SlabAllocation { ptr: 0, index: 0, entry: FOREIGN, size: 0 });
        self.live.resize(len.div_ceil(64), 0);
    }

    /// Takes out the allocation at `ptr` filed under `slot`, if it is there.
    #[inline]
    pub(super) fn remove(&mut self, slot: u32, ptr: CUdeviceptr) -> Option<SlabAllocation> {
        let index = slot as usize;
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        let allocation = *self.by_index.get(index)?;
        if self.live[word] & bit == 0 || allocation.ptr != ptr {
            return None;
        }
        self.live[word] &= !bit;
        self.count -= 1;
        Some(allocation)
    }

    /// The indices of the live ones, in order.
    pub(super) fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.live.iter().enumerate().flat_map(|(word, &bits)| {
            let mut bits = bits;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let bit = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    word * 64 + bit
                })
            })
        })
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &SlabAllocation> {
        self.indices().map(|index| &self.by_index[index])
    }

    pub(super) fn for_each_mut(&mut self, mut visit: impl FnMut(&mut SlabAllocation)) {
        for (word, &bits) in self.live.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                visit(&mut self.by_index[word * 64 + bits.trailing_zeros() as usize]);
                bits &= bits - 1;
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub(super) fn clear(&mut self) {
        self.live.fill(0);
        self.count = 0;
    }
}
