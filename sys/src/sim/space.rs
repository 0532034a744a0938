//! Free space inside a simulated pool, and the simulated virtual address space.
//!
//! A pool's free space is a set of pieces, each inside one of the pool's address ranges (its
//! *segment*, named by the range's base) and each with a readiness: `Ready` (any stream may reuse
//! it) or `Pending` (freed on a stream at a position the host has not yet observed complete).
//! Adjacent pieces of one range merge when both are ready, or both are pending on the same stream
//! (the merged piece waits for the later free), whether or not memory is mapped behind them. Lookups are
//! best-fit: the smallest piece that is large enough and that the allocating stream may reuse,
//! the lowest address on ties.

use std::collections::{BTreeMap, BTreeSet};

use super::clock::{Clock, StreamId};

/// When a free piece may be reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// Its frees are complete: any stream may reuse it.
    Ready,
    /// Freed on `stream` at `position`, not yet observed complete.
    Pending { stream: StreamId, position: u64 },
}

impl Readiness {
    /// Whether `stream` may reuse a piece of this readiness without new dependencies: it is
    /// ready, pending on `stream` itself, or (with `follow_events`) pending on another stream at a
    /// position `knowledge` already orders `stream` after.
    fn reusable_by(self, stream: Option<StreamId>, knowledge: &Clock, follow_events: bool) -> bool {
        match self {
            Readiness::Ready => true,
            Readiness::Pending { stream: other, position } => {
                Some(other) == stream || (follow_events && knowledge.get(other) > 0 && position <= knowledge.get(other))
            }
        }
    }

    /// The readiness of two adjacent pieces merged into one, if they may merge.
    fn merge(self, other: Readiness) -> Option<Readiness> {
        match (self, other) {
            (Readiness::Ready, Readiness::Ready) => Some(Readiness::Ready),
            (Readiness::Pending { stream: a, position: p }, Readiness::Pending { stream: b, position: q })
                if a == b =>
            {
                Some(Readiness::Pending { stream: a, position: p.max(q) })
            }
            _ => None,
        }
    }
}

/// A free piece: `len` bytes inside the address range starting at `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) len: u64,
    pub(crate) segment: u64,
    pub(crate) readiness: Readiness,
}

/// The free pieces of one pool, indexed by address, by size for ready pieces, and by size per
/// stream for pending ones.
#[derive(Debug, Default)]
pub(crate) struct FreeSpace {
    by_addr: BTreeMap<u64, Piece>,
    ready: BTreeSet<(u64, u64)>,
    pending: BTreeMap<StreamId, BTreeSet<(u64, u64)>>,
}

