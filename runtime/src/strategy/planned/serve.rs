//! Serving a scope's allocations: from its plan by index, online best fit in the slab, or from
//! the fallback chunks.
//!
//! # Why a hand-out never overlaps a live allocation
//!
//! Planned entries are handed out in increasing order, each at most once per scope (the cursor
//! only moves forward). When entry *i* is handed out, every live slab allocation is an entry
//! *j < i* of the same plan or a range on the *late list*. An entry *j* the recording had still
//! alive when *i* was allocated was packed apart from *i* (the packing is checked before it is
//! kept). An entry the recording had freed by then but which is still live — freed late, or never
//! — is moved to the late list as the cursor passes its planned free, and so are the live entries
//! of a plan the scope switched away from; *i* is handed out only if it overlaps nothing on the
//! late list. An entry handed out larger than planned was checked against every live slab
//! allocation and is put on the late list itself. An entry with a second place (memory carried
//! into the next scope, made again there before the one carried in is freed) is handed out at
//! it only where its own offset is taken and the second place overlaps nothing on the late
//! list; the plan packs both places apart from every other entry for the whole scope, and a
//! scope that leaves its plan puts each live entry on the late list where it lies. A plan
//! corrected partway through a scope ([`Planned::correct_guess`]) is packed around every live
//! allocation of the scope where it lies, until its planned free, and the memory carried in
//! stays on the late list until freed, so the same holds. A scope of a
//! new shape, and a scope after a deviation, serves from ranges of the slab that no live
//! allocation holds, and no planned entry is handed out after that. Deviations come from the
//! fallback chunks, allocations of the pool apart from the slab. At the scope's end every slab
//! range and every chunk is reclaimed (leaked buffers too); the boundary has ordered the pool's
//! stream after every stream that used them.

use steppool_sys::CUdeviceptr;

use super::free_ranges::FreeRanges;
use super::live::{FOREIGN, SlabAllocation};
use super::select::PREDICTION_SLACK;
use super::slab::{MAX_FALLBACK_CHUNK, Slab};
use super::{Entry, Plan, Planned};
use crate::error::{Error, Result};
use crate::source::Source;
use crate::strategy::Bin;
use crate::strategy::chunks::GRANULE;

/// How far ahead a size that does not match the next entry looks for its entry (allocations the
/// scope skipped); the entries jumped over are missing.
pub(super) const LOOKAHEAD: usize = 16;

/// A scope that goes online before this many allocations, or before the
/// [`NEW_SHAPE_SHARE`]th of its plan's entries, is a new shape (a plan matched by its first
/// sizes, left at a size that differs, or in the forward pass of a mixture of experts whose
/// routing varies), not a sequence that left its plan late, among the live entries the plan
/// placed ([`Planned::likely_carried`]).
pub(super) const NEW_SHAPE_PREFIX: usize = 16;

/// The share of its plan (a sixteenth) within which a scope that goes online is a new shape
/// ([`NEW_SHAPE_PREFIX`]).
pub(super) const NEW_SHAPE_SHARE: usize = 16;

/// The offset in the slab of entry `entry` of plan `index`: the plan's own, or its layout's
/// around the bin held.
#[inline]
pub(super) fn planned_offset(plans: &[Plan], bin: Option<Bin>, index: usize, entry: usize) -> u64 {
    match (&plans[index].binned, bin) {
        (Some(binned), Some(_)) => binned.offsets[entry],
        _ => plans[index].offsets[entry],
    }
}

/// Where a plan puts an allocation: at an offset in the slab, or at an address in the bin.
#[derive(Clone, Copy, Debug)]
pub(super) enum Placed {
    Slab(u64),
    Bin(CUdeviceptr),
}

