//! Offline packing of a recorded sequence of allocations: an offset in one slab for each, such
//! that allocations alive at the same time never overlap, and the slab as small as the heuristic
//! finds. The planned strategy packs each recorded scope with it; a replay packs a whole trace
//! with it to know the least any online strategy could reserve.
//!
//! The problem is NP-complete (it is dynamic storage allocation). The floor any packing meets is
//! the *lower bound*: the peak of live bytes over the recorded sequence. The heuristic is TFLite's
//! greedy by size (Pisarchyk and Lee, "Efficient Memory Management for Deep Neural Net
//! Inference", 2020): blocks in decreasing size, each placed in the smallest gap left between the
//! blocks already placed that are alive at the same time, else above them. [`pack`] runs it with
//! a few orderings and keeps the smallest. Everything here is pure: no device, no runtime.

use std::collections::BTreeMap;

/// One allocation of a recorded scope: its size (already aligned) and its lifetime, the positions
/// of its allocation and of its free in the scope's sequence of events. Positions are distinct
/// for distinct events; a block never freed in the scope ends at [`Block::NEVER_FREED`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Bytes, already aligned as the slab needs.
    pub size: u64,
    /// Position of its allocation in the sequence.
    pub start: u32,
    /// Position of its free, or [`Block::NEVER_FREED`].
    pub end: u32,
}

impl Block {
    /// The end of a block alive until the scope's end.
    pub const NEVER_FREED: u32 = u32::MAX;

    /// Whether the two are alive at the same time.
    pub fn overlaps_in_time(&self, other: &Block) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// Offsets of the blocks in one slab, in block order, and the slab's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packing {
    /// Each block's offset in the slab, in block order.
    pub offsets: Vec<u64>,
    /// The slab's size: the highest end of a placed block.
    pub size: u64,
}

/// The peak of live bytes over the sequence: no packing fits in less.
pub fn lower_bound(blocks: &[Block]) -> u64 {
    live_peak(blocks).0
}

/// The position (a block's start) at which the live bytes of `blocks` first reach their peak
/// ([`lower_bound`]); 0 when there are none.
pub fn peak_position(blocks: &[Block]) -> u32 {
    live_peak(blocks).1
}

/// The peak of live bytes of `blocks` and the position of the allocation that first reaches it.
fn live_peak(blocks: &[Block]) -> (u64, u32) {
    let mut events: Vec<(u32, bool, u64)> = Vec::with_capacity(blocks.len() * 2);
    for block in blocks {
        events.push((block.start, true, block.size));
        if block.end != Block::NEVER_FREED {
            events.push((block.end, false, block.size));
        }
    }
    // Frees sort before allocations at the same position (positions are distinct, so this only
    // matters for malformed input, where it keeps the bound a bound).
    events.sort_unstable();
    let (mut live, mut peak, mut at) = (0u64, 0u64, 0u32);
    for (position, allocation, size) in events {
        if allocation {
            live += size;
            if live > peak {
                (peak, at) = (live, position);
            }
        } else {
            live -= size;
        }
    }
    (peak, at)
}

/// Greedy by size: the largest block first (the earlier one on ties), each at the start of the
/// smallest gap that holds it between the time-overlapping blocks placed so far, else right above
/// the highest of them.
pub fn greedy_by_size(blocks: &[Block]) -> Packing {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by(|&a, &b| blocks[b].size.cmp(&blocks[a].size).then(blocks[a].start.cmp(&blocks[b].start)));
    place_in_order(&compress(blocks), &order)
}

/// The blocks with their positions replaced by their ranks among all the positions used: the
/// same order, so the same blocks meet in time, on a time axis no longer than twice the number
/// of blocks, whatever the positions (a step of a long trace keeps the trace's event indices).
fn compress(blocks: &[Block]) -> Vec<Block> {
    let mut positions: Vec<u32> =
        blocks.iter().flat_map(|b| [b.start, b.end]).filter(|&p| p != Block::NEVER_FREED).collect();
    positions.sort_unstable();
    positions.dedup();
    let rank = |p: u32| {
        if p == Block::NEVER_FREED { p } else { positions.partition_point(|&q| q < p) as u32 }
    };
    blocks.iter().map(|b| Block { size: b.size, start: rank(b.start), end: rank(b.end) }).collect()
}

/// The smallest of four greedy packings, the blocks taken by size (ties: earlier first), by
/// size (ties: longer-lived first), by area (size × lifetime), and by lifetime. On the six
/// shapes of the shared PyTorch traces the best of them is 0.3–1.1 % above the lower bound where
/// greedy by size alone is 0.3–2.6 % above; no single ordering wins on all of them.
///
/// Each ordering finds the blocks alive at the same time as the one it places through an index
/// over time (a segment tree of lifetimes and a map of starts), so its cost grows with the number of pairs of blocks alive together, not with
/// the square of the number of blocks: whole traces of a million allocations pack in seconds.
pub fn pack(blocks: &[Block]) -> Packing {
    let all: Vec<usize> = (0..blocks.len()).collect();
    let ordered = best_ordering(blocks, &compress(blocks), &[], &all);
    let greedy = greedy_by_size(blocks);
    if ordered.size < greedy.size { ordered } else { greedy }
}

/// How long a block lives, in positions (to the end of the sequence if it is never freed).
fn lifetime(block: &Block) -> u64 {
    u64::from(block.end.min(u32::MAX - 1).saturating_sub(block.start))
}

/// A key blocks are sorted by to be placed, largest first.
type OrderKey = fn(&Block) -> (u64, u64);

/// The orderings [`pack`] tries, each a key the blocks are sorted by, largest first: size (ties:
/// longer-lived first), area (size × lifetime), lifetime.
const ORDERINGS: [OrderKey; 3] =
    [|b| (b.size, lifetime(b)), |b| (b.size.saturating_mul(lifetime(b)), b.size), |b| (lifetime(b), b.size)];

/// The smallest of the packings that place `first` in its order, then `rest` in each of the
/// [`ORDERINGS`] (ties: earlier allocations first); the earliest ordering on ties.
fn best_ordering(blocks: &[Block], ranked: &[Block], first: &[usize], rest: &[usize]) -> Packing {
    smallest_over_orderings(|key| {
        let order: Vec<usize> = first.iter().copied().chain(sorted_by(blocks, rest, key)).collect();
        place_in_order(ranked, &order)
    })
}

/// `ids` sorted by `key`, largest first (the earlier allocation on ties).
fn sorted_by(blocks: &[Block], ids: &[usize], key: OrderKey) -> Vec<usize> {
    let mut order = ids.to_vec();
    order.sort_by(|&a, &b| key(&blocks[b]).cmp(&key(&blocks[a])).then(blocks[a].start.cmp(&blocks[b].start)));
    order
}

/// The smallest of the packings `pack` makes with each of the [`ORDERINGS`] (the earliest on
/// ties).
fn smallest_over_orderings(pack: impl FnMut(OrderKey) -> Packing) -> Packing {
    ORDERINGS
        .into_iter()
        .map(pack)
        .reduce(|best, packing| if packing.size < best.size { packing } else { best })
        .expect("three orderings")
}

/// The layout an online best fit makes: each block in allocation order (by start) at the start
/// of the smallest gap between the blocks alive when it is allocated (the lowest on ties), else
/// right above them. Usually larger than [`pack`]'s, but every prefix of it is what best fit makes
/// of that prefix alone: a scope served from it up to any allocation, then best-fit in the free
/// space around what is live, ends up as if it had been served best-fit from its start. The
/// planned strategy lays out the plans its scopes are expected to leave this way.
pub fn best_fit_in_order(blocks: &[Block]) -> Packing {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by_key(|&b| blocks[b].start);
    place_in_order(&compress(blocks), &order)
}

/// [`best_fit_in_order`] for a plan whose scopes hand memory to the next ([`Carried`], as
/// [`pack_around`] takes them): the pinned pairs first, where they lie, then every other block
/// in allocation order (a pair by the block of its allocation, at one offset with its life in
/// the next scope), each in the smallest gap among the time-overlapping blocks placed so far,
/// else right above them. A scope served from it that leaves it part way has what it made
/// where best fit around the carried memory would have put it.
pub fn best_fit_in_order_around(blocks: &[Block], carried: &[Carried]) -> Packing {
    pack_after_prefix_around(blocks, carried, usize::MAX)
}

/// [`pack_after_prefix`] for a plan whose scopes hand memory to the next: the pinned pairs
/// where they lie, then the first `prefix` of the other blocks by start laid out as
/// [`best_fit_in_order_around`] lays them out, then the rest packed around them (the best of
/// [`pack`]'s orderings, a pair by the block of its allocation).
pub fn pack_after_prefix_around(blocks: &[Block], carried: &[Carried], prefix: usize) -> Packing {
    let ranked = compress(blocks);
    let pairing = pairing(blocks.len(), carried);
    let is_pinned = marked(blocks.len(), &pairing.pinned);
    let mut first: Vec<usize> = (0..blocks.len()).filter(|&id| !pairing.second[id] && !is_pinned[id]).collect();
    first.sort_by_key(|&b| blocks[b].start);
    first.truncate(prefix);
    let in_order = place_pairs(&ranked, &first, &pairing.partner, &pairing.pinned, &[]);
    let placed: Vec<(usize, u64)> =
        pairing.pinned.iter().copied().chain(first.iter().map(|&id| (id, in_order.offsets[id]))).collect();
    pack_rest(blocks, &ranked, &pairing, &placed)
}