impl FreeSpace {
    /// Every piece, by address.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = (u64, &Piece)> {
        self.by_addr.iter().map(|(&addr, piece)| (addr, piece))
    }

    fn index(&mut self, addr: u64, piece: Piece) {
        match piece.readiness {
            Readiness::Ready => self.ready.insert((piece.len, addr)),
            Readiness::Pending { stream, .. } => self.pending.entry(stream).or_default().insert((piece.len, addr)),
        };
        self.by_addr.insert(addr, piece);
    }

    fn unindex(&mut self, addr: u64) -> Option<Piece> {
        let piece = self.by_addr.remove(&addr)?;
        match piece.readiness {
            Readiness::Ready => {
                self.ready.remove(&(piece.len, addr));
            }
            Readiness::Pending { stream, .. } => {
                if let Some(set) = self.pending.get_mut(&stream) {
                    set.remove(&(piece.len, addr));
                    if set.is_empty() {
                        self.pending.remove(&stream);
                    }
                }
            }
        }
        Some(piece)
    }

    /// Adds `[addr, addr + len)` of `segment` as free, merging with compatible neighbours.
    pub(crate) fn insert(&mut self, mut addr: u64, mut len: u64, segment: u64, mut readiness: Readiness) {
        if let Some((&prev_addr, prev)) = self.by_addr.range(..addr).next_back()
            && prev.segment == segment
            && prev_addr + prev.len == addr
            && let Some(merged) = prev.readiness.merge(readiness)
        {
            let prev = self.unindex(prev_addr).expect("indexed piece");
            addr = prev_addr;
            len += prev.len;
            readiness = merged;
        }
        if let Some(next) = self.by_addr.get(&(addr + len)).copied()
            && next.segment == segment
            && let Some(merged) = readiness.merge(next.readiness)
        {
            self.unindex(addr + len);
            len += next.len;
            readiness = merged;
        }
        self.index(addr, Piece { len, segment, readiness });
    }

    /// Takes `[addr, addr + len)` out of the piece that starts at `addr`; the rest stays free.
    pub(crate) fn take(&mut self, addr: u64, len: u64) -> Piece {
        let piece = self.unindex(addr).expect("allocation placed at the start of a free piece");
        debug_assert!(piece.len >= len, "piece of {} bytes cannot hold {len}", piece.len);
        if piece.len > len {
            self.index(addr + len, Piece { len: piece.len - len, ..piece });
        }
        piece
    }

    /// Makes ready every pending piece whose free `completed` covers, merging it with neighbours.
    pub(crate) fn promote(&mut self, completed: &Clock) {
        let mut done = Vec::new();
        for (&stream, set) in &self.pending {
            let known = completed.get(stream);
            for &(_, addr) in set {
                if let Readiness::Pending { position, .. } = self.by_addr[&addr].readiness
                    && position <= known
                {
                    done.push(addr);
                }
            }
        }
        for addr in done {
            let piece = self.unindex(addr).expect("indexed piece");
            self.insert(addr, piece.len, piece.segment, Readiness::Ready);
        }
    }

    /// The best-fit piece for `len` bytes that `stream` may reuse without new dependencies: a
    /// ready piece, a piece pending on `stream` itself, or (with `follow_events`) a piece pending
    /// on another stream at a position `knowledge` already orders `stream` after.
    pub(crate) fn best_fit(
        &self,
        len: u64,
        stream: Option<StreamId>,
        knowledge: &Clock,
        follow_events: bool,
    ) -> Option<u64> {
        self.best_fit_where(len, stream, knowledge, follow_events, |_| true)
    }

    /// [`FreeSpace::best_fit`] among the pieces whose start `accept` accepts.
    pub(crate) fn best_fit_where(
        &self,
        len: u64,
        stream: Option<StreamId>,
        knowledge: &Clock,
        follow_events: bool,
        accept: impl Fn(u64) -> bool,
    ) -> Option<u64> {
        let mut best = self.ready.range((len, 0)..).copied().find(|&(_, addr)| accept(addr));
        for (&other, set) in &self.pending {
            let candidate = if Some(other) == stream {
                set.range((len, 0)..).copied().find(|&(_, addr)| accept(addr))
            } else if follow_events && knowledge.get(other) > 0 {
                set.range((len, 0)..).copied().find(|&(_, addr)| {
                    self.by_addr[&addr].readiness.reusable_by(stream, knowledge, follow_events) && accept(addr)
                })
            } else {
                None
            };
            best = match (best, candidate) {
                (Some(b), Some(c)) => Some(b.min(c)),
                (b, c) => b.or(c),
            };
        }
        best.map(|(_, addr)| addr)
    }

    /// The best-fit piece pending on a stream other than `stream`, and that stream: reusing it
    /// needs a dependency on the freeing stream.
    pub(crate) fn best_fit_elsewhere(&self, len: u64, stream: Option<StreamId>) -> Option<(u64, StreamId)> {
        self.pending
            .iter()
            .filter(|(other, _)| Some(**other) != stream)
            .filter_map(|(&other, set)| set.range((len, 0)..).next().map(|&(size, addr)| (size, addr, other)))
            .min()
            .map(|(_, addr, other)| (addr, other))
    }

    /// Removes the free piece that starts at `addr`.
    pub(crate) fn remove(&mut self, addr: u64) {
        self.unindex(addr);
    }

    /// The free piece that starts at `addr`.
    pub(crate) fn piece(&self, addr: u64) -> Option<&Piece> {
        self.by_addr.get(&addr)
    }

    /// Whether `[addr, addr + len)` is free, and `stream` may reuse all of it without new
    /// dependencies, as [`FreeSpace::best_fit`] reuses a piece.
    pub(crate) fn covers_reusable(
        &self,
        addr: u64,
        len: u64,
        stream: Option<StreamId>,
        knowledge: &Clock,
        follow_events: bool,
    ) -> bool {
        let reusable = |piece: &Piece| piece.readiness.reusable_by(stream, knowledge, follow_events);
        let Some((&start, first)) = self.by_addr.range(..=addr).next_back() else { return false };
        let mut end = start + first.len;
        if end <= addr || !reusable(first) {
            return false;
        }
        while end < addr + len {
            match self.by_addr.get(&end) {
                Some(piece) if reusable(piece) => end += piece.len,
                _ => return false,
            }
        }
        true
    }

    /// Whether `[addr, addr + len)` lies inside one ready piece: nothing live, nothing pending.
    pub(crate) fn covers_ready(&self, addr: u64, len: u64) -> bool {
        matches!(self.by_addr.range(..=addr).next_back(),
            Some((&start, p)) if start + p.len >= addr + len && p.readiness == Readiness::Ready)
    }
}

