//! The free ranges of a slab served online: best fit, by offset and by size.

use std::collections::{BTreeMap, BTreeSet};

/// The free ranges of the slab while a scope without a plan is served from it: best fit, by
/// offset (to merge neighbours) and by size.
#[derive(Debug, Default)]
pub(super) struct FreeRanges {
    pub(super) by_offset: BTreeMap<u64, u64>,
    pub(super) by_size: BTreeSet<(u64, u64)>,
    /// The free range at the end of a growable slab is taken last ([`FreeRanges::take`]): set
    /// for a scope served online from a slab where nothing of its own lives (memory carried into
    /// it aside).
    pub(super) end_last: bool,
}

impl FreeRanges {
    /// The slab's free ranges around the live ones.
    pub(super) fn around(slab: u64, mut live: Vec<(u64, u64)>) -> Self {
        live.sort_unstable();
        let mut ranges = Self::default();
        let mut top = 0;
        for (offset, size) in live.into_iter().chain(std::iter::once((slab, 0))) {
            if offset > top {
                ranges.insert(top, offset - top);
            }
            top = top.max(offset + size);
        }
        ranges
    }

    pub(super) fn insert(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
    }

    pub(super) fn remove(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
    }

    /// The start of the smallest free range that holds `size` (the lowest on ties). In a range
    /// that grows in place, ending at `growable_end`, the free range at its end is taken last,
    /// only when no other holds the request: it is where the range grows and gives pages back,
    /// so an allocation placed there (a small one in the page rounding of the last growth, which
    /// best fit finds smallest) keeps pages mapped above every free one and makes the next large
    /// request grow the range past it.
    pub(super) fn take(&mut self, size: u64, growable_end: Option<u64>) -> Option<u64> {
        let growable_end = growable_end.filter(|_| self.end_last);
        let end = |&(len, offset): &(u64, u64)| Some(offset + len) == growable_end;
        let inside = self.by_size.range((size, 0)..).copied().find(|range| !end(range));
        let at_end = || {
            let (&offset, &len) = self.by_offset.iter().next_back()?;
            (len >= size && end(&(len, offset))).then_some((len, offset))
        };
        let (len, offset) = inside.or_else(at_end)?;
        self.remove(offset, len);
        if len > size {
            self.insert(offset + size, len - size);
        }
        Some(offset)
    }

    /// The start of the lowest free range that holds `size` (first fit).
    pub(super) fn take_lowest(&mut self, size: u64) -> Option<u64> {
        let (offset, len) = self.by_offset.iter().map(|(&offset, &len)| (offset, len)).find(|&(_, len)| len >= size)?;
        self.remove(offset, len);
        if len > size {
            self.insert(offset + size, len - size);
        }
        Some(offset)
    }

    /// Returns a range, merged with its free neighbours.
    pub(super) fn give(&mut self, mut offset: u64, mut len: u64) {
        if let Some((&below, &below_len)) = self.by_offset.range(..offset).next_back()
            && below + below_len == offset
        {
            self.remove(below, below_len);
            offset = below;
            len += below_len;
        }
        if let Some(&above_len) = self.by_offset.get(&(offset + len)) {
            self.remove(offset + len, above_len);
            len += above_len;
        }
        self.insert(offset, len);
    }
}