/// [`pack`] with the first `prefix` blocks by start laid out first, as [`best_fit_in_order`] lays
/// them out: a scope served from it that leaves it within those blocks has what is live where
/// best fit would have put it, and the rest is packed around them (the best of [`pack`]'s
/// orderings for the rest).
pub fn pack_after_prefix(blocks: &[Block], prefix: usize) -> Packing {
    let mut by_start: Vec<usize> = (0..blocks.len()).collect();
    by_start.sort_by_key(|&b| blocks[b].start);
    let (first, rest) = by_start.split_at(prefix.min(blocks.len()));
    best_ordering(blocks, &compress(blocks), first, rest)
}

/// The blocks placed so far, found by time: those alive at a position (a stabbing query on a
/// segment tree over positions, each block stored at the `O(log T)` nodes that tile its
/// lifetime) and those that begin inside a range (an ordered map by start). A block `b` is alive
/// at the same time as `q` exactly when it is alive at `q.start` or begins strictly inside
/// `(q.start, q.end)`, and never both, so the two queries list each time-overlapping block once.
#[derive(Debug)]
struct TimeIndex {
    /// Leaves: positions `0..leaves`; node `i`'s children are `2i` and `2i + 1`.
    leaves: usize,
    /// Per node, the blocks whose lifetime covers the node's range and not its parent's.
    nodes: Vec<Vec<u32>>,
    /// Placed blocks by start (a list: malformed input may repeat a start).
    by_start: BTreeMap<u32, Vec<u32>>,
}

impl TimeIndex {
    fn new(blocks: &[Block]) -> Self {
        let horizon = blocks
            .iter()
            .map(|b| if b.end == Block::NEVER_FREED { b.start } else { b.end.max(b.start) })
            .max()
            .map_or(1, |last| last as usize + 2);
        let leaves = horizon.next_power_of_two();
        Self { leaves, nodes: vec![Vec::new(); 2 * leaves], by_start: BTreeMap::new() }
    }

    /// The end of `block`'s lifetime on the index's positions.
    fn end(&self, block: &Block) -> usize {
        (block.end as usize).min(self.leaves)
    }

    fn insert(&mut self, id: u32, block: &Block) {
        self.by_start.entry(block.start).or_default().push(id);
        let (mut lo, mut hi) = (block.start as usize + self.leaves, self.end(block) + self.leaves);
        while lo < hi {
            if lo & 1 == 1 {
                self.nodes[lo].push(id);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                self.nodes[hi].push(id);
            }
            lo >>= 1;
            hi >>= 1;
        }
    }

    /// Calls `f` once for each placed block alive at the same time as `block`.
    fn for_each_overlapping(&self, block: &Block, mut f: impl FnMut(u32)) {
        let at = block.start as usize;
        if at < self.leaves {
            let mut node = at + self.leaves;
            while node > 0 {
                self.nodes[node].iter().copied().for_each(&mut f);
                node >>= 1;
            }
        }
        if let Some(after) = block.start.checked_add(1)
            && after < block.end
        {
            for ids in self.by_start.range(after..block.end).map(|(_, ids)| ids) {
                ids.iter().copied().for_each(&mut f);
            }
        }
    }
}

/// Places the blocks in `order`, each in the smallest gap among the time-overlapping blocks
/// already placed (the lowest such gap on ties), else right above the highest of them.
fn place_in_order(blocks: &[Block], order: &[usize]) -> Packing {
    place_pairs(blocks, order, &vec![None; blocks.len()], &[], &[])
}

/// Memory that lives across the boundary between two scopes of one plan, as
/// [`pack_around`] takes it: the block of its allocation (alive from its allocation to the
/// scope's end, [`Block::NEVER_FREED`]) and a second block for the same memory in the next scope
/// (alive from the scope's start to its free there), which must sit at the same offset, since a
/// plan reused scope after scope hands the memory out at one place. `at` pins both where the
/// memory already lives (an allocation carried into the scope that follows the packing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Carried {
    /// The block of its allocation.
    pub block: usize,
    /// The block of its life in the next scope, up to its free.
    pub next: usize,
    /// Its offset where it is already placed.
    pub at: Option<u64>,
}

/// [`pack`] for a plan reused scope after scope whose scopes hand memory to the next
/// ([`Carried`]): each carried pair at one offset, clear of every block alive during either of
/// its two lifetimes (so the plan is valid around the boundary as well as inside a scope). The
/// pinned pairs go first, where they are; then the own place of each of `alternates` (an entry
/// whose second place is one of the pairs), right below or right above that place where clear
/// of the pinned pairs (both sides tried, the smaller packing kept; where neither is clear, it
/// is packed as any block); then the rest in each of the packer's orderings, a pair by the
/// block of its allocation, the best kept. A pair's `next` ends no later than its `block`
/// starts (the memory is free before the plan hands it out again) and is the same size; a block
/// is in one pair at most.
pub fn pack_around(blocks: &[Block], carried: &[Carried], alternates: &[Alternate]) -> Packing {
    let ranked = compress(blocks);
    let pairing = pairing(blocks.len(), carried);
    let pinned = pairing.pinned.clone();
    let pack = |pinned: &[(usize, u64)]| pack_rest(blocks, &ranked, &pairing, pinned);
    // An entry's own place goes right below or right above its second place, where clear of
    // the pinned memory (the smaller packing of the two): placed by the packing, the own place
    // of a small entry alive the whole scope lands in the smallest gap between pinned memory,
    // and the next plan, pinned there in turn, packs its scope around it.
    let mut sides = [pinned.clone(), pinned.clone()];
    for alternate in alternates {
        let pair = carried[alternate.second];
        let Some(at) = pair.at else { continue };
        let size = blocks[alternate.own].size;
        let candidates = [at.checked_sub(size), Some(at + blocks[pair.block].size)];
        for (side, offset) in sides.iter_mut().zip(candidates) {
            let clear = |offset: u64| {
                side.iter().all(|&(id, placed)| placed + blocks[id].size <= offset || offset + size <= placed)
            };
            if let Some(offset) = offset.filter(|&offset| clear(offset)) {
                side.push((alternate.own, offset));
            }
        }
    }
    let beside = sides.iter().filter(|side| side.len() > pinned.len()).map(|side| pack(side));
    beside
        .reduce(|best, packing| if packing.size < best.size { packing } else { best })
        .unwrap_or_else(|| pack(&pinned))
}

/// [`pack_around`] partway through a scope: the `placed` blocks (block, offset) lie where they
/// are (what the scope has made and holds, what the scope before carried into it), the pinned
/// pairs too; the rest, the pairs among them by the block of their allocation, in each of the
/// packer's orderings. Where `previous` has an offset for a block (an earlier layout of the same
/// rest, `previous` empty or of `blocks`' length), a second layout keeps each such block there,
/// in order of allocation, where it is clear of what lies and was kept before it, and places the
/// others around them; the smaller layout is returned, the second on ties. A placed block is in
/// no pair.
pub fn pack_around_placed(
    blocks: &[Block],
    carried: &[Carried],
    placed: &[(usize, u64)],
    previous: &[Option<u64>],
) -> Packing {
    let ranked = compress(blocks);
    let pairing = pairing(blocks.len(), carried);
    let pinned: Vec<(usize, u64)> = pairing.pinned.iter().chain(placed).copied().collect();
    let fresh = pack_rest(blocks, &ranked, &pairing, &pinned);
    let is_pinned = marked(blocks.len(), &pinned);
    let mut candidates: Vec<usize> = (0..previous.len().min(blocks.len()))
        .filter(|&id| previous[id].is_some() && !pairing.second[id] && !is_pinned[id])
        .collect();
    if candidates.is_empty() {
        return fresh;
    }
    candidates.sort_by_key(|&id| blocks[id].start);
    let mut index = TimeIndex::new(&ranked);
    let mut at = vec![None; blocks.len()];
    let put = |id: usize, offset: u64, index: &mut TimeIndex, at: &mut Vec<Option<u64>>| {
        for id in std::iter::once(id).chain(pairing.partner[id]) {
            at[id] = Some(offset);
            index.insert(id as u32, &ranked[id]);
        }
    };
    for &(id, offset) in &pinned {
        put(id, offset, &mut index, &mut at);
    }
    let mut kept = pinned.clone();
    for id in candidates {
        let offset = previous[id].expect("a candidate has an earlier offset");
        let size = blocks[id].size;
        let mut clear = true;
        for of in std::iter::once(id).chain(pairing.partner[id]) {
            index.for_each_overlapping(&ranked[of], |other| {
                let other = other as usize;
                let (from, len) = (at[other].expect("indexed blocks are placed"), blocks[other].size);
                clear &= from + len <= offset || offset + size <= from;
            });
        }
        if clear {
            put(id, offset, &mut index, &mut at);
            kept.push((id, offset));
        }
    }
    let repaired = pack_rest(blocks, &ranked, &pairing, &kept);
    if fresh.size < repaired.size { fresh } else { repaired }
}