impl Planned {
    /// Serves the rest of a scope without a plan from the slab's free ranges.
    pub(super) fn go_online(&mut self, slab: Slab) {
        // Nothing of the scope's own lives in the slab (what the scope before carried in aside):
        // its end is the range's wilderness, as in a first scope.
        let from_empty = self.slab_live.is_empty()
            && self.late.iter().all(|&late| self.carried_in_slab(slab).any(|carried| carried == late));
        let live = self
            .slab_live
            .iter()
            .map(|allocation| (allocation.ptr - slab.base, allocation.size))
            .chain(self.carried_in_slab(slab))
            .collect();
        self.slab_live.for_each_mut(|allocation| allocation.entry = FOREIGN);
        self.bin_live.for_each_mut(|allocation| allocation.entry = FOREIGN);
        self.late.clear();
        self.online = Some(FreeRanges { end_last: from_empty, ..FreeRanges::around(slab.size, live) });
        let planned = self.plan.map_or(0, |index| self.plans[index].sizes.len());
        self.online_early = (self.allocations as usize) < NEW_SHAPE_PREFIX.max(planned / NEW_SHAPE_SHARE);
        self.bin_free = self.bin.map(|bin| {
            FreeRanges::around(bin.len, self.bin_live.iter().map(|live| (live.ptr - bin.ptr, live.size)).collect())
        });
    }

    /// The scope's next allocation, of `size` (aligned), at its planned offset, where it is the
    /// plain case of a step that follows its plan: past the first sizes, on a recorded plan (not
    /// a predicted one) whose next entry holds it, in the slab as mapped, with no bin, no online
    /// serving, no guess to check and no holes, clear of the late list, and passing only planned
    /// frees that happened. Makes the decisions [`Planned::serve`] would make for it, and files
    /// the allocation as it would, without the checks of every other case; `None`, having
    /// changed nothing, where the case is another. The `steppool_planned` rows of
    /// `benches/alloc_latency.rs` measure it.
    #[inline(always)]
    pub(super) fn serve_following(&mut self, size: u64) -> Option<CUdeviceptr> {
        if (self.allocations as usize) < self.signature_len
            || self.template.is_some()
            || self.online.is_some()
            || self.bin.is_some()
            || self.guess_check
            || !self.holes.is_empty()
        {
            return None;
        }
        let (index, slab) = (self.plan?, self.slab?);
        let plan = &self.plans[index];
        let entry = self.cursor;
        if plan.predicted || entry >= plan.sizes.len() || plan.sizes[entry] < size {
            return None;
        }
        // A slab smaller than its plan is replaced first, unless it grows in place; a growable
        // one maps pages as the cursor reaches them, so the entry must lie in what is mapped.
        let offset = plan.offsets[entry];
        if (!slab.growable && slab.size < plan.bytes) || offset + size > slab.size || !self.clear_of_late(offset, size)
        {
            return None;
        }
        // The planned frees the cursor passes: each entry freed already, else the slow path
        // moves it to the late list.
        let start = plan.starts[entry];
        let mut passed = self.passed_ends;
        while let Some(&ended) = plan.by_end.get(passed)
            && plan.ends[ended as usize] < start
        {
            if self.entries[ended as usize] == Entry::Live {
                return None;
            }
            passed += 1;
        }
        self.passed_ends = passed;
        self.cursor = entry + 1;
        self.entries[entry] = Entry::Live;
        let ptr = slab.base + offset;
        self.slab_live.insert(SlabAllocation { ptr, index: self.allocations, entry: entry as u32, size });
        self.counters.planned += 1;
        Some(ptr)
    }

    /// Where the plan puts the next allocation of `size` (aligned), if it may serve it.
    #[inline]
    pub(super) fn next_planned(&mut self, size: u64) -> Option<Placed> {
        let index = self.plan?;
        let entry = self.cursor;
        let count = self.plans[index].sizes.len();
        // An allocation no larger than its entry is served at the entry's offset: the range is
        // the entry's, whatever part of it the allocation uses.
        if entry < count && self.plans[index].sizes[entry] >= size {
            // A predicted entry much larger than what is asked: the scope is not the sequence the
            // prediction read, and leaves the plan. (Small entries are predicted generously: a
            // size of a few hundred bytes agrees with every power.)
            let planned = self.plans[index].sizes[entry];
            if self.plans[index].predicted && planned > 2 * size + PREDICTION_SLACK {
                self.deviated = true;
                self.counters.deviations += 1;
                return None;
            }
            return self.hand_out(index, entry, size, false);
        }
        self.left_at_end |= !self.deviated && entry >= count;
        self.deviated = true;
        // Larger than its entry (a size that varies from scope to scope: routed tokens, a
        // ragged batch): at the entry's offset when the larger range is clear.
        if entry < count && self.in_bin(index, entry).is_none() {
            self.pass_ends(index, entry);
            if self.grown_range_clear(planned_offset(&self.plans, self.bin, index, entry), size) {
                return self.hand_out(index, entry, size, true);
            }
        }
        // Allocations the scope skipped: the entry further on with this size, if near (not in
        // a plan whose sizes vary: there a later entry of the same size is a coincidence).
        let end = if self.plans[index].varies { entry + 1 } else { count.min(entry + 1 + LOOKAHEAD) };
        let Some(found) = (entry + 1..end).find(|&e| self.plans[index].sizes[e] == size) else {
            if entry < count {
                // The entry, larger than planned, where its range is not clear.
                self.entries[entry] = Entry::Done;
                self.cursor = entry + 1;
            }
            // Otherwise an allocation the plan does not have: the cursor stays.
            self.counters.deviations += 1;
            return None;
        };
        self.entries[entry..found].fill(Entry::Done);
        self.counters.missing += (found - entry) as u64;
        self.hand_out(index, found, size, false)
    }