/// A simulated virtual address range handed out in granule-aligned pieces, first fit.
#[derive(Debug)]
pub(crate) struct AddressSpace {
    free: BTreeMap<u64, u64>,
}

impl AddressSpace {
    /// The range `[base, base + len)`.
    pub(crate) fn new(base: u64, len: u64) -> Self {
        Self { free: BTreeMap::from([(base, len)]) }
    }

    /// Reserves `len` bytes at the lowest address that has room.
    pub(crate) fn reserve(&mut self, len: u64) -> Option<u64> {
        let (&start, &room) = self.free.iter().find(|&(_, &room)| room >= len)?;
        self.free.remove(&start);
        if room > len {
            self.free.insert(start + len, room - len);
        }
        Some(start)
    }

    /// Returns `[start, start + len)`, merging it with free neighbours.
    pub(crate) fn release(&mut self, mut start: u64, mut len: u64) {
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back()
            && prev + prev_len == start
        {
            self.free.remove(&prev);
            start = prev;
            len += prev_len;
        }
        if let Some(next_len) = self.free.remove(&(start + len)) {
            len += next_len;
        }
        self.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u64 = 0x1000_0000;

    fn pending(stream: StreamId, position: u64) -> Readiness {
        Readiness::Pending { stream, position }
    }

    #[test]
    fn ready_neighbours_merge_and_pending_ones_wait() {
        let mut space = FreeSpace::default();
        space.insert(SEG, 512, SEG, Readiness::Ready);
        space.insert(SEG + 1024, 512, SEG, Readiness::Ready);
        space.insert(SEG + 512, 512, SEG, Readiness::Ready);
        assert_eq!(space.pieces().count(), 1);
        assert!(space.covers_ready(SEG, 1536));
        assert!(space.covers_ready(SEG + 512, 1024));
        assert!(!space.covers_ready(SEG + 512, 1536), "past the piece's end");

        space.insert(SEG + 4096, 512, SEG, pending(1, 3));
        space.insert(SEG + 4608, 512, SEG, pending(1, 5));
        space.insert(SEG + 5120, 512, SEG, pending(2, 1));
        let pieces: Vec<_> = space.pieces().map(|(a, p)| (a - SEG, p.len, p.readiness)).collect();
        assert_eq!(pieces, vec![(0, 1536, Readiness::Ready), (4096, 1024, pending(1, 5)), (5120, 512, pending(2, 1))]);
    }

    #[test]
    fn pieces_of_different_ranges_never_merge() {
        let mut space = FreeSpace::default();
        space.insert(SEG, 512, SEG, Readiness::Ready);
        space.insert(SEG + 512, 512, SEG + 512, Readiness::Ready);
        assert_eq!(space.pieces().count(), 2);
    }

    #[test]
    fn best_fit_respects_stream_order() {
        let mut space = FreeSpace::default();
        space.insert(SEG, 4096, SEG, pending(1, 2));
        let mut knowledge = Clock::default();
        assert_eq!(space.best_fit(1024, Some(1), &knowledge, true), Some(SEG), "same stream");
        assert_eq!(space.best_fit(1024, Some(2), &knowledge, true), None, "unordered stream");
        knowledge.advance(1, 1);
        assert_eq!(space.best_fit(1024, Some(2), &knowledge, true), None, "ordered before the free");
        knowledge.advance(1, 2);
        assert_eq!(space.best_fit(1024, Some(2), &knowledge, true), Some(SEG), "ordered after");
        assert_eq!(space.best_fit(1024, Some(2), &knowledge, false), None, "policy disabled");
        assert_eq!(space.best_fit_elsewhere(1024, Some(2)), Some((SEG, 1)));
        assert_eq!(space.best_fit_elsewhere(1024, Some(1)), None);

        let mut completed = Clock::default();
        completed.advance(1, 2);
        assert!(!space.covers_ready(SEG, 4096), "pending");
        space.promote(&completed);
        assert!(space.covers_ready(SEG, 4096));
    }

    #[test]
    fn a_range_is_reusable_when_every_piece_over_it_is_free_to_the_stream() {
        let mut space = FreeSpace::default();
        space.insert(SEG, 1024, SEG, Readiness::Ready);
        space.insert(SEG + 1024, 1024, SEG, pending(1, 4));
        space.insert(SEG + 4096, 1024, SEG, pending(2, 4));
        let none = Clock::default();
        assert!(space.covers_reusable(SEG, 2048, Some(1), &none, true), "ready, then pending on the stream itself");
        assert!(space.covers_reusable(SEG + 512, 1024, Some(1), &none, true), "from inside a piece");
        assert!(!space.covers_reusable(SEG, 2048, Some(2), &none, true), "pending on a stream not ordered before");
        assert!(!space.covers_reusable(SEG, 4096, Some(1), &none, true), "a gap: something lives there");
        assert!(!space.covers_reusable(SEG + 4096, 1024, Some(1), &none, true));
        let mut knowledge = Clock::default();
        knowledge.advance(2, 4);
        assert!(space.covers_reusable(SEG + 4096, 1024, Some(1), &knowledge, true), "ordered after the free");
        assert!(!space.covers_reusable(SEG + 4096, 1024, Some(1), &knowledge, false), "unless events are not followed");
    }

    #[test]
    fn best_fit_prefers_the_smallest_then_the_lowest() {
        let mut space = FreeSpace::default();
        space.insert(SEG, 8192, SEG, Readiness::Ready);
        space.insert(2 * SEG, 2048, 2 * SEG, Readiness::Ready);
        space.insert(3 * SEG, 2048, 3 * SEG, Readiness::Ready);
        let none = Clock::default();
        assert_eq!(space.best_fit(1024, None, &none, true), Some(2 * SEG));
        assert_eq!(space.best_fit(4096, None, &none, true), Some(SEG));
        assert_eq!(space.best_fit(9000, None, &none, true), None);
        space.take(2 * SEG, 1024);
        assert_eq!(space.best_fit(1024, None, &none, true), Some(2 * SEG + 1024));
    }

    #[test]
    fn address_space_reuses_released_ranges() {
        let mut va = AddressSpace::new(0x10000, 0x10000);
        let a = va.reserve(0x4000).unwrap();
        let b = va.reserve(0x4000).unwrap();
        assert_eq!((a, b), (0x10000, 0x14000));
        va.release(a, 0x4000);
        assert_eq!(va.reserve(0x2000), Some(0x10000));
        va.release(0x10000, 0x2000);
        va.release(b, 0x4000);
        assert_eq!(va.reserve(0x10000), Some(0x10000), "everything merged back");
        assert_eq!(va.reserve(1), None);
    }
}