/// The blocks of `pairing` not `pinned` (nor the second of a pair) placed around the pinned ones
/// in each of the packer's orderings, the best kept; `ranked` is `blocks` compressed.
fn pack_rest(blocks: &[Block], ranked: &[Block], pairing: &Pairing, pinned: &[(usize, u64)]) -> Packing {
    let is_pinned = marked(blocks.len(), pinned);
    let rest: Vec<usize> = (0..blocks.len()).filter(|&id| !pairing.second[id] && !is_pinned[id]).collect();
    smallest_over_orderings(|key| place_pairs(ranked, &sorted_by(blocks, &rest, key), &pairing.partner, pinned, &[]))
}

/// Per block of `count`, whether it is one of `pinned`.
fn marked(count: usize, pinned: &[(usize, u64)]) -> Vec<bool> {
    let mut marked = vec![false; count];
    for &(id, _) in pinned {
        marked[id] = true;
    }
    marked
}

/// An entry with two places ([`pack_around`]): the block of its own place, alive the whole scope,
/// and the index among the carried pairs of its second place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alternate {
    /// The block of its own place.
    pub own: usize,
    /// Its second place: an index into the carried pairs.
    pub second: usize,
}

/// [`pack_around`] for a plan whose carried memory is not yet where the plan hands it out: the
/// first scope served from it finds the memory carried into it elsewhere (a range the plan
/// moved away from, a chunk), while the plan's own range maps its pages as hand-outs reach
/// them. Each unpinned pair goes above every other block allocated before its life in the next
/// scope ends, so that such a scope, until it has freed what was carried in, reaches no higher
/// in the plan than the blocks it has made: what it holds elsewhere and what it has mapped stay
/// within the plan's size where they can ([`handover_peak`]). Pinned pairs are placed first,
/// where they are; then the other blocks in each of the packer's orderings, then the unpinned
/// pairs, largest first, the best kept.
pub fn pack_around_above(blocks: &[Block], carried: &[Carried]) -> Packing {
    let ranked = compress(blocks);
    let Pairing { partner, second, pinned } = pairing(blocks.len(), carried);
    let others: Vec<usize> = (0..blocks.len()).filter(|&id| partner[id].is_none() && !second[id]).collect();
    let mut free_pairs: Vec<&Carried> = carried.iter().filter(|pair| pair.at.is_none()).collect();
    free_pairs.sort_by(|a, b| {
        let (a, b) = (&blocks[a.block], &blocks[b.block]);
        b.size.cmp(&a.size).then(a.start.cmp(&b.start))
    });
    let pairs: Vec<usize> = free_pairs.iter().map(|pair| pair.block).collect();
    smallest_over_orderings(|key| {
        let first = place_pairs(&ranked, &sorted_by(blocks, &others, key), &partner, &pinned, &[]);
        let mut floor = vec![0u64; blocks.len()];
        for pair in &free_pairs {
            let until = blocks[pair.next].end;
            floor[pair.block] = others
                .iter()
                .filter(|&&id| blocks[id].start < until)
                .map(|&id| first.offsets[id] + blocks[id].size)
                .max()
                .unwrap_or(0);
        }
        let placed: Vec<(usize, u64)> =
            pinned.iter().copied().chain(others.iter().map(|&id| (id, first.offsets[id]))).collect();
        place_pairs(&ranked, &pairs, &partner, &placed, &floor)
    })
}

/// The blocks of a packing paired by [`Carried`] pairs.
struct Pairing {
    /// Each block's partner, set on the block of a pair's allocation.
    partner: Vec<Option<usize>>,
    /// Whether a block is the second of a pair (its life in the next scope).
    second: Vec<bool>,
    /// The pinned pairs, by the block of their allocation, with their offsets.
    pinned: Vec<(usize, u64)>,
}

fn pairing(blocks: usize, carried: &[Carried]) -> Pairing {
    let mut partner: Vec<Option<usize>> = vec![None; blocks];
    let mut second = vec![false; blocks];
    for pair in carried {
        partner[pair.block] = Some(pair.next);
        second[pair.next] = true;
    }
    let pinned = carried.iter().filter_map(|pair| pair.at.map(|at| (pair.block, at))).collect();
    Pairing { partner, second, pinned }
}

/// The most a scope served from `packing` holds when the memory carried into it (the `next`
/// block of each pair) lies outside the packing's range until freed, and the range is mapped
/// as hand-outs reach it: at each allocation, the carried-in bytes not yet freed plus the
/// highest end among the other blocks allocated so far. The scope that first follows a plan
/// made by [`pack_around_above`] pays this once; the plan's size is its least.
pub fn handover_peak(blocks: &[Block], carried: &[Carried], packing: &Packing) -> u64 {
    let mut incoming = vec![false; blocks.len()];
    for pair in carried {
        incoming[pair.next] = true;
    }
    let mut events: Vec<(u32, bool, usize)> = Vec::with_capacity(blocks.len() * 2);
    for (id, block) in blocks.iter().enumerate() {
        events.push((block.start, true, id));
        if block.end != Block::NEVER_FREED {
            events.push((block.end, false, id));
        }
    }
    // Frees first at one position, as in `lower_bound`.
    events.sort_unstable_by_key(|&(position, allocation, _)| (position, allocation));
    let mut outside: u64 = carried.iter().map(|pair| blocks[pair.next].size).sum();
    let (mut reach, mut peak) = (0u64, outside);
    for (_, allocation, id) in events {
        match (incoming[id], allocation) {
            (true, false) => outside -= blocks[id].size,
            (true, true) => {}
            (false, true) => {
                reach = reach.max(packing.offsets[id] + blocks[id].size);
                peak = peak.max(reach + outside);
            }
            (false, false) => {}
        }
    }
    peak
}

/// [`place_in_order`] with pairs of blocks at one offset: `pinned` first at their offsets, then
/// each block of `order` (and its partner, if it has one) in the smallest gap left by the
/// blocks placed so far that are alive at the same time as either, else above them, and no
/// lower than its `floor` (none where `floor` is empty).
fn place_pairs(
    blocks: &[Block],
    order: &[usize],
    partner: &[Option<usize>],
    pinned: &[(usize, u64)],
    floor: &[u64],
) -> Packing {
    let mut offsets = vec![0u64; blocks.len()];
    let mut index = TimeIndex::new(blocks);
    let mut size = 0u64;
    let mut put = |id: usize, offset: u64, offsets: &mut Vec<u64>, index: &mut TimeIndex| {
        for id in std::iter::once(id).chain(partner[id]) {
            offsets[id] = offset;
            size = size.max(offset + blocks[id].size);
            index.insert(id as u32, &blocks[id]);
        }
    };
    for &(id, offset) in pinned {
        put(id, offset, &mut offsets, &mut index);
    }
    let mut near: Vec<(u64, u64)> = Vec::new();
    for &id in order {
        near.clear();
        for of in std::iter::once(id).chain(partner[id]) {
            index.for_each_overlapping(&blocks[of], |other| {
                let offset = offsets[other as usize];
                near.push((offset, offset + blocks[other as usize].size));
            });
        }
        if let Some(&floor) = floor.get(id).filter(|&&floor| floor > 0) {
            near.push((0, floor));
        }
        near.sort_unstable();
        let need = blocks[id].size;
        let mut best: Option<(u64, u64)> = None;
        let mut top = 0u64;
        for &(offset, end) in &near {
            if offset > top {
                let gap = offset - top;
                if gap >= need && best.is_none_or(|(smallest, _)| gap < smallest) {
                    best = Some((gap, top));
                }
            }
            top = top.max(end);
        }
        put(id, best.map_or(top, |(_, offset)| offset), &mut offsets, &mut index);
    }
    Packing { offsets, size }
}

/// Lowers `packing` below granule boundaries while it can: the blocks that reach past the
/// highest boundary under its size move, largest first, each into the smallest gap below that
/// boundary between the time-overlapping blocks (the others keep their offsets), and when every
/// one of them fits the packing ends there, a granule lower, and the next boundary is tried. A
/// slab mapped in pages of `granule` bytes (a range that grows in place) holds `⌈size /
/// granule⌉` of them, so a packing that reaches a few KiB into its last page pays the whole
/// page; [`pack`] minimises bytes and does not see that. Returns the packing unchanged when no
/// boundary can be met, or when `granule` is 0.
pub fn below_granules(blocks: &[Block], mut packing: Packing, granule: u64) -> Packing {
    if granule == 0 || packing.offsets.len() != blocks.len() {
        return packing;
    }
    let ranked = compress(blocks);
    while packing.size > granule {
        let ceiling = (packing.size - 1) / granule * granule;
        match fit_below(&ranked, &packing, ceiling) {
            Some(lower) => packing = lower,
            None => break,
        }
    }
    packing
}