    /// Moves the entries the recording had freed before entry `entry` was allocated, and that
    /// are still live, to the late list.
    #[inline]
    pub(super) fn pass_ends(&mut self, index: usize, entry: usize) {
        let plan = &self.plans[index];
        let start = plan.starts[entry];
        while let Some(&passed) = plan.by_end.get(self.passed_ends) {
            if plan.ends[passed as usize] >= start {
                break;
            }
            if self.entries[passed as usize] == Entry::Live {
                self.entries[passed as usize] = Entry::Late;
                // An entry in the bin keeps clear of the slab's; a later one in the bin is
                // checked against every live one there (`hand_out`).
                let in_bin =
                    self.bin.is_some() && plan.binned.as_ref().is_some_and(|b| b.at[passed as usize].is_some());
                if !in_bin {
                    let offset = planned_offset(&self.plans, self.bin, index, passed as usize);
                    self.late.push((offset, self.plans[index].sizes[passed as usize]));
                }
            }
            self.passed_ends += 1;
        }
    }

    /// Whether `size` bytes at `offset`, past the entry's planned range, are in the slab and
    /// miss every live slab allocation: past its planned range the packing promises nothing.
    pub(super) fn grown_range_clear(&self, offset: u64, size: u64) -> bool {
        let Some(slab) = self.slab else { return false };
        let disjoint = |at: u64, len: u64| at + len <= offset || offset + size <= at;
        offset + size <= slab.size
            && self.late.iter().all(|&(late, len)| disjoint(late, len))
            && self.slab_live.iter().all(|allocation| disjoint(allocation.ptr - slab.base, allocation.size))
    }

    /// Entry `entry` of plan `index` for an allocation of `size`, if its range is clear: `grown`
    /// when the allocation is larger than the entry (the range was checked against every live
    /// allocation, and goes on the late list, so no later entry is handed out over it).
    #[inline]
    pub(super) fn hand_out(&mut self, index: usize, entry: usize, size: u64, grown: bool) -> Option<Placed> {
        self.cursor = entry + 1;
        self.pass_ends(index, entry);
        if let Some(ptr) = self.in_bin(index, entry) {
            // In the bin: clear of every allocation live there (one kept past its planned free
            // included); a grown entry never comes here (`next_planned`).
            let clear = self.bin_live.iter().all(|live| live.ptr + live.size <= ptr || ptr + size <= live.ptr);
            if !clear {
                self.entries[entry] = Entry::Done;
                self.deviated = true;
                self.counters.deviations += 1;
                return None;
            }
            self.entries[entry] = Entry::Live;
            return Some(Placed::Bin(ptr));
        }
        let fits = |offset: u64| self.slab.is_some_and(|slab| offset + size <= slab.size);
        let mut offset = planned_offset(&self.plans, self.bin, index, entry);
        if !(fits(offset) && self.clear_of_late(offset, size)) {
            // Its second place, if it has one and that is clear (both are the entry's for the
            // whole scope in the plan, so either serves).
            match self.second_place(index, entry, offset, size).filter(|&at| fits(at) && self.clear_of_late(at, size)) {
                Some(at) => offset = at,
                None => {
                    self.entries[entry] = Entry::Done;
                    self.deviated = true;
                    self.counters.deviations += 1;
                    return None;
                }
            }
        }
        if grown {
            self.entries[entry] = Entry::Late;
            self.late.push((offset, size));
        } else {
            self.entries[entry] = Entry::Live;
        }
        Some(Placed::Slab(offset))
    }

    /// The address in the bin of entry `entry` of plan `index`, where the plan has a layout for the
    /// bin held ([`Allocator::set_bin`](crate::strategy::Allocator::set_bin)) and puts the entry
    /// there.
    #[inline]
    pub(super) fn in_bin(&self, index: usize, entry: usize) -> Option<CUdeviceptr> {
        let bin = self.bin?;
        let at = self.plans[index].binned.as_ref()?.at[entry]?;
        Some(bin.ptr + at)
    }

    /// Whether `size` bytes at `offset` miss every range on the late list.
    #[inline]
    pub(super) fn clear_of_late(&self, offset: u64, size: u64) -> bool {
        self.late.iter().all(|&(late, len)| late + len <= offset || offset + size <= late)
    }

    /// The second place of entry `entry` of plan `index` (`Plan::alternates`), where it has one
    /// and its own, at `offset`, is taken by a range on the late list (the allocation of the
    /// entry carried in from the scope before).
    #[inline]
    pub(super) fn second_place(&self, index: usize, entry: usize, offset: u64, size: u64) -> Option<u64> {
        let alternates = &self.plans[index].alternates;
        if alternates.is_empty() || self.clear_of_late(offset, size) {
            return None;
        }
        alternates.iter().find(|&&(e, _)| e as usize == entry).map(|&(_, at)| at)
    }

    /// Serves `size` online and files it: in the bin when its smallest free range that holds the
    /// request is no larger than the slab's (the free range at a growable slab's end aside: it
    /// costs new pages), else in the slab ([`Planned::take_online`]).
    pub(super) fn serve_online(&mut self, source: &mut dyn Source, size: u64) -> Result<Option<CUdeviceptr>> {
        let index = self.allocations;
        if let (Some(bin), Some(bin_free), Some(online)) = (self.bin, &self.bin_free, &self.online)
            && let Some(&(len, _)) = bin_free.by_size.range((size, 0)..).next()
        {
            let growable_end = self.slab.filter(|slab| slab.growable).map(|slab| slab.size);
            let slab_best = online.by_size.range((size, 0)..).find(|&&(l, at)| Some(at + l) != growable_end);
            if slab_best.is_none_or(|&(slab_len, _)| len <= slab_len) {
                let at = self.bin_free.as_mut().and_then(|free| free.take(size, None)).expect("a range that holds it");
                let ptr = bin.ptr + at;
                self.bin_live.insert(SlabAllocation { ptr, index, entry: FOREIGN, size });
                if let Some(template) = &mut self.template {
                    template.in_bin.push(index);
                }
                return Ok(Some(ptr));
            }
        }
        let Some(offset) = self.take_online(source, size)? else { return Ok(None) };
        let ptr = self.slab.expect("an online scope has a slab").base + offset;
        self.slab_live.insert(SlabAllocation { ptr, index, entry: FOREIGN, size });
        Ok(Some(ptr))
    }

    /// Serves `size` online from the slab's free ranges, growing a growable slab at its end when
    /// none holds it (by what the free range at its end lacks, as an expandable segment grows).
    pub(super) fn take_online(&mut self, source: &mut dyn Source, size: u64) -> Result<Option<u64>> {
        let growable_end = self.slab.filter(|slab| slab.growable).map(|slab| slab.size);
        let lowest = self.made_again_while_carried() || self.likely_carried(size);
        let Some(online) = &mut self.online else { return Ok(None) };
        let taken = if lowest { online.take_lowest(size) } else { online.take(size, growable_end) };
        if let Some(offset) = taken {
            return self.fill_holes(source, offset, size);
        }
        let Some(slab) = self.slab.filter(|slab| slab.growable) else { return Ok(None) };
        if self.slab_refused {
            return Ok(None);
        }
        let online = self.online.as_mut().expect("an online scope");
        let tail =
            online.by_offset.iter().next_back().filter(|&(&at, &len)| at + len == slab.size).map_or(0, |(_, &len)| len);
        // As many freed pages go back as the slab is about to map.
        self.punch_freed(source, (size - tail).next_multiple_of(GRANULE))?;
        if !self.grow_slab(source, slab.size + (size - tail))? {
            return Ok(None);
        }
        let growable_end = self.slab.map(|slab| slab.size);
        match self.online.as_mut().and_then(|online| online.take(size, growable_end)) {
            Some(offset) => self.fill_holes(source, offset, size),
            None => Ok(None),
        }
    }