/// [`below_granules`]' move of the blocks reaching past `ceiling`, or `None` when one of them
/// finds no room under it.
fn fit_below(blocks: &[Block], packing: &Packing, ceiling: u64) -> Option<Packing> {
    let mut offsets = packing.offsets.clone();
    let reaches = |id: usize| offsets[id] + blocks[id].size > ceiling;
    let mut moved: Vec<usize> = (0..blocks.len()).filter(|&id| reaches(id)).collect();
    // What moves must fit beside what stays: a quick refusal before any placement.
    if moved.iter().any(|&id| blocks[id].size > ceiling) {
        return None;
    }
    moved.sort_by(|&a, &b| blocks[b].size.cmp(&blocks[a].size).then(blocks[a].start.cmp(&blocks[b].start)));
    let mut index = TimeIndex::new(blocks);
    let mut staying = vec![true; blocks.len()];
    for &id in &moved {
        staying[id] = false;
    }
    for id in (0..blocks.len()).filter(|&id| staying[id]) {
        index.insert(id as u32, &blocks[id]);
    }
    let mut near: Vec<(u64, u64)> = Vec::new();
    for &id in &moved {
        let block = &blocks[id];
        near.clear();
        index.for_each_overlapping(block, |other| {
            let offset = offsets[other as usize];
            near.push((offset, offset + blocks[other as usize].size));
        });
        near.push((ceiling, ceiling));
        near.sort_unstable();
        let mut best: Option<(u64, u64)> = None;
        let mut top = 0u64;
        for &(offset, end) in &near {
            if offset > top {
                let gap = offset.min(ceiling) - top.min(ceiling);
                if gap >= block.size && best.is_none_or(|(smallest, _)| gap < smallest) {
                    best = Some((gap, top));
                }
            }
            top = top.max(end);
        }
        let (_, offset) = best?;
        offsets[id] = offset;
        index.insert(id as u32, block);
    }
    let size = offsets.iter().zip(blocks).map(|(&offset, block)| offset + block.size).max().unwrap_or(0);
    Some(Packing { offsets, size })
}

/// Moves the blocks alive after the last allocation of `blocks` (what outlives the scope's
/// allocations: gradients freed at its end, memory it hands to the next scope) so that they
/// touch fewer pages of `page` bytes: page by page, those with the fewest of their bytes first,
/// every such block on the page moves, if each finds a gap between the time-overlapping blocks
/// below the packing's size on pages such blocks hold already, and else none does. Nothing else
/// moves and the size never grows. Once the scope's other blocks are freed these are all that
/// hold pages of a range mapped on demand, and [`pack`] minimises bytes, not pages: best fit
/// scatters small ones through the gaps the larger leave, each holding a page of its own.
/// Returns the packing unchanged when `page` is 0.
pub fn survivors_by_page(blocks: &[Block], mut packing: Packing, page: u64) -> Packing {
    let Some(last) = blocks.iter().map(|b| b.start).max() else { return packing };
    if page == 0 || packing.offsets.len() != blocks.len() {
        return packing;
    }
    let survivors: Vec<usize> = (0..blocks.len()).filter(|&id| blocks[id].end > last).collect();
    if survivors.len() < 2 {
        return packing;
    }
    let pages_of = |offset: u64, size: u64| offset / page..(offset + size).div_ceil(page);
    // The survivors on each page, kept as they move.
    let mut on_page: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut bytes_on: BTreeMap<u64, u64> = BTreeMap::new();
    for &id in &survivors {
        let (at, size) = (packing.offsets[id], blocks[id].size);
        for p in pages_of(at, size) {
            on_page.entry(p).or_default().push(id);
            *bytes_on.entry(p).or_default() += (at + size).min((p + 1) * page) - at.max(p * page);
        }
    }
    let mut by_bytes: Vec<(u64, u64)> = bytes_on.into_iter().map(|(p, bytes)| (bytes, p)).collect();
    by_bytes.sort_unstable();
    let ranked = compress(blocks);
    let mut index = TimeIndex::new(&ranked);
    for (id, block) in ranked.iter().enumerate() {
        index.insert(id as u32, block);
    }
    let lift = |on_page: &mut BTreeMap<u64, Vec<usize>>, id: usize, at: u64| {
        for p in pages_of(at, blocks[id].size) {
            let ids = on_page.get_mut(&p).expect("listed");
            ids.retain(|&other| other != id);
            if ids.is_empty() {
                on_page.remove(&p);
            }
        }
    };
    let lay = |on_page: &mut BTreeMap<u64, Vec<usize>>, id: usize, at: u64| {
        for p in pages_of(at, blocks[id].size) {
            on_page.entry(p).or_default().push(id);
        }
    };
    let ceiling = packing.size;
    let mut near: Vec<(u64, u64)> = Vec::new();
    for (_, vacated) in by_bytes {
        let Some(on) = on_page.get(&vacated) else { continue };
        let mut on = on.clone();
        on.sort_by(|&a, &b| blocks[b].size.cmp(&blocks[a].size).then(blocks[a].start.cmp(&blocks[b].start)));
        let mut moved: Vec<(usize, u64)> = Vec::new();
        for &id in &on {
            let (from, size) = (packing.offsets[id], blocks[id].size);
            lift(&mut on_page, id, from);
            let on_held = |at: u64| {
                !pages_of(at, size).contains(&vacated) && pages_of(at, size).all(|p| on_page.contains_key(&p))
            };
            near.clear();
            index.for_each_overlapping(&ranked[id], |other| {
                if other as usize != id {
                    let offset = packing.offsets[other as usize];
                    near.push((offset, offset + blocks[other as usize].size));
                }
            });
            near.push((ceiling, ceiling));
            near.sort_unstable();
            let mut found = None;
            let mut top = 0u64;
            for &(offset, end) in &near {
                if offset > top && offset - top >= size {
                    let (lo, hi) = (top, offset - size);
                    // The gap's two ends, and each end of a held page inside it.
                    let ends = on_page
                        .range(lo / page..=offset.div_ceil(page))
                        .flat_map(|(&p, _)| [p * page, ((p + 1) * page).saturating_sub(size)]);
                    found = [lo, hi].into_iter().chain(ends).filter(|c| (lo..=hi).contains(c)).find(|&c| on_held(c));
                    if found.is_some() {
                        break;
                    }
                }
                top = top.max(end);
            }
            let at = found.unwrap_or(from);
            packing.offsets[id] = at;
            lay(&mut on_page, id, at);
            if found.is_none() {
                // One stays, so the page stays held: the others go back.
                for (id, from) in moved.into_iter().rev() {
                    lift(&mut on_page, id, packing.offsets[id]);
                    packing.offsets[id] = from;
                    lay(&mut on_page, id, from);
                }
                break;
            }
            moved.push((id, from));
        }
    }
    packing
}

/// A packing's blocks split between its slab and a *bin*: a separate stretch of `len` bytes (the
/// unused end of the last page another pool's long-lived allocations touch), so that the slab
/// ends a page lower. See [`into_bin`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinLayout {
    /// Per block: its offset in the bin, or `None` where it is in the slab.
    pub at: Vec<Option<u64>>,
    /// Per block: its offset in the slab (meaningless for a block in the bin).
    pub offsets: Vec<u64>,
    /// The bin's length the layout was made for.
    pub len: u64,
    /// The slab's size now: the highest end of a block that stayed.
    pub slab_bytes: u64,
}

/// Puts some blocks of `packing` into a bin of `len` bytes so that the slab ends a whole
/// `granule` lower (or more): a slab taken in whole granules (pages mapped in a range that grows
/// in place) then holds a granule less for each boundary met.
///
/// First the blocks reaching past the highest boundary under the slab's size move to the bin
/// (with those moved before, for the next boundary), largest first, each at the start of the
/// smallest gap between the time-overlapping blocks already there; the others keep their
/// offsets. Where a block across the boundary is larger than the bin, small blocks alive where
/// more than the boundary is live go to the bin instead, largest first, until no moment needs
/// more, and the rest is packed again ([`pack`]) under the boundary — unless `keep_layout` (a
/// layout whose placement matters beyond its size: best fit in allocation order). `None` when
/// neither meets the first boundary (or the packing does not match the blocks). The bin holds no
/// more than 256 blocks, and a packing of more than 4096 blocks is not packed again.
pub fn into_bin(blocks: &[Block], packing: &Packing, granule: u64, len: u64, keep_layout: bool) -> Option<BinLayout> {
    if granule == 0 || len == 0 || packing.offsets.len() != blocks.len() || packing.size <= granule {
        return None;
    }
    let moved = move_top(blocks, packing, granule, len);
    if keep_layout { moved } else { moved.or_else(|| repack_under(blocks, packing, granule, len)) }
}

/// The most blocks a bin holds.
const BIN_MOST: usize = 256;

/// [`into_bin`]'s first way: the blocks at the top move.
fn move_top(blocks: &[Block], packing: &Packing, granule: u64, len: u64) -> Option<BinLayout> {
    let mut layout: Option<BinLayout> = None;
    let mut moved: Vec<usize> = Vec::new();
    let mut top = packing.size;
    while top > granule {
        let ceiling = (top - 1) / granule * granule;
        let mut candidate = moved.clone();
        candidate.extend(
            (0..blocks.len()).filter(|&id| !moved.contains(&id) && packing.offsets[id] + blocks[id].size > ceiling),
        );
        if candidate.len() > BIN_MOST {
            break;
        }
        let Some(at) = bin_offsets(blocks, &mut candidate, len) else { break };
        let mut in_bin = vec![None; blocks.len()];
        for (&id, &offset) in candidate.iter().zip(&at) {
            in_bin[id] = Some(offset);
        }
        top = (0..blocks.len())
            .filter(|&id| in_bin[id].is_none())
            .map(|id| packing.offsets[id] + blocks[id].size)
            .max()
            .unwrap_or(0);
        moved = candidate;
        layout = Some(BinLayout { at: in_bin, offsets: packing.offsets.clone(), len, slab_bytes: top });
    }
    layout
}

/// [`into_bin`]'s second way: small blocks alive where too much is live go to the bin, and the
/// rest is packed again under the boundary.
fn repack_under(blocks: &[Block], packing: &Packing, granule: u64, len: u64) -> Option<BinLayout> {
    const MOST_PACKED: usize = 4096;
    let ceiling = (packing.size - 1) / granule * granule;
    if blocks.len() > MOST_PACKED || ceiling == 0 || lower_bound(blocks) > ceiling + len {
        return None;
    }
    // Live bytes at each position of the compressed time axis.
    let ranked = compress(blocks);
    let horizon = ranked.iter().map(|b| if b.end == Block::NEVER_FREED { b.start } else { b.end }).max()? as usize + 1;
    let span = |b: &Block| b.start as usize..(if b.end == Block::NEVER_FREED { horizon } else { b.end as usize });
    let mut live = vec![0u64; horizon];
    for block in &ranked {
        for at in span(block) {
            live[at] += block.size;
        }
    }
    let mut candidates: Vec<usize> = (0..blocks.len()).filter(|&id| blocks[id].size <= len).collect();
    candidates.sort_by(|&a, &b| blocks[b].size.cmp(&blocks[a].size).then(blocks[a].start.cmp(&blocks[b].start)));
    let mut chosen: Vec<usize> = Vec::new();
    let mut chosen_at: Vec<u64> = Vec::new();
    let mut near: Vec<(u64, u64)> = Vec::new();
    for id in candidates {
        if live.iter().all(|&bytes| bytes <= ceiling) || chosen.len() == BIN_MOST {
            break;
        }
        let block = &ranked[id];
        if span(block).all(|at| live[at] <= ceiling) {
            continue;
        }
        near.clear();
        near.extend(
            chosen
                .iter()
                .zip(&chosen_at)
                .filter(|&(&other, _)| ranked[other].overlaps_in_time(block))
                .map(|(&other, &offset)| (offset, offset + blocks[other].size)),
        );
        let Some(offset) = smallest_gap(&mut near, block.size, len) else { continue };
        chosen.push(id);
        chosen_at.push(offset);
        for at in span(block) {
            live[at] -= block.size;
        }
    }
    if live.iter().any(|&bytes| bytes > ceiling) {
        return None;
    }
    let mut in_bin = vec![None; blocks.len()];
    for (&id, &offset) in chosen.iter().zip(&chosen_at) {
        in_bin[id] = Some(offset);
    }
    let rest: Vec<usize> = (0..blocks.len()).filter(|&id| in_bin[id].is_none()).collect();
    let repacked = pack(&rest.iter().map(|&id| blocks[id]).collect::<Vec<_>>());
    if repacked.size > ceiling {
        return None;
    }
    let mut offsets = vec![0u64; blocks.len()];
    for (&id, &offset) in rest.iter().zip(&repacked.offsets) {
        offsets[id] = offset;
    }
    Some(BinLayout { at: in_bin, offsets, len, slab_bytes: repacked.size })
}

/// Offsets in a bin of `len` bytes for `ids` (sorted here, largest first), or `None` when one
/// finds no room.
fn bin_offsets(blocks: &[Block], ids: &mut [usize], len: u64) -> Option<Vec<u64>> {
    ids.sort_by(|&a, &b| blocks[b].size.cmp(&blocks[a].size).then(blocks[a].start.cmp(&blocks[b].start)));
    let mut at: Vec<u64> = Vec::with_capacity(ids.len());
    let mut near: Vec<(u64, u64)> = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        let block = &blocks[id];
        near.clear();
        near.extend(
            ids[..i]
                .iter()
                .zip(&at)
                .filter(|&(&other, _)| blocks[other].overlaps_in_time(block))
                .map(|(&other, &offset)| (offset, offset + blocks[other].size)),
        );
        at.push(smallest_gap(&mut near, block.size, len)?);
    }
    Some(at)
}

/// The start of the smallest gap of at least `size` bytes below `len` between the `(offset, end)`
/// ranges of `near` (sorted here), the lowest on ties; `None` when none holds it.
fn smallest_gap(near: &mut Vec<(u64, u64)>, size: u64, len: u64) -> Option<u64> {
    near.push((len, len));
    near.sort_unstable();
    let mut best: Option<(u64, u64)> = None;
    let mut top = 0u64;
    for &(offset, end) in near.iter() {
        if offset > top {
            let gap = offset - top;
            if gap >= size && best.is_none_or(|(smallest, _)| gap < smallest) {
                best = Some((gap, top));
            }
        }
        top = top.max(end);
    }
    best.map(|(_, offset)| offset)
}

/// Why a packing is not valid for its blocks: what [`first_conflict`] finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Conflict {
    /// There are not as many offsets as blocks.
    Count {
        /// Blocks.
        blocks: usize,
        /// Offsets.
        offsets: usize,
    },
    /// Block `block` is empty or ends no later than it starts.
    Malformed {
        /// Its index.
        block: usize,
    },
    /// Block `block` reaches past the slab's end.
    OutsideSlab {
        /// Its index.
        block: usize,
    },
    /// Blocks `first` and `second` are alive at the same time and share bytes.
    Overlap {
        /// The one allocated (or placed, on ties) first.
        first: usize,
        /// The other.
        second: usize,
    },
}

/// Checks a packing independently of how it was made: every block inside the slab, and no two
/// blocks alive at the same time overlapping. A sweep over time with the live blocks by offset.
pub fn is_valid(blocks: &[Block], packing: &Packing) -> bool {
    first_conflict(blocks, packing).is_none()
}