    /// Serves the scope's next allocation: at its planned offset, else from the pool.
    pub(super) fn serve(&mut self, source: &mut dyn Source, size: u64) -> Result<CUdeviceptr> {
        if self.unmoved.is_some() && self.allocations == 0 {
            self.move_or_stay(source)?;
        }
        // A plan larger than the slab (one that has not served recently) takes a larger slab of
        // the pool. A growable slab is not mapped for the whole plan here: the entries map it as
        // the cursor reaches them (below), so a scope holds the pages its plan has reached.
        let need = self.plan.map_or(0, |p| self.plans[p].bytes);
        // A scope that starts from its plan on pages an earlier scope left mapped: those past
        // what the plan needs go back first (a bin lent at the boundary may end its slab lower).
        // Not from a predicted plan: a new shape keeps the pages the recent plans need, as one
        // served best-fit does, so that steps of lengths within the recent ones map nothing.
        if self.allocations == 0
            && let (Some(index), Some(slab)) = (self.plan, self.slab.filter(|slab| slab.growable))
            && !self.plans[index].predicted
            && self.slab_live.is_empty()
            && self.late.is_empty()
        {
            let needs = self.slab_bytes(&self.plans[index]);
            if slab.size > needs.next_multiple_of(GRANULE) {
                self.shrink_slab(source, needs)?;
            }
        }
        if need > 0 && self.slab.is_none_or(|slab| slab.size < need) && !self.growable_slab(source)? {
            let desired = need.max(self.desired_slab());
            self.ensure_slab(source, desired)?;
        }
        // Holes left between scopes (pages under memory carried into the scope could not be
        // mapped again at its start): no plan promises a hand-out there is mapped, so the scope
        // is served online, which maps a hole before handing it out.
        if self.online.is_none()
            && !self.holes.is_empty()
            && let Some(slab) = self.slab
        {
            self.deviated |= self.plan.is_some();
            self.go_online(slab);
        }
        // A scope with no plan from its first allocation, nothing mapped (a first scope, or one
        // after the slab went back): recorded best-fit in a growable slab, which maps pages at its
        // end as the scope needs them and gives back its free pages as the scope runs (see
        // `punch_freed`), rather than in fallback chunks.
        if self.plan.is_none()
            && self.online.is_none()
            && self.allocations == 0
            && !self.slab_refused
            && self.slab.is_none_or(|slab| slab.size == 0)
            && self.growable_slab(source)?
            && let Some(slab) = self.slab
        {
            self.go_online(slab);
        }
        if let (None, None, Some(slab)) = (self.plan, &self.online, self.slab.filter(|slab| slab.size > 0)) {
            if self.slab_live.is_empty() && self.late.is_empty() {
                // A new shape from its first allocation, the slab empty: the slab goes back and
                // the scope is recorded in chunks, like a first step, rather than best-fit in the
                // free ranges of a slab packed for another shape (an evaluation pass after
                // training steps: its large buffers fit none of the training plan's holes, and
                // the slab and the chunks would both be held). The stream is waited for so the
                // trim returns the slab to the device before the chunks are taken.
                //
                // A growable slab has no such cost: the new shape is served best-fit from its
                // start (nothing lives in it, so there are no holes), pages are mapped at its end
                // as the scope needs them, free ones inside go back when it maps more (see
                // `punch_freed`), and the slab ends the scope sized by the new plan.
                if slab.growable {
                    self.go_online(slab);
                } else {
                    self.slab = None;
                    self.online = None;
                    source.free(slab.base, slab.size)?;
                    source.synchronize()?;
                    source.trim_to(0)?;
                }
            } else {
                self.go_online(slab);
            }
        }
        if self.guess_check {
            self.check_guess();
        }
        if self.online.is_some()
            && let Some(ptr) = self.serve_online(source, size)?
        {
            self.counters.unplanned += 1;
            return Ok(ptr);
        }
        // Once online, the plan's offsets promise nothing: the slab is full, the chunks serve.
        // Without a slab (refused for lack of memory, or lost to a failed call) the plan cannot
        // serve: the scope deviates and the chunks serve.
        if let (false, Some(slab), Some(index)) = (self.online.is_some(), self.slab, self.plan)
            && slab.growable
            && self.cursor < self.plans[index].offsets.len()
            && self.in_bin(index, self.cursor).is_none()
        {
            // An entry past the end of what is mapped (the plan's cursor reaching pages not mapped
            // yet, or an entry larger than planned): the slab grows to hold it, at its second
            // place where its own is taken.
            let offset = planned_offset(&self.plans, self.bin, index, self.cursor);
            let at = self.second_place(index, self.cursor, offset, size).unwrap_or(offset);
            if at + size > slab.size {
                self.grow_slab(source, at + size)?;
            }
        }
        let planned = match (self.online.is_some(), self.slab) {
            (false, Some(slab)) => self.next_planned(size).map(|offset| (slab, offset)),
            (false, None) if self.plan.is_some() => {
                self.deviated = true;
                None
            }
            _ => None,
        };
        match planned {
            Some((slab, placed)) => {
                let entry = self.cursor as u32 - 1;
                let ptr = match placed {
                    Placed::Slab(offset) => {
                        let ptr = slab.base + offset;
                        self.slab_live.insert(SlabAllocation { ptr, index: self.allocations, entry, size });
                        ptr
                    }
                    Placed::Bin(ptr) => {
                        self.bin_live.insert(SlabAllocation { ptr, index: self.allocations, entry, size });
                        ptr
                    }
                };
                self.counters.planned += 1;
                Ok(ptr)
            }
            None => {
                self.counters.unplanned += 1;
                // The plan failed this scope (a size larger than its entry where the range is
                // not clear, an allocation it lacks): the rest of the scope is served best-fit
                // from the slab's free ranges, then the fallback chunks, so a scope that leaves
                // its plan holds the slab and little beside it, not the slab and a second copy
                // of itself in chunks.
                if let Some(slab) = self.slab.filter(|slab| slab.size > 0) {
                    self.go_online(slab);
                    if let Some(ptr) = self.serve_online(source, size)? {
                        return Ok(ptr);
                    }
                }
                match self.allocate_from_pool(source, size) {
                    // The pool cannot place a chunk (the device is full, or its free memory is in
                    // pieces): the scope goes on best-fit in a growable slab, whose pages need no
                    // contiguous memory.
                    Err(Error::Driver(error))
                        if error.is_out_of_memory() && !self.slab_refused && self.growable_slab(source)? =>
                    {
                        let slab = self.slab.expect("a growable slab");
                        if self.online.is_none() {
                            self.go_online(slab);
                        }
                        match self.serve_online(source, size)? {
                            Some(ptr) => Ok(ptr),
                            None => Err(Error::Driver(error)),
                        }
                    }
                    other => other,
                }
            }
        }
    }