/// What makes a packing invalid, the first found by [`is_valid`]'s sweep; `None` when valid.
pub fn first_conflict(blocks: &[Block], packing: &Packing) -> Option<Conflict> {
    if packing.offsets.len() != blocks.len() {
        return Some(Conflict::Count { blocks: blocks.len(), offsets: packing.offsets.len() });
    }
    let mut events: Vec<(u32, bool, usize)> = Vec::with_capacity(blocks.len() * 2);
    for (id, block) in blocks.iter().enumerate() {
        if block.size == 0 || block.start >= block.end {
            return Some(Conflict::Malformed { block: id });
        }
        match packing.offsets[id].checked_add(block.size) {
            Some(end) if end <= packing.size => {}
            _ => return Some(Conflict::OutsideSlab { block: id }),
        }
        events.push((block.start, true, id));
        if block.end != Block::NEVER_FREED {
            events.push((block.end, false, id));
        }
    }
    events.sort_unstable();
    // Live blocks by offset: (end, id).
    let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    for (_, allocation, id) in events {
        let (offset, end) = (packing.offsets[id], packing.offsets[id] + blocks[id].size);
        if !allocation {
            live.remove(&offset);
            continue;
        }
        if let Some((_, &(below_end, below))) = live.range(..=offset).next_back()
            && below_end > offset
        {
            return Some(Conflict::Overlap { first: below, second: id });
        }
        if let Some((&above, &(_, other))) = live.range(offset..).next()
            && above < end
        {
            return Some(Conflict::Overlap { first: other, second: id });
        }
        live.insert(offset, (end, id));
    }
    None
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn block(size: u64, start: u32, end: u32) -> Block {
        Block { size, start, end }
    }

    /// Blocks from a random sequence of allocations and frees (distinct positions, as recorded).
    fn sequence() -> impl Strategy<Value = Vec<Block>> {
        prop::collection::vec((1u64..64, any::<bool>(), any::<prop::sample::Index>()), 1..120).prop_map(|ops| {
            let mut blocks: Vec<Block> = Vec::new();
            let mut live: Vec<usize> = Vec::new();
            for (position, (size, allocate, pick)) in ops.into_iter().enumerate() {
                let position = position as u32;
                if allocate || live.is_empty() {
                    live.push(blocks.len());
                    blocks.push(block(size * 512, position, Block::NEVER_FREED));
                } else {
                    let id = live.swap_remove(pick.index(live.len()));
                    blocks[id].end = position;
                }
            }
            blocks
        })
    }

    /// A gradient made late in a scope and freed early in the next, and activations: the
    /// gradient's memory is theirs between its free and its next allocation.
    fn carried_scope() -> (Vec<Block>, Vec<Carried>) {
        let blocks = vec![
            block(100, 1, 4),                 // activation, before the gradient's free
            block(100, 5, 7),                 // activation, after it
            block(60, 8, Block::NEVER_FREED), // the gradient, made at the end
            block(60, 0, 3),                  // the same gradient, carried in, freed at 3
        ];
        (blocks, vec![Carried { block: 2, next: 3, at: None }])
    }

    #[test]
    fn a_carried_pair_shares_one_offset_and_its_memory_between_the_scopes() {
        let (blocks, carried) = carried_scope();
        let packing = pack_around(&blocks, &carried, &[]);
        assert!(is_valid(&blocks, &packing));
        assert_eq!(packing.offsets[2], packing.offsets[3]);
        // The activation alive with the carried-in gradient sits apart from it, the one after
        // its free may not: 160 bytes, the peak of live bytes, not 220.
        assert_eq!(packing.size, 160);
        assert_eq!(lower_bound(&blocks), 160);
    }

    #[test]
    fn a_pinned_pair_stays_where_it_lives_and_the_rest_packs_around_it() {
        let (blocks, mut carried) = carried_scope();
        carried[0].at = Some(40);
        let packing = pack_around(&blocks, &carried, &[]);
        assert!(is_valid(&blocks, &packing));
        assert_eq!((packing.offsets[2], packing.offsets[3]), (40, 40));
        // Below the gradient there is no room for the first activation: it goes above.
        assert_eq!(packing.offsets[0], 100);
        assert_eq!(packing.size, 200);
    }

    #[test]
    fn placed_blocks_stay_where_they_lie_and_the_rest_packs_around_them() {
        // Partway through a scope: a block of 2 made at 0 lies at 6, memory of 4 carried in lies
        // at 0 until 3 and is made again at 5 (a pair pinned there), and two blocks of 3 alive
        // from 1 to 4 and from 2 to 6 are yet to come. Around what lies where it lies, they go
        // above the placed block (the gap of 2 under it holds neither), the longer-lived first:
        // 14 in all.
        let blocks = [
            block(2, 0, Block::NEVER_FREED),
            block(4, 5, Block::NEVER_FREED),
            block(4, 0, 3),
            block(3, 1, 4),
            block(3, 2, 6),
        ];
        let pairs = [Carried { block: 1, next: 2, at: Some(0) }];
        let packing = pack_around_placed(&blocks, &pairs, &[(0, 6)], &[]);
        assert!(is_valid(&blocks, &packing));
        assert_eq!(packing.offsets, [6, 0, 0, 11, 8]);
        assert_eq!(packing.size, 14);
        // An earlier layout of the rest, as small, is kept; where a block of it is no longer
        // clear (the one at 4 would now reach into the placed block), that block alone moves.
        for previous in [[None, None, None, Some(8), Some(11)], [None, None, None, Some(4), Some(11)]] {
            let packing = pack_around_placed(&blocks, &pairs, &[(0, 6)], &previous);
            assert!(is_valid(&blocks, &packing));
            assert_eq!((packing.offsets, packing.size), (vec![6, 0, 0, 8, 11], 14));
        }
    }

    #[test]
    fn an_entrys_own_place_goes_beside_its_second_place() {
        // Gradients pinned at 0, 10, 12 and 17, each made at 5 and carried in until 1; a batch
        // of 4 with two places, its second pinned at 1, where the one carried in lies until 1;
        // three activations of 3 between. Placed by the packing, the batch's own place takes the
        // smallest gap between the pinned memory, at 13, and the activations go around it (20
        // bytes); beside its second place, at 5, they fit above it (18).
        let mut blocks = Vec::new();
        let mut carried = Vec::new();
        for (size, start, at) in [(1, 5, 0), (4, 1, 1), (1, 5, 10), (1, 5, 12), (1, 5, 17)] {
            carried.push(Carried { block: blocks.len(), next: blocks.len() + 1, at: Some(at) });
            blocks.push(block(size, start, Block::NEVER_FREED));
            blocks.push(block(size, 0, 1));
        }
        let own = blocks.len();
        blocks.push(block(4, 0, Block::NEVER_FREED));
        blocks.extend([block(3, 2, 4), block(3, 2, 4), block(3, 2, 4)]);
        let packed = pack_around(&blocks, &carried, &[]);
        assert!(is_valid(&blocks, &packed));
        assert_eq!((packed.offsets[own], packed.size), (13, 20));
        let beside = pack_around(&blocks, &carried, &[Alternate { own, second: 1 }]);
        assert!(is_valid(&blocks, &beside));
        assert_eq!((beside.offsets[own], beside.size), (5, 18));
    }

    #[test]
    fn carried_memory_placed_above_is_handed_over_within_the_plans_size() {
        let (blocks, carried) = carried_scope();
        // As small, the gradient at the bottom and the first activation above it: a scope that
        // finds the gradient carried in elsewhere holds it there while it reaches the
        // activation's end, 60 + 160 bytes.
        let low = Packing { offsets: vec![60, 0, 0, 0], size: 160 };
        assert!(is_valid(&blocks, &low));
        assert_eq!(handover_peak(&blocks, &carried, &low), 220);
        // Above what is made before its free, it costs that scope nothing.
        let above = pack_around_above(&blocks, &carried);
        assert!(is_valid(&blocks, &above));
        assert_eq!((above.offsets[2], above.offsets[3], above.offsets[0], above.size), (100, 100, 0, 160));
        assert_eq!(handover_peak(&blocks, &carried, &above), 160);
    }

    #[test]
    fn the_lower_bound_is_the_peak_of_live_bytes() {
        let blocks = [block(100, 0, 3), block(50, 1, 2), block(70, 4, 5), block(10, 2, Block::NEVER_FREED)];
        // Positions 1..2: 150 live; at 2 the 50 goes and the 10 comes: 110; at 4: 10 + 70 = 80.
        assert_eq!(lower_bound(&blocks), 150);
        assert_eq!(lower_bound(&[]), 0);
    }

    #[test]
    fn blocks_that_never_meet_share_their_memory() {
        let blocks = [block(1024, 0, 1), block(1024, 2, 3), block(512, 4, 5)];
        let packing = greedy_by_size(&blocks);
        assert_eq!(packing.size, 1024);
        assert_eq!(packing.offsets, vec![0, 0, 0]);
        assert!(is_valid(&blocks, &packing));
    }

    #[test]
    fn a_smaller_block_takes_the_smallest_gap_that_holds_it() {
        // A (1536) and C (512) alive with a 1024 hole between them, left by B; then D (512)
        // arrives while A and C are live and goes into the hole, not above C.
        let blocks = [block(1536, 0, 20), block(1024, 1, 3), block(512, 2, 20), block(512, 4, 20)];
        let packing = greedy_by_size(&blocks);
        assert!(is_valid(&blocks, &packing));
        assert_eq!(packing.offsets, vec![0, 1536, 2560, 1536]);
        assert_eq!(packing.size, 3072);
        assert_eq!(packing.size, lower_bound(&blocks));
    }

    #[test]
    fn validation_rejects_overlaps_and_blocks_outside_the_slab() {
        let blocks = [block(1024, 0, 3), block(512, 1, 2)];
        assert!(!is_valid(&blocks, &Packing { offsets: vec![0, 512], size: 1536 }));
        assert!(!is_valid(&blocks, &Packing { offsets: vec![0, 1024], size: 1024 }));
        assert!(is_valid(&blocks, &Packing { offsets: vec![0, 1024], size: 1536 }));
        assert_eq!(
            first_conflict(&blocks, &Packing { offsets: vec![0, 512], size: 1536 }),
            Some(Conflict::Overlap { first: 0, second: 1 })
        );
        assert_eq!(
            first_conflict(&blocks, &Packing { offsets: vec![0, 1024], size: 1024 }),
            Some(Conflict::OutsideSlab { block: 1 })
        );
        // Once the first is freed, the same range may serve the next.
        let blocks = [block(1024, 0, 1), block(1024, 2, 3)];
        assert!(is_valid(&blocks, &Packing { offsets: vec![0, 0], size: 1024 }));
    }

    #[test]
    fn the_best_ordering_is_kept() {
        // Greedy by size takes the earlier 1536 first and leaves no room beside the 1024s;
        // taking the longer-lived 1536 first meets the lower bound (3584 at positions 8 to 9).
        let blocks = [block(1536, 2, 5), block(1536, 3, 9), block(1024, 8, 11), block(1024, 7, 10)];
        assert_eq!(greedy_by_size(&blocks).size, 4096);
        let packing = pack(&blocks);
        assert!(is_valid(&blocks, &packing));
        assert_eq!(packing.size, 3584);
        assert_eq!(lower_bound(&blocks), 3584);
    }

    #[test]
    fn best_fit_in_order_places_each_block_as_it_comes() {
        // A (2) lives; B (2) is freed once C (1) is allocated; D (3) comes last. In order, D
        // finds B's hole too small and goes on top (8); greedy by size places D first (6).
        let blocks = [block(2048, 0, 20), block(2048, 1, 3), block(1024, 2, 20), block(3072, 4, 20)];
        let in_order = best_fit_in_order(&blocks);
        assert!(is_valid(&blocks, &in_order));
        assert_eq!(in_order.offsets, vec![0, 2048, 4096, 5120]);
        assert_eq!(in_order.size, 8192);
        assert_eq!(pack(&blocks).size, 6144);
        // Every prefix is laid out as on its own: the layout never depends on what comes later.
        for n in 1..blocks.len() {
            assert_eq!(best_fit_in_order(&blocks[..n]).offsets, in_order.offsets[..n]);
        }
    }

    #[test]
    fn best_fit_in_order_around_carried_memory_places_each_block_as_it_comes() {
        // The blocks above, and memory carried in (E', freed at 1) and made again at 5 (E), pinned
        // at 0. In order: A finds E' below it; B, C and D stack as before, each on the block
        // before (B's hole is too small for D); E is E''s place.
        let blocks = [
            block(2048, 0, 20),
            block(2048, 1, 3),
            block(1024, 2, 20),
            block(3072, 4, 20),
            block(1024, 5, Block::NEVER_FREED),
            block(1024, 0, 1),
        ];
        let carried = [Carried { block: 4, next: 5, at: Some(0) }];
        let in_order = best_fit_in_order_around(&blocks, &carried);
        assert!(is_valid(&blocks, &in_order));
        assert_eq!(in_order.offsets, vec![1024, 3072, 5120, 6144, 0, 0]);
        assert_eq!(in_order.size, 9216);
        assert_eq!(
            pack_around(&blocks, &carried, &[]).size,
            7168,
            "the packing puts D in the place A's neighbours leave"
        );
        // Without pairs it is best fit in order; with its first block in order and the rest
        // packed around it, the packing's size.
        assert_eq!(best_fit_in_order_around(&blocks[..4], &[]), best_fit_in_order(&blocks[..4]));
        let prefix = pack_after_prefix_around(&blocks, &carried, 1);
        assert!(is_valid(&blocks, &prefix));
        assert_eq!((prefix.offsets[0], prefix.offsets[4], prefix.size), (1024, 0, 7168));
    }

    #[test]
    fn a_prefix_in_allocation_order_then_the_rest_packed_around_it() {
        // As above: in order D goes on top (8 KiB), packed it goes first (6 KiB). With the first
        // two blocks in order, A and B keep their in-order places and the rest is packed around
        // them: D fits beside A once B is freed.
        let blocks = [block(2048, 0, 20), block(2048, 1, 3), block(1024, 2, 20), block(3072, 4, 20)];
        let in_order = best_fit_in_order(&blocks);
        for prefix in 0..=blocks.len() {
            let packing = pack_after_prefix(&blocks, prefix);
            assert!(is_valid(&blocks, &packing), "prefix {prefix}");
            assert_eq!(packing.offsets[..prefix], in_order.offsets[..prefix], "prefix {prefix}");
            assert!(packing.size <= in_order.size && packing.size >= pack(&blocks).size, "prefix {prefix}");
        }
        assert_eq!(pack_after_prefix(&blocks, 2).size, 6144);
        assert_eq!(pack_after_prefix(&blocks, 4), in_order);
    }

    /// The placement as first written: every placed block scanned for each new one. The index
    /// must find the same time-overlapping blocks, so the packings must agree.
    fn quadratic_place(blocks: &[Block], order: &[usize]) -> Packing {
        let mut offsets = vec![0u64; blocks.len()];
        let mut placed: Vec<(u64, Block)> = Vec::new();
        let mut size = 0u64;
        for &id in order {
            let block = &blocks[id];
            let (mut best, mut top): (Option<(u64, u64)>, u64) = (None, 0);
            for &(offset, other) in &placed {
                if !block.overlaps_in_time(&other) {
                    continue;
                }
                if offset > top && offset - top >= block.size && best.is_none_or(|(g, _)| offset - top < g) {
                    best = Some((offset - top, top));
                }
                top = top.max(offset + other.size);
            }
            let offset = best.map_or(top, |(_, offset)| offset);
            offsets[id] = offset;
            size = size.max(offset + block.size);
            let at = placed.partition_point(|&(o, _)| o <= offset);
            placed.insert(at, (offset, *block));
        }
        Packing { offsets, size }
    }

    #[test]
    fn a_long_sequence_packs_valid_and_near_the_bound() {
        // 200 000 allocations: a few hundred long-lived, the rest short, as a training trace.
        let mut blocks = Vec::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for i in 0..200_000u32 {
            let size = 512 * (1 + next() % 4096);
            let life = if i % 500 == 0 { 400_000 } else { 1 + (next() % 64) as u32 };
            blocks.push(block(size, 2 * i, (2 * i + 2 * life + 1).min(400_001)));
        }
        let packing = pack(&blocks);
        assert!(is_valid(&blocks, &packing));
        let bound = lower_bound(&blocks);
        assert!(packing.size >= bound && packing.size <= bound + bound / 4, "{} vs {bound}", packing.size);
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_blocks_past_a_granule_boundary_move_to_the_bin_and_the_slab_ends_a_granule_lower() {
        // 2 MiB and, meeting it, 0.5 MiB: packed to 2.5 MiB, two 2 MiB granules.
        let blocks = [block(2 * MIB, 0, 4), block(MIB / 2, 1, 3), block(MIB / 4, 5, 6)];
        let packing = pack(&blocks);
        assert_eq!(packing.size, 5 * MIB / 2);
        let layout = into_bin(&blocks, &packing, 2 * MIB, MIB, false).expect("the half MiB fits the bin");
        assert_eq!(layout.at, vec![None, Some(0), None]);
        assert_eq!((layout.slab_bytes, layout.len), (2 * MIB, MIB));
        // A bin smaller than the block above the boundary: nothing moves.
        assert_eq!(into_bin(&blocks, &packing, 2 * MIB, MIB / 4, false), None);
        // A packing inside one granule has no boundary to meet.
        assert_eq!(into_bin(&blocks[1..], &pack(&blocks[1..]), 2 * MIB, MIB, false), None);
    }

    #[test]
    fn where_a_block_across_the_boundary_is_larger_than_the_bin_small_ones_go_and_the_rest_is_packed_again() {
        // 1.25 + 0.5 + 0.5 + 0.25 MiB alive together: 2.5 MiB. Packed, a 0.5 MiB block crosses
        // 2 MiB with the 0.25 above it: 0.75 MiB past the boundary, more than the 0.5 MiB bin.
        let blocks = [block(5 * MIB / 4, 0, 9), block(MIB / 2, 1, 8), block(MIB / 2, 2, 7), block(MIB / 4, 3, 6)];
        let packing = pack(&blocks);
        assert_eq!(packing.size, 5 * MIB / 2);
        let layout = into_bin(&blocks, &packing, 2 * MIB, MIB / 2, false).expect("one half MiB block goes");
        assert_eq!(layout.at.iter().filter(|at| at.is_some()).count(), 1);
        assert_eq!(layout.at[1], Some(0), "the larger, earlier of the two");
        assert_eq!(layout.slab_bytes, 2 * MIB);
        // Less than the 0.5 MiB that must go: nothing.
        assert_eq!(into_bin(&blocks, &packing, 2 * MIB, MIB / 4, false), None);
    }

    #[test]
    fn blocks_in_the_bin_that_meet_in_time_do_not_share_bytes() {
        // Two half MiB blocks alive together above a 2 MiB one: the bin must hold both side by
        // side; a third that meets neither reuses the bin's start.
        let blocks = [block(2 * MIB, 0, 9), block(MIB / 2, 1, 4), block(MIB / 2, 2, 5), block(MIB / 2, 6, 7)];
        let packing = pack(&blocks);
        assert!(packing.size > 2 * MIB);
        let layout = into_bin(&blocks, &packing, 2 * MIB, MIB, false).expect("both fit side by side");
        assert_eq!(layout.slab_bytes, 2 * MIB);
        let mut in_bin: Vec<u64> = layout.at[1..3].iter().map(|at| at.expect("moved")).collect();
        in_bin.sort_unstable();
        assert_eq!(in_bin, vec![0, MIB / 2]);
        assert_eq!(into_bin(&blocks, &packing, 2 * MIB, 3 * MIB / 4, false), None, "not both in 0.75 MiB");
    }

    /// The pages of `page` bytes the blocks alive after the last allocation touch.
    fn survivor_pages(blocks: &[Block], packing: &Packing, page: u64) -> std::collections::BTreeSet<u64> {
        let last = blocks.iter().map(|b| b.start).max().unwrap_or(0);
        (0..blocks.len())
            .filter(|&id| blocks[id].end > last)
            .flat_map(|id| packing.offsets[id] / page..(packing.offsets[id] + blocks[id].size).div_ceil(page))
            .collect()
    }

    #[test]
    fn what_outlives_the_scope_gathers_on_the_pages_it_already_holds() {
        let page = 2 * MIB;
        // Two activations, then two small gradients alive to the end, each left on a page of its
        // own: the first where the first activation was, the second where the second was.
        let mut blocks = vec![
            block(2 * MIB, 0, 3),                  // activation
            block(MIB / 4, 4, Block::NEVER_FREED), // gradient, page 0
            block(2 * MIB, 1, 5),                  // activation
            block(MIB / 4, 6, Block::NEVER_FREED), // gradient, page 1
        ];
        let scattered = Packing { offsets: vec![0, 0, 2 * MIB, 3 * MIB], size: 4 * MIB };
        assert!(is_valid(&blocks, &scattered));
        assert_eq!(survivor_pages(&blocks, &scattered, page).len(), 2);
        let gathered = survivors_by_page(&blocks, scattered.clone(), page);
        assert!(is_valid(&blocks, &gathered));
        assert_eq!(gathered.size, scattered.size);
        // The first gradient cannot leave page 0 (the second activation holds page 1 when it is
        // made); the second, made after that activation's free, joins it there.
        assert_eq!(gathered.offsets, vec![0, 0, 2 * MIB, MIB / 4]);
        assert_eq!(survivor_pages(&blocks, &gathered, page).len(), 1);
        assert_eq!(survivors_by_page(&blocks, scattered.clone(), 0), scattered, "no pages: unchanged");

        // An activation alive when the second gradient is made fills the rest of page 0: it stays.
        blocks.push(block(7 * MIB / 4, 5, 8));
        let full = Packing { offsets: vec![0, 0, 2 * MIB, 3 * MIB, MIB / 4], size: 4 * MIB };
        assert!(is_valid(&blocks, &full));
        assert_eq!(survivors_by_page(&blocks, full.clone(), page), full);
    }

    proptest! {
        #[test]
        fn gathering_what_outlives_the_scope_moves_only_it_keeps_blocks_apart_and_holds_no_more_pages(
            blocks in sequence(),
            page in 1u64..8,
        ) {
            let page = page * 1024;
            let packing = pack(&blocks);
            let gathered = survivors_by_page(&blocks, packing.clone(), page);
            prop_assert!(is_valid(&blocks, &gathered));
            prop_assert!(gathered.size <= packing.size);
            let last = blocks.iter().map(|b| b.start).max().unwrap_or(0);
            for (id, block) in blocks.iter().enumerate() {
                prop_assert!(block.end > last || gathered.offsets[id] == packing.offsets[id], "{id} moved");
            }
            prop_assert!(survivor_pages(&blocks, &gathered, page).len() <= survivor_pages(&blocks, &packing, page).len());
        }
    }

    proptest! {
        #[test]
        fn a_bin_layout_keeps_every_block_apart_and_lowers_the_slab_by_granules(
            blocks in sequence(),
            granule in 1u64..16,
            len in 1u64..16,
        ) {
            let (granule, len) = (granule * 2048, len * 1024);
            let packing = pack(&blocks);
            for keep_layout in [false, true] {
            if let Some(layout) = into_bin(&blocks, &packing, granule, len, keep_layout) {
                if keep_layout {
                    prop_assert!((0..blocks.len()).all(|id| layout.offsets[id] == packing.offsets[id]));
                }
                prop_assert!(layout.slab_bytes.div_ceil(granule) < packing.size.div_ceil(granule));
                for (id, block) in blocks.iter().enumerate() {
                    match layout.at[id] {
                        Some(at) => prop_assert!(at + block.size <= len),
                        None => prop_assert!(layout.offsets[id] + block.size <= layout.slab_bytes),
                    }
                    for (other, second) in blocks.iter().enumerate().skip(id + 1) {
                        if !block.overlaps_in_time(second) {
                            continue;
                        }
                        let (a, b) = match (layout.at[id], layout.at[other]) {
                            (Some(a), Some(b)) => (a, b),
                            (None, None) => (layout.offsets[id], layout.offsets[other]),
                            _ => continue,
                        };
                        prop_assert!(a + block.size <= b || b + second.size <= a, "{id} and {other} share bytes");
                    }
                }
            }
            }
        }

        #[test]
        fn carried_pairs_share_their_offset_and_nothing_alive_with_either_overlaps(
            mut blocks in sequence(),
            picks in prop::collection::vec((any::<bool>(), 0u32..400, any::<bool>()), 120),
        ) {
            // Blocks never freed, some of them carried into a next scope up to a free there, some
            // of those pinned at a stretch of their own above everything else.
            let mut carried = Vec::new();
            let mut pin_at = blocks.iter().map(|b| b.size).sum::<u64>();
            for id in 0..blocks.len() {
                let (carry, free, pin) = picks[id];
                // Freed in the next scope before it is made again, as a plan needs of memory it
                // hands out at one place scope after scope.
                if blocks[id].end == Block::NEVER_FREED && carry && blocks[id].start > 0 {
                    blocks.push(Block { size: blocks[id].size, start: 0, end: 1 + free % blocks[id].start });
                    let at = pin.then(|| { pin_at += blocks[id].size; pin_at - blocks[id].size });
                    carried.push(Carried { block: id, next: blocks.len() - 1, at });
                }
            }
            let packing = pack_around(&blocks, &carried, &[]);
            prop_assert!(is_valid(&blocks, &packing), "{:?} {:?} -> {:?}", blocks, carried, packing);
            for pair in &carried {
                prop_assert_eq!(packing.offsets[pair.block], packing.offsets[pair.next]);
                if let Some(at) = pair.at {
                    prop_assert_eq!(packing.offsets[pair.block], at);
                }
            }
            prop_assert!(packing.size >= lower_bound(&blocks));
            for prefix in [usize::MAX, blocks.len() / 4] {
                let in_order = pack_after_prefix_around(&blocks, &carried, prefix);
                prop_assert!(is_valid(&blocks, &in_order), "{:?} {:?} -> {:?}", blocks, carried, in_order);
                for pair in &carried {
                    prop_assert_eq!(in_order.offsets[pair.block], in_order.offsets[pair.next]);
                    if let Some(at) = pair.at {
                        prop_assert_eq!(in_order.offsets[pair.block], at);
                    }
                }
            }
            // Above: the same, and each unpinned pair above every block outside the pairs made
            // before its free in the next scope.
            let above = pack_around_above(&blocks, &carried);
            prop_assert!(is_valid(&blocks, &above), "{:?} {:?} -> {:?}", blocks, carried, above);
            let mut paired = vec![false; blocks.len()];
            for pair in &carried {
                paired[pair.block] = true;
                paired[pair.next] = true;
            }
            for pair in &carried {
                prop_assert_eq!(above.offsets[pair.block], above.offsets[pair.next]);
                match pair.at {
                    Some(at) => prop_assert_eq!(above.offsets[pair.block], at),
                    None => {
                        for id in (0..blocks.len()).filter(|&id| !paired[id] && blocks[id].start < blocks[pair.next].end) {
                            prop_assert!(above.offsets[id] + blocks[id].size <= above.offsets[pair.block]);
                        }
                    }
                }
            }
            prop_assert!(handover_peak(&blocks, &carried, &above) >= above.size.max(lower_bound(&blocks)));
        }

        #[test]
        fn packings_are_valid_and_never_below_the_bound(blocks in sequence()) {
            let greedy = greedy_by_size(&blocks);
            prop_assert!(is_valid(&blocks, &greedy), "{:?} -> {:?}", blocks, greedy);
            prop_assert!(greedy.size >= lower_bound(&blocks));
            prop_assert!(greedy.size <= blocks.iter().map(|b| b.size).sum::<u64>());
            let best = pack(&blocks);
            prop_assert!(is_valid(&blocks, &best), "{:?} -> {:?}", blocks, best);
            prop_assert!(best.size >= lower_bound(&blocks) && best.size <= greedy.size);
            let mut order: Vec<usize> = (0..blocks.len()).collect();
            order.sort_by(|&a, &b| blocks[b].size.cmp(&blocks[a].size).then(blocks[a].start.cmp(&blocks[b].start)));
            prop_assert_eq!(&greedy, &quadratic_place(&blocks, &order));
            let in_order = best_fit_in_order(&blocks);
            prop_assert!(is_valid(&blocks, &in_order), "{:?} -> {:?}", blocks, in_order);
            prop_assert!(in_order.size >= lower_bound(&blocks));
        }
    }
}