    /// Serves an allocation the slab does not from the fallback chunks. A chunk is a sixteenth
    /// of what the pool holds for the scope (the slab and the chunks), at least a granule, so a
    /// scope that outgrows the slab takes few chunks and the last one, mostly unused at the
    /// scope's peak, is small beside it. A request smaller than the granule takes a chunk of as
    /// many requests (one to four times as many as the chunk holds) as leave the least of the
    /// granule unused: four 1.5 MiB requests fill 6 MiB, where one alone leaves a quarter of
    /// 2 MiB.
    pub(super) fn allocate_from_pool(&mut self, source: &mut dyn Source, size: u64) -> Result<CUdeviceptr> {
        let held = self.slab.map_or(0, |slab| slab.size) + self.fallback.held();
        let mut chunk = (held / 16).clamp(GRANULE, MAX_FALLBACK_CHUNK);
        if size < GRANULE {
            let fewest = (chunk / size).max(1);
            let len = |count: u64| (count * size).next_multiple_of(GRANULE);
            let unused = |count: u64| len(count) - count * size;
            // The least unused per byte of chunk, the fewest requests on ties.
            let count = (fewest..=4 * fewest)
                .min_by(|&a, &b| (unused(a) * len(b)).cmp(&(unused(b) * len(a))).then(a.cmp(&b)))
                .unwrap_or(fewest);
            chunk = count * size;
        }
        let ptr = self.fallback.alloc(source, size, chunk)?;
        self.pooled.insert(ptr, self.allocations);
        Ok(ptr)
    }
}
